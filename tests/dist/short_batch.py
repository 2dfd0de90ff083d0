"""Run under torchrun (2 ranks): a rank's short last batch (batch size 1, a shorter sequence) trains as DDP trains it.

    torchrun --standalone --nproc_per_node=2 tests/dist/short_batch.py --style replicate --backend fx --out DIR

Both ranks pass (4, 16) token batches at the first step (one static program); at the second, rank 1 passes the
short last batch of its epoch, (1, 9), while rank 0 passes (4, 16); at the third, rank 0 passes sequences of
length 1, (3, 1), and rank 1 (2, 16); sizes of 1 again at the fifth and sixth steps, which ORT runs alone (a
segment's first three sets of sizes are checked against fx, whose outputs the step uses).  torch specialises
sizes 1, so a symbolic program traced for the others would not serve rank 1, and every rank must run the same
program (the same collectives): the dims that differ become symbolic with size 1 included (traced
size-obliviously), one more program that serves every later step.  Before, every rank raised "ranks disagree on
this step's inputs".  A DDP model trains on the same local batches (each rank's loss its local mean, gradients
averaged over the ranks); after every step the loss, the parameters and the AdamW state equal DDP's (fx: bit for
bit; ORT: helpers' RTOL of each tensor's largest element).  The step zeroes the gradients last, so no step
re-traces for them.  Writes DIR/rank<r>.json: traces, symbolic dims, describe(), the ORT report.
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
from helpers import RTOL, assert_close_relmax, ort_report  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=2, layers=1)
# (batch, length) per step, per rank
SIZES = [[(4, 16), (4, 16), (3, 1), (2, 12), (1, 5), (4, 3)],
         [(4, 16), (1, 9), (2, 16), (3, 7), (4, 16), (1, 1)]]


def step_fn(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def make_opt(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)  # the kernel the compiled step runs


def values(model, opt) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state, unsharded (collective under fully_shard)."""
    full = spmd_ort.full_state_dict(model, opt, rank0_only=False)
    out = {f"param {n}": full["model"][n] for n, _ in model.named_parameters()}
    for i, st in full["optim"]["state"].items():
        out.update((f"state {i}.{k}", v) for k, v in st.items())
    return out


def check(backend: str, got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    if backend == "fx":  # DDP's kernels, fused AdamW included, and DDP's averaging
        assert torch.equal(got, want), f"{msg}: max |diff| {(got - want).abs().max().item():.3g}"
    else:
        assert_close_relmax(got, want, rtol=RTOL, msg=msg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--style", choices=("replicate", "fully_shard"), default="replicate")
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = GPT(CFG)
    ddp = DDP(copy.deepcopy(base))
    opt_ref = make_opt(ddp.parameters())
    model = copy.deepcopy(base)
    opt = make_opt(model.parameters())
    step = spmd_ort.compile(backend=args.backend,
                            # a fixed cap (several buckets): "auto" would re-trace once it has measured steps
                            parallel_mode=spmd_ort.DataParallel(parallel_style=args.style, bucket_cap_mb=0.05))(step_fn)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for i, (b, length) in enumerate(SIZES[rank]):
        x = torch.randint(0, CFG.vocab, (b, length), generator=g)
        y = torch.randint(0, CFG.vocab, (b, length), generator=g)
        ref = step_fn(ddp, opt_ref, x, y).detach()
        loss = step(model, opt, x, y)
        check(args.backend, loss, ref, f"rank {rank} step {i} loss")
        want, got = values(ddp.module, opt_ref), values(model, opt)
        assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
        for name, w in want.items():
            check(args.backend, got[name], w, f"rank {rank} step {i} {name}")
        losses.append(float(loss))
    finish(args.out, {"rank": rank, "losses": losses, "traces": step.transitions.traces,
                      "dynamic": step.dynamic.describe(), "describe": step.compiled.describe(),
                      "ort": ort_report(step)})


if __name__ == "__main__":
    main()
