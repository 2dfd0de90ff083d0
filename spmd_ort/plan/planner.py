"""Plan a compiled step for N ranks in one process, before renting them (:func:`plan_step`).

The same pipeline a real first call runs (bind -> prepare the layout -> trace -> every pass -> the executor,
ORT's export included unless ``export=False``), on meta copies of the model and optimizer, with torch's fake
process group standing in for the world: nothing of the model's size is allocated, the ranks' agreements answer
as if every rank agreed, and no collective moves a byte.  What the finished graph holds is then priced
(:mod:`spmd_ort.plan.cost`) and accounted as ``train_step.memory()`` and ``train_step.comm`` account a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import copy
import time

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from spmd_ort.capture.inputs import find_state_owners
from spmd_ort.capture.prepare import Preparation
from spmd_ort.distributed import dtensor, parallel
from spmd_ort.distributed.experts import ExpertParallel
from spmd_ort.distributed.stages import PipelineParallel
from spmd_ort.distributed.sharding import persistent_bytes
from spmd_ort.errors import ConfigError
from spmd_ort.graph.slots import SlotKind
from spmd_ort.passes.analysis import CollectiveCounts, MemoryPlan
from spmd_ort.passes.context_parallel import ContextParallelSplit
from spmd_ort.passes.pipeline_parallel import PipelineStages
from spmd_ort.plan.cost import step_cost
from spmd_ort.plan.device import DeviceSpec, device_spec
from spmd_ort.plan.report import Plan
from spmd_ort.graph.liveness import value_bytes


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """torch's fake process group as the default group for the block: ``world_size`` ranks, this process
    ``rank``; every collective returns at once without moving data (an all-gather of objects hands back this
    rank's for every rank: the ranks agree).  Refused where a process group is up already."""
    if dist.is_initialized():
        raise ConfigError(
            "plan() stands up torch's fake process group for the world it plans, but this process already has a "
            f"process group ({dist.get_backend()}, {dist.get_world_size()} ranks). Fix: plan before "
            "init_process_group, or in a separate process (python -m spmd_ort.plan, or a script without torchrun)")
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ConfigError(f"plan(world_size={world_size!r}, rank={rank!r}): give world_size >= 1 and "
                          "0 <= rank < world_size")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; a plan leaves the process as it was
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _meta_copies(args: tuple, kwargs: dict):
    """(args, kwargs) with the model and optimizer replaced by copies on the meta device (nothing of their size
    allocated; the originals untouched) and every tensor by a meta tensor of its shape and dtype."""
    module, opt, _ = find_state_owners(args, kwargs)
    if getattr(module, parallel.PARALLELIZED_ATTR, None) is not None or dtensor.has_dtensor_state(module):
        raise ConfigError(f"plan(): {type(module).__name__} is laid out for a world already (parallelize, or "
                          "DTensor parameters). Fix: plan the model as built (on the meta device is best), before "
                          "parallelize; the plan lays it out for the world it plans")
    memo: dict[int, object] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    twin = copy.deepcopy(module, memo)
    twin_opt = None
    if opt is not None:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [memo[id(p)] for p in g["params"]]}
                  for g in opt.param_groups]
        try:
            twin_opt = type(opt)(groups, **opt.defaults)
        except TypeError:
            twin_opt = type(opt)(groups)

    def swap(leaf):
        if leaf is module:
            return twin
        if leaf is opt:
            return twin_opt
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, nn.Parameter):
            return torch.empty_like(leaf, device="meta").requires_grad_(leaf.requires_grad)
        return leaf

    args, kwargs = pytree.tree_map(swap, (args, kwargs))
    return args, kwargs


