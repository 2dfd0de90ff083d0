"""Spans of profiled steps (``train_step.profile``): what ran when, on three lanes per rank.

The executors record segments and host nodes (``spmd_ort.backends.timed.TimedInterpreter``), the communicator
each collective from issue to completion; ``spmd_ort.debug.timeline`` draws them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Span:
    name: str
    lane: str
    start: float  # seconds since the recorder's origin
    end: float
    step: int


@dataclass
class Recorder:
    """Spans of the profiled steps of one rank."""

    steps: int
    origin: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    step: int = 0
    step_bounds: list[tuple[float, float]] = field(default_factory=list)

    def add(self, name: str, lane: str, start: float, end: float) -> None:
        self.spans.append(Span(name, lane, start - self.origin, end - self.origin, self.step))

    def step_done(self, start: float, end: float) -> None:
        self.step_bounds.append((start - self.origin, end - self.origin))
        self.step += 1

    @property
    def done(self) -> bool:
        return self.step >= self.steps
