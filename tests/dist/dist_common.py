"""What every torchrun script of tests/dist does last: write this rank's result, leave the group together."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch.distributed as dist


def finish(out: str | Path, result: dict, name: str | None = None) -> None:
    """Write ``result`` to ``out/<name>`` (default ``rank<r>.json``), then barrier and destroy the process group.

    Objects holding collectives (DDP's reducer, pending work) are collected first, so they die before the
    process group does.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / (name or f"rank{dist.get_rank()}.json")).write_text(json.dumps(result, indent=1))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
