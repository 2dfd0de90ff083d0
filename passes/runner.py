"""The pass runner: applies an ordered list of graph passes, checks their contracts and records what each did."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from torch import fx

from spmd_ort.errors import CompileError

from .context import PassContext, PassRecord
from .contracts import ALWAYS, Invariant

logger = logging.getLogger("spmd_ort")

GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


class PassError(CompileError):
    """A graph pass failed: a compile error (nothing has touched the model yet) naming the pass."""


def graph_pass(*, requires: Sequence[Invariant] = (), ensures: Sequence[Invariant] = ()):
    """Declare what a pass requires of the graph it gets and ensures of the graph it returns.

    The function stays a plain ``(gm, ctx) -> gm`` pass; the runner reads the
    declarations (``fn.requires`` / ``fn.ensures``) when checking contracts.
    """

    def mark(fn: GraphPass) -> GraphPass:
        fn.requires = tuple(requires)
        fn.ensures = tuple(ensures)
        return fn

    return mark


def pass_name(graph_pass: GraphPass) -> str:
    return getattr(graph_pass, "__name__", repr(graph_pass))


def op_counts(gm: fx.GraphModule) -> Counter:
    """How often each call_function target appears: ``{"aten.mm.default": 12, ...}``."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _check(gm: fx.GraphModule, ctx: PassContext, invariants: Sequence[Invariant], name: str, when: str,
           done: list[str]) -> None:
    for inv in invariants:
        problem = inv.check(gm, ctx)
        if problem is not None:
            ran = ", ".join(done) or "none"
            hint = " (was a pass it relies on disabled?)" if when == "requires" else ""
            raise PassError(f"graph pass `{name}` {when} `{inv.name}` ({inv.doc}), which does not hold "
                            f"{'before' if when == 'requires' else 'after'} it: {problem}{hint}; "
                            f"passes already applied: {ran}")


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[GraphPass]) -> fx.GraphModule:
    """Apply ``passes`` in order; lint and recompile after each; check contracts; log and record each."""
    done: list[str] = []
    for graph_pass in passes:
        name = pass_name(graph_pass)
        before = len(gm.graph.nodes)
        if name in ctx.disabled:
            ctx.applied.append(PassRecord(name=name, seconds=0.0, nodes_before=before, nodes_after=before,
                                          skipped=True))
            logger.debug("pass %s disabled", name)
            continue
        if ctx.check_contracts:
            _check(gm, ctx, getattr(graph_pass, "requires", ()), name, "requires", done)
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
        seconds = time.perf_counter() - t0
        gm = out
        if ctx.check_contracts:
            _check(gm, ctx, ALWAYS + tuple(getattr(graph_pass, "ensures", ())), name, "ensures", done)
        record = PassRecord(name=name, seconds=seconds, nodes_before=before, nodes_after=len(gm.graph.nodes))
        ctx.applied.append(record)
        done.append(name)
        logger.debug("pass %s", record)
    return gm
