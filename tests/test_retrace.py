"""The transition manager: what re-traces and what does not."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import spmd_ort
from helpers import assert_close_normwise, assert_ran_on_ort, assert_same_state, classification_step
from models import MLP


def _data(batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _setup(opt_cls=torch.optim.Adam, dynamic=None, **opt_kwargs):
    torch.manual_seed(0)
    model = MLP()
    opt = opt_cls(model.parameters(), **(opt_kwargs or {"lr": 1e-3}))
    return model, opt, spmd_ort.compile(backend="fx", dynamic=dynamic)(classification_step)


def test_new_batch_size_retraces_once_and_old_variant_is_reused(caplog):
    """With dynamic shapes off, one variant per shape (by default a new batch size makes the batch dim
    symbolic: tests/test_dynamic.py)."""
    model, opt, step = _setup(dynamic=False)
    step(model, opt, *_data(8))
    step(model, opt, *_data(8))  # Adam's state was created before the first trace: the same variant
    assert step.transitions.traces == 1
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        step(model, opt, *_data(4))
    assert step.transitions.traces == 2
    assert "re-tracing" in caplog.text and "(8, 32)" in caplog.text and "(4, 32)" in caplog.text
    step(model, opt, *_data(4))
    step(model, opt, *_data(8))  # back to the first shape: reused
    step(model, opt, *_data(4))
    assert step.transitions.traces == 2
    assert len(step.variants) == 2


def test_lr_change_never_retraces_and_takes_effect():
    model, opt, step = _setup(torch.optim.SGD, lr=0.1, momentum=0.9)
    eager_model, eager_opt = copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    for i, lr in enumerate([0.1, 0.05, 0.2, 0.0, 1e-3, 0.3]):
        for o in (opt, eager_opt):
            o.param_groups[0]["lr"] = lr
        x, y = _data(8, seed=i)
        torch.testing.assert_close(step(model, opt, x, y), classification_step(eager_model, eager_opt, x, y).detach())
    assert step.transitions.traces == 2
    assert_same_state(eager_model, model, eager_opt, opt)


class DropoutBatchNorm(torch.nn.Module):
    """Both layers that behave differently in eval(): BatchNorm (running statistics) and dropout."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64, bias=False)  # BatchNorm follows: a bias would get a zero gradient
        self.bn = torch.nn.BatchNorm1d(64)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.bn(self.fc1(x)))))


def step_with_logits(model, opt, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, logits.detach()


@pytest.mark.on_ort
@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_train_and_eval_alternately_match_eager_with_dropout_and_batchnorm(backend):
    """model.train() / model.eval() between calls: one variant per mode (the mode is part of the key), and
    every call equals eager's: in train mode dropout masks and the BatchNorm statistics' update, in eval
    mode no dropout and the running statistics used and left alone (outputs, loss, parameters, gradients,
    buffers, optimizer state; fx bit for bit, ORT to its rounding)."""
    torch.manual_seed(0)
    model = DropoutBatchNorm()
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    step = spmd_ort.compile(backend=backend)(step_with_logits)
    modes = ["train", "train", "eval", "eval", "train", "eval", "train"]
    for i, mode in enumerate(modes):
        for m in (model, eager):
            m.train(mode == "train")
        x, y = _data(8, seed=i)
        stats_before = eager.bn.running_mean.clone()
        torch.manual_seed(100 + i)  # the same dropout masks on both sides
        loss_e, logits_e = step_with_logits(eager, opt_e, x, y)
        torch.manual_seed(100 + i)
        loss, logits = step(model, opt, x, y)
        if backend == "fx":  # eager's kernels, fused AdamW on both sides
            assert torch.equal(loss, loss_e.detach()) and torch.equal(logits, logits_e), (i, mode)
        else:
            torch.testing.assert_close(loss, loss_e.detach(), rtol=1e-5, atol=1e-6)
            assert_close_normwise(logits, logits_e, msg=f"step {i} ({mode}) logits")
        assert_same_state(eager, model, opt_e, opt, where=f"step {i} ({mode})", normwise=backend == "ort")
        # the modes were exercised: the statistics move in train mode only
        assert torch.equal(eager.bn.running_mean, stats_before) == (mode == "eval"), (i, mode)
    assert int(model.bn.num_batches_tracked) == modes.count("train")
    assert step.transitions.traces == 2
    if backend == "ort":
        assert_ran_on_ort(step)


class DropoutOfInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):  # (B, T, 6)
        h = self.drop(x)
        return self.head(h), h == 0  # the output and where dropout dropped


