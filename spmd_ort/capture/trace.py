"""Whole-step capture: the user's train step as one stateless, functional FX graph.

Two make_fx passes over fake tensors, so nothing real is read or written:

1. **capture** runs the user's function with the lifted state bound into the
   module and optimizer (:meth:`StateLayout.bind`).  ``loss.backward()`` runs the
   autograd engine on the traced tensors, so the backward ops land in the graph;
   ``optimizer.step()`` is the functional rule of :mod:`spmd_ort.capture.optim`.  The
   graph still updates its inputs in place (``copy_``, ``add_``, ...).
2. **functionalize** re-traces that graph under ``torch.func.functionalize``:
   every mutation becomes a new value.  The step function returns the final
   state explicitly, so the epilogue ``copy_`` into inputs is dropped, and state
   that did not change is no output at all.

The result, :class:`TracedStep`, has placeholders ``state..., batch..., input
grads...`` and outputs ``user leaves..., new state..., input grads...`` described
by :class:`~.state.Slot` lists.  A batch tensor that requires grad is a leaf of
the traced autograd graph, as in eager: backward accumulates into its ``.grad``
(an ``input_grad`` placeholder when it already has one) and whatever the step
leaves there is an ``input_grad`` output, written back after the run.

Parts that cannot be traced run opaquely (:mod:`spmd_ort.capture.opaque`): when
capture fails inside an autograd.Function or a submodule, that part joins the
:class:`~spmd_ort.capture.opaque.OpaquePlan` and the step is traced again, until
it traces or the failure is nowhere an opaque part can take it.  A failure that
eager PyTorch would raise too (an op rejecting its arguments' shapes or dtypes)
is an error, never an opaque part: it blames the input or the module.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from spmd_ort.graph import ops
from spmd_ort.graph.meta import USER_OP
from spmd_ort.runtime import opaque_calls
from spmd_ort.runtime.taps import TapRegistry, collecting
from spmd_ort.capture.amp import autocast_disabled
from spmd_ort.capture.diagnose import OpWatch, quiet_torch_logs, raised_by_own_code, tracing_frame
from spmd_ort.graph.symbolic import DynamicDims, SymbolicShapes, fake_inputs
from spmd_ort.errors import CompileError
from spmd_ort.capture.inputs import StepInputs, describe
from spmd_ort.runtime.opaque_calls import OpaqueCall
from spmd_ort.capture.opaque import CallStack, Frame, OpaqueCapture, OpaquePlan, link_backward
from spmd_ort.capture.presence import GradPresence, tracking
from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.capture.state import StateLayout
from spmd_ort.distributed import dtensor
from spmd_ort.options import get_logger

logger = get_logger(__name__)
aten = torch.ops.aten


TENSOR = object()  # marks where a graph output goes in the step's return value

# torch's tracing machinery keeps process-wide state: torch.fx's patches of nn.Module.__call__ and the
# flag and current meta of preserve_node_meta, and a trace here patches Function.apply and installs global
# module hooks.  Two traces at once in one process corrupt each other (torch-internal assertions, or
# preserve_node_meta left on for every later compile), so every compile in the process holds this lock:
# trace, passes and executor build (Compiler.compile), and a segment re-traced at new sizes at run time.
# Running a compiled program does not take it: runs of other steps go on while one step compiles.
COMPILE_LOCK = threading.RLock()
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_ort_tracing", default=False)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off while a compile runs (as torch's DCP state_dict does).

    A trace makes objects by the hundred thousand (fake tensors, proxies, nodes, their metadata), so
    the collector runs some 190 times in a gpt-mini compile, each pass walking every object the process
    holds: 0.2-0.3 s of a 2 s warm compile.  The garbage a compile leaves is collected after it, as usual;
    tensors are freed by reference counting either way.  A collector the user turned off stays off.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def is_tracing() -> bool:
    """Whether the user's step is running under capture (its tensors are traced, not real)."""
    return _TRACING.get()

def _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """BatchNorm as the functional twin of eager's own kernel, then the running statistics written.

    ``functionalize`` treats ``native_batch_norm`` as functional and would drop its in-place update of the
    running statistics.  torch's decomposition (var_mean, rsqrt, ...) fixes that but rounds differently
    from the kernel eager runs (2e-7 apart), and an ill-conditioned gradient (a bias reaching BatchNorm
    through tanh and a residual attention) turned that into 1e-5 differences after three Adam steps
    (found by tests/test_fuzz.py).  ``_native_batch_norm_legit_functional`` runs the same kernel, so
    compiled BatchNorm equals eager bit for bit.
    """
    if running_mean is None or running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    out, mean, invstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps)
    if training:
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return out, mean, invstd


