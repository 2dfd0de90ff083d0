"""ZeRO stage 3 as graph passes: the full-shape step rewritten over parameter, gradient and state shards.

The step is traced on full shapes (:mod:`spmd_ort.capture.trace` stands fake full
tensors in for the shards); these passes, in pipeline order, rewrite it over
shards (layout: :mod:`spmd_ort.distributed.sharding`):

1. :func:`shard_placeholders_pass`: parameter, gradient and (non-scalar)
   optimizer-state placeholders hold shards;
2. :func:`reduce_scatter_gradients_pass`: each gradient tag becomes
   ``reshape -> pad -> reduce_scatter -> wait_``, the averaged gradient shard;
3. :func:`rematerialize_param_views_pass` (``reshard_after_forward``): backward
   reads of forward views of a parameter (e.g. the transposed weight autograd
   saved) read the same views of a backward copy, so the forward gather dies
   after its last forward use;
4. :func:`propagate_shards_pass`: what reads gradient or state shards must be
   valid on shards (elementwise ops, the optimizer ops, 2-norms); anything else
   is a :class:`CompileError` naming the op and parameter;
5. :func:`gather_parameters_pass`: every use of a parameter outside the
   optimizer reads ``all_gather -> wait_ -> slice -> view``;
6. :func:`complete_grad_norms_pass`: shard 2-norms (``clip_grad_norm_``) are
   completed by one all-reduce of their squares;
7. :func:`complete_found_inf_pass`: a GradScaler's inf check of gradient shards
   is combined across ranks (one all-reduce), so every rank skips together.

Analyses mark nodes (``meta["sharded_param"]``, ``meta["shard_of"]``,
``meta["partial_norm"]``, ``meta["partial_found_inf"]``) and later passes read the marks.  Buckets, prefetch
and offload follow (:mod:`.shard_schedule`, :mod:`.offload`).
"""

from __future__ import annotations

from dataclasses import dataclass

import operator

import torch
from torch import fx
from torch.fx.passes.tools_common import stable_topological_sort

from spmd_ort.graph.slots import SlotKind
from spmd_ort.errors import CompileError
from spmd_ort.graph.ops import OPTIMIZER_OPS, all_gather, all_reduce_, reduce_scatter, wait_
from spmd_ort.distributed.sharding import is_sharded_state

from .context import PassResult
from .contracts import (BACKWARD_VIEWS_REMATERIALIZED, COLLECTIVES_WAITED, FOUND_INF_COMPLETED, GRAD_NORMS_COMPLETED,
                        GRADS_TAGGED, NO_GRAD_TAGS, PARAMS_GATHERED_BEFORE_USE, PER_GRADIENT_REDUCTIONS,
                        SHARDED_PLACEHOLDERS, SHARDS_PROPAGATED)
from .helpers import (AMP_CHECK, DEDUP_KEY, GRADIENT_OF, PARTIAL_FOUND_INF, PARTIAL_NORM, SHARD_OF, SHARDED_PARAM, TAG,
                      aten, call, fake_mode_of, group_of, is_dtype_cast, is_view_op, phase, placeholders, refake,
                      set_phase, val)
from .runner import graph_pass

# ops whose output has the shape of their (first) input: as valid on a shard as on the whole
SHAPE_PRESERVING = frozenset({
    aten.detach.default, aten.clone.default, aten.alias.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.full_like.default, aten._to_copy.default, aten.copy.default,
    aten.zero.default,  # zero_grad(set_to_none=False) on the held gradient shards
})
NORM = aten.linalg_vector_norm.default
FOREACH_NORM = aten._foreach_norm.Scalar


def _param_names(ctx) -> dict[int, str]:
    return {s.index: s.name for s in ctx.input_slots if s.kind is SlotKind.PARAM}


def sharded_params(gm: fx.GraphModule) -> list[fx.Node]:
    """Parameter placeholders that hold shards, in placeholder order."""
    return [n for n in placeholders(gm) if n.meta.get(SHARDED_PARAM) is not None]


def _shard_of(node: fx.Node) -> int | None:
    return node.meta.get(SHARD_OF)


@dataclass(frozen=True)
class ShardedParams(PassResult):
    """``shard_placeholders_pass``: how many parameters are sharded, over how many ranks, with what padding."""

    count: int
    world: int
    numel: int  # elements of the sharded parameters, unpadded
    pad: int  # padding elements, all shards together

    def lines(self) -> list[str]:
        return [f"fully_shard: {self.count} parameters in {self.world} shards each "
                f"({self.numel / self.world / 1e6:.3f} M elements per rank, {self.pad} padding elements in all)"]


