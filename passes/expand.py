"""Expand mode (DTensor state): the collectives DTensor's redistributions traced become the step's own.

Tracing a step whose parameters are DTensors (:mod:`spmd_ort.distributed.dtensor`) runs torch's sharding
propagation, which adds ``_c10d_functional`` collectives (an op that starts, ``wait_tensor`` that completes)
wherever a placement must change: the all-reduce after a row-wise linear, the all-gather that undoes a
sequence shard.  :func:`adopt_dtensor_collectives_pass` rewrites each into the compiled step's collective ops
on the same process group, so that the later passes (dedup, overlap) and the accounting
(``train_step.comm``, ``describe()``) treat them as every other collective.  Reductions other than sum and
mean, and collectives without a counterpart here (all-to-all), stay as traced: they run as host nodes.
"""

from __future__ import annotations

from torch import fx

from spmd_ort.capture.dynamic import SizeEmitter
from spmd_ort.runtime.ops import all_gather, all_reduce_, reduce_scatter, wait_

from .contracts import COLLECTIVES_WAITED
from .helpers import aten, call, val
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
        for user in list(node.users):
            if user.target is WAIT:
                user.replace_all_uses_with(done)
                graph.erase_node(user)
        node.replace_all_uses_with(done)
        graph.erase_node(node)
    gm.recompile()
    return gm
