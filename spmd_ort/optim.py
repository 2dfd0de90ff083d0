"""Functional optimizer updates traced in place of ``optimizer.step()``.

Tracing torch's own ``step()`` bakes every hyper-parameter into the graph as a
Python float (so an LR schedule would re-trace each step) and, outside
``torch.compile``, reads the step count with ``.item()``.  Instead, while the
train step is traced, ``optimizer.step`` is replaced by the rule registered for
its class in :data:`OPTIMIZER_RULES`.  A rule emits one functional multi-tensor
op per param group (``spmd_ort::adam`` / ``spmd_ort::sgd``) whose
hyper-parameters are a graph input, and copies the results back into the traced state so the
graph returns the new parameters and optimizer state.

The ops run torch's fused multi-tensor kernels, so compiled numbers equal eager
``fused=True`` exactly and ``foreach``/for-loop eager within fp32 rounding.
All scalar hyper-parameters of a group travel in one float64 host tensor
(``hparams``) that the op reads when it runs.  Each op has an in-place twin (``adam_``/``sgd_``) that the
``reinplace_optimizer_pass`` uses when the old state is not read afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import CompileError

# --------------------------------------------------------------------------
# Ops.  Output layouts are flat lists:
#   adam: params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (amsgrad only), steps
#   sgd:  params, momentum_buffers (momentum != 0 only)
# --------------------------------------------------------------------------


def _adam_kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad, maximize,
                 decoupled):
    # hparams is a host tensor read here, at run time: changing it never re-traces.
    lr, beta1, beta2, weight_decay, eps = hparams.tolist()
    torch._foreach_add_(steps, 1)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
           lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
           amsgrad=amsgrad, maximize=maximize)


def _functional_adam(kernel, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad,
                     maximize, decoupled) -> list[Tensor]:
    """Run an in-place Adam ``kernel`` on copies of the state; the copies, flat, in output layout."""
    out = [[t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)]
    kernel(out[0], grads, out[1], out[2], out[3], out[4], hparams, amsgrad, maximize, decoupled)
    return [t for ts in out for t in ts]


def _adam_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad, maximize, decoupled):
    return [torch.empty_like(t) for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) for t in ts]


ADAM_OUTPUTS = ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps")
SGD_OUTPUTS = ("params", "momentum_buffers")
# functional op -> (in-place twin, names of the mutated list arguments in output order)
INPLACE_TWINS: dict = {}


def _register_twin(name: str, outputs: tuple[str, ...]) -> None:
    ops = torch.ops.spmd_ort
    INPLACE_TWINS[getattr(ops, name).default] = (getattr(ops, f"{name}_").default, outputs)


def _define_adam(name: str, kernel, doc: str) -> None:
    """``spmd_ort::<name>`` (functional, returns the new state; see layout) and ``<name>_`` (in place)."""

    def functional(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                   max_exp_avg_sqs: list[Tensor], steps: list[Tensor], hparams: Tensor, amsgrad: bool,
                   maximize: bool, decoupled: bool) -> list[Tensor]:
        return _functional_adam(kernel, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams,
                                amsgrad, maximize, decoupled)

    def in_place(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 max_exp_avg_sqs: list[Tensor], steps: list[Tensor], hparams: Tensor, amsgrad: bool,
                 maximize: bool, decoupled: bool) -> None:
        kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad, maximize, decoupled)

    functional.__doc__, in_place.__doc__ = doc, f"In-place twin of spmd_ort::{name}: updates the state it is given."
    op = torch.library.custom_op(f"spmd_ort::{name}", functional, mutates_args=())
    op.register_fake(_adam_fake)
    torch.library.custom_op(f"spmd_ort::{name}_", in_place, mutates_args=ADAM_OUTPUTS)
    _register_twin(name, ADAM_OUTPUTS)


_define_adam("adam", _adam_kernel, """Functional Adam/AdamW over one param group; returns the new state (see layout).

    ``hparams`` is a float64 host tensor ``[lr, beta1, beta2, weight_decay, eps]``.
    """)


def _sgd_kernel(params, grads, bufs, hparams, nesterov, maximize, first_step):
    lr, momentum, dampening, weight_decay = hparams.tolist()
    torch._fused_sgd_(params, grads, bufs if bufs else [], weight_decay=weight_decay,
                      momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                      maximize=maximize, is_first_step=first_step)


def _functional_sgd(kernel, params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize,
                    buffer_device=None) -> list[Tensor]:
    """Run an in-place SGD ``kernel`` on copies; new params + momentum buffers (first step: new buffers)."""
    new_params = [p.clone() for p in params]
    first = has_momentum and not momentum_buffers
    if not has_momentum:
        bufs = []
    elif first:
        bufs = [torch.empty_like(g, device=buffer_device) for g in grads]
    else:
        bufs = [b.clone() for b in momentum_buffers]
    kernel(new_params, grads, bufs, hparams, nesterov, maximize, first)
    return new_params + bufs


def _sgd_fake(params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize, buffer_device=None):
    bufs = [torch.empty_like(g, device=buffer_device) for g in grads] if has_momentum else []
    return [torch.empty_like(p) for p in params] + bufs


def _define_sgd(name: str, kernel, doc: str, buffer_device: str | None = None) -> None:
    """``spmd_ort::<name>`` (functional: new params + momentum buffers) and ``<name>_`` (in place, never the
    first momentum step: buffers must exist); first-step buffers are made on ``buffer_device``."""

    def functional(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], hparams: Tensor,
                   has_momentum: bool, nesterov: bool, maximize: bool) -> list[Tensor]:
        return _functional_sgd(kernel, params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize,
                               buffer_device)

    def fake(params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize):
        return _sgd_fake(params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize, buffer_device)

    def in_place(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], hparams: Tensor,
                 has_momentum: bool, nesterov: bool, maximize: bool) -> None:
        kernel(params, grads, momentum_buffers, hparams, nesterov, maximize, False)

    functional.__doc__, in_place.__doc__ = doc, f"In-place twin of spmd_ort::{name}."
    op = torch.library.custom_op(f"spmd_ort::{name}", functional, mutates_args=())
    op.register_fake(fake)
    torch.library.custom_op(f"spmd_ort::{name}_", in_place, mutates_args=SGD_OUTPUTS)
    _register_twin(name, SGD_OUTPUTS)


_define_sgd("sgd", _sgd_kernel, """Functional SGD over one param group.

    ``hparams`` is ``[lr, momentum, dampening, weight_decay]``.

    An empty ``momentum_buffers`` with ``has_momentum`` is the first step:
    buffers start as the gradient (as torch does).
    """)


# --------------------------------------------------------------------------
# Host twins (offload_optimizer="cpu"): the same updates on the host with the
# native kernel of csrc/ (spmd_ort.native).  Gradients and parameters on a
# device are copied to the host and the new parameters back; optimizer state
# stays in host memory.  On a CPU-only machine host == device: nothing moves.
# --------------------------------------------------------------------------


def _on_host(ts: list[Tensor]) -> list[Tensor]:
    return [t if t.device.type == "cpu" else t.to("cpu") for t in ts]


def _back(dst: list[Tensor], host: list[Tensor]) -> None:
    for d, h in zip(dst, host):
        if d is not h:
            d.copy_(h, non_blocking=True)


def _host_adam_kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad, maximize,
                      decoupled):
    from . import native

    lr, beta1, beta2, weight_decay, eps = hparams.tolist()
    torch._foreach_add_(steps, 1)
    hp, hm, hv, hmax, hs = (_on_host(ts) for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps))
    native.adam_(hp, _on_host(grads), hm, hv, hmax, hs, lr=lr, beta1=beta1, beta2=beta2,
                 weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, decoupled=decoupled)
    for dst, host in ((params, hp), (exp_avgs, hm), (exp_avg_sqs, hv), (max_exp_avg_sqs, hmax), (steps, hs)):
        _back(dst, host)


_define_adam("host_adam", _host_adam_kernel, ":func:`adam` with the update on the host (native kernel).")


def _host_sgd_kernel(params, grads, bufs, hparams, nesterov, maximize, first_step):
    from . import native

    lr, momentum, dampening, weight_decay = hparams.tolist()
    hp, hb = _on_host(params), _on_host(bufs)
    native.sgd_(hp, _on_host(grads), hb, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                nesterov=nesterov, maximize=maximize, is_first_step=first_step)
    _back(params, hp)
    _back(bufs, hb)


_define_sgd("host_sgd", _host_sgd_kernel,
            ":func:`sgd` with the update on the host (native kernel); momentum buffers live on the host.",
            buffer_device="cpu")

# device op -> its host twin (offload_optimizer)
HOST_TWINS: dict = {
    torch.ops.spmd_ort.adam.default: torch.ops.spmd_ort.host_adam.default,
    torch.ops.spmd_ort.adam_.default: torch.ops.spmd_ort.host_adam_.default,
    torch.ops.spmd_ort.sgd.default: torch.ops.spmd_ort.host_sgd.default,
    torch.ops.spmd_ort.sgd_.default: torch.ops.spmd_ort.host_sgd_.default,
}

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
        d.copy_(s)


def initial_step(group: dict, p: Tensor) -> Tensor:
    """Adam's step counter as torch creates it: a float32 scalar, on the parameter's device only when fused/capturable."""
    on_param = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=torch.float32, device=p.device if on_param else "cpu")


def adam_rule(opt: torch.optim.Optimizer) -> None:
    """Adam and AdamW (``decoupled_weight_decay``)."""
    for gi, group in enumerate(opt.param_groups):
        _check_group(opt, gi, group, ("differentiable",))
        params = _with_grad(group)
        if not params:
            continue
        amsgrad = group["amsgrad"]
        for p in params:
            if p.grad.is_sparse:
                raise CompileError("Adam does not support sparse gradients", op="Adam.step")
            state = opt.state[p]
            if len(state) == 0:
                # Same initial state as torch.optim.Adam._init_group.
                state["step"] = initial_step(group, p)
                # Shaped like the gradient (= the parameter): under fully_shard both are
                # the local shard once the passes have run, so new state is sharded too.
                state["exp_avg"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        states = [opt.state[p] for p in params]
        lists = dict(
            params=params,
            exp_avgs=[s["exp_avg"] for s in states],
            exp_avg_sqs=[s["exp_avg_sq"] for s in states],
            max_exp_avg_sqs=[s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            steps=[s["step"] for s in states],
        )
        out = torch.ops.spmd_ort.adam(
            params, [p.grad for p in params], lists["exp_avgs"], lists["exp_avg_sqs"],
            lists["max_exp_avg_sqs"], lists["steps"], group[HPARAMS_KEY], bool(amsgrad), bool(group["maximize"]),
            bool(group.get("decoupled_weight_decay", False)))
        i = 0
        for name in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"):
            n = len(lists[name])
            _copy_back(lists[name], out[i:i + n])
            i += n


def sgd_rule(opt: torch.optim.Optimizer) -> None:
    """SGD with momentum, dampening, nesterov, weight decay, maximize."""
    for gi, group in enumerate(opt.param_groups):
        _check_group(opt, gi, group, ("differentiable",))
        params = _with_grad(group)
        if not params:
            continue
        momentum = float(group["momentum"])
        bufs = [opt.state[p].get("momentum_buffer") for p in params]
        have = [b is not None for b in bufs]
        if momentum != 0 and any(have) and not all(have):
            raise CompileError(
                f"SGD param group {gi}: some parameters have a momentum buffer and some do not; "
                "the compiled step needs all or none", op="SGD.step")
        bufs = [b for b in bufs if b is not None]
        out = torch.ops.spmd_ort.sgd(
            params, [p.grad for p in params], bufs, group[HPARAMS_KEY], momentum != 0, bool(group["nesterov"]),
            bool(group["maximize"]))
        _copy_back(params, out[:len(params)])
        if momentum != 0:
            new_bufs = out[len(params):]
            if bufs:
                _copy_back(bufs, new_bufs)
            else:
                for p, b in zip(params, new_bufs):
                    opt.state[p]["momentum_buffer"] = b


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
    """

    step: Callable[[torch.optim.Optimizer], None]
    hparams: Callable[[dict], list[float]]
    lifted: tuple[str, ...]
    structure: Callable[[dict], tuple] = lambda group: ()


OPTIMIZER_RULES: dict[type, OptimizerRule] = {
    torch.optim.Adam: OptimizerRule(adam_rule, _adam_hparams, ("lr", "betas", "weight_decay", "eps")),
    torch.optim.AdamW: OptimizerRule(adam_rule, _adam_hparams, ("lr", "betas", "weight_decay", "eps")),
    torch.optim.SGD: OptimizerRule(sgd_rule, _sgd_hparams, ("lr", "momentum", "dampening", "weight_decay"),
                                   structure=lambda group: (group["momentum"] != 0,)),
}


def rule_for(opt: torch.optim.Optimizer) -> OptimizerRule:
    rule = OPTIMIZER_RULES.get(type(opt))
    if rule is None:
        names = ", ".join(sorted(t.__name__ for t in OPTIMIZER_RULES))
        raise CompileError(
            f"optimizer {type(opt).__module__}.{type(opt).__qualname__} has no functional rule "
            f"(supported: {names}); register one in spmd_ort.optim.OPTIMIZER_RULES or step this "
            "optimizer outside the compiled function", op=f"{type(opt).__name__}.step")
    return rule
