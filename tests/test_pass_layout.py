"""pin_random_layouts_pass on small graphs: random ops draw in the layout eager's kernels give their inputs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.passes import PassContext, op_counts, pin_random_layouts_pass, run_passes
from spmd_ort.passes.layout import RandomLayouts
from spmd_ort.passes.contracts import RANDOM_LAYOUTS_PINNED
from spmd_ort.graph import ops

aten = torch.ops.aten


def _batch_norm_channels(x):  # (B, T, C) -> (B, T, C), normalised over C as BatchNorm1d does
    # eager's CPU kernel returns a contiguous (B, C, T) tensor, so the result is a transposed view; torch's fake
    # kernel keeps its input's strides, so the trace has it contiguous
    return F.batch_norm(x.transpose(1, 2), None, None, training=True).transpose(1, 2)


def dropout_after_batch_norm(x):
    """Dropout as the capture records it (spmd_ort.capture.trace._bernoulli_): a fill of ``empty_like``; returns
    the output and the mask."""
    h = _batch_norm_channels(x)
    mask = ops.bernoulli_like(torch.empty_like(h), 0.5)
    return h * mask, mask


def native_dropout_after_batch_norm(x):
    """A random op that reads its input's values, not only its layout."""
    return aten.native_dropout.default(_batch_norm_channels(x), 0.5, True)


def _trace(fn, x, mode="fake"):
    return make_fx(fn, tracing_mode=mode)(x)


def _ctx() -> PassContext:
    return PassContext(input_slots=[], output_slots=[])


class ContiguousOutputs(fx.Interpreter):
    """Runs a graph as an ORT segment returns values: every aten op's tensor result contiguous (ours, the host
    ops, keep theirs)."""

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if getattr(target, "namespace", None) == "aten" and isinstance(out, torch.Tensor):
            return out.contiguous()
        return out


def _seeded(run, x, seed=7):
    torch.manual_seed(seed)
    return run(x)


def assert_same_draws(got, expected, *, bitwise: bool):
    """The same masks, bit for bit; outputs bit for bit (eager's kernels) or to rounding (other kernels)."""
    (out, mask), (expected_out, expected_mask) = got, expected
    assert torch.equal(mask, expected_mask)
    if bitwise:
        assert torch.equal(out, expected_out)
    else:
        torch.testing.assert_close(out, expected_out)


@pytest.mark.parametrize("fn", [dropout_after_batch_norm, native_dropout_after_batch_norm])
def test_random_op_draws_eagers_values_whatever_layout_the_executor_gives(fn):
    x = torch.randn(3, 4, 6)
    gm = _trace(fn, x)
    expected = _seeded(fn, x)  # eager
    # the bug: with contiguous values (an ORT segment's outputs) the same seed draws another mask
    assert not torch.equal(_seeded(ContiguousOutputs(gm).run, x)[1], expected[1])
    ctx = _ctx()
    before = op_counts(gm)
    gm = run_passes(gm, ctx, [pin_random_layouts_pass])
    gm.graph.lint()
    assert op_counts(gm)["spmd_ort.with_layout.default"] == 1
    assert sum(op_counts(gm).values()) == sum(before.values()) + 1
    (pin,) = [n for n in gm.graph.nodes if n.target is ops.with_layout]
    assert tuple(pin.args[1]) == (0, 2, 1)  # eager's layout: C outermost after B, T innermost
    assert pin.args[2] is (fn is native_dropout_after_batch_norm)  # values copied only where they are read
    assert_same_draws(_seeded(gm, x), expected, bitwise=True)  # the fx executor: eager's kernels
    # contiguous outputs: a batch norm of a contiguous input rounds otherwise, as ORT's kernels do
    assert_same_draws(_seeded(ContiguousOutputs(gm).run, x), expected, bitwise=False)
    assert RANDOM_LAYOUTS_PINNED.check(gm, ctx) is None
    result = ctx.results.get(RandomLayouts)
    assert result.pinned == 1 and len(result.moved) == 1
    assert "eager (0, 2, 1), traced (0, 1, 2)" in result.lines()[0]


