"""Published Hugging Face causal-LM configurations, by name, and a tiny config of each family.

``python -m spmd_ort.plan --model qwen3-8b`` plans one at its real size (built on the meta device from these
values, nothing downloaded); ``bench/hf_zoo.py`` plans every family for 8 ranks and trains each tiny config on 2
real ranks against DDP. Each entry is ``(model_type, the published config.json's architecture fields)``: the
fields that set the shapes and the computation (sizes, heads, vocabulary, rotary and attention variants);
tokenizer ids, dtypes and generation settings are left at their defaults. The values are those of the model
card's ``config.json`` named in ``SOURCES``.
"""

from __future__ import annotations

from typing import Any

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu")

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": ("llama", LLAMA3_8B),
    "mistral-7b": ("mistral", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False)),
    "mixtral-8x7b": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)),
    "qwen2-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "qwen3-8b": ("qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "gemma-7b": ("gemma", dict(
        vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=16, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rope_theta=10000.0, rms_norm_eps=1e-6)),
    "gemma2-9b": ("gemma2", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6)),
    "gemma3-1b": ("gemma3_text", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "phi3-mini": ("phi3", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        sliding_window=2047, tie_word_embeddings=False)),
    "falcon-7b": ("falcon", dict(
        vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False, hidden_dropout=0.0,
        attention_dropout=0.0, max_position_embeddings=2048)),
    "gpt2-xl": ("gpt2", dict(
        vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
    "pythia-6.9b": ("gpt_neox", dict(
        vocab_size=50432, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32,
        rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True, max_position_embeddings=2048,
        hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False)),
    "olmo2-7b": ("olmo2", dict(
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "stablelm-2-1.6b": ("stablelm", dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, partial_rotary_factor=0.25, use_qkv_bias=True, max_position_embeddings=4096,
        rope_theta=10000.0, layer_norm_eps=1e-5, tie_word_embeddings=False)),
    "granite-3-8b": ("granite", dict(
        vocab_size=49155, hidden_size=4096, intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=4096, rope_theta=10000.0, embedding_multiplier=12.0,
        logits_scaling=16.0, residual_multiplier=0.22, attention_multiplier=0.0078125, tie_word_embeddings=True)),
    "aya-23-8b": ("cohere", dict(
        vocab_size=256000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, logit_scale=0.125, use_qk_norm=False, max_position_embeddings=8192,
        rope_theta=10000.0, layer_norm_eps=1e-5)),
    "deepseek-v3": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=163840, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096))),
    "gpt-oss-20b": ("gpt_oss", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, rope_theta=150000.0, tie_word_embeddings=False)),
    "smollm3-3b": ("smollm3", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=65536, rope_theta=5e6, no_rope_layer_interval=4,
        tie_word_embeddings=True)),
}

SOURCES = {
    "llama3-8b": "meta-llama/Llama-3.1-8B", "mistral-7b": "mistralai/Mistral-7B-v0.3",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "qwen2-7b": "Qwen/Qwen2-7B", "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "gemma-7b": "google/gemma-7b", "gemma2-9b": "google/gemma-2-9b",
    "gemma3-1b": "google/gemma-3-1b-pt", "phi3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "falcon-7b": "tiiuae/falcon-7b", "gpt2-xl": "openai-community/gpt2-xl", "pythia-6.9b": "EleutherAI/pythia-6.9b",
    "olmo2-7b": "allenai/OLMo-2-1124-7B", "stablelm-2-1.6b": "stabilityai/stablelm-2-1_6b",
    "granite-3-8b": "ibm-granite/granite-3.0-8b-base", "aya-23-8b": "CohereForAI/aya-23-8B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3", "gpt-oss-20b": "openai/gpt-oss-20b",
    "smollm3-3b": "HuggingFaceTB/SmolLM3-3B",
}

# the fields a tiny config shrinks, where the family has them; heads and experts stay divisible by 2 ranks
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, moe_intermediate_size=32,
            num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, sliding_window=8, query_pre_attn_scalar=16, n_embd=64, n_layer=2, n_head=4,
            n_positions=128)
TINY_FAMILY = {  # where the shared shrink does not fit a family
    "falcon": dict(num_attention_heads=4, multi_query=True),
    "gpt2": dict(),
    "gemma3_text": dict(num_key_value_heads=1),
    "mistral": dict(sliding_window=None), "mixtral": dict(sliding_window=None),
    "gpt_oss": dict(intermediate_size=64, head_dim=16),
    "phi3": dict(num_key_value_heads=4, sliding_window=None),
    "olmo2": dict(num_key_value_heads=4), "stablelm": dict(num_key_value_heads=4),
    "smollm3": dict(no_rope_layer_interval=2),
    "gemma": dict(num_key_value_heads=4),
    "deepseek_v3": dict(num_key_value_heads=4),  # multi-head latent attention: as many key/value heads as heads
}
TINY_DROP = {"falcon": {"head_dim"}, "deepseek_v3": {"head_dim"}}  # derived from other fields there
TINY_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def config(name: str, *, tiny: bool = False, **overrides):
    """The transformers config of ``name`` (a key of :data:`CONFIGS`), or its tiny version (``tiny``: 2 layers of
    d 64, 4 heads, vocabulary 256; MoE: 4 experts, top 2), without dropout and without the KV cache."""
    import transformers

    model_type, fields = CONFIGS[name]
    fields = dict(fields)
    if tiny:  # the shared shrink of each field the family sets, or has a value for by default
        reference = transformers.AutoConfig.for_model(model_type)
        fields |= {k: v for k, v in TINY.items() if k not in TINY_DROP.get(model_type, ())
                   and (k in fields or getattr(reference, k, None) is not None)}
        fields |= TINY_FAMILY.get(model_type, {}) | TINY_TOKENS
    cfg = transformers.AutoConfig.for_model(model_type, **(fields | overrides))
    cfg.use_cache = False
    return cfg
