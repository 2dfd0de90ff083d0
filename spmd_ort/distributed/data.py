"""Load-balanced data for several ranks (ORTModule's ``LoadBalancingDistributedSampler`` and batch sampler).

With variable-length samples (speech, NLP), a plain ``DistributedSampler``
gives the ranks samples of unrelated lengths at each step, and every step waits
for the rank with the longest one.  These samplers give each rank a disjoint
share of the dataset whose samples, step by step, have matching complexity::

    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda i: len(dataset[i][0]))
    batches = LoadBalancingDistributedBatchSampler(
        sampler, batch_fn=lambda idx: [idx[i:i + 8] for i in range(0, len(idx), 8)])
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=pad)
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        for x, y in loader: ...

How: each epoch every rank computes the same seeded permutation of the
dataset (no communication), cuts it into windows of ``window`` samples per
rank, sorts each window by complexity and deals consecutive samples to the
ranks, one each, so the samples the ranks receive at the same position have
neighbouring complexities; windows are then shuffled as whole blocks, so a
rank's sequence is not ordered by length.  The batch sampler applies
``batch_fn`` to every rank's share (each rank computes all of them) and gives
every rank the same number of batches, so no rank waits at the end of an epoch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        else:
            num_replicas = 1 if num_replicas is None else num_replicas
            rank = 0 if rank is None else rank
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    return num_replicas, rank


class LoadBalancingDistributedSampler(Sampler[int]):
    """A drop-in for ``DistributedSampler`` that balances ``complexity_fn(index)`` across ranks step by step.

    ``complexity_fn(i)`` is any number (e.g. the sample's length), evaluated once per index
    (cached).  ``shuffle``/``seed``/``drop_last``/``set_epoch`` mean what they mean for
    ``DistributedSampler``: without ``drop_last`` the dataset is padded by repeating its first
    samples until it divides by the number of ranks.  ``window``: samples per rank sorted
    together (larger: better balance, less randomness).
    """

    def __init__(self, dataset: Sequence, complexity_fn: Callable[[int], float], num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 window: int = 64):
        self.dataset = dataset
        self.complexity_fn = complexity_fn
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = window
        self.epoch = 0
        n = len(dataset)
        self.num_samples = n // self.num_replicas if drop_last else math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._complexity: list[float] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def complexities(self) -> list[float]:
        if self._complexity is None:
            self._complexity = [float(self.complexity_fn(i)) for i in range(len(self.dataset))]
        return self._complexity

    def shares(self) -> list[list[int]]:
        """Every rank's indices for this epoch (the same on every rank: computed, not communicated)."""
        n, world = len(self.dataset), self.num_replicas
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.drop_last:
            order = order[:self.total_size]
        else:
            order += (order * math.ceil(self.total_size / max(n, 1)))[:self.total_size - n]
        cost = self.complexities()
        span = self.window * world
        blocks = []  # each block: one sample per rank, of neighbouring complexity
        for start in range(0, len(order), span):
            chunk = sorted(order[start:start + span], key=lambda i: cost[i])
            blocks += [chunk[k:k + world] for k in range(0, len(chunk), world)]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch + 1_000_003)
            blocks = [blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()]
        return [[block[r] for block in blocks] for r in range(world)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.shares()[self.rank])

    def __len__(self) -> int:
        return self.num_samples


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Batches of a :class:`LoadBalancingDistributedSampler`'s share, the same number on every rank.

    ``batch_fn(indices) -> list of batches`` (lists of indices) is applied to each rank's share
    in its balanced order (e.g. fixed-size chunks, or a token budget); every rank then takes
    the same number of batches: the smallest count over ranks (``drop_last``, the default) or
    the largest, repeating the rank's first batches (``drop_last=False``).
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_fn: Callable[[list[int]], list[list[int]]],
                 drop_last: bool = True):
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def all_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for this epoch (equal counts)."""
        per_rank = [[list(b) for b in self.batch_fn(share)] for share in self.sampler.shares()]
        if any(not b for b in per_rank):
            raise ValueError("batch_fn returned no batch for some rank's share; the dataset is too small for the "
                             "number of ranks and batches")
        count = min(map(len, per_rank)) if self.drop_last else max(map(len, per_rank))
        return [(b * math.ceil(count / len(b)))[:count] for b in per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all_batches()[self.sampler.rank])

    def __len__(self) -> int:
        return len(self.all_batches()[self.sampler.rank])
