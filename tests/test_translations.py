"""Each of our own ONNX translations (spmd_ort.backends.ort.translations) against torch's kernel, op by op.

A one-op graph is traced, translated, run in ONNX Runtime and compared with the op itself, over the
argument variants the translation distinguishes (strides, padding, groups, masks, output masks, ...).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import assert_close_relmax
from spmd_ort.backends.ort import coverage
from spmd_ort.backends.ort.export import translate
from spmd_ort.graph.symbolic import fake_inputs
from spmd_ort.backends.ort.session import OrtSegment, is_symbolic
from spmd_ort.backends.ort.translations import TRANSLATIONS
from spmd_ort.graph import ops

aten = torch.ops.aten
G = torch.Generator().manual_seed(0)


def _randn(*shape):
    return torch.randn(*shape, generator=G)


def _check(op, args: tuple, kwargs: dict | None = None, outputs: tuple[int, ...] | None = None,
           resized: tuple[tuple, dict] | None = None) -> None:
    """``op(*args, **kwargs)`` in ORT (through our translation) equals torch's, output by output.

    ``resized``: the same ``(args, kwargs)`` at other sizes.  Then the dims whose sizes differ are symbolic
    (dynamic shapes), and one ONNX model runs both sets of arguments.
    """
    kwargs = kwargs or {}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def call(*tensors):
        new = list(leaves)
        for i, t in zip(positions, tensors):
            new[i] = t
        a, kw = pytree.tree_unflatten(new, spec)
        out = op(*a, **kw)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    tensors = [leaves[i] for i in positions]
    expected = call(*tensors)
    keep = outputs if outputs is not None else range(len(expected))
    cases = [(tensors, expected)]
    if resized is None:
        gm = make_fx(lambda *ts: tuple(call(*ts)[i] for i in keep), tracing_mode="fake")(*tensors)
    else:
        others = [x for x in pytree.tree_leaves(resized) if isinstance(x, torch.Tensor)]
        dims = [frozenset(d for d in range(t.dim()) if t.shape[d] != o.shape[d]) for t, o in zip(tensors, others)]
        assert any(dims), "resized changes no size"
        _, _, fakes = fake_inputs([], tensors, dims, [f"arg{i}" for i in range(len(tensors))])
        gm = make_fx(lambda *ts: tuple(call(*ts)[i] for i in keep), tracing_mode="symbolic",
                     _allow_non_fake_inputs=True)(*fakes)
        assert is_symbolic(gm), gm.code
        cases.append((others, call(*others)))
    assert any(n.target is op for n in gm.graph.nodes), gm.code  # the op itself, not a decomposition
    node = next(n for n in gm.graph.nodes if n.target is op)
    assert coverage.why_untranslatable(node) is None
    segment = OrtSegment("probe", gm, translate(gm), threads=1, allow_spinning=False)
    for inputs, want in cases:
        got = segment.run_ort(*inputs)
        got = got if isinstance(got, tuple) else (got,)
        for k, (i, g) in enumerate(zip(keep, got)):
            assert_close_relmax(g, want[i], rtol=2e-5, msg=f"{op} output {i} at {[tuple(t.shape) for t in inputs]}")


def test_every_translation_is_in_the_registry_and_has_a_reason():
    reg = coverage.registry()
    for op, translation in TRANSLATIONS.items():
        assert reg.get_decomps(op)[0].onnx_function is translation.function, op
        assert translation.why


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_activation_backwards(approximate):
    x, g = _randn(4, 7), _randn(4, 7)
    _check(aten.silu_backward.default, (g, x))
    _check(aten.gelu_backward.default, (g, x), {"approximate": approximate})


def test_elu_is_exact_near_zero():
    """ONNX's Elu computes exp(x) - 1 (1.6% off at x = -1.8e-6 in onnxruntime 1.32); ours keeps every value
    to fp32 rounding, elementwise, from -1e-7 to -20, and the other parameters (alpha, scale, input_scale)."""
    x = torch.cat([-torch.logspace(-7, 1.3, 64), torch.logspace(-7, 1, 16)])
    for alpha, scale, input_scale in ((1.0, 1.0, 1.0), (1.6732632, 1.0507010, 1.0), (0.5, 2.0, 3.0)):
        op = aten.elu.default
        gm = make_fx(lambda t: op(t, alpha, scale, input_scale), tracing_mode="fake")(x)
        got = OrtSegment("probe", gm, translate(gm), threads=1, allow_spinning=False).run_ort(x)
        want = op(x.double(), alpha, scale, input_scale)
        rel = ((got.double() - want).abs() / want.abs()).max().item()
        assert rel < 1e-6, (alpha, scale, input_scale, rel)


@pytest.mark.parametrize("dim", [-1, 0])
def test_softmax_backwards(dim):
    x, g = _randn(3, 5, 6), _randn(3, 5, 6)
    _check(aten._softmax_backward_data.default, (g, torch.softmax(x, dim), dim, torch.float32))
    _check(aten._log_softmax_backward_data.default, (g, torch.log_softmax(x, dim), dim, torch.float32))


@pytest.mark.parametrize("padding_idx,scale", [(-1, False), (3, False), (-1, True)])
def test_embedding_dense_backward(padding_idx, scale):
    idx = torch.randint(0, 9, (4, 6), generator=G)
    idx[0, :3] = 3  # repeats (and the padding index)
    _check(aten.embedding_dense_backward.default, (_randn(4, 6, 5), idx, 9, padding_idx, scale))


def test_embedding_dense_backward_sums_repeated_tokens_alike_on_every_run_with_threads():
    """ORT's CPU ScatterND(add) races when its threads split the updates (6 runs in 200 wrong with 2 threads, a
    1024-token batch): the translation is a ScatterElements, and 200 runs on 2 threads all equal torch."""
    idx = torch.randint(0, 1024, (8, 128), generator=G)
    idx[:, :16] = 7  # a token seen 128 times
    grad = _randn(8, 128, 256)
    args = (grad, idx, 1024, -1, False)
    want = aten.embedding_dense_backward.default(*args)
    gm = make_fx(lambda g, i: aten.embedding_dense_backward.default(g, i, 1024, -1, False), tracing_mode="fake")(
        grad, idx)
    segment = OrtSegment("probe", gm, translate(gm), threads=2, allow_spinning=False)
    wrong = sum(not torch.allclose(segment.run_ort(grad, idx), want, rtol=1e-5, atol=1e-5) for _ in range(200))
    assert wrong == 0, f"{wrong} of 200 runs summed differently"


def test_the_export_never_evaluates_a_weight_sized_constant(monkeypatch):
    """The embedding gradient's zeros (vocabulary x width) have constant inputs: onnxscript's folder computed
    them in numpy before its size limit dropped the result (Llama-3-8B: 2 GiB, twice, in each export). No node
    whose output exceeds the fold limit is evaluated; the model still runs and equals torch."""
    from onnxscript.optimizer import _constant_folding

    from spmd_ort.backends.ort.export import FOLD_LIMIT

    evaluated = []
    real = _constant_folding._reference_evaluator.evaluate

    def evaluate(domain, op_type, version, *args, **kwargs):
        out = real(domain, op_type, version, *args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        evaluated.append((op_type, max((o.size for o in outs if hasattr(o, "size")), default=0)))
        return out

    monkeypatch.setattr(_constant_folding._reference_evaluator, "evaluate", evaluate)
    vocab, width = 65536, 16  # 4x the limit
    idx = torch.randint(0, vocab, (2, 8), generator=G)
    grad = _randn(2, 8, width)
    gm = make_fx(lambda g, i: aten.embedding_dense_backward.default(g * 2, i, vocab, -1, False),
                 tracing_mode="fake")(grad, idx)
    segment = OrtSegment("probe", gm, translate(gm), threads=1, allow_spinning=False)
    assert evaluated, "nothing was folded (the probe sees no evaluation, or the folder did not run)"
    assert max(size for _, size in evaluated) <= FOLD_LIMIT, evaluated
    assert torch.equal(segment.run_ort(grad, idx), aten.embedding_dense_backward.default(grad * 2, idx, vocab, -1, False))


@pytest.mark.parametrize("dim,start,end,step", [(3, 64, 2**63 - 1, 1), (3, 0, 64, 1), (1, -3, 2**63 - 1, 1),
                                                 (2, 1, 5, 1), (2, 1, 7, 2), (0, -9, 1, 1), (2, 9, 12, 1)])
def test_slice_backward_pads_the_gradient_with_zeros(dim, start, end, step):
    """A slice's gradient (rotary embedding's halves) is one Pad: no zero tensor of the input's size from
    constant inputs, which ONNX Runtime would fold into an initializer in every session. Other steps keep
    torch's decomposition. Every case equals torch."""
    import onnx

    from spmd_ort.backends.ort import decompose

    sizes = [2, 5, 7, 128]
    x = _randn(*sizes)
    grad = _randn(*aten.slice.Tensor(x, dim, start, end, step).shape)
    fn = lambda g: aten.slice_backward.default(g, sizes, dim, start, end, step)  # noqa: E731
    gm = make_fx(fn, tracing_mode="fake")(grad)
    decompose.annotate(gm)
    data = translate(gm)
    kinds = {n.op_type for n in onnx.load_from_string(data).graph.node}
    if step == 1:
        assert "Pad" in kinds and "ScatterND" not in kinds and "ConstantOfShape" not in kinds, kinds
    segment = OrtSegment("probe", gm, data, threads=1, allow_spinning=False)
    assert torch.equal(segment.run_ort(grad), fn(grad))


