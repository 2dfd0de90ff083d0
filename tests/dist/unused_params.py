"""Run under torchrun: an MoE expert that gets no tokens on some ranks and steps, against DDP and eager.

    torchrun --standalone --nproc_per_node=2 tests/dist/unused_params.py --out DIR [--backend fx|ort]

``RoutedMoENet`` (its MoE runs opaquely) trains with fused AdamW (weight decay 0.1), zeroing
gradients at the start of each step, so ``.grad`` after a step is what backward and the
reduction left.  Per step, which ranks' batches give expert 3 no token (:data:`SCHEDULE`):
both (also on the first step, whose state the compiled step creates before tracing), one of
them, none.

Every rank starts from the same weights (taking rank 0's is tested elsewhere), so what a step moved is
what it did.

* ``replicate``: the compiled step vs ``DDP(find_unused_parameters=True)`` on each rank's batch:
  loss, every parameter, gradient (None where DDP leaves None) and the optimizer state,
  elementwise (assert_same_state), on every rank and step.
* ``fully_shard``: vs single-process eager on the global batch (where a rank's batch has no
  token for the expert, the global batch may still have some): loss and every full parameter
  and optimizer state.

What DDP did to expert 3 on each step (grad None or not, moved or not, state or not) is
written to DIR/rank<r>.json next to what the compiled steps did, with the WARNING the
fully_shard compile logs.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import assert_close_normwise, assert_same_state  # noqa: E402
from models import RoutedMoENet, starve  # noqa: E402

EXPERT = 3
# per step: the ranks whose batch gives expert 3 no token
SCHEDULE = ({0, 1}, {1}, set(), {0, 1}, {0}, set())
ROWS = 8  # per rank


def step_fn(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def global_batch(i: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(ROWS * world, 16, generator=g)
    y = torch.randint(0, 10, (ROWS * world,), generator=g)
    for r in range(world):
        rows = slice(r * ROWS, (r + 1) * ROWS)
        if r in SCHEDULE[i]:
            x[rows] = starve(x[rows], EXPERT)
        else:
            x[r * ROWS, EXPERT] = 5.0  # at least one token for the expert on this rank
    return x, y


def expert_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if n.startswith(f"moe.experts.{EXPERT}.")}


def observe(model, opt, before: dict) -> dict:
    """What the step did to expert 3: gradient None or not, how far it moved, whether it has optimizer state."""
    params = expert_params(model)
    return {"grad_none": all(p.grad is None for p in params.values()),
            "moved": max((p.detach() - before[n]).abs().max().item() for n, p in params.items()),
            "has_state": all(len(opt.state.get(p, {})) > 0 for p in params.values())}


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in expert_params(model).items()}


def replicate(rank: int, world: int, backend: str) -> dict:
    torch.manual_seed(0)  # the same weights everywhere, so "moved" below is what the steps did
    base = RoutedMoENet()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    model = copy.deepcopy(base)
    opt_ref, opt = make_opt(ddp.parameters()), make_opt(model.parameters())
    step = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(), backend=backend)(step_fn)
    out = {"ddp": [], "compiled": []}
    for i in range(len(SCHEDULE)):
        x, y = global_batch(i, world)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        before_ref, before = snapshot(ddp.module), snapshot(model)
        ref = step_fn(ddp, opt_ref, x[mine], y[mine])
        loss = step(model, opt, x[mine], y[mine])
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        assert_same_state(ddp.module, model, opt_ref, opt, where=f"rank {rank} step {i}", normwise=backend == "ort")
        out["ddp"].append(observe(ddp.module, opt_ref, before_ref))
        out["compiled"].append(observe(model, opt, before))
    out["traces"] = step.transitions.traces
    return out


def fully_shard(rank: int, world: int, backend: str) -> dict:
    torch.manual_seed(0)
    reference = RoutedMoENet()  # trained eagerly on the global batch
    model = copy.deepcopy(reference)
    opt_ref, opt = make_opt(reference.parameters()), make_opt(model.parameters())
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("spmd_ort").addHandler(handler)
    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    step = spmd_ort.compile(parallel_mode=mode, backend=backend)(step_fn)
    out = {"eager": [], "compiled": []}
    for i in range(len(SCHEDULE)):
        x, y = global_batch(i, world)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        before_ref = snapshot(reference)
        with spmd_ort.gathered_parameters(model):
            before = snapshot(model)
        ref = step_fn(reference, opt_ref, x, y).detach()
        loss = step(model, opt, x[mine], y[mine]).detach().clone()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / world, ref, rtol=1e-5, atol=1e-6)
        full = spmd_ort.full_state_dict(model, opt, rank0_only=False)
        for name, want in reference.state_dict().items():
            assert_close_normwise(full["model"][name], want, msg=f"rank {rank} step {i} {name}")
        ref_state = opt_ref.state_dict()["state"]
        assert sorted(full["optim"]["state"]) == sorted(ref_state), (i, sorted(full["optim"]["state"]))
        for k, st in ref_state.items():
            for key, want in st.items():
                assert_close_normwise(full["optim"]["state"][k][key], want, atol=0.0,
                                      msg=f"rank {rank} step {i} state {k}.{key}")
        out["eager"].append(observe(reference, opt_ref, before_ref))
        with spmd_ort.gathered_parameters(model):
            moved = max((p.detach() - before[n]).abs().max().item() for n, p in expert_params(model).items())
        out["compiled"].append({"grad_none": all(p.grad is None for p in expert_params(model).values()),
                                "moved": moved})
    logging.getLogger("spmd_ort").removeHandler(handler)
    out["warnings"] = warnings
    out["traces"] = step.transitions.traces
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"replicate": replicate(rank, world, args.backend), "fully_shard": fully_shard(rank, world, args.backend)}
    finish(args.out, result)


if __name__ == "__main__":
    main()
