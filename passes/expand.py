"""Expand mode (DTensor state): the collectives DTensor's redistributions traced become the step's own.

Tracing a step whose parameters are DTensors (:mod:`spmd_ort.distributed.dtensor`) runs torch's sharding
propagation, which adds ``_c10d_functional`` collectives (an op that starts, ``wait_tensor`` that completes)
wherever a placement must change: the all-reduce after a row-wise linear, the all-gather that undoes a
sequence shard.  :func:`adopt_dtensor_collectives_pass` rewrites each into the compiled step's collective ops
on the same process group, so that the later passes (dedup, overlap) and the accounting
(``train_step.comm``, ``describe()``) treat them as every other collective.  Reductions other than sum and
mean, and collectives without a counterpart here (all-to-all), stay as traced: they run as host nodes.

:func:`merge_summed_all_reduces_pass` then uses that a sum of all-reduces is the all-reduce of the sum: the input
gradients of separate column-wise q, k and v projections (each a partial sum DTensor all-reduces on its own)
are added before one all-reduce.

:func:`split_replicated_matmuls_pass` shares out what the plan leaves replicated: a matmul every rank of the
tensor-parallel group computes alike (an LM head outside the plan: its weight gradient and input gradient) is
computed a share of its rows per rank and all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from spmd_ort.graph.symbolic import SizeEmitter
from spmd_ort.errors import CompileError
from spmd_ort.graph.ops import REDUCE_OPS, all_gather, all_reduce_, reduce_op, reduce_scatter, wait_
from spmd_ort.options import get_logger

from .context import PassResult
from .contracts import COLLECTIVES_WAITED
from .helpers import ACTIVATION_COLLECTIVE, GRADIENT_OF, aten, call, group_of, val
from .runner import graph_pass

import torch

logger = get_logger(__name__)

try:
    import torch.distributed  # registers the _c10d_functional ops

    FUNCOL = torch.ops._c10d_functional
    ALL_REDUCE, ALL_GATHER = FUNCOL.all_reduce.default, FUNCOL.all_gather_into_tensor.default
    REDUCE_SCATTER, WAIT = FUNCOL.reduce_scatter_tensor.default, FUNCOL.wait_tensor.default
except (AttributeError, RuntimeError):  # a torch without distributed support: nothing to adopt
    ALL_REDUCE = ALL_GATHER = REDUCE_SCATTER = WAIT = None

REDUCTIONS = ("sum", "avg")


def _group_size(name: str) -> int:
    from spmd_ort.runtime.collectives import process_group

    return process_group(name).size()


@graph_pass(provides=[COLLECTIVES_WAITED])
def adopt_dtensor_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Each ``_c10d_functional`` all-reduce, all-gather and reduce-scatter (sum or mean) becomes the step's own.

    * ``all_reduce(x, op, group)`` -> ``wait_(all_reduce_(clone(x), 1 or 1/size, group))`` (ours is in place;
      max and min keep their op);
    * ``all_gather_into_tensor(x, size, group)`` -> ``wait_(all_gather(x, size, -1, group))`` viewed as the
      concatenation along dim 0 (ours gathers flat, rank-major: the same elements in the same order);
    * ``reduce_scatter_tensor(x, op, size, group)`` -> ``wait_(reduce_scatter(x, size, group, op == "avg"))``
      viewed as the dim-0 shard.

    The functional op's ``wait_tensor`` users read the new ``wait_``.
    """
    graph = gm.graph
    sizes = SizeEmitter.of(gm)  # a symbolic size (a shard of a dynamic length): read from the inputs' sizes
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER):
            continue
        out = val(node)
        if node.target is ALL_REDUCE:
            x, op, group = node.args
            if op not in REDUCTIONS and op not in REDUCE_OPS:
                continue  # (left to the check below)
            scale = 1.0 / _group_size(group) if op == "avg" else 1.0
            with graph.inserting_before(node):
                copy = call(graph, aten.clone.default, (x,), val(x))
                started = call(graph, all_reduce_, (copy, scale, group) + (() if op in REDUCTIONS else (op,)), out)
                done = call(graph, wait_, (started,), out)
        elif node.target is ALL_GATHER:
            x, size, group = node.args
            flat = out.reshape(-1)
            with graph.inserting_before(node):
                started = call(graph, all_gather, (x, size, -1, group), flat)
                waited = call(graph, wait_, (started,), flat)
                done = call(graph, aten.view.default, (waited, [sizes.size(d) for d in out.shape]), out)
        else:
            x, op, size, group = node.args
            if op not in REDUCTIONS:
                continue
            flat = out.reshape(-1)
            with graph.inserting_before(node):
                started = call(graph, reduce_scatter, (x, size, group, op == "avg"), flat)
                waited = call(graph, wait_, (started,), flat)
                done = call(graph, aten.view.default, (waited, [sizes.size(d) for d in out.shape]), out)
        for n in {started, done, *started.all_input_nodes, *done.all_input_nodes} - {x}:
            n.meta.update({k: v for k, v in node.meta.items() if k != "val"})  # phase, module path
        started.meta[ACTIVATION_COLLECTIVE] = True  # the step computes on with its result (schedule_overlap_pass)
        for user in list(node.users):
            if user.target is WAIT:
                user.replace_all_uses_with(done)
                graph.erase_node(user)
        node.replace_all_uses_with(done)
        graph.erase_node(node)
    left = [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) ==
            "_c10d_functional" and n.target is not WAIT]
    if left:  # it would run on the mesh's own group, which the user's collectives share: refused, never raced
        n = left[0]
        raise CompileError(
            f"the step's DTensor redistribution `{n.target}` ({', '.join(map(str, n.args[1:]))}, node "
            f"`{n.name}`) has no collective of spmd_ort's own to run as: supported are all-reduce (sum, avg, max, "
            "min), all-gather and reduce-scatter (sum, avg). Fix: a plan whose redistributions are these (the "
            "model is unchanged)",
            op=str(n.target))
    gm.recompile()
    return gm