def test_index_put_with_accumulate_stays_in_torch_on_cpu():
    """torchlib translates index_put(accumulate=True) as a ScatterND(add), which races on ORT's CPU provider."""
    from spmd_ort.backends.ort.partition import why_host

    def f(x, i, v):
        return aten.index_put.default(x, [i], v, True), aten.index_put.default(x, [i], v, False)

    gm = make_fx(f, tracing_mode="fake")(_randn(9, 4), torch.tensor([1, 1, 2]), _randn(3, 4))
    accumulate, assign = [n for n in gm.graph.nodes if n.target is aten.index_put.default]
    assert "sums repeated indices wrongly" in why_host(accumulate)
    assert why_host(assign) is None


@pytest.mark.parametrize("affine,mask", [(True, [True, True, True]), (False, [True, False, False]),
                                         (True, [False, True, False])])
def test_native_layer_norm_backward(affine, mask):
    x = _randn(3, 4, 8)
    w, b = (_randn(8), _randn(8)) if affine else (None, None)
    _, mean, rstd = aten.native_layer_norm.default(x, [8], w, b, 1e-5)
    outputs = tuple(i for i, m in enumerate(mask) if m and (i == 0 or affine))
    _check(aten.native_layer_norm_backward.default, (_randn(3, 4, 8), x, [8], mean, rstd, w, b, mask),
           outputs=outputs)


