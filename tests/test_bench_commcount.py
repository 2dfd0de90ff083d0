"""bench/commcount.py counts each collective call once, with its real payload, on a 2-rank gloo group.

Two ranks, because on one a gather's output is as large as its input and a reduce-scatter's input as
large as its output: a counter reading the wrong argument would pass there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BENCH = Path(__file__).resolve().parent.parent / "bench"
WORLD = 2
pytestmark = pytest.mark.multiproc


def _cases(rank: int):
    """(name, call, expected bytes): gathers count what they gather, reduce-scatters what goes in."""
    shard = torch.full((1000,), float(rank + 1))  # 4000 bytes per rank
    gathered = torch.empty(WORLD * 1000)  # 8000 bytes
    scattered = torch.empty(1000)
    whole = torch.ones(WORLD * 1000)
    return [
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(gathered, shard), 8000),  # nests below
        ("all_gather_single", lambda: dist.all_gather_single(gathered, shard), 8000),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(scattered, whole), 8000),  # nests below
        ("all_reduce", lambda: dist.all_reduce(torch.ones(250)), 1000),
        ("broadcast", lambda: dist.broadcast(torch.ones(10, dtype=torch.float64), src=0), 80),
        ("all_gather", lambda: dist.all_gather([torch.empty(5) for _ in range(WORLD)], torch.ones(5)), 40),
    ], gathered, scattered


def _worker(rank: int, init: str) -> None:
    sys.path.insert(0, str(BENCH))
    from commcount import CommCounter

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        counter = CommCounter().install()
        counter.enabled = True
        cases, gathered, scattered = _cases(rank)
        for name, call, payload in cases:
            before_bytes, before_calls = counter.bytes, counter.calls
            call()
            got = (counter.bytes - before_bytes, counter.calls - before_calls)
            assert got == (payload, 1), f"rank {rank} {name}: counted (bytes, calls) {got}, expected {(payload, 1)}"
        # the collectives ran for real: both shards gathered, the sum of two ranks' ones scattered
        assert torch.equal(gathered, torch.cat([torch.full((1000,), 1.0), torch.full((1000,), 2.0)]))
        assert torch.equal(scattered, torch.full((1000,), float(WORLD)))
        counter.enabled = False
        before = (counter.bytes, counter.calls)
        dist.all_reduce(torch.ones(4))
        assert (counter.bytes, counter.calls) == before, "counted while disabled"
    finally:
        dist.destroy_process_group()


def test_each_entry_point_counts_its_payload_once_on_two_ranks(tmp_path):
    # a rank's assertion error is re-raised here with its traceback (ProcessRaisedException)
    mp.spawn(_worker, args=(f"file://{tmp_path / 'store'}",), nprocs=WORLD, join=True)
