"""Data-parallel expansion: gradient tags -> bucketed, overlapped, de-duplicated all-reduces.

Pipeline order (:mod:`.pipeline`): expand -> broadcast buffers -> bucket -> reduce gradient presence -> dedup
-> overlap.
``broadcast_buffers_pass``, ``dedup_collectives_pass`` and ``schedule_overlap_pass``
serve ``fully_shard`` too.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.tools_common import stable_topological_sort

from spmd_ort.distributed.experts import is_expert_param
from spmd_ort.graph.slots import SlotKind
from spmd_ort.graph.ops import all_gather, all_reduce_, broadcast_, grads_present, reduce_scatter, wait_

from .context import PassResult
from .contracts import (BUFFERS_BROADCAST, COLLECTIVES_WAITED, GRADS_SUMMED_BEFORE_REDUCTION, GRADS_TAGGED,
                        NO_DUPLICATE_COLLECTIVES, NO_GRAD_TAGS,
                        OVERLAP_SCHEDULED, PER_GRADIENT_REDUCTIONS, Invariant)
from .helpers import (ACTIVATION_COLLECTIVE, DEDUP_KEY, GRADIENT_OF, TAG, aten, call, calls, is_random,
                      move_after_inputs, nbytes, producers, set_phase, unpack_chain, val)
from .runner import graph_pass
from spmd_ort.options import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class GradientBuckets(PassResult):
    """``bucket_collectives_pass``: gradient node names and payload bytes per all-reduce bucket (and of each
    gradient, in the order backward produces them: what ``bucket_cap_mb="auto"`` re-plans from)."""

    names: tuple[tuple[str, ...], ...]
    nbytes: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...] = ()

    def lines(self) -> list[str]:
        return [f"gradient buckets: {len(self.nbytes)} ({', '.join(f'{b / 2**20:.2f} MiB' for b in self.nbytes)})"]


def _one_all_reduce_per_bucket(gm, ctx):
    buckets = ctx.results.get(GradientBuckets)
    if buckets is None:
        return "no gradient buckets recorded"
    n = sum(1 for node in gm.graph.nodes
            if node.op == "call_function" and node.target is all_reduce_ and GRADIENT_OF in node.meta)
    return None if n == len(buckets.nbytes) else f"{n} gradient all-reduces for {len(buckets.nbytes)} buckets"


ONE_ALL_REDUCE_PER_BUCKET = Invariant("one_all_reduce_per_bucket", "gradient all-reduces == recorded buckets",
                                      _one_all_reduce_per_bucket)


@dataclass(frozen=True)
class SummedMicroBatches(PassResult):
    """``sum_micro_batch_gradients_pass``: parameters whose micro-batch gradients are summed before one reduction,
    the most backward passes that reached one of them, and how many of them the step reads between micro-batches."""

    params: int
    micro_batches: int
    read_between: int

    def lines(self) -> list[str]:
        extra = f"; {self.read_between} read between micro-batches, reduced there too" if self.read_between else ""
        return [f"gradient accumulation: {self.params} parameters summed over {self.micro_batches} micro-batches, "
                f"then reduced once{extra}"]


def _accumulation(tags: list[fx.Node]) -> list[list[tuple[fx.Node, fx.Node]]]:
    """One parameter's tags, in graph order, grouped into runs that autograd accumulates into one ``.grad``:
    each run a list of (tag, the value of ``.grad`` after it).  The value after tag j+1 is
    ``add(value after tag j, tag j+1)``; a run starts with the tag itself, or ``add(g, tag)`` where ``g`` is a
    gradient the step started with."""
    runs: list[list[tuple[fx.Node, fx.Node]]] = []
    for tag in tags:
        adds = [u for u in tag.users if u.target is aten.add.Tensor and len(u.args) == 2 and u.args[1] is tag]
        after = adds[0] if len(adds) == 1 else tag
        if runs and after is not tag and after.args[0] is runs[-1][-1][1]:
            runs[-1].append((tag, after))
        else:
            runs.append([(tag, after)])
    return runs


def _sum_then_tag(graph: fx.Graph, index: int, run: list[tuple[fx.Node, fx.Node]]) -> int:
    """Rewrite one run: sum the raw gradients, tag the sum where ``.grad`` is read; returns the reads between
    micro-batches.  A gradient the step started with stays outside the sum (``add(g, tag(sum))``), as it is
    outside the reduction with one micro-batch."""
    tags, values = [t for t, _ in run], [v for _, v in run]
    readers = [[u for u in v.users if j + 1 == len(values) or u is not values[j + 1]] for j, v in enumerate(values)]
    base = values[0].args[0] if values[0] is not tags[0] else None
    sums = list(values)
    if base is not None:  # the running sum starts at the first micro-batch's gradient
        values[1].replace_input_with(values[0], tags[0])
        sums[0] = tags[0]
    between = 0
    for j, (total, read) in enumerate(zip(sums, readers)):
        if not read:
            continue
        between += j + 1 < len(values)
        with graph.inserting_after(total):
            out = tagged = set_phase(call(graph, TAG, (total, index), val(total)), "backward")
        if base is not None:
            with graph.inserting_after(tagged):
                out = set_phase(call(graph, aten.add.Tensor, (base, tagged), val(values[j])), "backward")
        for reader in read:
            reader.replace_input_with(values[j], out)
    if base is not None:
        graph.erase_node(values[0])
    for tag in tags:
        tag.replace_all_uses_with(tag.args[0])
        graph.erase_node(tag)
    return between


@graph_pass(requires=[GRADS_TAGGED], provides=[GRADS_TAGGED, GRADS_SUMMED_BEFORE_REDUCTION])
def sum_micro_batch_gradients_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """With several backward passes before one optimizer step (gradient accumulation), reduce the sum once.

    Tracing tags each backward's new gradient, so a step with k micro-batches would reduce each parameter's
    gradient k times (k times the bytes).  Reduction is linear: here the tags of each run that autograd
    accumulates into one ``.grad`` are removed, the raw gradients are summed as autograd sums them, and only
    the accumulated ``.grad`` is tagged where the step reads it: once after the last micro-batch (then the
    optimizer, clipping, the write-back read the reduced sum, as DDP's ``no_sync`` on all but the last
    micro-batch gives), and also between micro-batches only where the step reads ``.grad`` there.
    """
    graph = gm.graph
    by_param: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is TAG:
            by_param.setdefault(node.args[1], []).append(node)
    params, most, between = 0, 1, 0
    for index, tags in by_param.items():
        for run in _accumulation(tags):
            if len(run) < 2:
                continue
            params += 1
            most = max(most, len(run))
            between += _sum_then_tag(graph, index, run)
    if params:
        ctx.results.record(SummedMicroBatches(params=params, micro_batches=most, read_between=between))
    return gm


@graph_pass(requires=[GRADS_TAGGED], provides=[NO_GRAD_TAGS, COLLECTIVES_WAITED, PER_GRADIENT_REDUCTIONS],
            invalidates=[GRADS_TAGGED])
def expand_data_parallel_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Each ``tag_grad(g)`` becomes ``wait_(all_reduce_(clone(g, contiguous), 1/world))``.

    The all-reduce runs on a private copy, so the in-place collective never
    touches a tensor something else reads.
    """
    graph = gm.graph
    prescale = 1.0 / ctx.world_size
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is TAG:
            grad, index = node.args
            with graph.inserting_before(node):
                # contiguous: a collective reads the tensor's memory in order (NCCL refuses another layout), and
                # a gradient computed as a view of a segment's output may be transposed (t(x) of ORT's output)
                copy = graph.call_function(aten.clone.default, (grad,), {"memory_format": torch.contiguous_format})
                copy.meta["val"] = val(node)
                reduced = call(graph, all_reduce_, (copy, prescale, ctx.group), val(node))
                done = call(graph, wait_, (reduced,), val(node))
            reduced.meta[GRADIENT_OF] = index
            node.replace_all_uses_with(done)
            graph.erase_node(node)
    return gm