@pytest.mark.parametrize("train", [True, False])
def test_native_batch_norm_backward(train):
    x, w = _randn(4, 3, 5, 5), _randn(3)
    rm, rv = _randn(3), torch.rand(3, generator=G) + 0.5
    _, save_mean, save_invstd = aten.native_batch_norm.default(x, w, None, rm.clone(), rv.clone(), True, 0.1, 1e-5)
    _check(aten.native_batch_norm_backward.default,
           (_randn(4, 3, 5, 5), x, w, rm, rv, save_mean, save_invstd, train, 1e-5, [True, True, True]))


@pytest.mark.parametrize("dim,correction,keepdim", [([0, 2, 3], 0, False), ([1], 1, True), (None, 1, False)])
def test_var_mean_and_squeeze(dim, correction, keepdim):
    _check(aten.var_mean.correction, (_randn(4, 3, 5, 2),), {"dim": dim, "correction": correction, "keepdim": keepdim})
    _check(aten.squeeze.dims, (_randn(4, 1, 5, 1),), {"dim": [1, 2, -1]})


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_pooling_backwards(kernel, stride, padding):
    x = _randn(2, 3, 9, 9)
    out, idx = aten.max_pool2d_with_indices.default(x, [kernel], [stride], [padding])
    g = _randn(*out.shape)
    _check(aten.max_pool2d_with_indices_backward.default, (g, x, [kernel], [stride], [padding], [1], False, idx))
    for include_pad in (True, False):
        _check(aten.avg_pool2d_backward.default, (g, x, [kernel], [stride], [padding], False, include_pad, None))
    x3 = _randn(3, 9, 9)  # unbatched
    g3 = _randn(*F.avg_pool2d(x3, kernel, stride, padding).shape)
    _check(aten.avg_pool2d_backward.default, (g3, x3, [kernel], [stride], [padding], False, True, None))


