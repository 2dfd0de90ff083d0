"""Functional optimizer updates traced in place of ``optimizer.step()``.

Tracing torch's own ``step()`` bakes every hyper-parameter into the graph as a
Python float (so an LR schedule would re-trace each step) and, outside
``torch.compile``, reads the step count with ``.item()``.  Instead, while the
train step is traced, ``optimizer.step`` is replaced by the rule registered for
its class in :data:`OPTIMIZER_RULES`.  A rule emits one functional multi-tensor
op per param group (``spmd_ort::adam`` / ``spmd_ort::sgd``) whose
hyper-parameters are a graph input, and copies the results back into the traced state so the
graph returns the new parameters and optimizer state.

The ops (:mod:`spmd_ort.graph.ops`, bodies in :mod:`spmd_ort.runtime.kernels`) run torch's
fused multi-tensor kernels, so compiled numbers equal eager ``fused=True``
exactly and ``foreach``/for-loop eager within fp32 rounding (float16/bfloat16 SGD on the
CPU: eager's for-loop update, exactly; ``fused=True`` there is refused, see
:func:`~spmd_ort.runtime.kernels.fused_sgd_updates`).  All scalar
hyper-parameters of a group travel in one float64 host tensor (``hparams``)
that the op reads when it runs.  Each op has an in-place twin (``adam_``/``sgd_``)
that the ``reinplace_optimizer_pass`` uses when the old state is not read afterwards.

A GradScaler hands a rule ``opt.found_inf`` (and, for fused optimizers, ``opt.grad_scale``)
as it hands them to torch's fused optimizers (:func:`amp_arguments`); the op passes
``found_inf`` to the fused kernel, which skips the update where it is 1.  A parameter whose gradient
only an opaque part makes gets a presence entry (``present``; :mod:`spmd_ort.capture.presence`): the op skips
it on a step where no part made its gradient, as eager's optimizer skips a parameter whose ``.grad`` is None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from spmd_ort.capture import presence
from spmd_ort.distributed.dtensor import is_dtensor, local, spec_of, to_spec, wrap
from spmd_ort.graph import ops
from spmd_ort.errors import CompileError
from spmd_ort.runtime import kernels

# --------------------------------------------------------------------------
# Rules: run at trace time on the traced (proxy) param groups and state.
# --------------------------------------------------------------------------


def _check_group(opt: torch.optim.Optimizer, gi: int, group: dict, unsupported: tuple[str, ...]) -> None:
    for key in unsupported:
        if group.get(key):
            raise CompileError(
                f"{type(opt).__name__} param group {gi}: option {key}=True is not supported by the "
                "compiled step; remove it or step this optimizer outside the compiled function",
                op=f"{type(opt).__name__}.step")


def _with_grad(group: dict) -> list[Tensor]:
    return [p for p in group["params"] if p.grad is not None]


def _copy_back(dst: list[Tensor], src: list[Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        local(d).copy_(s)


def _locals(ts: list[Tensor]) -> list[Tensor]:
    """The updates are elementwise over tensors placed alike (a DTensor parameter's state shares its
    placements): they run on the local tensors."""
    return [local(t) for t in ts]


def _local_grads(params: list[Tensor]) -> list[Tensor]:
    """Each gradient's local tensor, placed as its parameter first: a replicated parameter used on sharded
    activations (sequence parallel) gets a pending sum (``Partial``), reduced here as eager's update reduces it."""
    return [local(to_spec(p.grad, spec_of(p))) for p in params]


def amp_arguments(opt: torch.optim.Optimizer, params: list[Tensor]) -> Tensor | None:
    """What a GradScaler passed this step (``opt.grad_scale`` / ``opt.found_inf``, as torch's fused optimizers
    read them); returns ``found_inf``.

    ``grad_scale`` (the fused path of ``GradScaler.step``): the gradients are divided by it here, in
    the graph, so that ``p.grad`` ends as eager's fused kernel leaves it: unscaled, or untouched
    where the kernel skips (``found_inf == 1``).  The division is the kernel's own (``grad / scale``),
    so the update is bit for bit the same.
    """
    grad_scale = opt.__dict__.get("grad_scale")
    found_inf = opt.__dict__.get("found_inf")
    if grad_scale is not None:
        for p in params:
            unscaled = p.grad / grad_scale.to(p.grad.device)
            if found_inf is not None:
                unscaled = torch.where(found_inf.to(p.grad.device) == 1.0, p.grad, unscaled)
            p.grad.copy_(unscaled)
    return found_inf


def initial_step(group: dict, p: Tensor) -> Tensor:
    """Adam's step counter as torch creates it: a float32 scalar, on the parameter's device only when
    fused/capturable."""
    on_param = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=torch.float32, device=p.device if on_param else "cpu")


def adam_initial_state(group: dict, like: Tensor) -> dict:
    """The state torch.optim.Adam._init_group creates for a parameter (``like``: its gradient)."""
    zeros = lambda: torch.zeros_like(like, memory_format=torch.preserve_format)  # noqa: E731
    state = {"step": initial_step(group, like), "exp_avg": zeros(), "exp_avg_sq": zeros()}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = zeros()
    return state


