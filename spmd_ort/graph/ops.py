"""Every ``spmd_ort::`` op, registered here with one API (``torch.library.define`` / ``impl`` / ``register_fake``).

The graph passes insert these ops and the executors run them as host nodes.
What runs is elsewhere: optimizer bodies in :mod:`spmd_ort.runtime.kernels`, collective
work in the running step's :class:`~spmd_ort.runtime.collectives.Communicator`.

* ``tag_grad(grad, index)``: marks the gradient of parameter ``index`` while
  tracing (identity); the data-parallel passes replace it.
* ``tap(x, tap_id)``: marks an activation whose statistics a debug subscriber
  records (identity); ``insert_activation_stats_pass`` replaces it.
* random: ``bernoulli_like(t, p)`` (dropout's in-place fill, functional) and
  ``with_layout(x, dim_order, values)``, which gives a random op's input the memory
  layout eager's kernels gave it (``pin_random_layouts_pass``).
* collectives: ``all_reduce_``, ``wait_``, ``broadcast_`` (in place, returning
  their input, so graph order follows data) and ``all_gather``, ``reduce_scatter``
  (new tensors that ``wait_`` completes); see :mod:`spmd_ort.runtime.collectives`.
* optimizer updates over one param group: ``adam`` / ``sgd`` (functional: they
  return the new state) and their in-place twins ``adam_`` / ``sgd_``; the host
  variants ``host_adam(_)`` / ``host_sgd(_)`` run the native kernel
  (``offload_optimizer="cpu"``).  Each takes an optional ``found_inf`` (a GradScaler's
  flag): 1 skips the update, as torch's fused kernels do.
* ``check_index(index, high, wraps, ignore, op, input, fqn, message)``: eager's bounds check of an
  index the step's inputs feed to a gather (:mod:`spmd_ort.runtime.checks`); returns ``index`` itself,
  so the ops that read the index read its output and run after it (``insert_index_checks_pass``).
* ``grouped_mm(mat_a, mat_b, offs, bias, out_dtype)``: ``aten._grouped_mm`` (an MoE's experts, one matmul per
  group of rows) in a dtype eager's kernel takes and torch's fake kernel rejects (it checks CUDA's bfloat16
  rule): tracing maps the aten op to this one (``spmd_ort.capture.trace.EAGER_DECOMPS``), which runs eager's
  kernel and infers shapes without the dtype check.
* opaque parts (:mod:`spmd_ort.runtime.opaque_calls`): ``opaque_forward(inputs, index)`` runs
  call ``index`` of the step's opaque table (user code, eagerly) and returns its
  outputs plus a token; ``opaque_backward(token, grads, index)`` runs its
  backward and returns one gradient per input that needs one, then which of them its autograd
  produced (``grads_present`` gathers those flags for the optimizer).  Both have side
  effects (the user's code may run collectives): dead-code elimination keeps them.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.utils.flop_counter
from torch import Tensor, fx

from spmd_ort.runtime import checks, kernels
from spmd_ort.runtime import opaque_calls
from spmd_ort.runtime.step_runtime import active

_LIB = torch.library.Library("spmd_ort", "DEF")  # torch's op registry is per process: defined once, at import
_IMPL = "CompositeExplicitAutograd"  # one body for every device; no autograd formula (graphs run without it)


def _op(schema: str, body, fake, tags: tuple = ()) -> torch._ops.OpOverload:
    """Define ``spmd_ort::<schema>`` with ``body`` and its fake (shape-only) implementation."""
    name = schema.split("(", 1)[0]
    qualname = f"spmd_ort::{name}"
    torch.library.define(qualname, schema[len(name):], lib=_LIB, tags=tags)
    torch.library.impl(qualname, _IMPL, lib=_LIB)(body)
    torch.library.register_fake(qualname, lib=_LIB)(fake)
    return getattr(torch.ops.spmd_ort, name).default


# ---------------------------------------------------------------------- tracing marks
tag_grad = _op("tag_grad(Tensor grad, int index) -> Tensor",
               lambda grad, index: grad.clone(), lambda grad, index: torch.empty_like(grad))
# an activation whose statistics a debug subscriber records (spmd_ort.runtime.taps); identity, also for autograd
tap = _op("tap(Tensor x, int tap_id) -> Tensor", lambda x, tap_id: x.clone(), lambda x, tap_id: torch.empty_like(x))
torch.library.register_autograd("spmd_ort::tap", lambda ctx, grad: (grad, None), lib=_LIB)

# ---------------------------------------------------------------------- input checks
# an alias of its input (no copy); a side effect (it raises), so dead-code elimination keeps it
check_index = _op("check_index(Tensor(a) index, SymInt high, bool wraps, int? ignore, str op, str input, str fqn, "
                  "str message) -> Tensor(a)", checks.check_index, lambda index, *rest: index)
fx.node.has_side_effect(check_index)
# a pipeline's index checks agreed on by every rank, at one point they all reach (after the micro-batches)
agree_checks = _op("agree_checks(Tensor after) -> Tensor", checks.agree_checks, lambda after: after.new_empty(0))
fx.node.has_side_effect(agree_checks)

# ---------------------------------------------------------------------- random
# ``t.bernoulli_(p)`` as a functional op: the mask in ``t``'s own layout, filled in its memory order as the
# in-place op fills it (functionalization's ``aten.bernoulli.p`` returns a contiguous tensor filled in
# logical order: another mask from the same seed when ``t`` is transposed, e.g. dropout after a Conv1d
# over (B, T, C)).  Runs on the host with torch's RNG, like every random op (tagged as torch tags its own).
RANDOM = torch.Tag.nondeterministic_seeded
bernoulli_like = _op("bernoulli_like(Tensor t, float p) -> Tensor",
                     lambda t, p: torch.empty_like(t).bernoulli_(p), lambda t, p: torch.empty_like(t), tags=(RANDOM,))


def draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: torch tags its random ops (``nondeterministic_seeded``), ours carry
    the tag; an op tagged for an optional dropout (attention's ``dropout_p``, ``native_dropout``'s ``p`` or
    ``train``) draws nothing when that dropout is off."""
    if not (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and RANDOM in node.target.tags):
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
        if (arg.name in ("dropout_p", "p") and value == 0) or (arg.name == "train" and value is False):
            return False
    return True


