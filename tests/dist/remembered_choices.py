"""Run under torchrun: the automatic choice remembered across runs, each rank with a cache of its own.

    torchrun --standalone --nproc_per_node=2 tests/dist/remembered_choices.py --out DIR

Three runs of the same compiled step in turn (a fresh compile each, ``DataParallel``, the default backend),
each trained 3 steps against DDP on the rank's batch (loss and every parameter and optimizer state, per
tensor).  Run 1 writes each rank's entry, run 2 recalls it on both ranks; before run 3 rank 1's entry is
damaged, so that the ranks hold different entries and both measure afresh.  Rank 0 prints
``remembered choices: <run 1> | <run 2> | <run 3>``, each run as every rank's ``fresh`` or ``recalled``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish, mlp_against_ddp  # noqa: E402


def one_run(rank: int) -> str:
    step = mlp_against_ddp(rank)
    return "recalled" if step.compiled.executor.remembered.recalled else "fresh"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cache = Path(args.out) / f"cache{rank}"
    os.environ.update(SPMD_ORT_CACHE_DIR=str(cache), SPMD_ORT_REMEMBER_CHOICES="1")
    runs = []
    for run in range(3):
        if run == 2 and rank == 1:
            for entry in (cache / "choices").glob("*.json"):
                entry.write_text("{}")
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, one_run(rank))
        runs.append(" ".join(seen))
    if rank == 0:
        print("remembered choices: " + " | ".join(runs), flush=True)
    finish(args.out, {"runs": runs})


if __name__ == "__main__":
    main()
