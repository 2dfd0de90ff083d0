"""Data-parallel expansion: gradient tags -> bucketed, overlapped, de-duplicated all-reduces.

Pipeline order (``pipeline.parallel_passes``): expand -> bucket -> dedup -> overlap.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.tools_common import stable_topological_sort

from spmd_ort.collectives import all_gather, all_reduce_, broadcast_, reduce_scatter, wait_
from spmd_ort import parallel  # noqa: F401 - registers spmd_ort::tag_grad
from spmd_ort.trace import phase

aten = torch.ops.aten
TAG = torch.ops.spmd_ort.tag_grad.default


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _call(graph: fx.Graph, target, args: tuple, val) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _nbytes(node: fx.Node) -> int:
    v = _val(node)
    return v.numel() * v.element_size()


def expand_data_parallel_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Each ``tag_grad(g)`` becomes ``wait_(all_reduce_(clone(g), 1/world))``; buffers are broadcast.

    requires: gradients tagged while tracing; ``ctx.world_size``, ``ctx.parallel_mode``.
    ensures: one all-reduce per tagged gradient on a private copy (the in-place
    collective never touches a tensor something else reads); with
    ``broadcast_buffers`` every buffer placeholder is broadcast from rank 0
    before its first use; no tag remains.
    """
    graph = gm.graph
    prescale = 1.0 / ctx.world_size
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is TAG:
            grad = node.args[0]
            with graph.inserting_before(node):
                copy = _call(graph, aten.clone.default, (grad,), _val(node))
                reduced = _call(graph, all_reduce_, (copy, prescale), _val(node))
                done = _call(graph, wait_, (reduced,), _val(node))
            node.replace_all_uses_with(done)
            graph.erase_node(node)
    broadcast_buffers(gm, ctx)
    return gm


def broadcast_buffers(gm: fx.GraphModule, ctx) -> None:
    """With ``broadcast_buffers``, every used buffer placeholder is broadcast from rank 0 first."""
    mode = ctx.parallel_mode
    if mode is None or not mode.broadcast_buffers:
        return
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    for node, slot in zip(placeholders, ctx.input_slots):
        if slot.kind != "buffer" or not node.users:
            continue
        with graph.inserting_after(last):
            synced = _call(graph, broadcast_, (node, 0), _val(node))
        node.replace_all_uses_with(synced, delete_user_cb=lambda u: u is not synced)
        last = synced


