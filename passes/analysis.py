"""Analyses of the finished distributed graph (they record results; the graph is unchanged)."""

from __future__ import annotations

from torch import fx

from spmd_ort.memory import planned_peak_bytes

from .context import MemoryPlan
from .contracts import MEMORY_PLANNED
from .runner import graph_pass


@graph_pass(ensures=[MEMORY_PLANNED])
def plan_memory_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Record the planned peak of the values the step creates (``ctx.results.memory``).

    Planned on the whole graph, before the backend fuses parts of it into segments.
    """
    ctx.results.memory = MemoryPlan(planned_peak_bytes=planned_peak_bytes(gm))
    return gm
