"""remove_redundant_copies_pass on small graphs."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.passes import PassContext, op_counts, remove_redundant_copies_pass, run_passes


def _trace(fn, *args):
    return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"), tracing_mode="fake")(*args)


def test_same_layout_copy_is_removed_and_numbers_unchanged():
    def fn(a, b):
        c = a.clone()
        c.copy_(b * 2)  # functional copy of an equal-layout tensor
        return c + 1

    a, b = torch.randn(4, 3), torch.randn(4, 3)
    gm = _trace(fn, a, b)
    assert op_counts(gm)["aten.copy.default"] == 1
    expected = gm(a, b)
    ctx = PassContext(input_slots=[], output_slots=[])
    gm = run_passes(gm, ctx, [remove_redundant_copies_pass])
    gm.graph.lint()
    assert op_counts(gm)["aten.copy.default"] == 0
    torch.testing.assert_close(gm(a, b), expected)
    assert ctx.applied[0].nodes_after < ctx.applied[0].nodes_before


def test_broadcasting_or_casting_copy_is_kept():
    def fn(a, b):
        c = a.clone()
        c.copy_(b)  # b: (3,) broadcast into (4, 3), float64 -> float32
        return c

    a, b = torch.randn(4, 3), torch.randn(3, dtype=torch.float64)
    gm = _trace(fn, a, b)
    expected = gm(a, b)
    gm = remove_redundant_copies_pass(gm, PassContext(input_slots=[], output_slots=[]))
    assert op_counts(gm)["aten.copy.default"] == 1
    torch.testing.assert_close(gm(a, b), expected)
