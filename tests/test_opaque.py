"""Opaque parts: autograd.Functions and submodules that cannot be traced run eagerly as host nodes.

Eager PyTorch is the oracle: each model trains eagerly and compiled, step by step
(``train_side_by_side``: loss, parameters, gradients, buffers, optimizer state).
Several ranks (collectives inside opaque parts, Mixtral replicate / fully_shard):
tests/dist/opaque_parity.py, driven by test_opaque_parts_on_two_ranks.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest

import launch
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from spmd_ort.graph.slots import SlotKind
import spmd_ort
from helpers import assert_ort_report_clean, assert_same_state, train_side_by_side, train_step
from models import (FunctionMLP, GlobalCenter, MoENet, NumpyTanh, RoutedMoENet, ScaleByMax, starve,
                    tiny_mixtral_config)
from spmd_ort.graph.ops import opaque_backward, opaque_forward
from zoo import clipped_lm_step as lm_step

ROOT = Path(__file__).resolve().parent.parent


def _batches(n: int = 3, seed: int = 4, rows: int = 32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 16, generator=g), torch.randint(0, 10, (rows,), generator=g)) for _ in range(n)]


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def _sgd(m):
    # no optimizer state: one compiled variant (one ONNX export on the ORT backend)
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _opaque_nodes(step) -> dict:
    gm = step.compiled.gm
    return {op: sum(1 for n in gm.graph.nodes if n.target is op) for op in (opaque_forward, opaque_backward)}


# ---------------------------------------------------------------------- autograd.Functions
def test_value_reading_function_runs_opaquely_with_its_own_ctx():
    """``float(x.abs().max())`` cannot be traced: forward and backward run the user's code (ctx.scale
    carries the value from one to the other) as host nodes.  (On ORT: test_hf_mixtral_tiny, and
    the Function with collectives in test_opaque_parts_on_two_ranks.)"""
    torch.manual_seed(0)
    step, _, _ = train_side_by_side(lambda: FunctionMLP(ScaleByMax), _adamw, train_step, _batches())
    assert _opaque_nodes(step) == {opaque_forward: 1, opaque_backward: 1}
    text = step.compiled.describe()
    assert "opaque[0] autograd.Function models.ScaleByMax in module `layer`: forward + backward" in text
    assert "reads a tensor's value" in text and "shapes from random real tensors" in text
    assert "; last step" in text and step.compiled.opaque_seconds[0] > 0  # what the part cost the last step


def test_numpy_function_runs_opaquely():
    torch.manual_seed(0)
    step, le, _ = train_side_by_side(lambda: FunctionMLP(NumpyTanh), _adamw, train_step, _batches())
    assert _opaque_nodes(step) == {opaque_forward: 1, opaque_backward: 1}
    assert ".numpy()" in step.compiled.opaque[0].reason


class ScaledClamp(torch.autograd.Function):
    """ORTModule's example: non-tensor arguments (a float, a tuple, an object) beside the tensor."""

    @staticmethod
    def forward(ctx, x, alpha, beta, options):
        ctx.save_for_backward(x)
        ctx.factor = alpha * beta[0] * beta[1] * options["gamma"] / (float(x.detach().abs().max()) + 1.0)
        return ctx.factor * x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ctx.factor * grad * (x >= 0), None, None, None


class ClampLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.options = {"gamma": 0.5}

    def forward(self, x):
        return ScaledClamp.apply(self.lin(x), 2.0, (1.5, 0.5), self.options)


def test_function_with_non_tensor_arguments_runs_opaquely():
    torch.manual_seed(0)
    step, _, _ = train_side_by_side(lambda: nn.Sequential(ClampLayer(), nn.Linear(32, 10)), _adamw, train_step,
                                    _batches(2))
    assert [c.name for c in step.compiled.opaque] == ["test_opaque.ScaledClamp"]


class ApplyModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        return module(x) / (float(x.detach().abs().max()) + 1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class HidesParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 10)

    def forward(self, x):
        return ApplyModule.apply(x, self.inner)


def test_function_receiving_a_module_cannot_run_opaquely():
    model = HidesParameters()
    with pytest.raises(spmd_ort.CompileError, match=r"ApplyModule in module `<root>` cannot be traced .* receives "
                                                    r"the module Linear as an argument.*Fix"):
        spmd_ort.compile(backend="fx")(train_step)(model, _sgd(model), *_batches(1)[0])