def plan_step(step, args: tuple, kwargs: dict, *, world_size: int, device: str | DeviceSpec = "h100", rank: int = 0,
              export: bool = True, cache: bool | None = None) -> Plan:
    """:meth:`spmd_ort.CompiledStep.plan`: ``step``'s program for ``world_size`` ranks, as rank ``rank`` runs it;
    with ``cache``, read from and kept in ``<cache_dir>/plans`` (:mod:`spmd_ort.plan.cache`)."""
    t0 = time.perf_counter()
    spec = device_spec(device)  # this CPU's probe runs before the fake world exists
    step.check_call(args, kwargs)
    kept_at = None
    if step.options.plan_cache if cache is None else cache:
        from spmd_ort.plan import cache as plans

        module, opt, _ = find_state_owners(args, kwargs)
        kept_at = plans.path_for(step.options.cache_dir, plans.plan_key(
            step, args, kwargs, module, opt, world_size=world_size, device=spec, rank=rank, export=export))
        kept = plans.load(kept_at)
        if kept is not None:
            def again(other: DeviceSpec) -> Plan:  # (no graph kept: planned again for another device)
                return plan_step(step, args, kwargs, world_size=world_size, device=other, rank=rank, export=export)

            return dataclasses.replace(kept, planning_s=time.perf_counter() - t0, cached_from=str(kept_at),
                                       first_planning_s=kept.planning_s, repricer=again)
    mode = step.layout  # a Parallel is lowered for the plan's world, inside it
    if isinstance(mode, parallel.TensorParallel) and mode.mesh is not None and not isinstance(mode.mesh, tuple):
        raise ConfigError("plan(): TensorParallel(mesh=<DeviceMesh>) is a mesh of this process's world; give its "
                          "shape instead (mesh=(dp, tp), or (tp,)), built on the world the plan runs in")
    args, kwargs = _meta_copies(args, kwargs)
    twin = step.twin()  # the plan's variants, shapes, opaque parts and tuner never touch the step's own
    priced: dict = {}
    fused = step.backend == "inductor"

    def price(gm: fx.GraphModule, ctx) -> None:
        # a copy of the finished graph: the executor's partition rewrites gm in place after this; walked here,
        # while the world is up, so that each collective's group size is read (and kept in its node's meta)
        priced["graph"] = _snapshot(gm)
        priced["cost"] = step_cost(priced["graph"], spec, world_size, fused=fused)
        priced["live"] = ctx.results.get(MemoryPlan).live  # plan_memory_pass's walk, node for node the same graph
        assert len(priced["live"]) == len(gm.graph.nodes), "the memory plan is of another graph"
        priced["nodes"] = len(gm.graph.nodes)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        held = [(s, v.meta.get("val")) for v, s in zip(out, ctx.output_slots)
                if s.kind is SlotKind.GRAD and isinstance(v, fx.Node)]
        priced["grads"] = sum(value_bytes(v) for _, v in held)
        priced["held_grads"] = held

    with fake_world(world_size, rank):
        call = twin.bind(args, kwargs, planning=True)
        with Preparation(call, overrides=twin.module_override) as prep:
            for _ in range(2):  # the step's own build path: the same retries and agreement as a call's
                program, _ = twin.build(call, twin.shapes.agreed_key(call), prep, planning=True,
                                        executor=export and step.backend == "ort", after_passes=price)
                twin.compiled = program
                if not priced["held_grads"] or any(p.grad is not None for p in call.module.parameters()):
                    break
                # gradients held between steps (zero_grad(set_to_none=False)): the steady step is the second
                # one, which takes them as inputs; give the meta copies the gradients the first one leaves
                slots, vals = zip(*priced["held_grads"])
                program.layout.write_back(list(slots), [torch.empty(v.shape, dtype=v.dtype, device="meta")
                                                        for v in vals])
            held = persistent_bytes(call.module, call.opt)
        mode_name = _describe(twin.parallel_mode, call.mode)
    comm_bytes, comm_calls = _by_kind(program.results.get(CollectiveCounts))
    split = program.results.get(ContextParallelSplit)  # context parallel: the sequence's split, in explain()
    stages = program.results.get(PipelineStages)  # pipeline parallel: the stages and the schedule's table
    stats = program.executor.stats if program.executor is not None else None  # ORT's: segments, fallbacks
    export = {"segments": stats.segments, "export_s": stats.export_seconds, "fallbacks": dict(stats.fallback_reasons)
              } if stats is not None else {}
    activations = program.results.get(MemoryPlan).planned_peak_bytes
    planning_s = time.perf_counter() - t0

    def priced_on(spec: DeviceSpec, cost=None) -> Plan:
        """The plan of this graph on ``spec`` (the graph walked again unless ``cost`` is given)."""
        cost = cost or step_cost(priced["graph"], spec, world_size, fused=fused)
        if len(cost.inflight) != len(priced["live"]):
            raise AssertionError("the priced graph is not the graph the memory plan walked")
        live = [a + c for a, c in zip(priced["live"], cost.inflight)]
        state = held["params"] + priced["grads"] + held["opt_state"] + held["buffers"]
        peak = state + max(live, default=0)
        per_rank = {"params": held["params"], "grads": priced["grads"], "optimizer": held["opt_state"],
                    "buffers": held["buffers"], "activations": activations,
                    "comm_buffers": max(cost.inflight, default=0), "peak": peak,
                    "reserved": int(peak * (1 + spec.achieved.fragmentation)),
                    "outside_allocator": spec.achieved.outside_allocator}
        main = max(cost.flops_by_dtype, key=cost.flops_by_dtype.get) if cost.flops_by_dtype else torch.float32
        return Plan(world_size=world_size, rank=rank, device=spec, parallel=mode_name, backend=step.backend,
                    per_rank_bytes=per_rank, comm_bytes=dict(sorted(comm_bytes.items())),
                    comm_calls=dict(sorted(comm_calls.items())), flops=cost.flops,
                    recompute_flops=cost.recompute_flops, predicted_step_s=cost.predicted_s,
                    compute_s_by_kind=dict(cost.compute_s_by_kind), compute_s=cost.compute_s, comm_s=cost.comm_s,
                    exposed_comm_s=cost.exposed_comm_s, graph_nodes=priced["nodes"],
                    exported=program.executor is not None, planning_s=planning_s, main_dtype=main, export=export,
                    memory_over_step=tuple(state + v for v in live), unpriced=dict(cost.unpriced),
                    layout_notes=(tuple(split.lines()) if split is not None else ())
                    + (tuple(stages.lines()) + _pipeline_note(cost) if stages is not None else ()),
                    repricer=priced_on)

    plan = priced_on(spec, priced["cost"])
    if kept_at is not None:
        plans.store(kept_at, plan)
    return plan


