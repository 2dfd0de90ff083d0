"""fuse_linear_cross_entropy_pass: an LM head's matmul + cross-entropy as torch's chunked operator.

On graphs made with make_fx (the pass alone: what it fuses, what it keeps and why, the numbers against the
unfused graph), and end to end against eager on every backend; data parallel and fully_shard on 2 ranks are
in test_data_parallel.py and test_zero3.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import spmd_ort
from spmd_ort.graph.flops import node_flops
from spmd_ort.passes import PassContext, fuse_linear_cross_entropy_pass, op_counts, remove_identity_views_pass, run_passes
from spmd_ort.passes.fusion import FusedLosses
from spmd_ort.passes.analysis import MemoryPlan
from spmd_ort.graph import ops

from helpers import RTOL, assert_close_relmax, train_side_by_side, train_step
from models import GPT, GPTConfig, gpt_batch
from spmd_ort.backends.inductor import cxx_compiler

pytestmark = pytest.mark.skipif(ops.LINEAR_CROSS_ENTROPY is None, reason="torch has no chunked linear_cross_entropy")
FUSED = str(ops.LINEAR_CROSS_ENTROPY)
ROWS, FEATURES, CLASSES = 512, 64, 8192  # 4 M logits, 128x as many classes as features: fused


def _inputs(rows=ROWS, features=FEATURES, classes=CLASSES, ignored=0):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, features, generator=g, requires_grad=True)
    w = (torch.randn(classes, features, generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, classes, (rows,), generator=g)
    y[:ignored] = -100
    return h, w, y


def _fused(fn, *inputs, mode="fake"):
    """``fn`` traced, before and after the pass, and what the pass recorded."""
    gm = make_fx(fn, tracing_mode=mode)(*inputs)
    reference = make_fx(fn, tracing_mode=mode)(*inputs)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = len(out) if isinstance(out, (tuple, list)) else 1
    ctx = PassContext(input_slots=[None] * len(inputs), output_slots=[None] * outputs, check_contracts=True)
    gm = run_passes(gm, ctx, [remove_identity_views_pass, fuse_linear_cross_entropy_pass])  # as the pipeline runs it
    return gm, reference, ctx.results.get(FusedLosses)


def _real(inputs):
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]


@pytest.mark.parametrize("reduction,scale,ignored", [("mean", None, 0), ("mean", 3.0, 37), ("sum", 0.5, 5)])
def test_head_is_fused_and_computes_the_same_loss_and_gradients(reduction, scale, ignored):
    """``loss.backward()`` (upstream gradient ``ones_like``) and a scaled loss (a GradScaler's, an accumulation's
    1/n: the fused gradients times the upstream one); rows with ``ignore_index`` count nowhere."""
    def step(h, w, y):
        loss = F.cross_entropy(F.linear(h, w), y, reduction=reduction)
        gh, gw = torch.autograd.grad(loss if scale is None else loss * scale, (h, w))
        return loss, gh, gw

    inputs = _inputs(ignored=ignored)
    gm, reference, result = _fused(step, *inputs)
    counts = op_counts(gm)
    assert counts[FUSED] == 1 and counts["aten._log_softmax.default"] == 0, counts
    assert counts["aten.nll_loss_forward.default"] == counts["aten.nll_loss_backward.default"] == 0, counts
    assert counts["aten.mm.default"] == 0, counts  # the logits' and both gradients' matmuls are the operator's
    # the gradients times the upstream one, unless it is ones_like(loss)
    assert counts["aten.mul.Tensor"] == op_counts(reference)["aten.mul.Tensor"] + (0 if scale is None else 2)
    assert result.fused == (f"mm: {ROWS} rows x {CLASSES} classes, {ROWS} rows per chunk",) and not result.left
    got, want = gm(*_real(inputs)), reference(*_real(inputs))
    for name, a, b in zip(("loss", "grad h", "grad W"), got, want, strict=True):
        assert_close_relmax(a, b, rtol=RTOL, msg=name)
    node = next(n for n in gm.graph.nodes if n.target is ops.LINEAR_CROSS_ENTROPY)
    assert node_flops(node) == 3 * 2 * ROWS * FEATURES * CLASSES  # the logits and two gradients


def test_a_batch_of_padding_gives_eagers_nan_loss_and_zero_gradients():
    """Every target ``ignore_index`` with the mean: eager's loss is 0 / 0 (NaN) and its gradients 0 (no row
    counts); the fused head gives the same, not NaN gradients (which Adam would spread into every weight)."""
    def step(h, w, y):
        loss = F.cross_entropy(F.linear(h, w), y)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    inputs = _inputs(ignored=ROWS)
    gm, reference, _ = _fused(step, *inputs)
    assert op_counts(gm)[FUSED] == 1
    (loss, gh, gw), (want_loss, want_gh, want_gw) = gm(*_real(inputs)), reference(*_real(inputs))
    assert torch.isnan(loss) and torch.isnan(want_loss)
    assert torch.equal(gh, want_gh) and torch.equal(gw, want_gw) and not gw.abs().sum()


@pytest.mark.parametrize("reduction,ignored,class_weight", [("mean", 9, False), ("sum", 9, True),
                                                             ("mean", 0, True), ("sum", ROWS, False)])
def test_the_decomposition_onnx_gets_computes_what_the_operator_does(reduction, ignored, class_weight):
    """What an ORT segment exports in place of the operator (spmd_ort/backends/ort/fused.py), against the operator itself
    (the segment's first run checks the same against torch)."""
    from spmd_ort.backends.ort.fused import linear_cross_entropy

    h, w, y = (t.detach() for t in _inputs(rows=96, classes=300, ignored=ignored))
    weight = torch.rand(300, generator=torch.Generator().manual_seed(3)) if class_weight else None
    args = (h, w, y, None, weight, reduction, -100, 0.0, 32, "compact", torch.float32, False, True, True, False)
    for got, want in zip(linear_cross_entropy(*args), ops.LINEAR_CROSS_ENTROPY(*args), strict=True):
        assert got.shape == want.shape
        if want.numel():
            assert_close_relmax(got, want, rtol=RTOL)


def test_only_the_gradients_the_backward_asks_for_are_computed():
    """A frozen head (no gradient of W): the operator computes the hidden states' gradient only."""
    def step(h, w, y):
        loss = F.cross_entropy(F.linear(h, w), y)
        (gh,) = torch.autograd.grad(loss, (h,))
        return loss, gh

    inputs = _inputs()
    gm, reference, _ = _fused(step, *inputs)
    node = next(n for n in gm.graph.nodes if n.target is ops.LINEAR_CROSS_ENTROPY)
    assert node.args[-3:] == (True, False, False)
    for a, b in zip(gm(*_real(inputs)), reference(*_real(inputs)), strict=True):
        assert_close_relmax(a, b, rtol=RTOL)


def test_a_head_whose_logits_are_read_elsewhere_is_kept_and_says_why():
    def step(h, w, y):
        logits = F.linear(h, w)
        loss = F.cross_entropy(logits, y)
        gh, gw = torch.autograd.grad(loss, (h, w))
        return loss, gh, gw, logits.argmax(1)  # an accuracy reads the logits

    gm, _, result = _fused(step, *_inputs())
    assert op_counts(gm)[FUSED] == 0
    assert result.fused == () and "the logits are read besides the loss" in result.left[0]
    assert "linear + cross-entropy not fused" in "\n".join(result.lines())


@pytest.mark.parametrize("shape", [(ROWS // 4, FEATURES, CLASSES),  # 1 M logits
                                   (ROWS * 4, 1024, 2048)])  # 2x as many classes as features
def test_a_head_where_eager_is_as_fast_is_kept_silently(shape):
    def step(h, w, y):
        loss = F.cross_entropy(F.linear(h, w), y)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    gm, _, result = _fused(step, *_inputs(*shape))
    assert op_counts(gm)[FUSED] == 0 and result is None  # the expected case: no line in describe()


def test_without_a_backward_nothing_is_fused():
    gm, _, result = _fused(lambda h, w, y: F.cross_entropy(F.linear(h, w), y), *_inputs())
    assert op_counts(gm)[FUSED] == 0 and "no single cross-entropy backward" in result.left[0]


WIDE = GPTConfig(vocab=8192, seq=64, d=32, layers=1)  # batches of 8: 512 rows of 8192 classes


def _wide_gpt():
    torch.manual_seed(0)
    return GPT(WIDE)


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [gpt_batch(WIDE, 8, g) for _ in range(n)]


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)


@pytest.mark.parametrize("backend", ["fx", "ort", "inductor"])
def test_gpt_with_a_wide_head_trains_like_eager(backend, monkeypatch):
    """A tied 8192-class head: the fused step against eager, every step, with fallback disabled.  fx runs the
    operator; ORT exports its decomposition (the unfused math), verified against it on the first run; inductor
    calls it from its compiled code."""
    if backend == "inductor" and cxx_compiler() is None:
        pytest.skip("inductor's CPU code needs a C++ compiler")
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    compiled, _, _ = train_side_by_side(_wide_gpt, _adamw, train_step, _batches(), backend=backend, normwise=True)
    program = compiled.compiled
    assert "linear + cross-entropy fused (torch's chunked linear_cross_entropy): `head`: 512 rows x 8192 classes" \
        in program.describe()
    fused = [n for m in program.gm.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.nodes if n.target is ops.LINEAR_CROSS_ENTROPY]
    assert fused, "the fused operator is in the program's graph or its segments"
    if backend == "ort":
        assert "lowered for ONNX (exported as torch's decomposition; torch runs the op): " \
               f"{FUSED}" in program.describe()


def test_the_fused_head_keeps_less_for_the_backward():
    """The planned peak of the values a step makes drops: no log-probabilities (rows x classes) kept for the
    backward, no logits or logits' gradient made whole."""
    import os

    peaks = {}
    for fused in (True, False):
        if not fused:
            os.environ["SPMD_ORT_DISABLE_PASSES"] = "fuse_linear_cross_entropy_pass"
        try:
            step = spmd_ort.compile(backend="fx")(train_step)
            model = _wide_gpt()
            x, y = _batches(1)[0]
            step(model, _adamw(model), x, y)
            peaks[fused] = step.compiled.results.get(MemoryPlan)
        finally:
            os.environ.pop("SPMD_ORT_DISABLE_PASSES", None)
    logits_bytes = 512 * 8192 * 4
    assert peaks[False].planned_peak_bytes - peaks[True].planned_peak_bytes >= 2 * logits_bytes, peaks
    assert peaks[False].saved_for_backward_bytes - peaks[True].saved_for_backward_bytes >= logits_bytes, peaks


def test_a_target_out_of_range_fails_like_eager():
    """The fused operator's target is checked like cross_entropy's: eager's IndexError, naming the input."""
    step = spmd_ort.compile(backend="fx")(train_step)
    model = _wide_gpt()
    x, y = _batches(1)[0]
    y = y.clone()
    y[0, 3] = WIDE.vocab
    with pytest.raises(IndexError, match="y"):
        step(model, _adamw(model), x, y)


@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_hf_llama_lm_head_is_fused(backend, monkeypatch):
    """transformers' causal-LM loss (labels padded with ignore_index and shifted, ``reduction="mean"`` over the
    rows that count) on an 8192-class head: fused, and trained like eager (fallback disabled)."""
    transformers = pytest.importorskip("transformers")
    from test_hf_models import _sgd, lm_step

    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (4, 129), generator=g),) for _ in range(4)]  # SGD momentum: 2 variants
    torch.manual_seed(0)
    step, _, _ = train_side_by_side(lambda: transformers.LlamaForCausalLM(cfg), _sgd, lm_step, batches,
                                    backend=backend, normwise=True)
    assert "linear + cross-entropy fused (torch's chunked linear_cross_entropy): `lm_head`: 516 rows x 8192 " \
           "classes" in step.compiled.describe()


def test_each_micro_batch_head_is_fused_and_scaled_by_its_share():
    """Gradient accumulation over 2 micro-batches (each loss divided by 2): one fused head per micro-batch, its
    gradients times the upstream 1/2, trained like eager."""
    from helpers import accumulation_step

    def step(model, opt, x, y):
        return accumulation_step(model, opt, x.chunk(2), y.chunk(2))[0]

    compiled, _, _ = train_side_by_side(_wide_gpt, _adamw, step, _batches(), backend="fx", normwise=True)
    fused = [line for line in compiled.compiled.describe().splitlines() if "linear + cross-entropy fused" in line]
    assert fused == ["linear + cross-entropy fused (torch's chunked linear_cross_entropy): `head`: 256 rows x 8192 "
                     "classes, 256 rows per chunk"] * 2