def test_traceable_function_is_inlined_unless_listed_opaque(monkeypatch):
    """GlobalCenter (no process group here) traces: no opaque node.  Listed in
    SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS it runs opaquely, and trains the same."""
    torch.manual_seed(0)
    step, _, _ = train_side_by_side(lambda: FunctionMLP(GlobalCenter), _adamw, train_step, _batches(2))
    assert _opaque_nodes(step) == {opaque_forward: 0, opaque_backward: 0} and not step.compiled.opaque
    monkeypatch.setenv("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS", "models.GlobalCenter, models.NumpyTanh")
    torch.manual_seed(0)
    step, _, _ = train_side_by_side(lambda: FunctionMLP(GlobalCenter), _adamw, train_step, _batches(2))
    assert _opaque_nodes(step) == {opaque_forward: 1, opaque_backward: 1}
    assert step.compiled.opaque[0].reason == "listed in SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS"
    assert step.compiled.opaque[0].shapes_from == "fake tensors"


def test_a_listed_function_defined_in_a_function_is_checked_after_the_first_trace(monkeypatch, caplog):
    """`<locals>` names cannot be imported at compile(): one WARNING after the first trace when the step applied no
    Function of that name; the right name runs the Function opaquely, without a warning."""

    class LocalCenter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x - x.mean(dim=0, keepdim=True)

        @staticmethod
        def backward(ctx, grad):
            return grad - grad.mean(dim=0, keepdim=True)

    name = f"{LocalCenter.__module__}.{LocalCenter.__qualname__}"
    assert "<locals>" in name
    for listed, opaque in ((name.replace("LocalCenter", "LocalCentre"), 0), (name, 1)):
        monkeypatch.setenv("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS", listed)
        caplog.clear()
        torch.manual_seed(0)
        with caplog.at_level(logging.WARNING, logger="spmd_ort"):
            step, _, _ = train_side_by_side(lambda: FunctionMLP(LocalCenter), _adamw, train_step, _batches(2))
        warned = [r.getMessage() for r in caplog.records if "SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS" in r.getMessage()]
        assert _opaque_nodes(step)[opaque_forward] == opaque
        if opaque:
            assert not warned, warned
        else:
            assert len(warned) == 1 and f"names {listed}, but the traced step applied no" in warned[0], warned
            assert name in warned[0]  # what it did apply


def test_a_single_override_needs_no_list():
    """`module_override=OpaqueOverride(...)` failed with "'OpaqueOverride' object is not iterable"; anything that is
    not an Override is a TypeError saying what it is."""
    torch.manual_seed(0)
    step, _, _ = train_side_by_side(BNNet, _adamw, train_step, _batches(2),
                                    module_override=spmd_ort.OpaqueOverride("blocks.*.mlp"))
    assert [c.fqn for c in step.compiled.opaque] == ["blocks.0.mlp", "blocks.1.mlp"]
    with pytest.raises(TypeError, match=r"module_override=\.\.\.\) takes a spmd_ort.Override or a list of them "
                                        r"\(e.g. .*\), not str"):
        spmd_ort.compile(module_override="blocks.*.mlp")
    with pytest.raises(TypeError, match=r"item 1 is str 'head', not a spmd_ort.Override"):
        spmd_ort.compile(module_override=[spmd_ort.OpaqueOverride("blocks.*.mlp"), "head"])


