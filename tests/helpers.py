"""Shared test helpers: train eager and compiled side by side and compare every step."""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn

import spmd_ort

# Tolerances per quantity (fp32):
# * parameters and buffers (O(1e-2..1)): elementwise, rtol 1e-5, with an absolute floor of 1e-6
#   for the elements that cross zero;
# * gradients and optimizer moments, whose elements span decades (Adam's exp_avg_sq has a
#   median of ~5e-8): relative to the tensor's largest element, max|a - b| <= 1e-5 * max|b|;
#   an absolute floor there would let any value of the small elements pass;
# * integers (step counts, num_batches_tracked) exactly; bitwise where a test claims it.
# On backends whose kernels round differently (ORT), comparisons are per tensor (normwise):
# Adam normalises each gradient element, so an element whose gradient is rounding noise moves by
# up to lr in either implementation and later gradients are taken at slightly different
# weights (20 GPT steps: parameters 2.8e-5, moments 7e-6 apart, normwise).  Parameters:
# ||a - b|| <= 1e-5 ||b|| + 1e-6 sqrt(n); gradients and moments: ||a - b|| <= 1e-5 ||b||, no
# absolute term.
RTOL, ATOL = 1e-5, 1e-6


def scaled_update(loss, model, opt, scaler, clip: float = 1.0):
    """The AMP update of the torch docs: scaled backward, unscale_ before clipping, step, update, zero_grad."""
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss


def shard_without_collectives(model: nn.Module, opt, world: int, rank: int = 0) -> None:
    """What fully_shard's ShardedModule does, without collectives: rank ``rank``'s shards of every parameter and
    state (pass tests trace a sharded step on one process)."""
    from spmd_ort.distributed.sharding import SHARD_ATTR, ShardSpec

    for p in model.parameters():
        spec = ShardSpec(tuple(p.shape), p.numel(), world, rank)
        st = opt.state.get(p, {})
        for k, v in list(st.items()):
            if v.dim() > 0:
                st[k] = spec.shard_of(v)
        p.data = spec.shard_of(p.data)
        setattr(p, SHARD_ATTR, spec)


def train_step(model, opt, x, y, clip: float | None = None):
    """Cross-entropy step for classifiers (B, C) and language models (B, T, V) alike."""
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


classification_step = lm_step = train_step


def grads_kept_step(model, opt, x, y):
    """:func:`train_step` with clipping, zeroing the gradients first: they are held between steps."""
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def accumulation_step(model, opt, xs, ys, read_between: bool = False, no_sync=None):
    """nanoGPT's loop: one backward per micro-batch (loss divided by their number), then one optimizer step.

    ``read_between``: the step also returns the norm of the first parameter's ``.grad`` after every
    micro-batch but the last (a step that reads gradients between micro-batches).  ``no_sync``: a DDP
    module's ``no_sync`` to enter for every micro-batch but the last (eager DDP only)."""
    import contextlib

    first = next(model.parameters())
    reads = []
    for j, (x, y) in enumerate(zip(xs, ys)):
        last = j + 1 == len(xs)
        with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
            out = model(x)
            loss = F.cross_entropy(out.flatten(0, -2), y.flatten()) / len(xs)
            loss.backward()
        if read_between and not last:
            reads.append(first.grad.norm())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, reads


