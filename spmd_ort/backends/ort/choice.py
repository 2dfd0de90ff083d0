"""The first run of a program on the ORT backend: every segment checked, timed on both executors, one chosen.

:class:`FirstRun` runs each ORT segment and its fx graph, compares them
(:func:`~spmd_ort.backends.ort.verify.checked_first_run`), times both and, with
``Options.segment_executor`` = ``auto`` (the default), keeps the faster for the steps
that follow; downstream nodes read the fx result, so the first step's numbers are eager's.
On several ranks each segment's times are averaged over the ranks and a failure anywhere
sends the segment to fx everywhere, so every rank runs the same executor per segment:
replicas compute the same numbers.
Then :func:`choose_whole` times the whole step as chosen against the whole graph on fx,
unsplit, and keeps the faster; a program that lives long enough to pay for its compile
(:mod:`spmd_ort.tuner`) times the whole graph compiled by inductor against that
(``Options.auto_inductor``, where a C++ compiler is found): the automatic choice never
loses to its own candidates.  Each choice is reported upward as a
:class:`~spmd_ort.graph.decisions.Decision` (``OrtExecutor.decisions()``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import fx

from spmd_ort.backends.ort.remembered import Remembered
from spmd_ort.backends.ort.session import OrtSegment
from spmd_ort.backends.ort.stats import OrtStats, SegmentChoice, WholeChoice
from spmd_ort.backends.checked import agree_segment
from spmd_ort.backends.ort.verify import checked_first_run
from spmd_ort.graph import ops
from spmd_ort.runtime.collectives import control_group
from spmd_ort.runtime.step_runtime import active
from spmd_ort.runtime.devices import now, rng_kept
from spmd_ort.runtime.interpreter import RunInterpreter

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

    def __init__(self, gm: fx.GraphModule, stats: OrtStats, *, policy: str, verify: bool, segment_executor: str,
                 remembered: Remembered | None = None):
        super().__init__(gm)
        self.stats, self.policy, self.verify, self.segment_executor = stats, policy, verify, segment_executor
        self.remembered = remembered  # an earlier run's choices (auto): checked again here, not timed again
        # a graph of this rank's own (pipeline stages: its transfers pair with other graphs' transfers): each
        # segment is decided here alone, and a failure is raised after the run, once every rank has finished it
        self.local = any(n.op == "call_function" and n.target in ops.P2P for n in gm.graph.nodes)
        self.error: Exception | None = None

    def call_module(self, target, args, kwargs):
        seg = self.module.get_submodule(target)
        if not isinstance(seg, OrtSegment) or seg.use_fallback:
            return super().call_module(target, args, kwargs)
        known = self.remembered.segment(seg.name) if self.remembered is not None else None
        timing = self.segment_executor == "auto" and known is None
        # with auto, fx's timing runs come before ORT's outputs exist, each dropping the last one's outputs (it
        # computes them again): the host's peak holds one set of fx outputs and one run's intermediates
        fx_s, reference = timed_fx_runs(seg.fallback, args, repeat=timing)
        try:
            ort_s, error = checked_first_run(seg.name, seg, args, reference, self.stats, self.policy,
                                             self.verify), None
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks' agreement (no rank left waiting)
            ort_s, error = None, exc
        if error is not None and self.local:  # raised once the run is over (its peers wait on its transfers)
            self.error, error = self.error or error, None
        seg.checked_runs += 1  # ORT's outputs compared, the fx graph's used
        if seg.new_sizes is not None:
            seg.new_sizes.checked.add(seg.sizes.key(args))
        times = {"fx": fx_s, "ort": ort_s}
        if ort_s is not None and timing:
            times = {"fx": fx_s, "ort": fastest(seg.run_ort, args, ort_s)}
        times, failed_elsewhere = agree_segment("ORT", seg.name, times, error, failed="ort", local=self.local)
        if ort_s is None or failed_elsewhere:
            if failed_elsewhere and ort_s is not None:
                self.stats.fell_back(seg.name, "ONNX Runtime failed or differed on another rank: every rank runs "
                                               "it on fx, so all compute alike")
            seg.release()
            return reference
        self._choose(seg, times, known)
        return reference

    def _choose(self, seg: OrtSegment, times: dict[str, float], known: dict | None = None) -> None:
        """With ``auto``, keep the faster executor on the ranks' summed times (ties go to ORT), or what an
        earlier run chose (``known``, the same on every rank); every rank chooses alike, so replicas compute
        the same numbers (a parameter update on ORT on one rank and on fx on another would let them drift
        apart by rounding)."""
        mode = self.segment_executor
        if mode == "auto" and known is not None:
            self.stats.choices[seg.name] = SegmentChoice(known["executor"], known["ort_ms"], known["fx_ms"], True)
            if known["executor"] == "fx":
                seg.park()
            return
        if mode != "auto":
            self.stats.choices[seg.name] = SegmentChoice(mode)
            if mode == "fx":
                seg.release()
            return
        choice = "fx" if times["fx"] < times["ort"] else "ort"
        self.stats.choices[seg.name] = SegmentChoice(choice, ort_ms=times["ort"] * 1e3, fx_ms=times["fx"] * 1e3)
        if choice == "fx":
            seg.park()  # its session kept: the whole step with every segment on ORT is a candidate (choose_whole)


def _wants_more(samples: list[float]) -> bool:
    """Whether a timing has too few samples yet: fewer than :data:`TIMED_RUNS`' least, or fewer than its most
    while within :data:`TIMING_BUDGET_S`."""
    least, most = TIMED_RUNS
    return len(samples) < least or (len(samples) < most and sum(samples) < TIMING_BUDGET_S)


def fastest(run, args, first: float) -> float:
    """The fastest of ``first`` (the checked run's time) and further runs of ``run``."""
    samples: list[float] = [first]
    while _wants_more(samples):
        t0 = now()
        run(*args)
        samples.append(now() - t0)
    return min(samples)


def timed_fx_runs(run, args, repeat: bool) -> tuple[float, object]:
    """Run ``run`` (an fx graph: new output tensors each run) on ``args``; with ``repeat``, again as
    :func:`fastest` does, each run's outputs dropped before the next computes them again.  Returns the fastest
    run's seconds and the last run's outputs (only this frame holds them: the drop frees them)."""
    t0 = now()
    result = run(*args)
    samples: list[float] = [now() - t0]
    while repeat and _wants_more(samples):
        result = None  # noqa: F841 - freed before the run that replaces it
        t0 = now()
        result = run(*args)
        samples.append(now() - t0)
    return min(samples), result


# Timing runs of each whole-step candidate, alternating.  A fixed number: every rank must run the same
# steps (they issue the step's collectives), and the median of 3 is robust to one slow run.
WHOLE_RUNS = 3
# What a candidate must gain over what runs now to replace it (on a revisit, spmd_ort.tuner): less is noise here
# (interleaved runs of one program differ by a few percent on this 2-core machine; bench/early.py).
MARGIN = 0.05


def choose_whole(runners: dict[str, fx.GraphModule], inputs: list, stats: OrtStats, field: str = "whole",
                 keep: str | None = None) -> str:
    """Time the step on each of ``runners`` (the partitioned graph with each segment where it chose to run,
    ``"segments"``; with every segment on ORT, ``"ort"``; the same graph on fx, unsplit, ``"fx"``; compiled by
    inductor, ``"inductor"``) on ``inputs`` (copies: the runs update state in place), alternating, and return the
    fastest's name by the median of each one's runs; what decided goes to ``stats.<field>``.  ``keep``: the one
    that runs now, which another must beat by :data:`MARGIN` to replace.  Ranks agree (their times are
    averaged), torch's RNG and the step's collective figures are as before, so the timing runs change nothing but
    the choice."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    runs = {m: m.runs for gm in runners.values() for m in gm.modules() if isinstance(getattr(m, "runs", None), int)}
    with untouched():
        for _ in range(WHOLE_RUNS):
            for name, gm in runners.items():
                t0 = now()
                gm(*inputs)
                active().comm.finish()  # this run's collectives, before the next run issues its own
                times[name].append(now() - t0)
    for m, n in runs.items():  # timing runs are no steps (a segment's runs count steps that used it)
        m.runs = n
    median = torch.tensor([sorted(v)[len(v) // 2] for v in times.values()], dtype=torch.float64)
    if _world() > 1:  # every rank decides alike: on the ranks' mean times
        dist.all_reduce(median, group=control_group())
        median /= _world()
    names = list(times)
    best = names[int(torch.argmin(median))]
    if keep in times and median[names.index(best)] > median[names.index(keep)] * (1 - MARGIN):
        best = keep  # within the noise of what runs now
    setattr(stats, field, WholeChoice(best, tuple((name, float(t) * 1e3) for name, t in zip(names, median))))
    return best


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def everywhere(flag: bool) -> bool:
    """``flag`` holds on every rank (each rank's segment choices are its own)."""
    if _world() == 1:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return int(t) == 0


@contextlib.contextmanager
def untouched():
    """Timing runs leave no trace: torch's RNG (random ops draw from it) and the step's collective counts."""
    comm = active().comm
    counts = comm.step
    comm.step = type(counts)()
    try:
        with rng_kept():
            yield
    finally:
        comm.step = counts
