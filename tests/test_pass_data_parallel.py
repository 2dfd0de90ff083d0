"""The data-parallel passes on small traced graphs: counts, placement, numbers."""

from __future__ import annotations

import copy

import torch
import pytest
from torch import fx

import spmd_ort
from spmd_ort.passes import sum_micro_batch_gradients_pass
from spmd_ort.passes.data_parallel import GradientBuckets, SummedMicroBatches
from spmd_ort.graph.ops import all_reduce_, broadcast_, wait_
from spmd_ort.passes import (PassContext, broadcast_buffers_pass, bucket_collectives_pass, build_pipeline,
                                 dedup_collectives_pass, expand_data_parallel_pass, op_counts, run_passes,
                                 schedule_overlap_pass)
from spmd_ort.runtime.step_runtime import StepRuntime
from spmd_ort.graph.slots import SlotKind
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.optim import rule_for
from spmd_ort.capture.trace import trace_step
from helpers import accumulation_step, train_step
from models import CNN, MLP

AR, WAIT, BCAST = "spmd_ort.all_reduce_.default", "spmd_ort.wait_.default", "spmd_ort.broadcast_.default"


def _traced(model, x, y, opt_cls=torch.optim.SGD):
    opt = opt_cls(model.parameters(), lr=0.1)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    traced = trace_step(train_step, (model, opt, x, y), {}, layout, tag_grads=True)
    # as in the pipeline: capture clean-up first (drops autograd's detach of each gradient)
    traced.gm = run_passes(traced.gm, _ctx(traced), build_pipeline(None, "fx", stages=("cleanup",)))
    inputs = layout.gather() + [x, y]
    return traced, inputs


def _ctx(traced, world_size=1, **mode):
    return PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots),
                       world_size=world_size, mode=spmd_ort.DataParallel(**mode), check_contracts=True)


def _run(gm, inputs):
    runtime = StepRuntime()  # collectives run on this runtime's communicator
    with torch.no_grad(), runtime.active():
        out = [o.clone() for o in gm(*[t.detach().clone() for t in inputs])]
    runtime.comm.finish()
    return out


