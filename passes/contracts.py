"""Checkable contracts of graph passes: named invariants a pass requires or ensures.

A pass declares them with :func:`spmd_ort.passes.runner.graph_pass`; when
contract checking is on (``SPMD_ORT_CHECK_PASSES=1``, ``DebugOptions(check_passes=True)``,
always in the test suite) the runner checks ``requires`` before the pass and
``ensures`` (plus :data:`ALWAYS`) after it, and a violation is a ``PassError``
naming the pass, the invariant and what is wrong.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort import coverage, ops

from .context import PassContext
from .helpers import DEDUP_KEY, SHARD_OF, TAG, calls, compute_device, placeholders, val

Check = Callable[[fx.GraphModule, PassContext], "str | None"]


@dataclass(frozen=True)
class Invariant:
    """A property of the graph (and its context); ``check`` returns None when it holds, else what is wrong."""

    name: str
    doc: str
    check: Check

    def __str__(self) -> str:
        return self.name


def _io_matches_slots(gm, ctx):
    n_in = len(placeholders(gm))
    outs = gm.graph.output_node().args[0]
    n_out = len(outs) if isinstance(outs, (tuple, list)) else 1
    if n_in != len(ctx.input_slots) or n_out != len(ctx.output_slots):
        return (f"{n_in} placeholders / {n_out} outputs, but {len(ctx.input_slots)} input slots / "
                f"{len(ctx.output_slots)} output slots")
    return None


def _values_known(gm, ctx):
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            return f"node `{node.name}` ({node.target}) has no meta['val']"
    return None


def _functional_aten(gm, ctx):
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable \
                and getattr(node.target, "namespace", None) == "aten":
            return f"`{node.name}` ({node.target}) mutates its input"
    return None


def _grads_tagged(gm, ctx):
    seen: set[int] = set()
    params = {s.index for s in ctx.input_slots if s.kind == "param"}
    for node in calls(gm, TAG):
        index = node.args[1]
        if index in seen:
            return f"parameter {index}'s gradient is tagged twice"
        if index not in params:
            return f"tag_grad names parameter {index}, which is not a graph input"
        seen.add(index)
    if not seen:
        return "no gradient is tagged (trace with tag_grads=True)"
    return None


def _no_grad_tags(gm, ctx):
    tags = calls(gm, TAG)
    return f"{len(tags)} tag_grad node(s) remain" if tags else None


def _collectives_waited(gm, ctx):
    for node in calls(gm, *ops.STARTS):
        waits = [u for u in node.users if u.target is ops.wait_]
        if len(waits) != 1:
            return f"collective `{node.name}` ({node.target}) has {len(waits)} wait_ nodes, not 1"
    return None


def _no_duplicate_collectives(gm, ctx):
    seen = {}
    for node in calls(gm, ops.all_reduce_, ops.broadcast_, ops.all_gather):
        key = (node.target, tuple(node.args), node.meta.get(DEDUP_KEY))
        if key in seen:
            return f"`{node.name}` repeats `{seen[key].name}`"
        seen[key] = node
    return None


def _one_all_reduce_per_bucket(gm, ctx):
    buckets = ctx.results.gradient_buckets
    if buckets is None:
        return "no gradient buckets recorded"
    n = len(calls(gm, ops.all_reduce_))
    return None if n == len(buckets.nbytes) else f"{n} all-reduces for {len(buckets.nbytes)} buckets"


def _one_shard_collective_per_bucket(gm, ctx):
    buckets = ctx.results.shard_buckets
    if buckets is None:
        return "no shard buckets recorded"
    gathers, scatters = len(calls(gm, ops.all_gather)), len(calls(gm, ops.reduce_scatter))
    if (gathers, scatters) != (len(buckets.all_gather), len(buckets.reduce_scatter)):
        return (f"{gathers} all-gathers / {scatters} reduce-scatters for {len(buckets.all_gather)} / "
                f"{len(buckets.reduce_scatter)} buckets")
    return None


def _sharded_placeholders(gm, ctx):
    for node, slot in zip(placeholders(gm), ctx.input_slots):
        if slot.kind == "param" and slot.index in ctx.shard_specs:
            want = (ctx.shard_specs[slot.index].shard_numel,)
            if tuple(val(node).shape) != want:
                return f"parameter placeholder `{slot.name}` holds {tuple(val(node).shape)}, not its shard {want}"
    return None


def _params_gathered_before_use(gm, ctx):
    for node, slot in zip(placeholders(gm), ctx.input_slots):
        if slot.kind != "param" or slot.index not in ctx.shard_specs:
            continue
        for user in node.users:
            if user.target is ops.all_gather or user.meta.get(SHARD_OF) is not None:
                continue
            if user.users and all(u.target is ops.all_gather for u in user.users):
                continue  # a cast (or host copy) of the shard that only feeds gathers
            if user.target is operator.getitem:
                continue
            return f"`{user.name}` ({user.target}) reads the shard of `{slot.name}` without gathering it"
    return None


def _no_device_optimizer_ops(gm, ctx):
    left = calls(gm, *ops.HOST_TWINS)
    return f"{len(left)} device optimizer op(s) remain" if left else None


def _gathers_on_compute_device(gm, ctx):
    device = compute_device(gm, ctx.input_slots)
    for node in calls(gm, ops.all_gather):
        if val(node.args[0]).device != device:
            return f"`{node.name}` gathers a tensor on {val(node.args[0]).device}, not on {device}"
    return None


def _onnx_lowered(gm, ctx):
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "aten" \
                and coverage.decomposition_for(node) is not None:
            return f"`{node.name}` ({node.target}) has no direct ONNX translation but a decomposition"
    return None


def _memory_planned(gm, ctx):
    return None if ctx.results.memory is not None else "no memory plan recorded"


IO_MATCHES_SLOTS = Invariant("io_matches_slots", "placeholders and outputs match input_slots/output_slots",
                             _io_matches_slots)
VALUES_KNOWN = Invariant("values_known", "every placeholder and op node has meta['val']", _values_known)
FUNCTIONAL_ATEN = Invariant("functional_aten", "no aten op mutates its inputs", _functional_aten)
GRADS_TAGGED = Invariant("grads_tagged", "each parameter gradient is tagged once (trace with tag_grads)",
                         _grads_tagged)
NO_GRAD_TAGS = Invariant("no_grad_tags", "no tag_grad node remains", _no_grad_tags)
COLLECTIVES_WAITED = Invariant("collectives_waited", "every collective start has exactly one wait_",
                               _collectives_waited)
NO_DUPLICATE_COLLECTIVES = Invariant("no_duplicate_collectives", "no two collectives share target, args and key",
                                     _no_duplicate_collectives)
ONE_ALL_REDUCE_PER_BUCKET = Invariant("one_all_reduce_per_bucket", "all-reduces == recorded gradient buckets",
                                      _one_all_reduce_per_bucket)
ONE_SHARD_COLLECTIVE_PER_BUCKET = Invariant(
    "one_shard_collective_per_bucket", "all-gathers and reduce-scatters == recorded shard buckets",
    _one_shard_collective_per_bucket)
SHARDED_PLACEHOLDERS = Invariant("sharded_placeholders", "sharded parameter placeholders hold their shard",
                                 _sharded_placeholders)
PARAMS_GATHERED_BEFORE_USE = Invariant(
    "params_gathered_before_use", "a sharded parameter is read whole only through an all-gather",
    _params_gathered_before_use)
NO_DEVICE_OPTIMIZER_OPS = Invariant("no_device_optimizer_ops", "every optimizer op is a host twin",
                                    _no_device_optimizer_ops)
GATHERS_ON_COMPUTE_DEVICE = Invariant("gathers_on_compute_device", "all-gathers read tensors on the compute device",
                                      _gathers_on_compute_device)
ONNX_LOWERED = Invariant("onnx_lowered", "no aten op that lacks a direct ONNX translation has a decomposition left",
                         _onnx_lowered)
MEMORY_PLANNED = Invariant("memory_planned", "the memory plan is recorded", _memory_planned)

# checked after every pass when contracts are checked
ALWAYS = (IO_MATCHES_SLOTS, VALUES_KNOWN, FUNCTIONAL_ATEN)
