"""Bodies of the optimizer ops of :mod:`spmd_ort.graph.ops` (what runs when the graph runs).

Output layouts are flat lists:

* adam: params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (amsgrad only), steps
* sgd:  params, momentum_buffers (momentum != 0 only)

Device kernels run torch's fused multi-tensor kernels, so compiled numbers equal
eager ``fused=True`` exactly (a CUDA-graphed step's learning rate is a float32 device tensor: see
:func:`hparam_numbers`) (SGD over float16/bfloat16 CPU tensors, which torch's fused
CPU kernel leaves unchanged, runs eager's default there, the for-loop update).  Host
kernels (``offload_optimizer="cpu"``) run the
native kernel of ``csrc/`` (:mod:`spmd_ort.runtime.native`) on host tensors: device
gradients and parameters are copied in, new parameters back; optimizer state
stays in host memory.  On a CPU-only machine host == device and nothing moves.
All scalar hyper-parameters of a group travel in one float64 host tensor
(``hparams``), read when the op runs, so changing them never re-traces.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

from spmd_ort.runtime import native
from spmd_ort.runtime.step_runtime import active, current

ADAM_OUTPUTS = ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps")
SGD_OUTPUTS = ("params", "momentum_buffers")


# ---------------------------------------------------------------------- Adam / AdamW
def hparam_numbers(hparams: Tensor, like: list[Tensor] = ()) -> tuple[list[float], Tensor | None]:
    """A group's hyper-parameters as numbers, and its learning rate as a device tensor where they live on a GPU.

    On the host they are read (a host read, no wait).  On a GPU (a CUDA-graphed step: they are device tensors that
    the host writes before each replay) the numbers are the values the host wrote this step
    (:attr:`StepRuntime.hparam_values`), which a capture freezes, and the learning rate, the one a schedule changes
    every step, is also given as a float32 tensor on the device of ``like`` (the parameters it updates), which
    torch's fused kernels read there: rounded to float32, as torch's own tensor learning rate is (a learning rate
    that float32 holds exactly, such as 2**-7, gives eager's float one's numbers bit for bit).  Entry 0 of every
    rule's hyper-parameters is the learning rate."""
    if hparams.device.type == "cpu":
        return hparams.tolist(), None
    runtime = current()
    values = runtime.hparam_values.get(hparams.data_ptr()) if runtime is not None else None
    if values is None:  # not written by this step's layout (a graph run by hand): read it, which waits
        values = tuple(hparams.tolist())
    device = like[0].device if len(like) else hparams.device
    return list(values), hparams[0].to(device=device, dtype=torch.float32)


def adam_device(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad, maximize,
                decoupled, found_inf=None, present=None, present_index=()) -> None:
    (lr, beta1, beta2, weight_decay, eps), lr_on_device = hparam_numbers(hparams, params)
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = _present(
        present, present_index, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    if not params:
        return
    grads = in_layout_of(params, grads)
    if steps[0].device != params[0].device:
        _adam_with_host_steps(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
                              beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                              decoupled=decoupled, found_inf=found_inf)
        return
    found_inf = _on(found_inf, params)
    torch._foreach_add_(steps, 1)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
           lr=lr if lr_on_device is None else lr_on_device, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
           eps=eps, amsgrad=amsgrad, maximize=maximize, found_inf=found_inf)
    if found_inf is not None:  # as torch.optim's fused Adam: a skipped step does not count
        torch._foreach_sub_(steps, [found_inf.to(steps[0].device)] * len(steps))


def _adam_with_host_steps(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2,
                          weight_decay, eps, amsgrad, maximize, decoupled, found_inf) -> None:
    """Adam whose step counters live on the host while its tensors are on an accelerator: eager's default
    (neither fused nor capturable) on a GPU.  The fused kernels read the counters on the device, so this runs
    what eager runs there, torch's foreach implementation, which reads them as host numbers: eager's numbers,
    and no host copy to the device.  A found_inf (a GradScaler) is read on the host, as eager's
    ``GradScaler.step`` reads it for an optimizer that is not fused."""
    flag = None if found_inf is None else float(found_inf)
    if flag == 1.0:
        return
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
               foreach=True, decoupled_weight_decay=decoupled, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
               weight_decay=weight_decay, eps=eps, maximize=maximize)
    if flag:  # as adam_host: a non-zero flag other than 1.0 updates and un-counts the step
        torch._foreach_sub_(steps, flag)


