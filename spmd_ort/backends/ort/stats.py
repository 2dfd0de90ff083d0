"""What the ONNX Runtime backend did with a program's segments: exports, fallbacks, checks, executor choices.

Kept on the :class:`~spmd_ort.backends.ort.executor.OrtExecutor` (``describe()`` and ``explain()`` print it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_ort.backends.checked import CheckStats


@dataclass(frozen=True)
class SegmentChoice:
    """Which executor runs a segment after the first run, and (``auto``) the warm times that decided it."""

    executor: str
    ort_ms: float | None = None
    fx_ms: float | None = None
    remembered: bool = False  # chosen in an earlier run of the program (backends/ort/remembered.py)

    def __str__(self) -> str:
        if self.ort_ms is None:
            return f"{self.executor} (SPMD_ORT_SEGMENT_EXECUTOR={self.executor})"
        return f"{self.executor} (ort {self.ort_ms:.2f} ms, fx {self.fx_ms:.2f} ms{self.since})"

    @property
    def since(self) -> str:
        return ", remembered from an earlier run" if self.remembered else ""


@dataclass(frozen=True)
class WholeChoice:
    """After the segments' choices (``auto``): the whole step as chosen against every segment on ORT, the whole
    graph on fx, unsplit, and compiled by inductor (where it is a candidate).

    ``executor`` is ``"segments"`` (as chosen), ``"ort"``, ``"fx"`` or ``"inductor"``; ``times_ms``: each
    candidate's median over the timed runs (empty: not timed, e.g. no segment runs on ORT and inductor was no
    candidate)."""

    executor: str
    times_ms: tuple[tuple[str, float], ...] = ()
    remembered: bool = False  # chosen in an earlier run of the program (backends/ort/remembered.py)

    WHERE = {"segments": "the segments as chosen", "ort": "ORT in every segment", "fx": "fx, unsplit",
             "inductor": "inductor's compiled segments"}

    def __str__(self) -> str:
        where = self.WHERE[self.executor]
        if not self.times_ms:
            return f"the whole graph runs on {where} (no segment runs on ORT)"
        since = ", remembered from an earlier run" if self.remembered else ""
        return f"the whole graph runs on {where} ({', '.join(f'{k} {ms:.2f} ms' for k, ms in self.times_ms)}{since})"


@dataclass
class OrtStats(CheckStats):
    segments: int = 0
    host_ops: dict = field(default_factory=dict)  # op -> why it stays on the host
    export_seconds: float = 0.0
    cache_hits: int = 0
    choices: dict = field(default_factory=dict)  # segment -> SegmentChoice
    upgrade: WholeChoice | None = None  # the tuner's inductor candidate: what ran against inductor's compiled graph
    upgrade_seconds: float = 0.0  # inductor's compile, checked run and timing
    upgrade_step: int = 0  # the program's step at which the tuner timed it
    whole: WholeChoice | None = None  # auto: the whole step on the segments as chosen, on ORT only, or on fx unsplit
    revisit: WholeChoice | None = None  # the tuner's second timing of the same candidates, after steady steps
    revisit_step: int = 0
    first_run_seconds: float = 0.0  # the checked first run: both executors, comparison, timing (verify_seconds)

    def why_fx(self, segment: str) -> str | None:
        """Why ``segment`` fell back to fx (its own failure, or its failure at some sizes), or None."""
        return next((why for name, why in self.fallback_reasons.items()
                     if name == segment or name.startswith(f"{segment} at sizes") or name.startswith(f"{segment}_")),
                    None)
