"""How tracing captures opaque parts: autograd.Functions and submodules that run eagerly as host nodes.

While :func:`spmd_ort.capture.trace.trace_step` traces, an :class:`OpaqueCapture` is installed:

* ``torch.autograd.Function.apply`` is wrapped.  A Function is traced (inlined)
  unless the :class:`OpaquePlan` says it is opaque: then the call becomes
  ``spmd_ort::opaque_forward`` in the graph, and autograd records
  ``spmd_ort::opaque_backward`` for its backward (through :class:`_OpaqueApply`).
* the ``forward`` of every opaque submodule (by FQN, or an ``OpaqueOverride``
  glob) is replaced, for the trace only, by the same capture with the
  module's parameters and buffers as explicit inputs: they stay graph inputs,
  so data-parallel all-reduce, ZeRO-3 gathers and reduce-scatters, the optimizer
  and checkpoints cover them.
* a :class:`CallStack` follows which module and Function is running (forward,
  and a Function's backward through hooks on its autograd node), so a trace
  failure names its innermost module or Function.  ``trace_step`` then adds
  that part to the plan (:meth:`OpaquePlan.adopt`) and traces again.

Each capture runs the user's code once on sample inputs (:meth:`OpaqueCapture.sample`)
to learn its outputs: on fake tensors where that works, else on random real
tensors of the inputs' shapes (RNG state saved and restored).  Collectives in an
opaque part run at run time, as host nodes, in graph order: the same order on
every rank, between the compiled step's own (asynchronous) collectives.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import logging
import operator
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, fx, nn
from torch.autograd.function import Function
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils import stateless
from torch.utils._python_dispatch import TorchDispatchMode

from spmd_ort.capture import presence
from spmd_ort.runtime import opaque_calls
from spmd_ort.errors import CompileError
from spmd_ort.runtime.opaque_calls import OpaqueCall, TensorMeta
from spmd_ort.graph.ops import opaque_backward, opaque_forward
from spmd_ort.capture.state import unique_named
from spmd_ort.options import get_logger

logger = get_logger(__name__)
aten = torch.ops.aten


def qualified_name(cls: type) -> str:
    """``pkg.mod.Cls``: how ``SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS`` names a Function."""
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------- where the trace is
def under_trace() -> bool:
    """Whether the caller runs under make_fx's proxy mode: in the tracing thread, or in autograd's threads for it.

    The capture's global hooks and its patch of ``Function.apply`` act on every thread of the process;
    other threads (a compiled step running while another one compiles) run without the mode and are left
    alone.  One trace at a time holds the mode (``spmd_ort.capture.trace.COMPILE_LOCK``).
    """
    return get_proxy_mode() is not None


@dataclass(frozen=True)
class Frame:
    """A module or an autograd.Function running while the step is traced."""

    kind: str  # "module" or "function"
    name: str  # module FQN ("<root>" for the root) or the Function's qualified name
    fqn: str | None  # the module the frame runs in
    cls: type | None = None  # the Function class
    phase: str = "forward"

    @property
    def what(self) -> str:
        if self.kind == "module":
            return f"module `{self.name}`"
        return f"autograd.Function {self.name} ({self.phase})" + (f" in module `{self.fqn}`" if self.fqn else "")


class CallStack:
    """Which submodule and Function are running: names the culprit of a trace failure.

    Besides the live stack it logs (graph size, innermost frame) at each entry
    and exit, so that a node of the captured graph maps back to the module or
    Function that recorded it.  An exception leaving a frame records that frame
    as the exception's culprit (the innermost one it left first); exceptions
    are caught on the way too (non-reentrant checkpointing stops recomputation
    with one), so the stack itself stays exact.
    """

    def __init__(self, module: nn.Module):
        self.names = {id(m): (fqn or "<root>") for fqn, m in module.named_modules(remove_duplicate=False)}
        self.stack: list[Frame] = []
        self.events: list[tuple[int, Frame | None]] = []
        # (the graph's last node, innermost frame) at each entry and exit: node identities, unlike sizes, stay
        # right when a symbolic trace inserts size nodes earlier in the graph
        self.marks: list[tuple[fx.Node | None, Frame | None]] = []
        self.culprits: dict[int, tuple[BaseException, Frame]] = {}
        self.paused = 0

    def _graph_size(self) -> int:
        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else -1

    def _mark(self) -> None:
        mode = get_proxy_mode()
        nodes = mode.tracer.graph.nodes if mode is not None else ()
        self.marks.append((next(iter(reversed(nodes)), None) if nodes else None, self.innermost()))

    def push(self, frame: Frame) -> None:
        if not self.paused:
            self.stack.append(frame)
            self.events.append((self._graph_size(), frame))
            self._mark()

    def pop(self, exc: BaseException | None = None) -> None:
        if self.paused or not self.stack:
            return
        frame = self.stack.pop()
        if exc is not None and id(exc) not in self.culprits:
            self.culprits[id(exc)] = (exc, frame)
        self.events.append((self._graph_size(), self.innermost()))
        self._mark()

    @contextlib.contextmanager
    def installed(self):
        def pre(mod, args):
            if not under_trace():  # another thread's eager run: not part of this trace
                return
            name = self.names.get(id(mod), type(mod).__name__)
            self.push(Frame("module", name, name))

        def post(mod, args, out):
            if not under_trace():
                return
            # always_call: also when forward raised (then ``out`` is None and the exception is being handled)
            self.pop(sys.exc_info()[1] if out is None else None)

        h1 = nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = nn.modules.module.register_module_forward_hook(post, always_call=True)
        try:
            yield self
        finally:
            h1.remove()
            h2.remove()

    @contextlib.contextmanager
    def pause(self):
        """Sample runs of opaque parts are not part of the trace."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def innermost(self) -> Frame | None:
        return self.stack[-1] if self.stack else None

    def module(self) -> str | None:
        """FQN of the innermost running module."""
        return next((f.fqn for f in reversed(self.stack) if f.fqn is not None), None)

    def culprit(self, exc: BaseException) -> Frame | None:
        """The innermost module or Function that ``exc`` (or an exception it was raised from) left.

        A failure in a Function's backward leaves no frame (autograd calls it): its
        frame is still the innermost on the stack.
        """
        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if id(exc) in self.culprits and self.culprits[id(exc)][0] is exc:
                return self.culprits[id(exc)][1]
            exc = exc.__cause__ or exc.__context__
        return self.innermost()

    def frame_of(self, gm: fx.GraphModule, node: fx.Node) -> Frame | None:
        """The innermost module or Function running when ``node`` was recorded."""
        index = list(gm.graph.nodes).index(node)
        frame = None
        for size, f in self.events:
            if size > index:
                break
            frame = f
        return frame

    def tag_modules(self, gm: fx.GraphModule) -> None:
        """Write the FQN of the module each node was recorded in to ``node.meta["custom"]["module"]``.

        The functionalizing re-trace copies ``custom`` to the nodes it makes (as the phase tags), so
        passes can name the module an op of the final graph came from (e.g. in an input check's error).
        Nodes recorded outside any module (the step function, backward) get no entry.
        """
        after = dict(self.marks)  # node -> the frame running once it was recorded (the last change wins)
        frame = after.get(None)
        for node in gm.graph.nodes:
            if frame is not None and frame.fqn is not None and node.op == "call_function":
                node.meta.setdefault("custom", {})["module"] = frame.fqn
            frame = after.get(node, frame)