def assert_close_normwise(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = RTOL, atol: float = ATOL,
                          msg: str = "") -> None:
    """||actual - expected|| <= rtol * ||expected|| + atol * sqrt(n).

    For backends whose kernels round differently from eager's (ORT): Adam
    normalises each gradient element, so one element whose gradient suffers
    cancellation can move by up to lr times its relative rounding error while
    the tensor as a whole agrees to 1e-6.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, msg
    if not actual.dtype.is_floating_point:
        assert torch.equal(actual, expected), msg
        return
    diff = (actual.double() - expected.double()).norm().item()
    bound = rtol * expected.double().norm().item() + atol * expected.numel() ** 0.5
    assert diff <= bound, f"{msg}: ||diff|| = {diff:.3g} > {bound:.3g} (max |diff| " \
                          f"{(actual.double() - expected.double()).abs().max().item():.3g})"


def assert_close_relmax(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = RTOL, msg: str = "") -> None:
    """max |actual - expected| <= rtol * max |expected| (elementwise, scaled by the tensor's largest element)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, msg
    if not actual.dtype.is_floating_point:
        assert torch.equal(actual, expected), msg
        return
    a, b = actual.double(), expected.double()
    err = (a - b).abs().max().item() if b.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    assert err <= rtol * scale or err == 0.0, f"{msg}: max |diff| = {err:.3g} > {rtol:g} x max |expected| = {scale:.3g}"


def _close(actual, expected, kind: str, normwise: bool, msg: str) -> None:
    """``kind``: "param"/"buffer" (elementwise) or "grad"/"state" (relative to the tensor's max);
    ``normwise`` on backends that round differently (see the tolerances above)."""
    if not actual.dtype.is_floating_point:
        assert actual.shape == expected.shape and torch.equal(actual, expected), f"{msg}: {actual} vs {expected}"
    elif normwise:
        assert_close_normwise(actual, expected, atol=0.0 if kind in ("grad", "state") else ATOL, msg=msg)
    elif kind in ("grad", "state"):
        assert_close_relmax(actual, expected, msg=msg)
    else:
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{msg}: {m}")


# A gradient analytically zero (e.g. an attention key bias: softmax is shift-invariant) is rounding
# noise in any implementation, many orders below the real gradients.
NOISE_GRAD = 1e-9


def assert_same_state(eager: nn.Module, compiled: nn.Module, eager_opt=None, compiled_opt=None, where="",
                      normwise: bool = False, zero_grad_params: Collection[str] = ()):
    """Parameters, gradients, buffers and optimizer state agree (tolerances above).

    ``zero_grad_params``: FQN patterns of parameters whose gradient is analytically zero; their
    gradients (and the optimizer state made from them) are checked to be noise-level in both runs
    instead of compared with each other - noise agrees in no two implementations.
    """
    noise = {n for n, _ in eager.named_parameters() if any(fnmatch.fnmatch(n, pat) for pat in zero_grad_params)}
    assert len(noise) >= len(zero_grad_params), f"{zero_grad_params} match no parameter"
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        _close(b, a, "param", normwise, f"{where} param {name}")
        if a.grad is None:
            assert b.grad is None, f"{where} {name}: compiled has a grad, eager has none"
        elif name in noise:
            assert max(a.grad.abs().max().item(), b.grad.abs().max().item()) < NOISE_GRAD, f"{where} {name}"
        else:
            _close(b.grad, a.grad, "grad", normwise, f"{where} grad {name}")
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled.named_buffers(), strict=True):
        _close(b, a, "buffer", normwise, f"{where} buffer {name}")
    if eager_opt is not None:
        sa, sb = eager_opt.state_dict(), compiled_opt.state_dict()
        assert sa["param_groups"] == sb["param_groups"], where
        assert sa["state"].keys() == sb["state"].keys(), where
        index_names = dict(enumerate(_names_in_optimizer_order(eager, eager_opt)))
        for k in sa["state"]:
            for key, va in sa["state"][k].items():
                vb = sb["state"][k][key]
                if isinstance(va, torch.Tensor) and index_names.get(k) in noise and va.dtype.is_floating_point \
                        and va.dim() > 0:
                    assert max(va.abs().max().item(), vb.abs().max().item()) < NOISE_GRAD, (where, k, key)
                elif isinstance(va, torch.Tensor):
                    _close(vb, va, "state", normwise, f"{where} opt state {index_names.get(k, k)}.{key}")
                else:
                    assert va == vb, (where, k, key)


def _names_in_optimizer_order(model: nn.Module, opt) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), "?") for g in opt.param_groups for p in g["params"]]


def train_side_by_side(make_model: Callable[[], nn.Module], make_opt: Callable, step_fn: Callable,
                       batches: list, *, backend: str = "fx", make_sched: Callable | None = None,
                       compare_state: bool = True, expect_clean_ort: bool = True, expect_verified: bool = True,
                       zero_grad_params: Collection[str] = (), normwise: bool | None = None, **compile_kwargs):
    """Train an eager and a compiled copy on the same batches; assert equal loss and state each step.

    ``backend="ort"`` with ``expect_clean_ort`` (the default) compiles with ``autotune=False`` unless told
    otherwise, and asserts that every segment ran on ORT (:func:`assert_ran_on_ort`).
    ``normwise``: compare state per tensor (default: on every backend but fx, which runs eager's kernels; a
    model whose head ``fuse_linear_cross_entropy_pass`` fuses runs torch's chunked operator there instead).
    Returns (compiled step, eager losses, compiled losses).
    """
    if normwise is None:
        normwise = backend != "fx"
    model_e = make_model()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = make_opt(model_e), make_opt(model_c)
    sched_e = make_sched(opt_e) if make_sched else None
    sched_c = make_sched(opt_c) if make_sched else None
    if backend == "ort" and expect_clean_ort:
        # the test asserts that steps trained on ORT's outputs: the static choice (every segment ORT supports runs
        # on ORT), not the faster of ORT and fx (the suite pins no executor; tests/test_default_path.py)
        compile_kwargs.setdefault("autotune", False)
    compiled = spmd_ort.compile(backend=backend, **compile_kwargs)(step_fn)
    losses_e, losses_c = [], []
    for i, batch in enumerate(batches):
        le = step_fn(model_e, opt_e, *batch)
        lc = compiled(model_c, opt_c, *batch)
        losses_e.append(float(le.detach()))
        losses_c.append(float(lc))
        torch.testing.assert_close(lc, le.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"step {i} loss: {m}")
        if compare_state:
            # fx runs eager's own kernels: elementwise; ORT's and inductor's round differently: per tensor
            assert_same_state(model_e, model_c, opt_e, opt_c, where=f"step {i}", normwise=normwise,
                              zero_grad_params=zero_grad_params)
        if sched_e is not None:
            sched_e.step()
            sched_c.step()
    if backend == "ort" and expect_clean_ort:
        assert_ran_on_ort(compiled, verified=expect_verified)
    return compiled, losses_e, losses_c