def _pipeline_note(cost) -> tuple[str, ...]:
    """The schedule as the plan priced it: each action's time on this rank, a transfer's, the bubble."""
    p = cost.pipeline
    if p is None:
        return ()
    return (f"pipeline priced: F {p['F_s'] * 1e3:.3f} ms, B {p['B_s'] * 1e3:.3f} ms, W {p['W_s'] * 1e3:.3f} ms per "
            f"micro-batch and stage, a transfer {p['link_s'] * 1e3:.3f} ms: the schedule's time line "
            f"{p['makespan_s'] * 1e3:.2f} ms with a bubble of {p['bubble']:.1%}",)


def _snapshot(gm: fx.GraphModule) -> fx.Graph:
    """A copy of a finished graph's nodes (each with a copy of its meta, the values in it shared)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


def _by_kind(counts: CollectiveCounts) -> tuple[dict, dict]:
    """``count_collectives_pass``'s counts ({"all-gather (forward)": ...}) by the kinds ``train_step.comm`` counts
    (``all_gather``, ``all_reduce``, ``broadcast``, ``reduce_scatter``): bytes, and calls."""
    nbytes: dict = {}
    calls: dict = {}
    for name, n in counts.calls.items():
        kind = name.split(" ")[0].replace("-", "_")
        nbytes[kind] = nbytes.get(kind, 0) + counts.nbytes[name]
        calls[kind] = calls.get(kind, 0) + n
    return nbytes, calls


def _describe(mode, resolved) -> str:
    if isinstance(mode, parallel.TensorParallel):
        shape = mode.mesh if isinstance(mode.mesh, tuple) else None
        dp = mode.data_parallel
        return (f"tensor parallel {shape[1]} x {dp.parallel_style} {shape[0]}" if dp is not None and shape
                else f"tensor parallel{f' {shape[0]}' if shape else ''}")
    if resolved is None:
        return "one rank"
    if isinstance(resolved, parallel.ContextParallel):
        dp = resolved.dp
        return f"{resolved.parallel_style} {dp} x context parallel {resolved.cp}" if dp > 1 else \
            f"context parallel {resolved.cp}"
    if isinstance(resolved, ExpertParallel):
        return f"{resolved.parallel_style} x expert parallel {resolved.ep} ({resolved.experts})"
    if isinstance(resolved, PipelineParallel):
        p = resolved.pipeline
        return f"pipeline parallel {resolved.pp} ({p.schedule}, {p.microbatches} micro-batches)"
    return resolved.parallel_style
