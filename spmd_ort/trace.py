"""Whole-step capture: the user's train step as one stateless, functional FX graph.

Two make_fx passes over fake tensors, so nothing real is read or written:

1. **capture** runs the user's function with the lifted state bound into the
   module and optimizer (:meth:`StateLayout.bind`).  ``loss.backward()`` runs the
   autograd engine on the traced tensors, so the backward ops land in the graph;
   ``optimizer.step()`` is the functional rule of :mod:`spmd_ort.optim`.  The
   graph still updates its inputs in place (``copy_``, ``add_``, ...).
2. **functionalize** re-traces that graph under ``torch.func.functionalize``:
   every mutation becomes a new value.  The step function returns the final
   state explicitly, so the epilogue ``copy_`` into inputs is dropped, and state
   that did not change is no output at all.

The result, :class:`TracedStep`, has placeholders ``state... , batch...`` and
outputs ``user leaves..., new state...`` described by :class:`~.state.Slot` lists.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from .amp import autocast_disabled
from .errors import CompileError
from .state import Slot, StateLayout

logger = logging.getLogger("spmd_ort")
aten = torch.ops.aten


TENSOR = object()  # marks where a graph output goes in the step's return value

# Ops that mutate their arguments but have no functionalization rule of their
# own; their decompositions reach ops that do (e.g. _native_batch_norm_legit).
# Applied while capturing, so that functionalization sees the result.
FUNCTIONAL_DECOMPS = get_decompositions([aten.native_batch_norm.default])


@dataclass
class TracedStep:
    gm: fx.GraphModule
    layout: StateLayout
    input_slots: list[Slot]  # one per placeholder
    output_slots: list[Slot]  # one per graph output
    batch_positions: list[int]  # positions of tensor leaves in the flattened (args, kwargs)
    user_spec: pytree.TreeSpec  # structure of the step's return value
    user_leaves: list[Any]  # non-tensor leaves of the return value (TENSOR where a tensor goes)
    seconds: float


class _ModuleStack:
    """Which submodule is running: names the FQN in trace errors.

    Besides the live stack, it logs (graph size, stack) at each module entry
    and exit, so that a node of the captured graph maps back to its module.
    """

    def __init__(self, module: nn.Module):
        self.names = {id(m): (fqn or "<root>") for fqn, m in module.named_modules(remove_duplicate=False)}
        self.stack: list[str] = []
        self.events: list[tuple[int, str | None]] = []

    def _graph_size(self) -> int:
        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else -1

    @contextlib.contextmanager
    def installed(self):
        def pre(mod, args):
            self.stack.append(self.names.get(id(mod), type(mod).__name__))
            self.events.append((self._graph_size(), self.stack[-1]))

        def post(mod, args, out):
            if self.stack:
                self.stack.pop()
            self.events.append((self._graph_size(), self.innermost()))

        h1 = nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = nn.modules.module.register_module_forward_hook(post)
        try:
            yield self
        finally:
            h1.remove()
            h2.remove()

    def innermost(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def fqn_of(self, gm: fx.GraphModule, node: fx.Node) -> str | None:
        """The module that was running when ``node`` was recorded (forward ops only)."""
        index = list(gm.graph.nodes).index(node)
        fqn = None
        for size, name in self.events:
            if size > index:
                break
            fqn = name
        return fqn


class _Phases(torch.overrides.TorchFunctionMode):
    """Records which stretches of the capture graph ``Tensor.backward`` / ``autograd.grad`` produced.

    Nodes recorded while backward runs get ``node.meta["custom"]["phase"] =
    "backward"``; the functionalizing re-trace copies the tag to the nodes it
    creates, so passes (e.g. re-gathering sharded parameters for backward) can
    tell forward from backward uses.
    """

    BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

    def __init__(self):
        super().__init__()
        self.ranges: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.BACKWARD:
            return func(*args, **kwargs)
        mode = get_proxy_mode()
        start = len(mode.tracer.graph.nodes) if mode is not None else -1
        out = func(*args, **kwargs)
        if mode is not None:
            self.ranges.append((start, len(mode.tracer.graph.nodes)))
        return out

    def tag(self, gm: fx.GraphModule) -> None:
        for i, node in enumerate(gm.graph.nodes):
            if any(a <= i < b for a, b in self.ranges):
                node.meta.setdefault("custom", {})["phase"] = "backward"


def phase(node: fx.Node) -> str:
    """``"backward"`` for nodes autograd recorded, else ``"forward"`` (optimizer and epilogue included)."""
    return node.meta.get("custom", {}).get("phase", "forward")


def _describe_failure(exc: BaseException) -> tuple[str, str | None]:
    """(what went wrong, op name) for the common ways tracing fails."""
    from torch._subclasses import fake_tensor as ft

    func = getattr(exc, "func", None)
    op = str(func) if func is not None else None
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ft.DataDependentOutputException) or "data-dependent" in text.lower() or (
            op is not None and ("_local_scalar_dense" in op or "is_nonzero" in op)):
        return ("the step reads a tensor's value in Python (.item(), bool(tensor), `if tensor:`, "
                "a data-dependent shape); the compiled graph cannot depend on tensor values", op)
    if isinstance(exc, ft.DynamicOutputShapeException):
        return "an op's output shape depends on tensor values (e.g. nonzero, boolean masking)", op
    if isinstance(exc, ft.UnsupportedOperatorException):
        return "an op has no fake-tensor implementation, so it cannot be traced", op
    return text, op


def trace_step(fn, args: tuple, kwargs: dict, layout: StateLayout, *, sdpa_math: bool = False,
               tag_grads: bool = False, mixed_precision=None) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` into a functional graph over ``layout``'s state.

    ``sdpa_math`` traces ``scaled_dot_product_attention`` as its math form
    (matmuls and softmax) instead of a fused kernel whose backward ONNX lacks.
    ``mixed_precision``: a :class:`spmd_ort.amp.MixedPrecisionPolicy` the forward runs under.
    """
    t0 = time.perf_counter()
    leaves, spec = pytree.tree_flatten((args, kwargs))
    batch_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    state_in = layout.gather()
    n_state = len(state_in)
    captured: dict[str, Any] = {}

    def step(*flat):
        state, batch = list(flat[:n_state]), flat[n_state:]
        new_leaves = list(leaves)
        for pos, t in zip(batch_positions, batch):
            new_leaves[pos] = t
        a, kw = pytree.tree_unflatten(new_leaves, spec)
        with layout.bind(state, tag_grads=tag_grads, mixed_precision=mixed_precision) as bound:
            out = fn(*a, **kw)
            final = bound.final()
        out_leaves, out_spec = pytree.tree_flatten(out)
        captured["user_spec"] = out_spec
        captured["user_leaves"] = [TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]
        captured["final_slots"] = [s for s, _ in final]
        return tuple(x for x in out_leaves if isinstance(x, torch.Tensor)) + tuple(t for _, t in final)

    trace_inputs = _state_for_tracing(layout, state_in) + [leaves[i] for i in batch_positions]
    stack = _ModuleStack(layout.module)
    phases = _Phases()
    try:
        attention = sdpa_kernel([SDPBackend.MATH]) if sdpa_math else contextlib.nullcontext()
        with stack.installed(), torch.enable_grad(), attention, phases:
            gm1 = make_fx(step, decomposition_table=FUNCTIONAL_DECOMPS, tracing_mode="fake",
                          _allow_non_fake_inputs=True)(*trace_inputs)
            _check_no_data_dependence(gm1, captured, stack)
    except CompileError:
        raise
    except Exception as exc:  # noqa: BLE001 - every trace failure becomes a CompileError
        what, op = _describe_failure(exc)
        raise _trace_error(what, op, stack.innermost()) from exc

    phases.tag(gm1)

    def run_capture(*flat):
        # An interpreter with node meta preserved: new nodes inherit the phase tags.
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(gm1).run(*flat)

    plain_inputs = [t.detach() for t in trace_inputs]
    with autocast_disabled():  # the capture already holds autocast's casts
        gm2 = make_fx(torch.func.functionalize(run_capture, remove="mutations"),
                      tracing_mode="fake", _allow_non_fake_inputs=True)(*plain_inputs)
    _check_functional(gm2)

    input_slots = layout.input_slots() + [Slot("batch", f"input[{k}]", k) for k in range(len(batch_positions))]
    n_user = sum(1 for x in captured["user_leaves"] if x is TENSOR)
    output_slots = [Slot("user", f"output[{k}]", k) for k in range(n_user)] + captured["final_slots"]
    _outputs_from_mutations(gm2, input_slots, output_slots)
    return TracedStep(gm2, layout, input_slots, output_slots, batch_positions, captured["user_spec"],
                      captured["user_leaves"], time.perf_counter() - t0)


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