# ---------------------------------------------------------------------- what is opaque
@dataclass
class OpaquePlan:
    """Which parts of a step run opaquely; kept by the compiled step across its variants.

    ``functions`` / ``modules`` (qualified Function name or module FQN -> why)
    grow when a trace fails inside such a part; ``forced`` Functions
    (``SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS``) and ``patterns`` (``OpaqueOverride``
    globs) are opaque from the start.  ``custom_autograd=False``
    (``SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1``): Functions are traced or the
    compile fails; ``auto_opaque=False`` (``SPMD_ORT_AUTO_OPAQUE=0``): a module that
    fails to trace is an error, as without this feature.
    """

    custom_autograd: bool = True
    auto_opaque: bool = True
    forced: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()
    functions: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    met: set[str] = field(default_factory=set)  # qualified names of the Functions applied while tracing
    checked_forced: bool = False
    # expert parallelism (an ExpertParallel mode): the modules its ``experts`` glob matches run by expert
    experts: Any = None

    def check_forced_met(self) -> None:
        """After the first trace: a WARNING naming the ``forced`` Functions defined in a function (``<locals>``,
        which compile() could not import and check) that the step never applied: likely a misspelled name."""
        if self.checked_forced:
            return
        self.checked_forced = True
        unmet = sorted(n for n in self.forced if "<locals>" in n and n not in self.met)
        if unmet:
            logger.warning("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS names %s, but the traced step applied no "
                           "autograd.Function of that name (it applied %s); check the spelling (module.qualname)",
                           ", ".join(unmet), ", ".join(sorted(self.met)) or "none")

    def function_reason(self, cls: type) -> str | None:
        if not self.custom_autograd:
            return None
        name = qualified_name(cls)
        if name in self.forced:
            return "listed in SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS"
        return self.functions.get(name)

    def expert_reason(self, fqn: str) -> str | None:
        """Why ``fqn`` runs by expert (its experts spread over ranks), or None."""
        if self.experts is not None and fnmatch.fnmatchcase(fqn, self.experts.experts):
            return f"expert parallel over {self.experts.ep} ranks (experts={self.experts.experts!r})"
        return None

    def module_reason(self, fqn: str) -> str | None:
        expert = self.expert_reason(fqn)
        if expert is not None:
            return expert
        if fqn in self.modules:
            return self.modules[fqn]
        pattern = next((p for p in self.patterns if fnmatch.fnmatchcase(fqn, p)), None)
        return f"OpaqueOverride({pattern!r})" if pattern is not None else None

    def adopt(self, frame: Frame | None, what: str) -> bool:
        """Make ``frame``'s part opaque after a trace failure (``what``); False if it cannot be."""
        if frame is None:
            return False
        why = f"tracing failed: {what}"
        if frame.kind == "function":
            name = frame.name
            if not self.custom_autograd or name in self.functions:
                return False
            self.functions[name] = why
            logger.info("autograd.Function %s cannot be traced (%s); it runs opaquely, as a host node", name, what)
            return True
        if not self.auto_opaque or frame.name == "<root>" or frame.name in self.modules:
            return False
        self.modules[frame.name] = why
        logger.warning("module `%s` cannot be traced (%s); it runs eagerly as an opaque host node inside the "
                       "compiled step (its parameters stay graph inputs). SPMD_ORT_AUTO_OPAQUE=0 makes this an "
                       "error", frame.name, what)
        return True