@graph_pass(provides=[BUFFERS_BROADCAST])
def broadcast_buffers_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """With ``broadcast_buffers`` (DDP's default), every used buffer placeholder is broadcast from rank 0 first.

    Each such buffer is then read only through its ``broadcast_``, placed right after the placeholders.
    """
    if ctx.mode is None or not ctx.mode.broadcast_buffers:
        return gm
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op == "placeholder"]
    last = nodes[-1]
    for node, slot in zip(nodes, ctx.input_slots):
        if slot.kind is not SlotKind.BUFFER or not node.users:
            continue
        with graph.inserting_after(last):
            synced = call(graph, broadcast_, (node, 0), val(node))
        node.replace_all_uses_with(synced, delete_user_cb=lambda u: u is not synced)
        last = synced
    return gm


def _chains(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(clone, all_reduce_, wait_) chains of single gradients, in graph order (not other all-reduces: a tensor-
    parallel layer's, adopted from DTensor, reduces an activation)."""
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is all_reduce_ and GRADIENT_OF in node.meta:
            src = node.args[0]
            waits = [u for u in node.users if u.target is wait_]
            if src.target is aten.clone.default and len(src.users) == 1 and len(waits) == 1 \
                    and len(node.users) == 1:
                out.append((src, node, waits[0]))
    return out


def _same_kind(a: fx.Node, b: fx.Node) -> bool:
    va, vb = val(a), val(b)
    return va.dtype == vb.dtype and va.device == vb.device


def _plan_buckets(chains: list, first_cap: float, cap: float) -> list[list]:
    """Chains in order of their gradient, grouped greedily up to the byte caps (one dtype/device per bucket)."""
    buckets: list[list] = []
    size, limit = 0, min(first_cap, cap)
    for chain in sorted(chains, key=lambda c: c[0].args[0]):  # by when the gradient exists
        grad = chain[0].args[0]
        fits = buckets and size + nbytes(grad) <= limit and _same_kind(buckets[-1][0][0].args[0], grad)
        if not fits:
            if buckets:
                limit = cap
            buckets.append([])
            size = 0
        buckets[-1].append(chain)
        size += nbytes(grad)
    return buckets


def _merge_bucket(graph: fx.Graph, bucket: list) -> None:
    """``cat`` of the flattened gradients -> ``all_reduce_`` -> ``wait_`` -> ``split`` -> ``view`` per gradient."""
    grads = [c[0].args[0] for c in bucket]
    last = max(grads)
    vals = [val(g) for g in grads]
    flat_val = torch.empty(sum(v.numel() for v in vals), dtype=vals[0].dtype, device=vals[0].device)
    with graph.inserting_before(last.next):  # (inserting_after would reverse the sequence)
        flats = [call(graph, aten.reshape.default, (g, [-1]), v.reshape(-1)) for g, v in zip(grads, vals)]
        cat = call(graph, aten.cat.default, (flats,), flat_val)
        reduced = call(graph, all_reduce_, (cat, *bucket[0][1].args[1:]), flat_val)  # its prescale and group
        reduced.meta[GRADIENT_OF] = tuple(c[1].meta.get(GRADIENT_OF) for c in bucket)
        done = call(graph, wait_, (reduced,), flat_val)
        sizes = [v.numel() for v in vals]
        parts = call(graph, aten.split_with_sizes.default, (done, sizes), list(flat_val.split(sizes)))
        for i, ((clone, ar, wait), v) in enumerate(zip(bucket, vals)):
            piece = call(graph, operator.getitem, (parts, i), v.reshape(-1))
            shaped = call(graph, aten.view.default, (piece, list(v.shape)), v)
            wait.replace_all_uses_with(shaped)
    for clone, ar, wait in bucket:
        graph.erase_node(wait)
        graph.erase_node(ar)
        graph.erase_node(clone)


@graph_pass(requires=[PER_GRADIENT_REDUCTIONS, COLLECTIVES_WAITED],
            provides=[ONE_ALL_REDUCE_PER_BUCKET, COLLECTIVES_WAITED], invalidates=[PER_GRADIENT_REDUCTIONS])
def bucket_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Gradients, in the order backward produces them, share one all-reduce per bucket.

    Buckets hold gradients of one dtype and device up to ``bucket_cap_mb``
    (the first up to ``first_bucket_cap_mb``, so communication starts early).
    """
    mode = ctx.mode
    graph = gm.graph
    buckets = _plan_buckets(_chains(graph), mode.first_bucket_cap_mb * 2**20, mode.cap_bytes)
    ctx.results.record(GradientBuckets(
        names=tuple(tuple(c[0].args[0].name for c in b) for b in buckets),
        nbytes=tuple(sum(nbytes(c[0].args[0]) for c in b) for b in buckets),
        sizes=tuple(tuple(nbytes(c[0].args[0]) for c in b) for b in buckets)))
    for bucket in buckets:
        if len(bucket) > 1:
            _merge_bucket(graph, bucket)
    # A gradient read before its bucket is complete (e.g. returned by the step) now reads
    # the unpacked view, defined after the bucket's last gradient: restore topological order.
    stable_topological_sort(gm)
    return gm


def _presence_reduced(gm, ctx):
    for node in calls(gm, grads_present):
        if [u.target for u in node.users] != [all_reduce_]:
            return f"`{node.name}` (which parameters have a gradient) is read before its sum over ranks"
    return None


PRESENCE_REDUCED = Invariant("presence_reduced", "a step's gradient-presence vector is read only summed over ranks",
                             _presence_reduced)



@graph_pass(requires=[COLLECTIVES_WAITED], provides=[PRESENCE_REDUCED, COLLECTIVES_WAITED])
def reduce_grad_presence_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Which parameters have a gradient this step (``grads_present``, :mod:`spmd_ort.capture.presence`), summed
    over the ranks: one small all-reduce.

    A parameter only opaque parts use gets a gradient on the ranks whose part used it; with the sum,
    every rank updates it (with the averaged gradient, this rank's zeros included) when any rank's part
    used it, and skips it when none did: ``DDP(find_unused_parameters=True)``.  Under fully_shard,
    FSDP2 differs (a WARNING names the parameters).  After bucketing, so the gradient buckets stay
    gradients only.
    """
    graph = gm.graph
    for node in calls(gm, grads_present):
        users = list(node.users)
        with graph.inserting_after(node):
            reduced = call(graph, all_reduce_, (node, 1.0), val(node))
        with graph.inserting_after(reduced):
            done = call(graph, wait_, (reduced,), val(node))
        for user in users:
            user.replace_input_with(node, done)
    names = tuple(ctx.layout.param_names[i][0] for i in ctx.layout.present_params) if ctx.layout is not None else ()
    # experts computed by expert get a gradient on every rank, every step (the exchange brings every rank's tokens)
    names = tuple(n for n in names if not is_expert_param(n, ctx.mode))
    if names and ctx.mode.sharded and ("opaque_only_grads", names) not in ctx.warned:
        ctx.warned.add(("opaque_only_grads", names))  # once per step, not once per variant
        logger.warning(
            "fully_shard: %s get gradients only from opaque parts, which may not use them on every step. A "
            "step where no rank's part uses one leaves it, its .grad and optimizer state as they were (as eager "
            "and FSDP2 do); a step where some ranks' parts use it updates it on every rank with the gradient "
            "averaged over all ranks, zeros included, as DDP(find_unused_parameters=True) does. FSDP2 fails "
            "there (ranks reduce-scatter different gradients) unless set_reduce_scatter_unused_params(True), "
            "which then also updates a parameter no rank used, with a zero gradient", ", ".join(names))
    return gm


DEDUP_TARGETS = (all_reduce_, broadcast_, all_gather)


@graph_pass(requires=[COLLECTIVES_WAITED], provides=[NO_DUPLICATE_COLLECTIVES])
def dedup_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Identical collectives on identical inputs run once (as the reference's ``_dedup_collectives``).

    Two collectives are identical when target, arguments and ``meta["dedup_key"]``
    agree (``gather_parameters_pass`` keys gathers by phase when resharding, so a
    parameter is gathered once for forward and once for backward).  The
    duplicate's ``wait_`` users read the first one's result.
    """
    seen: dict = {}
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in DEDUP_TARGETS:
            continue
        key = (node.target, tuple(node.args), node.meta.get(DEDUP_KEY))
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


def _movable(node: fx.Node) -> bool:
    """A pure compute node, free to change places with others of its kind: an aten op that draws no random
    numbers, or an item of one's outputs (collectives, waits, host ops and random ops keep their order)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _movable(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten" and not is_random(node)


def _issue_before_independent_compute(collective: fx.Node) -> None:
    """Move the compute between the last non-movable node before ``collective`` and it that its input does not
    depend on to just after it, in order (its users are after it, or move with it: a user of a node that
    does not lead to the collective does not lead to it either)."""
    region: list[fx.Node] = []
    node = collective.prev
    while _movable(node):
        region.append(node)
        node = node.prev
    if not region:
        return
    inside = set(region)
    leads, todo = set(), [a for a in collective.all_input_nodes if a in inside]
    while todo:
        n = todo.pop()
        if n not in leads:
            leads.add(n)
            todo += [a for a in n.all_input_nodes if a in inside]
    anchor = collective
    for n in reversed(region):  # graph order
        if n not in leads:
            anchor.append(n)
            anchor = n


@graph_pass(requires=[COLLECTIVES_WAITED], provides=[COLLECTIVES_WAITED, OVERLAP_SCHEDULED])
def schedule_overlap_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Issue each reduction early; wait only just before the result is needed.

    * gradient all-reduces and reduce-scatters are issued as soon as their
      input exists, so between issue and ``wait_`` lies all the compute that
      does not need the result (the rest of backward);
    * a collective the step computes on (expand mode: a tensor-parallel all-reduce of an activation or of its
      gradient) is issued before the compute that does not lead to it: between the host node before it and
      the collective, what its input does not depend on (a layer's weight gradients, computed after its input
      gradient's all-reduce starts) moves below the collective, into its flight;
    * every ``wait_`` moves down together with the split/slice/view nodes that
      unpack its bucket, each to just before its first user.

    (``fully_shard``'s all-gathers are scheduled by ``prefetch_gathers_pass``.)
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (all_reduce_, reduce_scatter):
            for producer in producers(node.args[0]):
                move_after_inputs(producer)
            move_after_inputs(node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.meta.get(ACTIVATION_COLLECTIVE):
            _issue_before_independent_compute(node)
    sinkable = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target is wait_:
            sinkable |= unpack_chain(node)
    for node in reversed(list(graph.nodes)):  # users first, so each node sinks below its moved users
        if node in sinkable and node.users:
            first = min(node.users)
            if node.next is not first:
                first.prepend(node)
    return gm