@pytest.mark.parametrize("exponent", [2, 2.0, 3, 0.5, -0.5, -1, -2.0, 1, 0, 1.7, -3])
def test_pow_with_a_scalar_exponent(exponent):
    """The exponents torch's CPU kernel special-cases (products, square roots, reciprocals) and the rest (Pow),
    negative bases and zeros included; an integer base goes to torchlib's translation."""
    x = _randn(4, 5)
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-30] if exponent >= 0 else [-0.5, 2.0, 1e-3])  # no infinities
    _check(aten.pow.Tensor_Scalar, (x.abs() if exponent in (0.5, -0.5, 1.7) else x, exponent))
    if isinstance(exponent, int) and exponent >= 0:
        _check(aten.pow.Tensor_Scalar, (torch.randint(-3, 4, (4, 5), generator=G), exponent))


def test_grouped_mm_one_matmul_per_group():
    """``spmd_ort::grouped_mm`` (an MoE's experts) in ORT: 2-D @ 3-D (forward, input gradient; an output width
    eager's kernel pads to 16 bytes) and 2-D @ 2-D (weight gradient, groups along the contraction dim; an empty
    group is zeros), groups read from ``offs`` at run time, a batched 3-D @ 3-D, and a dynamic number of rows;
    3-D @ 2-D is declined."""
    offs = torch.tensor([7, 7, 30, 40], dtype=torch.int32)  # group 1 is empty
    x, w, g = _randn(40, 16), _randn(4, 16, 24), _randn(40, 24)
    _check(ops.grouped_mm, (x, w, offs))
    _check(ops.grouped_mm, (x, _randn(4, 6, 16).transpose(-2, -1), offs))  # transposed weights, 6 columns
    grad_w = ops.grouped_mm(x.t(), g, offs)
    assert torch.equal(grad_w[1], torch.zeros(16, 24))  # torch's kernel: zeros for the empty group
    _check(ops.grouped_mm, (x.t(), g, offs))
    _check(ops.grouped_mm, (_randn(4, 8, 16), w))
    _check(ops.grouped_mm, (x, w, offs), resized=((_randn(56, 16), w, torch.tensor([20, 21, 21, 56],
                                                                                     dtype=torch.int32)), {}))
    gm = make_fx(lambda a, b, o: ops.grouped_mm(a, b, o), tracing_mode="fake")(_randn(2, 8, 4), _randn(4, 8), offs[:2])
    node = next(n for n in gm.graph.nodes if n.target is ops.grouped_mm)
    assert "2-D @ 3-D and 2-D @ 2-D" in coverage.why_untranslatable(node)


def test_grouped_mm_traces_what_eagers_kernel_returns_and_rejects():
    """The fake kernel gives eager's output layout (rows padded to 16 bytes: (8, 6) float32 has strides (8, 1)),
    so a view traced after it fits; and it rejects what eager's kernel rejects (int64 offs, float64, a bias)."""
    a, b = _randn(8, 4), _randn(2, 6, 4).transpose(-2, -1)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    eager = torch._grouped_mm(a, b, offs=offs)
    gm = make_fx(lambda a, b, o: ops.grouped_mm(a, b, o), tracing_mode="fake")(a, b, offs)
    traced = next(n for n in gm.graph.nodes if n.target is ops.grouped_mm).meta["val"]
    assert traced.shape == eager.shape and traced.stride() == eager.stride() == (8, 1)
    for args, message in [((a, b, offs.long()), "int32"), ((a.double(), b.double(), offs), "(?i)float32, (bfloat16 or )?float16"),
                          ((a, b, offs, _randn(2, 6)), "(?i)bias")]:
        with pytest.raises(RuntimeError, match=message):
            torch._grouped_mm(*args[:2], offs=args[2], bias=args[3] if len(args) > 3 else None)  # eager
        with pytest.raises(RuntimeError, match=message):
            make_fx(lambda *t: ops.grouped_mm(*t), tracing_mode="fake")(*args)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