def test_unpinned_random_op_breaks_the_contract():
    gm = _trace(dropout_after_batch_norm, torch.randn(3, 4, 6))
    assert "reads `empty_like` without with_layout" in RANDOM_LAYOUTS_PINNED.check(gm, _ctx())


def test_layouts_found_at_one_size_serve_every_size():
    """Dynamic shapes: the probe runs at the sizes' hints; with_layout lays out each call's own sizes."""
    gm = _trace(dropout_after_batch_norm, torch.randn(3, 4, 6), mode="symbolic")
    unpinned = ContiguousOutputs(copy.deepcopy(gm))
    gm = run_passes(gm, _ctx(), [pin_random_layouts_pass])
    for shape in [(2, 5, 6), (4, 7, 6)]:
        x = torch.randn(shape)
        assert not torch.equal(_seeded(unpinned.run, x)[1], _seeded(dropout_after_batch_norm, x)[1])
        assert_same_draws(_seeded(ContiguousOutputs(gm).run, x), _seeded(dropout_after_batch_norm, x), bitwise=False)


def test_the_probe_draws_nothing_from_torchs_generator():
    """The probe runs the random ops before a later one (their masks set its input's layout) on a forked RNG."""
    def two_dropouts(x):
        h, first = dropout_after_batch_norm(x)
        out, second = dropout_after_batch_norm(h + 1)
        return out, torch.stack([first, second])

    x = torch.randn(3, 4, 6)
    gm = _trace(two_dropouts, x)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    gm = run_passes(gm, _ctx(), [pin_random_layouts_pass])
    assert torch.equal(torch.get_rng_state(), state)
    assert op_counts(gm)["spmd_ort.with_layout.default"] == 2
    assert_same_draws(_seeded(ContiguousOutputs(gm).run, x), _seeded(two_dropouts, x), bitwise=False)


def test_layout_eager_already_traced_is_pinned_and_costs_nothing_on_fx():
    """Dropout of a plain activation: the trace's layout is eager's; with_layout returns its input as it is."""
    def fn(x):
        h = torch.tanh(x)
        mask = ops.bernoulli_like(torch.empty_like(h), 0.5)
        return h * mask, mask

    x = torch.randn(3, 4)
    ctx = _ctx()
    gm = run_passes(_trace(fn, x), ctx, [pin_random_layouts_pass])
    assert ctx.results.get(RandomLayouts) == RandomLayouts(pinned=1)
    assert ctx.results.get(RandomLayouts).lines() == []
    y = torch.empty(3, 4)
    assert ops.with_layout(y, [0, 1], False) is y
    assert_same_draws(_seeded(gm, x), _seeded(fn, x), bitwise=True)


def test_a_graph_without_random_ops_is_left_alone():
    gm = _trace(lambda x: torch.tanh(x).transpose(0, 1), torch.randn(3, 4))
    before = gm.code
    ctx = _ctx()
    gm = run_passes(gm, ctx, [pin_random_layouts_pass])
    assert gm.code == before and ctx.results.get(RandomLayouts) is None


def test_an_input_the_probe_cannot_make_keeps_the_executors_layout_and_says_so(caplog):
    """A data-dependent size has no hint to make zeros of: that random op is marked, logged and listed."""
    def fn(x):
        kept = x[x > 0]  # data-dependent length
        return torch.rand_like(kept)

    gm = _trace(fn, torch.randn(8), mode="symbolic")
    ctx = _ctx()
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        gm = run_passes(gm, ctx, [pin_random_layouts_pass])
    assert op_counts(gm)["spmd_ort.with_layout.default"] == 0
    (rand,) = [n for n in gm.graph.nodes if n.target is aten.rand_like.default]
    assert rand.meta["eager_layout_unknown"]
    assert RANDOM_LAYOUTS_PINNED.check(gm, ctx) is None
    assert "rand_like.default of" in ctx.results.get(RandomLayouts).lines()[1]
    assert "eager's memory layout of the input of rand_like.default" in caplog.text
