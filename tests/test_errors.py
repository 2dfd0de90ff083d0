"""Bad input gets a clear error and loses nothing."""

from __future__ import annotations

import copy

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
