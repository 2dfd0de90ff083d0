"""Analysis passes record results and leave the graph as it is: count_collectives_pass."""

from __future__ import annotations

import torch

import spmd_ort
from spmd_ort.capture.optim import rule_for
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.trace import trace_step
from spmd_ort.passes import PassContext, build_pipeline, op_counts, run_passes
from spmd_ort.passes.analysis import CollectiveCounts, count_collectives_pass
from helpers import shard_without_collectives, train_step
from models import MLP


def _distributed(mode):
    """The MLP step traced and run through the parallel passes of ``mode`` on 2 (fake) ranks."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode is not None and mode.sharded:
        shard_without_collectives(model, opt, world=2)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    traced = trace_step(train_step, (model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,))), {}, layout,
                        tag_grads=True)
    ctx = PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots), mode=mode,
                      world_size=2, layout=layout, shard_specs=layout.shard_specs, check_contracts=True)
    stages = ("cleanup", "replicate", "parallel", "mixed_precision", "fully_shard", "offload")
    return run_passes(traced.gm, ctx, build_pipeline(mode, "fx", stages=stages)), ctx


def test_counts_each_kind_of_collective_with_its_bytes():
    gm, ctx = _distributed(spmd_ort.DataParallel(bucket_cap_mb=0.01, first_bucket_cap_mb=0.01))
    before = gm.code
    gm = run_passes(gm, ctx, [count_collectives_pass])
    counts = ctx.results.get(CollectiveCounts)
    reduces = [n for n in gm.graph.nodes if n.target is spmd_ort.graph.ops.all_reduce_]
    assert counts.calls == {"all-reduce": len(reduces)} and len(reduces) > 1  # several buckets
    grad_bytes = sum(p.numel() * 4 for p in MLP().parameters())
    assert counts.nbytes == {"all-reduce": grad_bytes}
    assert gm.code == before  # an analysis: the graph is unchanged
    assert f"collectives per step: all-reduce x{len(reduces)}" in ctx.results.lines()[-1]


def test_all_gathers_are_counted_per_phase_under_fully_shard():
    gm, ctx = _distributed(spmd_ort.DataParallel(parallel_style="fully_shard"))
    ops = op_counts(gm)
    gm = run_passes(gm, ctx, [count_collectives_pass])
    calls = ctx.results.get(CollectiveCounts).calls
    assert set(calls) == {"all-gather (forward)", "all-gather (backward)", "reduce-scatter"}
    assert calls["all-gather (forward)"] + calls["all-gather (backward)"] == ops["spmd_ort.all_gather.default"]
    assert calls["reduce-scatter"] == ops["spmd_ort.reduce_scatter.default"]


def test_one_process_has_none():
    gm, ctx = _distributed(None)
    run_passes(gm, ctx, [count_collectives_pass])
    assert ctx.results.get(CollectiveCounts).calls == {}
    assert "collectives per step: none" in ctx.results.lines()
