"""Segments: a graph's regions one backend runs, between host nodes torch runs (any backend's grouping).

The operator-support predicate is each backend's (``spmd_ort.backends.ort.partition.OrtSupport``,
``spmd_ort.backends.inductor.InductorSupport``); the grouping is shared: torch.fx's ``CapabilityBasedPartitioner``
(deterministic, largest connected regions, no cycles through host nodes), split where a collective starts or
is waited for and at each random draw.  Also the ops every backend leaves on the host.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupport
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from spmd_ort.graph import ops
from spmd_ort.graph.aliasing import is_view_op
from spmd_ort.graph.ops import STARTS, draws_random, wait_
from spmd_ort.graph.symbolic import SizeEmitter, input_symbols

aten = torch.ops.aten

HOST_NAMESPACES = ("spmd_ort", "_c10d_functional", "c10d_functional", "_dtensor")
RANDOM_OPS = {
    aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p, aten.rand.default,
    aten.randn.default, aten.rand_like.default, aten.randn_like.default, aten.randint.low,
    aten.randint.default, aten.randperm.default, aten.multinomial.default, aten.normal.Tensor_float,
    aten.uniform.default, aten.exponential.default,
}
UNINITIALIZED_OPS = {
    aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
    aten.new_empty_strided.default,
}


def partition_with(gm: fx.GraphModule, support: OperatorSupport) -> tuple[fx.GraphModule, list[str]]:
    """Fuse the regions ``support`` accepts into submodules ``fused_<i>`` (largest connected regions, split at
    collectives, none of views alone; any backend's grouping); returns (graph, their names)."""
    partitions = _propose_by_stage(gm, support)
    # a segment made only of views/getitems is not worth an ORT call
    partitions = [p for p in partitions if any(_is_compute(n) for n in p.nodes)]
    # what CapabilityBasedPartitioner.fuse_partitions calls, without building that partitioner over the whole
    # graph: its constructor records every node's downstream set (quadratic: 0.5 GiB at 16 Llama-3-8B layers)
    fused = fuse_by_partitions(gm, [p.nodes for p in partitions], prefix="fused_")
    names = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    return fused, names


def sizes_from_inputs(gm: fx.GraphModule) -> None:
    """Dynamic shapes: every symbolic size read from the graph's inputs, never from a value computed in it.

    ``sym_size`` of an activation is a host node (sizes are Python ints) that depends
    on the segment computing the activation, so the segment that uses the size must
    start after it: each such read splits the graph.  The same size is a symbol of
    an input's size or an expression in such symbols (``s0*s1``, the rows of a
    flattened batch), so it is read there, at the top of the graph, and computed
    from those reads with Python arithmetic: the ORT segments stay as large as in a
    static program.  An expression it cannot rebuild keeps its read.
    """
    sources = {sym: src for sym, src in input_symbols(gm).items() if src[1] is not None}  # dims of tensors
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not sources:
        return
    graph = gm.graph
    emit = SizeEmitter(graph, placeholders[-1], sources)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.sym_size.int or node.args[0].op == "placeholder":
            continue
        val = node.meta.get("val")
        made = emit(val.node.expr) if isinstance(val, torch.SymInt) else None
        if isinstance(made, fx.Node):
            node.replace_all_uses_with(made)
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _propose_by_stage(gm: fx.GraphModule, support: OperatorSupport) -> list:
    """torch's ``CapabilityBasedPartitioner`` proposals, made stage by stage (:func:`_stages`) on a copy of each
    stage's nodes: the same grouping as proposing over the whole graph and splitting at the host points, in time
    linear in the number of stages (the partitioner's cycle check walks every node downstream of a merge: over
    the whole graph that is quadratic, 560 s of a 32-layer Llama's 630 s plan).  A stage's nodes are contiguous
    in graph order (a getitem joins its tuple's stage, its only input): no path leaves a stage and comes back
    into it, so what is acyclic within a stage is acyclic in the graph."""

    stages = _stages(gm)
    by_stage: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            by_stage.setdefault(stages[node], []).append(node)
    out: list = []
    for nodes in by_stage.values():
        graph, original = fx.Graph(), {}
        copies: dict[fx.Node, fx.Node] = {}

        def outside(n: fx.Node) -> fx.Node:  # a value from another stage: a placeholder of this stage's copy
            if n not in copies:
                copies[n] = graph.placeholder(f"in_{len(copies)}")
                copies[n].meta = n.meta
            return copies[n]

        for node in nodes:
            copy = graph.node_copy(node, lambda n: copies[n] if n in copies else outside(n))
            copies[node] = copy
            original[copy] = node
        graph.output(None)

        class OnOriginal(OperatorSupport):
            def is_node_supported(self, submodules, node: fx.Node) -> bool:
                return node in original and support.is_node_supported(submodules, original[node])

        window = fx.GraphModule(gm, graph)
        for p in CapabilityBasedPartitioner(window, OnOriginal(), allows_single_node_partition=False
                                            ).propose_partitions():
            out.append(Partition(id=len(out), nodes=[original[n] for n in p.nodes]))
    return out


def _stages(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Each node's stage: the number of collective issue or wait points, pipeline transfers and random draws
    before it in graph order (a getitem: its tuple's).

    No segment spans a collective's issue or wait point, so compute overlaps the collective; and none spans
    a random draw, so the draws keep their order.

    Without the first, all of backward would be one segment and every all-reduce would
    start after it (and a parameter all-gather's wait would hold back compute
    that does not need the parameter).  Without the second, a segment fusing independent regions between
    draws (two micro-batches' dropouts: the first's second mask and the second's first) makes the host run
    the draws in another order than eager, which changes every mask.  A pipeline's transfers keep the
    schedule's order (a segment spanning one could hold a send back behind a receive its peer waits on).  Parts
    are contiguous in graph order, so
    splitting keeps the partitions acyclic.  A getitem stays with the op whose tuple it reads (its only input),
    wherever it stands: a segment returns tensors, never a multi-output op's tuple
    (``native_layer_norm_backward``'s bias gradient read after a collective began, under sequence parallelism).
    """
    stage, stages = 0, {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.target in STARTS or node.target is wait_ or node.target in ops.P2P
                                           or draws_random(node)):
            stage += 1
        source = node.args[0] if node.target is operator.getitem and node.args else None
        stages[node] = stages[source] if isinstance(source, fx.Node) and source in stages else stage
    return stages


def _is_compute(node: fx.Node) -> bool:
    """Not an element of a multi-output op's results, a view or an in-place result: something to place."""
    return node.target is not operator.getitem and not is_view_op(node.target, writes=True)


# Ops whose output's size depends on the values: a CUDA graph replays the sizes it captured.
VALUE_SIZED = (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default,
               torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default,
               torch.ops.aten.repeat_interleave.Tensor)
# Ops that read a value on the host: the host waits for the device there, which a capture cannot do.
HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
              torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default)


def tensors_of(value) -> list[torch.Tensor]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


def capture_verdict(node: fx.Node, host: str = "cpu") -> tuple[str, str] | None:
    """Whether one graph node of a GPU step can be captured in a CUDA graph: None if it can, else ("split",
    why) for a node that must run on the host between graphs, or ("block", why) for one no graph can replay.
    ``host``: the device type whose tensors a graph cannot hold (a CPU standing in for a GPU in tests: none)."""
    target = node.target
    if target is operator.getitem:
        return None
    if target in ops.OPAQUE_OPS:
        return "split", "an opaque part: the user's Python code runs between graphs"
    if target in VALUE_SIZED:
        return "block", f"{target}'s output size depends on the values, and a graph replays the sizes it captured"
    if target in HOST_READS:
        return "split", f"{target} reads a value on the host, which waits for the GPU"
    if target is ops.grads_present:
        return "split", "which gradients opaque parts made is gathered on the host"
    if target in ops.OPTIMIZER_OPS and _argument(node, "present") is not None:
        return "split", (f"{target} skips the parameters no opaque part gave a gradient, reading which on the "
                         "host")
    if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return None  # size arithmetic: fixed in each capture (one per size)
    if not isinstance(target, torch._ops.OpOverload):
        return "split", f"the Python callable {getattr(target, '__name__', target)} runs on the host"
    for arg in node.all_input_nodes:
        for t in tensors_of(arg.meta.get("val")):
            if t.device.type == host:
                # a 0-d host tensor is read at capture and replayed as that constant: a hyper-parameter on the
                # host would be frozen at its first value
                return "split", f"{target} reads {arg.name}, a host tensor"
    for t in tensors_of(node.meta.get("val")):
        if t.device.type == host:
            return "split", f"{target} makes a host tensor"
    return None


def _argument(node: fx.Node, name: str):
    """The value of ``node``'s argument ``name`` (by its op's schema), or None."""
    if name in node.kwargs:
        return node.kwargs[name]
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else None
    return None