def memory_order(t: Tensor) -> tuple[int, ...] | None:
    """The dims of ``t`` longer than 1, outermost first in memory, when ``t`` is dense (no gaps, no overlap);
    else None.  A dim of size 1 takes no part: any stride serves it, and a fill never steps along it."""
    if t.numel() == 0:
        return tuple(d for d in range(t.dim()) if t.shape[d] != 1)  # nothing is drawn: any order is eager's
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d))
    expected = 1
    for d in reversed(dims):
        if t.stride(d) != expected:
            return None
        expected *= t.shape[d]
    return tuple(dims)


def dense_dim_order(t: Tensor) -> tuple[int, ...]:
    """Every dim of ``torch.empty_like(t)``, outermost first: the layout a random op draws ``t``-shaped values in
    (``empty_like`` keeps a dense tensor's strides and gives any other the dense layout nearest to them)."""
    strides = torch.empty_like(t).stride()
    return tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))  # stable: dims of size 1 in place


def _with_layout(x: Tensor, dim_order: list[int], values: bool) -> Tensor:
    if memory_order(x) == tuple(d for d in dim_order if x.shape[d] != 1):
        return x  # already laid out as eager had it (the fx executor runs eager's kernels): nothing to do
    out = torch.empty_permuted(x.shape, dim_order, dtype=x.dtype, device=x.device)
    return out.copy_(x) if values else out


# ``x`` laid out in memory with its dims in ``dim_order`` (outermost first), the layout eager's kernels gave it
# (found by ``pin_random_layouts_pass``): ``x`` itself when it already is, else a new tensor holding ``x``'s
# values (``values``) or none (``x`` is an uninitialised allocation a random op fills).  A random op draws in
# its input's memory order, and an ORT segment's outputs are contiguous whatever eager's kernels return.
with_layout = _op("with_layout(Tensor x, int[] dim_order, bool values) -> Tensor", _with_layout,
                  lambda x, dim_order, values: torch.empty_permuted(x.shape, dim_order, dtype=x.dtype,
                                                                    device=x.device))


