"""Every ``spmd_ort::`` op, registered here with one API (``torch.library.define`` / ``impl`` / ``register_fake``).

The graph passes insert these ops and the executors run them as host nodes.
What runs is elsewhere: optimizer bodies in :mod:`spmd_ort.runtime.kernels`, collective
work in the running step's :class:`~spmd_ort.runtime.collectives.Communicator`.

* ``tag_grad(grad, index)``: marks the gradient of parameter ``index`` while
  tracing (identity); the data-parallel passes replace it.
* ``tap(x, tap_id)``: marks an activation whose statistics a debug subscriber
  records (identity); ``insert_activation_stats_pass`` replaces it.
* collectives: ``all_reduce_``, ``wait_``, ``broadcast_`` (in place, returning
  their input, so graph order follows data) and ``all_gather``, ``reduce_scatter``
  (new tensors that ``wait_`` completes); see :mod:`spmd_ort.runtime.collectives`.
* optimizer updates over one param group: ``adam`` / ``sgd`` (functional: they
  return the new state) and their in-place twins ``adam_`` / ``sgd_``; the host
  variants ``host_adam(_)`` / ``host_sgd(_)`` run the native kernel
  (``offload_optimizer="cpu"``).  Each takes an optional ``found_inf`` (a GradScaler's
  flag): 1 skips the update, as torch's fused kernels do.
* opaque parts (:mod:`spmd_ort.runtime.opaque`): ``opaque_forward(inputs, index)`` runs
  call ``index`` of the step's opaque table (user code, eagerly) and returns its
  outputs plus a token; ``opaque_backward(token, grads, index)`` runs its
  backward and returns one gradient per input that needs one.  Both have side
  effects (the user's code may run collectives): dead-code elimination keeps them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, fx

from spmd_ort.runtime import kernels, opaque
from spmd_ort.runtime.context import active

_LIB = torch.library.Library("spmd_ort", "DEF")
_IMPL = "CompositeExplicitAutograd"  # one body for every device; no autograd formula (graphs run without it)


def _op(schema: str, body, fake) -> torch._ops.OpOverload:
    """Define ``spmd_ort::<schema>`` with ``body`` and its fake (shape-only) implementation."""
    name = schema.split("(", 1)[0]
    qualname = f"spmd_ort::{name}"
    torch.library.define(qualname, schema[len(name):], lib=_LIB)
    torch.library.impl(qualname, _IMPL, lib=_LIB)(body)
    torch.library.register_fake(qualname, lib=_LIB)(fake)
    return getattr(torch.ops.spmd_ort, name).default


# ---------------------------------------------------------------------- tracing marks
tag_grad = _op("tag_grad(Tensor grad, int index) -> Tensor",
               lambda grad, index: grad.clone(), lambda grad, index: torch.empty_like(grad))
# an activation whose statistics a debug subscriber records (spmd_ort.runtime.taps); identity, also for autograd
tap = _op("tap(Tensor x, int tap_id) -> Tensor", lambda x, tap_id: x.clone(), lambda x, tap_id: torch.empty_like(x))
torch.library.register_autograd("spmd_ort::tap", lambda ctx, grad: (grad, None), lib=_LIB)

# ---------------------------------------------------------------------- random
# ``t.bernoulli_(p)`` as a functional op: the mask in ``t``'s own layout, filled in its memory order as the
# in-place op fills it (functionalization's ``aten.bernoulli.p`` returns a contiguous tensor filled in
# logical order: another mask from the same seed when ``t`` is transposed, e.g. dropout after a Conv1d
# over (B, T, C)).  Runs on the host with torch's RNG, like every random op.
bernoulli_like = _op("bernoulli_like(Tensor t, float p) -> Tensor",
                     lambda t, p: torch.empty_like(t).bernoulli_(p), lambda t, p: torch.empty_like(t))

# ---------------------------------------------------------------------- collectives
all_reduce_ = _op("all_reduce_(Tensor(a!) t, float prescale) -> Tensor(a!)",
                  lambda t, prescale: active().comm.all_reduce(t, prescale), lambda t, prescale: t)
wait_ = _op("wait_(Tensor(a!) t) -> Tensor(a!)", lambda t: active().comm.wait(t), lambda t: t)
broadcast_ = _op("broadcast_(Tensor(a!) t, int src) -> Tensor(a!)",
                 lambda t, src: active().comm.broadcast(t, src), lambda t, src: t)
# ``carried``: the slot of a gather the previous step issued for this one (cross-step prefetch), -1: none
all_gather = _op("all_gather(Tensor shard, int world, int carried=-1) -> Tensor",
                 lambda shard, world, carried=-1: active().comm.all_gather(shard, world, carried),
                 lambda shard, world, carried=-1: shard.new_empty(shard.numel() * world))
reduce_scatter = _op("reduce_scatter(Tensor t, int world) -> Tensor",
                     lambda t, world: active().comm.reduce_scatter(t, world),
                     lambda t, world: t.new_empty(t.numel() // world))
# ops that start a collective whose result ``wait_`` completes
STARTS = (all_reduce_, all_gather, reduce_scatter)
COLLECTIVES = (*STARTS, wait_, broadcast_)

# ---------------------------------------------------------------------- opaque parts
opaque_forward = _op("opaque_forward(Tensor[] inputs, int index) -> Tensor[]",
                     lambda inputs, index: active().opaque_frame().forward(index, inputs), opaque.fake_forward)
opaque_backward = _op("opaque_backward(Tensor token, Tensor[] grads, int index) -> Tensor[]",
                      lambda token, grads, index: active().opaque_frame().backward(index, grads),
                      opaque.fake_backward)
OPAQUE_OPS = (opaque_forward, opaque_backward)
for _target in OPAQUE_OPS:
    fx.node.has_side_effect(_target)

# ---------------------------------------------------------------------- optimizer updates
_ADAM_ARGS = ("(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, Tensor[] max_exp_avg_sqs, "
              "Tensor[] steps, Tensor hparams, bool amsgrad, bool maximize, bool decoupled, Tensor? found_inf=None)")
_ADAM_ARGS_INPLACE = ("(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
                      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, Tensor hparams, bool amsgrad, "
                      "bool maximize, bool decoupled, Tensor? found_inf=None)")
_SGD_ARGS = ("(Tensor[] params, Tensor[] grads, Tensor[] momentum_buffers, Tensor hparams, bool has_momentum, "
             "bool nesterov, bool maximize, Tensor? found_inf=None)")
_SGD_ARGS_INPLACE = ("(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor hparams, "
                     "bool has_momentum, bool nesterov, bool maximize, Tensor? found_inf=None)")

# functional op -> (in-place twin, names of the mutated list arguments in output order)
INPLACE_TWINS: dict = {}


def _define_adam(name: str, kernel) -> tuple:
    """``spmd_ort::<name>`` (functional: returns the new state, see kernels) and ``<name>_`` (in place).

    ``hparams`` is a float64 host tensor ``[lr, beta1, beta2, weight_decay, eps]``.  ``found_inf``
    (GradScaler) skips the update where it is 1.0, as torch's fused kernels do (the step
    counters end where they were).
    """
    functional = _op(f"{name}{_ADAM_ARGS} -> Tensor[]", functools.partial(kernels.functional_adam, kernel),
                     kernels.adam_fake)
    in_place = _op(f"{name}_{_ADAM_ARGS_INPLACE} -> ()", kernel, lambda *args: None)
    INPLACE_TWINS[functional] = (in_place, kernels.ADAM_OUTPUTS)
    return functional, in_place


def _define_sgd(name: str, kernel, buffer_device: str | None = None) -> tuple:
    """``spmd_ort::<name>`` (functional: new params + momentum buffers) and ``<name>_`` (in place).

    ``hparams`` is ``[lr, momentum, dampening, weight_decay]``; ``found_inf`` as for Adam.  An empty
    ``momentum_buffers`` with ``has_momentum`` is the first step: buffers start as
    the gradient (as torch does), made on ``buffer_device``; the in-place twin
    never runs a first step (its buffers must exist).
    """
    functional = _op(f"{name}{_SGD_ARGS} -> Tensor[]",
                     functools.partial(_sgd_functional, kernel, buffer_device),
                     functools.partial(_sgd_fake, buffer_device))
    in_place = _op(f"{name}_{_SGD_ARGS_INPLACE} -> ()",
                   lambda params, grads, bufs, hparams, has_momentum, nesterov, maximize, found_inf=None:
                   kernel(params, grads, bufs, hparams, nesterov, maximize, False, found_inf), lambda *args: None)
    INPLACE_TWINS[functional] = (in_place, kernels.SGD_OUTPUTS)
    return functional, in_place


def _sgd_functional(kernel, buffer_device, params: list[Tensor], grads, momentum_buffers, hparams, has_momentum,
                    nesterov, maximize, found_inf=None):
    return kernels.functional_sgd(kernel, params, grads, momentum_buffers, hparams, has_momentum, nesterov,
                                  maximize, buffer_device, found_inf)


def _sgd_fake(buffer_device, params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize,
              found_inf=None):
    return kernels.sgd_fake(params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize,
                            buffer_device)


adam, adam_ = _define_adam("adam", kernels.adam_device)
sgd, sgd_ = _define_sgd("sgd", kernels.sgd_device)
host_adam, host_adam_ = _define_adam("host_adam", kernels.adam_host)
host_sgd, host_sgd_ = _define_sgd("host_sgd", kernels.sgd_host, buffer_device="cpu")

# device op -> its host twin (offload_optimizer)
HOST_TWINS: dict = {adam: host_adam, adam_: host_adam_, sgd: host_sgd, sgd_: host_sgd_}
OPTIMIZER_OPS = frozenset(INPLACE_TWINS) | frozenset(twin for twin, _ in INPLACE_TWINS.values())
