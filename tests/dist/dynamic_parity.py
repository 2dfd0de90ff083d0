"""Run under torchrun: ranks with different sequence lengths and batch sizes every step, vs torch DDP.

    torchrun --standalone --nproc_per_node=2 tests/dist/dynamic_parity.py --backend fx --out DIR

Every step each rank draws its own batch size and sequence length (as a dynamic-padding
loader does), so ranks differ from each other and from step to step.  A DDP model, a
compiled ``replicate`` model and a compiled ``fully_shard`` model train on the same
local batches; loss and full parameters are compared with DDP's after every step
(DDP averages the ranks' gradients whatever their batch sizes, and so do both
compiled styles).  The loss is multiplied by a Python float that changes every step and
differs between ranks (lifted to a graph input, like the sizes).  Writes DIR/rank<r>.json
with the traces and the dims that went symbolic.
"""

from __future__ import annotations

import argparse
import copy
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
from helpers import ort_report  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab=64, seq=24, d=32, heads=2, layers=2)
# (batch, length) per step, per rank: rank 0 and rank 1 differ at every step but the first
SIZES = [[(4, 16), (4, 12), (3, 20), (4, 9), (2, 24), (4, 16)],
         [(4, 16), (3, 10), (4, 13), (2, 17), (4, 5), (3, 11)]]


def step_fn(model, opt, x, y, scale):
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten()) * scale
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def full_params(model) -> dict[str, torch.Tensor]:
    with spmd_ort.gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(args, rank: int) -> dict:
    torch.manual_seed(0)
    base = GPT(CFG)
    ddp = DDP(copy.deepcopy(base))
    opt_ref = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1)
    runs = {}
    for style in ("replicate", "fully_shard"):
        model = copy.deepcopy(base)
        mode = spmd_ort.DataParallel(parallel_style=style, bucket_cap_mb=0.05)
        runs[style] = (model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                       spmd_ort.compile(parallel_mode=mode, backend=args.backend)(step_fn))
    g = torch.Generator().manual_seed(100 + rank)
    out: dict = {"rank": rank, "losses": []}
    for i, (b, length) in enumerate(SIZES[rank]):
        x = torch.randint(0, CFG.vocab, (b, length), generator=g)
        y = torch.randint(0, CFG.vocab, (b, length), generator=g)
        scale = 1.0 + (i + 1) * (0.1 if rank == 0 else -0.05)
        ref = step_fn(ddp, opt_ref, x, y, scale)
        want = {n: p.detach() for n, p in ddp.module.named_parameters()}
        losses = {}
        for style, (model, opt, step) in runs.items():
            loss = step(model, opt, x, y, scale)
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {style} step {i} loss: {m}")
            got = full_params(model)
            for name, w in want.items():
                torch.testing.assert_close(got[name], w, rtol=1e-4, atol=2e-6,
                                           msg=lambda m: f"rank {rank} {style} step {i} {name}: {m}")
            losses[style] = float(loss)
        out["losses"].append(losses)
    out["traces"] = {style: r[2].transitions.traces for style, r in runs.items()}
    out["dynamic"] = {style: r[2].dynamic.describe() for style, r in runs.items()}
    out["symbolic"] = {style: r[2].compiled.symbolic is not None for style, r in runs.items()}
    out["ort"] = {style: ort_report(r[2]) for style, r in runs.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = run(args, rank)
    finish(args.out, result)


if __name__ == "__main__":
    main()