# ---------------------------------------------------------------------- grouped matmul
def _grouped_mm_fake(mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> Tensor:
    """The output of ``aten._grouped_mm`` as eager's kernel makes it, and the arguments it rejects.

    torch's meta kernel checks the CUDA kernel's rule (bfloat16 only); eager's CPU kernel takes float32,
    float16 and bfloat16 alike, with the other checks below, and pads its output's rows to 16 bytes (an (8, 6)
    float32 result has strides (8, 1)), as the meta kernel does only on a CUDA build: the padding here is
    eager's, so views traced after the op fit the tensor eager's kernel returns.
    """
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: f"grouped_mm: operands must be 2-D or 3-D, got {mat_a.dim()}-D and {mat_b.dim()}-D")
    torch._check(mat_a.dtype in (torch.float32, torch.float16, torch.bfloat16) and mat_b.dtype == mat_a.dtype,
                 lambda: f"grouped_mm: operands must be float32, float16 or bfloat16 alike, got {mat_a.dtype} and "
                         f"{mat_b.dtype}")
    torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                 lambda: "grouped_mm: the output dtype must match mat_a's")
    torch._check(bias is None, lambda: "grouped_mm: bias is not supported (eager's kernel rejects it)")
    torch._check((offs is None) == (mat_a.dim() == 3 and mat_b.dim() == 3),
                 lambda: "grouped_mm: offs are needed with a 2-D operand, and only then")
    torch._check(offs is None or offs.dtype == torch.int32, lambda: "grouped_mm: offs must be int32")
    torch._check(mat_a.shape[-1] == mat_b.shape[-2] if mat_a.dim() == 3 or mat_b.dim() == 3
                 else mat_a.shape[1] == mat_b.shape[0],
                 lambda: f"grouped_mm: contraction sizes differ ({tuple(mat_a.shape)} @ {tuple(mat_b.shape)})")
    shape = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype).shape
    alignment = 16 // mat_a.dtype.itemsize
    row = (shape[-1] + alignment - 1) // alignment * alignment
    strides = (shape[1] * row, row, 1) if len(shape) == 3 else (row, 1)
    return torch.empty_strided(shape, strides, dtype=mat_a.dtype, device=mat_a.device)


grouped_mm = _op("grouped_mm(Tensor mat_a, Tensor mat_b, Tensor? offs=None, Tensor? bias=None, "
                 "ScalarType? out_dtype=None) -> Tensor",
                 lambda mat_a, mat_b, offs=None, bias=None, out_dtype=None:
                 torch.ops.aten._grouped_mm.default(mat_a, mat_b, offs, bias, out_dtype), _grouped_mm_fake)


def grouped_mm_flops(a_shape, b_shape, *args, out_shape, **kwargs) -> int:
    """Multiply-add FLOPs (2 per MAC) of a grouped matmul with every row in a group (the groups cover what
    ``offs`` says, at most that): (S, K) @ (G, K, N) is an (S, K) @ (K, N) matmul's; (K, S) @ (S, N) with groups
    along S is a (K, S) @ (S, N) one's; 3-D @ 3-D is a batched matmul."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


torch.utils.flop_counter.register_flop_formula(torch.ops.spmd_ort.grouped_mm)(grouped_mm_flops)


def _linear_cross_entropy_op():
    """torch's chunked linear + cross-entropy operator (``F.linear_cross_entropy`` with options), or None on a torch
    without it; ``fuse_linear_cross_entropy_pass`` puts it in place of an LM head's matmul and loss."""
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401 - registers torch_nn::_linear_cross_entropy_...

        return torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default
    except (ImportError, AttributeError):  # a torch before 2.13, or one whose operator has another name
        return None


LINEAR_CROSS_ENTROPY = _linear_cross_entropy_op()


def linear_cross_entropy_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """Multiply-add FLOPs of the fused head: the logits' matmul and, for each gradient it computes, one more."""
    compute = [bool(a) for a in args[-3:-1]] if len(args) >= 3 else [True, True]
    rows, features = math.prod(input_shape[:-1]), input_shape[-1]
    return 2 * rows * features * weight_shape[0] * (1 + sum(compute))


if LINEAR_CROSS_ENTROPY is not None and LINEAR_CROSS_ENTROPY.overloadpacket not in \
        torch.utils.flop_counter.flop_registry:
    torch.utils.flop_counter.register_flop_formula(LINEAR_CROSS_ENTROPY.overloadpacket)(linear_cross_entropy_flops)


