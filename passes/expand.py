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
"""

from __future__ import annotations

from torch import fx

from spmd_ort.capture.dynamic import SizeEmitter
from spmd_ort.runtime.ops import all_gather, all_reduce_, reduce_scatter, wait_

from .contracts import COLLECTIVES_WAITED
from .helpers import ACTIVATION_COLLECTIVE, GRADIENT_OF, aten, call, val
from .runner import graph_pass

import torch

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

    * ``all_reduce(x, op, group)`` -> ``wait_(all_reduce_(clone(x), 1 or 1/size, group))`` (ours is in place);
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
            if op not in REDUCTIONS:
                continue
            scale = 1.0 if op == "sum" else 1.0 / _group_size(group)
            with graph.inserting_before(node):
                copy = call(graph, aten.clone.default, (x,), val(x))
                started = call(graph, all_reduce_, (copy, scale, group), out)
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
    if not (started.target is all_reduce_ and len(started.users) == 1 and GRADIENT_OF not in started.meta):
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
            for n in (summed, started, done):
                n.meta.update({k: v for k, v in left.meta.items() if k != "val"})  # phase, module path
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