@pytest.mark.parametrize("dim,descending", [(-1, False), (0, True), (1, False)])
def test_a_stable_sort_gives_torchs_order_of_equal_values(dtype, dim, descending):
    """Many equal keys (an MoE's expert ids): ORT's TopK keeps them in input order, as torch's stable sort does,
    ascending and descending, along any dim, values and indices alike."""
    keys = torch.randint(0, 4, (64, 48), generator=G).to(dtype)
    _check(aten.sort.stable, (keys,), {"stable": True, "dim": dim, "descending": descending})
    unstable = torch.sort(keys, dim=dim, descending=descending).indices  # torch's own unspecified order
    assert not torch.equal(unstable, torch.sort(keys, dim=dim, descending=descending, stable=True).indices)
    bools = make_fx(lambda k: aten.sort.stable(k, stable=True), tracing_mode="fake")(keys > 1)
    node = next(n for n in bools.graph.nodes if n.target is aten.sort.stable)
    assert "sort of torch.bool is not translated" in coverage.why_untranslatable(node)


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil", [
    (2, 2, 0, 1, False), (3, 2, 1, 1, False), (3, 1, 1, 1, False), (3, 2, 1, 2, True), ([3, 2], [2, 1], [1, 0], 1, True)])
def test_max_pool_forward_gives_torch_indices(kernel, stride, padding, dilation, ceil):
    """Values and torch's per-plane indices (ONNX's are flat over the whole tensor), batched and not;
    ties (a ReLU's zeros) pick the window's first maximum, as torch does."""
    as_list = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
    args = (as_list(kernel), as_list(stride), as_list(padding), as_list(dilation), ceil)
    for x in (_randn(2, 3, 9, 8), F.relu(_randn(2, 3, 9, 8)), _randn(3, 7, 9)):
        _check(aten.max_pool2d_with_indices.default, (x, *args))
    _check(aten.max_pool2d_with_indices.default, (_randn(2, 3, 9, 9), *args),
           resized=((_randn(3, 2, 11, 10), *args), {}))


CONVS = {  # name: (input shape, weight shape, stride, padding, dilation, groups)
    "2d": ((2, 4, 9, 9), (6, 4, 3, 3), [2], [1], [1], 1),
    "2d-groups-dilation": ((2, 4, 8, 8), (6, 2, 3, 3), [1], [2], [2], 2),
    "2d-depthwise-odd": ((1, 3, 7, 6), (3, 1, 2, 3), [2, 1], [0, 1], [1], 3),
    "1d": ((2, 3, 11), (5, 3, 4), [3], [2], [1], 1),
}


@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("mask", [[True, True, True], [False, True, False]])
def test_convolution_backward(name, mask):
    shape, wshape, stride, padding, dilation, groups = CONVS[name]
    x, w = _randn(*shape), _randn(*wshape)
    out = aten.convolution.default(x, w, None, stride, padding, dilation, False, [0], groups)
    outputs = tuple(i for i, m in enumerate(mask) if m)
    _check(aten.convolution_backward.default,
           (_randn(*out.shape), x, w, [wshape[0]], stride, padding, dilation, False, [0], groups, mask),
           outputs=outputs)


ATTENTION = {  # name: (kv heads, causal, mask kind, scale)
    "causal": (4, True, None, None),
    "padding-mask": (4, False, "padding", None),
    "float-mask-scale": (4, False, "float", 0.3),
    "gqa-causal": (2, True, None, None),
}


