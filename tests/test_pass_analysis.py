"""Analysis passes record results and leave the graph as it is: count_collectives_pass."""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd_ort
from spmd_ort.capture.optim import rule_for
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.trace import trace_step
from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.passes import PassContext, build_pipeline, op_counts, run_passes
from spmd_ort.passes.analysis import CapturePlan, CollectiveCounts, count_collectives_pass, plan_graph_capture_pass
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


def _gpu_graph(build) -> fx.GraphModule:
    """A graph made by ``build(add)``, where ``add(op, target, args, val)`` adds a node whose value is ``val``
    (fake tensors: CUDA ones exist on this CPU-only machine)."""
    graph = fx.Graph()

    def add(op, target, args=(), val=None):
        node = graph.create_node(op, target, args, {}, name=target if op == "placeholder" else None)
        node.meta["val"] = val
        return node

    with FakeTensorMode():
        out = build(add)
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


def _capture_plan(gm) -> CapturePlan:
    """The pass's plan; the graph's first input is the batch (the step computes where its batch is)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slots = [Slot(SlotKind.BATCH if i == 0 else SlotKind.PARAM, n.name, i) for i, n in enumerate(inputs)]
    ctx = PassContext(input_slots=slots, output_slots=[])
    run_passes(gm, ctx, [plan_graph_capture_pass])
    return ctx.results.get(CapturePlan)


def test_a_gpu_step_of_kernels_and_nccl_collectives_is_one_graph():
    """Matmuls, elementwise ops, a GPU collective and its wait, a random op: one graph holds them all."""
    aten, ops = torch.ops.aten, spmd_ort.graph.ops

    def build(add):
        x = add("placeholder", "x", val=torch.empty(8, 16, device="cuda"))
        w = add("placeholder", "w", val=torch.empty(16, 16, device="cuda"))
        y = add("call_function", aten.mm.default, (x, w), torch.empty(8, 16, device="cuda"))
        r = add("call_function", aten.relu.default, (y,), torch.empty(8, 16, device="cuda"))
        m = add("call_function", aten.bernoulli.p, (r, 0.5), torch.empty(8, 16, device="cuda"))
        g = add("call_function", ops.all_reduce_, (m, 0.5, ""), torch.empty(8, 16, device="cuda"))
        return add("call_function", ops.wait_, (g,), torch.empty(8, 16, device="cuda"))

    plan = _capture_plan(_gpu_graph(build))
    assert plan.capturable and plan.regions == (5,) and plan.splits == () and not plan.per_size
    assert plan.lines() == ["CUDA graph capture: 1 graph (5 ops)"]


def test_host_work_splits_the_capture_and_a_value_sized_output_stops_it():
    """A value read on the host, a hyper-parameter kept on the host and a gloo (host tensor) collective each run
    between graphs, named with why; an output whose size depends on the values makes capture impossible."""
    aten, ops = torch.ops.aten, spmd_ort.graph.ops

    def build(add, nonzero=False):
        x = add("placeholder", "x", val=torch.empty(8, device="cuda"))
        lr = add("placeholder", "lr", val=torch.empty((), device="cpu"))
        a = add("call_function", aten.mul.Tensor, (x, x), torch.empty(8, device="cuda"))
        s = add("call_function", aten._local_scalar_dense.default, (a,), 1.0)
        b = add("call_function", aten.mul.Tensor, (a, lr), torch.empty(8, device="cuda"))
        c = add("call_function", aten.add.Tensor, (b, b), torch.empty(8, device="cuda"))
        d = add("call_function", aten.exp.default, (c,), torch.empty(8, device="cuda"))
        if nonzero:
            add("call_function", aten.nonzero.default, (d,), torch.empty(3, 1, dtype=torch.long, device="cuda"))
        h = add("call_function", aten._to_copy.default, (d,), torch.empty(8, device="cpu"))
        g = add("call_function", ops.all_reduce_, (h, 1.0, ""), torch.empty(8, device="cpu"))
        return (s, g)

    gm = _gpu_graph(build)
    plan = _capture_plan(gm)
    assert plan.capturable and plan.regions == (1, 2)  # mul | item | mul(lr) | add, exp | to cpu | all-reduce
    nodes = {n.name: n for n in gm.graph.nodes}
    split = [nodes[name] for name, _ in plan.splits]
    assert [n.target for n in split] == [aten._local_scalar_dense.default, aten.mul.Tensor, aten._to_copy.default,
                                         ops.all_reduce_]
    why = [reason for _, reason in plan.splits]
    assert "reads a value on the host" in why[0] and "reads lr, a host tensor" in why[1]
    assert "makes a host tensor" in why[2] and f"reads {split[2].name}, a host tensor" in why[3]
    assert plan.lines()[0] == "CUDA graph capture: 2 graphs (1 + 2 ops)" and len(plan.lines()) == 5
    blocked = _capture_plan(_gpu_graph(lambda add: build(add, nonzero=True)))
    assert not blocked.capturable and "nonzero" in blocked.blocker and "depends on the values" in blocked.blocker
    assert blocked.lines() == [f"CUDA graph capture: not possible: {blocked.blocker}"]


def test_a_cpu_step_records_nothing_to_capture_and_shows_nothing():
    """The pipeline's last pass on a real CPU step: nothing to capture, no line in describe()."""
    step = spmd_ort.compile(backend="fx")(train_step)
    model = MLP()
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 32), torch.randint(0, 10, (4,)))
    plan = step.compiled.results.get(CapturePlan)
    assert plan == CapturePlan(cuda=False) and not plan.capturable
    assert step.compiled.passes_applied[-1].name == "plan_graph_capture_pass"
    assert "CUDA graph" not in step.compiled.describe()
