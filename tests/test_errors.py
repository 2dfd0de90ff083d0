"""Bad input gets a clear error and loses nothing."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_ort
from helpers import classification_step
from models import MLP


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # Python control flow on a tensor value
            return h * 2
        return h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 32)
        self.bn = nn.BatchNorm1d(32)
        self.router = DataDependent()
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.router(self.bn(self.stem(x))))


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return params, grads, buffers, copy.deepcopy(opt.state_dict()), [id(p) for p in model.parameters()]


def _assert_identical(before, model, opt):
    params, grads, buffers, opt_state, ids = before
    now = _snapshot(model, opt)
    for n in params:
        assert torch.equal(params[n], now[0][n]), n
        assert (grads[n] is None) == (now[1][n] is None), n
        if grads[n] is not None:
            assert torch.equal(grads[n], now[1][n]), n
    for n in buffers:
        assert torch.equal(buffers[n], now[2][n]), n
    assert opt_state["param_groups"] == now[3]["param_groups"]
    assert opt_state["state"].keys() == now[3]["state"].keys()
    for k, st in opt_state["state"].items():
        for key, v in st.items():
            assert torch.equal(v, now[3]["state"][k][key]) if isinstance(v, torch.Tensor) else v == now[3]["state"][k][key]
    assert ids == now[4]


def test_failed_compile_names_module_and_op_and_changes_nothing(monkeypatch):
    # Without SPMD_ORT_AUTO_OPAQUE=0 the router would run opaquely (tests/test_opaque.py)
    monkeypatch.setenv("SPMD_ORT_AUTO_OPAQUE", "0")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for _ in range(2):  # real optimizer state, BN statistics and gradients exist
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    before = _snapshot(model, opt)
    step = spmd_ort.compile(backend="fx")(classification_step)
    with pytest.raises(spmd_ort.CompileError) as info:
        step(model, opt, x, y)
    msg = str(info.value)
    assert "`router`" in msg and "Override" in msg and "unchanged" in msg
    assert "unset SPMD_ORT_AUTO_OPAQUE=0" in msg
    assert info.value.fqn == "router"
    assert "tensor's value" in msg
    _assert_identical(before, model, opt)
    # the same objects still train eagerly afterwards
    classification_step(model, opt, x, y)


def test_item_in_step_function_is_reported_outside_modules():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    before = _snapshot(model, opt)
    with pytest.raises(spmd_ort.CompileError, match="outside any submodule"):
        spmd_ort.compile(backend="fx")(step_fn)(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    _assert_identical(before, model, opt)


def test_unsupported_optimizer_is_named():
    model = MLP()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.1)
    before = _snapshot(model, opt)
    with pytest.raises(spmd_ort.CompileError, match="RMSprop has no functional rule.*supported: Adam, AdamW, SGD"):
        spmd_ort.compile(backend="fx")(classification_step)(model, opt, torch.randn(4, 32),
                                                            torch.randint(0, 10, (4,)))
    _assert_identical(before, model, opt)


def test_argument_errors():
    step = spmd_ort.compile(backend="fx")(classification_step)
    with pytest.raises(TypeError, match="exactly one nn.Module.*got no nn.Module"):
        step(None, None, torch.randn(2, 32), torch.zeros(2, dtype=torch.long))
    m = MLP()
    o1, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)

    def two(model, a, b, x):
        return model(x).sum()

    with pytest.raises(TypeError, match="at most one optimizer; got 2"):
        spmd_ort.compile(backend="fx")(two)(m, o1, o2, torch.randn(2, 32))
    with pytest.raises(ValueError, match="backend='tvm'"):
        spmd_ort.compile(backend="tvm")


def test_optimizer_param_not_in_module():
    model = MLP()
    stray = nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1)
    with pytest.raises(spmd_ort.CompileError, match=r"shape \(3,\) that is not a parameter of MLP"):
        spmd_ort.compile(backend="fx")(classification_step)(model, opt, torch.randn(4, 32),
                                                            torch.randint(0, 10, (4,)))


def test_step_closure_is_rejected():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(model, opt, x, y):
        def closure():
            return F.cross_entropy(model(x), y)
        return opt.step(closure)

    with pytest.raises(spmd_ort.CompileError, match="closure"):
        spmd_ort.compile(backend="fx")(step_fn)(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))


# ---------------------------------------------------------------------- errors that blame the right thing
def _mlp_and_step(backend="fx"):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, spmd_ort.compile(backend=backend)(classification_step)


def test_wrong_feature_size_names_the_input_not_an_override(capfd):
    """The input, its shape and the last shape that compiled, the op and the module; torch's fake-tensor
    error log (a traceback per failed op) stays off the console."""
    model, opt, step = _mlp_and_step()
    y = torch.randint(0, 10, (4,))
    step(model, opt, torch.randn(4, 32), y)
    before = _snapshot(model, opt)
    capfd.readouterr()
    with pytest.raises(spmd_ort.CompileError) as info:
        step(model, opt, torch.randn(4, 31), y)
    assert str(info.value) == (
        "the input `x` (shape (4, 31), float32; the last call that compiled passed shape (4, 32), float32) does not "
        "fit module `fc1` (Linear): F.linear rejected it: a and b must have same reduction dim, but got [4, 31] X "
        "[32, 64]. Fix: pass `x` with the shape and dtype the model expects. The model and optimizer are unchanged.")
    assert (info.value.input, info.value.fqn, info.value.op) == ("x", "fc1", "F.linear")
    err = capfd.readouterr().err
    assert "failed while attempting to run meta" not in err and "Traceback" not in err, err
    _assert_identical(before, model, opt)


def test_integer_batch_into_a_float_model_fails_while_tracing_not_in_ort(caplog):
    """It traced, then ONNX Runtime refused the segment (a WARNING) and fx raised 'While executing %fused_0'."""
    model, opt, step = _mlp_and_step("ort")
    before = _snapshot(model, opt)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(spmd_ort.CompileError) as info:
            step(model, opt, torch.randint(0, 5, (4, 32)), torch.randint(0, 10, (4,)))
    assert str(info.value) == (
        "the input `x` (shape (4, 32), int64) does not fit module `fc1` (Linear): F.linear rejected it: F.linear "
        "needs operands of one dtype, got int64 and float32 (eager PyTorch rejects this too). Fix: pass `x` with the "
        "shape and dtype the model expects. The model and optimizer are unchanged.")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    _assert_identical(before, model, opt)


def test_wrong_target_names_the_target():
    model, opt, step = _mlp_and_step()
    with pytest.raises(spmd_ort.CompileError) as info:
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (3,)))
    assert str(info.value).startswith(
        "the input `y` (shape (3,), int64) does not fit the step function: F.cross_entropy rejected it: Expected "
        "input batch_size (4) to match target batch_size (3). Fix: pass `y`")


@pytest.mark.parametrize("index_checks", [True, False])
def test_input_that_changed_is_named_when_the_graph_fails_at_run_time(index_checks, monkeypatch):
    """A longer sequence than the position table traces (fake tensors do not see index values): the position
    ids, computed from the input's length, are out of range.  The index checks name the input and the bad
    position (an IndexError, as eager's); without them the graph fails when it runs and the error names the
    input that changed since the last call that compiled."""
    from models import GPT, GPTConfig, gpt_batch

    if not index_checks:
        monkeypatch.setenv("SPMD_ORT_DISABLE_PASSES", "insert_index_checks_pass")
    cfg = GPTConfig(vocab=16, seq=8, d=8, heads=1, layers=1)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd_ort.compile(backend="fx")(classification_step)
    x, y = gpt_batch(cfg, 2, torch.Generator().manual_seed(0))
    step(model, opt, x, y)
    long_x = torch.randint(0, cfg.vocab, (2, 2 * cfg.seq))
    if index_checks:
        with pytest.raises(spmd_ort.InputIndexError) as info:
            step(model, opt, long_x, long_x)
        assert str(info.value).startswith(
            f"the indices that aten.embedding reads, computed from input `x`, hold {cfg.seq} at [{cfg.seq}]: "
            f"nn.Embedding / F.embedding (aten.embedding) in module `wpe` (Embedding) accepts [0, {cfg.seq})")
        return
    with pytest.raises(spmd_ort.CompileError) as info:
        step(model, opt, long_x, long_x)
    assert str(info.value).startswith(
        f"the input `x` changed from shape (2, {cfg.seq}), int64 to shape (2, {2 * cfg.seq}), int64 since the last "
        "call that compiled, and with it the compiled step fails when it runs: IndexError: index out of range in "
        "self")


def test_a_model_bug_names_the_module_and_op_without_blaming_the_input():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(32, 16)
            self.b = nn.Linear(8, 10)  # expects 8 features, gets 16

        def forward(self, x):
            return self.b(self.a(x))

    model = Broken()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(spmd_ort.CompileError) as info:
        spmd_ort.compile(backend="fx")(classification_step)(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert str(info.value) == (
        "could not trace the train step in module `b` (Linear): F.linear raised RuntimeError: a and b must have "
        "same reduction dim, but got [4, 16] X [8, 10]. Fix: if eager PyTorch runs this step with these inputs, "
        "supply an Override for `b` (spmd_ort.Override.replacement) or make it traceable; if it fails there too, "
        "fix the shapes or dtypes that reach F.linear. The model and optimizer are unchanged.")
    assert info.value.input is None


def test_call_that_does_not_match_the_signature_says_so():
    model, opt, step = _mlp_and_step()
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    with pytest.raises(TypeError) as info:
        step(model, opt, x)
    assert str(info.value) == (
        "spmd_ort: the call does not match the train step's signature `train_step(model, opt, x, y, clip=None)`"
        ": missing a required argument: 'y' (it was called with 3 positional arguments and no keyword "
        "arguments)")
    with pytest.raises(TypeError, match=r"signature .*: got an unexpected keyword argument 'labels' \(it was called "
                                        r"with 4 positional arguments and keyword arguments \['labels'\]\)"):
        step(model, opt, x, y, labels=y)
    with pytest.raises(TypeError, match="signature .*: too many positional arguments"):
        step(model, opt, x, y, 1.0, 2.0)
    assert step.transitions.traces == 0


def test_optimizer_state_of_another_optimizer_is_named():
    model, opt, step = _mlp_and_step()
    p = next(model.parameters())
    opt.state[p]["momentum_buffer"] = torch.zeros_like(p)  # SGD state in an AdamW
    with pytest.raises(spmd_ort.CompileError) as info:
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert str(info.value) == (
        "AdamW param group 0, parameter 0: its optimizer state has ['momentum_buffer'] but no ['step', 'exp_avg', "
        "'exp_avg_sq'] (state of another optimizer, loaded or assigned by hand?); eager AdamW fails here too. Fix: "
        "clear it (optimizer.state.clear()) or load a checkpoint saved with AdamW")
