"""The fully_shard passes on small traced graphs: structure at N = 2, numbers on a one-rank group."""

from __future__ import annotations

import copy

import pytest
import torch

from spmd_ort.passes.shard_schedule import KeptForBackward, ShardBuckets
from spmd_ort.passes.offload import OptimizerOffload
import spmd_ort
from spmd_ort.graph.ops import all_gather, all_reduce_, reduce_scatter, wait_
from spmd_ort.capture.optim import rule_for
from spmd_ort.passes import (PARALLEL_STAGES, PassContext, build_pipeline, complete_grad_norms_pass,
                                 dedup_collectives_pass, gather_parameters_pass, offload_optimizer_pass,
                                 propagate_shards_pass, reduce_scatter_gradients_pass, rematerialize_param_views_pass,
                                 run_passes, shard_placeholders_pass)
from spmd_ort.runtime.step_runtime import StepRuntime
from spmd_ort.graph.slots import SlotKind
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.trace import trace_step
from spmd_ort.graph.meta import phase
from helpers import shard_without_collectives, train_step
from models import GPT, MLP, GPTConfig


def _traced(model, opt, x, y, world, clip=None, step=None):
    shard_without_collectives(model, opt, world)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    fn = step or (lambda m, o, a, b: train_step(m, o, a, b, clip=clip))
    traced = trace_step(fn, (model, opt, x, y), {}, layout, tag_grads=True)
    return traced, layout


def _ctx(traced, layout, world, **mode):
    mode = spmd_ort.DataParallel(parallel_style="fully_shard", **mode)
    return PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots),
                       world_size=world, mode=mode, shard_specs=layout.shard_specs, layout=layout,
                       check_contracts=True)


def _cleanup(ctx):
    return build_pipeline(ctx.mode, "fx", stages=("cleanup",))


def _shard(ctx):
    """The sharding rewrite (placeholders, reduce-scatters, views, propagation, gathers, norms)."""
    passes = [shard_placeholders_pass, reduce_scatter_gradients_pass]
    if ctx.mode.reshard_after_forward:
        passes.append(rematerialize_param_views_pass)
    return passes + [propagate_shards_pass, gather_parameters_pass, complete_grad_norms_pass]


def _parallel(ctx):
    return build_pipeline(ctx.mode, "fx", stages=("cleanup", *PARALLEL_STAGES))


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _gpt_batch(cfg, n=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, cfg.vocab, (n, cfg.seq), generator=g),
            torch.randint(0, cfg.vocab, (n, cfg.seq), generator=g))


def test_shard_pass_gathers_before_use_and_reduce_scatters_every_gradient():
    cfg = GPTConfig(vocab=67, d=27, heads=3, layers=1)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    traced, layout = _traced(model, opt, *_gpt_batch(cfg), world=2, clip=1.0)
    ctx = _ctx(traced, layout, 2)
    gm = run_passes(traced.gm, ctx, _cleanup(ctx) + _shard(ctx))
    n_params = len(layout.params)
    assert not [n for n in gm.graph.nodes if "tag_grad" in str(n.target)]
    # every gradient: reshape -> (pad) -> reduce_scatter -> wait
    assert len(_nodes(gm, reduce_scatter)) == n_params
    # parameter placeholders hold shards; optimizer reads shards
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, ctx.input_slots):
        if slot.kind is SlotKind.PARAM:
            assert node.meta["val"].shape == (layout.shard_specs[slot.index].shard_numel,)
    # one gather per use before dedup; each use reads a gather of its own phase
    gathers = _nodes(gm, all_gather)
    assert len(gathers) >= n_params
    gm = run_passes(gm, ctx, [dedup_collectives_pass])
    per_phase = {}
    for g in _nodes(gm, all_gather):
        per_phase.setdefault(phase(g), []).append(g.args[0])
    assert len(per_phase["forward"]) == len(set(per_phase["forward"])) == n_params - 0  # each parameter once
    assert len(per_phase["backward"]) == len(set(per_phase["backward"]))
    assert 0 < len(per_phase["backward"]) < n_params  # biases and LayerNorm biases need no re-gather
    # clip_grad_norm_: the shard norms are completed by one all-reduce of their squares
    assert len(_nodes(gm, all_reduce_)) == 1


def test_reshard_after_forward_false_gathers_once_and_backward_reads_forward_views():
    cfg = GPTConfig(layers=1)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    traced, layout = _traced(model, opt, *_gpt_batch(cfg), world=2)
    ctx = _ctx(traced, layout, 2, reshard_after_forward=False)
    gm = run_passes(traced.gm, ctx, _cleanup(ctx) + _shard(ctx) + [dedup_collectives_pass])
    assert len(_nodes(gm, all_gather)) == len(layout.params)