@graph_pass(provides=[SHARDED_PLACEHOLDERS])
def shard_placeholders_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Placeholders of sharded parameters, their gradients and non-scalar optimizer state hold the local shard.

    The shards are ``ctx.shard_specs`` (param index -> ShardSpec).  Marks parameter
    placeholders ``meta["sharded_param"]`` and gradient/state placeholders
    ``meta["shard_of"]`` (the parameter index); scalars (Adam's step) stay replicated.
    """
    specs = ctx.shard_specs
    fake_mode = fake_mode_of(gm)
    for node, slot in zip(placeholders(gm), ctx.input_slots):
        if not slot.kind.per_parameter or slot.index not in specs:
            continue
        v = val(node)
        if slot.kind is SlotKind.OPT_STATE and not is_sharded_state(v):
            continue
        with fake_mode:
            node.meta["val"] = torch.empty(specs[slot.index].shard_numel, dtype=v.dtype, device=v.device)
        node.meta[SHARDED_PARAM if slot.kind is SlotKind.PARAM else SHARD_OF] = slot.index
    sharded = [specs[s.index] for s in ctx.input_slots if s.kind is SlotKind.PARAM and s.index in specs]
    if sharded:
        ctx.results.record(ShardedParams(count=len(sharded), world=sharded[0].world,
                                         numel=sum(spec.numel for spec in sharded),
                                         pad=sum(spec.pad for spec in sharded)))
    return gm


@graph_pass(requires=[GRADS_TAGGED], provides=[NO_GRAD_TAGS, COLLECTIVES_WAITED, PER_GRADIENT_REDUCTIONS],
            invalidates=[GRADS_TAGGED])
def reduce_scatter_gradients_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Each ``tag_grad(g, i)`` becomes ``reshape -> pad -> reduce_scatter(average) -> wait_``: the gradient shard."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not TAG:
            continue
        grad, index = node.args
        spec = ctx.shard_specs[index]
        v = val(grad)
        with graph.inserting_before(node):
            flat = call(graph, aten.reshape.default, (grad, [-1]), v.reshape(-1))
            if spec.pad:
                flat = call(graph, aten.constant_pad_nd.default, (flat, [0, spec.pad]), v.new_empty(spec.padded_numel))
            shard = v.new_empty(spec.shard_numel)
            rs = call(graph, reduce_scatter, (flat, ctx.world_size, ctx.group), shard)
            done = call(graph, wait_, (rs,), shard)
        for n in (flat, rs, done):
            set_phase(n, "backward")
        done.meta[SHARD_OF] = index
        rs.meta[GRADIENT_OF] = index
        node.replace_all_uses_with(done)
        graph.erase_node(node)
    return gm


@graph_pass(requires=[SHARDED_PLACEHOLDERS], provides=[BACKWARD_VIEWS_REMATERIALIZED])
def rematerialize_param_views_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Backward reads of forward views (or casts) of a parameter read the same of a backward copy instead.

    With ``reshard_after_forward`` the forward gather must die after its last
    forward use; autograd's saved views of a weight (its transpose), or its
    low-precision cast (autocast, MixedPrecisionPolicy), would keep it alive
    through backward.  No backward node reads a forward view of a sharded
    parameter after it (``gather_parameters_pass`` then gathers it for backward).
    """
    graph = gm.graph
    params = set(sharded_params(gm))

    def chain_of(node: fx.Node):
        chain = []
        while node not in params:
            if node.op != "call_function" or not (is_view_op(node.target) or is_dtype_cast(node)) or not node.args \
                    or not isinstance(node.args[0], fx.Node):
                return None
            chain.append(node)
            node = node.args[0]
        return node, chain[::-1]

    memo: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or phase(node) != "backward":
            continue
        for arg in node.all_input_nodes:
            if arg in params or phase(arg) == "backward":
                continue
            if arg not in memo:
                found = chain_of(arg)
                if found is None:
                    continue
                current, chain = found
                with graph.inserting_before(node):
                    for view in chain:
                        current = graph.call_function(view.target, (current, *view.args[1:]), dict(view.kwargs))
                        current.meta["val"] = view.meta.get("val")
                        set_phase(current, "backward")
                memo[arg] = current
            node.replace_input_with(arg, memo[arg])
    return gm


def _ord(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)


def _is_partial_norm(node: fx.Node) -> bool:
    if node.target is not NORM:
        return False
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    keepdim = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
    return _ord(node) == 2 and dim is None and not keepdim


def _shard_safe(node: fx.Node) -> bool:
    """Whether ``node`` computes the same thing on shards as on whole tensors (elementwise)."""
    target = node.target
    if target in OPTIMIZER_OPS or target is operator.getitem or target in SHAPE_PRESERVING:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    elementwise = torch.Tag.pointwise in target.tags or target.__name__.startswith("_foreach_")
    if not elementwise:
        return False
    # the other operands must broadcast over a shard: scalars, or shards / params (read as shards)
    for arg in node.all_input_nodes:
        if _shard_of(arg) is not None or arg.meta.get(SHARDED_PARAM) is not None:
            continue
        v = arg.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        if not all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in vals):
            return False
    return True


