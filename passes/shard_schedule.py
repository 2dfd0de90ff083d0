"""Scheduling ``fully_shard``'s collectives: tail gathers kept for backward, buckets, prefetch (within a step and
across steps)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx
from torch.fx.passes.tools_common import stable_topological_sort

from spmd_ort.graph.ops import all_gather, reduce_scatter, wait_

from .context import PassResult
from .contracts import (COLLECTIVES_WAITED, NO_DUPLICATE_COLLECTIVES, OVERLAP_SCHEDULED, PARAMS_GATHERED_BEFORE_USE,
                        PER_GRADIENT_REDUCTIONS, Invariant)
from .helpers import (GRADIENT_OF, aten, call, calls, group_of, is_dtype_cast, phase, placeholders, producers,
                      set_phase, shard_calls,
                      tensor_bytes, unpack_chain, val)
from .runner import graph_pass


@dataclass(frozen=True)
class KeptForBackward(PassResult):
    """``keep_tail_gathers_pass``: parameters whose forward gather serves backward too."""

    params: tuple[str, ...]

    def lines(self) -> list[str]:
        return [f"kept gathered for backward: {', '.join(self.params) or 'none'}"]


@dataclass(frozen=True)
class ShardBuckets(PassResult):
    """``bucket_shard_collectives_pass``: unsharded bytes per all-gather and per reduce-scatter bucket."""

    all_gather: tuple[int, ...]
    reduce_scatter: tuple[int, ...]

    def lines(self) -> list[str]:
        return [f"{kind} buckets: {len(sizes)} ({', '.join(f'{x / 2**20:.2f} MiB' for x in sizes)})"
                for kind, sizes in (("all_gather", self.all_gather), ("reduce_scatter", self.reduce_scatter))]


def _one_shard_collective_per_bucket(gm, ctx):
    buckets = ctx.results.get(ShardBuckets)
    if buckets is None:
        return "no shard buckets recorded"
    gathers, scatters = len(shard_calls(gm, ctx, all_gather)), len(shard_calls(gm, ctx, reduce_scatter))
    if (gathers, scatters) != (len(buckets.all_gather), len(buckets.reduce_scatter)):
        return (f"{gathers} all-gathers / {scatters} reduce-scatters for {len(buckets.all_gather)} / "
                f"{len(buckets.reduce_scatter)} buckets")
    return None


ONE_SHARD_COLLECTIVE_PER_BUCKET = Invariant(
    "one_shard_collective_per_bucket", "all-gathers and reduce-scatters == recorded shard buckets",
    _one_shard_collective_per_bucket)


def _uses(gather: fx.Node) -> list[fx.Node]:
    """The nodes that read a gathered parameter, past the wait/slice/view nodes that unpack it.

    A dtype cast (autocast's, a MixedPrecisionPolicy's) counts where its result is used: the cast of
    a tied weight made for the embedding is still in use at the LM head.
    """
    chain = set().union(*(unpack_chain(wait) for wait in gather.users))
    uses = [u for n in chain for u in n.users if u not in chain]
    return [v for u in uses for v in (list(u.users) if is_dtype_cast(u) and u.users else [u])]


@graph_pass(requires=[NO_DUPLICATE_COLLECTIVES, PARAMS_GATHERED_BEFORE_USE])
def keep_tail_gathers_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """With resharding, parameters still gathered when forward ends are not gathered again for backward.

    A parameter whose last forward use comes after the last forward gather has
    been waited for (the final block, the LM head, a tied embedding) holds its
    gathered copy until the end of forward anyway; backward starts with exactly
    these parameters, so freeing and re-gathering them would only add a
    blocking all-gather at the turn (FSDP2 keeps its root module unsharded for
    the same reason).  It needs one gather per parameter and phase (dedup);
    after it, such parameters' backward uses read the forward gather.
    """
    graph = gm.graph
    gathers: dict[tuple, fx.Node] = {(n.args, phase(n)): n for n in shard_calls(gm, ctx, all_gather)}
    forward_waits = [w for (args, ph), g in gathers.items() if ph == "forward" for w in g.users]
    if not forward_waits:
        return gm
    last_wait = max(forward_waits)
    kept = []
    for (args, ph), forward in gathers.items():
        backward = gathers.get((args, "backward"))
        if ph != "forward" or backward is None:
            continue
        forward_uses = [u for u in _uses(forward) if phase(u) == "forward"]
        if not forward_uses or max(forward_uses) < last_wait:
            continue
        (fwd_wait,), (bwd_wait,) = list(forward.users), list(backward.users)
        bwd_wait.replace_all_uses_with(fwd_wait)
        graph.erase_node(bwd_wait)
        graph.erase_node(backward)
        kept.append(args[0].name)
    ctx.results.record(KeptForBackward(params=tuple(kept)))
    return gm


def _buckets(pairs: list, cap: float) -> list[list]:
    buckets: list[list] = []
    size = 0
    for start, wait in pairs:
        v = val(wait) if start.target is all_gather else val(start.args[0])
        head = buckets[-1][0][1] if buckets else None
        same = head is not None and val(head).dtype == val(wait).dtype and val(head).device == val(wait).device
        if not buckets or not same or size + tensor_bytes(v) > cap:
            buckets.append([])
            size = 0
        buckets[-1].append((start, wait))
        size += tensor_bytes(v)
    return buckets


def _merge_gathers(graph: fx.Graph, bucket: list, world: int, group: str) -> None:
    if len(bucket) == 1:
        return
    shards = [start.args[0] for start, _ in bucket]
    sizes = [val(s).numel() for s in shards]
    total = sum(sizes)
    v = val(shards[0])
    ph = phase(bucket[0][0])
    with graph.inserting_before(bucket[0][0]):
        cat = call(graph, aten.cat.default, (shards,), v.new_empty(total))
        start = call(graph, all_gather, (cat, world, -1, group), v.new_empty(total * world))
        done = call(graph, wait_, (start,), v.new_empty(total * world))
        table = call(graph, aten.view.default, (done, [world, total]), v.new_empty(world, total))
        new = [cat, start, done, table]
        offset = 0
        for (old_start, old_wait), size in zip(bucket, sizes):
            cols = call(graph, aten.slice.Tensor, (table, 1, offset, offset + size), v.new_empty(world, size))
            flat = call(graph, aten.reshape.default, (cols, [-1]), v.new_empty(world * size))
            old_wait.replace_all_uses_with(flat)
            new += [cols, flat]
            offset += size
    for n in new:
        set_phase(n, ph)
    for old_start, old_wait in bucket:
        graph.erase_node(old_wait)
        graph.erase_node(old_start)


def _merge_scatters(graph: fx.Graph, bucket: list, world: int, group: str) -> None:
    if len(bucket) == 1:
        return
    inputs = [start.args[0] for start, _ in bucket]
    last = max(inputs)
    sizes = [val(w).numel() for _, w in bucket]
    total = sum(sizes)
    v = val(inputs[0])
    with graph.inserting_before(last.next):
        tables = [call(graph, aten.view.default, (x, [world, s]), v.new_empty(world, s))
                  for x, s in zip(inputs, sizes)]
        cat = call(graph, aten.cat.default, (tables, 1), v.new_empty(world, total))
        flat = call(graph, aten.view.default, (cat, [-1]), v.new_empty(world * total))
        start = call(graph, reduce_scatter, (flat, world, group), v.new_empty(total))
        start.meta[GRADIENT_OF] = tuple(old_start.meta.get(GRADIENT_OF) for old_start, _ in bucket)
        done = call(graph, wait_, (start,), v.new_empty(total))
        parts = call(graph, aten.split_with_sizes.default, (done, sizes), list(v.new_empty(total).split(sizes)))
        new = tables + [cat, flat, start, done, parts]
        for i, ((old_start, old_wait), size) in enumerate(zip(bucket, sizes)):
            piece = call(graph, operator.getitem, (parts, i), v.new_empty(size))
            old_wait.replace_all_uses_with(piece)
            new.append(piece)
    for n in new:
        set_phase(n, "backward")
    for old_start, old_wait in bucket:
        graph.erase_node(old_wait)
        graph.erase_node(old_start)


@graph_pass(requires=[PER_GRADIENT_REDUCTIONS, PARAMS_GATHERED_BEFORE_USE, NO_DUPLICATE_COLLECTIVES,
                      COLLECTIVES_WAITED],
            provides=[ONE_SHARD_COLLECTIVE_PER_BUCKET, COLLECTIVES_WAITED], invalidates=[PER_GRADIENT_REDUCTIONS])
def bucket_shard_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """All-gathers of one phase, in order of use, and reduce-scatters, in order of production, share buckets.

    A gather bucket is ``cat(shards) -> all_gather -> wait_ -> view(N, total)``
    and per parameter ``slice`` of its columns ``-> reshape`` (rank-major back
    to the parameter's flat layout).  A reduce-scatter bucket is each padded
    gradient ``view(N, shard)``, ``cat`` along columns ``-> reduce_scatter ->
    wait_ -> split``.  Buckets hold one dtype and device, at most
    ``bucket_cap_mb`` of unsharded bytes.
    """
    cap = ctx.mode.cap_bytes
    graph = gm.graph
    world = ctx.world_size
    gathers: dict[str, list] = {}
    scatters = []
    for node in shard_calls(gm, ctx, all_gather, reduce_scatter):
        waits = [u for u in node.users if u.target is wait_]
        if len(waits) == 1 and len(node.users) == 1:
            if node.target is all_gather:
                gathers.setdefault(phase(node), []).append((node, waits[0]))
            else:
                scatters.append((node, waits[0]))
    gather_bytes, scatter_bytes = [], []
    for pairs in gathers.values():
        for bucket in _buckets(pairs, cap):
            gather_bytes.append(sum(tensor_bytes(val(w)) for _, w in bucket))
            _merge_gathers(graph, bucket, world, ctx.group)
    scatters.sort(key=lambda pair: pair[0].args[0])
    for bucket in _buckets(scatters, cap):
        scatter_bytes.append(sum(tensor_bytes(val(start.args[0])) for start, _ in bucket))
        _merge_scatters(graph, bucket, world, ctx.group)
    ctx.results.record(ShardBuckets(all_gather=tuple(gather_bytes), reduce_scatter=tuple(scatter_bytes)))
    stable_topological_sort(gm)
    return gm


@graph_pass(requires=[ONE_SHARD_COLLECTIVE_PER_BUCKET, OVERLAP_SCHEDULED, COLLECTIVES_WAITED],
            provides=[COLLECTIVES_WAITED])
def prefetch_gathers_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Parameter all-gathers are issued ``prefetch`` buckets ahead.

    Bucket k starts just before the wait of bucket k - prefetch of the same
    phase (forward or backward), so its transfer overlaps that bucket's compute
    while at most prefetch + 1 buckets are in flight (on bucketed gathers whose
    waits are already sunk to their first use).
    """
    by_phase: dict[str, list] = {}
    for node in calls(gm, wait_):
        if node.args[0].target is all_gather and group_of(node.args[0]) == ctx.group:
            by_phase.setdefault(phase(node), []).append(node)
    for waits in by_phase.values():
        for k, wait in enumerate(waits):
            start = wait.args[0]
            anchor = waits[max(0, k - ctx.mode.prefetch)]
            for producer in producers(start.args[0]):
                anchor.prepend(producer)
            anchor.prepend(start)
    return gm


# gradient reduce-scatters in flight at once: gloo's holds a copy of its input bucket until it is waited for, so
# waiting for all of them at the optimizer held a copy of every gradient through the backward
REDUCE_SCATTERS_IN_FLIGHT = 2


@graph_pass(requires=[ONE_SHARD_COLLECTIVE_PER_BUCKET, OVERLAP_SCHEDULED, COLLECTIVES_WAITED],
            provides=[COLLECTIVES_WAITED])
def bound_reduce_scatters_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """At most ``REDUCE_SCATTERS_IN_FLIGHT`` gradient reduce-scatters are in flight: the wait of bucket k moves up
    to just before bucket k + ``REDUCE_SCATTERS_IN_FLIGHT`` starts.

    ``schedule_overlap_pass`` sinks each wait to its first user, the optimizer, so every bucket's reduce-scatter
    was in flight until the end of the backward, and the process group keeps what it reduces (gloo: a copy of
    the input bucket) until the wait: measured on a 97 M-parameter GPT on 2 ranks, the step's resident memory
    rose by about the whole gradient's bytes through the backward and fell at the optimizer's waits.  A wait
    moved up blocks only on a reduction issued two buckets earlier (a bucket's worth of backward compute ago),
    so the overlap stays; the values are the same.
    """
    starts = [n for n in calls(gm, reduce_scatter) if group_of(n) == ctx.group]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k in range(REDUCE_SCATTERS_IN_FLIGHT, len(starts)):
        start = starts[k]
        for wait in [u for u in starts[k - REDUCE_SCATTERS_IN_FLIGHT].users if u.target is wait_]:
            if order[wait] > order[start]:  # each wait moves once: ``order`` needs no update
                start.prepend(wait)
    return gm


@dataclass(frozen=True)
class CarriedGather(PassResult):
    """``carry_first_gather_pass``: the first forward all-gather, issued by the previous step after its optimizer.

    ``recipe`` computes the gather's input from the state placeholders at ``inputs`` (positions among the
    graph's inputs); ``CompiledProgram.carry_gathers`` runs it after each step and starts the gather.
    """

    slot: int
    inputs: tuple[int, ...]
    recipe: fx.GraphModule
    world: int
    nbytes: int
    group: str = ""

    def lines(self) -> list[str]:
        return [f"cross-step prefetch: the first forward all-gather ({self.nbytes / 2**20:.2f} MiB) is issued at the "
                "end of the previous step (not after last_train_step=True)"]


def _recipe(gm: fx.GraphModule, x: fx.Node) -> tuple[tuple[int, ...], fx.GraphModule] | None:
    """The nodes computing ``x`` from placeholders alone (packing ops), as a graph of their own; None otherwise."""
    order = {n: i for i, n in enumerate(placeholders(gm))}
    chain = producers(x) if x.op != "placeholder" else []
    leaves = sorted({a for n in chain for a in n.all_input_nodes if a not in chain} | ({x} if not chain else set()),
                    key=lambda n: n.name)
    if any(a not in order for a in leaves):
        return None
    graph = fx.Graph()
    env = {a: graph.placeholder(a.name) for a in sorted(leaves, key=order.get)}
    for node in chain:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[x])
    return tuple(order[a] for a in sorted(leaves, key=order.get)), fx.GraphModule(gm, graph)


