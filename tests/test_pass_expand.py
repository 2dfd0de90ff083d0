"""adopt_dtensor_collectives_pass: DTensor's traced ``_c10d_functional`` collectives become the step's own ops.

Graphs are traced here from functional collectives on a real one-rank gloo group (the multi-rank behaviour, against
eager DTensor tensor parallelism, is tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.passes import PassContext, adopt_dtensor_collectives_pass, count_collectives_pass
from spmd_ort.passes.expand import FUNCOL
from spmd_ort.runtime import ops
from spmd_ort.runtime.context import StepRuntime


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


def test_other_reductions_stay_as_traced(one_rank):
    group = dist.group.WORLD.group_name
    gm = _traced(lambda x: funcol.all_reduce(x, "max", group), torch.randn(3))
    gm = adopt_dtensor_collectives_pass(gm, PassContext(input_slots=[], output_slots=[]))
    assert FUNCOL.all_reduce.default in _targets(gm) and ops.all_reduce_ not in _targets(gm)
