"""Expert parallelism: the experts' host nodes read this rank's block of experts, and their gradients stay there.

Runs after the fully_shard passes have gathered every parameter for its uses and reduce-scattered every
gradient (:mod:`.fully_shard`).  For each experts module that runs by expert (an opaque call whose
``expert_params`` are set: :mod:`spmd_ort.distributed.experts`), with ``efsdp = world / ep``:

* its parameters: ``all_gather`` over the world (all E experts) becomes the rank's block of E/ep experts: its
  own shard viewed as ``(E/ep, ...)`` when ``efsdp`` is 1, else an all-gather over its efsdp group;
* their gradients: the block's gradient already sums what every token of the ep group sent it (the exchange's
  backward).  ``reduce_scatter`` over the world becomes ``g / world`` (``efsdp`` 1), or a reduce-scatter of
  ``g / ep`` averaged over the efsdp group: either way the rank's shard of the average over every rank, as
  fully_shard's (DDP's arithmetic).

The shards, optimizer, clipping (their 2-norms complete over the world as every shard's do) and checkpoints are
fully_shard's, unchanged.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.errors import CompileError
from spmd_ort.graph.flops import EXPERT_COST
from spmd_ort.graph.liveness import HELD_BYTES
from spmd_ort.graph.ops import all_gather, opaque_backward, opaque_forward, reduce_scatter, wait_

from .context import PassResult
from .helpers import (EXPERT_BLOCK, GRADIENT_OF, SHARD_OF, SHARDED_PARAM, aten, call, fake_mode_of, refake, set_phase,
                      val)
from .runner import graph_pass


@dataclass(frozen=True)
class ExpertParallelLayout(PassResult):
    """``localize_experts_pass``: the experts modules computed by expert, and how their blocks are held."""

    modules: tuple[str, ...]
    ep: int
    efsdp: int
    params: int
    gathered_bytes: int  # per step, what the rank's experts' all-gathers bring (0 with efsdp 1)
    saved_bytes: int  # what fully_shard's all-gathers of every expert would have brought

    @property
    def rank_specific(self) -> bool:
        """With efsdp > 1 each rank's graph names its own efsdp group: ranks agree on the collectives and their
        group sizes (:meth:`spmd_ort.program.CompiledProgram.signature`)."""
        return self.efsdp > 1

    recompute: bool = False  # the experts' backward runs their forward again (activation checkpointing)

    def lines(self) -> list[str]:
        held = "its own shard" if self.efsdp == 1 else \
            f"gathered over {self.efsdp} ranks, {self.gathered_bytes / 2**20:.2f} MiB per step"
        return [f"expert parallel: {len(self.modules)} experts modules over ep={self.ep} ranks, each computing "
                f"1/{self.ep} of the experts ({held}); {self.params} expert parameters not gathered whole "
                f"({self.saved_bytes / 2**20:.2f} MiB of all-gathers fewer per use)"
                + ("; their backward runs their forward again (activation checkpointing)" if self.recompute else "")]


def _gather_chain(node: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(the all_gather, the sharded parameter placeholder, the nodes from the gather to ``node``: wait_, slice, the
    full view, then casts) that ``node`` (a gathered parameter's view) reads."""
    seen, chain = node, []
    while seen.op == "call_function" and seen.target is not all_gather:
        if not seen.args or not isinstance(seen.args[0], fx.Node):
            return None
        chain.append(seen)
        seen = seen.args[0]
    if seen.op != "call_function":
        return None
    shard = seen.args[0]
    return (seen, shard, chain[::-1]) if shard.op == "placeholder" and SHARDED_PARAM in shard.meta else None


def _dead(graph: fx.Graph, nodes) -> None:
    for n in nodes:
        if not n.users:
            graph.erase_node(n)


