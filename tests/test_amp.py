"""Mixed precision: torch.autocast + GradScaler against eager (fx, ORT and inductor), errors, and the 2-rank runs
against DDP and FSDP2 (tests/dist/amp_parity.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import launch
import torch
import torch.nn.functional as F

import spmd_ort
from spmd_ort.graph.slots import SlotKind
from spmd_ort.backends.inductor import cxx_compiler
from helpers import assert_close_relmax, assert_ran_on_ort, assert_same_state, scaled_update
from models import MLP

ROOT = Path(__file__).resolve().parent.parent
POISON_STEP = 3  # an inf in the batch: every run must skip this step and back off


def fp16_step(model, opt, scaler, x, y):
    """The AMP step of the torch docs: unscale_ before clipping, then step and update."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    return scaled_update(loss, model, opt, scaler)


def bf16_step(model, opt, scaler, x, y):
    """No unscale_: with a fused optimizer the scaler hands it grad_scale (the kernel unscales)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss


def batches(n: int):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        if i == POISON_STEP:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def scaler_state(scaler) -> tuple[float, int]:
    return float(scaler._scale), int(scaler._growth_tracker)


NEEDS_CXX = pytest.mark.skipif(cxx_compiler() is None, reason="inductor's CPU code needs a C++ compiler")
# (dtype, backend, optimizer).  fp16: MLP gradients overflow float16 at a scale of 2^18 and above, so
# the initial 2^19 skips the first two steps; bf16 has float32's range (no scale overflows it), so its
# skip comes from the poisoned batch alone.  fused AdamW takes the scaler's grad_scale/found_inf
# path, foreach SGD the host-decision path that the compiled step replaces.
CASES = [
    ("float16", "fx", "adamw-fused"),
    ("bfloat16", "fx", "sgd-foreach"),
    ("float16", "ort", "adamw-fused"),
    ("bfloat16", "ort", "adamw-fused"),
    pytest.param("bfloat16", "inductor", "adamw-fused", marks=NEEDS_CXX),
    pytest.param("float16", "inductor", "adamw-fused", marks=NEEDS_CXX),
]


def make_opt(kind: str, params):
    if kind == "sgd-foreach":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)


@pytest.mark.on_ort
@pytest.mark.parametrize("dtype,backend,opt_kind", CASES)
def test_autocast_and_gradscaler_match_eager(dtype, backend, opt_kind):
    """Loss, skipped steps, the scale and growth tracker after every step, parameters and optimizer state
    equal eager's.  fx runs eager's kernels: bit for bit with a fused optimizer (foreach SGD: rtol 1e-5,
    the fused kernel rounds differently).  ORT: every float16 matmul runs in an ORT segment (checked), with
    ORT's float16 kernels, which round differently from torch's by about one float16 ulp (2^-10 relative):
    the loss agrees to 2^-10, parameters and AdamW moments elementwise (tolerances at
    FP16_ORT_PARAM_ATOL); bf16 compute stays in torch on CPU (spmd_ort.backends.ort.partition.HOST_DTYPES), the
    float32 rest is ORT: rtol 1e-5 normwise.  inductor (the issue-24 executor): every segment compiled and
    verified, none fell back, the same tolerances as fx's."""
    dtype_ = getattr(torch, dtype)
    step_fn = fp16_step if dtype_ == torch.float16 else bf16_step
    init = 2.0**19 if dtype_ == torch.float16 else 2.0**16
    torch.manual_seed(0)
    model = MLP()
    model_c = copy.deepcopy(model)
    opt, opt_c = make_opt(opt_kind, model.parameters()), make_opt(opt_kind, model_c.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=2)
    scaler_c = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=2)
    compiled = spmd_ort.compile(backend=backend)(step_fn)
    low_precision_ort = backend == "ort" and dtype_ == torch.float16
    rtol = 2.0**-10 if low_precision_ort else 1e-5
    scales, skipped = [], []
    for i, (x, y) in enumerate(batches(8)):
        before = [p.detach().clone() for p in model.parameters()]
        loss = step_fn(model, opt, scaler, x, y)
        loss_c = compiled(model_c, opt_c, scaler_c, x, y)
        assert scaler_state(scaler_c) == scaler_state(scaler), (i, scaler_state(scaler_c), scaler_state(scaler))
        scales.append(scaler_state(scaler))
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        if i == POISON_STEP:
            assert loss_c.isnan() and loss.isnan()
        else:
            torch.testing.assert_close(loss_c, loss.detach(), rtol=rtol, atol=0)
        if backend == "fx" and opt_kind == "adamw-fused":
            assert i == POISON_STEP or torch.equal(loss_c, loss.detach()), i
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_c.parameters())), i
            sa, sb = opt.state_dict()["state"], opt_c.state_dict()["state"]  # a skipped step does not count
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k]), i
        elif low_precision_ort:
            assert_fp16_ort_close(model, model_c, opt, opt_c, where=f"step {i}")
        else:
            assert_same_state(model, model_c, opt, opt_c, where=f"step {i}", normwise=backend == "ort")
    # the schedule was exercised: skips (overflow, the inf batch), backoff and growth
    assert skipped[POISON_STEP] and scales[POISON_STEP][0] < scales[POISON_STEP - 1][0], (skipped, scales)
    if dtype_ == torch.float16:
        assert skipped[:2] == [True, True] and not skipped[2], (skipped, scales)
    assert any(b[0] > a[0] for a, b in zip(scales, scales[1:])), scales  # grew after 2 good steps
    assert not all(skipped) and sum(skipped) >= 1
    assert compiled.transitions.traces == 2  # the scale changes every step: a graph input, no re-trace
    if backend == "ort":
        assert_ran_on_ort(compiled)  # every segment ran in ONNX Runtime at every step, none fell back
        kinds = [s.kind for s in compiled.compiled.input_slots]
        assert kinds.count(SlotKind.SCALER) == 2
    if backend == "inductor":
        for program in compiled.variants:
            stats = program.executor.stats
            assert stats.segments >= 1 and not stats.fallbacks and stats.verified == stats.segments, stats
    if low_precision_ort:
        for program in compiled.variants:
            in_ort, on_host = fp16_matmuls(program)
            # the MLP's 3 Linear layers: 3 forward addmm, 3 weight-gradient and 2 input-gradient mm
            assert (len(in_ort), on_host) == (8, []), (in_ort, on_host)


