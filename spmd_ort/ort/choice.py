"""The first run of a program on the ORT backend: every segment checked, timed on both executors, one chosen.

:class:`FirstRun` runs each ORT segment and its fx graph, compares them
(:func:`~spmd_ort.ort.verify.checked_first_run`), times both and, with
``Options.segment_executor`` = ``auto`` (the default), keeps the faster for the steps
that follow; downstream nodes read the fx result, so the first step's numbers are eager's.
"""

from __future__ import annotations

import time

from torch import fx

from spmd_ort.ort.session import OrtSegment
from spmd_ort.runtime.interpreter import RunInterpreter
from spmd_ort.ort.stats import OrtStats, SegmentChoice
from spmd_ort.ort.verify import checked_first_run

# Timing on the first run: each executor's checked run is its first sample; then it runs the segment back to
# back (switching between ORT's and torch's thread pools costs more than a small segment: measured up to
# 0.3 s on a loaded 2-core machine) until it has TIMED_RUNS[0] samples, and up to TIMED_RUNS[1] while they
# take less than TIMING_BUDGET_S; the fastest counts.
TIMED_RUNS, TIMING_BUDGET_S = (2, 5), 0.25


class FirstRun(RunInterpreter):
    """Runs every ORT segment and its fx graph, compares and times them; downstream uses the fx result.

    ``policy``: ``Options.fallback_policy``; ``verify``: compare outputs; ``segment_executor``:
    ``auto`` (time both, keep the faster), ``ort`` or ``fx``.  What it decides goes into ``stats``.
    """

    def __init__(self, gm: fx.GraphModule, stats: OrtStats, *, policy: str, verify: bool, segment_executor: str):
        super().__init__(gm)
        self.stats, self.policy, self.verify, self.segment_executor = stats, policy, verify, segment_executor

    def call_module(self, target, args, kwargs):
        seg = self.module.get_submodule(target)
        if not isinstance(seg, OrtSegment) or seg.use_fallback:
            return super().call_module(target, args, kwargs)
        t0 = time.perf_counter()
        reference = seg.fallback(*args)
        fx_s = time.perf_counter() - t0
        ort_s = checked_first_run(seg.name, seg, args, reference, self.stats, self.policy, self.verify)
        seg.checked_runs += 1  # ORT's outputs compared, the fx graph's used
        if seg.new_sizes is not None:
            seg.new_sizes.checked.add(seg.sizes.key(args))
        if ort_s is None:
            seg.use_fallback = True
            return reference
        self._choose(seg, args, {"fx": fx_s, "ort": ort_s})
        return reference

    def _choose(self, seg: OrtSegment, args, first: dict[str, float]) -> None:
        """Time both executors on this segment; with ``auto``, keep the faster (ties go to ORT)."""
        mode = self.segment_executor
        if mode != "auto":
            self.stats.choices[seg.name] = SegmentChoice(mode)
            seg.use_fallback = mode == "fx"
            return
        fx_s, ort_s = fastest(seg.fallback, args, first["fx"]), fastest(seg.run_ort, args, first["ort"])
        choice = "fx" if fx_s < ort_s else "ort"
        self.stats.choices[seg.name] = SegmentChoice(choice, ort_ms=ort_s * 1e3, fx_ms=fx_s * 1e3)
        seg.use_fallback = choice == "fx"


def fastest(run, args, first: float) -> float:
    """The fastest of ``first`` (the checked run's time) and further runs of ``run``."""
    least, most = TIMED_RUNS
    samples: list[float] = [first]
    while len(samples) < least or (len(samples) < most and sum(samples) < TIMING_BUDGET_S):
        t0 = time.perf_counter()
        run(*args)
        samples.append(time.perf_counter() - t0)
    return min(samples)