class _OpaqueApply(torch.autograd.Function):
    """An opaque call in the traced graph: ``opaque_forward`` now, ``opaque_backward`` when autograd runs backward."""

    @staticmethod
    def forward(ctx, call: OpaqueCall, *inputs: Tensor):
        outs = opaque_forward(list(inputs), call.index)
        values, token = outs[:-1], outs[-1]
        ctx.call = call
        ctx.save_for_backward(token)
        differentiable = list(call.differentiable) + [False] * (len(values) - len(call.differentiable))
        ctx.mark_non_differentiable(token, *(v for v, d in zip(values, differentiable) if not d))
        return (*values, token)

    @staticmethod
    def backward(ctx, *grads):
        (token,) = ctx.saved_tensors
        call: OpaqueCall = ctx.call
        wanted = [g for g, d in zip(grads, call.differentiable) if d]
        *grads_in, present = opaque_backward(token, wanted, call.index)
        tracker = presence.current()
        if tracker is not None:
            tracker.produced(grads_in, present)
        got = iter(grads_in)
        return (None, *(next(got) if g else None for g in call.needs_grad))


# ---------------------------------------------------------------------- capture
class OpaqueCapture:
    """Installed while a step is traced: captures opaque Functions and modules, follows where the trace is."""

    def __init__(self, root: nn.Module, plan: OpaquePlan, stack: CallStack):
        self.root = root
        self.plan = plan
        self.stack = stack
        self.calls: list[OpaqueCall] = []
        self.sampling = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[OpaqueCapture]:
        saved_apply = Function.__dict__["apply"]
        original = saved_apply.__get__(None, Function).__func__
        patched: list[tuple[nn.Module, Any]] = []

        def apply(cls, *args, **kwargs):
            # Function.apply is patched for the whole process: a Function another thread runs eagerly meanwhile
            # (a compiled step's opaque part) is no part of this trace
            if self.sampling or cls is _OpaqueApply or not under_trace():
                return original(cls, *args, **kwargs)
            self.plan.met.add(qualified_name(cls))
            reason = self.plan.function_reason(cls)
            if reason is not None:
                return self._capture_function(cls, args, kwargs, reason)
            return self._trace_function(cls, original, args, kwargs)

        try:
            Function.apply = classmethod(apply)
            for fqn, mod in self._opaque_modules():
                patched.append((mod, mod.__dict__.get("forward")))
                capture = self._capture_experts if self.plan.expert_reason(fqn) else self._capture_module
                mod.forward = functools.partial(capture, fqn, mod, mod.forward)
            with opaque_calls.tracing(self.calls), _quiet_fake_tensor_log():
                yield self
        finally:
            Function.apply = saved_apply
            for mod, previous in patched:
                if previous is None:
                    del mod.forward
                else:
                    mod.forward = previous

    def _opaque_modules(self) -> list[tuple[str, nn.Module]]:
        """Opaque submodules, outermost only (what runs inside an opaque module is not traced)."""
        out: list[tuple[str, nn.Module]] = []
        seen: set[int] = set()
        for fqn, mod in self.root.named_modules():
            if not fqn or id(mod) in seen or any(fqn.startswith(f"{p}.") for p, _ in out):
                continue
            if self.plan.module_reason(fqn) is not None:
                out.append((fqn, mod))
                seen.add(id(mod))
        if self.plan.patterns:
            unmatched = [p for p in self.plan.patterns
                         if not any(fnmatch.fnmatchcase(f, p) for f, _ in self.root.named_modules() if f)]
            for p in unmatched:
                logger.warning("OpaqueOverride(%r) matches no submodule of %s", p, type(self.root).__name__)
        return out

    # -------------------------------------------------------------- Functions
    def _trace_function(self, cls, original, args, kwargs):
        """Trace a Function inline; its frame (forward, then backward through node hooks) names it in failures."""
        frame = Frame("function", qualified_name(cls), self.stack.module(), cls)
        self.stack.push(frame)
        try:
            out = original(cls, *args, **kwargs)
        except BaseException as exc:
            self.stack.pop(exc)
            raise
        self.stack.pop()
        nodes = {id(t.grad_fn): t.grad_fn for t in pytree.tree_leaves(out)
                 if isinstance(t, Tensor) and t.grad_fn is not None}
        backward = Frame("function", frame.name, frame.fqn, cls, "backward")
        for node in nodes.values():
            node.register_prehook(lambda grad_outputs: self.stack.push(backward))
            node.register_hook(lambda grad_inputs, grad_outputs: self.stack.pop())
        return out

    def _capture_function(self, cls, args, kwargs, reason: str):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        name, fqn = qualified_name(cls), self.stack.module()
        for x in leaves:
            holder = x if isinstance(x, nn.Module) else getattr(x, "__self__", None)
            if isinstance(holder, nn.Module) and any(True for _ in holder.parameters()):
                where = f" in module `{fqn}`" if fqn else ""
                raise CompileError(
                    f"autograd.Function {name}{where} cannot be traced ({reason}) nor run opaquely: "
                    f"it receives the module {type(holder).__name__} as an argument, so its parameters would "
                    "bypass the compiled graph (data parallel, sharding, the optimizer). Fix: make the Function "
                    "traceable, or pass the tensors it needs as arguments", fqn=fqn, op=name)
        constants = [None if isinstance(x, Tensor) else x for x in leaves]  # no trace-time tensors kept alive

        def run(tensors: list[Tensor]):
            filled = list(constants)
            for i, t in zip(positions, tensors):
                filled[i] = t
            a, kw = pytree.tree_unflatten(filled, spec)
            return cls.apply(*a, **kw)

        inputs = [leaves[i] for i in positions]
        result, _ = self._capture("function", name, fqn, reason, run, inputs, mutable=())
        return result

    # -------------------------------------------------------------- modules
    def _capture_module(self, fqn: str, mod: nn.Module, forward: Callable, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        constants = [None if isinstance(x, Tensor) else x for x in leaves]
        params, param_names, _ = unique_named(mod.named_parameters(remove_duplicate=False))
        buffers, buffer_names, _ = unique_named(mod.named_buffers(remove_duplicate=False))
        names = param_names + buffer_names
        n_acts = len(positions)

        def run(tensors: list[Tensor]):
            filled = list(constants)
            for i, t in zip(positions, tensors[:n_acts]):
                filled[i] = t
            a, kw = pytree.tree_unflatten(filled, spec)
            mapping = {n: t for ns, t in zip(names, tensors[n_acts:]) for n in ns}
            with stateless._reparametrize_module(mod, mapping):
                return forward(*a, **kw)

        inputs = [leaves[i] for i in positions] + params + buffers
        first_buffer = n_acts + len(params)
        buffer_positions = tuple(range(first_buffer, len(inputs)))
        result, updated = self._capture("module", type(mod).__name__, fqn, self.plan.module_reason(fqn), run,
                                         inputs, mutable=buffer_positions)
        with torch.no_grad():
            for pos, value in updated:
                inputs[pos].copy_(value)  # the module's buffer (a traced tensor): a new-state output
        return result

    def _capture_experts(self, fqn: str, mod: nn.Module, forward: Callable, *args, **kwargs):
        """An experts module under expert parallelism: a host node whose run sends the tokens to the ranks that
        compute their experts (:func:`spmd_ort.distributed.experts.dispatch`; torchtitan's call on rows sorted by
        expert: ``dispatch_sorted``).  Its output has the hidden states' (rows') shape; its parameter inputs are
        traced whole and read as the rank's block of experts after the passes (:mod:`spmd_ort.passes.expert_parallel`).
        """
        from spmd_ort.distributed.experts import EXPECTED, call_kind, experts_runner

        try:
            bound = inspect.signature(forward).bind(*args, **kwargs)
        except TypeError as exc:
            raise CompileError(f"expert parallel: module `{fqn}` ({type(mod).__name__}) was called with "
                               f"{len(args)} positional and {sorted(kwargs)} keyword arguments ({exc}); expected "
                               f"{EXPECTED}", fqn=fqn, op=type(mod).__name__) from exc
        acts = list(bound.arguments.values())
        kind = call_kind(acts) if all(isinstance(t, Tensor) for t in acts) else None
        if kind is None:
            got = ", ".join(str(TensorMeta.of(t)) if isinstance(t, Tensor) else type(t).__name__ for t in acts)
            raise CompileError(f"expert parallel: module `{fqn}` ({type(mod).__name__}) was called with ({got}); "
                               f"expected {EXPECTED}", fqn=fqn, op=type(mod).__name__)
        params, _, _ = unique_named(mod.named_parameters(remove_duplicate=False))
        if any(True for _ in mod.buffers()):
            raise CompileError(f"expert parallel: module `{fqn}` ({type(mod).__name__}) holds buffers; an experts "
                               f"module computed by expert holds parameters only ({EXPECTED})", fqn=fqn,
                               op=type(mod).__name__)
        inputs = acts + params
        grad = torch.is_grad_enabled()
        call = OpaqueCall(index=len(self.calls), kind="module", name=type(mod).__name__, fqn=fqn,
                          reason=self.plan.expert_reason(fqn),
                          run=experts_runner(fqn, mod, forward, self.plan.experts, len(params), kind),
                          inputs=tuple(TensorMeta.of(t) for t in inputs),
                          needs_grad=tuple(grad and t.requires_grad and t.is_floating_point() for t in inputs),
                          outputs=(TensorMeta.of(acts[0]),), differentiable=(grad,),
                          shapes_from="the hidden states' shape (expert parallel)",
                          expert_params=tuple(range(len(acts), len(acts) + len(params))))
        self.calls.append(call)
        outs = _OpaqueApply.apply(call, *inputs)
        return outs[0]

    # -------------------------------------------------------------- both
    def _capture(self, kind: str, name: str, fqn: str | None, reason: str, run, inputs: list[Tensor], *,
                 mutable: tuple[int, ...]):
        """Record the call, learn its outputs from a sample run, emit the opaque op; (result, updated inputs)."""
        grad = torch.is_grad_enabled()
        call = OpaqueCall(index=len(self.calls), kind=kind, name=name, fqn=fqn, reason=reason, run=run,
                          inputs=tuple(TensorMeta.of(t) for t in inputs),
                          needs_grad=tuple(grad and t.requires_grad and t.is_floating_point() for t in inputs))
        structure, spec = self.sample(call, inputs, mutable)
        self.calls.append(call)
        outs = _OpaqueApply.apply(call, *inputs)
        n_values = len(call.outputs) - len(call.updates)
        values = iter(outs[:n_values])
        result = pytree.tree_unflatten([next(values) if x is None else x for x in structure], spec)
        return result, list(zip(call.updates, outs[n_values:-1]))

    def sample(self, call: OpaqueCall, inputs: list[Tensor], mutable: tuple[int, ...]):
        """Run the user's code once on sample inputs: its outputs' shapes, dtypes, structure, and what it updates.

        Fake tensors first (no data touched); when the code reads values, random
        real tensors of the inputs' shapes (the RNG state is restored after).
        Returns the result's leaves (None where a tensor goes) and its spec; sets the call's
        outputs and ``updates`` (inputs changed in place: allowed only at ``mutable`` positions).
        """
        failures = []
        for how in ("fake tensors", "random real tensors"):
            try:
                with self._sampling(how == "fake tensors", inputs) as xs, _Writes() as writes:
                    with torch.enable_grad():
                        raw = call.run(xs)
                    updated = tuple(i for i, x in enumerate(xs) if writes.wrote(x))
                    leaves, spec = pytree.tree_flatten(raw)
                    tensors = [x for x in leaves if isinstance(x, Tensor)]
                    call.outputs = tuple(TensorMeta.of(t) for t in tensors) + tuple(TensorMeta.of(xs[i])
                                                                                     for i in updated)
                    call.differentiable = tuple(t.requires_grad and t.is_floating_point() for t in tensors)
            except CompileError:
                raise
            except Exception as exc:  # noqa: BLE001 - try the next way; all failing is reported below
                failures.append(f"on {how}: {type(exc).__name__}: {_short(exc)}")
                continue
            bad = [i for i in updated if i not in mutable]
            if bad:
                raise CompileError(
                    f"{call.what} cannot be traced ({call.reason}) nor run opaquely: it modifies its input "
                    f"{bad[0]} ({call.inputs[bad[0]]}) in place, which the compiled graph may also read. Fix: "
                    "return a new tensor (clone the input before changing it)", fqn=call.fqn, op=call.name)
            call.out_consts = [x for x in leaves if not isinstance(x, Tensor)]
            call.shapes_from = how
            call.updates = updated
            return [None if isinstance(x, Tensor) else x for x in leaves], spec
        raise CompileError(
            f"{call.what} cannot be traced ({call.reason}) nor run opaquely: running it to learn its output "
            f"shapes failed ({'; '.join(failures)}). Fix: make it traceable, or make it run on inputs of these "
            f"shapes ({', '.join(str(m) for m in call.inputs)})", fqn=call.fqn, op=call.name)

    @contextlib.contextmanager
    def _sampling(self, fake: bool, inputs: list[Tensor]):
        self.sampling += 1
        try:
            with disable_proxy_modes_tracing(), self.stack.pause(), unset_fake_temporarily():
                if fake:
                    # A mode of its own, without symbolic shapes: reading a value fails here instead of
                    # leaving an unbacked symbol in the trace's shape environment.
                    with FakeTensorMode():
                        yield [_non_leaf(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device), t)
                               for t in inputs]
                else:
                    devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
                    with torch.random.fork_rng(devices=devices):
                        torch.manual_seed(0)
                        yield [_non_leaf(_random_like(t), t) for t in inputs]
        finally:
            self.sampling -= 1


