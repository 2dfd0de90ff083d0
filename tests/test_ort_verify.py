"""The first-run check of ORT segments (spmd_ort.ort.verify): outputs compared as the ops define them."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.ort.verify import first_difference, in_defined_order, unordered_topks


def _router(scores, bias, other):
    """A MoE router as DeepSeek-V3 writes it: unsorted topk, weights gathered by its indices and normalized."""
    idx = torch.topk(scores + bias, k=3, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5
    ranked = torch.topk(other, k=2, dim=-1)[1]  # sorted (the default): its order is defined
    return idx, weights, idx.flatten(), weights.sum(dim=-1), ranked, weights * other[:, :3]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.rand(5, 8, generator=g), torch.zeros(8), torch.randn(5, 8, generator=g)


def test_outputs_in_an_unsorted_topks_order_are_found_in_the_graph():
    gm = make_fx(_router, tracing_mode="fake")(*_inputs())
    (group,) = unordered_topks(gm)
    # the indices and the weights follow the topk's order; a flattening, a reduction over the topk dim, the
    # sorted topk and a product with a tensor that varies along the topk dim are compared exactly
    assert (group.dim, group.indices, group.members) == (1, 0, (0, 1))


def _permuted(outputs, perm):
    """What ONNX Runtime may return: the same k elements per row, in another order (idx and weights alike)."""
    idx, weights, _, *rest = outputs
    return (idx.gather(1, perm), weights.gather(1, perm), idx.gather(1, perm).flatten(), *rest)


def test_same_sets_in_another_order_verify_and_other_differences_still_fail():
    gm = make_fx(_router, tracing_mode="fake")(*_inputs())
    groups = unordered_topks(gm)
    reference = gm(*_inputs())
    perm = torch.tensor([[2, 0, 1], [1, 2, 0], [0, 1, 2], [2, 1, 0], [1, 0, 2]])
    ort = _permuted(reference, perm)
    # the flattened indices (output 2) are compared exactly: their order is part of their value
    assert first_difference(in_defined_order(ort, groups), in_defined_order(reference, groups)) == \
        "output 2: integer values differ"
    ort = (*ort[:2], reference[2], *ort[3:])
    assert first_difference(ort, reference) == "output 0: integer values differ"  # compared as they come
    assert first_difference(in_defined_order(ort, groups), in_defined_order(reference, groups)) is None
    # pairs that no longer match (a weight moved without its index) are a difference
    swapped = (ort[0], ort[1][:, [1, 0, 2]], *ort[2:])
    assert first_difference(in_defined_order(swapped, groups), in_defined_order(reference, groups)).startswith(
        "output 1 (shape (5, 3))")
    # another set of experts is a difference
    other = (ort[0].clone(), *ort[1:])
    other[0][0, 0] = 7 if int(other[0][0, 0]) != 7 else 6
    assert first_difference(in_defined_order(other, groups), in_defined_order(reference, groups)) == \
        "output 0: integer values differ"
