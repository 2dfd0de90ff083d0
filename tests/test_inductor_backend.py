"""The inductor backend: segments compiled by torch's inductor, against eager; compile and verification failures."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_ort
from helpers import train_side_by_side, train_step
from launch import torchrun
from models import CNN, MLP

pytestmark = pytest.mark.skipif(
    __import__("spmd_ort.backends.inductor", fromlist=["cxx_compiler"]).cxx_compiler() is None,
    reason="inductor's CPU code needs a C++ compiler")


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _batches(shape, classes, n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)) for _ in range(n)]


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.3, self.training))


@pytest.mark.parametrize("make,shape", [(MLP, (8, 32)), (CNN, (4, 3, 16, 16))], ids=["mlp", "cnn+batchnorm"])
def test_trains_like_eager(make, shape):
    """Loss and state per step as eager's to fp32 rounding (inductor's fused loops round differently); the whole
    forward, backward and clipping in one compiled segment, the optimizer on the host."""
    torch.manual_seed(0)
    compiled, losses_e, losses_c = train_side_by_side(
        make, _adamw, lambda m, o, x, y: train_step(m, o, x, y, clip=1.0), _batches(shape, 10), backend="inductor")
    executor = compiled.compiled.executor
    assert executor.name == "inductor" and executor.stats.segments >= 1
    assert not executor.stats.fallbacks and executor.stats.verified == executor.stats.segments
    assert all(seg.runs == 2 for seg in executor.segments)  # every step after the checked first one
    assert "spmd_ort.adam_.default" in executor.stats.host_ops


def test_dropout_draws_eagers_masks():
    """Random ops stay in torch (and compiling draws nothing from torch's RNG): from the same RNG state each
    step, eager and compiled dropout masks agree, so losses agree to rounding."""
    torch.manual_seed(0)
    model = DropoutMLP()
    twin = __import__("copy").deepcopy(model)
    opt, opt_c = _adamw(model), _adamw(twin)
    step = spmd_ort.compile(backend="inductor")(train_step)
    for x, y in _batches((8, 32), 10, 3):
        state = torch.get_rng_state()
        loss = train_step(model, opt, x, y)
        torch.set_rng_state(state)
        loss_c = step(twin, opt_c, x, y)
        torch.testing.assert_close(loss_c, loss.detach(), rtol=1e-5, atol=1e-6)
    assert "spmd_ort.bernoulli_like.default" in step.compiled.executor.stats.host_ops


def test_a_segment_inductor_cannot_compile_runs_on_fx(monkeypatch, caplog):
    import torch._inductor.compile_fx as cfx

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for this today")

    monkeypatch.setattr(cfx, "compile_fx", refuse)
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _batches((8, 32), 10, 2), backend="inductor")
    assert "inductor could not compile it: no kernel for this today; it runs on the fx executor" in caplog.text
    assert compiled.compiled.executor.stats.fallbacks == ["fused_0"]
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = MLP()
    opt = _adamw(model)
    before = [p.detach().clone() for p in model.parameters()]
    step = spmd_ort.compile(backend="inductor")(train_step)
    with pytest.raises(spmd_ort.CompileError, match="inductor segment `fused_0`.*FALLBACK_DISABLE"):
        step(model, opt, *_batches((8, 32), 10, 1)[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state


def test_a_wrong_compiled_segment_is_caught_on_the_first_run(monkeypatch, caplog):
    from spmd_ort.backends.inductor import InductorSegment

    right = InductorSegment.run_compiled

    def wrong(self, *args):
        out = right(self, *args)
        return tuple(o * 1.001 if o.is_floating_point() else o for o in out) if isinstance(out, tuple) else out * 1.001

    monkeypatch.setattr(InductorSegment, "run_compiled", wrong)
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _batches((8, 32), 10, 3), backend="inductor")
    stats = compiled.compiled.executor.stats
    assert stats.fallbacks == ["fused_0"] and "verification failed" in caplog.text
    assert compiled.compiled.executor.segments[0].runs == 0  # fx ran every step: the numbers are eager's


def test_without_a_cxx_compiler_it_is_a_config_error(monkeypatch):
    from spmd_ort.backends import inductor as executor

    monkeypatch.setattr(executor, "cxx_compiler", lambda: None)
    model = MLP()
    opt = _adamw(model)
    with pytest.raises(spmd_ort.ConfigError, match="no C\\+\\+ compiler.*backend='fx' or 'ort'"):
        spmd_ort.compile(backend="inductor")(train_step)(model, opt, *_batches((8, 32), 10, 1)[0])
    assert not opt.state


def test_an_input_in_another_layout_than_traced_is_copied_into_it():
    """Inductor's code asserts its inputs' strides; a value whose layout the trace could not see (an opaque part's
    output: mixtral-tiny's experts) may arrive transposed.  The segment copies it into the traced layout and
    computes what its fx graph computes."""
    from spmd_ort.backends.inductor import InductorSegment

    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    gm = make_fx(lambda x, w: torch.relu(x @ w) * 2)(x, w)  # each placeholder's meta["val"]: the traced layout
    seg = InductorSegment("s", gm)
    xt = torch.randn(8, 4).t()  # the same shape, transposed strides
    assert xt.stride() != x.stride()
    torch.testing.assert_close(seg(xt, w), gm(xt, w))
    assert seg(xt, w).shape == (4, 3) and seg.runs == 2


@pytest.mark.parametrize("winner", ["inductor", "segments"])
def test_the_automatic_choice_times_inductor_as_a_candidate(monkeypatch, winner):
    """SPMD_ORT_SEGMENT_EXECUTOR=auto (the default outside the suite) on the ORT backend: once a program's steady
    steps have spent the candidate's predicted compile (here predicted free, after one measured step: step 3),
    the tuner compiles the whole graph with inductor, checks its first run and times it against what runs; when
    inductor is faster it runs every later step (the ORT sessions are freed), else it is freed and later
    variants of the step are compiled without it.  Timings are made up so that each outcome is tested; the
    numbers match eager every step either way."""
    monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "auto")
    from spmd_ort import tuner
    from spmd_ort.backends.ort import choice

    monkeypatch.setattr(tuner.CompileCost, "predict", classmethod(lambda cls, nodes: (0.0, "free")))
    monkeypatch.setattr(tuner.CompileCost, "seconds_per_node", None)  # restored after the compile calibrates it
    monkeypatch.setattr(tuner, "MEASURED_STEPS", 1)
    choose = choice.choose_whole

    def rigged(runners, inputs, stats, field="whole"):
        if "inductor" in runners:  # the upgrade: make the other one slow
            slow = lambda fn: lambda *a, **k: (__import__("time").sleep(0.3), fn(*a, **k))[1]  # noqa: E731
            for name, gm in runners.items():
                if name != winner and not (winner == "segments" and name != "inductor"):
                    gm.forward = slow(gm.forward)
        return choose(runners, inputs, stats, field)

    monkeypatch.setattr(choice, "choose_whole", rigged)  # the tuner's timing of the candidate
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _batches((8, 32), 10, 5), backend="auto",
                                        expect_clean_ort=False, dynamic=False)
    ex = compiled.compiled.executor
    up = ex.stats.upgrade
    assert up is not None and [k for k, _ in up.times_ms][1] == "inductor"
    described = compiled.compiled.describe()
    assert "at step 3:" in described
    if winner == "inductor":
        assert up.executor == "inductor" and ex.runs == "inductor" and ex.whole is None
        assert all(seg.session is None for seg in ex.segments)
        assert all(seg.runs == 3 for seg in ex.inductor.segments)  # steps 3 (after the choice), 4 and 5
        assert "inductor segments:" in described
    else:
        assert up.executor != "inductor" and ex.inductor is None
    # a new variant (another batch size, static shapes) is compiled with inductor's candidate only if it won
    model, (x, y) = MLP(), _batches((4, 32), 10, 1)[0]
    opt = _adamw(model)
    for _ in range(3):
        compiled(model, opt, x, y)
    again = compiled.compiled.executor
    assert again is not ex and (again.stats.upgrade is not None) == (winner == "inductor")


class Cancelling(nn.Module):
    """A loss that is ill-conditioned in float32 (a small value found as the difference of two large ones): fx
    computes it with a 1e-3 relative error, and another correct implementation differs from fx by as much."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return (self.fc(x) + 30000.0) - 30000.0


def test_an_ill_conditioned_output_is_judged_against_float64_as_ORTs_is(monkeypatch, caplog):
    """Found in bench/step.py: the CNN's first weight gradient (a sum of 65536 terms that nearly cancel) came out
    of inductor 0.3% off fx's, inductor's segment fell back to fx and the 8th-step choice lost its 0.7x step. The
    first run now forgives what ORT's forgives: a difference no larger than fx's own from float64. Here the
    compiled segment's outputs are the float64 ones, rounded (as exact as float32 allows); scaled by 1.001 they
    are wrong and still fall back."""
    from spmd_ort.backends.inductor import InductorSegment
    from spmd_ort.graph.checking import _Float64

    def exact(self, *args):
        with torch.no_grad():
            out = _Float64(self.fallback).run(*[a.double() if a.dtype == torch.float32 else a for a in args])
        return tuple(o.float() if o.dtype == torch.float64 else o for o in out)

    def first_run(run_compiled):
        monkeypatch.setattr(InductorSegment, "run_compiled", run_compiled)
        torch.manual_seed(0)
        model = Cancelling()
        step = spmd_ort.compile(backend="inductor")(train_step)
        step(model, _adamw(model), *_batches((8, 32), 10, 1)[0])  # (eager rounds the loss as fx does: no oracle)
        return step.compiled.executor

    monkeypatch.setenv("SPMD_ORT_LOG_LEVEL", "INFO")  # (compile sets the logger's level)
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        executor = first_run(exact)
    assert executor.stats.ill_conditioned == ["fused_0"] and not executor.stats.fallbacks, caplog.text
    assert "max |inductor - fx|" in caplog.text and "ill-conditioned computation, not a fault" in caplog.text
    assert "ill-conditioned; accepted" in "\n".join(executor.describe())
    executor = first_run(lambda self, *args: tuple(o * 1.001 if o.is_floating_point() else o
                                                   for o in exact(self, *args)))
    assert executor.stats.fallbacks == ["fused_0"] and not executor.stats.ill_conditioned


# one zoo model per architecture it covers (rotary GQA decoder, learned positions, encoder-decoder with relative
# attention bias, padded classification, patch embedding, convolutions with BatchNorm): each compiles in 7-18 s
# with an empty inductor cache, so not the whole zoo (tests/test_ort_coverage.py runs all of it on ORT)
ZOO_ON_INDUCTOR = ("llama", "gpt2", "t5", "bert", "vit", "resnet")


@pytest.mark.parametrize("name", ZOO_ON_INDUCTOR)
def test_zoo_trains_on_inductor_without_fallback(name, monkeypatch):
    """Loss and state as eager's at every step (normwise: inductor's loops round differently), every segment
    compiled and verified, none fell back (fallback disabled); the host keeps only the update and the index
    checks of the batch."""
    pytest.importorskip("transformers")
    from zoo import sgd, zoo

    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = zoo()[name]
    torch.manual_seed(0)
    batches = model.batches(torch.Generator().manual_seed(0), 1) * 3
    compiled, losses, _ = train_side_by_side(model.make, sgd, model.step, batches, backend="inductor",
                                             zero_grad_params=model.zero_grad_params)
    stats = compiled.compiled.executor.stats
    assert stats.segments >= 1 and stats.verified == stats.segments and not stats.fallbacks, stats
    assert set(stats.host_ops) <= {"spmd_ort.check_index.default", "spmd_ort.sgd_.default"}, stats.host_ops
    assert losses[-1] < losses[0]


def test_new_lengths_train_like_eager_on_inductor(monkeypatch):
    """A new sequence length re-traces the step with the length symbolic (dynamic shapes): the inductor executor
    compiles segments of static shapes only, so the symbolic program's ops with symbolic sizes run in torch
    and the rest is compiled; the step trains as eager does at every length, fallback disabled."""
    pytest.importorskip("transformers")
    from zoo import sgd, zoo

    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = zoo()["llama"]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (2, length), generator=g),) for length in (8, 8, 6, 11, 8)]
    torch.manual_seed(0)
    compiled, _, _ = train_side_by_side(model.make, sgd, model.step, batches, backend="inductor")
    static, symbolic = [p for p in compiled.variants if p.symbolic is None], \
        [p for p in compiled.variants if p.symbolic is not None]
    assert static and symbolic
    assert all(p.executor.stats.segments >= 1 and not p.executor.stats.fallbacks for p in static)
    for p in symbolic:
        stats = p.executor.stats
        assert stats.segments >= 1 and not stats.fallbacks
        assert any(why.startswith("symbolic sizes") for why in stats.host_ops.values()), stats.host_ops


def test_the_ranks_of_a_machine_compile_each_graph_once(tmp_path):
    """4 ranks on this machine, each compiling the same replicated step with inductor (trained against DDP): one
    compiles every segment (inductor's FX graph cache misses), the other three wait on its lock and load every
    segment from the cache (hits), none compiles it again."""
    run = torchrun("inductor_once.py", nproc=4, out=tmp_path / "out", timeout=400,
                   env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                        "SPMD_ORT_CACHE_DIR": str(tmp_path / "cache")})
    ranks = run.ranks
    segments = ranks[0]["segments"]
    assert segments >= 1 and all(r["segments"] == segments and not r["fallbacks"] for r in ranks), ranks
    assert sorted((r["misses"], r["hits"]) for r in ranks) == [(0, segments)] * 3 + [(segments, 0)], ranks
