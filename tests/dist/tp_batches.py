"""Run under torchrun (2 ranks): tensor-parallel ranks that pass different batches fail on every rank, naming them.

    torchrun --standalone --nproc_per_node=2 tests/dist/tp_batches.py --out DIR

The ranks of a tensor-parallel group compute one model on one batch; a data loader that shards over them gives
each rank another one, and eager tensor parallelism (and the compiled step, before) trained on the mix silently.
A two-layer MLP LM under ``TensorParallel`` (fc1 column-wise, fc2 row-wise) is called with:

* ``values``: the same shapes, other tokens on rank 1 (the checksums the ranks exchange at a program's first call);
* ``shapes``: a shorter sequence on rank 1 (the ranks' agreement on the step's inputs, before any trace);

then with the same batch on both ranks, which must train (nobody hangs, the plan applies again).  Each failure
must raise spmd_ort's error naming the input and the ranks on every rank, and leave the module's parameters (the
plan undone: plain tensors again) and the optimizer as they were.  Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402

VOCAB, DIM = 32, 16


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(ids)))))


def step_fn(model, opt, ids, labels):
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def snapshot(model, opt) -> dict:
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"s:{i}:{k}": v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = spmd_ort.compile(backend=args.backend, parallel_mode=spmd_ort.TensorParallel(
        {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}))(step_fn)
    g = torch.Generator().manual_seed(0)  # the same batch on every rank ...
    ids, labels = torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)
    for case in ("values", "shapes"):
        bad = ids.clone()
        if rank == 1:  # ... but for rank 1's
            bad = (bad + 1) % VOCAB if case == "values" else bad[:, :6].contiguous()  # (only its sizes differ)
        before = snapshot(model, opt)
        try:
            step(model, opt, bad, labels if bad.shape == labels.shape else labels[:, :bad.shape[1]].contiguous())
            error, kind = None, None
        except spmd_ort.CompileError as exc:
            error, kind = str(exc), type(exc).__name__
        after = snapshot(model, opt)
        result[case] = {"error": error, "type": kind,
                        "unchanged": before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                                           for k in before),
                        "plain": not any(isinstance(p, DTensor) for p in model.parameters())}
    loss = step(model, opt, ids, labels)  # the same batch: trains
    result["loss"] = float(loss)
    result["sharded"] = isinstance(model.fc1.weight, DTensor)
    finish(args.out, result)


if __name__ == "__main__":
    main()
