"""The first-run check of ORT segments (spmd_ort.backends.ort.verify): outputs compared as the ops define them."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.graph import checking
from spmd_ort.graph.checking import first_difference, in_defined_order, unordered_topks


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


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "scalar"])
def test_outputs_compared_piece_by_piece_decide_as_whole_tensors(monkeypatch, layout):
    """first_difference compares VERIFY_CHUNK elements at a time (bounded temporaries on logits-sized outputs):
    a difference, a one-sided NaN or a large value in any piece counts as it would in the whole tensor."""
    monkeypatch.setattr(checking, "VERIFY_CHUNK", 7)
    g = torch.Generator().manual_seed(0)

    def shaped(t):
        return t.reshape(()) if layout == "scalar" else t.reshape(6, 5).t() if layout == "transposed" else t

    n = 1 if layout == "scalar" else 30
    base = torch.randn(n, generator=g)
    assert first_difference((shaped(base.clone()),), (shaped(base),)) is None
    last = base.clone()
    last[-1] += 1.0  # in the last piece only
    assert first_difference((shaped(last),), (shaped(base),)).startswith("output 0")
    nan = base.clone()
    nan[-1] = float("nan")
    assert first_difference((shaped(nan),), (shaped(base),)) == "output 0: NaN in one and not the other"
    assert first_difference((shaped(nan),), (shaped(nan.clone()),)) is None  # NaN where both have it
    if layout != "scalar":
        # a small difference relative to a large value in another piece is within tolerance, as in the whole
        scaled, near = base.clone(), base.clone()
        scaled[0] = near[0] = 1e6
        near[-1] += 1.0
        assert first_difference((shaped(near),), (shaped(scaled),)) is None
        assert first_difference((shaped(near),), (shaped(scaled),), tolerance=1e-7) is not None


def test_fx_timing_runs_hold_one_set_of_outputs():
    """The automatic choice times a segment's fx graph several times before its ORT run: each run's outputs are
    freed before the next run computes them again (a logits-sized set held per run would add to the peak)."""
    import weakref

    from spmd_ort.backends.ort.choice import TIMED_RUNS, timed_fx_runs

    outputs: list = []
    alive_at_start: list[int] = []

    def run(x):
        alive_at_start.append(sum(ref() is not None for ref in outputs))
        out = x * 2
        outputs.append(weakref.ref(out))
        return out

    x = torch.randn(1000)
    seconds, last = timed_fx_runs(run, (x,), repeat=True)
    assert len(outputs) >= TIMED_RUNS[0] and seconds >= 0
    assert alive_at_start == [0] * len(outputs)  # no earlier run's outputs alive when a run starts
    assert torch.equal(last, x * 2) and outputs[-1]() is last
    _, once = timed_fx_runs(run, (x,), repeat=False)
    assert len(outputs) == len(alive_at_start) and torch.equal(once, x * 2)


@pytest.fixture
def tf32_settings():
    saved = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    yield
    torch.backends.cudnn.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[1])


def test_a_gpu_segment_that_may_use_tf32_is_verified_to_tf32s_precision(tf32_settings):
    """Where torch's settings let the GPU compute a float32 convolution or matmul in TensorFloat-32 (cuDNN's
    convolutions by default; matmuls at a precision below "highest"), two implementations may differ by TF32's
    rounding (found on an H200: inductor's channels-last convolution against eager's, a batch norm's running mean
    0.014% apart): the tolerance of the outputs computed from such an op is 4 TF32 ulps then.  Traced on fake CUDA tensors (no GPU needed)."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, a = (torch.empty(2, 3, 8, 8, device="cuda"), torch.empty(4, 3, 3, 3, device="cuda"),
                   torch.empty(8, 8, device="cuda"))
    conv = make_fx(lambda x, w: F.conv2d(x, w).relu().sum())(x, w)
    mm = make_fx(lambda a: (a @ a).sum())(a)
    both = make_fx(lambda x, w, a: (F.conv2d(x, w).sum(), (a * 2).sum()))(x, w, a)
    cpu_conv = make_fx(lambda x, w: F.conv2d(x, w).sum())(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))
    tf32 = checking.VERIFY_ULPS * 2.0**-10
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("highest")
    assert max(checking.verify_tolerances(conv)) == tf32 and max(checking.verify_tolerances(mm)) == checking.VERIFY_TOLERANCE
    assert max(checking.verify_tolerances(cpu_conv)) == checking.VERIFY_TOLERANCE  # the CPU has no TF32
    # only the outputs downstream of the convolution are widened (issue 42: every output of the segment was)
    assert checking.verify_tolerances(both) == (tf32, checking.VERIFY_TOLERANCE)
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("high")
    assert max(checking.verify_tolerances(conv)) == checking.VERIFY_TOLERANCE and max(checking.verify_tolerances(mm)) == tf32