def adam_host(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad, maximize,
              decoupled, found_inf=None, present=None, present_index=()) -> None:
    lr, beta1, beta2, weight_decay, eps = hparam_numbers(hparams)[0]
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = _present(
        present, present_index, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    if not params:
        return
    # The native kernel has no found_inf argument: this host op reads the flag (a host tensor, or one
    # copy from the device, which the offloaded update waits for anyway) and skips as the fused kernel does.
    flag = None if found_inf is None else float(found_inf)
    if flag == 1.0:
        return
    torch._foreach_add_(steps, 1)
    hp, hm, hv, hmax, hs = (_on_host(ts) for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps))
    native.adam_(hp, in_layout_of(hp, _on_host(grads)), hm, hv, hmax, hs, lr=lr, beta1=beta1, beta2=beta2,
                 weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, decoupled=decoupled,
                 use_native=active().options.native)
    if flag:  # a non-zero flag other than 1.0 updates (as the fused kernel) and un-counts the step (as torch)
        torch._foreach_sub_(hs, flag)
    for dst, host in ((params, hp), (exp_avgs, hm), (exp_avg_sqs, hv), (max_exp_avg_sqs, hmax), (steps, hs)):
        _back(dst, host)


def functional_adam(kernel, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad,
                    maximize, decoupled, found_inf=None, present=None, present_index=()) -> list[Tensor]:
    """Run an in-place Adam ``kernel`` on copies of the state; the copies, flat, in output layout."""
    out = [[t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)]
    kernel(out[0], grads, out[1], out[2], out[3], out[4], hparams, amsgrad, maximize, decoupled, found_inf, present,
           present_index)
    return [t for ts in out for t in ts]


def adam_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hparams, amsgrad, maximize, decoupled,
              found_inf=None, present=None, present_index=()):
    return [torch.empty_like(t) for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) for t in ts]


# ---------------------------------------------------------------------- SGD
def sgd_device(params, grads, bufs, hparams, nesterov, maximize, first_step, found_inf=None, present=None,
               present_index=()) -> None:
    (lr, momentum, dampening, weight_decay), lr_on_device = hparam_numbers(hparams, params)
    params, grads, bufs = _present(present, present_index, params, grads, bufs)
    grads = in_layout_of(params, grads)
    update = dict(weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                  maximize=maximize)
    loop = [i for i, p in enumerate(params) if not fused_sgd_updates(p)]
    if loop:
        fused = [i for i, p in enumerate(params) if fused_sgd_updates(p)]
        _sgd_for_loop(*(_pick(ts, loop) for ts in (params, grads, bufs)), first_step=first_step,
                      found_inf=found_inf, **update)
        params, grads, bufs = (_pick(ts, fused) for ts in (params, grads, bufs))
    if not params:
        return
    if lr_on_device is not None:
        update["lr"] = lr_on_device
    torch._fused_sgd_(params, grads, bufs if bufs else [], **update, is_first_step=first_step,
                      found_inf=_on(found_inf, params))


def fused_sgd_updates(param: Tensor) -> bool:
    """Whether torch's fused SGD kernel updates ``param``.  Its CPU kernel leaves a float16 or bfloat16
    tensor unchanged (but for a tail shorter than one vector: 16 elements with AVX2; torch 2.13), so
    eager's fused=True SGD does not train such a model, and eager's default, for-loop SGD, does."""
    return param.device.type != "cpu" or param.dtype not in (torch.float16, torch.bfloat16)


def _sgd_for_loop(params, grads, bufs, *, first_step, found_inf, **update) -> None:
    """torch's for-loop SGD, what eager's default runs on the CPU, in place (a first momentum step fills the
    buffers given, as the fused kernel does).  A ``found_inf`` is read on the host, as ``GradScaler.step``
    reads it for an optimizer that is not fused."""
    if found_inf is not None and float(found_inf) == 1.0:
        return
    new_bufs = [None] * len(params) if first_step else list(bufs)
    torch_sgd(params, grads, new_bufs, foreach=False, fused=False, **update)
    for buf, new in zip(bufs, new_bufs) if first_step else ():
        if new is not None:  # None: momentum 0 this step, no buffer made
            buf.copy_(new)


def _pick(ts: list[Tensor], index: list[int]) -> list[Tensor]:
    """The entries ``index`` of a per-parameter list (an empty list, no momentum buffers, stays empty)."""
    return [ts[i] for i in index] if ts else ts