def _trace_error(what: str, op: str | None, fqn: str | None) -> CompileError:
    where = f"in module `{fqn}`" if fqn else "outside any submodule (in the step function or backward)"
    fix = (f"supply an Override for `{fqn}` (spmd_ort.Override.replacement) or make it traceable"
           if fqn and fqn != "<root>" else "make the step function traceable")
    return CompileError(
        f"could not trace the train step {where}{f' at op {op}' if op else ''}: {what}. Fix: {fix}. "
        "The model and optimizer are unchanged.", fqn=fqn, op=op)


def _check_no_data_dependence(gm: fx.GraphModule, captured: dict, stack: _ModuleStack) -> None:
    """``.item()`` traces to an unbacked symbol instead of failing: refuse it here."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten._local_scalar_dense.default:
            fqn = stack.fqn_of(gm, node)
            raise _trace_error("the step reads a tensor's value in Python (.item(), float(tensor), "
                               "int(tensor)); the compiled graph cannot depend on tensor values; return the "
                               "tensor instead and convert it after the step", str(node.target), fqn)
    for leaf in captured.get("user_leaves", []):
        if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _trace_error("the step returns a Python number computed from a tensor; return the tensor",
                               None, None)


def _check_functional(gm: fx.GraphModule) -> None:
    """Only the epilogue ``copy_`` into inputs may mutate; anything else is a capture bug."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable \
                and node.target is not aten.copy_.default:
            raise CompileError(f"internal error: op {node.target} still mutates its inputs after "
                               "functionalization; add a decomposition for it to spmd_ort.trace.FUNCTIONAL_DECOMPS",
                               op=str(node.target))


def _outputs_from_mutations(gm: fx.GraphModule, input_slots: list[Slot], output_slots: list[Slot]) -> None:
    """Turn functionalization's epilogue (``copy_`` of new values into inputs) into outputs.

    State is already returned explicitly, so its ``copy_`` goes; a mutated batch
    input becomes a ``batch`` output (written back like eager's in-place update).
    State outputs that are still the input itself (unchanged) are dropped.
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
            if slot.kind == "batch":
                outs.append(node.args[1])
                output_slots.append(slot)
            elif slot.kind not in ("param", "buffer", "grad", "opt_state", "scaler"):
                raise CompileError(f"the train step writes into {slot.kind} input `{slot.name}` in place")
            graph.erase_node(node)
    # Input and output slots of the same state compare equal (same kind, name, index, key).
    keep = [i for i, (o, s) in enumerate(zip(outs, output_slots))
            if s.kind in ("user", "batch") or slot_of.get(o) != s]
    new_outs = [outs[i] for i in keep]
    output_slots[:] = [output_slots[i] for i in keep]
    out_node.args = (tuple(new_outs),)
    graph.eliminate_dead_code()
    gm.recompile()

