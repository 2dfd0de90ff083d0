"""``bucket_cap_mb="auto"``'s cost model (spmd_ort.buckets) on measured rows it is given."""

from __future__ import annotations

import pytest

import spmd_ort
from spmd_ort import buckets as B

MiB = 2**20


def test_ready_curve_is_the_median_issue_time_of_each_bucket():
    sizes = [MiB // 2, 2 * MiB, MiB, 4 * MiB]
    steps = [[(n, t * k) for n, t in zip(sizes, [0.0, 0.010, 0.020, 0.040])] for k in (0.9, 1.0, 1.5)]
    ready = B.ready_curve(steps)
    assert ready == [(0.0, MiB / 2), (0.010, 2.5 * MiB), (0.020, 3.5 * MiB), (0.040, 7.5 * MiB)]
    costs = B.Costs(a=0.0, b=1e-9, ready=ready)
    assert costs.time_of(MiB / 2 + MiB) == pytest.approx(0.005)  # half-way through the second bucket
    assert B.ready_curve([[(MiB, 0.0)]]) is None  # one bucket: nothing to interpolate


def test_plan_is_the_passes_greedy_rule():
    assert B.plan([10, 10, 10, 10], 15, 25) == [10, 20, 10]
    assert B.plan([30, 5], 15, 25) == [30, 5]  # a gradient larger than the cap is a bucket alone


def test_small_buckets_win_when_backward_is_long_and_latency_small():
    """No contention (an accelerator's collectives): only the tail after backward costs, so small buckets."""
    sizes = [MiB] * 32
    costs = B.Costs(a=1e-5, b=1e-9, ready=[(0.0, MiB), (0.310, 32 * MiB)])  # 32 MiB over 310 ms
    exposed = {c: B.predict(costs, sizes, MiB, c * MiB) for c in B.CANDIDATES_MB}
    assert exposed[1.0] < exposed[4.0] < exposed[8.0] < exposed[16.0]  # the last bucket's transfer is what shows
    assert exposed[1.0] == pytest.approx(1e-5 + 1e-9 * MiB, rel=1e-6)
    # the whole payload in one bucket after backward: everything is exposed
    assert exposed[100.0] == pytest.approx(1e-5 + 1e-9 * 31 * MiB, rel=1e-6)


def test_large_buckets_win_when_latency_dominates():
    sizes = [MiB // 8] * 64
    costs = B.Costs(a=5e-3, b=1e-10, ready=[(0.0, MiB // 8), (0.010, 8 * MiB)])  # fast backward, slow startup
    exposed = {c: B.predict(costs, sizes, MiB // 8, c * MiB) for c in B.CANDIDATES_MB}
    assert min(exposed, key=exposed.get) >= 8.0


def test_contention_makes_fewer_buckets_win():
    """gloo ranks filling a CPU's cores (measured here: ~5 ms of the step lost per MiB reduced during
    backward): hiding the all-reduce behind compute costs about what waiting for it does, so the fewest
    buckets win; without contention the same costs pick small buckets."""
    sizes = [MiB] * 20
    ready = [(0.0, MiB), (0.250, 20 * MiB)]
    free = B.Costs(a=1e-4, b=3e-3 / MiB, ready=ready)
    busy = B.Costs(a=1e-4, b=3e-3 / MiB, ready=ready, stolen=5e-3 / MiB)
    best = {name: min(B.CANDIDATES_MB, key=lambda c: B.predict(costs, sizes, MiB, c * MiB))
            for name, costs in (("free", free), ("busy", busy))}
    assert best["free"] <= 1.0 and best["busy"] >= 25.0, best


def test_rows_of_picks_the_gradient_buckets():
    reductions = [("all_reduce", 4, 1.0, [1.5]), ("all_reduce", 100, 2.0, [2.5]), ("reduce_scatter", 8, 2.1, []),
                  ("all_reduce", 200, 3.0, [])]
    assert B.rows_of(reductions, (100, 200)) == [(100, 0.0), (200, 1.0)]
    assert B.rows_of(reductions, (100, 300)) is None


@pytest.mark.parametrize("bad", [0, -1.0, "big", True, None])
def test_bad_caps_are_refused(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        spmd_ort.DataParallel(bucket_cap_mb=bad)


def test_auto_is_the_default_and_starts_small_enough_to_measure():
    mode = spmd_ort.DataParallel()
    assert mode.auto_buckets and mode.cap_bytes == B.AUTO_START_MB * MiB
    tuner = B.BucketTuner()
    model = __import__("torch").nn.Linear(1024, 1024, bias=False)  # 4 MiB of parameters: a 16th is 0.25 MiB
    assert tuner.mode(mode, model).bucket_cap_mb == 0.25
    assert B.BucketTuner().mode(mode, __import__("torch").nn.Linear(2, 2)).bucket_cap_mb == B.MIN_START_MB
    assert spmd_ort.DataParallel(bucket_cap_mb=4).cap_bytes == 4 * MiB
    assert tuner.mode(spmd_ort.DataParallel(bucket_cap_mb=4), model).bucket_cap_mb == 4  # numbers win
