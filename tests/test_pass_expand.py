"""adopt_dtensor_collectives_pass: DTensor's traced ``_c10d_functional`` collectives become the step's own ops.

Graphs are traced here from functional collectives on a real one-rank gloo group (the multi-rank behaviour, against
eager DTensor tensor parallelism, is tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.passes import PassContext, adopt_dtensor_collectives_pass, count_collectives_pass, merge_summed_all_reduces_pass, schedule_overlap_pass
from spmd_ort.passes.expand import node_signatures
from spmd_ort.passes.expand import FUNCOL
from spmd_ort.errors import CompileError
from spmd_ort.graph import ops
from spmd_ort.runtime.step_runtime import StepRuntime


def _traced(fn, *inputs):
    return make_fx(fn)(*inputs)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_collectives_become_ours_and_keep_numbers(one_rank):
    group = dist.group.WORLD.group_name

    def step(x, y):
        a = funcol.all_reduce(x * 2, "sum", group)
        b = funcol.all_reduce(x + 1, "avg", group)
        g = FUNCOL.wait_tensor(FUNCOL.all_gather_into_tensor(y, 1, group))
        r = FUNCOL.wait_tensor(FUNCOL.reduce_scatter_tensor(y * 3, "sum", 1, group))
        return a + b, g.sum(0), r

    x, y = torch.randn(4, 3), torch.randn(2, 5)
    gm = _traced(step, x, y)
    expected = gm(x, y)
    assert FUNCOL.all_reduce.default in _targets(gm)
    ctx = PassContext(input_slots=[], output_slots=[])
    gm = adopt_dtensor_collectives_pass(gm, ctx)
    targets = _targets(gm)
    assert not [t for t in targets if getattr(t, "namespace", None) == "_c10d_functional"], targets
    assert targets.count(ops.all_reduce_) == 2 and targets.count(ops.all_gather) == 1
    assert targets.count(ops.reduce_scatter) == 1 and targets.count(ops.wait_) == 4
    runtime = StepRuntime()
    with torch.no_grad(), runtime.active():
        got = gm(x, y)
        comm = runtime.comm.end_step()
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert comm.all_reduce_calls == 2 and comm.all_gather_calls == 1 and comm.reduce_scatter_calls == 1
    count_collectives_pass(gm, ctx)
    assert "all-reduce" in ctx.results.lines()[0]


def test_max_and_min_become_ours_and_are_never_merged(one_rank):
    """Loss parallel's max over the vocabulary shards (and a min) run as collectives of ours, keeping their op: left
    as traced they would run on the mesh's group, which the user's own collectives share (pairing with them). Two
    maxima added are not merged into one reduction of their sum; a reduction we have no collective for is refused,
    naming it."""
    group = dist.group.WORLD.group_name

    def step(x):
        return funcol.all_reduce(x, "max", group) + funcol.all_reduce(x * 2, "max", group), \
            funcol.all_reduce(x - 1, "min", group)

    x = torch.randn(3)
    gm = _traced(step, x)
    expected = gm(x)
    gm = merge_summed_all_reduces_pass(_adopted(step, x), PassContext(input_slots=[], output_slots=[]))
    starts = [n for n in gm.graph.nodes if n.target is ops.all_reduce_]
    assert sorted(ops.reduce_op(n) for n in starts) == ["max", "max", "min"], gm.graph
    assert not [t for t in _targets(gm) if getattr(t, "namespace", None) == "_c10d_functional"], _targets(gm)
    out, comm = _run(gm, x)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert comm.all_reduce_calls == 3
    with pytest.raises(CompileError, match="all_reduce.default` \\(product"):
        _adopted(lambda x: funcol.all_reduce(x, "product", group), x)


def _adopted(step, *inputs):
    gm = adopt_dtensor_collectives_pass(_traced(step, *inputs), PassContext(input_slots=[], output_slots=[]))
    return gm


def _run(gm, *inputs):
    runtime = StepRuntime()
    with torch.no_grad(), runtime.active():
        out = gm(*inputs)
        comm = runtime.comm.end_step()
    return out, comm


def test_summed_all_reduces_become_one(one_rank):
    """Three partial sums all-reduced and added (q, k and v's input gradients) -> one all-reduce of their sum;
    a reduction with another reader, or on another group, keeps its own."""
    group, other = dist.group.WORLD.group_name, dist.new_group([0]).group_name

    def step(x, w):
        qkv = [funcol.all_reduce(x @ w[i], "sum", group) for i in range(3)]
        merged = (qkv[0] + qkv[1]) + qkv[2]
        read = funcol.all_reduce(x @ w[3], "sum", group)  # also returned: the sum alone cannot replace it
        elsewhere = funcol.all_reduce(x @ w[4], "sum", other)  # another group than the one beside it
        return merged, read + funcol.all_reduce(x, "sum", group), read, elsewhere + funcol.all_reduce(x, "sum", group)

    x, w = torch.randn(4, 4), torch.randn(5, 4, 4)
    gm = _adopted(step, x, w)
    expected, before = _run(gm, x, w)
    assert before.all_reduce_calls == 7
    gm = merge_summed_all_reduces_pass(gm, PassContext(input_slots=[], output_slots=[], check_contracts=True))
    gm.graph.lint()
    got, after = _run(gm, x, w)
    assert after.all_reduce_calls == 5  # q + k + v as one; the rest as traced
    assert [n for n in gm.graph.nodes if n.target is ops.all_reduce_][0].args[1:] == (1.0, group)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_compute_independent_of_a_collective_runs_in_its_flight(one_rank):
    """schedule_overlap_pass: between the last host node and an activation all-reduce, what its input does not
    depend on (a weight gradient) moves below it; the numbers stay."""
    group = dist.group.WORLD.group_name

    def step(g, x, w):
        dw = g.t() @ x  # the weight gradient: independent of the all-reduce
        dx = funcol.all_reduce(g @ w, "sum", group)  # the input gradient, completed across ranks
        return dx * 2, dw

    g, x, w = torch.randn(8, 4), torch.randn(8, 6), torch.randn(4, 6)
    gm = _adopted(step, g, x, w)
    expected, _ = _run(gm, g, x, w)
    ctx = PassContext(input_slots=[], output_slots=[], check_contracts=True)
    gm = schedule_overlap_pass(gm, ctx)
    gm.graph.lint()
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    started = next(i for i, n in enumerate(order) if n.target is ops.all_reduce_)
    waited = next(i for i, n in enumerate(order) if n.target is ops.wait_)
    mms = [i for i, n in enumerate(order) if n.target is torch.ops.aten.mm.default]
    assert mms[0] < started < mms[1] < waited  # dx's matmul before the issue, dw's in flight
    got, _ = _run(gm, g, x, w)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _slots(*kinds):
    from spmd_ort.graph.slots import Slot, SlotKind

    return [Slot(kind=SlotKind(k), name=f"in{i}", index=i) for i, k in enumerate(kinds)]


def _traced_as(gm, inputs: int) -> dict:
    """What one rank's exchange after the trace holds (Compiler.compile_everywhere)."""
    return {"nodes": node_signatures(gm), "state": [(0.0, 0.0)] * inputs}


def test_values_alike_on_the_tensor_parallel_group(one_rank):
    """What every rank of the group computes alike: plain parameters, the batch, the results of the group's
    all-reduces and deterministic ops of those; not a sharded parameter's products, nor a random draw."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DeviceMesh, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from spmd_ort.passes.expand import _alike_on_group

    group = dist.group.WORLD.group_name

    def step(w, s, x):
        h = x @ w  # plain parameter, batch
        r = funcol.all_reduce(x @ s, "sum", group)  # completed over the group
        return h.t() @ r, x @ s, torch.nn.functional.dropout(h, 0.5)

    w, s, x = torch.randn(4, 6), torch.randn(4, 3), torch.randn(8, 4)
    gm = _adopted(step, w, s, x)
    mesh = DeviceMesh("cpu", [0])
    sharded = DTensorSpec(mesh, (Shard(1),), TensorMeta(s.shape, s.stride(), s.dtype))
    ctx = PassContext(input_slots=_slots("param", "param", "batch"), output_slots=[],
                      layout=SimpleNamespace(in_specs=[None, (sharded, True)]), rank_signatures=[_traced_as(gm, 3)])
    alike = _alike_on_group(gm, ctx, group)
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    by_inputs = {tuple(a.name for a in n.all_input_nodes): n in alike for n in mms}
    assert by_inputs[("x_1", "w_1")] is True  # x @ w
    assert by_inputs[("x_1", "s_1")] is False  # x @ s, both times
    assert [n in alike for n in mms if n.all_input_nodes[1].target is ops.wait_] == [True]  # h.t() @ r
    assert not [n for n in gm.graph.nodes if ops.draws_random(n) and n in alike]


def test_a_parameter_that_differs_between_the_ranks_is_not_alike(one_rank, monkeypatch, caplog):
    """A parameter outside the plan that the ranks hold with other values (built from other seeds): eager trains each
    rank's copy on its own, so nothing computed from it is alike; a warning names it and the fix."""
    from types import SimpleNamespace

    from spmd_ort.passes import expand

    group = dist.group.WORLD.group_name
    gm = _adopted(lambda w, x: (x @ w, funcol.all_reduce(x, "sum", group)), torch.randn(4, 6), torch.randn(8, 4))
    monkeypatch.setattr(expand, "_group_ranks", lambda group: [0, 1])
    ranks = [_traced_as(gm, 2), _traced_as(gm, 2)]
    ranks[1]["state"][0] = (1.0, 1.0)  # rank 1's w
    ctx = PassContext(input_slots=_slots("param", "batch"), output_slots=[], layout=SimpleNamespace(in_specs=[]),
                      rank_signatures=ranks)
    with caplog.at_level("WARNING", logger="spmd_ort"):
        alike = expand._alike_on_group(gm, ctx, group)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert mm not in alike and mm.args[0] in alike  # x @ w: not alike; x (the batch): alike
    assert "`in0` is outside the tensor-parallel plan but differs between the ranks" in caplog.text
    assert "same seed" in caplog.text


def test_a_replicated_matmul_is_split_over_the_group(one_rank, monkeypatch):
    """Each rank computes its share of the rows and all-gathers them: rank 0's and rank 1's shares (the pass run as
    each, the gather stood in for on a one-rank group) are the product's rows, bit for bit; a matmul whose rows do not
    divide by the group, or whose contraction is shorter than SPLIT_MIN_K per skipped share, stays whole."""
    from types import SimpleNamespace

    from torch import fx

    from spmd_ort.passes import expand, split_replicated_matmuls_pass

    group = dist.group.WORLD.group_name

    def step(g, h, w, x):
        wide = g.t() @ h  # a weight gradient over 600 tokens (6 rows): split
        odd = g[:, :5].t() @ h  # 5 rows: whole
        short = x @ w  # a contraction of 4: whole
        return funcol.all_reduce(short, "sum", group) * 2, wide, odd

    g, h, w, x = torch.randn(600, 6), torch.randn(600, 3), torch.randn(4, 6), torch.randn(8, 4)
    expected = step(g, h, w, x)
    shares = []

    class Gathered(fx.Interpreter):  # the all-gather of one share as the group's: its share, repeated
        def call_function(self, target, args, kwargs):
            if target is ops.all_gather:
                shares.append(args[0].clone())
                return args[0].repeat(args[1], 1).reshape(-1)
            if target is ops.wait_ and args[0].dim() == 1:
                return args[0]
            return super().call_function(target, args, kwargs)

    for rank in (0, 1):
        monkeypatch.setattr(expand, "_rank_and_size", lambda group, r=rank: (r, 2))
        gm = _adopted(step, g, h, w, x)
        ctx = PassContext(input_slots=_slots("batch", "batch", "param", "batch"), output_slots=[],
                          layout=SimpleNamespace(in_specs=[]), check_contracts=True,
                          rank_signatures=[_traced_as(gm, 4)])
        gm = split_replicated_matmuls_pass(gm, ctx)
        monkeypatch.undo()
        gm.graph.lint()
        slices = [n.args[1:] for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor
                  and n.args[0].target is torch.ops.aten.t.default and n.args[0].args[0].name == "g_1"]
        assert slices == [(0, 3 * rank, 3 * rank + 3)], slices
        assert ctx.results.get(expand.SplitMatmuls).count == 1
        runtime = StepRuntime()
        with torch.no_grad(), runtime.active():
            got = Gathered(gm).run(g, h, w, x)
        torch.testing.assert_close(got[0], expected[0])
        assert torch.equal(got[2], expected[2])
    assert torch.equal(torch.cat(shares), expected[1])  # every element the same dot product as unsplit
