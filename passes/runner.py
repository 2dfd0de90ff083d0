"""The pass runner: applies an ordered list of graph passes and records what each did."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from spmd_ort.errors import CompileError

logger = logging.getLogger("spmd_ort")


@dataclass(frozen=True, kw_only=True)
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    skipped: bool = False

    def __str__(self) -> str:
        if self.skipped:
            return f"{self.name}: disabled"
        return f"{self.name}: {self.nodes_before} -> {self.nodes_after} nodes, {self.seconds * 1e3:.1f} ms"


@dataclass(kw_only=True)
class PassContext:
    """What passes may read and update besides the graph.

    ``input_slots``/``output_slots`` describe every placeholder/output (see
    ``spmd_ort.state.Slot``); a pass that adds or removes graph inputs or
    outputs keeps them in step.  ``disabled`` names passes to skip.
    """

    input_slots: list
    output_slots: list
    world_size: int = 1
    rank: int = 0
    parallel_mode: Any = None
    shard_specs: dict = field(default_factory=dict)  # fully_shard: param index -> spmd_ort.sharding.ShardSpec
    disabled: frozenset[str] = frozenset()
    applied: list[PassRecord] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


class PassError(CompileError):
    """A graph pass failed: a compile error (nothing has touched the model yet) naming the pass."""


def disabled_from_env() -> frozenset[str]:
    """Pass names listed in ``SPMD_ORT_DISABLE_PASSES`` (comma separated)."""
    raw = os.environ.get("SPMD_ORT_DISABLE_PASSES", "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def op_counts(gm: fx.GraphModule) -> Counter:
    """How often each call_function target appears: ``{"aten.mm.default": 12, ...}``."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[GraphPass]) -> fx.GraphModule:
    """Apply ``passes`` in order; lint and recompile after each; log and record it."""
    done: list[str] = []
    for graph_pass in passes:
        name = getattr(graph_pass, "__name__", repr(graph_pass))
        before = len(gm.graph.nodes)
        if name in ctx.disabled:
            ctx.applied.append(PassRecord(name=name, seconds=0.0, nodes_before=before, nodes_after=before,
                                          skipped=True))
            logger.debug("pass %s disabled", name)
            continue
        t0 = time.perf_counter()
        try:
            out = graph_pass(gm, ctx)
            if not isinstance(out, fx.GraphModule):
                raise TypeError(f"returned {type(out).__name__}, not a torch.fx.GraphModule")
            out.graph.lint()
            out.recompile()
        except Exception as exc:
            ran = ", ".join(done) or "none"
            where = {k: getattr(exc, k, None) for k in ("fqn", "op", "rank")}
            detail = getattr(exc, "detail", exc)
            raise PassError(f"graph pass `{name}` failed (passes already applied: {ran}): {detail}", **where) from exc
        gm = out
        record = PassRecord(name=name, seconds=time.perf_counter() - t0, nodes_before=before,
                            nodes_after=len(gm.graph.nodes))
        ctx.applied.append(record)
        done.append(name)
        logger.debug("pass %s", record)
    return gm
