"""spmd_ort.distributed.data: load-balancing samplers (disjoint, complete, balanced step by step, deterministic per epoch)."""

from __future__ import annotations

import statistics

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from spmd_ort.distributed.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def _samplers(lengths, world, **kw):
    return [LoadBalancingDistributedSampler(lengths, complexity_fn=lambda i: lengths[i], num_replicas=world, rank=r,
                                            **kw) for r in range(world)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 300), world=st.integers(1, 8), window=st.integers(1, 80), drop_last=st.booleans(),
       seed=st.integers(0, 1000))
def test_shares_are_disjoint_complete_and_the_same_on_every_rank(n, world, window, drop_last, seed):
    lengths = [(i * 7919) % 97 + 1 for i in range(n)]
    samplers = _samplers(lengths, world, window=window, drop_last=drop_last, seed=seed)
    shares = [list(s) for s in samplers]
    assert all(len(s) == len(samplers[0]) for s in shares)  # every rank the same number of steps
    assert all(samplers[0].shares() == s.shares() for s in samplers)  # computed alike everywhere
    flat = [i for s in shares for i in s]
    if drop_last:
        assert len(flat) == len(set(flat)) == (n // world) * world  # disjoint
    else:
        assert set(flat) == set(range(n))  # complete; padding repeats only what is needed
        assert len(flat) - n == (-n) % world


def _spread(shares, lengths):
    """Mean over steps of (max - min) / mean of the ranks' sample lengths at that step."""
    return statistics.mean((max(c) - min(c)) / statistics.mean(c)
                           for c in zip(*[[lengths[i] for i in s] for s in shares]))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), world=st.integers(2, 8))
def test_ranks_get_matching_complexity_at_every_step(seed, world):
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.rand(512, generator=g) ** 2 * 500 + 4).int().tolist()  # skewed, like real text lengths
    balanced = [list(s) for s in _samplers(lengths, world, seed=seed)]
    plain = [list(DistributedSampler(lengths, num_replicas=world, rank=r, seed=seed)) for r in range(world)]
    assert _spread(balanced, lengths) < 0.25 * _spread(plain, lengths)


def test_epochs_are_deterministic_and_differ():
    lengths = list(range(1, 101))
    s = _samplers(lengths, 2)[0]
    s.set_epoch(3)
    first = list(s)
    assert first == list(s)
    s.set_epoch(4)
    assert list(s) != first
    assert list(_samplers(lengths, 2, shuffle=False)[0]) == list(_samplers(lengths, 2, shuffle=False)[0])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(n=st.integers(8, 200), world=st.integers(1, 4), budget=st.integers(60, 400), drop_last=st.booleans())
def test_batch_sampler_gives_every_rank_the_same_number_of_batches(n, world, budget, drop_last):
    lengths = [(i * 31) % 50 + 10 for i in range(n)]

    def token_budget(indices):  # batches of at most `budget` tokens, as dynamic batching does
        batches, current, used = [], [], 0
        for i in indices:
            if current and used + lengths[i] > budget:
                batches.append(current)
                current, used = [], 0
            current.append(i)
            used += lengths[i]
        return batches + ([current] if current else [])

    per_rank = [LoadBalancingDistributedBatchSampler(s, token_budget, drop_last=drop_last)
                for s in _samplers(lengths, world)]
    batches = [list(b) for b in per_rank]
    assert len({len(b) for b in batches}) == 1 and all(len(b) == len(per_rank[0]) for b in batches)
    for r, bs in enumerate(batches):
        share = set(per_rank[r].sampler.shares()[r])
        assert all(i in share for b in bs for i in b)


def test_a_drop_in_for_distributed_sampler_in_a_data_loader():
    data = [torch.full((n,), float(n)) for n in [5, 40, 7, 33, 12, 28, 9, 50, 3, 44, 21, 16]]
    sampler = LoadBalancingDistributedSampler(data, complexity_fn=lambda i: len(data[i]), num_replicas=2, rank=1,
                                              window=3)
    batches = LoadBalancingDistributedBatchSampler(sampler, lambda idx: [idx[i:i + 2] for i in range(0, len(idx), 2)])
    loader = DataLoader(data, batch_sampler=batches, collate_fn=lambda xs: torch.nn.utils.rnn.pad_sequence(xs))
    shapes = [tuple(b.shape) for b in loader]
    assert len(shapes) == 3 and all(s[1] == 2 for s in shapes)