# fp16 on ORT, elementwise.  ORT's float16 matmuls round differently from torch's by about one float16 ulp
# (2^-10 relative).  Parameters: AdamW (lr 1e-3) turns that into a difference of about lr * 2^-10 per step
# and element, more where a gradient element nearly cancels; measured over these 8 steps the largest
# difference beyond 2^-10 relative was 5.7e-6, so rtol 2^-10 with atol 2e-5 (2% of one step, 3.5x the
# measured).  The moments, relative to each tensor's largest element: measured 1.04e-3 (exp_avg) and
# 1.32e-3 (exp_avg_sq), so 2^-8 (3x).
FP16_ORT_PARAM_ATOL = 2e-5
FP16_ORT_STATE_RTOL = 2.0**-8
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def assert_fp16_ort_close(model, model_c, opt, opt_c, *, where: str) -> None:
    for (name, a), b in zip(model.named_parameters(), model_c.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=2.0**-10, atol=FP16_ORT_PARAM_ATOL,
                                   msg=lambda m, name=name: f"{where} param {name}: {m}")
    sa, sb = opt.state_dict()["state"], opt_c.state_dict()["state"]
    assert sa.keys() == sb.keys(), where
    for k in sa:
        assert torch.equal(sa[k]["step"], sb[k]["step"]), (where, k)  # the same steps skipped
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_relmax(sb[k][key], sa[k][key], rtol=FP16_ORT_STATE_RTOL, msg=f"{where} state {k}.{key}")


def fp16_matmuls(program) -> tuple[list[str], list[str]]:
    """The float16 matrix products of a compiled variant: (inside ORT segments, on the host)."""
    def of(gm) -> list[str]:
        return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMULS
                and n.meta["val"].dtype == torch.float16]

    executor = program.executor
    return [n for seg in executor.segments for n in of(seg.fallback)], of(executor.gm)


