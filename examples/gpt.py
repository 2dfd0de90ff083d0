"""A small GPT (nanoGPT-style): token + position embedding, causal attention blocks, tied LM head.

Used by the demo, the benchmarks and the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    d: int = 32
    heads: int = 4
    layers: int = 2
    dropout: float = 0.0
    # separate q, k, v projections (the layout tensor-parallel plans shard column-wise: see tensor_parallel_plan)
    split_qkv: bool = False
    # the LM head shares the token embedding's weight (GPT-2); untied, a tensor-parallel plan can shard the head
    # over the vocabulary on its own (tensor_parallel_plan(loss_parallel=True))
    tie_head: bool = True


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d)
        # No qkv bias: the key bias has an analytically zero gradient (softmax is
        # shift-invariant), so Adam would turn rounding noise into +-lr steps and
        # any two correct implementations would drift apart on it.
        if cfg.split_qkv:
            self.q, self.k, self.v = (nn.Linear(cfg.d, cfg.d, bias=False) for _ in range(3))
        else:
            self.qkv = nn.Linear(cfg.d, 3 * cfg.d, bias=False)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.out = nn.Linear(4 * cfg.d, cfg.d)
        self.heads = cfg.heads
        self.dropout = cfg.dropout

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        h = self.ln1(x)
        q, k, v = (self.q(h), self.k(h), self.v(h)) if hasattr(self, "q") else self.qkv(h).split(C, dim=2)
        # -1 heads: under tensor parallelism a rank's q, k, v hold heads / tp of them
        q, k, v = (t.view(B, T, -1, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    """Token + position embedding, causal attention blocks, tied LM head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        if cfg.tie_head:
            self.head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("out.weight"):  # residual projections, scaled as in GPT-2
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):  # (B, T)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``new_tokens`` continuations of ``idx`` (B, T)."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.seq:])[:, -1, :] / temperature
            probs = torch.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def tensor_parallel_plan(loss_parallel: bool = False) -> dict:
    """Megatron's plan for :class:`GPT` built with ``split_qkv=True``: q, k, v and the MLP's first linear split
    column-wise (each rank a share of the heads and hidden units), the projections back row-wise (one all-reduce
    each in forward); embeddings, norms and the tied head replicated.

    ``loss_parallel``: for a model built with ``tie_head=False``, the head split column-wise too, its logits left
    sharded over the vocabulary (a DTensor), for a cross-entropy run under torch's
    ``torch.distributed.tensor.parallel.loss_parallel()`` (the loss and its backward: each rank computes its
    share of the vocabulary, and no rank holds all the logits)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"blocks.*.q": col, "blocks.*.k": col, "blocks.*.v": col, "blocks.*.proj": row,
            "blocks.*.fc": col, "blocks.*.out": row}
    if loss_parallel:
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan
