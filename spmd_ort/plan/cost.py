"""A roofline of one compiled step, walked in the order the schedule runs it (:func:`step_cost`).

Each op costs the larger of its FLOPs over the FLOP/s its kind of kernel achieves (torch's own formulas,
``torch.utils.flop_counter``; matmuls at the device's achieved matmul rate for their output's shape, attention
kernels at theirs: :class:`~spmd_ort.plan.device.Achieved`) and the bytes it reads over the achieved memory
bandwidth plus those it writes over the write bandwidth (a CPU's fresh outputs are page-faulted in), plus a fixed
dispatch cost; views cost nothing.  With ``fused`` (an executor that fuses: inductor), a chain of ops without
FLOPs (elementwise ops, reductions, gathers, the optimizer's updates) within one phase is priced as the kernel it
becomes: the bytes it reads from outside the chain and writes for readers outside it (a forward value the backward
reads is written, and read back), and one dispatch.  Collectives run on a stream of their own (ring costs: an
all-gather or reduce-scatter moves ``(n-1)/n`` of the full payload per rank, an all-reduce twice that, at the bus
bandwidth the group's ring gets, plus a fixed cost per call and per hop), starting where the schedule issues them
and no earlier than the last one ends; compute that runs beside a collective is slowed by ``achieved.overlap``; a
``wait_`` holds the compute stream until its collective ends.  So the overlap the schedule allows is what the
prediction counts, no more.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from spmd_ort.graph import ops
from spmd_ort.graph.aliasing import is_view_op
from spmd_ort.graph.flops import (ATTENTION_BACKWARD, ATTENTION_FORWARD, EXPERT_COST, hint, is_causal, node_flops,
                                  unpriced)
from spmd_ort.plan.device import DeviceSpec
from spmd_ort.graph.liveness import value_bytes
from spmd_ort.graph.meta import PP_ACTION, PP_SCHEDULE

KIND = {ops.all_reduce_: "all_reduce", ops.reduce_scatter: "reduce_scatter", ops.all_gather: "all_gather",
        ops.broadcast_: "broadcast"}
REDUCTIONS = (ops.all_reduce_, ops.reduce_scatter)


@dataclass
class StepCost:
    """What :func:`step_cost` found: ``flops`` of the step, ``compute_s`` (ops alone), ``comm_s`` (collectives
    alone, per kind in ``comm_s_by_kind``), ``exposed_comm_s`` (time the compute stream waited for them) and
    ``predicted_s`` (the walk's end); ``inflight`` the bytes of reduction inputs held by collectives in flight
    while each node runs (a library that copies them: ``DeviceSpec.copies_collective_inputs``); ``unpriced`` the
    ops that compute but that no formula prices (:func:`spmd_ort.graph.flops.unpriced`: their FLOPs count 0, their
    bytes as any op's), by how many nodes."""

    flops: int = 0
    recompute_flops: int = 0  # of them, the backward's recomputation of forward values (not model FLOPs)
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    predicted_s: float = 0.0
    comm_s_by_kind: dict = field(default_factory=dict)
    compute_s_by_kind: dict = field(default_factory=dict)  # "matmul", "attention", "memory-bound", "dispatch"
    flops_by_dtype: dict = field(default_factory=dict)
    inflight: list = field(default_factory=list)
    unpriced: dict = field(default_factory=dict)  # op -> nodes that compute but no formula prices (counted 0)
    # pipeline parallelism: the schedule simulated with this rank's actions' costs (``{"F": s, "B": s, "W": s}``,
    # the transfer's ``link_s``, ``bubble``, ``makespan_s``)
    pipeline: dict | None = None


def _is_view(node: fx.Node) -> bool:
    """A node that computes nothing: an element of a multi-output op's results, or a view."""
    return node.target is operator.getitem or is_view_op(node.target)


def _dtype(node: fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (list, tuple)) and val else val
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


GROUP_SIZE = "plan_group_size"  # node.meta: a collective's group size, read once (its group may be gone later)


def _group_size(node: fx.Node, world_size: int) -> int:
    if node.target in (ops.all_gather, ops.reduce_scatter):
        return int(node.args[1])
    if GROUP_SIZE in node.meta:
        return node.meta[GROUP_SIZE]
    group = node.args[2] if len(node.args) > 2 else node.kwargs.get("group", "")
    size = world_size
    if group:
        from spmd_ort.runtime.collectives import process_group

        size = process_group(group).size()
    node.meta[GROUP_SIZE] = size
    return size


def collective_seconds(node: fx.Node, device: DeviceSpec, world_size: int) -> tuple[str, float, int]:
    """(kind, seconds, full payload bytes) of one collective on a ring of its group."""
    kind = KIND[node.target]
    n = _group_size(node, world_size)
    full = value_bytes(node.meta.get("val")) if node.target is ops.all_gather else value_bytes(
        node.args[0].meta.get("val"))
    if n <= 1:
        return kind, 0.0, full
    share = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
             "broadcast": 1.0}[kind]
    hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
    seconds = share * full / device.link_bw(n) + hops * device.link_latency_s + device.achieved.latency_s
    return kind, seconds, full


def _is_attention(node: fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet in ATTENTION_FORWARD or packet in ATTENTION_BACKWARD


def compute_rate(node: fx.Node, device: DeviceSpec, dtype: torch.dtype) -> float:
    """FLOP/s ``node``'s kernel achieves on ``device``: attention kernels at the attention rate (forward or backward,
    causal or not), other ops with FLOPs (matmuls, convolutions) at the matmul rate for their output's shape."""
    if _is_attention(node):
        backward = node.target.overloadpacket in ATTENTION_BACKWARD
        return device.attention_rate(dtype, backward=backward, causal=is_causal(node))
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() >= 2:
        rows = 1
        for d in val.shape[:-1]:
            rows *= hint(d)
        return device.matmul_rate(dtype, rows, hint(val.shape[-1]))
    return device.matmul_rate(dtype)


def _fusible(node: fx.Node) -> bool:
    """An op a fusing executor folds into its neighbours' kernel: computes without FLOPs (elementwise ops, reductions,
    gathers and scatters, the optimizer's updates), is no collective."""
    return node.op == "call_function" and node.target not in KIND and node.target is not ops.wait_ \
        and not _is_view(node) and node_flops(node) == 0


def _phase(node: fx.Node) -> str:
    return node.meta.get("custom", {}).get("phase", "forward")


def _source(node: fx.Node) -> fx.Node:
    """The node whose output ``node`` views (itself, unless a view)."""
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def step_cost(graph: fx.Graph, device: DeviceSpec, world_size: int, fused: bool = False) -> StepCost:
    """Walk ``graph`` in order on two streams (compute, collectives) and price every node on ``device``; ``fused``:
    chains of ops without FLOPs priced as the fused kernels inductor makes of them."""
    cost = StepCost()
    fusible = {n for n in graph.nodes if _fusible(n)} if fused else set()
    memory_bw = device.achieved_memory_bw
    write_bw = device.write_bw * device.achieved.memory if device.write_bw else memory_bw
    t = comm_free = 0.0  # when the compute stream / the collectives' stream is next free
    ends: dict[fx.Node, float] = {}  # a started collective's node -> when it completes
    held: dict[fx.Node, int] = {}  # reductions in flight -> bytes the library holds for them
    actions: dict[tuple, float] = {}  # pipeline: each action's compute time
    sends: list[float] = []
    schedule = None
    for node in graph.nodes:
        if node.op != "call_function":
            cost.inflight.append(sum(held.values()))
            continue
        t_before = t
        if node.target is ops.p2p_send:  # a stage's output to the next: priced by the schedule's simulation
            sends.append(value_bytes(node.args[0].meta.get("val")) / device.link_bw(2) + device.link_latency_s
                         + device.achieved.latency_s)
            t += device.op_overhead_s
        elif node.target in (ops.p2p_recv, ops.p2p_wait_recv, ops.p2p_wait):
            schedule = node.meta.get(PP_SCHEDULE, schedule)
            t += device.op_overhead_s
        elif node.target in KIND:
            kind, seconds, full = collective_seconds(node, device, world_size)
            start = max(t, comm_free)
            comm_free = ends[node] = start + seconds
            cost.comm_s += seconds
            cost.comm_s_by_kind[kind] = cost.comm_s_by_kind.get(kind, 0.0) + seconds
            t += device.op_overhead_s  # issuing it
            cost.compute_s += device.op_overhead_s
            if node.target is ops.broadcast_:  # synchronous
                cost.exposed_comm_s += max(0.0, comm_free - t)
                t = max(t, comm_free)
            elif node.target in REDUCTIONS and device.copies_collective_inputs:
                held[node] = full
        elif node.target is ops.wait_:
            started = node.args[0]
            end = ends.get(started, 0.0)
            cost.exposed_comm_s += max(0.0, end - t)
            t = max(t, end)
            held.pop(started, None)
        elif not _is_view(node):
            flops = node_flops(node)
            missing = unpriced(node)
            if missing is not None:
                cost.unpriced[missing] = cost.unpriced.get(missing, 0) + 1
            inputs = node.all_input_nodes
            overhead = device.op_overhead_s
            if node in fusible:  # inside a fused kernel: what it reads from and writes for the rest of the graph
                here = _phase(node)  # (a forward value the backward reads is written, and read back, whatever reads it)
                inputs = [a for a in inputs if _source(a) not in fusible or _phase(_source(a)) != here]
                ends_chain = any(u not in fusible or _phase(u) != here for u in node.users) or not node.users
                written = value_bytes(node.meta.get("val")) if ends_chain else 0
                overhead = overhead if ends_chain else 0.0
            else:
                written = value_bytes(node.meta.get("val"))
            read = sum(value_bytes(a.meta.get("val")) for a in inputs)
            dtype = _dtype(node)
            memory_s = read / memory_bw + written / write_bw
            arithmetic_s = flops / compute_rate(node, device, dtype) if flops else 0.0
            seconds = max(arithmetic_s, memory_s) + overhead
            kind = ("attention" if _is_attention(node) else "matmul") if flops and arithmetic_s >= memory_s \
                else "memory-bound"
            if comm_free > t and device.achieved.overlap:  # a collective's kernels share the SMs meanwhile
                seconds += min(seconds, comm_free - t) * device.achieved.overlap
            by = cost.compute_s_by_kind
            by[kind] = by.get(kind, 0.0) + seconds - overhead
            by["dispatch"] = by.get("dispatch", 0.0) + overhead
            cost.flops += flops
            if flops:
                cost.flops_by_dtype[dtype] = cost.flops_by_dtype.get(dtype, 0) + flops
                if node.meta.get("recomputed"):
                    cost.recompute_flops += flops
            cost.compute_s += seconds
            t += seconds
            exchange = node.meta.get(EXPERT_COST)
            if exchange is not None:  # an experts host node's all-to-alls: synchronous, on the compute stream
                moved = exchange["all_to_all_bytes"] / device.link_bw(exchange["ep"])
                cost.comm_s += moved
                cost.comm_s_by_kind["all_to_all"] = cost.comm_s_by_kind.get("all_to_all", 0.0) + moved
                cost.exposed_comm_s += moved
                t += moved
        action = node.meta.get(PP_ACTION)
        if action is not None:
            actions[action] = actions.get(action, 0.0) + t - t_before
        cost.inflight.append(sum(held.values()))
    cost.predicted_s = max(t, comm_free)
    if schedule is not None and actions:
        _pipelined(cost, schedule, actions, sends)
    return cost


def _pipelined(cost: StepCost, schedule: dict, actions: dict, sends: list[float]) -> None:
    """A pipeline rank's step: what runs once (the step's start and end) plus the schedule simulated with each
    stage's actions: this rank's as priced, the other ranks' stages at this rank's seconds per FLOP of the same
    kind (each stage's FLOPs are counted by the pipeline pass), and one transfer's time between ranks."""
    from spmd_ort.distributed.stages import simulate

    mine: dict[tuple[str, int], list[float]] = {}
    for (kind, stage, _), seconds in actions.items():
        mine.setdefault((kind, stage), []).append(seconds)
    priced = {key: sum(v) / len(v) for key, v in mine.items()}
    flops = schedule.get("flops", {})
    costs: dict = {}
    for kind in "FBW":
        here = [key for key in priced if key[0] == kind]
        rate = sum(priced[k] for k in here) / max(1, sum(flops.get(k, 0) for k in here))  # seconds per FLOP
        mean = sum(priced[k] for k in here) / len(here) if here else 0.0
        costs[kind] = mean
        for (k, stage), f in flops.items():
            if k == kind and (k, stage) not in priced:
                costs[(k, stage)] = f * rate if f and rate else mean
    costs.update(priced)
    link_s = sum(sends) / len(sends) if sends else 0.0
    simulated = simulate(schedule["schedule"], schedule["pp"], schedule["microbatches"],
                         schedule["stages_per_rank"], costs=costs, link_s=link_s)
    once = cost.predicted_s - sum(actions.values())
    cost.pipeline = {**{f"{k}_s": costs[k] for k in "FBW"}, "link_s": link_s, "bubble": simulated.bubble,
                     "makespan_s": simulated.makespan}
    cost.predicted_s = once + simulated.makespan
