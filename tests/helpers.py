"""Shared test helpers: train eager and compiled side by side and compare every step."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import spmd_ort

# fp32, rtol 1e-5 as the issue asks; atol for parameters that cross zero.
RTOL, ATOL = 1e-5, 1e-6


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


def assert_same_state(eager: nn.Module, compiled: nn.Module, eager_opt=None, compiled_opt=None, where=""):
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} param {name}: {m}")
        if a.grad is None:
            assert b.grad is None, f"{where} {name}: compiled has a grad, eager has none"
        else:
            torch.testing.assert_close(b.grad, a.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{where} grad {name}: {m}")
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} buffer {name}: {m}")
    if eager_opt is not None:
        sa, sb = eager_opt.state_dict(), compiled_opt.state_dict()
        assert sa["param_groups"] == sb["param_groups"], where
        assert sa["state"].keys() == sb["state"].keys(), where
        for k in sa["state"]:
            for key, va in sa["state"][k].items():
                vb = sb["state"][k][key]
                if isinstance(va, torch.Tensor):
                    torch.testing.assert_close(vb, va, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"{where} opt state {k}.{key}: {m}")
                else:
                    assert va == vb, (where, k, key)


def train_side_by_side(make_model: Callable[[], nn.Module], make_opt: Callable, step_fn: Callable,
                       batches: list, *, backend: str = "fx", make_sched: Callable | None = None,
                       compare_state: bool = True, **compile_kwargs):
    """Train an eager and a compiled copy on the same batches; assert equal loss and state each step.

    Returns (compiled step, eager losses, compiled losses).
    """
    model_e = make_model()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = make_opt(model_e), make_opt(model_c)
    sched_e = make_sched(opt_e) if make_sched else None
    sched_c = make_sched(opt_c) if make_sched else None
    compiled = spmd_ort.compile(backend=backend, **compile_kwargs)(step_fn)
    losses_e, losses_c = [], []
    for i, batch in enumerate(batches):
        le = step_fn(model_e, opt_e, *batch)
        lc = compiled(model_c, opt_c, *batch)
        losses_e.append(float(le.detach()))
        losses_c.append(float(lc))
        torch.testing.assert_close(lc, le.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"step {i} loss: {m}")
        if compare_state:
            assert_same_state(model_e, model_c, opt_e, opt_c, where=f"step {i}")
        if sched_e is not None:
            sched_e.step()
            sched_c.step()
    return compiled, losses_e, losses_c
