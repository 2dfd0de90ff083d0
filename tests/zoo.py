"""The model zoo of the ORT coverage tests: tiny configs, random weights, never downloaded.

Each entry builds a model, its train step and a few batches.  Hidden sizes, layers and
sequences are as small as the architecture allows, so that a compile (trace, export, ORT
sessions) takes seconds; the ops, and so the ONNX coverage they test, are those of the real
models.  SGD without momentum keeps the optimizer stateless, so each model compiles one variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH = 64, 8, 2


@dataclass
class ZooModel:
    name: str
    make: Callable[[], nn.Module]
    step: Callable
    batches: Callable[[torch.Generator, int], list[tuple]]
    # parameters whose gradient is analytically zero (attention key biases): noise in any two runs
    zero_grad_params: tuple[str, ...] = field(default_factory=tuple)


def lm_step(model, opt, x):
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def clipped_step(loss_of, name: str):
    """A train step ``(model, opt, x)``: ``loss_of(model, x)``, backward, gradients clipped to norm 1, the
    optimizer's step, ``zero_grad``."""

    def step(model, opt, x):
        loss = loss_of(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.__name__ = step.__qualname__ = name
    return step


clipped_lm_step = clipped_step(lambda model, x: model(input_ids=x, labels=x).loss, "clipped_lm_step")


def seq2seq_step(model, opt, x, y):
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def cls_step(model, opt, x, mask, y):
    loss = model(input_ids=x, attention_mask=mask, labels=y).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def image_step(model, opt, x, y):
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _tokens(g: torch.Generator, n: int) -> list[tuple]:
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),) for _ in range(n)]


def _pairs(g: torch.Generator, n: int) -> list[tuple]:
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ - 2), generator=g))
            for _ in range(n)]


def _classes(g: torch.Generator, n: int) -> list[tuple]:
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, SEQ - 3:] = 0  # padding in one row
        out.append((x, mask, torch.randint(0, 3, (BATCH,), generator=g)))
    return out


def _images(size: int, classes: int) -> Callable[[torch.Generator, int], list[tuple]]:
    def make(g: torch.Generator, n: int) -> list[tuple]:
        return [(torch.randn(BATCH, 3, size, size, generator=g), torch.randint(0, classes, (BATCH,), generator=g))
                for _ in range(n)]

    return make


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)  # BN follows: no bias (zero gradient)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)) \
            if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    """ResNet-style: stem conv + BN + ReLU + max-pool, two residual blocks, global average pool, linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(ResBlock(8, 8, 1), ResBlock(8, 16, 2))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):  # (B, 3, 16, 16)
        x = self.blocks(self.stem(x))  # (B, 16, 4, 4)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _hf() -> dict[str, ZooModel]:
    import transformers as T

    decoder = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, max_position_embeddings=2 * SEQ, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)
    return {
        "llama": ZooModel("llama", lambda: T.LlamaForCausalLM(T.LlamaConfig(**decoder, num_key_value_heads=2)),
                          lm_step, _tokens),
        "qwen2": ZooModel("qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**decoder, num_key_value_heads=2)),
                          lm_step, _tokens, ("model.layers.*.self_attn.k_proj.bias",)),
        "mistral": ZooModel("mistral", lambda: T.MistralForCausalLM(
            T.MistralConfig(**decoder, num_key_value_heads=2, sliding_window=None)), lm_step, _tokens),
        "phi3": ZooModel("phi3", lambda: T.Phi3ForCausalLM(T.Phi3Config(**decoder)), lm_step, _tokens),
        "gemma": ZooModel("gemma", lambda: T.GemmaForCausalLM(T.GemmaConfig(**decoder, num_key_value_heads=2,
                                                                            head_dim=8)), lm_step, _tokens),
        # GPT-NeoX's fused query_key_value bias holds the key bias: its key third gets a noise gradient,
        # which plain SGD turns into a noise-sized update (compared with the rest of the tensor, normwise)
        "gpt_neox": ZooModel("gpt_neox", lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=2 * SEQ, hidden_dropout=0.0, attention_dropout=0.0)), lm_step, _tokens),
        "gpt2": ZooModel("gpt2", lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)), lm_step, _tokens),
        "opt": ZooModel("opt", lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=2 * SEQ, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)), lm_step, _tokens,
            ("model.decoder.layers.*.self_attn.k_proj.bias",)),
        "t5": ZooModel("t5", lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0.0,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)),
            seq2seq_step, _pairs),
        "bert": ZooModel("bert", lambda: T.BertForSequenceClassification(T.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=2 * SEQ, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)), cls_step, _classes, ("bert.encoder.layer.*.attention.self.key.bias",)),
        "vit": ZooModel("vit", lambda: T.ViTForImageClassification(T.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
            image_step, _images(16, 3), ("vit.layers.*.attention.k_proj.bias",)),
    }


def deepseek_v3() -> ZooModel:
    """DeepSeek-V3 (MoE): a dense layer, then a routed one whose router picks groups and experts with
    ``topk(..., sorted=False)`` (their order is unspecified) and whose experts, data-dependent, run opaquely
    (transformers' loop over the experts hit, ``experts_implementation="eager"``; its default ``grouped_mm``
    experts trace, as Mixtral's do in tests/test_hf_models.py).  Not in :func:`zoo`: its experts run on the
    host, so it is no model of 100% ORT coverage."""
    import transformers as T

    cfg = T.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                             num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                             topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=2 * SEQ, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, experts_implementation="eager")
    return ZooModel("deepseek_v3", lambda: T.DeepseekV3ForCausalLM(cfg), lm_step, _tokens)


def zoo() -> dict[str, ZooModel]:
    models = _hf()
    models["resnet"] = ZooModel("resnet", ResNet, image_step, _images(16, 10))
    return models


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)