def test_disabling_custom_autograd_support_makes_an_untraceable_function_an_error(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", "1")
    torch.manual_seed(0)
    model = FunctionMLP(ScaleByMax)
    opt = _adamw(model)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(spmd_ort.CompileError) as info:
        spmd_ort.compile(backend="fx")(train_step)(model, opt, *_batches(1)[0])
    msg = str(info.value)
    assert "autograd.Function models.ScaleByMax (forward) in module `layer`" in msg, msg
    assert "SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1 is set" in msg and "unchanged" in msg
    assert info.value.fqn == "layer"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class ScaleInPlace(torch.autograd.Function):
    """Untraceable (reads a value) and rewrites its input in place: it can run neither way."""

    @staticmethod
    def forward(ctx, x):
        x.div_(float(x.detach().abs().max()) + 1.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_function_that_can_neither_trace_nor_run_opaquely_is_a_clear_error():
    torch.manual_seed(0)
    model = FunctionMLP(ScaleInPlace)
    opt = _adamw(model)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(spmd_ort.CompileError) as info:
        spmd_ort.compile(backend="fx")(train_step)(model, opt, *_batches(1)[0])
    msg = str(info.value)
    assert "test_opaque.ScaleInPlace in module `layer`" in msg and "modifies its input 0" in msg, msg
    assert "Fix: return a new tensor" in msg
    assert info.value.fqn == "layer" and info.value.op == "test_opaque.ScaleInPlace"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class Positives(torch.autograd.Function):
    """Returns x's positive entries: the output's shape depends on the values."""

    @staticmethod
    def forward(ctx, x):
        return x[x > 0]

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not reached: the forward's shape check fails first")


def test_value_dependent_output_shape_is_named_at_run_time():
    def step_fn(model, opt, x):
        loss = Positives.apply(model(x)).sum()
        loss.backward()
        opt.step()
        return loss

    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    step = spmd_ort.compile(backend="fx")(step_fn)
    with pytest.raises(spmd_ort.CompileError, match=r"opaque autograd.Function test_opaque.Positives: output 0 is "
                                                    r"\(\d+,\) float32 but the graph was traced with \(\d+,\) "
                                                    r"float32 .*must depend only on its input shapes"):
        step(model, _adamw(model), _batches(1)[0][0])


# ---------------------------------------------------------------------- submodules
def test_top1_moe_module_runs_opaquely_with_one_warning(caplog):
    """Routing with nonzero() and `if sel.numel() == 0` cannot be traced: the module runs eagerly,
    named in one WARNING (the failed trace costs one more attempt), its parameters are graph inputs."""
    torch.manual_seed(4)  # every expert gets tokens at every step (eager would leave an idle expert's grad None)
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        step, le, _ = train_side_by_side(MoENet, _adamw, train_step, _batches(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "module `moe` cannot be traced" in warnings[0], warnings
    assert len(step.variants) == 1 and step.compiled.trace_attempts == 2
    [call] = step.compiled.opaque
    assert call.kind == "module" and call.fqn == "moe" and call.name == "Top1MoE"
    params = {s.name for s in step.compiled.input_slots if s.kind is SlotKind.PARAM}
    assert {"moe.router.weight", "moe.experts.3.down.bias"} <= params


# ---------------------------------------------------------------------- experts that get no tokens
def _moe_batches(starved: list[bool], seed: int = 1):
    """RoutedMoENet batches; where ``starved``, expert 3 gets no token (elsewhere at least one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in starved:
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
        if s:
            x = starve(x, 3)
        else:
            x[0, 3] = 5.0
        out.append((x, y))
    return out


def _step_keeping_grads(model, opt, x, y):
    """Gradients zeroed before backward and left after the step: its .grad is what this step's backward made."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _bitwise(model_e, model_c, opt_e, opt_c, where: str) -> None:
    for (name, a), b in zip(model_e.named_parameters(), model_c.parameters(), strict=True):
        assert torch.equal(a, b), f"{where}: {name} differs from eager"
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), \
            f"{where}: {name}.grad"
    sa, sb = opt_e.state_dict()["state"], opt_c.state_dict()["state"]
    assert sa.keys() == sb.keys(), f"{where}: optimizer state for {sorted(sa)} vs {sorted(sb)}"
    for k in sa:
        for key, v in sa[k].items():
            assert torch.equal(v, sb[k][key]), f"{where}: state {k}.{key}"


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
    # dampening: a first momentum step (buffer = gradient) differs from a later one from a zero buffer.  Not
    # fused: eager's fused SGD fails on a group where some parameters have a buffer and some do not yet
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, dampening=0.1,
                                              weight_decay=0.1, foreach=False),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("step_fn", [train_step, _step_keeping_grads], ids=["zero_grad_after", "grads_kept"])
def test_expert_without_tokens_is_left_alone_as_in_eager(opt_name, step_fn):
    """An expert that gets no tokens has no gradient in eager: the optimizer skips it (value, state, step count
    unchanged; a first step creates no state for it) and its .grad stays None.  The compiled step does the same,
    the first step included: bit for bit with fused AdamW; with SGD (momentum, dampening; eager's for-loop
    kernel rounds differently from the fused one) within the suite's tolerances and the idle expert bit for bit.
    (Before, its zero gradient moved it by weight decay and momentum: 6.9e-3 after two steps.)"""
    torch.manual_seed(0)
    make_opt = OPTIMIZERS[opt_name]
    model_e = RoutedMoENet()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = make_opt(model_e), make_opt(model_c)
    step = spmd_ort.compile(backend="fx")(step_fn)
    idle = {n: (p, q) for (n, p), q in zip(model_e.named_parameters(), model_c.parameters())
            if n.startswith("moe.experts.3.")}
    for i, (x, y) in enumerate(_moe_batches([True, False, True, True, False])):
        before = {n: (p.detach().clone(), {k: v.clone() for k, v in opt_e.state.get(p, {}).items()})
                  for n, (p, _) in idle.items()}
        le = step_fn(model_e, opt_e, x, y)
        lc = step(model_c, opt_c, x, y)
        if opt_name == "adamw":
            assert torch.equal(le.detach(), lc), f"step {i} loss"
            _bitwise(model_e, model_c, opt_e, opt_c, f"step {i}")
        else:
            torch.testing.assert_close(lc, le.detach(), rtol=1e-5, atol=1e-6)
            assert_same_state(model_e, model_c, opt_e, opt_c, where=f"step {i}")
        if i in (0, 2, 3):  # eager left the idle expert alone, and so did the compiled step
            for n, (p, q) in idle.items():
                value, state = before[n]
                assert p.grad is None and q.grad is None and torch.equal(p, value) and torch.equal(q, value), n
                assert opt_c.state.get(q, {}).keys() == state.keys(), n
                assert all(torch.equal(opt_c.state[q][k], v) for k, v in state.items()), n


def test_expert_without_tokens_on_ort():
    """The same on the ORT backend (every segment in ONNX Runtime, verified): parameters, gradients (None where
    eager's are) and optimizer state against eager per tensor, and the idle expert bit for bit unchanged."""
    torch.manual_seed(0)
    batches = _moe_batches([True, False] * 4)  # variants by which gradients exist; later steps repeat them
    train_side_by_side(RoutedMoENet, OPTIMIZERS["adamw"], _step_keeping_grads, batches, backend="ort")
    model = RoutedMoENet()
    opt = OPTIMIZERS["adamw"](model)
    step = spmd_ort.compile(backend="ort")(_step_keeping_grads)
    step(model, opt, *batches[1])
    before = {n: p.detach().clone() for n, p in model.moe.experts[3].named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.moe.experts[3].named_parameters()}
    step(model, opt, *batches[0])
    for n, p in model.moe.experts[3].named_parameters():
        assert p.grad is None and torch.equal(p, before[n]), n
        assert all(torch.equal(v, state[n][k]) for k, v in opt.state[p].items()), n
    assert [id(p) for p in step.compiled.skipped] == [id(p) for p in model.moe.experts[3].parameters()]
    assert "gradients only opaque parts make (17; " in step.compiled.describe()


def test_expert_whose_grad_the_step_replaces_is_named_in_a_warning(caplog):
    """A .grad the step replaces between backward and the optimizer is no longer what the opaque part made: such
    parameters are updated on every step, as before, and one WARNING at compile names them."""
    def step_fn(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.moe.experts[3].up.weight.grad = model.moe.experts[3].up.weight.grad * 1.0
        opt.step()
        opt.zero_grad()
        return loss

    model = RoutedMoENet()
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        spmd_ort.compile(backend="fx")(step_fn)(model, OPTIMIZERS["adamw"](model), *_moe_batches([True])[0])
    warned = [r.getMessage() for r in caplog.records if "replaces their .grad" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("moe.experts.3.up.weight get gradients only from opaque"), \
        warned


@pytest.mark.multiproc
def test_expert_without_tokens_on_two_ranks_matches_ddp(tmp_path):
    """2 ranks, expert 3 without tokens on both ranks, on one, on none (tests/dist/unused_params.py checks every
    step on every rank): replicate equals DDP(find_unused_parameters=True) in parameters, gradients (None where
    DDP leaves None) and optimizer state; fully_shard equals eager on the global batch and logs one WARNING
    naming the parameters and how FSDP2 differs.  What DDP did is measured, and the compiled steps did the same."""
    out = tmp_path / "out"
    launch.torchrun("unused_params.py", "--out", str(out), timeout=400)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    everywhere, somewhere = [0, 3], [1, 4]  # steps whose batches give the expert no token on both ranks / one
    for r in ranks:
        ddp, compiled = r["replicate"]["ddp"], r["replicate"]["compiled"]
        assert compiled == [{**d, "moved": c["moved"]} for d, c in zip(ddp, compiled)]
        for i in everywhere:  # DDP: no gradient anywhere, so none after the reduction and no update
            assert ddp[i]["grad_none"] and ddp[i]["moved"] == 0.0 and compiled[i]["moved"] == 0.0
        assert not ddp[0]["has_state"]  # and no state from a first step that skipped it
        for i in somewhere:  # the average of one rank's gradient and the other's zeros, on both ranks
            assert not ddp[i]["grad_none"] and ddp[i]["moved"] > 0
            assert compiled[i]["moved"] == pytest.approx(ddp[i]["moved"], rel=1e-4)
        eager, sharded = r["fully_shard"]["eager"], r["fully_shard"]["compiled"]
        for e, c in zip(eager, sharded, strict=True):
            assert e["grad_none"] == c["grad_none"] and c["moved"] == pytest.approx(e["moved"], rel=1e-4, abs=0)
        warned = [w for w in r["fully_shard"]["warnings"] if w.startswith("fully_shard:")]
        assert len(warned) == 1 and "moe.experts.3.up.weight" in warned[0] and "FSDP2" in warned[0], warned
        assert not [w for w in r["replicate"].get("warnings", []) if w.startswith("fully_shard:")]


def test_auto_opaque_off_is_a_compile_error(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_AUTO_OPAQUE", "0")
    torch.manual_seed(4)
    model = MoENet()
    with pytest.raises(spmd_ort.CompileError, match="in module `moe`.*unset SPMD_ORT_AUTO_OPAQUE=0"):
        spmd_ort.compile(backend="fx")(train_step)(model, _adamw(model), *_batches(1)[0])


class BNBlock(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        # no bias before BatchNorm: its gradient would be analytically zero (see tests/models.py)
        self.mlp = nn.Sequential(nn.Linear(d, d, bias=False), nn.BatchNorm1d(d), nn.ReLU())
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.mlp(x))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32, bias=False)
        self.blocks = nn.Sequential(BNBlock(), BNBlock())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def test_opaque_override_globs_keep_parameters_and_buffers_first_class(monkeypatch, caplog):
    """``OpaqueOverride("blocks.*.mlp")``: traceable modules run opaquely on request (also with
    SPMD_ORT_AUTO_OPAQUE=0), without warnings; BatchNorm's running statistics, updated in place by
    the eager code, come back as new buffer values."""
    monkeypatch.setenv("SPMD_ORT_AUTO_OPAQUE", "0")
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        step, _, _ = train_side_by_side(BNNet, _adamw, train_step, _batches(3),
                                        module_override=[spmd_ort.OpaqueOverride("blocks.*.mlp")])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [c.fqn for c in step.compiled.opaque] == ["blocks.0.mlp", "blocks.1.mlp"]
    assert all(c.reason == "OpaqueOverride('blocks.*.mlp')" for c in step.compiled.opaque)
    buffers = {s.name for s in step.compiled.output_slots if s.kind is SlotKind.BUFFER}
    assert buffers == {f"blocks.{i}.mlp.1.{b}" for i in (0, 1)
                       for b in ("running_mean", "running_var", "num_batches_tracked")}
    with pytest.raises(TypeError, match="FQN glob"):
        spmd_ort.OpaqueOverride()


class CheckpointedBlock(nn.Module):
    def __init__(self, reentrant: bool, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.reentrant = reentrant

    def inner(self, x):
        return self.norm(x + ScaleByMax.apply(torch.tanh(self.fc(x))))

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


class CheckpointedNet(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.blocks = nn.Sequential(CheckpointedBlock(reentrant), CheckpointedBlock(reentrant))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_with_an_opaque_function(reentrant):
    """torch.utils.checkpoint traces; the opaque Function inside runs once in forward (without
    recording autograd) and again in backward's recomputation, whose saved state its backward uses."""
    torch.manual_seed(0)
    step, le, _ = train_side_by_side(lambda: CheckpointedNet(reentrant), _adamw, train_step, _batches(3))
    calls = step.compiled.opaque
    assert len(calls) == 4 and [c.saves_for_backward for c in calls] == [False, False, True, True]
    assert _opaque_nodes(step) == {opaque_forward: 4, opaque_backward: 2}


# ---------------------------------------------------------------------- HF Mixtral
@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_hf_mixtral_tiny(backend):
    """Mixtral's experts as a loop over the experts hit (``experts_implementation="eager"``) branch on tensor
    values: they run opaquely, the rest (attention, router) is traced; on ORT it runs in segments around them.
    (Its default ``grouped_mm`` experts are traced: tests/test_hf_models.py.)"""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_mixtral_config(experts="eager")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, cfg.vocab_size, (2, 16), generator=g),) for _ in range(3)]
    torch.manual_seed(0)
    step, le, _ = train_side_by_side(lambda: transformers.MixtralForCausalLM(cfg), _sgd, lm_step, batches,
                                     backend=backend)
    [call] = step.compiled.opaque
    assert call.fqn == "model.layers.0.mlp.experts" and "reads a tensor's value" in call.reason
    if backend == "ort":  # host nodes between segments, every segment in ONNX Runtime (train_side_by_side)
        assert "host: spmd_ort.opaque_forward.default (opaque part" in step.compiled.describe()


# ---------------------------------------------------------------------- several ranks
@pytest.mark.on_ort
@pytest.mark.multiproc
def test_opaque_parts_on_two_ranks(tmp_path):
    """One torchrun, five scenarios (tests/dist/opaque_parity.py checks every step on every rank):
    collectives inside a Function and in a module's forward vs DDP on fx and ORT; HF Mixtral (opaque experts)
    replicate vs DDP and fully_shard vs single-process eager on the global batch; fully_shard again with its
    traced grouped_mm experts."""
    out = tmp_path / "out"
    launch.torchrun("opaque_parity.py", "--out", str(out), timeout=400)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        for name in ("collectives-fx", "collectives-ort", "mixtral-replicate", "mixtral-shard",
                     "mixtral-grouped-shard"):
            assert "compile_error" not in r[name], r[name]
            assert len(r[name]["losses"]) == 3
        opaque = r["collectives-ort"]["opaque"]
        assert "models.GlobalCenter" in opaque[0] and "c10d.allreduce_" in opaque[0]
        assert "module `scale` (GlobalTokenScale)" in opaque[1]
        assert_ort_report_clean(r["collectives-ort"]["ort"])
        for name in ("mixtral-replicate", "mixtral-shard"):
            assert "module `model.layers.0.mlp.experts`" in r[name]["opaque"][0]
        assert r["mixtral-grouped-shard"]["opaque"] == []  # traced: spmd_ort::grouped_mm in the graph
        for name in ("mixtral-shard", "mixtral-grouped-shard"):
            assert r[name]["comm"]["reduce_scatter_calls"] >= 1
    assert ranks[0]["collectives-fx"]["losses"] != ranks[1]["collectives-fx"]["losses"]  # each rank its shard


# last in this file: the one-rank process group (module scope) stays up until the module ends
def test_collective_in_the_step_function_is_a_compile_error(one_rank):
    """Not a raw NotImplementedError from tracing a ProcessGroup: a CompileError with the fix."""
    def step_fn(model, opt, x):
        loss = model(x).sum()
        torch.distributed.all_reduce(loss)
        loss.backward()
        opt.step()
        return loss

    model = nn.Linear(16, 8)
    with pytest.raises(spmd_ort.CompileError, match=r"outside any submodule .* torch.distributed call "
                                                    r"\(c10d.allreduce_.default\).*Fix: move the torch.distributed"):
        spmd_ort.compile(backend="fx")(step_fn)(model, _sgd(model), _batches(1)[0][0])