def _tiny():
    torch.manual_seed(0)
    model = MLP(8, 8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), torch.randn(4, 8), torch.randint(0, 4, (4,))


def test_gradscaler_errors_leave_everything_unchanged():
    """A scaler the step reaches without receiving it, a step that leaves the scaler mid-iteration and a
    scaler class whose methods the step cannot trace fail with errors naming the fix; the model, the
    optimizer and the scaler are as they were."""
    model, opt, x, y = _tiny()
    snapshot = copy.deepcopy(model.state_dict())
    outside = torch.amp.GradScaler("cpu")

    def uses_global(model, opt, x, y):
        outside.scale(F.cross_entropy(model(x), y)).backward()
        outside.step(opt)
        outside.update()

    with pytest.raises(spmd_ort.CompileError, match="not among its arguments; pass the scaler to the step"):
        spmd_ort.compile(backend="fx")(uses_global)(model, opt, x, y)
    assert outside._scale is None and not opt.state

    def no_update(model, opt, scaler, x, y):
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)

    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(spmd_ort.CompileError, match=r"mid-iteration \(stage STEPPED\).*scaler.update\(\)"):
        spmd_ort.compile(backend="fx")(no_update)(model, opt, scaler, x, y)
    assert scaler._scale is None and not opt.state and scaler._per_optimizer_states == {}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items())

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with pytest.raises(spmd_ort.CompileError, match="overrides GradScaler.*use torch.amp.GradScaler"):
        spmd_ort.compile(backend="fx")(fp16_step)(model, opt, ShardedGradScaler(device="cpu"), x, y)


def test_disabled_scaler_and_what_retraces():
    """``GradScaler(enabled=False)`` passes through as in eager; the scaler's update constants and autocast
    entered outside the step are what a graph is specialised on."""
    model, opt, x, y = _tiny()
    model_e, opt_e = copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    opt_e = torch.optim.AdamW(model_e.parameters(), lr=1e-2, fused=True)
    off, off_e = torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", enabled=False)
    step = spmd_ort.compile(backend="fx")(bf16_step)
    for _ in range(2):
        torch.testing.assert_close(step(model, opt, off, x, y), bf16_step(model_e, opt_e, off_e, x, y), rtol=0, atol=0)
    assert_same_state(model_e, model, opt_e, opt)
    assert [s.kind for s in step.compiled.input_slots].count(SlotKind.SCALER) == 0
    traces = step.transitions.traces
    on = torch.amp.GradScaler("cpu", growth_interval=3)
    step(model, opt, on, x, y)
    on.set_growth_interval(5)
    step(model, opt, on, x, y)
    assert step.transitions.traces == traces + 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(model, opt, on, x, y)  # the step's own autocast region nests in it; the key differs
    assert step.transitions.traces == traces + 3
    assert step.variants[-1].key.amp[0] == ("autocast", (("cpu", "torch.bfloat16"), ("cache", True)))
    assert step.variants[-2].key.amp[0] == ("autocast", (("cache", True),))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One torchrun (2 ranks) for both multi-rank scenarios; each rank checks every step itself."""
    out = tmp_path_factory.mktemp("amp") / "out"
    launch.torchrun("amp_parity.py", "--suite", "all", "--out", str(out), timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiproc
def test_replicate_fp16_gradscaler_matches_ddp(two_ranks):
    """2 ranks: loss, scale, growth tracker, parameters and optimizer state equal DDP + GradScaler at
    every step (checked in the script); an inf in rank 1's batch alone makes both ranks skip."""
    ranks = two_ranks
    for r in ranks:
        d = r["ddp"]
        assert d["traces"] == 2
        assert d["skipped"][:2] == [True, True] and d["skipped"][4], d["skipped"]
        assert not all(d["skipped"])
    assert ranks[0]["ddp"]["scales"] == ranks[1]["ddp"]["scales"]
    assert ranks[0]["ddp"]["skipped"] == ranks[1]["ddp"]["skipped"]