def _step_showing_the_mask(model, opt, x, y):
    out, dropped = model(x)
    loss = F.mse_loss(out, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, dropped


@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_a_batch_in_another_memory_layout_retraces_and_draws_eagers_masks(backend, caplog):
    """Dropout of the batch draws in the batch's memory layout, and each graph fixes the layouts its random ops
    draw in (pin_random_layouts_pass): a transposed batch of the same shape is another variant, logged."""
    torch.manual_seed(0)
    model = DropoutOfInput()
    eager = copy.deepcopy(model)
    opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))
    step = spmd_ort.compile(backend=backend)(_step_showing_the_mask)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x = torch.randn(3, 4, 6, generator=g) if i % 2 == 0 else torch.randn(3, 6, 4, generator=g).transpose(1, 2)
        y = torch.randn(3, 4, 3, generator=g)
        torch.manual_seed(100 + i)
        loss_e, dropped_e = _step_showing_the_mask(eager, opt_e, x, y)
        torch.manual_seed(100 + i)
        with caplog.at_level(logging.INFO, logger="spmd_ort"):
            loss, dropped = step(model, opt, x, y)
        assert torch.equal(dropped, dropped_e), f"step {i}: another mask than eager's"
        torch.testing.assert_close(loss, loss_e.detach(), rtol=1e-5, atol=0)
    assert step.transitions.traces == 2 and len(step.variants) == 2
    assert "re-tracing" in caplog.text and "('layout', (0, 2, 1))" in caplog.text
    assert_same_state(eager, model, opt_e, opt, normwise=backend == "ort")


def test_scheduled_betas_momentum_weight_decay_never_retrace():
    """OneCycleLR cycles Adam's beta1 (and lr) every step; weight decay set by hand: all graph inputs."""
    model, opt, step = _setup(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=12) for o in (opt, eager_opt)]
    for i in range(12):
        if i == 6:
            for o in (opt, eager_opt):
                o.param_groups[0]["weight_decay"] = 0.3
                o.param_groups[0]["eps"] = 1e-6
        x, y = _data(8, seed=i)
        torch.testing.assert_close(step(model, opt, x, y), classification_step(eager_model, eager_opt, x, y).detach())
        for sched in scheds:
            sched.step()
    assert opt.param_groups[0]["betas"][0] != 0.95  # the schedule did move beta1
    assert step.transitions.traces == 1
    assert_same_state(eager_model, model, eager_opt, opt)


