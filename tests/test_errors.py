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


def test_input_that_changed_is_named_when_the_graph_fails_at_run_time():
    """A longer sequence than the position table traces (fake tensors do not see index values) and fails when
    it runs: the error names the input that changed since the last call that compiled."""
    from models import GPT, GPTConfig, gpt_batch

    cfg = GPTConfig(vocab=16, seq=8, d=8, heads=1, layers=1)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd_ort.compile(backend="fx")(classification_step)
    x, y = gpt_batch(cfg, 2, torch.Generator().manual_seed(0))
    step(model, opt, x, y)
    long_x = torch.randint(0, cfg.vocab, (2, 2 * cfg.seq))
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


def _mse_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y) + F.smooth_l1_loss(model(x), y) + F.huber_loss(model(x), y, delta=0.5)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_a_zero_size_batch_runs_as_eager_runs_it(backend):
    """Eager trains on an empty batch (NaN loss, zero gradients: AdamW still decays the weights); tracing raised
    ZeroDivisionError in torch's decompositions of the mse / smooth L1 / Huber loss backward, with "Fix: make the
    step function traceable"."""
    torch.manual_seed(0)
    model = MLP(d_out=4)
    eager = copy.deepcopy(model)
    opt, opt_e = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager))
    step = spmd_ort.compile(backend=backend)(_mse_step)
    g = torch.Generator().manual_seed(0)
    for i, rows in enumerate((8, 0, 8, 0)):
        x, y = torch.randn(rows, 32, generator=g), torch.randn(rows, 4, generator=g)
        expected = _mse_step(eager, opt_e, x, y)
        got = step(model, opt, x, y)
        torch.testing.assert_close(got, expected.detach(), equal_nan=True, rtol=1e-5, atol=1e-6)
        assert torch.isnan(got).item() == (rows == 0)
        for (n, p), pe in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, pe, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"step {i} {n}: {m}")
    backward_ops = {n.target for v in step.variants for n in v.traced_gm.graph.nodes}
    assert torch.ops.aten.mse_loss_backward.default in backward_ops  # non-empty batches keep eager's kernel


def test_tracing_that_divides_by_an_empty_input_names_it(monkeypatch):
    """Where tracing (not eager) fails on an empty input, the error names the input and why, not the step."""
    from spmd_ort.capture import trace

    monkeypatch.setattr(trace, "EAGER_DECOMPS", {})  # as before the fix above: torch's decomposition divides by 0
    model = MLP(d_out=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _snapshot(model, opt)
    with pytest.raises(spmd_ort.CompileError) as info:
        spmd_ort.compile(backend="fx")(_mse_step)(model, opt, torch.randn(0, 32), torch.randn(0, 4))
    msg = str(info.value)
    assert "the input `x` is empty (shape (0, 32), float32)" in msg and "`huber_loss_backward`" in msg, msg
    assert "drop_last=True" in msg and "traceable" not in msg and info.value.input == "x"
    _assert_identical(before, model, opt)


def _user_error_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if x.shape[0] % 3:
        raise ValueError("this step wants a batch that is a multiple of 3")
    opt.step()
    return loss


def _double_unscale_step(model, opt, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return loss


class RaisingForward(MLP):
    def forward(self, x):
        if x.shape[-1] != 32:
            raise ValueError(f"expected 32 features, got {x.shape[-1]}")
        return super().forward(x)


OWN_ERRORS = {  # step, model class, the step's extra leading arguments, the batch's features, what eager raises
    "in the step": (_user_error_step, MLP, (), 32, ValueError, "this step wants a batch that is a multiple of 3"),
    "unscale_ twice": (_double_unscale_step, MLP, (torch.amp.GradScaler("cpu"),), 32, RuntimeError,
                       "unscale_() has already been called on this optimizer since the last update()"),
    "in the model's forward": (classification_step, RaisingForward, (), 31, ValueError, "expected 32 features, got 31"),
}


@pytest.mark.parametrize("case", OWN_ERRORS)
def test_the_steps_own_errors_are_raised_as_eager_raises_them(case):
    """An error the step's own code raises (eager raises it too) ended with "Fix: make the step function
    traceable"; it is now eager's exception, with a note that it is no limit of tracing, and nothing changed."""
    fn, cls, extra, features, kind, text = OWN_ERRORS[case]
    torch.manual_seed(0)
    model = cls()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    F.cross_entropy(model(x), y).backward()  # real gradients and optimizer state exist
    opt.step()
    batch = (torch.randn(4, features), y)
    eager = copy.deepcopy((model, opt, *extra))
    with pytest.raises(kind) as eager_info:
        fn(*eager, *batch)
    before = _snapshot(model, opt)
    with pytest.raises(kind) as info:
        spmd_ort.compile(backend="fx")(fn)(model, opt, *extra, *batch)
    assert not isinstance(info.value, spmd_ort.CompileError)
    assert str(info.value) == str(eager_info.value) and text in str(info.value)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "raised this itself" in notes and "no limit of tracing" in notes and "unchanged" in notes, notes
    _assert_identical(before, model, opt)


def test_a_deepspeed_plan_given_the_wrong_number_of_micro_batches_says_so():
    model = MLP()
    plan = spmd_ort.from_deepspeed_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, model,
                                          world_size=1)
    step = spmd_ort.compile(backend="fx")(plan.make_train_step(lambda m, x, y: F.cross_entropy(m(x), y)))
    with pytest.raises(ValueError, match=r"accumulates 2 micro-batches per step \(gradient_accumulation_steps\), "
                                         r"but `micro_batches` holds 1: pass a list of 2 batches") as info:
        step(model, plan.optimizer, plan.scaler, [(torch.randn(4, 32), torch.randint(0, 10, (4,)))])
    assert "traceable" not in str(info.value) and not plan.optimizer.state


@pytest.mark.parametrize("kind", ["numpy", "list"])
def test_a_batch_that_is_no_tensor_names_the_input_not_a_module(kind, caplog):
    """A numpy array or a list of numbers as the batch was blamed on the first module it reached (`fc1` "cannot be
    traced", a WARNING that it runs opaquely, then an error saying to make it traceable)."""
    import numpy as np

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _snapshot(model, opt)
    x = np.random.default_rng(0).standard_normal((4, 32), dtype=np.float32)
    x = x if kind == "numpy" else x.tolist()
    with caplog.at_level(logging.WARNING, logger="spmd_ort"), pytest.raises(spmd_ort.CompileError) as info:
        spmd_ort.compile(backend="fx")(classification_step)(model, opt, x, torch.randint(0, 10, (4,)))
    msg = str(info.value)
    what = "a numpy.ndarray (shape (4, 32), float32)" if kind == "numpy" else "a list of numbers (4 x 32)"
    fix = "torch.from_numpy(x)" if kind == "numpy" else "torch.tensor(x)"
    assert f"the input `x` is {what}, not a torch.Tensor: linear() in module `fc1` rejected it" in msg, msg
    assert f"Fix: pass a torch.Tensor, e.g. {fix}" in msg and "traceable" not in msg, msg
    assert info.value.input == "x" and info.value.fqn == "fc1"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # fc1 was never made opaque
    _assert_identical(before, model, opt)
