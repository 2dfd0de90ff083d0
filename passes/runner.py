"""The pass runner: checks the pipeline's order, applies the passes, checks their contracts, records each."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from spmd_ort.errors import ConfigError, CompileError

from .context import PassContext, PassRecord
from .contracts import ALWAYS, Invariant, traced_facts
from spmd_ort.options import get_logger

logger = get_logger(__name__)

GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


class PassError(CompileError):
    """A graph pass failed, or the pipeline's order breaks a contract: a compile error (nothing has touched the
    model yet) naming the pass."""


@dataclass(frozen=True)
class Contract:
    """What a pass requires of the graph it gets, provides in the graph it returns, and may break."""

    requires: tuple[Invariant, ...] = ()
    provides: tuple[Invariant, ...] = ()
    invalidates: tuple[Invariant, ...] = ()
    declared: bool = True  # False: a user transform, which declares nothing (its results are checked)


UNDECLARED = Contract(declared=False)


def graph_pass(*, requires: Sequence[Invariant] = (), provides: Sequence[Invariant] = (),
               invalidates: Sequence[Invariant] = ()):
    """Declare a pass's contract (:mod:`spmd_ort.passes.contracts`).

    ``requires``: facts that must hold of the graph it gets (provided by the trace or an earlier
    pass); ``provides``: facts that hold of the graph it returns; ``invalidates``: facts that held
    before and may not hold after it (e.g. expanding gradient tags invalidates ``grads_tagged``).
    The function stays a plain ``(gm, ctx) -> gm`` pass.
    """

    def mark(fn: GraphPass) -> GraphPass:
        fn.contract = Contract(tuple(requires), tuple(provides), tuple(invalidates))
        return fn

    return mark


def contract_of(graph_pass: GraphPass) -> Contract:
    return getattr(graph_pass, "contract", UNDECLARED)


def pass_name(graph_pass: GraphPass) -> str:
    return getattr(graph_pass, "__name__", repr(graph_pass))


def op_counts(gm: fx.GraphModule) -> Counter:
    """How often each call_function target appears: ``{"aten.mm.default": 12, ...}``."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def check_order(passes: Sequence[GraphPass], ctx: PassContext) -> None:
    """Check, before anything runs, that each pass's requirements hold when it runs: a fact it requires is
    provided by the trace (or the passes already run on ``ctx``) or an earlier enabled pass, and not
    invalidated in between.  A violation is a :class:`PassError` naming the pass and the pass that provides
    what it lacks (disabled, later, or undone by another)."""
    held = set(ctx.facts)
    invalidated: dict[Invariant, str] = {}
    providers: dict[Invariant, list[str]] = {}
    for p in passes:
        for fact in contract_of(p).provides:
            providers.setdefault(fact, []).append(pass_name(p))
    for p in passes:
        name, contract = pass_name(p), contract_of(p)
        if name in ctx.disabled:
            continue
        for fact in contract.requires:
            if fact not in held:
                raise PassError(f"graph pass `{name}` requires `{fact}` ({fact.doc}), "
                                f"{_why_missing(fact, name, providers, invalidated, passes, ctx)}")
        for fact in contract.invalidates:
            held.discard(fact)
            invalidated[fact] = name
        held |= set(contract.provides)


def _why_missing(fact: Invariant, name: str, providers: dict, invalidated: dict, passes, ctx) -> str:
    names = [pass_name(p) for p in passes]
    who = providers.get(fact, [])
    if not who:
        return "which neither the trace nor any pass of this pipeline provides"
    disabled = [w for w in who if w in ctx.disabled]
    if disabled:
        return (f"which `{disabled[0]}` provides, but `{disabled[0]}` is disabled (SPMD_ORT_DISABLE_PASSES); "
                f"enable it, or disable `{name}` too")
    if fact in invalidated:
        return f"which `{who[0]}` provides, but `{invalidated[fact]}` invalidates it before `{name}` runs"
    return f"which `{who[0]}` provides, but `{who[0]}` runs after `{name}` (position {names.index(who[0]) + 1} " \
           f"vs {names.index(name) + 1})"


