"""Mixed precision in the distributed graph: reductions in ``reduce_dtype``, gathers in the dtype parameters are
used in.

The forward and backward of a :class:`spmd_ort.MixedPrecisionPolicy` are made
while tracing (each module computes on its parameters cast to ``param_dtype``,
:func:`spmd_ort.capture.amp.apply_policy`); gradients reach the fp32 parameters through
the casts' backward.  These passes put the communication in the right dtype, as
FSDP2 does:

* :func:`cast_gradient_reductions_pass`: gradient all-reduces / reduce-scatters
  run in the policy's reduce dtype, and their results are cast back to the
  parameter's dtype for the optimizer;
* :func:`cast_params_before_gather_pass`: a sharded parameter whose every use is
  a cast to one narrower dtype (``param_dtype``, or autocast's casts) is cast
  on the shard and gathered in that dtype: half the bytes for bf16/fp16.
"""

from __future__ import annotations

import torch
from torch import fx

from spmd_ort.graph.ops import all_gather, all_reduce_, reduce_scatter, wait_

from .contracts import COLLECTIVES_WAITED, NO_DUPLICATE_COLLECTIVES, PARAMS_GATHERED_BEFORE_USE, PER_GRADIENT_REDUCTIONS
from .helpers import (GRADIENT_OF, SHARD_OF, aten, calls, fake_mode_of, is_dtype_cast, phase, refake, set_phase,
                      shard_calls, unpack_chain, val)
from .runner import graph_pass


def _cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype, fake_mode) -> fx.Node:
    out = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
    refake(out, fake_mode)
    return out


def _gradient_reductions(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(start, wait) of every gradient reduction (``meta["gradient_of"]``), not yet bucketed."""
    out = []
    for start in calls(gm, all_reduce_, reduce_scatter):
        if start.meta.get(GRADIENT_OF) is None:
            continue  # e.g. a norm or flag being completed
        waits = [u for u in start.users if u.target is wait_]
        if len(waits) == 1:
            out.append((start, waits[0]))
    return out


@graph_pass(requires=[PER_GRADIENT_REDUCTIONS, COLLECTIVES_WAITED], provides=[COLLECTIVES_WAITED])
def cast_gradient_reductions_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Gradients are reduced in the MixedPrecisionPolicy's reduce dtype (``reduce_dtype``, else ``param_dtype``).

    ``clone(g) -> all_reduce_`` becomes ``clone(cast(g)) -> all_reduce_ -> wait_ -> cast back``;
    ``reduce_scatter(flat)`` becomes ``reduce_scatter(cast(flat)) -> wait_ -> cast back``.  A
    gradient computed in ``param_dtype`` and cast to fp32 by autograd is cast back losslessly, so a
    bf16 reduction reduces the bf16 gradient, as FSDP2's.  It works on the gradient collectives of
    ``expand_data_parallel_pass`` / ``reduce_scatter_gradients_pass`` (``meta["gradient_of"]``), one
    per gradient (before bucketing); after it, each runs in the reduce dtype.
    """
    policy = ctx.mode.mixed_precision
    dtype = policy.gradient_reduce_dtype() if policy is not None else None
    if dtype is None:
        return gm
    graph = gm.graph
    fake_mode = fake_mode_of(gm)
    for start, wait in _gradient_reductions(gm):
        src = start.args[0]
        if val(src).dtype == dtype or not val(src).is_floating_point():
            continue
        original = val(wait)
        holder = src.args[0] if start.target is all_reduce_ else src  # cast before replicate's private copy
        with graph.inserting_before(src if start.target is all_reduce_ else start):
            low = _cast(graph, holder, dtype, fake_mode)
        if start.target is all_reduce_:
            src.replace_input_with(holder, low)
            refake(src, fake_mode)
        else:
            start.replace_input_with(src, low)
        for n in (low, start, wait):
            set_phase(n, phase(start))
        with fake_mode:
            start.meta["val"] = wait.meta["val"] = original.to(dtype)
        with graph.inserting_after(wait):
            back = _cast(graph, wait, original.dtype, fake_mode)
        set_phase(back, phase(wait))
        if SHARD_OF in wait.meta:
            back.meta[SHARD_OF] = wait.meta[SHARD_OF]
        wait.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
    return gm


def _cast_uses(gather: fx.Node) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """The casts that are the only readers of a gathered parameter (past its unpacking), or None."""
    chain = set().union(*(unpack_chain(w) for w in gather.users))
    uses = [u for n in chain for u in n.users if u not in chain]
    if not uses or not all(is_dtype_cast(u) for u in uses):
        return None
    if len({val(u).dtype for u in uses}) != 1:
        return None
    return uses, chain


@graph_pass(requires=[PARAMS_GATHERED_BEFORE_USE, NO_DUPLICATE_COLLECTIVES], provides=[PARAMS_GATHERED_BEFORE_USE])
def cast_params_before_gather_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """A gathered parameter that is only ever read cast to one narrower dtype is cast on the shard and gathered cast.

    ``all_gather(p) -> wait_ -> slice -> view -> cast`` becomes ``all_gather(cast(p)) -> wait_ -> slice ->
    view``: the same values (a cast is elementwise; zero padding stays zero), half the bytes for
    bf16/fp16 (FSDP2 gathers ``param_dtype`` the same way).  It needs one gather per parameter and
    phase (``dedup_collectives_pass``); after it, the gathered tensor is used without a cast.
    """
    graph = gm.graph
    fake_mode = fake_mode_of(gm)
    for gather in shard_calls(gm, ctx, all_gather):  # the parameters' (2-D: not DTensor's activations')
        shard = gather.args[0]
        found = _cast_uses(gather)
        if found is None:
            continue
        uses, chain = found
        dtype, own = val(uses[0]).dtype, val(shard).dtype
        if not own.is_floating_point or torch.finfo(dtype).bits >= torch.finfo(own).bits:
            continue
        with graph.inserting_before(gather):
            low = _cast(graph, shard, dtype, fake_mode)
        set_phase(low, phase(gather))
        gather.replace_input_with(shard, low)
        for node in [gather, *sorted(chain)]:
            refake(node, fake_mode)
        for use in uses:
            use.replace_all_uses_with(use.args[0])
            graph.erase_node(use)
    return gm