# Ops that update arguments in place although their schema does not say so: the batch norms'
# running statistics (positions), when training (argument 5).
UNANNOTATED_WRITES = {op: (3, 4) for op in (aten.native_batch_norm.default, aten.cudnn_batch_norm.default,
                                             aten.miopen_batch_norm.default)}


class _Writes(TorchDispatchMode):
    """Records the storage of every tensor an op writes (``Tensor(a!)`` in its schema, or
    :data:`UNANNOTATED_WRITES`), on fake and real tensors alike: kernels such as batch norm
    update running statistics without bumping a version counter.
    """

    def __init__(self):
        super().__init__()
        self.storages: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            for arg, value in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                  schema.arguments[len(args):]]):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    for t in value if isinstance(value, (list, tuple)) else [value]:
                        if isinstance(t, Tensor):
                            self.storages.add(StorageWeakRef(t.untyped_storage()))
        if func in UNANNOTATED_WRITES and len(args) > 5 and args[5]:
            for i in UNANNOTATED_WRITES[func]:
                if isinstance(args[i], Tensor):
                    self.storages.add(StorageWeakRef(args[i].untyped_storage()))
        return func(*args, **kwargs)

    def wrote(self, t: Tensor) -> bool:
        return StorageWeakRef(t.untyped_storage()) in self.storages