def _other_group_sum(node: fx.Node, ctx) -> bool:
    """2-D: a tensor-parallel group's sum (DTensor reducing a norm's ``Partial`` gradient over tp) of a gradient
    shard, or its wait: elementwise across ranks, so as valid on the dp shard as on the whole."""
    if node.target is wait_:
        return node.args[0].target is all_reduce_ and _other_group_sum(node.args[0], ctx)
    return node.target is all_reduce_ and group_of(node) != ctx.group


@graph_pass(requires=[SHARDED_PLACEHOLDERS, NO_GRAD_TAGS], provides=[SHARDS_PROPAGATED])
def propagate_shards_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Mark every value computed from shards, check that it is valid on shards, and recompute its shape.

    Elementwise ops and the optimizer ops are (``meta["shard_of"]``); 2-norms
    become partial norms (``meta["partial_norm"]``, completed by
    ``complete_grad_norms_pass``).  Anything else that reads a gradient or state
    shard as a whole tensor, a step that returns one, or a step that writes a
    whole sharded tensor is a :class:`CompileError` naming the op, the parameter
    FQN, the rank and the fix.  A GradScaler's inf check
    (``_amp_foreach_non_finite_check_and_unscale``) unscales shards and finds
    infs in this rank's shards only: its flag is marked ``meta["partial_found_inf"]``
    (completed by ``complete_found_inf_pass``).
    """
    names = _param_names(ctx)
    norms = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _shard_of(node) is not None or node.meta.get(PARTIAL_FOUND_INF):
            continue
        sources = [_shard_of(a) for a in node.all_input_nodes if _shard_of(a) is not None]
        if not sources:
            continue
        if node.target is AMP_CHECK:
            node.meta[SHARD_OF] = sources[0]  # output 0: the unscaled shards
            for user in node.users:
                if user.target is operator.getitem and user.args[1] == 1:
                    user.meta[PARTIAL_FOUND_INF] = True
        elif _is_partial_norm(node):
            node.meta[PARTIAL_NORM] = norms
            norms += 1
        elif node.target is FOREACH_NORM and _ord(node) == 2:
            for user in node.users:
                if user.target is operator.getitem:
                    user.meta[PARTIAL_NORM] = norms
                    norms += 1
        elif _shard_safe(node) or _other_group_sum(node, ctx):
            node.meta[SHARD_OF] = sources[0]
        else:
            fqn = names[sources[0]]
            raise CompileError(
                f"fully_shard: `{node.target}` reads the gradient or optimizer state of `{fqn}` as a whole "
                "tensor, but each rank holds only a 1/N shard of it.  Under fully_shard only elementwise "
                "ops, 2-norms (clip_grad_norm_) and the optimizer step may read gradients; move this "
                "computation into the model's forward, or use DataParallel(parallel_style='replicate')",
                fqn=fqn, op=str(node.target), rank=ctx.rank)
    fake_mode = fake_mode_of(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and _shard_of(node) is not None and node.target is not wait_:
            refake(node, fake_mode)
    _check_outputs(gm, ctx, names)
    return gm


def _check_outputs(gm: fx.GraphModule, ctx, names: dict[int, str]) -> None:
    out = gm.graph.output_node()
    for value, slot in zip(list(out.args[0]), ctx.output_slots):
        local = isinstance(value, fx.Node) and _shard_of(value) is not None
        sharded_state = slot.kind.per_parameter and slot.index in ctx.shard_specs
        if slot.kind is SlotKind.USER and local:
            raise CompileError(
                f"fully_shard: the step returns a gradient or optimizer state (output {slot.index}), which is "
                "sharded; return a value computed in forward, or read it after the step through "
                "spmd_ort.full_state_dict", rank=ctx.rank)
        if sharded_state and isinstance(value, fx.Node) and not local \
                and (slot.kind is not SlotKind.OPT_STATE or is_sharded_state(val(value))):
            fqn = names.get(slot.index, "?")
            raise CompileError(
                f"fully_shard: the step writes the whole {slot.kind} of `{fqn}` ({value.target}), but between "
                "steps each rank holds only its shard; change parameters only through the optimizer",
                fqn=fqn, op=str(value.target), rank=ctx.rank)


@graph_pass(requires=[SHARDED_PLACEHOLDERS, SHARDS_PROPAGATED],
            provides=[PARAMS_GATHERED_BEFORE_USE, COLLECTIVES_WAITED])
def gather_parameters_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Every use of a sharded parameter outside the optimizer reads ``all_gather -> wait_ -> slice -> view``.

    One gather per use, tagged with its user's phase; ``dedup_collectives_pass``
    keeps one per parameter (and, with ``reshard_after_forward``, per phase:
    the gathers' ``meta["dedup_key"]``).
    """
    graph = gm.graph
    fake_mode = fake_mode_of(gm)
    reshard = ctx.mode.reshard_after_forward
    for p in sharded_params(gm):
        spec = ctx.shard_specs[p.meta[SHARDED_PARAM]]
        full_val = None
        for user in list(p.users):
            if _shard_of(user) is not None:
                continue  # the optimizer (or elementwise ops next to it) reads the shard
            if full_val is None:
                with fake_mode:
                    full_val = torch.empty(spec.shape, dtype=val(p).dtype, device=val(p).device)
            flat_val = full_val.new_empty(spec.padded_numel)
            with graph.inserting_before(user):
                ag = call(graph, all_gather, (p, ctx.world_size, -1, ctx.group), flat_val)
                done = call(graph, wait_, (ag,), flat_val)
                piece = call(graph, aten.slice.Tensor, (done, 0, 0, spec.numel), full_val.reshape(-1))
                full = call(graph, aten.view.default, (piece, list(spec.shape)), full_val)
            for n in (ag, done, piece, full):
                set_phase(n, phase(user))
            if reshard:
                ag.meta[DEDUP_KEY] = phase(user)
            user.replace_input_with(p, full)
    return gm