# ops whose body reads nothing but its arguments (no step context; random ones draw from torch's RNG): what
# pin_random_layouts_pass may run on its own tensors to learn the layouts eager's kernels give
PURE_OPS = (tag_grad, tap, bernoulli_like, with_layout, grouped_mm)

# ---------------------------------------------------------------------- collectives
# ``group``: the process group's name ("" is the world; DTensor's mesh dims name theirs, expand mode)
# ``op``: "sum" (after the prescale: an average where it is 1/size), "max" or "min" (DTensor's own reductions, e.g.
# loss parallel's max over the vocabulary shards)
all_reduce_ = _op('all_reduce_(Tensor(a!) t, float prescale, str group="", str op="sum") -> Tensor(a!)',
                  lambda t, prescale, group="", op="sum": active().comm.all_reduce(t, prescale, group, op),
                  lambda t, prescale, group="", op="sum": t)
REDUCE_OPS = ("sum", "max", "min")


def reduce_op(node) -> str:
    """The reduction of an ``all_reduce_`` node: "sum" unless it names another."""
    return node.kwargs.get("op", node.args[3] if len(node.args) > 3 else "sum")
wait_ = _op("wait_(Tensor(a!) t) -> Tensor(a!)", lambda t: active().comm.wait(t), lambda t: t)
broadcast_ = _op("broadcast_(Tensor(a!) t, int src) -> Tensor(a!)",
                 lambda t, src: active().comm.broadcast(t, src), lambda t, src: t)
# ``carried``: the slot of a gather the previous step issued for this one (cross-step prefetch), -1: none
all_gather = _op('all_gather(Tensor shard, int world, int carried=-1, str group="") -> Tensor',
                 lambda shard, world, carried=-1, group="": active().comm.all_gather(shard, world, carried, group),
                 lambda shard, world, carried=-1, group="": shard.new_empty(shard.numel() * world))
