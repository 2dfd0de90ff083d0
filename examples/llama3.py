"""Llama 3 as torchtitan defines it (``torchtitan/models/llama``): the model of torchtitan's published runs, so that
a plan of it is a plan of the step they measured (bench/plan_vs_published.py).

Pre-norm blocks of grouped-query attention (``F.scaled_dot_product_attention(..., is_causal=True)`` on keys and
values repeated to the query heads, rotary positions) and a SwiGLU feed-forward (``w2(silu(w1(x)) * w3(x))``); RMSNorm
computed in float32; an untied output head.  Rotary positions are applied with cos/sin tables instead of torchtitan's
complex multiply (the same values; no complex tensors in the graph).  Build it on the meta device for sizes that do
not fit here::

    with torch.device("meta"):
        model = Llama3(LLAMA3_8B)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Llama3Config:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192


# torchtitan/models/llama/__init__.py: ffn hidden from dim, ffn_dim_multiplier and multiple_of
LLAMA3_8B = Llama3Config()
LLAMA3_70B = Llama3Config(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672)
LLAMA3_405B = Llama3Config(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary_tables(cfg: Llama3Config) -> tuple[torch.Tensor, torch.Tensor]:
    head = cfg.dim // cfg.n_heads
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, head, 2).float() / head))
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (B, T, heads, head_dim): pairs (even, odd) rotated by each position's angles."""
    x = x.float().unflatten(-1, (-1, 2))
    a, b = x[..., 0], x[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: Llama3Config):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head)  # -1: the heads this rank holds under tensor parallelism
        k = self.wk(x).view(b, t, -1, self.head)
        v = self.wv(x).view(b, t, -1, self.head)
        q, k = rotate(q, cos, sin).type_as(v), rotate(k, cos, sin).type_as(v)
        repeat = q.size(2) // k.size(2)
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)  # torchtitan's repeat_kv
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Llama3Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: Llama3Config):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    def __init__(self, cfg: Llama3Config = LLAMA3_8B):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        t = tokens.size(1)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def train_step(model, opt, tokens, labels):
    """torchtitan's step: cross-entropy in float32 over every token, gradients clipped at 1.0, the optimizer.  Under
    :func:`tensor_parallel_plan`'s loss parallelism the logits are a DTensor sharded over the vocabulary and the loss
    runs under torch's ``loss_parallel()``, as torchtitan runs it."""
    logits = model(tokens)
    sharded = getattr(logits, "placements", None) is not None
    with _loss_parallel() if sharded else contextlib.nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def tensor_parallel_plan() -> dict:
    """torchtitan's tensor-parallel plan (``parallelize_llama``'s ``apply_tp``): in each block q/k/v and w1/w3
    column-wise, wo and w2 row-wise (Megatron's), with sequence parallelism (the norms and the residual stream
    sharded over the sequence between the attention and feed-forward) and loss parallelism (the embedding split
    over the vocabulary rows, the head column-wise with its logits left sharded over the vocabulary)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    col, seq = ColwiseParallel(), SequenceParallel()
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), "norm": seq,
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    plan |= {"layers.*.attention_norm": seq, "layers.*.ffn_norm": seq,
             "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                      desired_input_layouts=(Replicate(), None, None)),
             "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                         desired_input_layouts=(Replicate(),)),
             "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
             "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    plan |= {f"layers.*.attention.{p}": col for p in ("wq", "wk", "wv")}
    plan |= {f"layers.*.feed_forward.{p}": col for p in ("w1", "w3")}
    return plan
