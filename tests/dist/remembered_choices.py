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
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import assert_same_state, train_step  # noqa: E402
from models import MLP  # noqa: E402


def one_run(rank: int) -> str:
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_d = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    step = spmd_ort.compile()(train_step)
    g = torch.Generator().manual_seed(10 + rank)
    for i in range(3):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = step(model, opt, x, y)
        loss_d = train_step(ddp, opt_d, x, y)
        torch.testing.assert_close(loss, loss_d.detach(), rtol=1e-5, atol=1e-6)
        assert_same_state(ddp.module, model, opt_d, opt, where=f"rank {rank} step {i}", normwise=True)
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
