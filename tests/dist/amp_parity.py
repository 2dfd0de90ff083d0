"""Run under torchrun: mixed precision on 2 ranks against torch's own, step by step.

    torchrun --standalone --nproc_per_node=2 tests/dist/amp_parity.py [--suite ddp|fsdp2|bf16|all] --out DIR

``--suite ddp``: compiled ``replicate`` + ``torch.autocast(float16)`` + ``GradScaler`` (a huge
initial scale: the first steps overflow; clipping after ``unscale_``) against torch DDP with the
same autocast and scaler.  At one step only rank 1's batch holds an inf: after the all-reduce
both ranks see it and skip together, in both runs.

``--suite fsdp2``: against torch FSDP2 (``fully_shard`` per block and root, with
``mp_policy=MixedPrecisionPolicy(...)``):

* ``fp16``: compiled ``fully_shard`` + ``spmd_ort.MixedPrecisionPolicy(param_dtype=float16)``
  + ``GradScaler`` (huge initial scale) vs FSDP2 + the same policy + ``ShardedGradScaler``:
  found_inf is combined across ranks, every rank skips together, the scales agree;
* ``bf16``: compiled ``fully_shard`` and compiled ``replicate`` with
  ``MixedPrecisionPolicy(param_dtype=bfloat16)`` vs FSDP2 with the same policy.

``--suite bf16`` runs the bf16 part alone (``--styles`` picks the compiled styles, ``--steps`` how many);
``--budget B`` compiles those runs with ``activation_memory_budget=B`` and, below 1.0, each style at
1.0 beside them: both equal FSDP2 bit for bit, so each other too (asserted as well).

Checked every step on every rank: loss, the GradScaler's scale and growth tracker (exactly),
which steps were skipped, and every full parameter (normwise, see ``TOLERANCE``); the
all-gather moves 2-byte parameters (half the fp32 bytes).  Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import copy
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
from spmd_ort.passes.recompute import Recomputation  # noqa: E402
from helpers import assert_close_normwise, assert_same_state, scaled_update  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab=64, d=16, heads=2, layers=1, seq=8)
STEPS = 7
INF_STEP = 4  # rank 1's batch holds an inf at this step (ddp suite)
# Parameters and loss against FSDP2.  Both runs do the same ops in the same dtypes on the same
# values (gathers in param_dtype, reductions in reduce_dtype, the same fused AdamW): bf16 is bit for
# bit.  The fp16 reference steps with foreach AdamW (see make_opt), which rounds differently from the
# fused kernel: rtol 1e-5 normwise, as every fp32 comparison (measured: 7e-8).
TOLERANCE = {torch.float16: 1e-5, torch.bfloat16: 0.0}


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g)
    y = torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g)
    return x, y


def amp_step(model, opt, scaler, x, y, poison):
    """The standard AMP step: autocast forward, scaled backward, unscale_, clip, step, update.

    ``poison`` (1.0, or inf on one rank at one step: a tensor, so every rank runs one graph)
    multiplies the logits.
    """
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x) * poison
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return scaled_update(loss, model, opt, scaler)


def policy_step(model, opt, scaler, x, y):
    """A FSDP2-style step: the policy casts, the loss is taken in fp32; a scaler when there is one."""
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    if scaler is not None:
        return scaled_update(loss, model, opt, scaler)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def scaler_state(scaler) -> tuple[float, int]:
    return float(scaler._scale), int(scaler._growth_tracker)


def make_opt(params, fused: bool = True):
    # With ShardedGradScaler, FSDP2's reference takes foreach: torch's fused Adam cannot take its
    # found_inf (shape [1] against scalar steps); the compiled update runs the fused kernel either way,
    # and a foreach update rounds differently, which a bf16 forward would amplify (1 bf16 ulp in a
    # weight): bf16 runs use fused on both sides.
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=fused, foreach=None if fused else True)


def ddp_suite(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # every rank starts elsewhere: both must take rank 0's weights
    base = GPT(CFG)
    ref = DDP(copy.deepcopy(base))
    model = copy.deepcopy(base)
    opt_ref, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    # 2^19 and 2^18 overflow fp16 in this model's backward, 2^17 does not
    scaler_ref = torch.amp.GradScaler("cpu", init_scale=2.0**19, growth_interval=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**19, growth_interval=2)
    step = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(bucket_cap_mb=0.01), backend="fx")(amp_step)
    out: dict = {"losses": [], "scales": [], "skipped": []}
    before = [p.detach().clone() for p in ref.module.parameters()]  # rank 0's: DDP broadcast them
    for i in range(STEPS):
        x, y = batch(i, rank)
        poisoned = i == INF_STEP and rank == 1
        poison = torch.tensor(float("inf") if poisoned else 1.0)
        loss = step(model, opt, scaler, x, y, poison)
        loss_ref = amp_step(ref, opt_ref, scaler_ref, x, y, poison)
        if not poisoned:
            torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=1e-6)
        assert scaler_state(scaler) == scaler_state(scaler_ref), (i, scaler_state(scaler), scaler_state(scaler_ref))
        assert_same_state(ref.module, model, opt_ref, opt, where=f"rank {rank} step {i}")
        out["losses"].append(float(loss))
        out["scales"].append(scaler_state(scaler))
        out["skipped"].append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        before = [p.detach().clone() for p in model.parameters()]
    out["traces"] = step.transitions.traces
    out["all_reduce_bytes"] = step.comm.all_reduce_bytes
    return out


def fsdp2_reference(base, dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype)
    for block in base.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(base, mp_policy=policy)
    return base


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter in full (FSDP2 DTensors, spmd_ort shards or plain tensors alike; collective)."""
    if any(hasattr(p, "_spmd_ort_shard") for p in model.parameters()):
        full = spmd_ort.full_state_dict(model, rank0_only=False)["model"]
        return {n: full[n] for n, _ in model.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def fsdp2_suite(rank: int, world: int, dtype: torch.dtype, styles: list[str] | None = None, steps: int = STEPS,
                budget: float | None = None) -> dict:
    torch.manual_seed(0)
    base = GPT(CFG)
    ref = fsdp2_reference(copy.deepcopy(base), dtype)
    scaled = dtype == torch.float16
    opt_ref = make_opt(ref.parameters(), fused=not scaled)
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=dtype)
    styles = styles or (["fully_shard"] if dtype == torch.float16 else ["fully_shard", "replicate"])
    beside = budget is not None and budget < 1.0  # each style also at budget 1.0: the same bits
    runs = {}
    for style in styles:
        for key, b in ((style, budget), (f"{style}@1.0", 1.0)) if beside else ((style, budget),):
            model = copy.deepcopy(base)
            mode = spmd_ort.DataParallel(parallel_style=style, mixed_precision=policy, bucket_cap_mb=0.01)
            step = spmd_ort.compile(parallel_mode=mode, backend="fx", activation_memory_budget=b)(policy_step)
            runs[key] = (model, make_opt(model.parameters(), fused=not scaled), step)
    if scaled:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler_ref = ShardedGradScaler(device="cpu", init_scale=2.0**19, growth_interval=2)
        scalers = {s: torch.amp.GradScaler("cpu", init_scale=2.0**19, growth_interval=2) for s in runs}
    else:
        scaler_ref, scalers = None, dict.fromkeys(runs)
    out: dict = {"losses": [], "scales": [], "skipped": [], "comm": {s: [] for s in runs},
                 "max_param_diff": dict.fromkeys(runs, 0.0)}
    fp32_param_bytes = sum(p.numel() * 4 for p in base.parameters())
    padded = None
    for i in range(steps):
        x, y = batch(i, rank)
        before = full_params(ref)
        loss_ref = policy_step(ref, opt_ref, scaler_ref, x, y).detach()
        want = full_params(ref)
        out["skipped"].append(all(torch.equal(before[n], want[n]) for n in want))
        if scaled:
            out["scales"].append(scaler_state(scaler_ref))
        out["losses"].append(float(loss_ref))
        losses = {}
        for style, (model, opt, step) in runs.items():
            loss = step(model, opt, scalers[style], x, y)
            losses[style] = loss
            torch.testing.assert_close(loss, loss_ref, rtol=TOLERANCE[dtype], atol=0,
                                       msg=lambda m: f"rank {rank} {style} step {i} loss: {m}")
            assert TOLERANCE[dtype] or torch.equal(loss, loss_ref), (style, i)
            if scaled:
                assert scaler_state(scalers[style]) == scaler_state(scaler_ref), \
                    (style, i, scaler_state(scalers[style]), scaler_state(scaler_ref))
            got = full_params(model)
            for name, w in want.items():
                assert_close_normwise(got[name], w, rtol=TOLERANCE[dtype], atol=0,
                                      msg=f"rank {rank} {style} step {i} {name}")
                assert TOLERANCE[dtype] or torch.equal(got[name], w), (style, i, name)
                rel = ((got[name] - w).norm() / w.norm()).item()
                out["max_param_diff"][style] = max(out["max_param_diff"][style], rel)
            c = step.comm
            out["comm"][style].append({"all_gather_bytes": c.all_gather_bytes,
                                       "reduce_scatter_bytes": c.reduce_scatter_bytes,
                                       "all_reduce_bytes": c.all_reduce_bytes})
            if style == "fully_shard" and padded is None:
                padded = sum(p._spmd_ort_shard.padded_numel for p in model.parameters())
        for style in styles if beside else ():
            assert torch.equal(losses[style], losses[f"{style}@1.0"]), (style, i)
            for (name, p), q in zip(runs[style][0].named_parameters(), runs[f"{style}@1.0"][0].parameters(),
                                    strict=True):
                assert torch.equal(p, q), f"rank {rank} {style} step {i}: {name} differs from budget 1.0's"
    out["fp32_param_bytes"] = fp32_param_bytes
    out["padded_numel"] = padded
    if "fully_shard" in styles:  # the same step without a policy, for the bytes it gathers in fp32
        model = copy.deepcopy(base)
        plain = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(parallel_style="fully_shard",
                                                                     bucket_cap_mb=0.01), backend="fx")(policy_step)
        plain(model, make_opt(model.parameters()), None, *batch(0, rank))
        out["fp32_all_gather_bytes"] = plain.comm.all_gather_bytes
    out["traces"] = {s: r[2].transitions.traces for s, r in runs.items()}
    out["recomputed_copies"] = {s: (r.copies if (r := run[2].compiled.results.get(Recomputation)) else 0)
                                for s, run in runs.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=["ddp", "fsdp2", "bf16", "all"], default="all")
    ap.add_argument("--styles", help="--suite bf16: the compiled styles, comma-separated (default: both)")
    ap.add_argument("--steps", type=int, default=STEPS, help="--suite bf16: steps")
    ap.add_argument("--budget", type=float, help="--suite bf16: compile(activation_memory_budget=...)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    if args.suite in ("ddp", "all"):
        result["ddp"] = ddp_suite(rank, world)
    if args.suite in ("fsdp2", "all"):
        result.update(fp16=fsdp2_suite(rank, world, torch.float16), bf16=fsdp2_suite(rank, world, torch.bfloat16))
    if args.suite == "bf16":
        styles = args.styles.split(",") if args.styles else None
        result["bf16"] = fsdp2_suite(rank, world, torch.bfloat16, styles, args.steps, args.budget)
    finish(args.out, result)


if __name__ == "__main__":
    main()
