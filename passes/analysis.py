"""Analyses of the finished distributed graph (they record results; the graph is unchanged)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from spmd_ort.runtime.memory import planned_peak_bytes

from .context import PassResult
from .contracts import Invariant
from .runner import graph_pass


@dataclass(frozen=True)
class MemoryPlan(PassResult):
    """``plan_memory_pass``: peak bytes of the values the graph creates, freed after their last use."""

    planned_peak_bytes: int

    def lines(self) -> list[str]:
        return [f"planned peak of values the step creates: {self.planned_peak_bytes / 2**20:.2f} MiB"]


MEMORY_PLANNED = Invariant("memory_planned", "the memory plan is recorded",
                           lambda gm, ctx: None if MemoryPlan in ctx.results else "no memory plan recorded")


@graph_pass(provides=[MEMORY_PLANNED])
def plan_memory_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Record the planned peak of the values the step creates (a :class:`MemoryPlan`).

    Planned on the whole graph, before the backend fuses parts of it into segments.
    """
    ctx.results.record(MemoryPlan(planned_peak_bytes=planned_peak_bytes(gm)))
    return gm

