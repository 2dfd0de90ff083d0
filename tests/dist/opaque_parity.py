"""Run under torchrun: opaque parts (collectives inside them, HF Mixtral's experts) on several ranks.

    torchrun --standalone --nproc_per_node=2 tests/dist/opaque_parity.py --out DIR [--scenarios a,b,...]

Scenarios, each against its oracle, step by step on every rank (any mismatch raises):

* ``collectives-fx`` / ``collectives-ort``: ``DistNet`` (an autograd.Function with an
  all-reduce in forward and one in backward, and a module that calls
  ``dist.all_reduce`` in its forward) under ``DataParallel()`` vs torch DDP.  Those
  collectives run inside opaque host nodes, between the compiled step's own
  asynchronous gradient all-reduces, in the same order on every rank.
* ``mixtral-replicate``: HF Mixtral (tiny config, its experts' data-dependent loop: opaque) under
  ``DataParallel()`` vs DDP.
* ``mixtral-shard``: the same under ``parallel_style="fully_shard"`` vs single-process
  eager on the global batch: the opaque experts read gathered parameters and their
  gradients are reduce-scattered.
* ``mixtral-grouped-shard``: the same with transformers' default ``grouped_mm`` experts, traced (no
  opaque part): their 3-D weights are gathered and reduce-scattered as every parameter is.

Every rank builds its models from its own seed (the compiled step must take rank 0's
weights) and writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.tensor import Shard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import assert_close_normwise, assert_same_state, ort_report, train_step  # noqa: E402
from models import DistNet, tiny_mixtral_config  # noqa: E402
from zoo import lm_step  # noqa: E402

STEPS = 3
SCENARIOS = ("collectives-fx", "collectives-ort", "mixtral-replicate", "mixtral-shard", "mixtral-grouped-shard")


def summary(step) -> dict:
    prog = step.compiled
    return {"opaque": [c.describe() for c in prog.opaque], "traces": step.transitions.traces,
            "ort": ort_report(step), "comm": {"all_reduce_calls": step.comm.all_reduce_calls,
                                              "all_gather_calls": step.comm.all_gather_calls,
                                              "reduce_scatter_calls": step.comm.reduce_scatter_calls}}


def vs_ddp(base, opt_fn, step_fn, batch_fn, backend: str, rank: int, world: int) -> dict:
    """Compiled replicate vs DDP on each rank's shard of the same global batches."""
    ddp = DDP(copy.deepcopy(base))  # broadcasts rank 0's weights
    model = copy.deepcopy(base)
    opt_ref, opt = opt_fn(ddp.parameters()), opt_fn(model.parameters())
    step = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(), backend=backend)(step_fn)
    losses = []
    for i in range(STEPS):
        batch = batch_fn(i, rank)
        loss = step(model, opt, *batch)
        ref = step_fn(ddp, opt_ref, *batch)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        assert_same_state(ddp.module, model, opt_ref, opt, where=f"rank {rank} step {i}", normwise=backend == "ort")
        losses.append(float(loss))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], t) for t in gathered), "parameters differ between ranks"
    del ddp
    gc.collect()
    return {"losses": losses, **summary(step)}


def collectives(rank: int, world: int, backend: str) -> dict:
    torch.manual_seed(rank)  # a different init on every rank

    def batch(i, r):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(8 * world, 16, generator=g), torch.randint(0, 10, (8 * world,), generator=g)
        return x[8 * r: 8 * (r + 1)], y[8 * r: 8 * (r + 1)]

    # ORT: plain SGD keeps it to one compiled variant (one export)
    make_opt = (lambda p: torch.optim.AdamW(p, lr=1e-2)) if backend == "fx" else (lambda p: torch.optim.SGD(p, lr=0.1))
    return vs_ddp(DistNet(), make_opt, train_step, batch, backend, rank, world)


def mixtral_batch(i: int, cfg, per_rank: int, world: int):
    g = torch.Generator().manual_seed(200 + i)
    return torch.randint(0, cfg.vocab_size, (per_rank * world, 8), generator=g)


def mixtral_replicate(rank: int, world: int) -> dict:
    import transformers

    cfg = tiny_mixtral_config(experts="eager")  # the experts' loop is data-dependent: opaque
    torch.manual_seed(rank)
    base = transformers.MixtralForCausalLM(cfg)
    return vs_ddp(base, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lm_step,
                  lambda i, r: (mixtral_batch(i, cfg, 2, world)[2 * r: 2 * (r + 1)],), "fx", rank, world)


def mixtral_shard(rank: int, world: int, experts: str) -> dict:
    """``experts="eager"``: the experts run opaquely on gathered parameters; ``"grouped_mm"``: traced, their 3-D
    weights gathered and their gradients reduce-scattered like every other parameter's."""
    import transformers

    cfg = tiny_mixtral_config(experts=experts)
    torch.manual_seed(0)
    reference = transformers.MixtralForCausalLM(cfg)  # rank 0's weights, trained eagerly on the global batch
    torch.manual_seed(rank)
    model = transformers.MixtralForCausalLM(cfg)
    if rank == 0:
        model.load_state_dict(reference.state_dict())
    make = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    opt_ref, opt = make(reference.parameters()), make(model.parameters())
    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    step = spmd_ort.compile(parallel_mode=mode, backend="fx")(lm_step)
    losses = []
    for i in range(STEPS):
        x = mixtral_batch(i, cfg, 2, world)
        loss = step(model, opt, x[2 * rank: 2 * (rank + 1)])
        ref = lm_step(reference, opt_ref, x).detach()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        torch.testing.assert_close(global_loss / world, ref, rtol=1e-5, atol=1e-6)
        full = spmd_ort.full_state_dict(model, opt, rank0_only=False)
        for name, want in reference.state_dict().items():
            assert_close_normwise(full["model"][name], want, msg=f"rank {rank} step {i} {name}")
        for k, st in opt_ref.state_dict()["state"].items():
            for key, want in st.items():
                assert_close_normwise(full["optim"]["state"][k][key], want, atol=0.0,
                                      msg=f"rank {rank} step {i} state {k}.{key}")
        losses.append(float(global_loss / world))
    assert all(p.placements == (Shard(0),) for p in model.parameters())  # Shard(0) DTensors between steps
    return {"losses": losses, **summary(step)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {"collectives-fx": lambda: collectives(rank, world, "fx"),
            "collectives-ort": lambda: collectives(rank, world, "ort"),
            "mixtral-replicate": lambda: mixtral_replicate(rank, world),
            "mixtral-shard": lambda: mixtral_shard(rank, world, "eager"),
            "mixtral-grouped-shard": lambda: mixtral_shard(rank, world, "grouped_mm")}
    result: dict = {"rank": rank, "world": world}
    for name in args.scenarios.split(","):
        try:
            result[name] = runs[name]()
        except spmd_ort.CompileError as exc:
            result[name] = {"compile_error": str(exc)}
    finish(args.out, result)


if __name__ == "__main__":
    main()