MERGED_DTYPES = (torch.float32, torch.float64)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, symbolic sizes included, decided without adding a guard to the program."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _lone_all_reduce(node) -> fx.Node | None:
    """The ``all_reduce_`` whose ``wait_`` ``node`` is, when both are used only along this chain (the all-reduce
    by its wait, the wait by one node), it reduces a value of its own (a clone, or the sum of a merge), and it is
    not a gradient's."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is wait_
            and len(node.users) == 1):
        return None
    started = node.args[0]
    if not (started.target is all_reduce_ and reduce_op(started) == "sum" and len(started.users) == 1
            and GRADIENT_OF not in started.meta):
        return None
    own = started.args[0]
    if not (own.op == "call_function" and own.target in (aten.clone.default, aten.add.Tensor)
            and len(own.users) == 1):
        return None
    return started


def _reduced(started: fx.Node) -> fx.Node:
    """What an all-reduce reduces: the clone's source, or the sum an earlier merge made."""
    own = started.args[0]
    return own.args[0] if own.target is aten.clone.default else own


@graph_pass(requires=[COLLECTIVES_WAITED], provides=[COLLECTIVES_WAITED])
def merge_summed_all_reduces_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``all_reduce(a) + all_reduce(b)`` -> ``all_reduce(a + b)``: one collective where DTensor issued two.

    DTensor completes a partial sum where the value leaves a DTensor op: the input gradients of column-wise
    q, k and v projections that read one activation are each all-reduced, then autograd adds them.  A sum (or mean)
    all-reduce is linear, so the sum of the reductions is the reduction of the sum; the merged one carries the
    bytes of one and is one synchronization of the ranks instead of several.  Merged when both reductions are
    the same (op, group), of the same shape and dtype, used only by the add, and not gradient reductions.  The
    order of the additions differs from eager's (each rank's terms first, then across ranks): rounding differs
    in the last bits, so only float32 and float64 sums merge (in bfloat16 or float16, under a
    ``MixedPrecisionPolicy``, the other order moves results by their unit in the last place, ~0.4% in bf16,
    away from eager's).
    """
    graph = gm.graph
    changed = True
    while changed:  # a sum of three reductions merges pairwise: ((a + b) + c)
        changed = False
        for node in list(graph.nodes):
            if not (node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2
                    and not node.kwargs):
                continue
            left, right = (_lone_all_reduce(a) for a in node.args)
            if left is None or right is None or left is right or left.args[1:] != right.args[1:]:
                continue
            a, b = _reduced(left), _reduced(right)
            out = val(node)
            if not (_same_shape(val(a), out) and _same_shape(val(b), out)
                    and val(a).dtype == val(b).dtype == out.dtype and out.dtype in MERGED_DTYPES):
                continue
            waits = [node.args[0], node.args[1]]
            with graph.inserting_before(node):
                summed = call(graph, aten.add.Tensor, (a, b), out)
                started = call(graph, all_reduce_, (summed, *left.args[1:]), out)
                done = call(graph, wait_, (started,), out)
            for n in (summed, started, done):  # phase, module path; only the collective is one
                n.meta.update({k: v for k, v in left.meta.items() if k not in ("val", ACTIVATION_COLLECTIVE)})
            started.meta[ACTIVATION_COLLECTIVE] = True
            node.replace_all_uses_with(done)
            graph.erase_node(node)
            for wait in waits:
                ar = wait.args[0]
                own = ar.args[0]
                graph.erase_node(wait)
                graph.erase_node(ar)
                if own.target is aten.clone.default:
                    graph.erase_node(own)
            changed = True
    gm.recompile()
    return gm


# A matmul every rank of the tensor-parallel group computes alike is split over the group when each rank skips at
# least this many multiply-adds per element of the result it gathers, K * (1 - 1/size): the all-gather of an M x N
# result then costs less than the skipped M x N x K work (on CPU gloo a gathered float costs about as much as ~100
# multiply-adds; this leaves the margin to the forward's logits, over the model width, which stay whole).
SPLIT_MIN_K = 256


def _tensor_parallel_group(gm: fx.GraphModule) -> str | None:
    """The one process group the step's tensor-parallel activation collectives run on (None: none, or several)."""
    groups = {group_of(n) for n in gm.graph.nodes if n.op == "call_function"
              and n.target in (all_reduce_, all_gather, reduce_scatter) and n.meta.get(ACTIVATION_COLLECTIVE)}
    return groups.pop() if len(groups) == 1 else None


def _rank_and_size(group: str) -> tuple[int, int]:
    """This rank's position in ``group`` and the group's size."""
    from spmd_ort.runtime.collectives import process_group

    pg = process_group(group)
    return torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg)


