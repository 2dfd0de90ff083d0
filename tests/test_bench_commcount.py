"""bench/commcount.py counts each collective call once, with its real payload (one-rank gloo group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from commcount import CommCounter  # noqa: E402


@pytest.fixture
def counter(one_rank):
    from torch.distributed import distributed_c10d as c10d

    names = [n for n in dir(c10d) if "gather" in n or "scatter" in n or n in ("all_reduce", "broadcast")]
    saved = {(m, n): getattr(m, n) for m in (dist, c10d) for n in names if hasattr(m, n)}
    c = CommCounter().install()
    c.enabled = True
    yield c
    for (m, n), fn in saved.items():
        setattr(m, n, fn)


def test_each_entry_point_counts_its_payload_once(counter):
    shard = torch.ones(1000)  # 4000 bytes; world 1: the gathered tensor is as large
    out = torch.empty(1000)
    cases = [
        (lambda: dist.all_gather_into_tensor(out, shard), 4000),  # calls all_gather_single inside
        (lambda: dist.all_gather_single(out, shard), 4000),
        (lambda: dist.reduce_scatter_tensor(out, shard), 4000),  # calls reduce_scatter_single inside
        (lambda: dist.all_reduce(torch.ones(250)), 1000),
        (lambda: dist.broadcast(torch.ones(10, dtype=torch.float64), src=0), 80),
        (lambda: dist.all_gather([torch.empty(5)], torch.ones(5)), 20),
    ]
    for call, payload in cases:
        before_bytes, before_calls = counter.bytes, counter.calls
        call()
        assert (counter.bytes - before_bytes, counter.calls - before_calls) == (payload, 1)


def test_nothing_is_counted_while_disabled(counter):
    counter.enabled = False
    dist.all_reduce(torch.ones(4))
    assert counter.bytes == 0 and counter.calls == 0
