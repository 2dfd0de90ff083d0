"""Run under torchrun: compiled fully_shard (ZeRO-3) vs single-process eager on the global batch.

    torchrun --standalone --nproc_per_node=N tests/dist/zero_parity.py --out DIR [--reshard 0|1]
        [--offload none|optimizer|param|both] [--backend fx|ort] [--opt adamw|sgd] [--clip 1.0]

Every rank builds the model from its own seed (the compiled step must start from
rank 0's weights), trains it fully sharded on its slice of each global batch, and
trains an eager copy of rank 0's model on the whole global batch.  After every
step: the global loss (mean of the ranks' losses), every full parameter and the
optimizer state (gathered from the shards) match eager (rtol 1e-5; the loss
elementwise, parameters and state normwise per tensor); persistent
bytes per rank stay within total / N plus padding.  Writes DIR/rank<r>.json.  ``--case`` (repeated): each case's
options one after the other in one launch (each its own models and step); DIR/rank<r>.json maps each to its result.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import UserTraffic, finish  # noqa: E402
import spmd_ort  # noqa: E402
from spmd_ort.passes.shard_schedule import ShardBuckets  # noqa: E402
from helpers import ATOL, RTOL, accumulation_step, assert_close_normwise, ort_report, train_step  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402


# Odd sizes (27-wide LayerNorms, 27x81 qkv): most parameters need padding for N = 2 and N = 4.
CFG = GPTConfig(vocab=67, d=27, heads=3)


def make_opt(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


def batches(cfg: GPTConfig, step: int, global_batch: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab, (global_batch, cfg.seq), generator=g)
    y = torch.randint(0, cfg.vocab, (global_batch, cfg.seq), generator=g)
    return x, y


def mode_from(args) -> spmd_ort.DataParallel:
    return spmd_ort.DataParallel(
        parallel_style="fully_shard", reshard_after_forward=bool(args.reshard), prefetch=args.prefetch,
        bucket_cap_mb=args.bucket_mb,
        offload_optimizer="cpu" if args.offload in ("optimizer", "both") else None,
        offload_param="cpu" if args.offload in ("param", "both") else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="per rank")
    ap.add_argument("--reshard", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=0.02)
    ap.add_argument("--offload", default="none", choices=["none", "optimizer", "param", "both"])
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--opt", default="adamw")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="gradient accumulation: each rank's slice in this many micro-batches, one backward each, "
                         "then one optimizer step (no clipping); the loss is not compared, parameters and state are")
    ap.add_argument("--vocab", type=int, default=0, help="the GPT's vocabulary (0: CFG's)")
    ap.add_argument("--seq", type=int, default=0, help="the GPT's sequence length (0: CFG's)")
    ap.add_argument("--user-collectives", action="store_true",
                    help="a thread of the user's all-reducing on the default group while each step runs (besides the "
                         "loss's all-reduce between steps, while the next step's first gather is in flight)")
    ap.add_argument("--case", action="append", default=[],
                    help="several cases in one launch, one after the other: each --case=\"--reshard 0 --backend ort\" "
                         "this script's options")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cases = [ap.parse_args([*shlex.split(case), "--out", args.out]) for case in args.case]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cases:
        result = {case: attempt(c, rank, world) for case, c in zip(args.case, cases, strict=True)}
    else:
        result = attempt(args, rank, world)
    finish(args.out, result)


def attempt(args, rank: int, world: int) -> dict:
    """``run``'s result, or the compile error it raised."""
    try:
        return run(args, rank, world)
    except spmd_ort.CompileError as exc:
        import traceback

        return {"compile_error": str(exc), "traceback": traceback.format_exception(exc)}