@pytest.mark.parametrize("name", list(ATTENTION))
def test_flash_attention_forward_and_backward(name):
    kv_heads, causal, mask_kind, scale = ATTENTION[name]
    q, k, v = _randn(2, 4, 6, 8), _randn(2, kv_heads, 6, 8), _randn(2, kv_heads, 6, 8)
    mask = None
    if mask_kind == "padding":  # additive, as F.scaled_dot_product_attention hands a boolean mask to the kernel
        mask = torch.zeros(2, 1, 6, 6)
        mask[1, :, :, 4:] = float("-inf")  # padded keys
    elif mask_kind == "float":
        mask = _randn(2, 1, 6, 6)
    kwargs = {"attn_mask": mask, "scale": scale}
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    _check(fwd, (q, k, v, 0.0, causal), kwargs)
    out, lse = fwd(q, k, v, 0.0, causal, **kwargs)
    _check(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
           (_randn(*out.shape), q, k, v, out, lse, 0.0, causal), kwargs)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_flash_attention_with_dynamic_batch_and_length(name):
    """Symbolic batch and sequence length: one model runs (2, L=6) and (3, L=9), causal mask and GQA included."""
    kv_heads, causal, mask_kind, scale = ATTENTION[name]

    def args(b, n):
        q, k, v = _randn(b, 4, n, 8), _randn(b, kv_heads, n, 8), _randn(b, kv_heads, n, 8)
        mask = {"padding": torch.zeros(b, 1, n, n), "float": _randn(b, 1, n, n)}.get(mask_kind)
        return q, k, v, mask

    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    (q, k, v, mask), (q2, k2, v2, mask2) = args(2, 6), args(3, 9)
    kw, kw2 = {"attn_mask": mask, "scale": scale}, {"attn_mask": mask2, "scale": scale}
    _check(fwd, (q, k, v, 0.0, causal), kw, resized=((q2, k2, v2, 0.0, causal), kw2))
    (out, lse), (out2, lse2) = fwd(q, k, v, 0.0, causal, **kw), fwd(q2, k2, v2, 0.0, causal, **kw2)
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    _check(bwd, (_randn(*out.shape), q, k, v, out, lse, 0.0, causal), kw,
           resized=((_randn(*out2.shape), q2, k2, v2, out2, lse2, 0.0, causal), kw2))


def test_normalization_and_embedding_with_dynamic_sizes():
    """The translations that count elements or build shapes, at two sizes of one symbolic model."""
    _check(aten.var_mean.correction, (_randn(4, 3, 5),), {"dim": [0, 2], "correction": 1},
           resized=((_randn(6, 3, 7),), {"dim": [0, 2], "correction": 1}))
    x, x2 = _randn(3, 4, 8), _randn(5, 7, 8)
    w, b = _randn(8), _randn(8)
    (_, mean, rstd), (_, mean2, rstd2) = (aten.native_layer_norm.default(t, [8], w, b, 1e-5) for t in (x, x2))
    mask = [True, True, True]
    _check(aten.native_layer_norm_backward.default, (_randn(3, 4, 8), x, [8], mean, rstd, w, b, mask),
           resized=((_randn(5, 7, 8), x2, [8], mean2, rstd2, w, b, mask), {}))
    xb, xb2, wb, rm, rv = _randn(4, 3, 5), _randn(6, 3, 9), _randn(3), _randn(3), torch.rand(3, generator=G) + 0.5
    stats = [aten.native_batch_norm.default(t, wb, None, rm.clone(), rv.clone(), True, 0.1, 1e-5)[1:]
             for t in (xb, xb2)]
    _check(aten.native_batch_norm_backward.default,
           (_randn(4, 3, 5), xb, wb, rm, rv, *stats[0], True, 1e-5, mask),
           resized=((_randn(6, 3, 9), xb2, wb, rm, rv, *stats[1], True, 1e-5, mask), {}))
    idx, idx2 = torch.randint(0, 9, (4, 6), generator=G), torch.randint(0, 9, (2, 11), generator=G)
    _check(aten.embedding_dense_backward.default, (_randn(4, 6, 5), idx, 9, -1, False),
           resized=((_randn(2, 11, 5), idx2, 9, -1, False), {}))


@pytest.mark.parametrize("name", list(CONVS))
def test_convolution_backward_with_dynamic_batch_and_image_size(name):
    """Batch and spatial sizes symbolic: one model runs two sizes (the input gradient is computed without
    cropping its end padding and fitted to the input's sizes at run time)."""
    shape, wshape, stride, padding, dilation, groups = CONVS[name]
    w = _randn(*wshape)
    mask = [True, True, True]

    def args(n, grow):
        x = _randn(n, shape[1], *[d + grow for d in shape[2:]])
        out = aten.convolution.default(x, w, None, stride, padding, dilation, False, [0], groups)
        return (_randn(*out.shape), x, w, [wshape[0]], stride, padding, dilation, False, [0], groups, mask)

    _check(aten.convolution_backward.default, args(shape[0] + 1, 0), resized=(args(shape[0] + 2, 3), {}))