# ``mean``: the average over the ranks (gradients), else their sum (a DTensor's pending sum)
reduce_scatter = _op('reduce_scatter(Tensor t, int world, str group="", bool mean=True) -> Tensor',
                     lambda t, world, group="", mean=True: active().comm.reduce_scatter(t, world, group, mean),
                     lambda t, world, group="", mean=True: t.new_empty(t.numel() // world))
# pipeline parallelism's point-to-point transfers (passes/pipeline_parallel.py), on ``group`` ("": the world) with the
# peer's global rank and a tag both ends compute from the graph.  ``after``: the rank's previous transfer (a token,
# or the buffer of a receive): each transfer reads it, so no pass can reorder a rank's transfers (their order is the
# schedule's, which never waits in a cycle).  A send starts (it is waited for at ``p2p_wait``, before the step
# returns) and gives a token; a receive is posted (``p2p_recv``: its buffer, right after the transfer before it)
# and waited for where its tensor is first read (``p2p_wait_recv``), so the transfer runs beside the compute
# between them.
p2p_send = _op('p2p_send(Tensor t, Tensor after, int peer, int tag, str group="") -> Tensor',
               lambda t, after, peer, tag, group="": active().comm.send(t, peer, tag, group),
               lambda t, after, peer, tag, group="": t.new_empty(0))
p2p_recv = _op('p2p_recv(Tensor after, SymInt[] size, ScalarType dtype, int peer, int tag, str group="") -> Tensor',
               lambda after, size, dtype, peer, tag, group="": active().comm.recv(size, dtype, after.device, peer,
                                                                                   tag, group),
               lambda after, size, dtype, peer, tag, group="": after.new_empty(size, dtype=dtype))
p2p_wait_recv = _op("p2p_wait_recv(Tensor buffer) -> Tensor", lambda buffer: active().comm.wait(buffer),
                    lambda buffer: torch.empty_like(buffer))
p2p_wait = _op("p2p_wait(Tensor after) -> Tensor", lambda after: active().comm.finish_sends(after),
               lambda after: after.new_empty(0))
P2P = (p2p_send, p2p_recv, p2p_wait_recv, p2p_wait)
for _target in P2P:
    fx.node.has_side_effect(_target)

# ops that start a collective whose result ``wait_`` completes
STARTS = (all_reduce_, all_gather, reduce_scatter)
COLLECTIVES = (*STARTS, wait_, broadcast_)


def is_collective(node) -> bool:
    """Whether graph node ``node`` is a collective: ours, or one of torch's functional collectives (expand
    mode's DTensor redistributions)."""
    return node.target in COLLECTIVES or getattr(node.target, "namespace", None) == "_c10d_functional"

# ---------------------------------------------------------------------- opaque parts
opaque_forward = _op("opaque_forward(Tensor[] inputs, int index) -> Tensor[]",
                     lambda inputs, index: active().opaque_frame().forward(index, inputs), opaque_calls.fake_forward)
opaque_backward = _op("opaque_backward(Tensor token, Tensor[] grads, int index) -> Tensor[]",
                      lambda token, grads, index: active().opaque_frame().backward(index, grads),
                      opaque_calls.fake_backward)
OPAQUE_OPS = (opaque_forward, opaque_backward)


def _grads_present(vectors: list[Tensor], which: list[int], element: list[int], slot: list[int], n: int) -> Tensor:
    flags = torch.stack([vectors[v][e] for v, e in zip(which, element)])
    out = flags.new_zeros(n)
    return out.scatter_reduce_(0, torch.tensor(slot, device=flags.device), flags, "amax")


# entry ``slot[j]`` = the largest of ``vectors[which[j]][element[j]]``: per parameter whose gradient only opaque
# backwards make, whether one of them made it this step (spmd_ort.capture.presence)
grads_present = _op("grads_present(Tensor[] vectors, int[] which, int[] element, int[] slot, int n) -> Tensor",
                    _grads_present, lambda vectors, which, element, slot, n: vectors[0].new_empty(n))
for _target in OPAQUE_OPS:
    fx.node.has_side_effect(_target)

# ---------------------------------------------------------------------- optimizer updates
# found_inf: a GradScaler's flag (1 skips the whole update); present / present_index: which parameters have a
# gradient this step (an entry 0 skips that parameter; index -1: always has one; spmd_ort.capture.presence)
_SKIPS = "Tensor? found_inf=None, Tensor? present=None, int[] present_index=[]"
_ADAM_ARGS = ("(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, Tensor[] max_exp_avg_sqs, "
              f"Tensor[] steps, Tensor hparams, bool amsgrad, bool maximize, bool decoupled, {_SKIPS})")
_ADAM_ARGS_INPLACE = ("(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
                      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, Tensor hparams, bool amsgrad, "
                      f"bool maximize, bool decoupled, {_SKIPS})")
_SGD_ARGS = ("(Tensor[] params, Tensor[] grads, Tensor[] momentum_buffers, Tensor hparams, bool has_momentum, "
             f"bool nesterov, bool maximize, {_SKIPS})")
_SGD_ARGS_INPLACE = ("(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor hparams, "
                     f"bool has_momentum, bool nesterov, bool maximize, {_SKIPS})")

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
                   lambda params, grads, bufs, hparams, has_momentum, nesterov, maximize, found_inf=None, present=None,
                   present_index=(): kernel(params, grads, bufs, hparams, nesterov, maximize, False, found_inf, present,
                                            present_index), lambda *args: None)
    INPLACE_TWINS[functional] = (in_place, kernels.SGD_OUTPUTS)
    return functional, in_place


def _sgd_functional(kernel, buffer_device, params: list[Tensor], grads, momentum_buffers, hparams, has_momentum,
                    nesterov, maximize, found_inf=None, present=None, present_index=()):
    return kernels.functional_sgd(kernel, params, grads, momentum_buffers, hparams, has_momentum, nesterov,
                                  maximize, buffer_device, found_inf, present, present_index)


def _sgd_fake(buffer_device, params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize,
              found_inf=None, present=None, present_index=()):
    return kernels.sgd_fake(params, grads, momentum_buffers, hparams, has_momentum, nesterov, maximize,
                            buffer_device)


adam, adam_ = _define_adam("adam", kernels.adam_device)
sgd, sgd_ = _define_sgd("sgd", kernels.sgd_device)
host_adam, host_adam_ = _define_adam("host_adam", kernels.adam_host)
host_sgd, host_sgd_ = _define_sgd("host_sgd", kernels.sgd_host, buffer_device="cpu")

# device op -> its host twin (offload_optimizer)
HOST_TWINS: dict = {adam: host_adam, adam_: host_adam_, sgd: host_sgd, sgd_: host_sgd_}
OPTIMIZER_OPS = frozenset(INPLACE_TWINS) | frozenset(twin for twin, _ in INPLACE_TWINS.values())
