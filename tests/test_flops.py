"""The one FLOP count (spmd_ort.graph.flops): every attention kernel a trace takes is counted (causal as half), and
an op that computes without a formula is named, not counted as free (issue 55 item 2)."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from spmd_ort.graph import ops
from spmd_ort.graph.flops import ATTENTION_BACKWARD, ATTENTION_FORWARD, node_flops, unpriced

aten = torch.ops.aten
B, H, T, D = 2, 4, 128, 16


def _node(target, args, kwargs=None) -> fx.Node:
    """A call of ``target`` on meta values (placeholders carrying ``val``), as a traced graph has it."""
    graph = fx.Graph()
    nodes = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            p = graph.placeholder(f"a{i}")
            p.meta["val"] = a
            nodes.append(p)
        else:
            nodes.append(a)
    return graph.call_function(target, tuple(nodes), kwargs or {})


def _t(*shape):
    return torch.empty(shape, device="meta")


FORWARD_CALLS = {  # each kernel's arguments after (query, key, value), is_causal=True
    aten._scaled_dot_product_flash_attention_for_cpu: ((0.0, True), {}),
    aten._scaled_dot_product_flash_attention: ((0.0, True), {}),
    aten._scaled_dot_product_efficient_attention: ((None, False, 0.0, True), {}),
    aten._scaled_dot_product_cudnn_attention: ((None, False, 0.0, True), {}),
    aten._scaled_dot_product_fused_attention_overrideable: ((), {"is_causal": True}),
}


@pytest.mark.parametrize("packet", sorted(ATTENTION_FORWARD, key=str))
def test_every_attention_kernel_is_counted_and_causal_is_half(packet):
    q, k, v = _t(B, H, T, D), _t(B, H, T, D), _t(B, H, T, D)
    rest, kwargs = FORWARD_CALLS[packet]
    causal = node_flops(_node(packet.default, (q, k, v, *rest), kwargs))
    full = sdpa_flop_count(q.shape, k.shape, v.shape)
    assert full == 4 * B * H * T * T * D and causal == full // 2
    assert unpriced(_node(packet.default, (q, k, v, *rest), kwargs)) is None


def test_attention_backward_and_grouped_query_heads():
    """The CPU flash kernel's backward (what a CPU or meta trace of eager's sdpa takes), causal and not; keys and
    values with fewer heads (GQA) counted at the query's heads."""
    g, q, k, v = _t(B, H, T, D), _t(B, H, T, D), _t(B, 1, T, D), _t(B, 1, T, D)
    out, lse = _t(B, H, T, D), _t(B, H, T)
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert bwd.overloadpacket in ATTENTION_BACKWARD
    full = node_flops(_node(bwd, (g, q, k, v, out, lse, 0.0, False)))
    assert full == sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape) == 10 * B * H * T * T * D
    assert node_flops(_node(bwd, (g, q, k, v, out, lse, 0.0, True))) == full // 2


def test_what_no_formula_prices_is_named():
    """An opaque part runs the user's Python; a matmul-like op without a formula: both named by unpriced(), and an
    elementwise op (priced by its bytes) or a matmul with one is not."""
    x = _t(8, 8)
    token = _t(1)
    assert "opaque_backward" in unpriced(_node(ops.opaque_backward, (token, [x], 0)))
    assert unpriced(_node(aten.mm.default, (x, x))) is None and node_flops(_node(aten.mm.default, (x, x))) == 1024
    assert unpriced(_node(aten.add.Tensor, (x, x))) is None
    assert unpriced(_node(aten.matmul.default, (x, x))) == "aten.matmul.default"  # no formula (decomposes)


def test_torchs_grouped_mm_is_priced_as_ours():
    """``aten._grouped_mm`` (what a bf16 mixture of experts traces: transformers' ``grouped_mm`` experts) is priced by
    our grouped matmul's formula: every routed row through one (K, N) matrix. Before, its formula was called with
    tensors instead of shapes, failed, and the experts' FLOPs were left out of a bf16 plan."""
    a, b = torch.empty(64, 32, device="meta", dtype=torch.bfloat16), torch.empty(4, 32, 48, device="meta",
                                                                                dtype=torch.bfloat16)
    offs = torch.empty(4, device="meta", dtype=torch.int32)
    node = _node(aten._grouped_mm.default, (a, b, offs))
    node.meta["val"] = torch.empty(64, 48, device="meta", dtype=torch.bfloat16)
    assert node_flops(node) == 2 * 64 * 32 * 48 and unpriced(node) is None
