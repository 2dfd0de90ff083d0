"""A roofline of one compiled step, walked in the order the schedule runs it (:func:`step_cost`).

Each op costs the larger of its FLOPs over the device's FLOP/s (torch's own formulas,
``torch.utils.flop_counter``) and the bytes it reads over the memory bandwidth plus those it writes over the
write bandwidth (a CPU's fresh outputs are page-faulted in), plus a fixed
dispatch cost; views cost nothing.  Collectives run on a stream of their own (ring costs: an all-gather or
reduce-scatter moves ``(n-1)/n`` of the full payload per rank, an all-reduce twice that), starting where the
schedule issues them and no earlier than the last one ends; a ``wait_`` holds the compute stream until its
collective ends.  So the overlap the schedule allows is what the prediction counts, no more.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from spmd_ort.graph import ops
from spmd_ort.graph.aliasing import is_view_op
from spmd_ort.graph.flops import node_flops, unpriced
from spmd_ort.plan.device import DeviceSpec
from spmd_ort.graph.liveness import value_bytes

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
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    predicted_s: float = 0.0
    comm_s_by_kind: dict = field(default_factory=dict)
    flops_by_dtype: dict = field(default_factory=dict)
    inflight: list = field(default_factory=list)
    unpriced: dict = field(default_factory=dict)  # op -> nodes that compute but no formula prices (counted 0)


def _is_view(node: fx.Node) -> bool:
    """A node that computes nothing: an element of a multi-output op's results, or a view."""
    return node.target is operator.getitem or is_view_op(node.target)


def _dtype(node: fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (list, tuple)) and val else val
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def _group_size(node: fx.Node, world_size: int) -> int:
    if node.target in (ops.all_gather, ops.reduce_scatter):
        return int(node.args[1])
    group = node.args[2] if len(node.args) > 2 else node.kwargs.get("group", "")
    if group:
        from spmd_ort.runtime.collectives import process_group

        return process_group(group).size()
    return world_size


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
    return kind, share * full / device.link_bw(n) + hops * device.link_latency_s, full


def step_cost(gm: fx.GraphModule, device: DeviceSpec, world_size: int) -> StepCost:
    """Walk ``gm`` in order on two streams (compute, collectives) and price every node on ``device``."""
    cost = StepCost()
    t = comm_free = 0.0  # when the compute stream / the collectives' stream is next free
    ends: dict[fx.Node, float] = {}  # a started collective's node -> when it completes
    held: dict[fx.Node, int] = {}  # reductions in flight -> bytes the library holds for them
    for node in gm.graph.nodes:
        if node.op != "call_function":
            cost.inflight.append(sum(held.values()))
            continue
        if node.target in KIND:
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
            read = sum(value_bytes(a.meta.get("val")) for a in node.all_input_nodes)
            written = value_bytes(node.meta.get("val"))
            dtype = _dtype(node)
            memory_s = read / device.memory_bw + written / (device.write_bw or device.memory_bw)
            seconds = max(flops / device.flops_for(dtype), memory_s) + device.op_overhead_s
            cost.flops += flops
            if flops:
                cost.flops_by_dtype[dtype] = cost.flops_by_dtype.get(dtype, 0) + flops
            cost.compute_s += seconds
            t += seconds
        cost.inflight.append(sum(held.values()))
    cost.predicted_s = max(t, comm_free)
    return cost