def _bernoulli_(self, p: float = 0.5, *, generator=None):
    """``t.bernoulli_(p)`` (dropout's mask) with the mask in ``t``'s layout, as eager fills it in place
    (:data:`spmd_ort.graph.ops.bernoulli_like`); functionalization alone would give a contiguous mask, which
    for a transposed ``t`` is another mask from the same seed (found by tests/test_fuzz.py)."""
    if generator is not None:
        return self.copy_(aten.bernoulli.p(self, p, generator=generator))
    return self.copy_(ops.bernoulli_like(self, p))


def _loss_backward_of_empty(grad_output, input, *args):  # noqa: A002 - aten's argument name
    """The backward of mse / smooth L1 / Huber loss on an empty input: an empty gradient, as eager's kernel gives.

    These ops have no fake-tensor kernel, so tracing runs torch's Python decompositions, which compute a
    ``mean`` reduction's ``1 / numel`` in Python: a zero-size batch raised ZeroDivisionError while tracing where
    eager trains (and returns a NaN loss).  Other sizes keep the op itself (``NotImplemented``: the graph runs
    eager's kernel).  A symbolic size never stands for 0 (torch specialises sizes 0 and 1).
    """
    numel = input.numel()
    if not (isinstance(numel, int) and numel == 0):
        return NotImplemented
    return torch.zeros_like(input)