def test_maximize_switched_on_mid_run_retraces_and_takes_effect(caplog):
    """maximize is baked into the graph: switching it on re-traces, the log names it, and the numbers
    follow eager's through the switch (bitwise: both run torch's fused kernel)."""
    model, opt, step = _setup(torch.optim.Adam, lr=1e-2, fused=True)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-2, fused=True)
    for i in range(6):
        if i == 3:
            for o in (opt, eager_opt):
                o.param_groups[0]["maximize"] = True
        x, y = _data(8, seed=i)
        with caplog.at_level(logging.INFO, logger="spmd_ort"):
            loss = step(model, opt, x, y)
        assert torch.equal(loss, classification_step(eager_model, eager_opt, x, y).detach())
    assert step.transitions.traces == 2
    assert "re-tracing" in caplog.text and "maximize" in caplog.text
    for a, b in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_amsgrad_matches_eager_and_switching_it_on_later_is_a_clear_error():
    """amsgrad adds max_exp_avg_sq state.  Eager Adam cannot switch it on once state exists (KeyError);
    the compiled step says so in a CompileError instead, and changes nothing."""
    model, opt, step = _setup(torch.optim.Adam, lr=1e-2, amsgrad=True, fused=True)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-2, amsgrad=True, fused=True)
    for i in range(4):
        x, y = _data(8, seed=i)
        assert torch.equal(step(model, opt, x, y), classification_step(eager_model, eager_opt, x, y).detach())
    assert all("max_exp_avg_sq" in opt.state[p] for p in model.parameters())
    assert_same_state(eager_model, model, eager_opt, opt)
    model, opt, step = _setup(torch.optim.Adam, lr=1e-2, fused=True)
    step(model, opt, *_data(8))
    opt.param_groups[0]["amsgrad"] = True
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(spmd_ort.CompileError, match="amsgrad was switched on after.*max_exp_avg_sq"):
        step(model, opt, *_data(8))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_at_most_eight_variants_are_kept():
    model, opt, step = _setup(torch.optim.SGD, dynamic=False, lr=0.1)  # plain SGD: no state, one variant per shape
    for batch in range(1, 11):
        step(model, opt, *_data(batch))
    assert step.transitions.traces == 10
    assert len(step.variants) == 8
    step(model, opt, *_data(10))  # most recent: kept
    assert step.transitions.traces == 10
    step(model, opt, *_data(1))  # evicted: traced again
    assert step.transitions.traces == 11


def test_automatic_dynamic_shapes_keep_two_variants_for_any_batch_size():
    model, opt, step = _setup(torch.optim.SGD, lr=0.1)
    for batch in range(2, 12):
        step(model, opt, *_data(batch))
    assert step.transitions.traces == 2 and step.compiled.symbolic is not None


def test_non_tensor_argument_change_retraces():
    """A Python float argument: a constant of the first program; when it changes it becomes a graph input
    (one more trace, none after it), and every call equals eager's with that value."""
    model, opt, _ = _setup(torch.optim.SGD, lr=0.1)
    eager = copy.deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)

    def step_fn(model, opt, x, y, scale):
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = spmd_ort.compile(backend="fx")(step_fn)
    for i, (scale, traces) in enumerate([(1.0, 1), (1.0, 1), (2.0, 2), (0.5, 2), (3.0, 2)]):
        x, y = _data(8, seed=i)
        want = step_fn(eager, opt_e, x, y, scale).detach()
        assert torch.equal(step(model, opt, x, y, scale), want), (i, scale)
        assert step.transitions.traces == traces, (i, scale)
        assert_same_state(eager, model, opt_e, opt, where=f"call {i} (scale {scale})")


def test_adam_state_made_before_the_first_trace_only_for_parameters_that_get_a_gradient():
    """The first call creates Adam's state before tracing (one variant); a parameter that gets no gradient
    would get state eager never creates, so then the step is traced as eager runs it: twice, and the
    unused parameter has no state, as in eager."""
    def run(make_model):
        torch.manual_seed(0)
        model = make_model()
        eager = copy.deepcopy(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, fused=True)
        step = spmd_ort.compile(backend="fx")(classification_step)
        for i in range(3):
            x, y = _data(8, seed=i)
            assert torch.equal(step(model, opt, x, y), classification_step(eager, opt_e, x, y).detach())
        assert_same_state(eager, model, opt_e, opt)
        return step, model, opt

    step, _, _ = run(MLP)
    assert step.transitions.traces == 1

    class WithUnused(MLP):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(2, 2)

    step, model, opt = run(WithUnused)
    assert step.transitions.traces == 2
    assert model.unused.weight not in opt.state and len(opt.state) == len(list(model.parameters())) - 2