@graph_pass()
def localize_experts_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The experts' host nodes read the rank's block of E/ep experts; the block's gradient is averaged into the
    rank's shard without a reduction over the world (see the module docstring)."""
    from spmd_ort.distributed.experts import ExpertParallel

    mode = ctx.mode
    if not isinstance(mode, ExpertParallel):
        return gm
    graph = gm.graph
    fake_mode = fake_mode_of(gm)
    world, ep = ctx.world_size, mode.ep
    efsdp = world // ep
    calls = {c.index: c for c in ctx.opaque}
    modules, params, gathered, saved = [], 0, 0, 0
    readers: dict[int, list] = {}  # param index -> (call, input position) of every host node that reads it
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not opaque_forward:
            continue
        c = calls.get(node.args[1])
        if c is None or not c.expert_params:
            continue
        if c.fqn not in modules:
            modules.append(c.fqn)
        # activation checkpointing (a budget below 1): the experts' backward runs their forward again, as a
        # checkpointed block's does, instead of keeping what their autograd saved
        c.recompute = ctx.activation_memory_budget != 1.0
        inputs = list(node.args[0])
        for pos in c.expert_params:
            found = _gather_chain(inputs[pos])
            if found is None:
                raise CompileError(f"expert parallel: input {pos} of the experts `{c.fqn}` is not a gathered "
                                   "parameter shard", fqn=c.fqn, rank=ctx.rank)
            ag, shard, chain = found
            index = shard.meta[SHARDED_PARAM]
            spec = ctx.shard_specs[index]
            block = (spec.shape[0] // ep, *spec.shape[1:])
            efsdp_group = mode.group_names(spec.shape[0])[1]
            saved += val(ag).numel() * val(ag).element_size()
            with graph.inserting_before(node):
                source = shard
                if efsdp > 1:  # the block's shards (and, with fewer experts than ranks, padding after them)
                    with fake_mode:
                        v = torch.empty(spec.shard_numel * efsdp, dtype=val(shard).dtype, device=val(shard).device)
                    g = call(graph, all_gather, (shard, efsdp, -1, efsdp_group), v)
                    source = call(graph, wait_, (g,), v)
                    gathered += v.numel() * v.element_size()
                    n = math.prod(block)
                    if n < v.numel():
                        source = call(graph, aten.slice.Tensor, (source, 0, 0, n), v[:n])
                with fake_mode:
                    bv = val(source).reshape(block)
                local = call(graph, aten.view.default, (source, list(block)), bv)
                local.meta[EXPERT_BLOCK] = index
            # the chain from the gathered full tensor to the host node (a mixed-precision cast) now reads the
            # block: rebuild it on ``local``
            full_at = next(i for i, n in enumerate(chain) if n.target is aten.view.default)
            rebuilt = local
            for n in chain[full_at + 1:]:
                with graph.inserting_before(node):
                    rebuilt = graph.call_function(n.target, (rebuilt, *n.args[1:]), dict(n.kwargs))
                    refake(rebuilt, fake_mode)
            node.replace_input_with(inputs[pos], rebuilt)
            _dead(graph, [*reversed(chain), ag])
            if index not in readers:
                params += 1
            readers.setdefault(index, []).append((c, pos))
        _price(gm, node, c, ep)
    for index, calls_of in readers.items():  # (once per parameter: micro-batches call the experts again)
        _local_gradients(gm, ctx, index, calls_of, efsdp, fake_mode)
    if modules:
        ctx.results.record(ExpertParallelLayout(modules=tuple(modules), ep=ep, efsdp=efsdp, params=params,
                                                gathered_bytes=gathered, saved_bytes=saved,
                                                recompute=ctx.activation_memory_budget != 1.0))
    return gm


def _price(gm: fx.GraphModule, forward: fx.Node, c, ep: int) -> None:
    """What the plan prices for the experts' host nodes (``meta["expert_parallel"]``), from the routing's expected
    even split: each rank computes as many (token, expert) rows as it routes (``tokens x top_k``), each row one
    expert's matmuls (2 FLOPs per expert parameter, twice that in backward), and each exchange sends the
    ``(ep - 1) / ep`` of the rows that go to other ranks: tokens out and results back in forward, their
    gradients in backward (what ``train_step.comm.all_to_all_bytes`` counts)."""
    hidden, index = c.inputs[0], c.inputs[1]
    # the router's (tokens, k) choices, or (torchtitan's call) rows already sorted by expert and their counts
    rows = index.shape[0] * index.shape[1] if len(index.shape) == 2 else hidden.shape[0]
    experts = c.inputs[c.expert_params[0]].shape[0]
    per_expert = sum(math.prod(c.inputs[i].shape) for i in c.expert_params) // experts
    flops = 2 * rows * per_expert
    moved = 2 * rows * (ep - 1) // ep * hidden.shape[1] * hidden.dtype.itemsize
    forward.meta[EXPERT_COST] = {"flops": flops, "all_to_all_bytes": moved, "all_to_all_calls": 3, "ep": ep,
                                 "rows": rows}
    # what the experts' autograd keeps from forward to backward, outside the graph (held by the host node's
    # token): per row its input and output (2 x hidden) and its intermediates, about 4/3 of the experts'
    # parameters per hidden unit (a gated MLP's 2F + F parameters per hidden unit: gate and up, their product)
    # (recomputed: the inputs only, and the backward runs the forward, its FLOPs and exchanges, again)
    width = hidden.shape[1]
    inner = sum(math.prod(c.inputs[i].shape) for i in c.expert_params) // (experts * width)
    inputs = sum(math.prod(m.shape) * m.dtype.itemsize for m in c.inputs[:c.expert_params[0]])
    held = inputs if c.recompute else rows * (2 * width + 4 * inner // 3) * hidden.dtype.itemsize
    token = len(c.outputs)
    for user in forward.users:
        if user.target is operator.getitem and user.args[1] == token:
            user.meta[HELD_BYTES] = held
    again = 1 if c.recompute else 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is opaque_backward and n.args[2] == c.index:
            n.meta[EXPERT_COST] = {"flops": (2 + again) * flops, "all_to_all_bytes": moved * (2 + again) // 2,
                                   "all_to_all_calls": 2 + 3 * again, "ep": ep, "rows": rows}


def _local_gradients(gm, ctx, index: int, calls_of: list, efsdp: int, fake_mode) -> None:
    """The gradient of parameter ``index``'s blocks, from every host node that reads it (``calls_of``: (call,
    input position); several with micro-batches): from their backwards (now the block's shape) to the rank's
    shard, averaged over the world."""
    graph = gm.graph
    world, ep = ctx.world_size, ctx.mode.ep
    spec = ctx.shard_specs[index]
    block = (spec.shape[0] // ep, *spec.shape[1:])
    grads = []
    for c, pos in calls_of:
        out = sum(1 for g in c.needs_grad[:pos] if g)  # its position among the backward's gradients
        grads += [u for b in graph.nodes if b.op == "call_function" and b.target is opaque_backward
                  and b.args[2] == c.index for u in b.users if u.target is operator.getitem and u.args[1] == out]
    for g in grads:
        with fake_mode:
            g.meta["val"] = torch.empty(block, dtype=val(g).dtype, device=val(g).device)
    reductions = [n for n in graph.nodes if n.op == "call_function" and n.target is reduce_scatter
                  and n.meta.get(GRADIENT_OF) == index]
    fqn = calls_of[0][0].fqn
    if len(reductions) != 1 or not grads:
        raise CompileError(f"expert parallel: the gradient of an expert parameter of `{fqn}` is reduced "
                           f"{len(reductions)} times, from {len(grads)} backward passes of the experts; expected one "
                           "reduction of their sum", fqn=fqn, rank=ctx.rank)
    rs = reductions[0]
    # what computes the reduced value from the block's gradient(s) (sums of micro-batches, a reshape, a cast)
    between = _between(grads, rs)
    for n in between:
        refake(n, fake_mode)
    flat, padded = rs.args[0], None
    if flat.target is aten.constant_pad_nd.default:  # fully_shard's padding to the world's shards: not this one
        flat, padded = flat.args[0], flat
    (done,) = list(rs.users)
    with graph.inserting_before(rs):
        if efsdp == 1:
            out = call(graph, aten.div.Tensor, (flat, world), None)
        else:
            # the block's rows, then zeros for the group's padding shards (fewer experts than ranks)
            extra = spec.shard_numel * efsdp - math.prod(block)
            if extra:
                flat = call(graph, aten.constant_pad_nd.default, (flat, [0, extra]), None)
                refake(flat, fake_mode)
                set_phase(flat, "backward")
            scaled = call(graph, aten.div.Tensor, (flat, ep), None)
            refake(scaled, fake_mode)
            new_rs = call(graph, reduce_scatter, (scaled, efsdp, ctx.mode.group_names(spec.shape[0])[1]), None)
            refake(new_rs, fake_mode)
            new_rs.meta[GRADIENT_OF] = index
            out = call(graph, wait_, (new_rs,), None)
            set_phase(scaled, "backward")
            set_phase(new_rs, "backward")
        refake(out, fake_mode)
        set_phase(out, "backward")
    out.meta[SHARD_OF] = index
    done.replace_all_uses_with(out)
    graph.erase_node(done)
    graph.erase_node(rs)
    if padded is not None and not padded.users:
        graph.erase_node(padded)


def _between(sources: list[fx.Node], sink: fx.Node) -> list[fx.Node]:
    """The nodes on paths from ``sources`` to ``sink`` (exclusive of both), in graph order."""
    reach = set(sources)
    order = []
    for n in sources[0].graph.nodes:
        if n is sink:
            break
        if n not in reach and any(a in reach for a in n.all_input_nodes):
            reach.add(n)
            order.append(n)
    ancestors = set()
    stack = [sink]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in ancestors:
                ancestors.add(a)
                stack.append(a)
    return [n for n in order if n in ancestors]