def run(args, rank: int, world: int) -> dict:
    cfg = dataclasses.replace(CFG, vocab=args.vocab or CFG.vocab, seq=args.seq or CFG.seq)
    torch.manual_seed(0)
    reference = GPT(cfg)  # rank 0's initial weights, trained eagerly on the global batch
    torch.manual_seed(rank)
    model = GPT(cfg)  # every rank starts elsewhere: fully_shard must take rank 0's weights
    if rank == 0:
        model.load_state_dict(reference.state_dict())
    opt_ref, opt = make_opt(args.opt, reference.parameters()), make_opt(args.opt, model.parameters())
    full_numel = sum(p.numel() for p in reference.parameters())
    micro = args.micro_batches
    if micro > 1:  # equal micro-batches: the mean of their means is the global batch's mean
        def fn(m, o, x, y):
            return accumulation_step(m, o, x.chunk(micro), y.chunk(micro))[0]
    else:
        def fn(m, o, x, y):
            return train_step(m, o, x, y, clip=args.clip)
    step = spmd_ort.compile(parallel_mode=mode_from(args), backend=args.backend)(fn)
    result: dict = {"rank": rank, "world": world, "losses": [], "comm": [], "step_s": []}
    for i in range(args.steps):
        x, y = batches(cfg, i, args.batch * world)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        t0 = time.perf_counter()
        with UserTraffic(rank, world) if args.user_collectives else contextlib.nullcontext():
            loss = step(model, opt, x[mine], y[mine])
        result["step_s"].append(time.perf_counter() - t0)
        ref_loss = train_step(reference, opt_ref, x, y, clip=args.clip).detach()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world
        if micro == 1:
            torch.testing.assert_close(global_loss, ref_loss, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} step {i} loss: {m}")
        # Parameters: rtol 1e-5 normwise per tensor.  The sharded step sums the batch in another order
        # (per-rank means, then the average), and Adam turns the rounding of a gradient element that
        # nearly cancels (|g| ~ eps) into a visible step of that one element; elementwise, one weight
        # in a few thousand can miss 1e-6 absolute although the tensor agrees to 1e-7 (see
        # helpers.assert_close_normwise).  Optimizer moments the same way, without the absolute term
        # (exp_avg_sq's elements are ~1e-8: any absolute floor would let them all pass).
        full = spmd_ort.full_state_dict(model, opt, rank0_only=False)
        ref_opt = opt_ref.state_dict()["state"]
        for name, want in reference.state_dict().items():
            assert_close_normwise(full["model"][name], want, msg=f"rank {rank} step {i} {name}")
        for k, st in ref_opt.items():
            for key, want in st.items():
                assert_close_normwise(full["optim"]["state"][k][key], want, atol=0.0,
                                      msg=f"rank {rank} step {i} state {k}.{key}")
        for name, p in model.named_parameters():  # between steps: Shard(0) DTensors of the full shape, as FSDP2's
            spec = p._spmd_ort_shard
            assert isinstance(p, DTensor) and p.placements == (Shard(0),) and tuple(p.shape) == spec.shape, name
            rows = -(-spec.shape[0] // world)
            assert p.to_local().shape[0] == max(0, min(rows, spec.shape[0] - rank * rows)), (name, p.to_local().shape)
        for name, t in model.state_dict().items():  # nothing in it whose shape is not the parameter's
            assert tuple(t.shape) == tuple(reference.state_dict()[name].shape), name
        for st in opt.state.values():
            for key, v in st.items():
                assert v.dim() == 0 or isinstance(v, DTensor), key
        c = step.comm
        result["losses"].append(float(global_loss))
        result["comm"].append({"all_gather_calls": c.all_gather_calls, "all_gather_bytes": c.all_gather_bytes,
                               "reduce_scatter_calls": c.reduce_scatter_calls,
                               "reduce_scatter_bytes": c.reduce_scatter_bytes, "all_reduce_bytes": c.all_reduce_bytes,
                               "carried_gathers": c.carried_gathers, "overlap": c.overlap})
    # evaluation outside the compiled step: the module's own forward gathers the full parameters and reshards
    # after (as FSDP2's hooks do); it equals the eager reference's, and the shards are as they were
    shards = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, CFG.vocab, (2, CFG.seq), generator=torch.Generator().manual_seed(7))
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert_close_normwise(model(x), reference(x), msg=f"rank {rank} eval forward outside the step")
    model.train()
    reference.train()
    assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(shards, model.parameters(), strict=True))
    # a parameter's full_tensor() is the full weight, as the gathered state dict has it
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), full["model"][name]), name
    memory = step.memory()
    padded = sum(p._spmd_ort_shard.padded_numel for p in model.parameters())
    unsharded = spmd_ort.distributed.sharding.persistent_bytes(reference, opt_ref)["total"]
    result.update(
        memory=memory, full_param_bytes=full_numel * 4, padded_param_bytes=padded * 4,
        unsharded_total=unsharded, n_params=len(list(model.parameters())),
        traces=step.transitions.traces, describe=step.compiled.describe(), ort=ort_report(step),
        explain=step.explain(),
        buckets={"all_gather": list(step.compiled.results.get(ShardBuckets).all_gather),
                 "reduce_scatter": list(step.compiled.results.get(ShardBuckets).reduce_scatter)})
    return result


if __name__ == "__main__":
    main()
