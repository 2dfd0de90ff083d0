"""Batch tensors that require grad get their .grad exactly as eager leaves it, on every backend."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd_ort.graph.slots import SlotKind
import spmd_ort
from helpers import assert_ran_on_ort, assert_same_state


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def accumulate(model, opt, x, y):
    """The optimizer zeroes only parameters: x.grad accumulates over steps (as eager)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def adversarial(model, opt, x, y, eps):
    """FGSM inside the step: the input gradient is read, the step trains on the perturbed batch and clears it."""
    F.cross_entropy(model(x), y).backward()
    x_adv = (x + eps * x.grad.sign()).detach()
    opt.zero_grad()
    loss = F.cross_entropy(model(x_adv), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    x.grad = None
    return loss


def saliency(model, opt, x, y):
    """Returns the input gradient and zeroes it in place (the tensor stays)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    sal = x.grad.abs().clone()
    x.grad.zero_()
    return loss, sal


STEPS = {"accumulate": accumulate, "adversarial": lambda m, o, x, y: adversarial(m, o, x, y, 0.1),
         "saliency": saliency}


def _compare(fn, backend, steps=3, x_grad_before=False):
    eager = _model()
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    step = spmd_ort.compile(backend=backend)(fn)
    g = torch.Generator().manual_seed(1)
    x_e = torch.randn(6, 8, generator=g).requires_grad_()
    x_c = x_e.detach().clone().requires_grad_()
    if x_grad_before:
        x_e.grad = torch.randn(6, 8, generator=g)
        x_c.grad = x_e.grad.clone()
    y = torch.randint(0, 4, (6,), generator=g)
    grads = []
    for i in range(steps):
        out_e, out_c = fn(eager, opt_e, x_e, y), step(compiled, opt_c, x_c, y)
        for a, b in zip(pytree_leaves(out_c), pytree_leaves(out_e)):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i} output: {m}")
        assert (x_c.grad is None) == (x_e.grad is None), f"step {i}: .grad {x_c.grad} vs eager {x_e.grad}"
        if x_e.grad is not None:
            torch.testing.assert_close(x_c.grad, x_e.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i} x.grad: {m}")
        grads.append(x_c.grad)
        assert_same_state(eager, compiled, opt_e, opt_c, where=f"step {i}", normwise=backend == "ort")
    return step, grads


def pytree_leaves(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", list(STEPS))
def test_input_grad_as_eager_fx(name):
    step, grads = _compare(STEPS[name], "fx")
    if name == "accumulate":
        assert grads[0] is grads[1] is grads[2]  # accumulated in place, as eager's AccumulateGrad does
    if name == "adversarial":
        assert grads == [None] * 3


@pytest.mark.on_ort
def test_input_grad_as_eager_ort():
    step, grads = _compare(accumulate, "ort", steps=3, x_grad_before=True)
    assert_ran_on_ort(step)


def test_existing_grad_is_accumulated_and_retraces_once_when_grad_appears():
    step, grads = _compare(accumulate, "fx", steps=3)
    # step 0: no x.grad, no optimizer state; step 1: both exist; step 2: same key
    assert step.transitions.traces == 2
    slots = [s for s in step.compiled.input_slots if s.kind is SlotKind.INPUT_GRAD]
    assert [s.name for s in slots] == ["x.grad"]
    assert [s.name for s in step.compiled.output_slots if s.kind is SlotKind.INPUT_GRAD] == ["x.grad"]


def test_same_tensor_passed_twice_accumulates_both_uses():
    """The same tensor passed twice is one autograd leaf: both uses accumulate into one .grad."""

    def both(model, opt, x, x_again, y):
        loss = F.cross_entropy(model(x) + model(x_again * 2), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    eager, compiled = _model(), _model()
    opt_e, opt_c = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))
    x_e = torch.randn(4, 8).requires_grad_()
    x_c = x_e.detach().clone().requires_grad_()
    y = torch.randint(0, 4, (4,))
    step = spmd_ort.compile(backend="fx")(both)
    both(eager, opt_e, x_e, x_e, y)
    step(compiled, opt_c, x_c, x_c, y)
    torch.testing.assert_close(x_c.grad, x_e.grad)
    # two different tensors are two inputs: a new variant, each gets its own gradient
    a_e, b_e = x_e.detach().clone().requires_grad_(), x_e.detach().clone().requires_grad_()
    a_c, b_c = a_e.detach().clone().requires_grad_(), b_e.detach().clone().requires_grad_()
    both(eager, opt_e, a_e, b_e, y)
    step(compiled, opt_c, a_c, b_c, y)
    assert step.transitions.traces == 2
    torch.testing.assert_close(a_c.grad, a_e.grad)
    torch.testing.assert_close(b_c.grad, b_e.grad)


def test_frozen_parameter_keeps_its_gradient():
    """Fuzzer counterexample: a parameter frozen after it got a gradient keeps the gradient (the compiled
    step dropped unchanged gradients, and SGD then stepped it once more than eager)."""
    eager = _model()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(eager(x), y).backward()
    compiled = copy.deepcopy(eager)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        b.grad = a.grad.clone()
    for m in (eager, compiled):
        m[0].weight.requires_grad_(False)
    opt_e, opt_c = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))

    def step_fn(model, opt, x, y):  # no zero_grad: gradients accumulate
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step = spmd_ort.compile(backend="fx")(step_fn)
    for i in range(2):
        step_fn(eager, opt_e, x, y)
        step(compiled, opt_c, x, y)
        assert_same_state(eager, compiled, opt_e, opt_c, where=f"step {i}")
    assert compiled[0].weight.grad is not None


def test_non_leaf_input_that_requires_grad_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = torch.randn(4, 8, requires_grad=True)
    x = w * 2
    with pytest.raises(spmd_ort.CompileError) as info:
        spmd_ort.compile(backend="fx")(accumulate)(model, opt, x, torch.randint(0, 4, (4,)))
    assert str(info.value) == (
        "the input `x` (shape (4, 8), float32) requires grad but is not a leaf (it was computed by MulBackward0 "
        "outside the step): the compiled step cannot backpropagate into the graph that produced it. Fix: pass "
        "`.detach().requires_grad_()` and apply its .grad yourself, or compute it inside the step. The model and "
        "optimizer are unchanged.")
    assert info.value.input == "x"