@graph_pass(requires=[ONE_SHARD_COLLECTIVE_PER_BUCKET, COLLECTIVES_WAITED], provides=[COLLECTIVES_WAITED])
def carry_first_gather_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The first forward all-gather of a step is issued by the step before, after its optimizer wrote the shards.

    Every step otherwise starts by waiting for its first bucket of parameters; a whole-step graph knows which
    bucket that is and how its input is computed from the state (``CarriedGather.recipe``), so the previous
    call starts it once its shards are final, and it arrives while the host is between steps.  The gather is
    marked ``carried``: at run time it takes the carried result when every rank's input is still what it
    gathered (a checkpoint load, an edit under ``no_grad`` or another program in between: it gathers anew, on
    every rank alike), else it gathers as before.  With ``prefetch=0`` nothing is carried.
    """
    if ctx.mode.prefetch == 0:
        return gm
    first = next((n for n in shard_calls(gm, ctx, all_gather) if phase(n) == "forward"), None)
    found = _recipe(gm, first.args[0]) if first is not None else None
    if found is None:
        return gm
    inputs, recipe = found
    first.args = (*first.args[:2], 0, ctx.group)
    ctx.results.record(CarriedGather(slot=0, inputs=inputs, recipe=recipe, world=ctx.world_size, group=ctx.group,
                                     nbytes=tensor_bytes(val(first))))
    return gm