def test_pooling_backwards_with_dynamic_image_size():
    def max_args(hw):
        x = _randn(2, 3, hw, hw)
        out, idx = aten.max_pool2d_with_indices.default(x, [3], [2], [1])
        return (_randn(*out.shape), x, [3], [2], [1], [1], False, idx)

    def avg_args(hw, include_pad):
        x = _randn(2, 3, hw, hw)
        g = _randn(*F.avg_pool2d(x, 3, 2, 1).shape)
        return (g, x, [3], [2], [1], False, include_pad, None)

    _check(aten.max_pool2d_with_indices_backward.default, max_args(9), resized=(max_args(12), {}))
    for include_pad in (True, False):
        _check(aten.avg_pool2d_backward.default, avg_args(9, include_pad), resized=(avg_args(12, include_pad), {}))


def test_declined_arguments_stay_untranslated_with_a_reason():
    """Where our translation declines a node's arguments, the predicate says why and the op is not lowered."""
    def node_of(fn, *args):
        gm = make_fx(fn, tracing_mode="fake")(*args)
        return next(n for n in gm.graph.nodes if n.op == "call_function")

    x, w = _randn(1, 4, 5, 5), _randn(4, 2, 3, 3)
    conv_t = node_of(lambda g, x, w: aten.convolution_backward.default(
        g, x, w, None, [1], [0], [1], True, [0], 1, [True, True, False]), _randn(1, 2, 7, 7), x, w)
    assert "transposed convolution" in coverage.why_untranslatable(conv_t)
    assert coverage.decomposition_for(conv_t) is None
    pool = node_of(lambda g, x: aten.avg_pool2d_backward.default(g, x, [2], [2], [0], True, True, None),
                   _randn(1, 4, 3, 3), x)
    assert "ceil_mode" in coverage.why_untranslatable(pool)