def test_expand_replaces_every_tag_and_keeps_numbers(one_rank):
    model = MLP()
    traced, inputs = _traced(model, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    gm = traced.gm
    assert op_counts(gm)["spmd_ort.tag_grad.default"] == 6
    expected = _run(gm, inputs)
    gm = run_passes(gm, _ctx(traced), [expand_data_parallel_pass])
    gm.graph.lint()
    counts = op_counts(gm)
    assert counts["spmd_ort.tag_grad.default"] == 0 and counts[AR] == 6 and counts[WAIT] == 6
    for a, b in zip(_run(gm, inputs), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("cap_mb,first_mb,buckets", [(25.0, 1.0, 1), (0.01, 0.01, 3), (0.01, 0.002, 4)])
def test_bucket_count_for_cap(one_rank, cap_mb, first_mb, buckets):
    # MLP grads in backward order: head (640+10), fc2 (4096+64), fc1 (2048+64) floats
    model = MLP()
    traced, inputs = _traced(model, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    expected = _run(traced.gm, inputs)
    ctx = _ctx(traced, bucket_cap_mb=cap_mb, first_bucket_cap_mb=first_mb)
    gm = run_passes(traced.gm, ctx, [expand_data_parallel_pass, bucket_collectives_pass])
    gm.graph.lint()
    buckets_made = ctx.results.get(GradientBuckets)
    assert op_counts(gm)[AR] == buckets == len(buckets_made.names)
    assert sum(buckets_made.nbytes) == sum(p.numel() * 4 for p in model.parameters())
    first = buckets_made.nbytes[0]
    assert first <= first_mb * 2**20 or len(buckets_made.names[0]) == 1  # one oversized grad may stand alone
    for a, b in zip(_run(gm, inputs), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_overlap_issues_early_and_waits_late(one_rank):
    model = MLP()
    traced, inputs = _traced(model, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    expected = _run(traced.gm, inputs)
    ctx = _ctx(traced, bucket_cap_mb=0.01, first_bucket_cap_mb=0.01)
    gm = run_passes(traced.gm, ctx, [expand_data_parallel_pass, bucket_collectives_pass, schedule_overlap_pass])
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    reduces = [n for n in nodes if n.target is all_reduce_]
    waits = [n for n in nodes if n.target is wait_]
    for ar in reduces:
        # issued right after its input is built
        assert pos[ar] == pos[ar.args[0]] + 1
    first_ar, last_wait = min(pos[n] for n in reduces), min(pos[n] for n in waits)
    # compute happens between the first issue and the first wait (backward of earlier layers)
    between = [n for n in nodes[first_ar:last_wait] if n.op == "call_function" and
               str(n.target).startswith("aten.mm")]
    assert between, "no compute overlaps the first all-reduce"
    # waits sit after every all-reduce: the optimizer is the first consumer
    assert min(pos[w] for w in waits) > max(pos[a] for a in reduces)
    for a, b in zip(_run(gm, inputs), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dedup_merges_identical_collectives(one_rank):
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    c1 = graph.call_function(all_reduce_, (x, 0.5))
    c2 = graph.call_function(all_reduce_, (x, 0.5))  # same op, same input
    c3 = graph.call_function(all_reduce_, (x, 0.25))  # different prescale: kept
    w1, w2, w3 = (graph.call_function(wait_, (c,)) for c in (c1, c2, c3))
    graph.output((w1, w2, w3))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert op_counts(gm)[AR] == 3
    gm = run_passes(gm, PassContext(input_slots=[], output_slots=[]), [dedup_collectives_pass])
    gm.graph.lint()
    assert op_counts(gm)[AR] == 2 and op_counts(gm)[WAIT] == 2


def test_buffers_are_broadcast_before_use(one_rank):
    model = CNN()
    traced, inputs = _traced(model, torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    expected = _run(traced.gm, inputs)
    gm = run_passes(traced.gm, _ctx(traced), [expand_data_parallel_pass, broadcast_buffers_pass])
    gm.graph.lint()
    assert op_counts(gm)[BCAST] == 6
    for node in gm.graph.nodes:
        if node.target is broadcast_:
            assert [u for u in node.args[0].users if u is not node] == []  # only the broadcast reads it
    for a, b in zip(_run(gm, inputs), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_each_runtime_counts_only_its_own_collectives(one_rank):
    """Host ops report to the communicator of the step whose graph is running (a context variable), so two
    graphs run at once from two threads each count their own all-reduces; one process-wide counter
    would give both the sum."""
    import threading

    runs = {}
    for name, hidden in (("small", 16), ("large", 128)):
        model = MLP(hidden=hidden)
        traced, inputs = _traced(model, torch.randn(8, 32), torch.randint(0, 10, (8,)))
        ctx = _ctx(traced, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
        gm = run_passes(traced.gm, ctx, [expand_data_parallel_pass, bucket_collectives_pass])
        runs[name] = (gm, inputs, StepRuntime(), sum(p.numel() * 4 for p in model.parameters()))
    start = threading.Barrier(2)

    def work(gm, inputs, runtime, _):
        start.wait()
        with torch.no_grad(), runtime.active():
            for _ in range(20):
                gm(*inputs)
                runtime.comm.finish()

    threads = [threading.Thread(target=work, args=run) for run in runs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (_, _, runtime, grad_bytes) in runs.items():
        assert runtime.comm.step.all_reduce_bytes == 20 * grad_bytes, name


def test_gradient_presence_is_summed_over_ranks_after_bucketing(one_rank):
    """Parameters only an opaque part uses (RoutedMoENet's MoE) have a presence vector (spmd_ort.capture.presence):
    the pass sums it over the ranks (one all-reduce, after the gradient buckets, which stay gradients only); on
    one rank the numbers equal the graph before it, an idle expert's entries 0 included."""
    from spmd_ort.capture.opaque import OpaquePlan
    from spmd_ort.graph.ops import grads_present
    from spmd_ort.passes import reduce_grad_presence_pass
    from models import RoutedMoENet, starve

    model = RoutedMoENet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    x[:3, :3] += 10 * torch.eye(3)  # a token for each of experts 0-2
    x = starve(x, 3)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    traced = trace_step(train_step, (model, opt, x, y), {}, layout, tag_grads=True, plan=OpaquePlan())
    names = [layout.param_names[i][0] for i in layout.present_params]
    assert "moe.experts.3.up.weight" in names and "embed.weight" not in names
    inputs = layout.gather() + [x, y]

    def run(gm):
        runtime = StepRuntime()
        with torch.no_grad(), runtime.active(), runtime.running(tuple(traced.opaque)):
            out = [o.clone() for o in gm(*[t.detach().clone() for t in inputs])]
        runtime.comm.finish()
        return out

    ctx = PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots), world_size=1,
                      mode=spmd_ort.DataParallel(), check_contracts=True, layout=layout)
    gm = run_passes(traced.gm, ctx, [expand_data_parallel_pass, bucket_collectives_pass])
    expected = run(gm)
    presence = expected[[s.kind for s in traced.output_slots].index(SlotKind.PRESENCE)]
    idle = [k for k, n in enumerate(names) if n.startswith("moe.experts.3.")]
    assert len(idle) == 4 and presence[idle].eq(0).all() and presence.sum() == len(names) - 4
    before = op_counts(gm)[AR]
    gm = run_passes(gm, ctx, [reduce_grad_presence_pass])
    gm.graph.lint()
    assert op_counts(gm)[AR] == before + 1 and op_counts(gm)[WAIT] == before + 1
    [node] = [n for n in gm.graph.nodes if n.target is grads_present]
    assert [u.target for u in node.users] == [all_reduce_]
    for a, b in zip(run(gm), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _accumulating(model, k: int, *, read_between: bool = False, grads_before: bool = False):
    """A step with ``k`` micro-batches (helpers.accumulation_step) traced with gradient tags, cleaned up."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if grads_before:  # the step starts with gradients (accumulated by the caller across steps)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 32, generator=g) for _ in range(k)]
    ys = [torch.randint(0, 10, (4,), generator=g) for _ in range(k)]
    traced = trace_step(accumulation_step, (model, opt, xs, ys), {"read_between": read_between}, layout,
                        tag_grads=True)
    traced.gm = run_passes(traced.gm, _ctx(traced), build_pipeline(None, "fx", stages=("cleanup",)))
    return traced, layout.gather() + xs + ys


@pytest.mark.parametrize("k,read_between,grads_before", [(2, False, False), (3, False, True), (3, True, False)])
def test_micro_batch_gradients_are_summed_then_tagged_once(one_rank, k, read_between, grads_before):
    """Before: one tag (one reduction) per parameter and micro-batch; after: one per parameter, plus one per
    read of .grad between micro-batches; with expand and a 1-rank all-reduce the numbers equal the graph before
    the pass up to the order of summation (a gradient the step started with is added after the sum)."""
    model = MLP()
    traced, inputs = _accumulating(model, k, read_between=read_between, grads_before=grads_before)
    gm = traced.gm
    n_params = len(list(model.parameters()))
    assert op_counts(gm)["spmd_ort.tag_grad.default"] == k * n_params
    ctx = _ctx(traced, world_size=1)
    expected = _run(run_passes(copy.deepcopy(gm), _ctx(traced), [expand_data_parallel_pass]), inputs)
    gm = run_passes(gm, ctx, [sum_micro_batch_gradients_pass])
    reads = (k - 1) if read_between else 0  # the first parameter's .grad, read after each micro-batch but the last
    assert op_counts(gm)["spmd_ort.tag_grad.default"] == n_params + reads
    summary = ctx.results.get(SummedMicroBatches)
    assert (summary.params, summary.micro_batches, summary.read_between) == (n_params, k, reads)
    gm = run_passes(gm, ctx, [expand_data_parallel_pass])
    for a, b in zip(_run(gm, inputs), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_one_micro_batch_is_left_alone():
    traced, _ = _traced(MLP(), torch.randn(8, 32), torch.randint(0, 10, (8,)))
    code = traced.gm.code
    ctx = _ctx(traced)
    gm = run_passes(traced.gm, ctx, [sum_micro_batch_gradients_pass])
    assert gm.code == code and SummedMicroBatches not in ctx.results
