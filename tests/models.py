"""Small models for the parity tests: an MLP, a CNN with BatchNorm, a GPT; parts that cannot be traced."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples.gpt import GPT, Block, GPTConfig  # noqa: F401 - one GPT for demo, bench and tests


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # BN follows: a bias would get a zero gradient
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):  # (B, 3, 16, 16)
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)  # (B, 8, 8, 8)
        x = F.avg_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)  # (B, 16, 4, 4)
        return self.fc(x.flatten(1))


def gpt_batch(cfg: GPTConfig, batch: int, generator: torch.Generator):
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=generator)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=generator)
    return x, y


# ---------------------------------------------------------------------- parts that cannot be traced
class ScaleByMax(torch.autograd.Function):
    """Divides by the input's largest magnitude, read as a Python float: tracing cannot read values."""

    @staticmethod
    def forward(ctx, x):
        scale = float(x.detach().abs().max()) + 1.0
        ctx.scale = scale
        return x / scale

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.scale


class NumpyTanh(torch.autograd.Function):
    """tanh computed by numpy: fake tensors have no data to hand it."""

    @staticmethod
    def forward(ctx, x):
        y = torch.from_numpy(np.tanh(x.detach().numpy()))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class GlobalCenter(torch.autograd.Function):
    """Subtracts the mean over the *global* batch (all ranks), a SyncBatchNorm-like region:
    one all-reduce in forward, one in backward (Megatron-style collectives inside a Function)."""

    @staticmethod
    def forward(ctx, x):
        total = x.sum(0)
        count = torch.tensor([float(x.shape[0])])
        if dist.is_initialized():
            dist.all_reduce(total)
            dist.all_reduce(count)
        ctx.count = count
        return x - total / count

    @staticmethod
    def backward(ctx, grad):
        total = grad.sum(0)
        if dist.is_initialized():
            dist.all_reduce(total)
        return grad - total / ctx.count


class FunctionLayer(nn.Module):
    def __init__(self, fn: type[torch.autograd.Function], d_in: int, d_out: int):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.relu(self.fn.apply(torch.tanh(self.lin(x))))


class FunctionMLP(nn.Module):
    """An MLP whose hidden layer (``layer``) applies an autograd.Function."""

    def __init__(self, fn: type[torch.autograd.Function], d_in: int = 16, hidden: int = 32, d_out: int = 10):
        super().__init__()
        self.layer = FunctionLayer(fn, d_in, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(self.layer(x))


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Top1MoE(nn.Module):
    """Top-1 mixture of experts routed with ``nonzero()`` and a Python branch on the token count."""

    def __init__(self, d: int = 16, hidden: int = 32, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(experts))

    def forward(self, x):  # (N, d)
        weight, choice = self.router(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (choice == e).nonzero().squeeze(-1)
            if sel.numel() == 0:
                continue
            out = out.index_add(0, sel, expert(x[sel]) * weight[sel, None])
        return out


class MoENet(nn.Module):
    def __init__(self, d_in: int = 16, d: int = 16, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.moe = Top1MoE(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x)
        return self.head(h + self.moe(h))


class RoutedMoENet(nn.Module):
    """embed -> Top1MoE -> head, routed by the first ``experts`` input features: expert e gets the tokens whose
    feature e is the largest of them, so a batch with feature e at -5 everywhere gives expert e no token.

    Nothing but the MoE reads the embedding, so every gradient is accumulated as eager accumulates it
    (an opaque part's input gradient is not summed with another): compiled fx equals eager bit for bit.
    """

    def __init__(self, d: int = 16, classes: int = 10, experts: int = 4):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.moe = Top1MoE(d, experts=experts)
        self.head = nn.Linear(d, classes)
        with torch.no_grad():
            self.embed.weight.copy_(torch.eye(d))
            self.embed.bias.zero_()
            self.moe.router.weight.copy_(10 * torch.eye(experts, d))

    def forward(self, x):
        return self.head(self.moe(self.embed(x)))


def starve(x: torch.Tensor, expert: int) -> torch.Tensor:
    """``x`` with no token for ``expert`` of a :class:`RoutedMoENet` (a copy)."""
    x = x.clone()
    x[:, expert] = -5.0
    return x


class GlobalTokenScale(nn.Module):
    """Scales by 1 / (tokens on all ranks): a plain torch.distributed call in forward, outside any Function."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        count = torch.tensor([float(x.shape[0])])
        if dist.is_initialized():
            dist.all_reduce(count)
        return self.proj(x) * (x.shape[0] / count)


class DistNet(nn.Module):
    """Both kinds of collectives in a model: a Function with all-reduces and a module that calls one."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.scale = GlobalTokenScale(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(torch.relu(self.scale(GlobalCenter.apply(torch.tanh(self.fc1(x))))))


def tiny_mixtral_config(layers: int = 1, experts: str | None = None):
    """HF Mixtral, tiny.  ``experts``: transformers' experts implementation (None: its default, `grouped_mm`;
    `"eager"`: a loop over the experts hit, data-dependent, so it runs opaquely in a compiled step)."""
    import transformers

    return transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64,
                                      **({"experts_implementation": experts} if experts else {}))


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts``: E gated experts, their weights fused with a leading expert dim, called on
    rows already sorted by expert with ``num_tokens_per_expert`` (its for-loop form: one matmul chain per expert)."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) * hidden**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, rows in enumerate(torch.split(x, num_tokens_per_expert.long().tolist(), dim=0)):
            h = torch.nn.functional.silu(rows @ self.w1[i].t()) * (rows @ self.w3[i].t())
            outs.append(h @ self.w2[i].t())
        return torch.cat(outs, dim=0)


class TitanMoE(nn.Module):
    """torchtitan's ``MoE`` layer: a top-k router (softmax scores), the tokens sorted by expert and scaled by their
    scores before the experts (``score_before_experts``), :class:`GroupedExperts`, and the rows summed back per
    token; plus a shared dense expert."""

    def __init__(self, dim: int = 32, hidden: int = 64, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = torch.softmax(self.gate(x), dim=-1)
        top, chosen = torch.topk(scores, self.top_k, dim=-1)
        counts = torch.histc(chosen.reshape(-1).float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        tokens = order // self.top_k
        routed = x[tokens] * top.reshape(-1)[order].unsqueeze(-1)
        out = self.experts(routed, counts)
        combined = torch.zeros_like(x).index_add(0, tokens, out)
        return (combined + self.shared(x)).reshape(shape)


class TitanMoELM(nn.Module):
    """A small LM of :class:`TitanMoE` blocks (``layers.N.moe.experts``): embedding, pre-norm residual blocks of
    causal attention (no biases: a key bias gets an analytically zero gradient) and an MoE, a head;
    ``forward(ids, labels)`` returns the mean cross-entropy."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, num_experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "norm1": nn.LayerNorm(dim), "attn": nn.MultiheadAttention(dim, 4, bias=False, batch_first=True),
            "norm2": nn.LayerNorm(dim), "moe": TitanMoE(dim, 2 * dim, num_experts)}) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        mask = torch.triu(torch.full((ids.shape[1], ids.shape[1]), float("-inf")), diagonal=1)
        for layer in self.layers:
            a = layer["norm1"](h)
            h = h + layer["attn"](a, a, a, attn_mask=mask, need_weights=False)[0]
            h = h + layer["moe"](layer["norm2"](h))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