def test_mixed_dtypes_are_promoted_explicitly():
    """aten ops promote mixed dtypes implicitly, ONNX ops do not: the translation inserts the casts."""
    x, i = _randn(4, 5), torch.randint(-3, 3, (4, 5), generator=G)

    def fn(x, i):
        return x + i, i * 0.5, (x > 0) * x, torch.where(i > 0, x, 1)

    gm = make_fx(fn, tracing_mode="fake")(x, i)
    got = OrtSegment("probe", gm, translate(gm), threads=1, allow_spinning=False).run_ort(x, i)
    for g, e in zip(got, fn(x, i)):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_split_by_a_size_known_at_run_time_exports_one_model(caplog):
    """onnxscript's constant folder fails on a SplitToSequence whose size is not a constant (sequence parallel's
    shards of a symbolic length); the folding stops there and the model is exported as it is, one for every size."""
    def halves(x):
        return tuple(aten.split.Tensor(x, x.shape[1] // 2, 1))

    _, _, fakes = fake_inputs([], [_randn(2, 8)], [frozenset({0, 1})], ["x"])
    gm = make_fx(halves, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*fakes)
    assert is_symbolic(gm) and any(n.target is aten.split.Tensor for n in gm.graph.nodes), gm.code
    with caplog.at_level("INFO", logger="spmd_ort"):
        segment = OrtSegment("probe", gm, translate(gm), threads=1, allow_spinning=False)
    assert "constant folding stopped early" in caplog.text  # said, not silent
    for x in (_randn(2, 8), _randn(3, 12)):
        for got, want in zip(segment.run_ort(x), halves(x), strict=True):
            assert torch.equal(got, want)


def test_two_dim_transposes_are_read_by_the_gemms_not_copied():
    """aten's ``t`` is a view a GEMM reads with its transpose flag; the model says the same (no ``Transpose`` left):
    a weight transposed for the forward GEMM and again for the input gradient, an activation gradient transposed
    for the weight gradient and added to another (a tied weight: ONNX Runtime's MatMul+Add fusion then kept the
    transpose as a full copy), in float32 and float64. A batched transpose and an integer product stay as they were."""
    import onnx

    def fn(x, w, b, g, e, q, k, i):
        wt = aten.t(w)
        y = aten.addmm(b, x, wt)                    # forward: Gemm(x, w, transB)
        dx = aten.mm(g, aten.t(wt))                 # input gradient: t(t(w)) is w
        dw = aten.add(aten.mm(aten.t(g), x), e)     # weight gradient of a tied weight
        scores = aten.bmm(q, aten.transpose(k, 1, 2))
        return y, dx, dw, scores, aten.mm(i, aten.t(i))

    for dtype in (torch.float32, torch.float64):
        args = [_randn(*s).to(dtype) for s in [(6, 4), (5, 4), (5,), (6, 5), (5, 4), (2, 3, 4), (2, 3, 4)]]
        args.append(torch.randint(-3, 3, (3, 4), generator=G))
        gm = make_fx(fn, tracing_mode="fake")(*args)
        data = translate(gm)
        ops = [n.op_type for n in onnx.load_from_string(data).graph.node]
        # left: the batched one (ONNX Runtime fuses it into its MatMul) and the integer one (no integer Gemm)
        assert ops.count("Transpose") == 2, ops
        assert ops.count("Gemm") == 2 and ops.count("MatMul") == 3, ops  # dx reads w itself: a MatMul
        got = OrtSegment("probe", gm, data, threads=1, allow_spinning=False).run_ort(*args)
        for k, (g, want) in enumerate(zip(got, fn(*args), strict=True)):
            assert g.dtype == want.dtype
            assert_close_relmax(g, want, rtol=2e-5 if dtype == torch.float32 else 1e-12, msg=f"output {k}, {dtype}")


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
def test_cross_entropy_backward_is_one_expression_with_the_same_numbers(reduction):
    """``nll_loss_backward`` then ``_log_softmax_backward_data`` (a cross-entropy's backward) is exported as
    ``exp(y) * w`` with ``-w`` added at each target (3 passes over the logits, not 7), with ignored targets; its
    numbers equal the pair's translated op by op, bit for bit, and torch's to rounding. At dynamic batch sizes too."""
    import onnx

    from spmd_ort.backends.ort import decompose

    def fn(x, y, g):
        logp = aten._log_softmax(x, 1, False)
        _, total_weight = aten.nll_loss_forward(logp, y, None, reduction, 3)
        return aten._log_softmax_backward_data(
            aten.nll_loss_backward(g, logp, y, None, reduction, 3, total_weight), logp, 1, x.dtype)

    def args(n):
        y = torch.randint(0, 40, (n,), generator=G)
        y[::5] = 3  # ignore_index
        return _randn(n, 40) * 4, y, _randn(n) if reduction == 0 else _randn(())

    a = args(16)
    gm = make_fx(fn, tracing_mode="fake")(*a)
    decompose.annotate(gm)  # (as lower_to_onnx_ops_pass: nll_loss_forward goes as torch's decomposition)
    fused = translate(gm)
    ops = [n.op_type for n in onnx.load_from_string(fused).graph.node]
    # over the logits: Exp, Mul, ScatterElements (the pair: ConstantOfShape, ScatterElements, Where, Mul, Exp,
    # ReduceSum, Mul, Sub)
    assert "ConstantOfShape" not in ops and "Sub" not in ops, ops
    assert ops.count("Exp") == ops.count("Mul") == ops.count("ScatterElements") == 1, ops
    original = decompose.fuse_loss_backward
    try:
        decompose.fuse_loss_backward = lambda gm: gm
        pair = translate(gm)
    finally:
        decompose.fuse_loss_backward = original
    half = make_fx(fn, tracing_mode="fake")(a[0].half(), a[1], a[2].half())  # (no float16 scatter-add on CPU)
    assert decompose.fuse_loss_backward(half) is half
    got = OrtSegment("fused", gm, fused, threads=1, allow_spinning=False).run_ort(*a)
    assert torch.equal(got, OrtSegment("pair", gm, pair, threads=1, allow_spinning=False).run_ort(*a))
    assert_close_relmax(got, fn(*a), rtol=2e-5)

    b = args(24)
    _, _, fakes = fake_inputs([], list(a), [frozenset({0}), frozenset({0}), frozenset({0} if reduction == 0 else ())],
                              ["x", "y", "g"])
    gm = make_fx(fn, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*fakes)
    assert is_symbolic(gm)
    decompose.annotate(gm)
    segment = OrtSegment("dynamic", gm, translate(gm), threads=1, allow_spinning=False)
    for inputs in (a, b):
        assert_close_relmax(segment.run_ort(*inputs), fn(*inputs), rtol=2e-5)