def test_reshard_recomputes_parameter_views_for_backward():
    """With resharding no backward node reads a forward view of a gathered parameter (it would keep
    the forward gather alive through backward)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traced, layout = _traced(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)), world=2)
    ctx = _ctx(traced, layout, 2)
    gm = run_passes(traced.gm, ctx, _cleanup(ctx) + _shard(ctx) + [dedup_collectives_pass])
    forward_gathers = {w for g in _nodes(gm, all_gather) if phase(g) == "forward" for w in g.users}

    def from_forward_gather(node, seen=()):
        if node in forward_gathers:
            return True
        return node.target in (torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.t.default) \
            and from_forward_gather(node.args[0])

    for node in gm.graph.nodes:
        if node.op == "call_function" and phase(node) == "backward":
            assert not any(from_forward_gather(a) for a in node.all_input_nodes), node


def test_buckets_and_prefetch_order():
    cfg = GPTConfig(layers=2)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    traced, layout = _traced(model, opt, *_gpt_batch(cfg), world=2)
    ctx = _ctx(traced, layout, 2, bucket_cap_mb=0.03, prefetch=1)
    gm = run_passes(traced.gm, ctx, _parallel(ctx))
    # the tied embedding / LM head and the last block are still gathered when forward ends: kept for backward
    kept = ctx.results.get(KeptForBackward).params
    wte = next(n.name for n, s in zip([n for n in gm.graph.nodes if n.op == "placeholder"], ctx.input_slots)
               if s.name == "wte.weight")
    assert wte in kept and len(kept) < len(layout.params) // 2, kept
    info = ctx.results.get(ShardBuckets)
    assert len(_nodes(gm, all_gather)) == len(info.all_gather) >= 4
    assert len(_nodes(gm, reduce_scatter)) == len(info.reduce_scatter) >= 2
    cap = 0.03 * 2**20
    assert all(b <= cap for b in info.reduce_scatter + info.all_gather)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for ph in ("forward", "backward"):
        waits = [w for w in _nodes(gm, wait_) if w.args[0].target is all_gather and phase(w) == ph]
        for k in range(1, len(waits)):
            # bucket k is issued before the wait of bucket k - 1: its transfer overlaps that bucket's compute
            assert order[waits[k].args[0]] < order[waits[k - 1]]
            if k >= 2:  # and not earlier than prefetch=1 asks
                assert order[waits[k].args[0]] > order[waits[k - 2]]
    # reduce-scatters are issued before backward ends, not after it
    last_backward = max(order[n] for n in gm.graph.nodes if phase(n) == "backward" and n.target
                        is torch.ops.aten.mm.default)
    assert min(order[n] for n in _nodes(gm, reduce_scatter)) < last_backward


def test_unsupported_gradient_use_names_the_op_and_parameter():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    traced, layout = _traced(model, opt, x, y, world=2, clip=None,
                             step=lambda m, o, a, b: _inf_clip_step(m, o, a, b))
    ctx = _ctx(traced, layout, 2)
    with pytest.raises(spmd_ort.CompileError) as err:
        run_passes(traced.gm, ctx, _cleanup(ctx) + _shard(ctx))
    msg = str(err.value)
    assert "fully_shard" in msg and "linalg_vector_norm" in msg and "replicate" in msg, msg
    assert any(f"`{name}`" in msg for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight",
                                                 "head.bias")), msg


def _inf_clip_step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
    opt.step()
    opt.zero_grad()
    return loss


def test_offload_optimizer_pass_swaps_in_the_host_twin():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    traced, layout = _traced(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)), world=2)
    ctx = _ctx(traced, layout, 2, offload_optimizer="cpu")
    gm = run_passes(traced.gm, ctx, _cleanup(ctx) + _shard(ctx) + [offload_optimizer_pass])
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "spmd_ort.host_adam.default" in targets and "spmd_ort.adam.default" not in targets
    assert ctx.results.get(OptimizerOffload).ops == 1


@pytest.mark.parametrize("reshard", [True, False])
def test_sharded_graph_on_one_rank_computes_the_unsharded_step(one_rank, reshard):
    """N = 1: every collective is the identity, so the fully sharded graph (all passes) must produce
    exactly what the traced full-shape graph produces."""
    cfg = GPTConfig(layers=1)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    x, y = _gpt_batch(cfg)
    train_step(model, opt, x, y)  # optimizer state exists
    ref_model, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref_loss = train_step(ref_model, ref_opt, x, y, clip=1.0)
    traced, layout = _traced(model, opt, x, y, world=1, clip=1.0)
    ctx = _ctx(traced, layout, 1, reshard_after_forward=reshard, bucket_cap_mb=0.01)
    gm = run_passes(traced.gm, ctx, _parallel(ctx))
    runtime = StepRuntime()
    with torch.no_grad(), runtime.active():
        outs = gm(*layout.gather(), x, y)
    runtime.comm.finish()
    torch.testing.assert_close(outs[0], ref_loss.detach(), rtol=1e-6, atol=1e-7)
    new = {s.index: v for s, v in zip(ctx.output_slots, outs) if s.kind is SlotKind.PARAM}
    for i, p in enumerate(ref_model.parameters()):
        torch.testing.assert_close(new[i], p.detach().reshape(-1), rtol=1e-6, atol=1e-7)


def test_planned_peak_falls_with_resharding_and_sharding():
    """The liveness plan sees what resharding buys: gathered weights die after their last forward use."""
    from spmd_ort.graph.liveness import planned_peak_bytes

    cfg = GPTConfig(layers=4, d=64, vocab=512)
    peaks = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train_step(model, opt, *_gpt_batch(cfg))  # optimizer state exists: the update runs in place
        traced, layout = _traced(model, opt, *_gpt_batch(cfg), world=2)
        ctx = _ctx(traced, layout, 2, reshard_after_forward=reshard, bucket_cap_mb=0.05)
        gm = run_passes(traced.gm, ctx, build_pipeline(ctx.mode, "fx"))
        peaks[reshard] = planned_peak_bytes(gm)
    params = sum(p.numel() * 4 for p in GPT(cfg).parameters())
    assert peaks[True] < peaks[False]
    assert peaks[False] - peaks[True] > 0.3 * params  # most gathered weights are not held through the turn


def test_opaque_module_reads_gathered_parameters_and_its_gradients_are_reduce_scattered():
    """An opaque submodule's parameters are placeholders like any other: gather_parameters_pass feeds
    its opaque_forward full parameters, and the gradients its opaque_backward returns are reduce-scattered."""
    from spmd_ort.capture.opaque import OpaquePlan
    from spmd_ort.graph.ops import opaque_backward, opaque_forward

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shard_without_collectives(model, opt, 2)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    traced = trace_step(train_step, (model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,))), {}, layout,
                        tag_grads=True, plan=OpaquePlan(patterns=("fc2",)))
    ctx = _ctx(traced, layout, 2)
    gm = run_passes(traced.gm, ctx, _cleanup(ctx) + _shard(ctx))
    [fwd], [bwd] = _nodes(gm, opaque_forward), _nodes(gm, opaque_backward)
    params = {n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("sharded_param") is not None}
    inputs = fwd.args[0]  # activation, fc2.weight, fc2.bias
    assert len(inputs) == 3 and not params & set(inputs)
    for full in inputs[1:]:  # view <- slice <- wait_ <- all_gather <- the shard placeholder
        node = full.args[0].args[0]
        assert node.target is wait_ and node.args[0].target is all_gather and node.args[0].args[0] in params
    flat = [u for g in bwd.users for u in g.users if u.target is torch.ops.aten.reshape.default]
    assert len(flat) == 2 and all(next(iter(r.users)).target is reduce_scatter for r in flat)  # 64x64, 64: no pad


def test_at_most_two_gradient_reduce_scatters_are_in_flight():
    """bound_reduce_scatters_pass: the process group keeps what a reduce-scatter reduces until its wait (gloo: a
    copy of the bucket), so the wait of bucket k comes before bucket k + 2 starts, not all at the optimizer (the
    values are the same: tests/test_zero3.py trains this schedule against eager and FSDP2)."""
    from spmd_ort.passes.shard_schedule import REDUCE_SCATTERS_IN_FLIGHT

    cfg = GPTConfig(layers=4, d=64, vocab=512)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, *_gpt_batch(cfg))
    traced, layout = _traced(model, opt, *_gpt_batch(cfg), world=2)
    ctx = _ctx(traced, layout, 2, bucket_cap_mb=0.05)
    gm = run_passes(traced.gm, ctx, build_pipeline(ctx.mode, "fx"))
    in_flight = peak = 0
    starts = 0
    for node in gm.graph.nodes:
        if node.target is reduce_scatter:
            starts += 1
            in_flight += 1
            peak = max(peak, in_flight)
        elif node.target is wait_ and node.args[0].target is reduce_scatter:
            in_flight -= 1
    assert starts > 2 * REDUCE_SCATTERS_IN_FLIGHT, starts  # enough buckets for the bound to matter
    assert peak == REDUCE_SCATTERS_IN_FLIGHT, peak
