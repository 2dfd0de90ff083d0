"""The mixed-precision passes (and the found_inf completion of fully_shard) on small traced graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import spmd_ort
from spmd_ort.graph.ops import all_gather, all_reduce_, reduce_scatter, wait_
from spmd_ort.capture.optim import rule_for
from spmd_ort.passes import (PassContext, build_pipeline, cast_gradient_reductions_pass,
                                 cast_params_before_gather_pass, complete_found_inf_pass, dedup_collectives_pass,
                                 expand_data_parallel_pass, gather_parameters_pass, propagate_shards_pass,
                                 reduce_scatter_gradients_pass, rematerialize_param_views_pass, run_passes,
                                 shard_placeholders_pass)
from spmd_ort.passes.helpers import is_dtype_cast, unpack_chain
from spmd_ort.runtime.step_runtime import StepRuntime
from spmd_ort.distributed.sharding import SHARD_ATTR, ShardSpec
from spmd_ort.graph.slots import SlotKind
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.trace import trace_step
from helpers import scaled_update, train_step
from models import MLP

BF16 = spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
aten = torch.ops.aten


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _traced(model, opt, args, *, world=1, sharded=False, step=train_step, scaler=None, policy=BF16):
    if sharded:
        for p in model.parameters():
            spec = ShardSpec(tuple(p.shape), p.numel(), world, 0)
            p.data = spec.shard_of(p.data)
            setattr(p, SHARD_ATTR, spec)
    layout = StateLayout.capture(model, opt, rule_for(opt), scaler)
    traced = trace_step(step, args, {}, layout, tag_grads=True, mixed_precision=policy)
    return traced, layout


def _ctx(traced, layout, world, style, policy=BF16):
    mode = spmd_ort.DataParallel(parallel_style=style, mixed_precision=policy)
    ctx = PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots),
                      world_size=world, mode=mode, shard_specs=layout.shard_specs, layout=layout,
                      check_contracts=True)
    traced.gm = run_passes(traced.gm, ctx, build_pipeline(mode, "fx", stages=("cleanup",)))
    return ctx


def _run(gm, inputs):
    runtime = StepRuntime()
    with torch.no_grad(), runtime.active():
        out = [o.clone() for o in gm(*[t.detach().clone() for t in inputs])]
    runtime.comm.finish()
    return out


def test_gradients_are_all_reduced_in_the_reduce_dtype_and_numbers_unchanged(one_rank):
    """replicate: every gradient all-reduce runs in bf16 (param_dtype, FSDP2's default reduce dtype); the
    bf16 gradient came back through the parameter's cast, so the round trip loses nothing (N = 1: bitwise)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    traced, layout = _traced(model, opt, (model, opt, x, y))
    ctx = _ctx(traced, layout, 1, "replicate")
    gm = run_passes(traced.gm, ctx, [expand_data_parallel_pass])
    inputs = layout.gather() + [x, y]
    before = _run(gm, inputs)
    assert all(n.meta["val"].dtype == torch.float32 for n in _nodes(gm, all_reduce_))
    gm = run_passes(gm, ctx, [cast_gradient_reductions_pass])
    reduces = _nodes(gm, all_reduce_)
    assert len(reduces) == 6 and all(n.meta["val"].dtype == torch.bfloat16 for n in reduces)
    for wait in _nodes(gm, wait_):  # each result goes back to the parameter's dtype for the optimizer
        assert [u.meta["val"].dtype for u in wait.users] == [torch.float32]
    for a, b in zip(_run(gm, inputs), before, strict=True):
        assert torch.equal(a, b)


def test_reduce_scatter_runs_in_reduce_dtype_and_gathers_move_param_dtype():
    """fully_shard, N = 2: reduce-scatters in fp32 when reduce_dtype=float32; every all-gather moves the
    bf16 cast of a shard (cast_params_before_gather_pass) and no cast of a gathered tensor remains."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    traced, layout = _traced(model, opt, (model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,))),
                             world=2, sharded=True, policy=policy)
    ctx = _ctx(traced, layout, 2, "fully_shard", policy)
    shard = [shard_placeholders_pass, reduce_scatter_gradients_pass, cast_gradient_reductions_pass,
             rematerialize_param_views_pass, propagate_shards_pass, gather_parameters_pass, dedup_collectives_pass]
    gm = run_passes(traced.gm, ctx, shard)
    assert all(n.meta["val"].dtype == torch.float32 for n in _nodes(gm, reduce_scatter))
    gathers = _nodes(gm, all_gather)
    assert gathers and all(g.args[0].meta["val"].dtype == torch.float32 for g in gathers)
    n_gathers = len(gathers)
    gm = run_passes(gm, ctx, [cast_params_before_gather_pass])
    gathers = _nodes(gm, all_gather)
    assert len(gathers) == n_gathers
    for g in gathers:
        assert g.args[0].target is aten._to_copy.default and g.meta["val"].dtype == torch.bfloat16
        assert g.args[0].args[0].op == "placeholder"  # the cast reads the shard itself
        chain = set().union(*(unpack_chain(w) for w in g.users))
        readers = [u for n in chain for u in n.users if u not in chain]
        assert readers and not any(is_dtype_cast(u) for u in readers)  # the gathered bf16 is used as it is


def _amp_step(model, opt, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    return scaled_update(loss, model, opt, scaler)


def test_found_inf_of_gradient_shards_is_combined_across_ranks(one_rank):
    """fully_shard: GradScaler's inf check reads this rank's gradient shards; complete_found_inf_pass sums the
    flag over ranks (one all-reduce) and clamps it to 1, and nothing else reads the partial flag.  On one
    rank (N = 1) the sharded graph computes what eager does: the skipped step (2^19 overflows fp16 in this
    MLP) and the backed-off scale, then with 2^16 an update equal to eager's bit for bit."""
    import copy

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    results = {}
    for init in (2.0**19, 2.0**16):
        m, o = copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        o = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        s = torch.amp.GradScaler("cpu", init_scale=init)
        _amp_step(m, o, s, x, y)
        results[init] = ([p.detach().reshape(-1) for p in m.parameters()], float(s._scale))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**19)
    traced, layout = _traced(model, opt, (model, opt, scaler, x, y), world=1, sharded=True, step=_amp_step,
                             scaler=scaler, policy=None)
    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    ctx = PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots), world_size=1,
                      mode=mode, shard_specs=layout.shard_specs, layout=layout, check_contracts=True)
    gm = run_passes(traced.gm, ctx, build_pipeline(mode, "fx", stages=("cleanup",)) + [
        shard_placeholders_pass, reduce_scatter_gradients_pass, propagate_shards_pass, gather_parameters_pass])
    flags = [n for n in gm.graph.nodes if n.meta.get("partial_found_inf")]
    assert len(flags) == 1 and flags[0].meta["val"].shape == ()
    gm = run_passes(gm, ctx, [complete_found_inf_pass])
    (flag,) = [n for n in gm.graph.nodes if n.meta.get("partial_found_inf")]
    assert [u.target for u in flag.users] == [aten.clone.default]  # only the completion reads it
    reduce = flag.next.next
    assert reduce.target is all_reduce_ and reduce.meta["val"].shape == ()
    assert [u.target for u in reduce.users] == [wait_]
    assert [u.target for u in next(iter(reduce.users)).users] == [aten.clamp_max.default]
    for init, (params, scale) in results.items():
        scaler_state = [torch.tensor(init), torch.tensor(0, dtype=torch.int32)]
        got = _run(gm, layout.gather()[:-2] + scaler_state + [x, y])
        new = {s.key or s.index: v for v, s in zip(got, ctx.output_slots) if s.kind in (SlotKind.PARAM, SlotKind.SCALER)}
        assert float(new["scale"]) == scale == (init / 2 if init == 2.0**19 else init)
        for i, want in enumerate(params):
            assert torch.equal(new.get(i, layout.params[i].detach()), want), (init, i)