def _check(gm: fx.GraphModule, ctx: PassContext, facts, name: str, when: str, done: list[str]) -> None:
    for fact in facts:
        if fact.check is None:
            continue
        problem = fact.check(gm, ctx)
        if problem is not None:
            ran = ", ".join(done) or "none"
            hint = " (was a pass it relies on disabled?)" if when == "requires" else ""
            raise PassError(f"graph pass `{name}` {when} `{fact.name}` ({fact.doc}), which does not hold "
                            f"{'before' if when == 'requires' else 'after'} it: {problem}{hint}; "
                            f"passes already applied: {ran}")


def _check_kept(gm: fx.GraphModule, ctx: PassContext, name: str, later: dict[Invariant, str]) -> None:
    """The facts later passes require still hold after ``name`` (which did not declare breaking them)."""
    for fact, needed_by in later.items():
        if fact in ctx.facts and fact.check is not None:
            problem = fact.check(gm, ctx)
            if problem is not None:
                raise PassError(f"graph pass `{name}` broke `{fact.name}` ({fact.doc}), which `{needed_by}` "
                                f"requires later: {problem}")


def _later_requirements(passes: Sequence[GraphPass], ctx: PassContext) -> list[dict[Invariant, str]]:
    """For each position, the facts enabled passes after it require (fact -> the first such pass)."""
    out: list[dict[Invariant, str]] = []
    later: dict[Invariant, str] = {}
    for p in reversed(passes):
        out.append(dict(later))
        if pass_name(p) not in ctx.disabled:
            later.update({fact: pass_name(p) for fact in contract_of(p).requires})
    return out[::-1]


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[GraphPass]) -> fx.GraphModule:
    """Check the order of ``passes``, then apply them in order; lint and recompile after each; check
    contracts on the graph (``ctx.check_contracts``; after user transforms always); log and record each."""
    if ctx.facts is None:
        ctx.facts = traced_facts(ctx)
    check_order(passes, ctx)
    # torch's lazily recompiled GraphModule: a pass's recompile() only marks the code stale, and the code is
    # generated when something runs the module or reads its code (generating a 1000-node graph's code after
    # every pass took ~0.4 s of a gpt-mini compile).
    gm = _LazyGraphModule.from_graphmodule(gm)
    later = _later_requirements(passes, ctx)
    done: list[str] = []
    for graph_pass, needed_later in zip(passes, later):
        name, contract = pass_name(graph_pass), contract_of(graph_pass)
        before = len(gm.graph.nodes)
        if name in ctx.disabled:
            ctx.applied.append(PassRecord(name=name, seconds=0.0, nodes_before=before, nodes_after=before,
                                          skipped=True))
            logger.debug("pass %s disabled", name)
            continue
        if ctx.check_contracts:
            _check(gm, ctx, contract.requires, name, "requires", done)
        t0 = time.perf_counter()
        try:
            out = graph_pass(gm, ctx)
            if not isinstance(out, fx.GraphModule):
                raise TypeError(f"returned {type(out).__name__}, not a torch.fx.GraphModule")
            out.graph.lint()
            out = _LazyGraphModule.from_graphmodule(out)  # a pass that built a new module: lazy again
            out.recompile()
        except ConfigError:
            raise  # the user's configuration, which the pass found wrong: its own words name the fix
        except Exception as exc:
            ran = ", ".join(done) or "none"
            where = {k: getattr(exc, k, None) for k in ("fqn", "op", "rank")}
            detail = getattr(exc, "detail", exc)
            raise PassError(f"graph pass `{name}` failed (passes already applied: {ran}): {detail}", **where) from exc
        seconds = time.perf_counter() - t0
        gm = out
        ctx.facts -= set(contract.invalidates)
        if ctx.check_contracts or not contract.declared:  # a broken fact a later pass needs: name both passes
            _check_kept(gm, ctx, name, {f: w for f, w in needed_later.items() if f not in contract.provides})
        if ctx.check_contracts:
            _check(gm, ctx, ALWAYS + contract.provides, name, "provides", done)
        ctx.facts |= set(contract.provides)
        record = PassRecord(name=name, seconds=seconds, nodes_before=before, nodes_after=len(gm.graph.nodes))
        ctx.applied.append(record)
        done.append(name)
        logger.debug("pass %s", record)
    return gm