@pytest.mark.multiproc
def test_fully_shard_and_replicate_with_policy_match_fsdp2(two_ranks):
    """2 ranks against torch FSDP2 with the same MixedPrecisionPolicy: bf16 bit for bit (fully_shard and
    replicate), fp16 + GradScaler (found_inf combined over the ranks' shards) with the same skips and
    scales; the all-gather moves 2-byte parameters: half of what fp32 moves."""
    ranks = two_ranks
    for r in ranks:
        for dtype in ("fp16", "bf16"):
            d = r[dtype]
            padded = d["padded_numel"]
            for c in d["comm"]["fully_shard"]:
                # half of what the same step gathers in fp32 (forward, and backward but the tail kept)
                assert 2 * c["all_gather_bytes"] == d["fp32_all_gather_bytes"], c
                assert c["reduce_scatter_bytes"] == 2 * padded  # reduced in param_dtype (FSDP2's default)
            for c in d["comm"].get("replicate", []):
                assert c["all_reduce_bytes"] == d["fp32_param_bytes"] // 2
            # bf16 (no GradScaler): a fresh AdamW's state is created before the first trace (on the shards under
            # fully_shard): one trace; fp16's GradScaler may skip the first step, which then creates no state
            assert d["traces"] == ({"fully_shard": 2} if dtype == "fp16" else {"fully_shard": 1, "replicate": 1})
        fp16 = r["fp16"]
        assert fp16["skipped"][:2] == [True, True] and not all(fp16["skipped"]), fp16["skipped"]
        assert len({s for s, _ in fp16["scales"]}) > 1
    assert ranks[0]["fp16"]["scales"] == ranks[1]["fp16"]["scales"]


def test_policy_on_one_process_matches_fsdp2(one_rank):
    """One process: the policy still applies (parameters cast per module, fp32 masters).  Against FSDP2 on a
    one-rank group with the same MixedPrecisionPolicy (bf16 compute, float inputs cast, fp32 outputs): loss
    and parameters bit for bit, and the compiled graph computes its matmuls in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    fully_shard(reference, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)

    def step(model, opt, x, y):
        out = model(x)
        assert out.dtype == torch.float32
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    compiled = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(mixed_precision=policy), backend="fx")(step)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        assert torch.equal(compiled(model, opt, x, y), step(reference, opt_ref, x, y).detach()), i
        for a, (name, b) in zip(model.parameters(), reference.named_parameters()):
            assert a.dtype == torch.float32 and torch.equal(a, b.full_tensor()), (i, name)
    mms = [n for n in compiled.compiled.gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert mms and all(n.meta["val"].dtype == torch.bfloat16 for n in mms)


def test_host_optimizer_skips_like_the_fused_kernel():
    """offload_optimizer's host twins take found_inf too: 1 skips (steps unchanged), 0 updates as the device op.
    (The host update here is torch's fused CPU kernel, SPMD_ORT_NATIVE=0: the native kernel's own equality with it
    is tests/test_native_optim.py's; this checks the skip around it.)"""
    from spmd_ort.graph import ops
    from spmd_ort.options import Options
    from spmd_ort.runtime.step_runtime import StepRuntime

    torch.manual_seed(0)
    params, grads = [torch.randn(37)], [torch.randn(37)]
    state = lambda: ([torch.zeros(37)], [torch.zeros(37)], [], [torch.tensor(3.0)])  # noqa: E731
    hp = torch.tensor([1e-2, 0.9, 0.999, 0.1, 1e-8], dtype=torch.float64)
    with StepRuntime(options=Options(native=False)).active():
        for flag in (0.0, 1.0):
            found = torch.tensor(flag)
            device = ops.adam(params, grads, *state(), hp, False, False, True, found)
            host = ops.host_adam(params, grads, *state(), hp, False, False, True, found)
            assert all(torch.equal(a, b) for a, b in zip(device, host)), flag
            assert float(device[-1]) == (3.0 if flag else 4.0)
            assert torch.equal(device[0], params[0]) == bool(flag)