def _grouped_mm_of_any_dtype(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm`` (an MoE's experts: transformers' default ``grouped_mm`` experts, one matmul per
    expert over its sorted tokens) as ``spmd_ort::grouped_mm``, which runs eager's kernel, where torch's fake
    kernel rejects what eager's takes.

    The fake kernel checks the CUDA kernel's rule, bfloat16 only, so an fp32 model on CPU failed to trace and
    its experts ran opaquely, outside the graph, while eager trains it.  bfloat16 keeps the aten op (its fake
    kernel agrees); any other dtype eager's kernel rejects at the first run, with eager's error.
    """
    if mat_a.dtype == mat_b.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16):
        return NotImplemented
    return ops.grouped_mm(mat_a, mat_b, offs, bias, out_dtype)


# Ops that mutate their arguments but have no functionalization rule of their own (or one that changes
# their result), mapped to ops that do.  Applied while capturing, so that functionalization sees the result.
FUNCTIONAL_DECOMPS = {aten.native_batch_norm.default: _native_batch_norm, aten.bernoulli_.float: _bernoulli_}
# Ops whose tracing (not whose eager kernel) fails on some inputs, mapped to what eager computes for those inputs.
EAGER_DECOMPS = {op: _loss_backward_of_empty for op in (aten.mse_loss_backward.default,
                                                        aten.smooth_l1_loss_backward.default,
                                                        aten.huber_loss_backward.default)}
EAGER_DECOMPS[aten._grouped_mm.default] = _grouped_mm_of_any_dtype


def _one_hot(tensor, num_classes=-1):
    """``F.one_hot`` as eager computes it on the CPU: zeros with a 1 scattered at each class.

    On fake tensors torch computes ``eq(tensor.unsqueeze(-1), arange(num_classes))`` and skips eager's check
    that every class lies in ``[0, num_classes)``, so a bad class gave a row of zeros where eager raises.  As a
    scatter, the classes are an index that ``insert_index_checks_pass`` checks on every backend, before anything
    runs.  ``num_classes=-1`` (read from the values), other dtypes (eager's error) and DTensors keep torch's own.
    """
    if type(num_classes) is not int or num_classes < 0 or tensor.dtype != torch.int64 or dtensor.is_dtensor(tensor):
        return NotImplemented
    out = torch.zeros((*tensor.shape, num_classes), dtype=torch.int64, device=tensor.device)
    return out.scatter_(-1, tensor.unsqueeze(-1), 1)


# torch functions whose form on fake tensors drops a check that eager makes, mapped to eager's own form.
EAGER_FORMS = {F.one_hot: _one_hot}


class _EagerForms(torch.overrides.TorchFunctionMode):
    """Traces the functions of :data:`EAGER_FORMS` as eager computes them; their nodes name the function
    (``node.meta["custom"]["user_op"]``), which errors about them show."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        form = EAGER_FORMS.get(func)
        mode = get_proxy_mode() if form is not None else None
        if mode is None:
            return func(*args, **kwargs)
        before = set(mode.tracer.graph.nodes)
        out = form(*args, **kwargs)
        if out is NotImplemented:
            return func(*args, **kwargs)
        for node in mode.tracer.graph.nodes:
            if node not in before:
                node.meta.setdefault("custom", {})[USER_OP] = f"F.{func.__name__}"
        return out


@contextlib.contextmanager
def native_batch_norm():
    """cuDNN off while tracing, so that BatchNorm on a GPU traces as ``native_batch_norm`` (which
    ``FUNCTIONAL_DECOMPS`` makes functional: the running statistics become outputs of the graph) instead of
    ``cudnn_batch_norm``, whose schema does not declare that it updates them: functionalization would drop the
    update (a copy of the buffers, as inductor's checked first run takes, would keep the old statistics).  Only
    the choice torch makes while tracing changes: convolutions still pick cuDNN when the graph runs."""
    saved = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = saved


# ops that torch decomposes for autograd (CompositeImplicitAutograd) but that also hold a Python Meta kernel: with the
# Python dispatcher on (a symbolic trace), meta tensors reach that kernel instead of the decomposition, and the op has
# no gradient (make_fx on meta tensors, tracing_mode="symbolic": F.cross_entropy's gradient is lost; torch 2.13)
COMPOSITE_WITH_META_KERNELS = ("nll_loss",)


@contextlib.contextmanager
def composite_meta_kernels_hidden():
    """While a symbolic trace runs (a plan's, on meta copies), the ops of :data:`COMPOSITE_WITH_META_KERNELS`
    decompose on meta tensors as on any other, so their gradients are traced; restored after."""
    from torch._C import DispatchKey

    hidden = []
    for name in COMPOSITE_WITH_META_KERNELS:
        op = getattr(torch.ops.aten, name).default
        kernel = op.py_kernels.pop(DispatchKey.Meta, None)
        if kernel is not None:
            hidden.append((op, kernel))
            op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in hidden:
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


@dataclass
class TracedStep:
    gm: fx.GraphModule
    layout: StateLayout
    input_slots: list[Slot]  # one per placeholder
    output_slots: list[Slot]  # one per graph output
    batch_positions: list[int]  # positions of distinct tensor leaves in the flattened (args, kwargs)
    grad_inputs: list[int]  # batch tensors (indices into batch_positions) whose .grad the step owns
    user_spec: pytree.TreeSpec  # structure of the step's return value
    user_leaves: list[Any]  # non-tensor leaves of the return value (TENSOR where a tensor goes)
    seconds: float
    opaque: tuple[OpaqueCall, ...] = ()  # the step's opaque parts, indexed by their ops' ``index``
    attempts: int = 1  # traces run (each failure that made a part opaque costs one)
    symbolic: SymbolicShapes | None = None  # the symbolic dims of the batch, when traced with any


class _Retry(Exception):
    """A trace failed inside a part the plan has now made opaque: trace again."""


class _MetaAttention(torch.overrides.TorchFunctionMode):
    """On the meta device (a plan: spmd_ort.plan), ``scaled_dot_product_attention`` as the fused CPU kernel, which
    a CPU run traces and whose memory is a GPU's flash attention's (the output and a logsumexp, no T x T
    probabilities kept): sdpa's kernel choice on meta tensors is its math form.  Grouped-query attention's keys
    and values are repeated to the query's heads first, and a boolean mask made additive, as sdpa hands them to
    that kernel; values of another head size than the queries' are padded to it, and the output cut back."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not args or not isinstance(args[0], torch.Tensor) or (
                args[0].device.type != "meta" or dtensor.is_dtensor(args[0])):
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args)) | kwargs
        q, k, v = a["query"], a["key"], a["value"]
        if q.dim() != 4 or k.dim() != 4:
            return func(*args, **kwargs)
        if k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
        mask = a.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:  # as sdpa hands the kernel a boolean mask: additive
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(mask.logical_not(), float("-inf"))
        dq, dv = q.size(-1), v.size(-1)
        scale = a.get("scale")
        if dq != dv:  # the kernel takes one head size: pad the smaller with zeros (as transformers does for flash
            # attention: DeepSeek's 192-wide queries and keys, 128-wide values), keep the queries' scale, cut the output
            scale = scale if scale is not None else dq ** -0.5
            width = max(dq, dv)
            q, k, v = (F.pad(t, (0, width - t.size(-1))) if t.size(-1) < width else t for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, a.get("dropout_p", 0.0), a.get("is_causal", False), attn_mask=mask, scale=scale)[0]
        return out[..., :dv] if out.size(-1) != dv else out


class _Phases(torch.overrides.TorchFunctionMode):
    """Tags the capture graph's nodes that ``Tensor.backward`` / ``autograd.grad`` recorded.

    Nodes recorded while backward runs get ``node.meta["custom"]["phase"] =
    "backward"``; the functionalizing re-trace copies the tag to the nodes it
    creates, so passes (e.g. re-gathering sharded parameters for backward,
    recomputing activations) can tell forward from backward uses.

    The tag is written when backward returns, on the nodes themselves: make_fx
    removes dead nodes once the trace ends, and a symbolic trace leaves many
    (size arithmetic nothing reads, dropout's above all), so positions counted
    during the trace name other nodes, or none, in the graph it returns.
    """

    BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mode = get_proxy_mode() if func in self.BACKWARD else None
        if mode is None:
            return func(*args, **kwargs)
        graph = mode.tracer.graph
        before = set(graph.nodes)
        out = func(*args, **kwargs)
        for node in graph.nodes:
            if node not in before:
                node.meta.setdefault("custom", {})["phase"] = "backward"
        return out


def _describe_failure(exc: BaseException) -> tuple[str, str | None, bool]:
    """(what went wrong, op name, whether it is a limit of tracing rather than an error eager would raise too)."""
    from torch._subclasses import fake_tensor as ft

    func = getattr(exc, "func", None)
    op = str(func) if func is not None else None
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ft.DataDependentOutputException) or "data-dependent" in text.lower() or (
            op is not None and ("_local_scalar_dense" in op or "is_nonzero" in op)):
        return ("the step reads a tensor's value in Python (.item(), bool(tensor), `if tensor:`, "
                "a data-dependent shape); the compiled graph cannot depend on tensor values", op, True)
    if isinstance(exc, ft.DynamicOutputShapeException):
        return "an op's output shape depends on tensor values (e.g. nonzero, boolean masking)", op, True
    if isinstance(exc, ft.UnsupportedOperatorException):
        return "an op has no fake-tensor implementation, so it cannot be traced", op, True
    return text.rstrip("."), op, False


def trace_step(fn, args: tuple, kwargs: dict, layout: StateLayout, *, sdpa_math: bool = False,
               tag_grads: bool = False, plan: OpaquePlan | None = None,
               inputs: StepInputs | None = None, mixed_precision=None,
               dynamic: DynamicDims | None = None, taps: TapRegistry | None = None,
               warned: set | None = None) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` into a functional graph over ``layout``'s state.

    ``sdpa_math`` traces ``scaled_dot_product_attention`` as its math form
    (matmuls and softmax) instead of a fused kernel whose backward ONNX lacks.
    ``plan`` says which parts run opaquely; parts found untraceable are added to it.
    ``inputs`` names the call's leaves for errors (and knows the last call that compiled).
    ``mixed_precision``: a :class:`spmd_ort.capture.amp.MixedPrecisionPolicy` the forward runs under.
    ``dynamic``: the dims of tensor inputs traced as symbols (:mod:`spmd_ort.graph.symbolic`).
    ``taps``: where debug subscribers' activation taps made while tracing are registered (the step's own).
    ``warned``: the WARNINGs the step already gave (each is given once per step, not once per trace).
    """
    t0 = time.perf_counter()
    plan = plan if plan is not None else OpaquePlan()
    warned = warned if warned is not None else set()
    inputs = inputs or StepInputs.of(fn, args, kwargs)
    limit = 2 + sum(1 for _ in layout.module.modules()) + 16  # each retry makes one more part opaque
    for attempt in range(1, limit + 1):
        try:
            with collecting(taps if taps is not None else TapRegistry()):
                traced = _trace_once(fn, args, kwargs, layout, sdpa_math=sdpa_math, tag_grads=tag_grads, plan=plan,
                                     inputs=inputs, mixed_precision=mixed_precision, dynamic=dynamic,
                                     warned=warned)
        except _Retry:
            continue
        traced.seconds = time.perf_counter() - t0
        traced.attempts = attempt
        return traced
    raise CompileError(f"could not trace the train step: {limit} traces each found another part to run opaquely")


def _trace_once(fn, args: tuple, kwargs: dict, layout: StateLayout, *, sdpa_math: bool, tag_grads: bool,
                plan: OpaquePlan, inputs: StepInputs, mixed_precision=None,
                dynamic: DynamicDims | None = None, warned: set | None = None) -> TracedStep:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    batch_positions, alias_of = _graph_inputs(leaves, dynamic)
    inputs.check(batch_positions)
    batch_tensors = [leaves[i] for i in batch_positions]
    grad_inputs = [k for k, t in enumerate(batch_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    grads_in = [k for k in grad_inputs if batch_tensors[k].grad is not None]
    n_batch = len(batch_positions)
    state_in = layout.gather()
    n_state = len(state_in)
    if layout.expands:
        dtensor.register_sharding_rules()
    captured: dict[str, Any] = {}

    def step(*flat):
        state, batch = list(flat[:n_state]), flat[n_state:n_state + n_batch]
        for k, g in zip(grads_in, flat[n_state + n_batch:]):
            batch[k].grad = g
        new_leaves = list(leaves)
        for pos, t in zip(batch_positions, batch):
            new_leaves[pos] = t
        for pos, src in alias_of.items():
            new_leaves[pos] = new_leaves[src]
        a, kw = pytree.tree_unflatten(new_leaves, spec)
        with tracking(GradPresence(warned=warned if warned is not None else set())) as tracker, \
                layout.bind(state, tag_grads=tag_grads, mixed_precision=mixed_precision, presence=tracker) as bound:
            out = fn(*a, **kw)
            final = layout.localize(bound.final())
        final += [(Slot(SlotKind.INPUT_GRAD, f"{inputs.names[batch_positions[k]]}.grad", k), batch[k].grad)
                  for k in grad_inputs if batch[k].grad is not None]
        out_leaves, out_spec = pytree.tree_flatten(out)
        captured["user_spec"] = out_spec
        captured["user_leaves"] = [_user_leaf(x) for x in out_leaves]
        captured["final_slots"] = [s for s, _ in final]
        return (tuple(dtensor.local(x) for x in out_leaves if isinstance(x, torch.Tensor))
                + tuple(t for _, t in final))

    trace_inputs, fake_mode = _trace_inputs(layout, state_in, batch_tensors, batch_positions, grads_in, dynamic,
                                            inputs)
    tracing_mode = "symbolic" if fake_mode is not None else "fake"
    stack = CallStack(layout.module)
    capture = OpaqueCapture(layout.module, plan, stack)
    phases = _Phases()
    watch = OpWatch()
    token = _TRACING.set(True)
    try:
        attention = sdpa_kernel([SDPBackend.MATH]) if sdpa_math else _MetaAttention()
        clipping = dtensor.mixed_grad_clipping() if layout.expands else contextlib.nullcontext()
        with (stack.installed(), capture.installed(), torch.enable_grad(), attention, phases, watch, _EagerForms(),
              quiet_torch_logs(), clipping, native_batch_norm(),
              composite_meta_kernels_hidden() if tracing_mode == "symbolic" else contextlib.nullcontext()):
            gm1 = make_fx(step, decomposition_table={**FUNCTIONAL_DECOMPS, **EAGER_DECOMPS},
                          tracing_mode=tracing_mode, _allow_non_fake_inputs=True)(*trace_inputs)
        _check_traceable(gm1, captured, stack, plan)
    except (CompileError, _Retry):
        raise
    except Exception as exc:  # noqa: BLE001 - every trace failure becomes an opaque part or a CompileError
        error = _failure(exc, stack.culprit(exc), watch, plan, layout, inputs, batch_positions, n_state)
        if error is exc:
            raise  # the step's own error, as eager raises it
        raise error from exc
    finally:
        _TRACING.reset(token)

    stack.tag_modules(gm1)
    gm2 = _functionalize(gm1, trace_inputs, capture.calls, tracing_mode)

    # a batch slot is named as the input is in the call (`ids`, `batch['labels']`): errors about it name it so
    input_slots = (layout.input_slots() + [Slot(SlotKind.BATCH, inputs.names[pos], k)
                                           for k, pos in enumerate(batch_positions)]
                   + [Slot(SlotKind.INPUT_GRAD, f"{inputs.names[batch_positions[k]]}.grad", k) for k in grads_in])
    n_user = sum(1 for x in captured["user_leaves"] if is_tensor_leaf(x))
    output_slots = [Slot(SlotKind.USER, f"output[{k}]", k) for k in range(n_user)] + captured["final_slots"]
    _outputs_from_mutations(gm2, input_slots, output_slots)
    symbolic = None
    if fake_mode is not None:
        symbolic = SymbolicShapes.after_trace(fake_mode, trace_inputs[n_state:n_state + n_batch])
    return TracedStep(gm2, layout, input_slots, output_slots, batch_positions, grad_inputs, captured["user_spec"],
                      captured["user_leaves"], 0.0, tuple(capture.calls), symbolic=symbolic)


def _user_leaf(x):
    """What the program keeps of a leaf of the step's return value: TENSOR where a graph output goes (a
    DTensor's: its local tensor, wrapped again after the run), the value itself otherwise."""
    if dtensor.is_dtensor(x):
        return dtensor.LocalOf(dtensor.spec_of(x))
    return TENSOR if isinstance(x, torch.Tensor) else x


def is_tensor_leaf(x) -> bool:
    """Whether a kept return-value leaf (:func:`_user_leaf`) is filled from a graph output."""
    return x is TENSOR or isinstance(x, dtensor.LocalOf)


def _functionalize(gm1: fx.GraphModule, trace_inputs: list, calls, tracing_mode: str) -> fx.GraphModule:
    """The capture traced again under ``functionalize``: no mutation left, phase tags kept."""

    def run_capture(*flat):
        # An interpreter with node meta preserved: new nodes inherit the phase tags.
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(gm1).run(*flat)

    plain_inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in trace_inputs]
    # the capture already holds autocast's casts; the opaque ops' fake kernels read the calls
    with autocast_disabled(), opaque_calls.tracing(calls), quiet_torch_logs():
        gm2 = make_fx(torch.func.functionalize(run_capture, remove="mutations"),
                      tracing_mode=tracing_mode, _allow_non_fake_inputs=True)(*plain_inputs)
    _check_functional(gm2)
    link_backward(gm2, calls)
    return gm2


def _graph_inputs(leaves: list, dynamic: DynamicDims | None) -> tuple[list[int], dict[int, int]]:
    """The call's leaves that are graph inputs, and the leaves that alias one of them.

    One placeholder per distinct tensor (a tensor passed twice is one leaf of autograd, as in eager),
    and one per Python number lifted to an input (dynamic shapes).
    """
    first: dict[int, int] = {}
    positions, alias_of = [], {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in first:
                alias_of[i] = first[id(leaf)]
            else:
                first[id(leaf)] = i
                positions.append(i)
        elif dynamic is not None and dynamic.lifts(i, leaf):
            positions.append(i)
    return positions, alias_of


def _trace_inputs(layout: StateLayout, state_in: list[torch.Tensor], batch_tensors: list[torch.Tensor],
                  batch_positions: list[int], grads_in: list[int], dynamic: DynamicDims | None, inputs: StepInputs):
    """Detached leaves to trace over (tracing sets .grad on them, never on the user's tensors), and the fake
    mode they live in when some batch dims are symbolic (else None: make_fx fakes them itself)."""
    batch_dims = [dynamic.for_leaf(pos, tuple(t.shape)) if dynamic and isinstance(t, torch.Tensor) else frozenset()
                  for pos, t in zip(batch_positions, batch_tensors)]
    if not any(batch_dims) and all(isinstance(t, torch.Tensor) for t in batch_tensors):
        return (_state_for_tracing(layout, state_in)
                + [t.detach().requires_grad_(t.requires_grad) for t in batch_tensors]
                + [batch_tensors[k].grad.detach() for k in grads_in]), None
    fake_mode, fake_state, fake_batch = fake_inputs(
        _state_for_tracing(layout, state_in), batch_tensors, batch_dims, [inputs.names[pos] for pos in batch_positions])
    grads = [fake_mode.from_tensor(batch_tensors[k].grad.detach(), static_shapes=True) for k in grads_in]
    return fake_state + fake_batch + grads, fake_mode


def _failure(exc: BaseException, frame: Frame | None, watch: OpWatch, plan: OpaquePlan, layout: StateLayout,
             inputs: StepInputs, batch_positions: list[int], n_state: int) -> Exception:
    """What a trace failure becomes: an error naming the input or the module, or a retry with a new opaque part."""
    what, op, untraceable = _describe_failure(exc)
    failed = None if untraceable else watch.failed
    fqn = frame.fqn if frame is not None else None
    if "spmd_ort.opaque_" in str(exc) and "sharding strategy" in str(exc):
        # DTensor dispatch reached an opaque part: it has no sharding rule (a module run eagerly has none)
        where = f"`{fqn}`" if fqn and fqn != "<root>" else "a part of the model"
        return CompileError(
            f"{where} runs opaquely (an OpaqueOverride, or a module that cannot be traced), but its inputs or "
            "parameters are DTensors (tensor parallelism), and opaque parts do not take DTensors: DTensor has no "
            f"sharding rule for a module run eagerly. Fix: make {where} traceable (drop its OpaqueOverride, or give "
            "an Override.replacement that traces), or keep it out of the tensor-parallel plan and its inputs "
            "plain. The model and optimizer are unchanged.", fqn=fqn, op=op)
    not_a_tensor = inputs.not_a_tensor(exc, failed.op if failed else op, fqn)
    if not_a_tensor is not None:  # a numpy array or a list where a tensor belongs: the input, not the module
        return not_a_tensor
    if failed is not None and failed.eager_fails:
        # eager rejects these arguments too: an error about the input or the module, never an opaque part
        fqn = frame.fqn if frame is not None else None
        module_type = type(layout.module.get_submodule("" if fqn == "<root>" else fqn)).__name__ if fqn else None
        # arguments computed from the batch alone: the batch is what the op rejected
        n_batch = len(batch_positions)
        from_batch = [batch_positions[sorted(r)[0] - n_state] for r in failed.roots
                      if r and all(n_state <= i < n_state + n_batch for i in r)]
        reason = " ".join(str(exc).split()).rstrip(".")
        blamed = inputs.blame(from_batch, failed.op, fqn, reason, module_type)
        return blamed or _op_error(what, failed.op, fqn, module_type)
    if plan.adopt(frame, what):
        return _Retry()
    if not untraceable and failed is None:
        own = raised_by_own_code(exc)
        if own is not None:
            return _own_error(exc, own, frame)
    empty = _empty_input_error(exc, inputs, batch_positions, frame)
    return empty or _trace_error(what, op, frame, plan)


def _own_error(exc: Exception, where: tuple[str, int], frame: Frame | None) -> Exception:
    """The step's own error (:func:`raised_by_own_code`) raised as eager raises it: same exception, same message,
    and a note saying so; the fix is what it says, never "make it traceable"."""
    filename, line = where
    place = f" in module `{frame.fqn}`" if frame is not None and frame.fqn and frame.fqn != "<root>" else ""
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"spmd_ort: the train step raised this itself{place} ({filename}:{line}) while it was traced, "
                     "as eager PyTorch raises it: this is no limit of tracing; fix what it says. "
                     "The model and optimizer are unchanged.")
    return exc


def _empty_input_error(exc: Exception, inputs: StepInputs, batch_positions: list[int],
                       frame: Frame | None) -> CompileError | None:
    """Tracing failed dividing by an element count while an input is empty: name that input (eager would run it)."""
    decomposition = tracing_frame(exc)
    if not isinstance(exc, ZeroDivisionError) or decomposition is None:
        return None
    empty = [pos for pos in batch_positions
             if isinstance(inputs.leaves[pos], torch.Tensor) and inputs.leaves[pos].numel() == 0]
    if not empty:
        return None
    name = inputs.names[empty[0]]
    where = f" in module `{frame.fqn}`" if frame is not None and frame.fqn and frame.fqn != "<root>" else ""
    return CompileError(
        f"the input `{name}` is empty ({describe(inputs.leaves[empty[0]])}), and tracing the step{where} fails on it: "
        f"torch's decomposition `{decomposition}` divides by its element count in Python ({type(exc).__name__}: "
        f"{exc}), where eager PyTorch runs the op itself. Fix: skip empty batches (e.g. DataLoader(..., "
        "drop_last=True)), or give the step at least one sample. The model and optimizer are unchanged.",
        fqn=frame.fqn if frame is not None else None, input=name)


def _state_for_tracing(layout: StateLayout, state_in: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf copies of the state (tracing sets .grad on them, never on the user's tensors).

    Under ``fully_shard`` the step is traced on the full shapes: each shard is
    stood in for by a fake tensor of the parameter's shape (nothing allocated),
    and the sharding passes turn the graph into one over shards.
    """
    if not layout.shard_specs:
        return [t.detach().requires_grad_(t.requires_grad) for t in state_in]
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    out = []
    for slot, t in zip(layout.input_slots(), state_in):
        if layout.is_sharded(slot, t):
            with fake_mode:
                full = torch.empty(layout.shard_specs[slot.index].shape, dtype=t.dtype, device=t.device)
        else:
            full = fake_mode.from_tensor(t.detach())
        out.append(full.requires_grad_(t.requires_grad))
    return out


def _trace_error(what: str, op: str | None, frame: Frame | None, plan: OpaquePlan,
                 fix: str | None = None) -> CompileError:
    """The CompileError of a trace failure no opaque part can take, naming where it happened and the fix."""
    if frame is not None and frame.kind == "function":
        fix = ("SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1 is set, so Functions are never run opaquely; unset it, "
               "or make the Function traceable" if not plan.custom_autograd else "make the Function traceable")
        return CompileError(
            f"could not trace the train step in {frame.what}{f' at op {op}' if op else ''}: {what}. Fix: {fix}. "
            "The model and optimizer are unchanged.", fqn=frame.fqn, op=op or frame.name)
    fqn = frame.name if frame is not None else None
    where = f"in module `{fqn}`" if fqn else "outside any submodule (in the step function or backward)"
    if fqn and fqn != "<root>":  # a submodule that may not run opaquely (SPMD_ORT_AUTO_OPAQUE=0)
        fix = f"supply an Override for `{fqn}` (spmd_ort.Override.replacement) or make it traceable"
        if not plan.auto_opaque:
            fix += "; or unset SPMD_ORT_AUTO_OPAQUE=0 to run it eagerly as an opaque host node"
    elif fix is None:
        fix = "make the step function traceable" if not fqn else (
            "make the model's own forward traceable, or move the untraceable part into a submodule "
            "(it then runs opaquely)")
    return CompileError(
        f"could not trace the train step {where}{f' at op {op}' if op else ''}: {what}. Fix: {fix}. "
        "The model and optimizer are unchanged.", fqn=fqn, op=op)


def _op_error(what: str, op: str, fqn: str | None, module_type: str | None) -> CompileError:
    """An op raised while tracing, on arguments not computed from the batch alone: eager may well raise too."""
    where = (f"in module `{fqn}` ({module_type})" if fqn and fqn != "<root>" else
             f"in the model ({module_type})" if fqn else "outside any submodule (in the step function or backward)")
    override = (f"supply an Override for `{fqn}` (spmd_ort.Override.replacement) or make it traceable"
                if fqn and fqn != "<root>" else "make the step function traceable")
    return CompileError(
        f"could not trace the train step {where}: {op} raised {what}. Fix: if eager PyTorch runs this step with "
        f"these inputs, {override}; if it fails there too, fix the shapes or dtypes that reach {op}. "
        "The model and optimizer are unchanged.", fqn=fqn, op=op)


def _check_traceable(gm: fx.GraphModule, captured: dict, stack: CallStack, plan: OpaquePlan) -> None:
    """What tracing recorded without failing but the graph cannot hold: value reads and raw collectives.

    ``.item()`` traces to an unbacked symbol instead of failing, and
    ``torch.distributed`` calls trace to ``c10d`` ops on a ProcessGroup object; the
    part that recorded them runs opaquely (then its collectives run in graph
    order on every rank), or this is a :class:`CompileError`.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        fix = None
        if node.target is aten._local_scalar_dense.default:
            what = ("the step reads a tensor's value in Python (.item(), float(tensor), int(tensor)); the compiled "
                    "graph cannot depend on tensor values; return the tensor instead and convert it after the step")
        elif getattr(node.target, "namespace", None) == "c10d":
            what = (f"a torch.distributed call ({node.target}) on a ProcessGroup; collectives of the compiled graph "
                    "are its own, so the part that calls it must run opaquely")
            fix = ("move the torch.distributed call out of the step, or into a submodule or an autograd.Function "
                   "(it then runs opaquely, in the same order on every rank)")
        else:
            continue
        frame = stack.frame_of(gm, node)
        if plan.adopt(frame, what):
            raise _Retry()
        raise _trace_error(what, str(node.target), frame, plan, fix)
    for leaf in captured.get("user_leaves", []):
        if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _trace_error(f"the step returns the Python number {leaf}, computed from a tensor (or from sizes "
                               "or numbers that are symbolic: dynamic shapes), so it has no one value; return it "
                               "as a tensor", None, None, plan)


def _check_functional(gm: fx.GraphModule) -> None:
    """Only the epilogue ``copy_`` into inputs may mutate; anything else is a capture bug."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable \
                and node.target is not aten.copy_.default:
            raise CompileError(f"internal error: op {node.target} still mutates its inputs after "
                               "functionalization; add a decomposition for it to "
                               "spmd_ort.capture.trace.FUNCTIONAL_DECOMPS",
                               op=str(node.target))


def _outputs_from_mutations(gm: fx.GraphModule, input_slots: list[Slot], output_slots: list[Slot]) -> None:
    """Turn functionalization's epilogue (``copy_`` of new values into inputs) into outputs.

    State is already returned explicitly, so its ``copy_`` goes; a mutated batch
    input becomes a ``batch`` output (written back like eager's in-place update).
    State outputs that are still the input itself (unchanged) are dropped, except
    gradients: a gradient missing from the outputs is one the step set to None.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(input_slots), (len(placeholders), len(input_slots))
    slot_of = dict(zip(placeholders, input_slots))
    out_node = graph.output_node()
    outs = list(pytree.tree_leaves(out_node.args[0]))
    assert len(outs) == len(output_slots), (len(outs), len(output_slots))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0] in slot_of:
            slot = slot_of[node.args[0]]
            if slot.kind is SlotKind.BATCH:
                outs.append(node.args[1])
                output_slots.append(slot)
            elif slot.kind not in (SlotKind.PARAM, SlotKind.BUFFER, SlotKind.GRAD, SlotKind.OPT_STATE,
                                   SlotKind.INPUT_GRAD, SlotKind.SCALER):
                raise CompileError(f"the train step writes into {slot.kind} input `{slot.name}` in place")
            graph.erase_node(node)
    # Input and output slots of the same state compare equal (same kind, name, index, key).  A gradient
    # stays an output even when unchanged: its presence after the step is what the output says.
    keep = [i for i, (o, s) in enumerate(zip(outs, output_slots))
            if s.kind in (SlotKind.USER, SlotKind.BATCH, SlotKind.GRAD, SlotKind.INPUT_GRAD) or slot_of.get(o) != s]
    new_outs = [outs[i] for i in keep]
    output_slots[:] = [output_slots[i] for i in keep]
    out_node.args = (tuple(new_outs),)
    graph.eliminate_dead_code()
    gm.recompile()