def _signature(node: fx.Node) -> int:
    """A hash of what ``node`` computes from its inputs (op, constants, which nodes it reads), equal across
    processes (Python's own string hash is salted per process)."""
    import hashlib

    target = node.target
    if not isinstance(target, (str, torch._ops.OpOverload)):  # a function's repr holds its address
        target = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
    value = node.meta.get("val")
    length = str(value) if isinstance(value, (int, torch.SymInt)) else ""  # its expression (a local shard's)
    text = repr((node.op, str(target), fx.map_arg(node.args, lambda a: a.name),
                 fx.map_arg(node.kwargs, lambda a: a.name), length))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def node_signatures(gm: fx.GraphModule) -> dict[str, int]:
    """Each node's :func:`_signature`, by name: what a rank's traced graph computes, for the ranks to compare
    (``Compiler.compile`` exchanges them after the trace, with
    :func:`spmd_ort.distributed.checksums.state_checksums`, into ``PassContext.rank_signatures``)."""
    return {n.name: _signature(n) for n in gm.graph.nodes}


def _group_ranks(group: str) -> list[int]:
    """The global ranks of ``group``, in group order."""
    from spmd_ort.runtime.collectives import process_group

    pg = process_group(group)
    return list(range(torch.distributed.get_world_size())) if pg is None else \
        torch.distributed.get_process_group_ranks(pg)