def _chains(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(clone, all_reduce_, wait_) chains of single gradients, in graph order."""
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is all_reduce_:
            src = node.args[0]
            waits = [u for u in node.users if u.target is wait_]
            if src.target is aten.clone.default and len(src.users) == 1 and len(waits) == 1 \
                    and len(node.users) == 1:
                out.append((src, node, waits[0]))
    return out


def bucket_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Gradients, in the order backward produces them, share one all-reduce per bucket.

    Buckets hold gradients of one dtype and device up to ``bucket_cap_mb``
    (the first up to ``first_bucket_cap_mb``, so communication starts early).
    A bucket is ``cat`` of the flattened gradients -> ``all_reduce_`` ->
    ``wait_`` -> ``split`` -> ``view`` back to each gradient's shape.
    requires: ``expand_data_parallel_pass``.  ensures: collectives = buckets.
    """
    mode = ctx.parallel_mode
    graph = gm.graph
    chains = _chains(graph)
    if not chains:
        return gm
    order = {n: i for i, n in enumerate(graph.nodes)}
    chains.sort(key=lambda c: order[c[0].args[0]])  # by when the gradient exists
    buckets: list[list] = []
    size, cap = 0, min(mode.first_bucket_cap_mb, mode.bucket_cap_mb) * 2**20
    for chain in chains:
        grad = chain[0].args[0]
        fits = buckets and size + _nbytes(grad) <= cap and _same_kind(buckets[-1][0][0].args[0], grad)
        if not fits:
            if buckets:
                cap = mode.bucket_cap_mb * 2**20
            buckets.append([])
            size = 0
        buckets[-1].append(chain)
        size += _nbytes(grad)
    ctx.extra["buckets"] = [[c[0].args[0].name for c in b] for b in buckets]
    ctx.extra["bucket_bytes"] = [sum(_nbytes(c[0].args[0]) for c in b) for b in buckets]
    for bucket in buckets:
        if len(bucket) == 1:
            continue
        grads = [c[0].args[0] for c in bucket]
        last = max(grads, key=lambda n: order[n])
        vals = [_val(g) for g in grads]
        flat_val = torch.empty(sum(v.numel() for v in vals), dtype=vals[0].dtype, device=vals[0].device)
        with graph.inserting_before(last.next):  # (inserting_after would reverse the sequence)
            flats = []
            for g, v in zip(grads, vals):
                flats.append(_call(graph, aten.reshape.default, (g, [-1]), v.reshape(-1)))
            cat = _call(graph, aten.cat.default, (flats,), flat_val)
            reduced = _call(graph, all_reduce_, (cat, bucket[0][1].args[1]), flat_val)
            done = _call(graph, wait_, (reduced,), flat_val)
            sizes = [v.numel() for v in vals]
            parts = _call(graph, aten.split_with_sizes.default, (done, sizes), list(flat_val.split(sizes)))
            for i, ((clone, ar, wait), v) in enumerate(zip(bucket, vals)):
                piece = _call(graph, operator.getitem, (parts, i), v.reshape(-1))
                shaped = _call(graph, aten.view.default, (piece, list(v.shape)), v)
                wait.replace_all_uses_with(shaped)
        for clone, ar, wait in bucket:
            graph.erase_node(wait)
            graph.erase_node(ar)
            graph.erase_node(clone)
    # A gradient read before its bucket is complete (e.g. returned by the step) now reads
    # the unpacked view, defined after the bucket's last gradient: restore topological order.
    stable_topological_sort(gm)
    return gm


def _same_kind(a: fx.Node, b: fx.Node) -> bool:
    va, vb = _val(a), _val(b)
    return va.dtype == vb.dtype and va.device == vb.device


DEDUP_TARGETS = (all_reduce_, broadcast_, all_gather)


def dedup_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Identical collectives on identical inputs run once (as the reference's ``_dedup_collectives``).

    ensures: no two collective nodes share (target, args); the duplicate's
    ``wait_`` users read the first one's result.  Under ``fully_shard`` a
    parameter used several times is gathered once; with
    ``reshard_after_forward`` once for forward and once for backward.
    """
    seen: dict = {}
    graph = gm.graph
    mode = ctx.parallel_mode
    per_phase = mode is not None and mode.sharded and mode.reshard_after_forward
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in DEDUP_TARGETS:
            continue
        key = (node.target, tuple(node.args), phase(node) if per_phase and node.target is all_gather else None)
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        for user in list(node.users):
            if user.target is wait_:
                first_waits = [u for u in first.users if u.target is wait_]
                if first_waits:
                    user.replace_all_uses_with(first_waits[0])
                    graph.erase_node(user)
                    continue
            user.replace_input_with(node, first)
        graph.erase_node(node)
    return gm


def schedule_overlap_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Issue each collective early; wait only just before the result is needed.

    requires: bucketed collectives.  ensures:

    * gradient all-reduces and reduce-scatters are issued as soon as their
      input exists, so between issue and ``wait_`` lies all the compute that
      does not need the result (the rest of backward);
    * parameter all-gathers (``fully_shard``) are issued ``prefetch`` buckets
      ahead: bucket k starts just before the wait of bucket k - prefetch of the
      same phase (forward or backward), so its transfer overlaps that
      bucket's compute while at most prefetch + 1 buckets are in flight;
    * every ``wait_`` moves down together with the split/slice/view nodes that
      unpack its bucket, each to just before its first user.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (all_reduce_, reduce_scatter):
            for producer in _producers(node.args[0]):
                _move_after_inputs(producer)
            _move_after_inputs(node)
    sinkable = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target is wait_:
            sinkable |= _unpack_chain(node)
    for node in reversed(list(graph.nodes)):  # users first, so each node sinks below its moved users
        if node in sinkable and node.users:
            order = {n: i for i, n in enumerate(graph.nodes)}
            first = min(node.users, key=lambda u: order[u])
            if order[first] != order[node] + 1:
                first.prepend(node)
    mode = ctx.parallel_mode
    if mode is not None and mode.sharded:
        _prefetch_gathers(graph, mode.prefetch)
    return gm


def _prefetch_gathers(graph: fx.Graph, prefetch: int) -> None:
    by_phase: dict[str, list] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is wait_ and node.args[0].target is all_gather:
            by_phase.setdefault(phase(node), []).append(node)
    for waits in by_phase.values():
        for k, wait in enumerate(waits):
            start = wait.args[0]
            anchor = waits[max(0, k - prefetch)]
            for producer in _producers(start.args[0]):
                anchor.prepend(producer)
            anchor.prepend(start)


UNPACK_OPS = (aten.split_with_sizes.default, aten.view.default, aten.reshape.default, aten.slice.Tensor,
              operator.getitem)
PACK_OPS = (aten.cat.default, aten.clone.default, aten.reshape.default, aten.view.default,
            aten.constant_pad_nd.default, aten._to_copy.default)


def _unpack_chain(wait: fx.Node) -> set[fx.Node]:
    """``wait`` and the split/getitem/slice/view nodes downstream of it that only unpack the bucket."""
    chain, todo = {wait}, [wait]
    while todo:
        for user in todo.pop().users:
            if user.op == "call_function" and user.target in UNPACK_OPS and user not in chain:
                chain.add(user)
                todo.append(user)
    return chain


def _producers(node: fx.Node) -> list[fx.Node]:
    """The nodes that only pack a collective's input (cat/reshape/pad/copy of single-use values), innermost first."""
    out: list[fx.Node] = []

    def visit(n: fx.Node) -> None:
        if n.op != "call_function" or n.target not in PACK_OPS or len(n.users) != 1 or n in out:
            return
        for arg in n.all_input_nodes:
            visit(arg)
        out.append(n)

    visit(node)
    return out


def _move_after_inputs(node: fx.Node) -> None:
    inputs = node.all_input_nodes
    if not inputs:
        return
    graph = node.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(inputs, key=lambda n: order[n])
    if order[last] + 1 != order[node]:
        last.append(node)
