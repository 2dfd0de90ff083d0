"""HF transformers models built from small configs with random weights (never downloaded)."""

from __future__ import annotations

import pytest
import torch

from helpers import train_side_by_side
from models import tiny_mixtral_config
from spmd_ort.graph.flops import node_flops
from spmd_ort.backends.inductor import cxx_compiler
from spmd_ort.graph import ops
from zoo import clipped_lm_step as lm_step, cls_step, deepseek_v3

transformers = pytest.importorskip("transformers")
STEPS = 6


def _sgd(m):
    # SGD: GPT-2 and BERT carry a key bias whose gradient is analytically zero;
    # Adam would normalise its rounding noise into +-lr steps (see tests/models.py).
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("backend", ["ort", "fx"])
def test_hf_gpt2_lm(backend):
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 128, (2, 16), generator=g),) for _ in range(2)] * (STEPS // 2)
    torch.manual_seed(0)
    _, le, _ = train_side_by_side(lambda: transformers.GPT2LMHeadModel(cfg), _sgd, lm_step, batches, backend=backend)
    assert le[-1] < le[0]


@pytest.mark.parametrize("backend", ["ort", "fx"])
def test_hf_bert_classification_with_padding_mask(backend):
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[3, 5:] = 0
    y = torch.randint(0, 3, (4,), generator=g)
    torch.manual_seed(0)
    # BERT's key bias has an analytically zero gradient (softmax is shift-invariant): its gradient and
    # momentum are rounding noise in both runs, checked to be that and not compared
    _, le, _ = train_side_by_side(lambda: transformers.BertForSequenceClassification(cfg), _sgd, cls_step,
                                  [(x, mask, y)] * STEPS, backend=backend,
                                  zero_grad_params=("bert.encoder.layer.*.attention.self.key.bias",))
    assert le[-1] < le[0]


def _grouped_mm_nodes(program) -> list:
    """The ``spmd_ort::grouped_mm`` nodes of a compiled program: its graph's and, on ORT or inductor, its segments'."""
    return [n for m in program.gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.target is ops.grouped_mm]


@pytest.mark.parametrize("backend", ["ort", "fx", "inductor"])
def test_hf_mixtral_grouped_mm_experts_are_traced(backend):
    """transformers' default Mixtral experts sort the (token, expert) pairs by expert and run one
    ``torch._grouped_mm`` per projection.  torch's fake kernel of that op admits bfloat16 only (the CUDA kernel's
    rule), so in float32 the experts ran opaquely; now they trace, as ``spmd_ort::grouped_mm`` (eager's kernel),
    with no opaque part, and in ORT as one MatMul per expert.  The sort has many equal keys: the graph asks for
    the stable order, the one ONNX Runtime gives, so every ORT segment verifies and runs in ORT
    (``train_side_by_side`` checks it)."""
    if backend == "inductor" and cxx_compiler() is None:
        pytest.skip("inductor's CPU code needs a C++ compiler")
    cfg = tiny_mixtral_config(layers=2)
    g = torch.Generator().manual_seed(0)
    # (4 steps: SGD's first step with momentum is a variant of its own, and each variant's first run is a checked
    # one, so that steps 3 and 4 train on the backend's outputs)
    batches = [(torch.randint(0, cfg.vocab_size, (2, 16), generator=g),) for _ in range(2)] * 2
    torch.manual_seed(0)
    step, le, _ = train_side_by_side(lambda: transformers.MixtralForCausalLM(cfg), _sgd, lm_step, batches,
                                     backend=backend)
    program = step.compiled
    assert program.opaque == ()
    grouped = _grouped_mm_nodes(program)
    # per layer: gate_up and down forward; their input gradients, and their weight gradients (2-D x 2-D)
    assert len(grouped) == 2 * 2 * 3, len(grouped)
    pairs, d, inner, experts = 2 * 16 * cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size, 4
    assert sorted({node_flops(n) for n in grouped}) == [2 * pairs * d * inner, 2 * pairs * d * 2 * inner]
    assert all(n.meta["val"].shape in {(pairs, 2 * inner), (pairs, d), (pairs, inner), (experts, d, 2 * inner),
                                       (experts, inner, d), (experts, 2 * inner, d), (experts, d, inner)}
               for n in grouped)
    if backend == "ort":  # in the segments (our translation), not host nodes between them
        assert "sorts made stable" in program.describe() and "host: spmd_ort.grouped_mm" not in program.describe()
    if backend == "inductor":  # an extern kernel in inductor's code: every segment compiled, none fell back
        stats = program.executor.stats
        assert not stats.fallbacks and stats.verified >= 1 and str(ops.grouped_mm) not in stats.host_ops
    assert le[2] < le[0]  # the same batch, two steps later


def test_hf_mixtral_grouped_mm_experts_with_new_lengths_on_ort(monkeypatch):
    """A new sequence length re-traces with the length symbolic (the number of (token, expert) pairs with it):
    the grouped matmuls' shapes follow it, and one ONNX model per segment serves every length, checked with
    fallback disabled; lengths seen before train on ORT's outputs (the first run at each is a checked run)."""
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    cfg = tiny_mixtral_config()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (2, length), generator=g),) for length in (16, 12, 20, 16, 20, 16)]
    torch.manual_seed(0)
    step, le, _ = train_side_by_side(lambda: transformers.MixtralForCausalLM(cfg), _sgd, lm_step, batches,
                                     backend="ort")
    program = step.compiled
    assert program.symbolic is not None and program.opaque == ()
    assert _grouped_mm_nodes(program)


def _moe_configs() -> dict:
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=8)),
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2)),
        "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, num_experts=4, num_experts_per_tok=2)),
        "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(  # biased, transposed experts
            **common, num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=["full_attention"])),
    }


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss"])
def test_hf_moe_families_with_grouped_mm_experts_train_on_ort(name):
    """Other transformers MoE families share Mixtral's ``grouped_mm`` experts (biases and transposed weights
    included, GPT-OSS): traced with no opaque part, every segment verified in ORT (fallback disabled)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (2, 16), generator=g),) for _ in range(4)]  # 2 trained on ORT (see above)
    torch.manual_seed(0)
    step, le, _ = train_side_by_side(_moe_configs()[name], _sgd, lm_step, batches, backend="ort")
    assert step.compiled.opaque == ()
    assert _grouped_mm_nodes(step.compiled)
    assert "host: spmd_ort.grouped_mm" not in step.compiled.describe()  # in the segments: our translation


def test_hf_deepseek_v3_moe_router_verifies_on_ort_and_matches_eager(monkeypatch):
    """The router's topk(..., sorted=False) indices and weights may come out of ONNX Runtime in another order
    than torch's: verification compares them as the op defines them (the set per row, indices and weights as
    pairs), so the segment passes with fallback disabled, and the experts, which read them as pairs, train
    as eager does."""
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = deepseek_v3()
    torch.manual_seed(0)
    batches = model.batches(torch.Generator().manual_seed(0), 2) * 2
    compiled, le, _ = train_side_by_side(model.make, _sgd, model.step, batches, backend="ort")
    groups = [g for seg in compiled.compiled.executor.segments for g in getattr(seg, "unordered", ())]
    assert groups and all(g.indices is not None and len(g.members) >= 2 for g in groups), groups
    assert le[-1] < le[0]
