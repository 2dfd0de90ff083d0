"""Small models for the parity tests: an MLP, a CNN with BatchNorm, a GPT."""

from __future__ import annotations

import torch
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
