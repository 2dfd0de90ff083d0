"""Analyses of the finished distributed graph (they record results; the graph is unchanged)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from spmd_ort.graph import ops
from spmd_ort.graph.flops import EXPERT_COST
from spmd_ort.graph.segments import capture_verdict, tensors_of
from spmd_ort.graph.liveness import plan_activation_memory

from .context import PassResult
from .contracts import Invariant
from .helpers import compute_device, placeholders
from .helpers import nbytes as nbytes_of
from .helpers import phase
from .runner import graph_pass


@dataclass(frozen=True)
class MemoryPlan(PassResult):
    """``plan_memory_pass``: peak bytes of the values the graph creates, freed after their last use, and the bytes
    of forward values kept for the backward among those live at that peak."""

    planned_peak_bytes: int
    saved_for_backward_bytes: int = 0
    live: tuple = field(default=(), repr=False, compare=False)  # bytes live while each node runs (the plan's picture)

    def lines(self) -> list[str]:
        return [(f"planned peak of values the step creates: {self.planned_peak_bytes / 2**20:.2f} MiB, of which "
                 f"{self.saved_for_backward_bytes / 2**20:.2f} MiB forward values kept for the backward")]


MEMORY_PLANNED = Invariant("memory_planned", "the memory plan is recorded",
                           lambda gm, ctx: None if MemoryPlan in ctx.results else "no memory plan recorded")


@graph_pass(provides=[MEMORY_PLANNED])
def plan_memory_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Record the planned peak of the values the step creates (a :class:`MemoryPlan`).

    Planned on the whole graph as it runs, after the optimizer updates its state in place
    (``reinplace_optimizer_pass``: a functional optimizer's fresh copy of every parameter and state tensor is no
    value the step keeps) and before the backend fuses parts of it into segments.
    """
    plan = plan_activation_memory(gm)
    ctx.results.record(MemoryPlan(planned_peak_bytes=plan.peak, saved_for_backward_bytes=plan.saved_for_backward,
                                  live=plan.live))
    return gm


@dataclass(frozen=True)
class CollectiveCounts(PassResult):
    """``count_collectives_pass``: per kind of collective (all-gathers per phase), the calls one step makes and
    their payload bytes (what an all-gather returns; what the others send)."""

    calls: dict[str, int]
    nbytes: dict[str, int]

    def lines(self) -> list[str]:
        if not self.calls:
            return ["collectives per step: none"]
        return ["collectives per step: " + ", ".join(f"{kind} x{n} ({self.nbytes[kind] / 2**20:.2f} MiB)"
                                                       for kind, n in self.calls.items())]


COLLECTIVE_KINDS = {ops.all_reduce_: "all-reduce", ops.reduce_scatter: "reduce-scatter", ops.broadcast_: "broadcast",
                    ops.all_gather: "all-gather", ops.p2p_send: "send (pipeline)"}


@graph_pass()
def count_collectives_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Record how many collectives of each kind one step issues, and their bytes (a :class:`CollectiveCounts`).

    Counted on the finished distributed graph, so ``describe()`` and ``explain()`` show what runs, next to
    the communicator's measured figures.  All-gathers are told apart by phase (forward, backward).  A payload
    whose size is symbolic (a tensor-parallel layer's activations under dynamic shapes) counts at the sizes the
    program was traced with.
    """
    calls: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target) if node.op == "call_function" else None
        if EXPERT_COST in node.meta:  # an experts host node's exchanges (spmd_ort.passes.expert_parallel)
            cost = node.meta[EXPERT_COST]
            calls["all-to-all"] = calls.get("all-to-all", 0) + cost["all_to_all_calls"]
            nbytes["all-to-all"] = nbytes.get("all-to-all", 0) + cost["all_to_all_bytes"]
        if kind is None:
            continue
        payload = node if node.target is ops.all_gather else node.args[0]
        if node.target is ops.all_gather:
            kind = f"{kind} ({phase(node)})"
        calls[kind] = calls.get(kind, 0) + 1
        nbytes[kind] = nbytes.get(kind, 0) + nbytes_of(payload)
    ctx.results.record(CollectiveCounts(calls=dict(sorted(calls.items())), nbytes=dict(sorted(nbytes.items()))))
    return gm


@dataclass(frozen=True)
class CapturePlan(PassResult):
    """``plan_graph_capture_pass``: how the finished graph of a step on a GPU would run as CUDA graphs.

    ``cuda``: the step's tensors are on a GPU (otherwise there is nothing to capture and nothing is shown);
    ``regions``: the call nodes of each run of nodes one graph can hold, in order; ``splits``: (node, why) for
    each node that must run on the host between two graphs; ``blocker``: why no graph can hold the step (None:
    one can); ``per_size``: the program has symbolic sizes, so one set of graphs per size seen."""

    cuda: bool
    regions: tuple[int, ...] = ()
    splits: tuple[tuple[str, str], ...] = ()
    blocker: str | None = None
    per_size: bool = False

    @property
    def capturable(self) -> bool:
        return self.cuda and self.blocker is None and bool(self.regions)

    def lines(self) -> list[str]:
        if not self.cuda:
            return []
        if self.blocker is not None:
            return [f"CUDA graph capture: not possible: {self.blocker}"]
        head = (f"CUDA graph capture: {len(self.regions)} graph{'s' if len(self.regions) != 1 else ''} "
                f"({' + '.join(map(str, self.regions))} ops)")
        if self.per_size:
            head += ", one set per size seen (symbolic sizes)"
        return [head] + [f"  runs between graphs: {name}: {why}" for name, why in self.splits]


@graph_pass()
def plan_graph_capture_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Record how the finished graph of a GPU step would be captured as CUDA graphs (a :class:`CapturePlan`):
    the runs of nodes one graph each can hold, the nodes that split them (an opaque part's Python, a value read
    on the host, work on host tensors: gloo's collectives, offload's copies, a hyper-parameter kept on the host)
    and what would stop any capture (an output whose size depends on the values). NCCL collectives, random ops
    (torch registers its generator with the graph) and the GPU's index checks (device-side asserts) capture.
    ``explain()`` shows it for steps on a GPU; on the CPU it records that there is nothing to capture."""
    if compute_device(gm, ctx.input_slots).type != "cuda":
        ctx.results.record(CapturePlan(cuda=False))
        return gm
    per_size = any(isinstance(d, torch.SymInt) for n in placeholders(gm) for t in tensors_of(n.meta.get("val"))
                   for d in t.shape)
    regions: list[int] = []
    splits: list[tuple[str, str]] = []
    current = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        verdict = capture_verdict(node)
        if verdict is None:
            current += 1
            continue
        kind, why = verdict
        if kind == "block":
            ctx.results.record(CapturePlan(cuda=True, blocker=f"{node.name}: {why}", per_size=per_size))
            return gm
        if current:
            regions.append(current)
        current = 0
        splits.append((node.name, why))
    if current:
        regions.append(current)
    ctx.results.record(CapturePlan(cuda=True, regions=tuple(regions), splits=tuple(splits), per_size=per_size))
    return gm