def _random_like(t: Tensor) -> Tensor:
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype, device=t.device)
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def _non_leaf(sample: Tensor, like: Tensor) -> Tensor:
    """A sample that requires grad as ``like`` does, computed from a leaf as activations are."""
    if like.requires_grad and like.is_floating_point():
        return sample.requires_grad_(True).clone()
    return sample


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """Fake tensors log every failing meta kernel at ERROR; a failure here becomes an opaque part or our error."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def link_backward(gm: fx.GraphModule, calls: list[OpaqueCall]) -> None:
    """After tracing: each ``opaque_backward`` reads what the forward that made its token saved.

    Usually that is the call the backward was recorded for; under non-reentrant
    activation checkpointing it is the forward's recomputation (a later call).
    Calls whose saved state no backward reads run without recording autograd.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not opaque_backward:
            continue
        token = node.args[0]
        while token.target in (aten.detach.default, aten.alias.default):  # autograd's unpacking of a saved tensor
            token = token.args[0]
        producer = token.args[0] if token.target is operator.getitem else None
        if producer is None or producer.target is not opaque_forward:
            raise AssertionError(f"opaque_backward {node.name} does not read an opaque_forward's token")
        index = producer.args[1]
        node.args = (token, node.args[1], index)
        calls[index].saves_for_backward = True
