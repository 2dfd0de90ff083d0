"""Run under torchrun (2 ranks): a batch that is empty on one rank only fails on every rank, naming the rank.

    torchrun --nproc_per_node=2 tests/dist/empty_batch.py --out DIR

For replicate, fully_shard and replicate with dynamic shapes off: rank 1 passes an empty
batch on the first call, then (after a good step) again.  Both times every rank must raise
a CompileError that names rank 1 and the input `x` and says what to do, instead of a raw
difference of the ranks' keys, and leave this rank's parameters, gradients and optimizer
state as they were (unsharded after the first); a good step after each failure must run
(no rank hangs).  Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import train_step  # noqa: E402
from models import MLP  # noqa: E402
from spmd_ort.distributed.sharding import is_sharded  # noqa: E402


def local_state(model, opt) -> dict:
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"g:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for i, st in enumerate(opt.state.values()):
        out.update({f"s:{i}:{k}": v.clone() for k, v in st.items()})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    for label, style, dynamic in (("replicate", "replicate", None), ("fully_shard", "fully_shard", None),
                                  ("static", "replicate", False)):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = spmd_ort.compile(backend="fx", dynamic=dynamic,
                                parallel_mode=spmd_ort.DataParallel(parallel_style=style))(train_step)
        seen = []
        for attempt in ("first call", "later call"):
            rows = 0 if rank == 1 else 8
            before = local_state(model, opt)
            try:
                step(model, opt, torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
                error = None
            except spmd_ort.CompileError as exc:
                error = str(exc)
            unchanged = same(before, local_state(model, opt))
            unsharded = not is_sharded(model)
            step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))  # a good step: nobody hangs
            seen.append({"attempt": attempt, "error": error, "unchanged": unchanged,
                         "unsharded": unsharded if attempt == "first call" else True})
        result[label] = seen
    finish(args.out, result)


if __name__ == "__main__":
    main()
