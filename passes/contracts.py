"""Contracts of graph passes: named facts about the graph that a pass requires, provides or invalidates.

Each pass declares its contract with :func:`spmd_ort.passes.runner.graph_pass`.  Two checks use them:

* **the order, always**: before any pass runs, :func:`spmd_ort.passes.runner.check_order` walks the
  pipeline from the facts the trace provides (:func:`traced_facts`) and fails with a ``PassError``
  naming both passes when a pass requires a fact that no earlier, enabled pass provides (or that a pass
  in between invalidates) — e.g. a disabled ``propagate_shards_pass`` under ``gather_parameters_pass``;
* **the graph, when asked** (``SPMD_ORT_CHECK_PASSES=1``, ``DebugOptions(check_passes=True)``, always in
  the test suite): an :class:`Invariant` with a ``check`` is checked on the graph before the passes that
  require it and after those that provide it, plus :data:`ALWAYS` after every pass; a fact a pass breaks
  without declaring it, while a later pass requires it, names both passes.  User transforms
  (``Override.transform``, ``gm_transformation``) declare nothing, so after each of them the facts later
  passes require are checked always.

Shared facts live here; a fact only one pass family provides lives with that family (e.g.
``ONE_ALL_REDUCE_PER_BUCKET`` in ``data_parallel.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.graph.slots import SlotKind
from spmd_ort.backends.ort import coverage
from spmd_ort.backends.ort.decompose import DECOMPOSITION
from spmd_ort.graph import ops

from .context import PassContext
from .helpers import (DEDUP_KEY, EAGER_LAYOUT_UNKNOWN, EXPERT_BLOCK, GRADIENT_OF, PARTIAL_FOUND_INF, PARTIAL_NORM,
                      SHARD_OF, SHARDED_PARAM, TAG, aten, calls, compute_device, is_dtype_cast, is_random, is_view_op,
                      phase, placeholders, val)

Check = Callable[[fx.GraphModule, PassContext], "str | None"]


@dataclass(frozen=True)
class Invariant:
    """A fact about the graph (and its context).

    ``check`` returns None when it holds, else what is wrong; a fact without one is tracked by the
    order check only (it is about how the graph was built, e.g. waits sunk to their first use).
    """

    name: str
    doc: str
    check: Check | None = None

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other) -> bool:
        return isinstance(other, Invariant) and other.name == self.name


def _io_matches_slots(gm, ctx):
    n_in = len(placeholders(gm))
    outs = gm.graph.output_node().args[0]
    n_out = len(outs) if isinstance(outs, (tuple, list)) else 1
    if n_in != len(ctx.input_slots) or n_out != len(ctx.output_slots):
        return (f"{n_in} placeholders / {n_out} outputs, but {len(ctx.input_slots)} input slots / "
                f"{len(ctx.output_slots)} output slots")
    return None


def _values_known(gm, ctx):
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            return f"node `{node.name}` ({node.target}) has no meta['val']"
    return None


def _functional_aten(gm, ctx):
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable \
                and getattr(node.target, "namespace", None) == "aten":
            return f"`{node.name}` ({node.target}) mutates its input"
    return None


def _grads_tagged(gm, ctx):
    seen: set[int] = set()
    params = {s.index for s in ctx.input_slots if s.kind is SlotKind.PARAM}
    for node in calls(gm, TAG):
        index = node.args[1]
        if index not in params:
            return f"tag_grad names parameter {index}, which is not a graph input"
        seen.add(index)  # (once per backward that reaches the parameter: micro-batches tag it several times)
    if not seen:
        return "no gradient is tagged (trace with tag_grads=True)"
    return None


def _tagged_once_per_read(gm, ctx):
    """No accumulation adds two tagged values: micro-batch gradients are summed before they are tagged."""
    tagged: set[fx.Node] = set(calls(gm, TAG))
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.add.Tensor:
            ins = [a for a in node.args if isinstance(a, fx.Node)]
            if sum(a in tagged for a in ins) >= 2:
                return f"`{node.name}` adds two tagged gradients ({', '.join(a.name for a in ins)}): reduced twice"
            if any(a in tagged for a in ins):
                tagged.add(node)
    return None


def _no_grad_tags(gm, ctx):
    tags = calls(gm, TAG)
    return f"{len(tags)} tag_grad node(s) remain" if tags else None


def _no_taps(gm, ctx):
    left = calls(gm, ops.tap)
    return f"{len(left)} tap node(s) remain" if left else None


def _collectives_waited(gm, ctx):
    for node in calls(gm, *ops.STARTS):
        waits = [u for u in node.users if u.target is ops.wait_]
        if len(waits) != 1:
            return f"collective `{node.name}` ({node.target}) has {len(waits)} wait_ nodes, not 1"
    return None


def _per_gradient_reductions(gm, ctx):
    for node in calls(gm, ops.all_reduce_, ops.reduce_scatter):
        if isinstance(node.meta.get(GRADIENT_OF), tuple):
            return f"`{node.name}` ({node.target}) reduces a bucket of gradients {node.meta[GRADIENT_OF]}"
    return None


def _no_duplicate_collectives(gm, ctx):
    seen = {}
    for node in calls(gm, ops.all_reduce_, ops.broadcast_, ops.all_gather):
        key = (node.target, tuple(node.args), node.meta.get(DEDUP_KEY))
        if key in seen:
            return f"`{node.name}` repeats `{seen[key].name}`"
        seen[key] = node
    return None


def _buffers_broadcast(gm, ctx):
    if ctx.mode is None or not ctx.mode.broadcast_buffers:
        return None
    for node, slot in zip(placeholders(gm), ctx.input_slots):
        if slot.kind is SlotKind.BUFFER and any(u.target is not ops.broadcast_ for u in node.users):
            return f"buffer `{slot.name}` is read without its broadcast_"
    return None


def _sharded_placeholders(gm, ctx):
    for node, slot in zip(placeholders(gm), ctx.input_slots):
        if slot.kind is SlotKind.PARAM and slot.index in ctx.shard_specs:
            want = (ctx.shard_specs[slot.index].shard_numel,)
            if tuple(val(node).shape) != want:
                return f"parameter placeholder `{slot.name}` holds {tuple(val(node).shape)}, not its shard {want}"
    return None


def _marked(node: fx.Node) -> bool:
    """Whether propagate_shards_pass marked ``node`` (a value on shards, a partial norm or inf flag)."""
    if node.meta.get(SHARD_OF) is not None or node.meta.get(PARTIAL_NORM) is not None:
        return True
    return any(u.meta.get(PARTIAL_NORM) is not None or u.meta.get(PARTIAL_FOUND_INF) for u in node.users)


def _shards_propagated(gm, ctx):
    for src in gm.graph.nodes:
        if src.meta.get(SHARD_OF) is None or not (src.op == "placeholder" or src.target is ops.wait_):
            continue
        for user in src.users:
            if user.op == "call_function" and user.target not in ops.COLLECTIVES and not _marked(user):
                return f"`{user.name}` ({user.target}) reads the shard `{src.name}` but carries no shard mark"
    return None


def _params_gathered_before_use(gm, ctx):
    for node, slot in zip(placeholders(gm), ctx.input_slots):
        if slot.kind is not SlotKind.PARAM or slot.index not in ctx.shard_specs:
            continue
        for user in node.users:
            if user.target is ops.all_gather or user.meta.get(SHARD_OF) is not None:
                continue
            if user.meta.get(EXPERT_BLOCK):  # expert parallel: the rank's experts are its own shard
                continue
            if user.users and all(u.target is ops.all_gather for u in user.users):
                continue  # a cast (or host copy) of the shard that only feeds gathers
            if user.target is operator.getitem:
                continue
            return f"`{user.name}` ({user.target}) reads the shard of `{slot.name}` without gathering it"
    return None


def _backward_reads_no_forward_views(gm, ctx):
    params = {n for n in placeholders(gm) if n.meta.get(SHARDED_PARAM) is not None}
    for node in gm.graph.nodes:
        if node.op != "call_function" or phase(node) != "backward":
            continue
        for arg in node.all_input_nodes:
            if arg in params or phase(arg) == "backward":
                continue
            root = arg
            while root.op == "call_function" and (is_view_op(root.target) or is_dtype_cast(root)) and root.args \
                    and isinstance(root.args[0], fx.Node):
                root = root.args[0]
            if root in params:
                return f"backward node `{node.name}` reads `{arg.name}`, a forward view of the parameter `{root.name}`"
    return None


def _partials_completed(mark: str, what: str):
    def check(gm, ctx):
        for node in gm.graph.nodes:
            value = node.meta.get(mark)
            if value is None or value is False:
                continue
            for user in node.users:
                if user.target not in (aten.stack.default, aten.clone.default):
                    return f"`{user.name}` ({user.target}) reads the {what} `{node.name}` before its completion"
        return None
    return check


def _no_device_optimizer_ops(gm, ctx):
    left = calls(gm, *ops.HOST_TWINS)
    return f"{len(left)} device optimizer op(s) remain" if left else None


def _gathers_on_compute_device(gm, ctx):
    device = compute_device(gm, ctx.input_slots)
    for node in calls(gm, ops.all_gather):
        if val(node.args[0]).device != device:
            return f"`{node.name}` gathers a tensor on {val(node.args[0]).device}, not on {device}"
    return None


def _onnx_lowered(gm, ctx):
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "aten" \
                and DECOMPOSITION not in node.meta and coverage.decomposition_for(node) is not None:
            return f"`{node.name}` ({node.target}) has no direct ONNX translation and no decomposition marked"
    return None


def _views_as_reshapes(gm, ctx):
    left = calls(gm, aten.view.default, aten._unsafe_view.default)
    return f"{len(left)} view node(s) remain (e.g. `{left[0].name}`)" if left else None


def _random_layouts_pinned(gm, ctx):
    for node in gm.graph.nodes:
        if not is_random(node) or node.meta.get(EAGER_LAYOUT_UNKNOWN):
            continue
        for arg in node.all_input_nodes:
            if isinstance(arg.meta.get("val"), torch.Tensor) and arg.target is not ops.with_layout:
                return f"random op `{node.name}` ({node.target}) reads `{arg.name}` without with_layout"
    return None


IO_MATCHES_SLOTS = Invariant("io_matches_slots", "placeholders and outputs match input_slots/output_slots",
                             _io_matches_slots)
VALUES_KNOWN = Invariant("values_known", "every placeholder and op node has meta['val']", _values_known)
FUNCTIONAL_ATEN = Invariant("functional_aten", "no aten op mutates its inputs", _functional_aten)
GRADS_TAGGED = Invariant("grads_tagged", "parameter gradients are tagged (trace with tag_grads)",
                         _grads_tagged)
NO_GRAD_TAGS = Invariant("no_grad_tags", "no tag_grad node remains", _no_grad_tags)
GRADS_SUMMED_BEFORE_REDUCTION = Invariant(
    "grads_summed_before_reduction",
    "micro-batch gradients are summed before they are tagged: one reduction per gradient value the step reads",
    _tagged_once_per_read)
NO_TAPS = Invariant("no_taps", "no activation tap remains (each became its statistics)", _no_taps)
COLLECTIVES_WAITED = Invariant("collectives_waited", "every collective start has exactly one wait_",
                               _collectives_waited)
PER_GRADIENT_REDUCTIONS = Invariant(
    "per_gradient_reductions", "each gradient is reduced by a collective of its own (not yet bucketed)",
    _per_gradient_reductions)
NO_DUPLICATE_COLLECTIVES = Invariant("no_duplicate_collectives", "no two collectives share target, args and key",
                                     _no_duplicate_collectives)
BUFFERS_BROADCAST = Invariant("buffers_broadcast", "with broadcast_buffers, buffers are read through broadcast_",
                              _buffers_broadcast)
SHARDED_PLACEHOLDERS = Invariant("sharded_placeholders", "sharded parameter placeholders hold their shard",
                                 _sharded_placeholders)
SHARDS_PROPAGATED = Invariant(
    "shards_propagated", "what reads a gradient or state shard is marked (shard_of, partial norm or inf flag)",
    _shards_propagated)
PARAMS_GATHERED_BEFORE_USE = Invariant(
    "params_gathered_before_use", "a sharded parameter is read whole only through an all-gather",
    _params_gathered_before_use)
BACKWARD_VIEWS_REMATERIALIZED = Invariant(
    "backward_views_rematerialized", "no backward node reads a forward view or cast of a sharded parameter",
    _backward_reads_no_forward_views)
GRAD_NORMS_COMPLETED = Invariant("grad_norms_completed", "partial norms are read only by their completion",
                                 _partials_completed(PARTIAL_NORM, "partial norm"))
FOUND_INF_COMPLETED = Invariant("found_inf_completed", "partial inf flags are read only by their completion",
                                _partials_completed(PARTIAL_FOUND_INF, "partial inf flag"))
OVERLAP_SCHEDULED = Invariant(
    "overlap_scheduled", "reductions issued as soon as their input exists, waits sunk to their first use "
    "(a scheduling fact: not checked on the graph)")
NO_DEVICE_OPTIMIZER_OPS = Invariant("no_device_optimizer_ops", "every optimizer op is a host twin",
                                    _no_device_optimizer_ops)
GATHERS_ON_COMPUTE_DEVICE = Invariant("gathers_on_compute_device", "all-gathers read tensors on the compute device",
                                      _gathers_on_compute_device)
ONNX_LOWERED = Invariant("onnx_lowered", "every aten op without a direct ONNX translation carries its decomposition",
                         _onnx_lowered)
RANDOM_LAYOUTS_PINNED = Invariant(
    "random_layouts_pinned", "every tensor input of a random op is read through with_layout (eager's layout), "
    "unless no probe could find that layout", _random_layouts_pinned)
VIEWS_AS_RESHAPES = Invariant("views_as_reshapes", "no aten view remains (views run as reshapes)", _views_as_reshapes)

# checked after every pass when contracts are checked
ALWAYS = (IO_MATCHES_SLOTS, VALUES_KNOWN, FUNCTIONAL_ATEN)


def traced_facts(ctx: PassContext) -> set[Invariant]:
    """What the graph of a trace provides: :data:`ALWAYS`, no collectives left unwaited (there are none), no
    gradient tags left (there are none) unless the trace tagged gradients for a parallel mode."""
    facts = set(ALWAYS) | {COLLECTIVES_WAITED}
    facts.add(GRADS_TAGGED if ctx.mode is not None else NO_GRAD_TAGS)
    return facts
