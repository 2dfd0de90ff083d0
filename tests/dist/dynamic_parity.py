"""Run under torchrun: ranks with different sequence lengths and batch sizes every step, vs torch DDP.

    torchrun --standalone --nproc_per_node=2 tests/dist/dynamic_parity.py --backend fx --out DIR
    torchrun --standalone --nproc_per_node=2 tests/dist/dynamic_parity.py --backend fx,ort --out DIR

Every step each rank draws its own batch size and sequence length (as a dynamic-padding
loader does), so ranks differ from each other and from step to step.  A DDP model, a
compiled ``replicate`` model and a compiled ``fully_shard`` model train on the same
local batches (DDP averages the ranks' gradients whatever their batch sizes, and so do both
compiled styles).  The loss is multiplied by a Python float that changes every step and
differs between ranks (lifted to a graph input, like the sizes).  After every step the loss
and the full parameters, gradients and AdamW state are compared with DDP's (tolerances at
:func:`check`).  Writes DIR/rank<r>.json with the traces, the dims that went symbolic and
where torchrun placed the process (tests/test_multinode.py launches it on two "nodes"); with several backends
(``--backend fx,ort``: one after the other in one launch, each with its own models), ``{backend: that}``.
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
from helpers import RTOL, assert_close_relmax, ort_report  # noqa: E402
from spmd_ort.distributed.sharding import spec_of  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab=64, seq=24, d=32, heads=2, layers=2)
# (batch, length) per step, per rank: rank 0 and rank 1 differ at every step but the first
SIZES = [[(4, 16), (4, 12), (3, 20), (4, 9), (2, 24), (4, 16)],
         [(4, 16), (3, 10), (4, 13), (2, 17), (4, 5), (3, 11)]]


def step_fn(model, opt, x, y, scale):
    opt.zero_grad()  # first, so that the step's gradients are there to compare after it
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten()) * scale
    loss.backward()
    opt.step()
    return loss


def make_opt(params) -> torch.optim.Optimizer:
    """Fused on every side: the kernel the compiled step runs, so no difference comes from a kernel choice."""
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


def full_values(model, opt) -> dict[str, torch.Tensor]:
    """Every compared value, unsharded (collective under fully_shard): parameters, gradients, AdamW state."""
    full = spmd_ort.full_state_dict(model, opt, rank0_only=False)
    out = {f"param {n}": full["model"][n] for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        spec = spec_of(p)
        out[f"grad {n}"] = p.grad.detach().clone() if spec is None else p.grad.full_tensor()  # (Shard(0) DTensor)
    for i, st in full["optim"]["state"].items():
        out.update((f"state {i}.{k}", v) for k, v in st.items())
    return out


def check(backend: str, got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """fx: bit for bit (it runs DDP's kernels, fused AdamW included, and averages gradients as DDP does:
    every value of every step was equal on both ranks and styles when measured).  ORT rounds differently:
    over the 6 steps the largest differences were 1.3e-7 (parameters), 6.4e-7 (gradients) and 6.6e-7
    (moments) of each tensor's largest element, so helpers' RTOL (1e-5) relative to it leaves a 15x margin
    (the suite's ORT comparison elsewhere is normwise, looser)."""
    if backend == "fx":
        assert torch.equal(got, want), f"{msg}: max |diff| {(got - want).abs().max().item():.3g}"
    else:
        assert_close_relmax(got, want, rtol=RTOL, msg=msg)


def run(backend: str, rank: int) -> dict:
    torch.manual_seed(0)
    base = GPT(CFG)
    ddp = DDP(copy.deepcopy(base))
    opt_ref = make_opt(ddp.parameters())
    runs = {}
    for style in ("replicate", "fully_shard"):
        model = copy.deepcopy(base)
        mode = spmd_ort.DataParallel(parallel_style=style, bucket_cap_mb=0.05)
        runs[style] = (model, make_opt(model.parameters()),
                       spmd_ort.compile(parallel_mode=mode, backend=backend)(step_fn))
    g = torch.Generator().manual_seed(100 + rank)
    placed = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    out: dict = {"rank": rank, "losses": [], "torchrun": {k: os.environ.get(k) for k in placed}}
    for i, (b, length) in enumerate(SIZES[rank]):
        x = torch.randint(0, CFG.vocab, (b, length), generator=g)
        y = torch.randint(0, CFG.vocab, (b, length), generator=g)
        scale = 1.0 + (i + 1) * (0.1 if rank == 0 else -0.05)
        ref = step_fn(ddp, opt_ref, x, y, scale).detach()
        want = full_values(ddp.module, opt_ref)
        losses = {}
        for style, (model, opt, step) in runs.items():
            loss = step(model, opt, x, y, scale)
            check(backend, loss, ref, f"rank {rank} {style} step {i} loss")
            got = full_values(model, opt)
            assert got.keys() == want.keys(), (style, i, sorted(got.keys() ^ want.keys()))
            for name, w in want.items():
                check(backend, got[name], w, f"rank {rank} {style} step {i} {name}")
            losses[style] = float(loss)
        out["losses"].append(losses)
    out["traces"] = {style: r[2].transitions.traces for style, r in runs.items()}
    out["dynamic"] = {style: r[2].dynamic.describe() for style, r in runs.items()}
    out["symbolic"] = {style: r[2].compiled.symbolic is not None for style, r in runs.items()}
    out["ort"] = {style: ort_report(r[2]) for style, r in runs.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="fx", help="fx, ort, or several (fx,ort): one after the other")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backends = args.backend.split(",")
    results = {backend: run(backend, rank) for backend in backends}
    finish(args.out, results if len(backends) > 1 else results[backends[0]])


if __name__ == "__main__":
    main()