@graph_pass(requires=[SHARDS_PROPAGATED], provides=[GRAD_NORMS_COMPLETED, COLLECTIVES_WAITED])
def complete_grad_norms_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``||shard||`` per gradient -> the full norms: sqrt(all-reduce of the squares), one collective.

    The partial norms are ``propagate_shards_pass``'s ``meta["partial_norm"]`` marks; after it,
    nothing reads a partial norm except the completion.
    """
    graph = gm.graph
    norms = sorted((n for n in graph.nodes if n.meta.get(PARTIAL_NORM) is not None),
                   key=lambda n: n.meta[PARTIAL_NORM])
    if norms:
        last = max(norms)
        v = val(norms[0])
        with fake_mode_of(gm):
            vec = v.new_empty(len(norms))
        with graph.inserting_after(last):
            stacked = call(graph, aten.stack.default, (norms,), vec)
        with graph.inserting_after(stacked):
            squares = call(graph, aten.mul.Tensor, (stacked, stacked), vec)
        with graph.inserting_after(squares):
            reduced = call(graph, all_reduce_, (squares, 1.0, ctx.group), vec)
        with graph.inserting_after(reduced):
            done = call(graph, wait_, (reduced,), vec)
        with graph.inserting_after(done):
            total = call(graph, aten.sqrt.default, (done,), vec)
        anchor = total
        for i, norm in enumerate(norms):
            with graph.inserting_after(anchor):
                full = call(graph, aten.select.int, (total, 0, i), v)
            norm.replace_all_uses_with(full, delete_user_cb=lambda u: u is not stacked)
            anchor = full
    stable_topological_sort(gm)
    return gm


@graph_pass(requires=[SHARDS_PROPAGATED], provides=[FOUND_INF_COMPLETED, COLLECTIVES_WAITED])
def complete_found_inf_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """A GradScaler's ``found_inf`` over this rank's gradient shards -> over the whole gradients, on every rank.

    Each flag is summed over ranks (one all-reduce) and clamped to 1, the value
    eager computes on whole gradients, so the optimizer skips and the scale backs
    off on every rank together (FSDP's ShardedGradScaler all-reduces it the same
    way).  The partial flags are ``propagate_shards_pass``'s ``meta["partial_found_inf"]``
    marks; after it, nothing reads a partial flag except the completion.
    """
    graph = gm.graph
    for flag in [n for n in graph.nodes if n.meta.get(PARTIAL_FOUND_INF)]:
        v = val(flag)
        with graph.inserting_after(flag):
            copy = call(graph, aten.clone.default, (flag,), v)
        with graph.inserting_after(copy):
            reduced = call(graph, all_reduce_, (copy, 1.0, ctx.group), v)
        with graph.inserting_after(reduced):
            done = call(graph, wait_, (reduced,), v)
        with graph.inserting_after(done):
            combined = call(graph, aten.clamp_max.default, (done, 1.0), v)
        for n in (copy, reduced, done, combined):
            set_phase(n, phase(flag))
        flag.replace_all_uses_with(combined, delete_user_cb=lambda u: u is not copy)
    return gm
