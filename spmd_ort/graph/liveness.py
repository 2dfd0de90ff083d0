"""The liveness walk of a graph: what its values hold while it runs (:func:`plan_activation_memory`), the one
byte count of a value (:func:`value_bytes`).

Every value lives from the op that makes it to its last use, views and in-place results sharing their base's
storage (:func:`spmd_ort.graph.aliasing.aliases_input`), as the fx executor frees them; inputs are not counted.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.compat import optimization_hint
from spmd_ort.graph.aliasing import aliases_input
from spmd_ort.graph.meta import phase


def value_bytes(val) -> int:
    """Bytes of a value; a symbolic size counts at the size the program was traced with."""
    if isinstance(val, torch.Tensor):
        return optimization_hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(value_bytes(v) for v in val)
    return 0


@dataclass(frozen=True)
class ActivationPlan:
    """The liveness walk's result: the peak bytes of the values the graph creates, and how many of those live
    at the peak are forward values kept for the backward (read by a node autograd recorded); ``live``: the bytes
    live while each node runs, in graph order (a picture of memory over the step)."""

    peak: int
    saved_for_backward: int
    live: tuple = ()


def _is_backward(node: fx.Node) -> bool:
    return phase(node) == "backward"  # the trace's tag (spmd_ort.capture.trace)


# node meta: bytes a value keeps alive outside the graph while it lives (an experts host node's token: what its
# autograd saved for the backward; spmd_ort.passes.expert_parallel)
HELD_BYTES = "held_bytes"


def plan_activation_memory(gm: fx.GraphModule) -> ActivationPlan:
    """Peak bytes of the values the graph creates (inputs excluded), freed after their last use, and the bytes of
    forward values the backward reads among those live at the peak (the first such peak).

    With symbolic sizes (dynamic shapes), at the sizes the program was traced with.
    """
    nodes = list(gm.graph.nodes)
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        # (an element of a multi-output op's results, a layer norm's output, mean and rstd, is storage of its own,
        # freed after its own last use; _unsafe_view is its input's storage, as the reshape the executed graph runs)
        if aliases_input(node, writes=True):
            base = node.args[0]
            root[node] = root.get(base, base)
        else:
            root[node] = node
    # a multi-output op holds what no getitem takes out; each element taken out is counted at its getitem
    own = {n: value_bytes(n.meta.get("val")) + n.meta.get(HELD_BYTES, 0) for n in nodes
           if n.op == "call_function" and root[n] is n}
    for node in nodes:
        if node.target is operator.getitem and root[node] is node and node.args[0] in own:
            own[node.args[0]] -= value_bytes(node.meta.get("val"))
    last: dict[fx.Node, int] = {}
    saved: set[fx.Node] = set()  # roots of forward values a backward node reads
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last[root[arg]] = i
            if _is_backward(node) and not _is_backward(arg):
                saved.add(root[arg])
    frees: dict[int, list[fx.Node]] = {}
    for r, i in last.items():
        frees.setdefault(i, []).append(r)
    live: set[fx.Node] = set()
    size = peak = peak_saved = 0
    at: list[int] = []
    for i, node in enumerate(nodes):
        if node.op == "call_function" and root[node] is node:
            live.add(node)
            size += own[node]
        at.append(size)
        if size > peak:
            peak = size
            peak_saved = sum(own[r] for r in live if r in saved)
        if node.op == "output":
            continue  # outputs outlive the step
        for r in frees.get(i, []):
            if r.op == "call_function":
                live.discard(r)
                size -= own[r]
    return ActivationPlan(peak=peak, saved_for_backward=peak_saved, live=tuple(at))


def planned_peak_bytes(gm: fx.GraphModule) -> int:
    """Peak bytes of the values the graph creates (inputs excluded), freed after their last use
    (:func:`plan_activation_memory`)."""
    return plan_activation_memory(gm).peak
