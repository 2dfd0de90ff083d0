"""ZeRO stage 3 as graph passes: sharded parameters, gradients and optimizer state.

The step is traced on full shapes (:mod:`spmd_ort.trace` stands fake full
tensors in for the shards).  :func:`shard_parameters_pass` then rewrites the
graph over shards (layout: :mod:`spmd_ort.sharding`):

* parameter placeholders become shards; every use outside the optimizer is
  preceded by ``all_gather -> wait_ -> slice -> view`` (one per use;
  ``dedup_collectives_pass`` keeps one per parameter and phase);
* with ``reshard_after_forward``, backward reads of forward views of a
  parameter (e.g. the transposed weight autograd saved) are recomputed from a
  backward gather, so the forward gather dies after its last forward use;
* each gradient tag becomes ``reshape -> pad -> reduce_scatter -> wait_``: the
  averaged gradient shard;
* what reads gradients and optimizer state is checked to be valid on shards:
  elementwise ops, the optimizer ops, and 2-norms (``clip_grad_norm_``), which
  become the norm of the shard completed by one all-reduce of squares.
  Anything else is a :class:`CompileError` naming the op and parameter.

:func:`bucket_shard_collectives_pass` merges gathers (per phase, in order of
use) and reduce-scatters (in order of production) into buckets of at most
``bucket_cap_mb``; ``schedule_overlap_pass`` then prefetches gathers and issues
reduce-scatters early.  Offload passes come last (:func:`offload_optimizer_pass`,
:func:`offload_params_pass`).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.tools_common import stable_topological_sort

from spmd_ort.collectives import all_gather, all_reduce_, reduce_scatter, wait_
from spmd_ort.errors import CompileError
from spmd_ort.optim import HOST_TWINS, INPLACE_TWINS
from spmd_ort.sharding import is_sharded_state
from spmd_ort.trace import phase

from .data_parallel import TAG, _call, _unpack_chain, _val, broadcast_buffers

aten = torch.ops.aten
OPTIMIZER_OPS = frozenset(INPLACE_TWINS) | frozenset(twin for twin, _ in INPLACE_TWINS.values())
# ops whose output has the shape of their (first) input: as valid on a shard as on the whole
SHAPE_PRESERVING = frozenset({
    aten.detach.default, aten.clone.default, aten.alias.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.full_like.default, aten._to_copy.default, aten.copy.default,
})
NORM = aten.linalg_vector_norm.default
FOREACH_NORM = aten._foreach_norm.Scalar


def _set_phase(node: fx.Node, ph: str) -> fx.Node:
    if ph == "backward":
        node.meta.setdefault("custom", {})["phase"] = "backward"
    return node


def _fake_mode(gm: fx.GraphModule):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])


def _refake(node: fx.Node, fake_mode) -> None:
    """Recompute ``node.meta["val"]`` from its inputs' (now sharded) values."""
    args = fx.map_arg(node.args, lambda n: n.meta["val"])
    kwargs = fx.map_arg(node.kwargs, lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


def _is_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def shard_parameters_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Rewrite the full-shape step into one over parameter, gradient and optimizer-state shards.

    requires: ``ctx.shard_specs`` (param index -> ShardSpec), gradients tagged
    while tracing, phase tags on backward nodes.  ensures: no tag remains;
    every sharded placeholder's ``val`` is its shard; all-gathers precede
    every use of a parameter outside the optimizer; only shard-safe ops read
    gradient or optimizer-state shards.
    """
    specs = ctx.shard_specs
    world = ctx.world_size
    mode = ctx.parallel_mode
    graph = gm.graph
    fake_mode = _fake_mode(gm)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = {s.index: s.name for s in ctx.input_slots if s.kind == "param"}
    params: dict[fx.Node, int] = {}
    local: dict[fx.Node, int] = {}  # values that are shards -> index of the parameter they belong to
    for node, slot in zip(placeholders, ctx.input_slots):
        if slot.kind not in ("param", "grad", "opt_state") or slot.index not in specs:
            continue
        val = _val(node)
        if slot.kind == "opt_state" and not is_sharded_state(val):
            continue  # scalars (Adam's step) are replicated
        with fake_mode:
            node.meta["val"] = torch.empty(specs[slot.index].shard_numel, dtype=val.dtype, device=val.device)
        if slot.kind == "param":
            params[node] = slot.index
        else:
            local[node] = slot.index
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is TAG:
            grad, index = node.args
            spec = specs[index]
            v = _val(grad)
            with graph.inserting_before(node):
                flat = _call(graph, aten.reshape.default, (grad, [-1]), v.reshape(-1))
                if spec.pad:
                    flat = _call(graph, aten.constant_pad_nd.default, (flat, [0, spec.pad]),
                                 v.new_empty(spec.padded_numel))
                shard = v.new_empty(spec.shard_numel)
                rs = _call(graph, reduce_scatter, (flat, world), shard)
                done = _call(graph, wait_, (rs,), shard)
            for n in (flat, rs, done):
                _set_phase(n, "backward")
            node.replace_all_uses_with(done)
            graph.erase_node(node)
            local[done] = index
    if mode.reshard_after_forward:
        _rematerialize_param_views(graph, params)
    norms: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node in local or not any(a in local for a in node.all_input_nodes):
            continue
        if _is_partial_norm(node):
            norms.append(node)
        elif node.target is FOREACH_NORM and _ord(node) == 2:
            norms += [u for u in node.users if u.target is operator.getitem]
        elif _shard_safe(node, local, params):
            local[node] = next(local[a] for a in node.all_input_nodes if a in local)
        else:
            fqn = names[next(local[a] for a in node.all_input_nodes if a in local)]
            raise CompileError(
                f"fully_shard: `{node.target}` reads the gradient or optimizer state of `{fqn}` as a whole "
                "tensor, but each rank holds only a 1/N shard of it.  Under fully_shard only elementwise "
                "ops, 2-norms (clip_grad_norm_) and the optimizer step may read gradients; move this "
                "computation into the model's forward, or use DataParallel(parallel_style='replicate')",
                fqn=fqn, op=str(node.target), rank=ctx.rank)
    gathers = 0
    for p, index in params.items():
        spec = specs[index]
        full_val = None
        for user in list(p.users):
            if user in local:
                continue  # the optimizer (or elementwise ops next to it) reads the shard
            if full_val is None:
                with fake_mode:
                    full_val = torch.empty(spec.shape, dtype=_val(p).dtype, device=_val(p).device)
            flat_val = full_val.new_empty(spec.padded_numel)
            with graph.inserting_before(user):
                ag = _call(graph, all_gather, (p, world), flat_val)
                done = _call(graph, wait_, (ag,), flat_val)
                piece = _call(graph, aten.slice.Tensor, (done, 0, 0, spec.numel), full_val.reshape(-1))
                full = _call(graph, aten.view.default, (piece, list(spec.shape)), full_val)
            for n in (ag, done, piece, full):
                _set_phase(n, phase(user))
            user.replace_input_with(p, full)
            gathers += 1
    if norms:
        _complete_norms(graph, norms, fake_mode)
    for node in graph.nodes:
        if node in local and node.op == "call_function" and node.target is not wait_:
            _refake(node, fake_mode)
    _check_outputs(graph, ctx, local, names)
    broadcast_buffers(gm, ctx)
    stable_topological_sort(gm)
    ctx.extra["sharded_params"] = len(params)
    return gm


def _ord(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)


def _is_partial_norm(node: fx.Node) -> bool:
    if node.target is not NORM:
        return False
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    keepdim = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
    return _ord(node) == 2 and dim is None and not keepdim


def _shard_safe(node: fx.Node, local: dict, params: dict) -> bool:
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
        if arg in local or arg in params:
            continue
        val = arg.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in vals):
            return False
    return True


def _rematerialize_param_views(graph: fx.Graph, params: dict[fx.Node, int]) -> None:
    """Backward reads of forward views of a parameter read the same views of a backward copy instead."""

    def chain_of(node: fx.Node):
        chain = []
        while node not in params:
            if node.op != "call_function" or not _is_view(node.target) or not node.args \
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
                        _set_phase(current, "backward")
                memo[arg] = current
            node.replace_input_with(arg, memo[arg])


def _complete_norms(graph: fx.Graph, norms: list[fx.Node], fake_mode) -> None:
    """``||shard||`` per gradient -> the full norms: sqrt(all-reduce of the squares), one collective."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(norms, key=lambda n: order[n])
    v = _val(norms[0])
    with fake_mode:
        vec = v.new_empty(len(norms))
    with graph.inserting_after(last):
        stacked = _call(graph, aten.stack.default, (norms,), vec)
    with graph.inserting_after(stacked):
        squares = _call(graph, aten.mul.Tensor, (stacked, stacked), vec)
    with graph.inserting_after(squares):
        reduced = _call(graph, all_reduce_, (squares, 1.0), vec)
    with graph.inserting_after(reduced):
        done = _call(graph, wait_, (reduced,), vec)
    with graph.inserting_after(done):
        total = _call(graph, aten.sqrt.default, (done,), vec)
    anchor = total
    for i, norm in enumerate(norms):
        with graph.inserting_after(anchor):
            full = _call(graph, aten.select.int, (total, 0, i), v)
        norm.replace_all_uses_with(full, delete_user_cb=lambda u: u is not stacked)
        anchor = full


def _check_outputs(graph: fx.Graph, ctx, local: dict, names: dict) -> None:
    out = graph.output_node()
    values = list(out.args[0])
    for value, slot in zip(values, ctx.output_slots):
        sharded_state = slot.kind in ("param", "grad", "opt_state") and slot.index in ctx.shard_specs
        if slot.kind == "user" and value in local:
            raise CompileError(
                f"fully_shard: the step returns a gradient or optimizer state (output {slot.index}), which is "
                "sharded; return a value computed in forward, or read it after the step through "
                "spmd_ort.full_state_dict", rank=ctx.rank)
        if sharded_state and isinstance(value, fx.Node) and value not in local \
                and (slot.kind != "opt_state" or is_sharded_state(_val(value))):
            fqn = names.get(slot.index, "?")
            raise CompileError(
                f"fully_shard: the step writes the whole {slot.kind} of `{fqn}` ({value.target}), but between "
                "steps each rank holds only its shard; change parameters only through the optimizer",
                fqn=fqn, op=str(value.target), rank=ctx.rank)


def keep_tail_gathers_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """With resharding, parameters still gathered when forward ends are not gathered again for backward.

    A parameter whose last forward use comes after the last forward gather has
    been waited for (the final block, the LM head, a tied embedding) holds its
    gathered copy until the end of forward anyway; backward starts with exactly
    these parameters, so freeing and re-gathering them would only add a
    blocking all-gather at the turn (FSDP2 keeps its root module unsharded for
    the same reason).  requires: one gather per parameter and phase (dedup).
    ensures: such parameters' backward uses read the forward gather.
    """
    mode = ctx.parallel_mode
    if not mode.reshard_after_forward:
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    gathers: dict[tuple, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is all_gather:
            gathers[(node.args, phase(node))] = node
    forward_waits = [order[w] for (args, ph), g in gathers.items() if ph == "forward" for w in g.users]
    if not forward_waits:
        return gm
    last_wait = max(forward_waits)
    kept = []
    for (args, ph), forward in gathers.items():
        backward = gathers.get((args, "backward"))
        if ph != "forward" or backward is None:
            continue
        last_use = max((order[u] for u in _uses(forward) if phase(u) == "forward"), default=-1)
        if last_use <= last_wait:
            continue
        (fwd_wait,), (bwd_wait,) = list(forward.users), list(backward.users)
        bwd_wait.replace_all_uses_with(fwd_wait)
        graph.erase_node(bwd_wait)
        graph.erase_node(backward)
        kept.append(args[0].name)
    ctx.extra["kept_for_backward"] = kept
    return gm


def _uses(gather: fx.Node) -> list[fx.Node]:
    """The nodes that read a gathered parameter, past the wait/slice/view nodes that unpack it."""
    chain = set().union(*(_unpack_chain(wait) for wait in gather.users))
    return [u for n in chain for u in n.users if u not in chain]


def _bytes(val: torch.Tensor) -> int:
    return val.numel() * val.element_size()


def bucket_shard_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """All-gathers of one phase, in order of use, and reduce-scatters, in order of production, share buckets.

    A gather bucket is ``cat(shards) -> all_gather -> wait_ -> view(N, total)``
    and per parameter ``slice`` of its columns ``-> reshape`` (rank-major back
    to the parameter's flat layout).  A reduce-scatter bucket is each padded
    gradient ``view(N, shard)``, ``cat`` along columns ``-> reduce_scatter ->
    wait_ -> split``.  Buckets hold one dtype and device, at most
    ``bucket_cap_mb`` of unsharded bytes.  requires: ``shard_parameters_pass``
    (and dedup).  ensures: one collective per bucket.
    """
    mode = ctx.parallel_mode
    cap = mode.bucket_cap_mb * 2**20
    graph = gm.graph
    world = ctx.world_size
    gathers: dict[str, list] = {}
    scatters = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (all_gather, reduce_scatter):
            waits = [u for u in node.users if u.target is wait_]
            if len(waits) == 1 and len(node.users) == 1:
                if node.target is all_gather:
                    gathers.setdefault(phase(node), []).append((node, waits[0]))
                else:
                    scatters.append((node, waits[0]))
    info = ctx.extra.setdefault("shard_buckets", {"all_gather": [], "reduce_scatter": []})
    for pairs in gathers.values():
        for bucket in _buckets(pairs, cap):
            info["all_gather"].append(sum(_bytes(_val(w)) for _, w in bucket))
            _merge_gathers(graph, bucket, world)
    order = {n: i for i, n in enumerate(graph.nodes)}
    scatters.sort(key=lambda pair: order[pair[0].args[0]])
    for bucket in _buckets(scatters, cap):
        info["reduce_scatter"].append(sum(_bytes(_val(start.args[0])) for start, _ in bucket))
        _merge_scatters(graph, bucket, world)
    stable_topological_sort(gm)
    return gm


def _buckets(pairs: list, cap: float) -> list[list]:
    buckets: list[list] = []
    size = 0
    for start, wait in pairs:
        v = _val(wait) if start.target is all_gather else _val(start.args[0])
        head = buckets[-1][0][1] if buckets else None
        same = head is not None and _val(head).dtype == _val(wait).dtype and _val(head).device == _val(wait).device
        if not buckets or not same or size + _bytes(v) > cap:
            buckets.append([])
            size = 0
        buckets[-1].append((start, wait))
        size += _bytes(v)
    return buckets


def _merge_gathers(graph: fx.Graph, bucket: list, world: int) -> None:
    if len(bucket) == 1:
        return
    shards = [start.args[0] for start, _ in bucket]
    sizes = [_val(s).numel() for s in shards]
    total = sum(sizes)
    v = _val(shards[0])
    ph = phase(bucket[0][0])
    with graph.inserting_before(bucket[0][0]):
        cat = _call(graph, aten.cat.default, (shards,), v.new_empty(total))
        start = _call(graph, all_gather, (cat, world), v.new_empty(total * world))
        done = _call(graph, wait_, (start,), v.new_empty(total * world))
        table = _call(graph, aten.view.default, (done, [world, total]), v.new_empty(world, total))
        new = [cat, start, done, table]
        offset = 0
        for (old_start, old_wait), size in zip(bucket, sizes):
            cols = _call(graph, aten.slice.Tensor, (table, 1, offset, offset + size), v.new_empty(world, size))
            flat = _call(graph, aten.reshape.default, (cols, [-1]), v.new_empty(world * size))
            old_wait.replace_all_uses_with(flat)
            new += [cols, flat]
            offset += size
    for n in new:
        _set_phase(n, ph)
    for old_start, old_wait in bucket:
        graph.erase_node(old_wait)
        graph.erase_node(old_start)


def _merge_scatters(graph: fx.Graph, bucket: list, world: int) -> None:
    if len(bucket) == 1:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [start.args[0] for start, _ in bucket]
    last = max(inputs, key=lambda n: order[n])
    sizes = [_val(w).numel() for _, w in bucket]
    total = sum(sizes)
    v = _val(inputs[0])
    with graph.inserting_before(last.next):
        tables = [_call(graph, aten.view.default, (x, [world, s]), v.new_empty(world, s))
                  for x, s in zip(inputs, sizes)]
        cat = _call(graph, aten.cat.default, (tables, 1), v.new_empty(world, total))
        flat = _call(graph, aten.view.default, (cat, [-1]), v.new_empty(world * total))
        start = _call(graph, reduce_scatter, (flat, world), v.new_empty(total))
        done = _call(graph, wait_, (start,), v.new_empty(total))
        parts = _call(graph, aten.split_with_sizes.default, (done, sizes), list(v.new_empty(total).split(sizes)))
        new = tables + [cat, flat, start, done, parts]
        for i, ((old_start, old_wait), size) in enumerate(zip(bucket, sizes)):
            piece = _call(graph, operator.getitem, (parts, i), v.new_empty(size))
            old_wait.replace_all_uses_with(piece)
            new.append(piece)
    for n in new:
        _set_phase(n, "backward")
    for old_start, old_wait in bucket:
        graph.erase_node(old_wait)
        graph.erase_node(old_start)


def offload_optimizer_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``offload_optimizer="cpu"``: every optimizer op becomes its host twin.

    The host twin (``spmd_ort::host_adam`` / ``host_sgd``) runs the native fused
    kernel of ``csrc/`` on host tensors, copying device gradients in and new
    parameters out; optimizer state stays in host memory.  ensures: no
    device optimizer op remains.
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in HOST_TWINS:
            node.target = HOST_TWINS[node.target]
            count += 1
    ctx.extra["offloaded_optimizer_ops"] = count
    return gm


def offload_params_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``offload_param="cpu"``: parameter shards live in host memory; each is copied to the device before its gather.

    The compute device is the device of the batch inputs.  When it is the
    host (a CPU-only run) the shards already are where the gathers read them
    and nothing is inserted.  ensures: every all-gather reads a tensor on the
    compute device.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = [_val(n) for n, s in zip(placeholders, ctx.input_slots) if s.kind == "batch"]
    device = batch[0].device if batch else torch.device("cpu")
    moved = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is all_gather:
            src = node.args[0]
            if _val(src).device == device:
                continue
            with gm.graph.inserting_before(node):
                copy = _call(gm.graph, aten._to_copy.default, (src,), _val(src).to("meta"))
                copy.kwargs = {"device": device, "non_blocking": True}
                _refake(copy, _fake_mode(gm))
            node.replace_input_with(src, copy)
            moved += 1
    ctx.extra["offload_param"] = {"device": str(device), "copies": moved}
    return gm