def _same_on_group(gm: fx.GraphModule, ctx, group: str) -> set[fx.Node]:
    """The nodes that compute the same function of their inputs on every rank of ``group``.

    A rank's graph holds its own constants where DTensor traced a redistribution (the shard a rank keeps of a
    replicated value: a slice at its own offset, a vocabulary range), so a value computed from alike inputs is not
    alike by that alone.  Every rank's traced graph is compared node by node (``ctx.rank_signatures``, exchanged
    after the trace, before any pass); a node a pass made since (the same on every rank: the passes are) counts as
    the same; a constant tensor (``get_attr``) is not compared, so not the same."""
    if not ctx.rank_signatures:
        return set()
    signatures = [ctx.rank_signatures[r]["nodes"] for r in _group_ranks(group)]
    mine = signatures[0]
    return {n for n in gm.graph.nodes if n.op != "get_attr" and (
        all(n.name not in s for s in signatures)
        or n.name in mine and all(s.get(n.name) == mine[n.name] for s in signatures))}


def _pure(node: fx.Node) -> bool:
    """An aten or prims op, or Python's arithmetic on sizes (``operator.mul`` of symbolic lengths, ``getitem``)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in ("aten", "prims")
    return getattr(target, "__module__", None) in ("_operator", "operator") or target in (
        torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float, torch.sym_int)


def _warn_differs(name: str, warned: set) -> None:
    """Once per step (``warned``: the step's WARNINGs given so far, kept across its variants)."""
    if ("differs", name) not in warned:
        warned.add(("differs", name))
        logger.warning(
            "`%s` is outside the tensor-parallel plan but differs between the ranks of its group: each rank trains "
            "its own copy (as eager tensor parallelism does), so its matmuls are not shared out over the ranks. "
            "Fix: build the model from the same seed on every rank (torch's tensor parallelism assumes it)", name)


def _alike_on_group(gm: fx.GraphModule, ctx, group: str) -> set[fx.Node]:
    """The values every rank of ``group`` computes alike: from plain (or replicated DTensor) parameters and
    buffers, the batch (one batch per tensor-parallel group) and hyper-parameters, the results of all-reduces and
    all-gathers over ``group``, and deterministic ops of those alone that compute the same function on every rank
    (:func:`_same_on_group`)."""
    from torch.distributed.tensor import Replicate

    from spmd_ort.graph.slots import SlotKind
    from spmd_ort.graph.ops import draws_random

    specs = ctx.layout.in_specs if ctx.layout is not None else []
    same = _same_on_group(gm, ctx, group)
    if not same:
        return set()
    states = [ctx.rank_signatures[r]["state"] for r in _group_ranks(group)]
    alike: set[fx.Node] = set()
    i = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            slot = ctx.input_slots[i]
            spec = specs[i] if i < len(specs) else None
            held = {s[i] if i < len(s) else None for s in states}
            i += 1
            if slot.kind not in (SlotKind.PARAM, SlotKind.BUFFER, SlotKind.BATCH, SlotKind.HPARAM) or (
                    spec is not None and not all(isinstance(p, Replicate) for p in spec[0].placements)):
                continue
            if slot.kind in (SlotKind.PARAM, SlotKind.BUFFER) and len(held) > 1:
                _warn_differs(slot.name, ctx.warned)
                continue
            alike.add(node)
        elif node.op == "call_function":
            if node.target is wait_:
                started = node.args[0]
                if started.target in (all_reduce_, all_gather) and group_of(started) == group:
                    alike.add(node)
            elif not (_pure(node) and not draws_random(node) and node in same):  # (arange: no inputs, alike)
                continue
            elif all(a in alike for a in node.all_input_nodes) or isinstance(
                    node.meta.get("val"), (int, torch.SymInt)):
                # a length: every symbol is one of the batch's (alike), every other length is a constant of the
                # graph, which every rank's holds alike (a local shard's length included)
                alike.add(node)
    return alike


@dataclass(frozen=True)
class SplitMatmuls(PassResult):
    """``split_replicated_matmuls_pass``: the replicated matmuls split over the tensor-parallel group, and the
    multiply-adds each rank skips per step."""

    count: int
    group_size: int
    skipped_flops: int

    def lines(self) -> list[str]:
        return [f"tensor parallel: {self.count} replicated matmul(s) split over the {self.group_size} ranks of the "
                f"group (each rank skips {self.skipped_flops / 1e9:.2f} GFLOP a step; one all-gather each)"]


@graph_pass(requires=[COLLECTIVES_WAITED], provides=[COLLECTIVES_WAITED])
def split_replicated_matmuls_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """A matmul every tensor-parallel rank computes alike is computed once, a share of its rows on each rank.

    Tensor parallelism leaves parts of the model replicated (an LM head and embedding outside the plan, tied or
    not): every rank of the group computes the same logits, their gradient and the head's weight gradient, which
    on gpt-mini is half of each rank's step.  ``mm(A, B)`` whose operands are alike on every rank of the group
    (:func:`_alike_on_group`) becomes ``all_gather(mm(A[share], B))``: each rank computes its share of the result's
    rows (the head's weight gradient: its share of the vocabulary; the gradient of the head's input: its share of
    the tokens) and the gather, rank-major, is the product.  Each element is the same dot product as before, so the
    numbers do not change (in any dtype).  Split where the rows divide by the group's size and are known (not
    symbolic), and each rank skips at least :data:`SPLIT_MIN_K` multiply-adds per element it gathers (the forward's
    logits, over the model width, stay whole).  Torch's tensor parallelism assumes the batch is the same on every
    rank of the group; a parameter outside the plan counts as alike only where the ranks' checksums of it agree
    (:func:`spmd_ort.distributed.checksums.state_checksums`; one that differs is each rank's own, as eagerly,
    with a warning).
    """
    group = _tensor_parallel_group(gm)
    if group is None:
        return gm
    rank, size = _rank_and_size(group)
    alike = _alike_on_group(gm, ctx, group)
    graph = gm.graph
    sizes = SizeEmitter.of(gm)
    split = skipped = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is aten.mm.default and node in alike):
            continue
        a, b = node.args
        out = val(node)
        m, k = val(a).shape
        k = k if isinstance(k, int) else getattr(k.node, "hint", None)  # a symbolic length: this trace's
        if not (isinstance(m, int) and m % size == 0 and isinstance(k, int) and out.dtype.is_floating_point
                and k * (size - 1) >= SPLIT_MIN_K * size):
            continue
        try:
            shape = [sizes.size(d) for d in out.shape]
        except ValueError:
            continue
        rows = m // size
        flat = out.reshape(-1)
        with graph.inserting_before(node):
            a_share = call(graph, aten.slice.Tensor, (a, 0, rank * rows, (rank + 1) * rows),
                           val(a)[rank * rows:(rank + 1) * rows])
            partial = call(graph, aten.mm.default, (a_share, b), out.new_empty((rows, out.shape[1])))
            started = call(graph, all_gather, (partial, size, -1, group), flat)
            waited = call(graph, wait_, (started,), flat)
            done = call(graph, aten.view.default, (waited, shape), out)
        for n in (a_share, partial, started, waited, done):
            n.meta.update({k: v for k, v in node.meta.items() if k != "val"})  # phase, module path
        started.meta[ACTIVATION_COLLECTIVE] = True
        node.replace_all_uses_with(done)
        graph.erase_node(node)
        split += 1
        n = out.shape[1]
        skipped += 2 * (m - rows) * n * k if isinstance(n, int) else 0
    if split:
        gm.recompile()
        ctx.results.record(SplitMatmuls(split, size, skipped))
    return gm
