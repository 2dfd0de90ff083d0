"""Activation statistics in the graph: each ``spmd_ort::tap`` becomes its statistics, an extra output."""

from __future__ import annotations

from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.runtime import taps
from spmd_ort.graph import ops

from .contracts import NO_TAPS
from .helpers import calls, val
from .runner import graph_pass


def _inline_stats(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """The nodes of ``taps.tensor_stats(x)``, inserted at the graph's insertion point; returns the stats node."""
    sub = make_fx(taps.tensor_stats, tracing_mode="fake")(val(x))
    placeholder = next(n for n in sub.graph.nodes if n.op == "placeholder")
    return graph.graph_copy(sub.graph, {placeholder: x})


@graph_pass(provides=[NO_TAPS])
def insert_activation_stats_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Each tapped activation's statistics (``spmd_ort.runtime.taps.STATS``) are computed in the graph and returned.

    A debug subscriber's hooks tap activations while the step is traced; here
    every ``tap(x, tap_id)`` is replaced by ``x`` and the float64 statistics of
    ``x`` (the aten ops of ``taps.tensor_stats``, so they run in ORT segments
    too) become an output described by ``Slot(SlotKind.STATS, <name>, tap_id)``; the
    compiled program hands them to the subscriber after each run (one stats output per tap).
    """
    graph = gm.graph
    out = graph.output_node()
    stats_outputs = []
    for node in calls(gm, ops.tap):
        x, tap_id = node.args
        with graph.inserting_before(node.next):  # (inserting_after would reverse the copied nodes)
            stats = _inline_stats(graph, x)
        node.replace_all_uses_with(x)
        graph.erase_node(node)
        if ctx.taps is not None and ctx.taps.known(tap_id):  # a subscriber removed since tracing gets nothing
            stats_outputs.append(stats)
            ctx.output_slots.append(Slot(SlotKind.STATS, ctx.taps.name_of(tap_id), tap_id))
    if stats_outputs:
        out.args = (tuple(out.args[0]) + tuple(stats_outputs),)
    graph.eliminate_dead_code()
    return gm