def adam_rule(opt: torch.optim.Optimizer) -> None:
    """Adam and AdamW (``decoupled_weight_decay``)."""
    for gi, group in enumerate(opt.param_groups):
        _check_group(opt, gi, group, ("differentiable",))
        params = _with_grad(group)
        if not params:
            continue
        amsgrad = group["amsgrad"]
        for j, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise CompileError("Adam does not support sparse gradients", op="Adam.step")
            state = opt.state[p]
            missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in state]
            if state and missing:
                raise CompileError(
                    f"{type(opt).__name__} param group {gi}, parameter {j}: its optimizer state has "
                    f"{sorted(state)} but no {missing} (state of another optimizer, loaded or assigned by hand?); "
                    f"eager {type(opt).__name__} fails here too. Fix: clear it (optimizer.state.clear()) or load a "
                    f"checkpoint saved with {type(opt).__name__}", op=f"{type(opt).__name__}.step")
            if len(state) == 0:
                # Shaped like the gradient (= the parameter): under fully_shard both are
                # the local shard once the passes have run, so new state is sharded too.
                state.update(adam_initial_state(group, p.grad))
        states = [opt.state[p] for p in params]
        if amsgrad and any("max_exp_avg_sq" not in st for st in states):
            raise CompileError(
                f"{type(opt).__name__} param group {gi}: amsgrad was switched on after the optimizer state was "
                "created, so there is no max_exp_avg_sq to update (eager Adam fails here too, with a KeyError); "
                "set amsgrad when the optimizer is built", op=f"{type(opt).__name__}.step")
        lists = dict(
            params=params,
            exp_avgs=[s["exp_avg"] for s in states],
            exp_avg_sqs=[s["exp_avg_sq"] for s in states],
            max_exp_avg_sqs=[s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            steps=[s["step"] for s in states],
        )
        found_inf = amp_arguments(opt, params)
        present, present_index = presence.positions(opt, params)
        out = ops.adam(
            _locals(params), _local_grads(params), _locals(lists["exp_avgs"]), _locals(lists["exp_avg_sqs"]),
            _locals(lists["max_exp_avg_sqs"]), lists["steps"], group[HPARAMS_KEY], bool(amsgrad),
            bool(group["maximize"]), bool(group.get("decoupled_weight_decay", False)), found_inf, present,
            present_index)
        i = 0
        for name in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"):
            n = len(lists[name])
            _copy_back(lists[name], out[i:i + n])
            i += n


def sgd_rule(opt: torch.optim.Optimizer) -> None:
    """SGD with momentum, dampening, nesterov, weight decay, maximize.

    With momentum, parameters that have a buffer and parameters that do not yet (eager's first
    step for them: the buffer starts as the gradient) are two ops: a group has both after a step
    that skipped a parameter without a gradient, as eager's SGD does.
    """
    for gi, group in enumerate(opt.param_groups):
        _check_group(opt, gi, group, ("differentiable",))
        params = _with_grad(group)
        if not params:
            continue
        momentum = float(group["momentum"])
        if momentum == 0:
            _sgd_update(opt, group, params, [], False)
            continue
        have = [p for p in params if opt.state[p].get("momentum_buffer") is not None]
        fresh = [p for p in params if opt.state[p].get("momentum_buffer") is None]
        if have:
            _sgd_update(opt, group, have, [opt.state[p]["momentum_buffer"] for p in have], True)
        if fresh:
            _sgd_update(opt, group, fresh, [], True)


def _sgd_update(opt: torch.optim.Optimizer, group: dict, params: list[Tensor], bufs: list[Tensor],
                has_momentum: bool) -> None:
    """One ``spmd_ort::sgd`` op over ``params`` (with ``bufs``, or none: their first momentum step)."""
    found_inf = amp_arguments(opt, params)
    present, present_index = presence.positions(opt, params)
    out = ops.sgd(
        _locals(params), _local_grads(params), _locals(bufs), group[HPARAMS_KEY], has_momentum,
        bool(group["nesterov"]), bool(group["maximize"]), found_inf, present, present_index)
    _copy_back(params, out[:len(params)])
    if has_momentum:
        new_bufs = out[len(params):]
        if bufs:
            _copy_back(bufs, new_bufs)
        else:
            for p, b in zip(params, new_bufs):
                opt.state[p]["momentum_buffer"] = wrap(b, spec_of(p)) if is_dtensor(p) else b
        if group["nesterov"] and not group["maximize"] and _eager_foreach(group, params):
            _nesterov_grads_as_foreach(group, params, new_bufs)


def _eager_foreach(group: dict, params: list[Tensor]) -> bool:
    """Whether eager ``step()`` runs this group with torch's foreach implementation (``foreach=True``, or
    neither flag set and every parameter on a device with foreach kernels: torch's own default)."""
    if group.get("fused"):
        return False
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    devices = _get_foreach_kernels_supported_devices()
    return not group.get("differentiable") and all(local(p).device.type in devices for p in params)


def _nesterov_grads_as_foreach(group: dict, params: list[Tensor], new_bufs: list[Tensor]) -> None:
    """Eager's foreach SGD with nesterov (no weight decay, no maximize) adds ``momentum * buf`` to the
    gradients in place (``torch._foreach_add_(device_grads, bufs, alpha=momentum)``), so ``p.grad`` after
    ``step()`` is the nesterov direction, which a step that keeps its gradients accumulates into.  The graph
    does the same; weight decay (a hyper-parameter input, so a schedule never re-traces) selects it per step,
    as eager's foreach path adds to a new tensor when it is not 0."""
    hparams = group[HPARAMS_KEY]
    # one copy per device, not per parameter; not waited for: a blocking host-to-device copy stalls the host until
    # the GPU has run everything queued before it
    on_device: dict[torch.device, tuple[Tensor, Tensor]] = {}
    for p, buf in zip(params, new_bufs, strict=True):
        if is_dtensor(p.grad) and spec_of(p.grad) != spec_of(p):
            continue  # a pending (Partial) gradient: eager's foreach add would redistribute it first
        grad = local(p.grad)
        if grad.device not in on_device:
            on_device[grad.device] = tuple(hparams[i].to(grad.device, non_blocking=True) for i in (1, 3))
        momentum, weight_decay = on_device[grad.device]
        moved = grad + (buf.to(grad.device) * momentum.to(grad.dtype))
        grad.copy_(torch.where(weight_decay == 0, moved, grad))


# Trace-time only: the param-group key under which a rule finds its hparams tensor.
HPARAMS_KEY = "__spmd_ort_hparams__"


def _adam_hparams(group: dict) -> list[float]:
    beta1, beta2 = group["betas"]
    return [float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"])]


def _sgd_hparams(group: dict) -> list[float]:
    return [float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
            float(group["weight_decay"])]


@dataclass(frozen=True)
class OptimizerRule:
    """How to trace one optimizer class.

    ``hparams(group)`` lists the group's scalar hyper-parameters, fed to the
    graph as one float64 tensor per group each step (so schedulers of lr,
    betas, momentum or weight decay never re-trace); ``lifted`` names the group
    keys they come from.  ``structure(group)`` is what else the graph is
    specialised on (e.g. whether SGD has momentum buffers at all).
    ``initial_state(group, param)``, where given, is exactly the state the
    optimizer's first step creates and then updates as if it had been there
    (Adam's zeros; not SGD's momentum buffer, which the first step sets to the
    gradient): the compiled step creates it before its first trace, so the first
    call traces and compiles one variant instead of two.
    ``refuse(group, param)``: why a parameter of this group is not compiled (None: it is),
    asked before tracing, so the error names the parameter and nothing has changed.
    """

    step: Callable[[torch.optim.Optimizer], None]
    hparams: Callable[[dict], list[float]]
    lifted: tuple[str, ...]
    structure: Callable[[dict], tuple] = lambda group: ()
    initial_state: Callable[[dict, Tensor], dict] | None = None
    refuse: Callable[[dict, Tensor], str | None] = lambda group, param: None


def _sgd_refuse(group: dict, param: Tensor) -> str | None:
    if not group.get("fused") or kernels.fused_sgd_updates(param):
        return None
    return ("torch's fused CPU SGD kernel leaves float16 and bfloat16 parameters unchanged, so eager "
            "SGD(fused=True) does not train it either. Fix: build the optimizer without fused=True (eager's "
            "default, the for-loop update, trains it, and so does the compiled step)")


OPTIMIZER_RULES: dict[type, OptimizerRule] = {
    torch.optim.Adam: OptimizerRule(adam_rule, _adam_hparams, ("lr", "betas", "weight_decay", "eps"),
                                    initial_state=adam_initial_state),
    torch.optim.AdamW: OptimizerRule(adam_rule, _adam_hparams, ("lr", "betas", "weight_decay", "eps"),
                                     initial_state=adam_initial_state),
    torch.optim.SGD: OptimizerRule(sgd_rule, _sgd_hparams, ("lr", "momentum", "dampening", "weight_decay"),
                                   structure=lambda group: (group["momentum"] != 0,), refuse=_sgd_refuse),
}


def rule_for(opt: torch.optim.Optimizer) -> OptimizerRule:
    rule = OPTIMIZER_RULES.get(type(opt))
    if rule is None:
        names = ", ".join(sorted(t.__name__ for t in OPTIMIZER_RULES))
        raise CompileError(
            f"optimizer {type(opt).__module__}.{type(opt).__qualname__} has no functional rule "
            f"(supported: {names}); register one in spmd_ort.capture.optim.OPTIMIZER_RULES or step this "
            "optimizer outside the compiled function", op=f"{type(opt).__name__}.step")
    return rule
