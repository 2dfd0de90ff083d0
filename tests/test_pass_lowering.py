"""lower_to_onnx_ops_pass on small graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.backends.ort import coverage, decompose
from spmd_ort.backends.ort.partition import why_host
from spmd_ort.passes import PassContext, lower_to_onnx_ops_pass, op_counts, run_passes
from spmd_ort.passes.lowering import Lowering


def _step(x, w, y):
    logits = torch.tanh(x @ w)
    loss = F.cross_entropy(logits, y)  # nll_loss_forward: torchlib's translation is wrong (a FIX)
    (grad,) = torch.autograd.grad(loss, w)  # tanh_backward, nll_loss_backward: no translation
    return loss, grad, torch.cummax(logits, 1).values  # cummax: no translation, no decomposition


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g, requires_grad=True), \
        torch.randint(0, 4, (6,), generator=g)


def test_ops_without_translation_carry_their_decomposition_and_numbers_unchanged():
    """The pass marks; the graph keeps its ops (torch runs them); expand() gives what ONNX translates:
    every op there translates directly, and it computes the same numbers."""
    x, w, y = _inputs()
    gm = make_fx(_step, tracing_mode="fake")(x, w, y)
    before = op_counts(gm)
    assert before["aten.tanh_backward.default"] == before["aten.nll_loss_backward.default"] == 1
    assert before["aten.nll_loss_forward.default"] == 1
    expected = gm(x, w.detach(), y)
    code = gm.code
    ctx = PassContext(input_slots=[None] * 3, output_slots=[None] * 3, check_contracts=True)
    gm = run_passes(gm, ctx, [lower_to_onnx_ops_pass])
    assert gm.code == code  # the op stays: where the graph runs in torch, torch's kernel runs
    marked = {str(n.target) for n in gm.graph.nodes if decompose.DECOMPOSITION in n.meta}
    assert marked == {"aten.tanh_backward.default", "aten.nll_loss_backward.default",
                      "aten.nll_loss_forward.default"}
    assert ctx.results.get(Lowering).lowered == {"aten.nll_loss_backward.default": 1,
                                                 "aten.nll_loss_forward.default": 1,
                                                 "aten.tanh_backward.default": 1}
    onnx_view = decompose.expand(gm)
    onnx_view.graph.lint()
    after = op_counts(onnx_view)
    for op in marked:
        assert after[op] == 0, op
    assert after["aten._log_softmax_backward_data.default"] == 1  # ours: translated, not lowered
    assert after["aten.cummax.default"] == 1  # nothing to lower it to: stays (on the host)
    for node in onnx_view.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "aten":
            assert "val" in node.meta
            if node.target is not torch.ops.aten.cummax.default:
                assert coverage.why_untranslatable(node) is None, node.format_node()
    for a, b in zip(onnx_view(x, w.detach(), y), expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert len(onnx_view.graph.nodes) > len(gm.graph.nodes)
    assert decompose.expand(gm) is not gm and gm.code == code  # expand works on a copy


def test_a_marked_op_runs_in_ort_only_when_its_whole_decomposition_does():
    x, w, y = _inputs()
    gm = make_fx(_step, tracing_mode="fake")(x, w, y)
    run_passes(gm, PassContext(input_slots=[None] * 3, output_slots=[None] * 3), [lower_to_onnx_ops_pass])
    for node in gm.graph.nodes:
        if decompose.DECOMPOSITION in node.meta:
            assert why_host(node) is None, node.format_node()
    cummax = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cummax.default)
    assert "no ONNX translation and no torch decomposition" in why_host(cummax)


def test_graph_without_untranslatable_ops_is_unchanged():
    gm = make_fx(lambda a, b: torch.relu(a @ b).sum(), tracing_mode="fake")(torch.randn(3, 4), torch.randn(4, 2))
    code = gm.code
    ctx = PassContext(input_slots=[None] * 2, output_slots=[None], check_contracts=True)
    gm = run_passes(gm, ctx, [lower_to_onnx_ops_pass])
    assert gm.code == code and ctx.results.get(Lowering).lowered == {}


def test_a_placeholder_carrying_a_mark_is_not_expanded():
    """The partitioner copies a value's meta onto the segment placeholder that receives it, mark included: only
    ops are expanded (a placeholder has nothing to replace; found by the dropout parity test on ORT)."""
    x, w, y = _inputs()
    gm = make_fx(_step, tracing_mode="fake")(x, w, y)
    run_passes(gm, PassContext(input_slots=[None] * 3, output_slots=[None] * 3), [lower_to_onnx_ops_pass])
    marked = next(n for n in gm.graph.nodes if decompose.DECOMPOSITION in n.meta)
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    first.meta[decompose.DECOMPOSITION] = marked.meta[decompose.DECOMPOSITION]
    expected = gm(x, w.detach(), y)
    for a, b in zip(decompose.expand(gm)(x, w.detach(), y), expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_unstable_sorts_become_stable_ones_the_order_onnx_runtime_gives():
    """torch's unstable sort leaves equal keys in an unspecified order (its CPU kernel does not keep theirs); ORT's
    TopK keeps input order.  The pass makes every sort stable, keeping its dim and direction, so that torch
    computes the order ORT does; a sort already stable stays as it is."""
    def fn(keys, x):
        ascending = torch.sort(keys)  # aten.sort.default
        descending = torch.sort(keys, dim=0, descending=True, stable=False)  # aten.sort.stable, stable=False
        kept = torch.sort(x, stable=True)
        return ascending.indices, descending.indices, kept.values, x[ascending.indices]

    keys = torch.randint(0, 4, (256,), generator=torch.Generator().manual_seed(0))
    x = torch.randn(256)
    gm = make_fx(fn, tracing_mode="fake")(keys, x)
    ctx = PassContext(input_slots=[None] * 2, output_slots=[None] * 4, check_contracts=True)
    gm = run_passes(gm, ctx, [lower_to_onnx_ops_pass])
    sorts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.ops.aten.sort.default,
                                                                                    torch.ops.aten.sort.stable)]
    assert [n.target for n in sorts] == [torch.ops.aten.sort.stable] * 3
    assert [n.kwargs for n in sorts[:2]] == [{"stable": True}, {"dim": 0, "descending": True, "stable": True}]
    assert ctx.results.get(Lowering).stable_sorts == 2
    assert any("sorts made stable" in line for line in ctx.results.get(Lowering).lines())
    got = gm(keys, x)
    want = (torch.sort(keys, stable=True).indices, torch.sort(keys, descending=True, stable=True).indices,
            torch.sort(x).values)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(torch.sort(keys).indices, want[0])  # what the graph computed before: another order