def ort_report(compiled) -> list[dict]:
    """Per variant: segments, fallbacks, mismatches, segments verified, and per segment how many steps used ORT's
    outputs (``ort_runs``) and how many only compared them with the fx graph's, which the step used
    (``checked_runs``: the first run, and a dynamic segment's first runs at new sizes)."""
    out = []
    for program in compiled.variants:
        ex = program.executor
        if ex.name == "inductor":
            out.append({"executor": "inductor", "segments": ex.stats.segments, "fallbacks": list(ex.stats.fallbacks),
                        "mismatches": list(ex.stats.mismatches), "verified": ex.stats.verified,
                        "runs": [seg.runs for seg in ex.segments], "steps_run": program.steps_run})
            continue
        if ex.name != "ort":
            out.append({"executor": ex.name})
            continue
        stats = ex.stats
        out.append({"executor": "ort", "segments": stats.segments, "fallbacks": list(stats.fallbacks),
                    "mismatches": list(stats.mismatches), "verified": stats.verified,
                    "ort_runs": [seg.runs for seg in ex.segments], "steps_run": program.steps_run,
                    "checked_runs": [seg.checked_runs for seg in ex.segments],
                    "sized": [len(seg.sessions) for seg in ex.segments if hasattr(seg, "sessions")],
                    "checked_sizes": [len(seg.new_sizes.checked) for seg in ex.segments
                                      if getattr(seg, "new_sizes", None) is not None]})
    return out


def assert_ort_report_clean(report: list[dict], *, verified: bool = True, trained: int = 2) -> None:
    """Every segment of every variant was exported, loaded and run by ONNX Runtime on every step it served
    (no fallback, no mismatch): the step used ORT's outputs on every step but the checked ones, whose outputs
    were compared with the fx graph's (with ``verified``: each segment on its first run, a dynamic one at its
    first sets of sizes); and at least ``trained`` steps trained on ORT's outputs alone (every segment's), so
    that a test which says ORT proves it (a checked run's outputs are fx's)."""
    assert report, "no compiled variant"
    for r in report:
        assert r["executor"] == "ort", r
        assert r["segments"] >= 1, r
        assert r["fallbacks"] == [] and r["mismatches"] == [], r
        # dynamic shapes: a segment with one model is checked at its first sets of sizes (checked_sizes), one
        # exported per set of sizes at each (sized); every other segment once
        once = r["segments"] - len(r["sized"]) - len(r["checked_sizes"])
        assert r["verified"] == (sum(r["sized"]) + sum(r["checked_sizes"]) + once if verified else 0), r
        assert len(r["ort_runs"]) == r["segments"], r
        assert all(n + c == r["steps_run"] for n, c in zip(r["ort_runs"], r["checked_runs"])), r
    on_ort = sum(min(r["ort_runs"]) for r in report)
    assert on_ort >= trained, (f"{on_ort} step(s) trained on ORT's outputs beyond the checked runs (whose outputs "
                               f"are fx's), {trained} wanted: give the test more steps: {report}")


def assert_inductor_report_clean(report: list[dict], *, trained: int = 2) -> None:
    """Every segment of every variant was compiled by inductor and checked at its first run (no fallback, no
    mismatch), and at least ``trained`` steps trained on inductor's outputs (every segment's) after it."""
    assert report, "no compiled variant"
    for r in report:
        assert r["executor"] == "inductor", r
        assert r["segments"] >= 1 and len(r["runs"]) == r["segments"], r
        assert r["fallbacks"] == [] and r["mismatches"] == [] and r["verified"] == r["segments"], r
    on_inductor = sum(min(r["runs"]) for r in report)
    assert on_inductor >= trained, f"{on_inductor} step(s) trained on inductor's outputs, {trained} wanted: {report}"


def assert_ran_on_ort(compiled, *, verified: bool = True, trained: int = 2) -> None:
    assert_ort_report_clean(ort_report(compiled), verified=verified, trained=trained)


def resync(model: nn.Module, opt, other: nn.Module, other_opt) -> None:
    """``other`` and ``other_opt`` given ``model``'s parameters and ``opt``'s state: the next step of each starts
    from the same state (a run of hundreds of steps drifts apart by rounding: each step is then compared alone)."""
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters()):
            theirs.copy_(mine)
    other_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
