"""What every torchrun script of tests/dist does last: write this rank's result, leave the group together."""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path

import torch
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


class UserTraffic(threading.Thread):
    """While a step runs, the user's own all-reduces on the default group, from another thread (each checked):
    ours must never pair with them, in whatever order the two threads issue theirs on each rank."""

    CALLS = 8  # each rank's thread issues as many (a collective every rank calls)

    def __init__(self, rank: int, world: int):
        super().__init__(daemon=True)
        self.rank, self.world, self.calls, self.error = rank, world, 0, None

    def run(self) -> None:
        try:
            for _ in range(self.CALLS):
                t = torch.full((1000,), float(self.rank + 1))
                dist.all_reduce(t)
                assert torch.all(t == self.world * (self.world + 1) / 2), f"the user's all-reduce got {t[:4]}"
                self.calls += 1
                time.sleep(0.002)  # spread over the step
        except Exception as exc:  # noqa: BLE001 - raised in the main thread
            self.error = exc

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.join(timeout=120)
        if self.error is not None:
            raise AssertionError(f"rank {self.rank}: the user's thread failed: {self.error}")
