"""Run under torchrun (2 ranks): an index out of range on one rank only fails on every rank, at once.

    torchrun --nproc_per_node=2 tests/dist/bad_index.py --out DIR

A GPT (embedding ids, cross-entropy targets) under replicate and fully_shard, fx and ORT: after a good
step, rank 1 passes an embedding id of -1.  Every rank must raise spmd_ort.InputIndexError naming rank
1's input (not wait for rank 1 in a collective until the process group's timeout), with this rank's
parameters and optimizer state as they were; a good step after it must run.  Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from empty_batch import local_state, same  # noqa: E402
from helpers import train_step  # noqa: E402
from models import GPT, GPTConfig, gpt_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(vocab=67, d=27, heads=3, layers=1)
    result: dict = {"rank": rank}
    for style in ("replicate", "fully_shard"):
        for backend in ("fx", "ort"):
            torch.manual_seed(0)
            model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            step = spmd_ort.compile(backend=backend, parallel_mode=spmd_ort.DataParallel(parallel_style=style))(
                train_step)
            g = torch.Generator().manual_seed(rank)
            step(model, opt, *gpt_batch(cfg, 4, g))
            x, y = gpt_batch(cfg, 4, g)
            if rank == 1:
                x[1, 3] = -1
            before = local_state(model, opt)
            t0 = time.perf_counter()
            try:
                step(model, opt, x, y)
                error, kind = None, None
            except Exception as exc:  # noqa: BLE001 - the test reads what was raised
                error, kind = str(exc), type(exc).__name__
            seconds = time.perf_counter() - t0
            unchanged = same(before, local_state(model, opt))
            step(model, opt, *gpt_batch(cfg, 4, g))  # a good step: nobody hangs
            result[f"{style}-{backend}"] = {"error": error, "type": kind, "seconds": seconds, "unchanged": unchanged}
    finish(args.out, result)


if __name__ == "__main__":
    main()