def sgd_host(params, grads, bufs, hparams, nesterov, maximize, first_step, found_inf=None, present=None,
             present_index=()) -> None:
    lr, momentum, dampening, weight_decay = hparam_numbers(hparams)[0]
    params, grads, bufs = _present(present, present_index, params, grads, bufs)
    if not params:
        return
    if found_inf is not None and float(found_inf) == 1.0:  # see adam_host
        return
    hp, hb = _on_host(params), _on_host(bufs)
    native.sgd_(hp, in_layout_of(hp, _on_host(grads)), hb, lr=lr, momentum=momentum, dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov, maximize=maximize, is_first_step=first_step, use_native=active().options.native)
    _back(params, hp)
    _back(bufs, hb)


def functional_sgd(kernel, params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize,
                   buffer_device=None, found_inf=None, present=None, present_index=()) -> list[Tensor]:
    """Run an in-place SGD ``kernel`` on copies; new params + momentum buffers (first step: new buffers).

    A first momentum step that ``found_inf`` skips leaves zero buffers (torch's fused SGD leaves
    the uninitialised memory it allocated); the next step's ``momentum * 0 + grad`` is then what
    a first step computes.  So do the new buffers of parameters ``present`` skips (the step's write-back drops
    them: eager creates no state for a parameter without a gradient).
    """
    new_params = [p.clone() for p in params]
    first = has_momentum and not momentum_buffers
    if not has_momentum:
        bufs = []
    elif first:
        new = torch.zeros_like if found_inf is not None or present is not None else torch.empty_like
        # in the parameter's layout, as eager's (a clone of a gradient, which has its parameter's layout)
        bufs = [new(p, dtype=g.dtype, device=buffer_device) for p, g in zip(params, grads)]
    else:
        bufs = [b.clone() for b in momentum_buffers]
    kernel(new_params, grads, bufs, hparams, nesterov, maximize, first, found_inf, present, present_index)
    return new_params + bufs


def sgd_fake(params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize, buffer_device=None,
             found_inf=None, present=None, present_index=()):
    bufs = [torch.empty_like(p, dtype=g.dtype, device=buffer_device) for p, g in zip(params, grads)] \
        if has_momentum else []
    return [torch.empty_like(p) for p in params] + bufs


def _present(present: Tensor | None, index, *lists: list[Tensor]) -> tuple[list[Tensor], ...]:
    """``lists`` without the parameters whose gradient does not exist this step (eager skips them).

    ``index[j]`` is parameter j's entry in ``present`` (-1: its gradient always exists); an entry > 0
    means some rank's opaque part produced it (:mod:`spmd_ort.capture.presence`).  Lists that are not
    per parameter (empty: no momentum, no amsgrad) pass unchanged.
    """
    if present is None:
        return lists
    flags = present.tolist()
    keep = [k < 0 or flags[k] > 0 for k in index]
    return tuple([t for t, kept in zip(ts, keep, strict=True) if kept] if ts else ts for ts in lists)


def in_layout_of(params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """``grads``, each in its parameter's memory layout (copied where the strides differ).

    torch's fused optimizer kernels (and the native one) walk every tensor of a parameter's update as one flat
    buffer, so a gradient whose strides differ from its parameter's is read in the wrong order, silently (torch
    2.13's CPU ``_fused_adamw_``).  Eager never hands them one (autograd's gradient layout contract), but a
    compiled step can: a segment run by ORT returns contiguous tensors where fx returns views, so a gradient
    that is ``t(x)`` of an ORT output is transposed when the fx graph's was not."""
    return [g if g.stride() == p.stride() or g.numel() <= 1 else torch.empty_like(p, dtype=g.dtype).copy_(g)
            for p, g in zip(params, grads, strict=True)]


def _on(flag: Tensor | None, like: list[Tensor]) -> Tensor | None:
    """``found_inf`` on the device of the tensors it guards (torch's fused kernels need that)."""
    if flag is None or not like or flag.device == like[0].device:
        return flag
    return flag.to(like[0].device, non_blocking=True)


# ---------------------------------------------------------------------- host copies
def _on_host(ts: list[Tensor]) -> list[Tensor]:
    return [t if t.device.type == "cpu" else t.to("cpu") for t in ts]


def _back(dst: list[Tensor], host: list[Tensor]) -> None:
    for d, h in zip(dst, host):
        if d is not h:
            d.copy_(h, non_blocking=True)
