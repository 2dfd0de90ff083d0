"""The executor interface every backend implements (:class:`Executor`), and the answers of one that has nothing
to report (:class:`ExecutorBase`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import fx

from spmd_ort.graph.decisions import Decision


@runtime_checkable
class Executor(Protocol):
    """Runs a finished graph (placeholders in, outputs out); it runs no graph passes of its own.  What the tuner,
    ``explain()`` and the plan ask of it is typed here (:class:`ExecutorBase` gives the answers of an executor that
    has nothing to say)."""

    name: str
    gm: fx.GraphModule  # what runs (for ORT: segments as submodules, host nodes between them)
    reuses_buffers: bool  # outputs live in buffers the next run overwrites: what escapes a step is copied
    stats: object | None  # the backend's statistics (segments, fallbacks, host ops, first run); None: none kept
    candidate_source: fx.GraphModule | None  # the whole graph the tuner may compile as inductor's candidate

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def describe(self) -> list[str]: ...

    def decisions(self) -> list[Decision]: ...  # what it chose from its own measurements, with the numbers

    def adopt(self, name: str, runner) -> None: ...  # run the steps on ``runner`` from now on (the tuner's choice)

    # the tuner's verdict on the candidate (kept, dropped, failed), kept for the next run of the same program
    def remember_candidate(self, outcome: str, detail: str) -> None: ...


class ExecutorBase:
    """The answers of an executor with nothing to report: no statistics, no candidate, no decisions, nothing to
    adopt."""

    stats = None
    candidate_source = None

    def decisions(self) -> list[Decision]:
        return []

    def remember_candidate(self, outcome: str, detail: str) -> None:
        pass  # no candidate, nothing remembered

    def adopt(self, name: str, runner) -> None:
        raise TypeError(f"the {self.name} executor runs its own graph; it adopts no {name}")
