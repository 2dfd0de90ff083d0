"""``train_step.explain()``: what the compiler did to a train step, in words.

Variants and why each was traced, the passes (node counts, time), the
collectives of one step (buckets and bytes, planned from the graph, next to the
last step's measured figures and to the parameter bytes they are bounded by),
the segments (ORT or host, ops, share of the step's matmul/conv FLOPs), host
nodes and why they stay on the host, the decisions made from measurements (:mod:`spmd_ort.tuner`: each with
the numbers behind it, and any recompile with its reason), and memory.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from spmd_ort.backends.cuda_graph import GraphedExecutor, unwrapped_reason
from spmd_ort.compat import optimization_hint
from spmd_ort.distributed.parallel_dims import Parallel
from spmd_ort.passes.analysis import CapturePlan, CollectiveCounts
from spmd_ort.graph.flops import node_flops
from spmd_ort.program import CompiledProgram

aten = torch.ops.aten
MIB = 2**20


def _shape(node) -> tuple:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _graph_flops(gm: fx.GraphModule) -> int:
    """The graph's matmul FLOPs; with symbolic sizes (dynamic shapes), at the sizes it was traced with."""
    total = sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")
    return int(optimization_hint(total)) if isinstance(total, torch.SymInt) else total


def segment_executor(name: str, sub, stats) -> tuple[str, str]:
    """(executor, why) for an ORT segment after the first run: ``ort`` or ``fx``, and why it runs there.

    ``fx`` is a fallback (its export, load, run or verification failed: the failure), the faster
    executor (``SPMD_ORT_SEGMENT_EXECUTOR=auto``: both times) or the one asked for (``ort``/``fx``).
    """
    from spmd_ort.backends.ort.session import OrtSegment
    from spmd_ort.backends.ort.sizes import SizedSegments

    failure = stats.why_fx(name) if stats is not None else None
    if isinstance(sub, SizedSegments):  # one model per set of sizes: some may run on fx
        on_fx = sum(1 for s in sub.sessions.values() if s is None)
        where = f"exported per set of sizes: {len(sub.sessions) - on_fx} on ort, {on_fx} on fx"
        return ("ort" if on_fx < len(sub.sessions) or not sub.sessions else "fx",
                where + (f"; fell back: {failure}" if failure else ""))
    if not isinstance(sub, OrtSegment):  # never became a session
        return "fx", f"fell back: {failure}" if failure else "fell back"
    choice = stats.choices.get(name) if stats is not None else None
    executor = "fx" if sub.use_fallback else "ort"
    if failure is not None and sub.use_fallback:
        return executor, f"fell back: {failure}"
    if choice is None:
        return executor, ""
    if choice.ort_ms is None:
        return executor, f"forced: SPMD_ORT_SEGMENT_EXECUTOR={choice.executor}"
    why = (f"chosen: faster on {choice.executor} (ort {choice.ort_ms:.2f} ms, fx {choice.fx_ms:.2f} ms"
           f"{choice.since}; SPMD_ORT_SEGMENT_EXECUTOR=auto)")
    if executor != choice.executor and executor == "ort":
        why += "; runs on ort: the whole step was faster with every segment on ORT"
    return executor, why


def _segments(program: CompiledProgram) -> list[tuple[str, str, int, int, str]]:
    """(name, where it runs, ops, FLOPs, detail) for each segment and host node of the executed graph."""
    rows = []
    gm = program.gm
    stats = program.executor.stats
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            graph = getattr(sub, "fallback", sub)
            where, why = segment_executor(node.target, sub, stats) if program.executor.name == "ort" \
                else (program.executor.name, "")
            n_ops = sum(1 for n in graph.graph.nodes if n.op == "call_function")
            rows.append((node.target, where, n_ops, _graph_flops(graph), why))
        elif node.op == "call_function" and node.target is not operator.getitem:
            flops = node_flops(node)
            flops = int(optimization_hint(flops)) if isinstance(flops, torch.SymInt) else flops
            if program.executor.name == "ort" or isinstance(node.target, torch._ops.OpOverload) and \
                    node.target.namespace == "spmd_ort":
                rows.append((node.name, "host", 1, flops, str(node.target)))
    if program.executor.name == "fx":
        n_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        # our ops listed too, their FLOPs (a grouped matmul's) counted once: in the graph's row
        rows = [("graph", "fx", n_ops, _graph_flops(gm), "every op in PyTorch")] + \
            [(name, where, n, 0, detail) for name, where, n, _, detail in rows if detail.startswith("spmd_ort")]
    return rows


def _collective_lines(program: CompiledProgram, comm) -> list[str]:
    counts = program.results.get(CollectiveCounts)
    if counts is None or not counts.calls:
        return ["collectives: none (one process)"]
    layout = program.layout
    param_bytes = sum(p.numel() * p.element_size() for p in layout.params)
    if layout.shard_specs:
        param_bytes = sum(spec.padded_numel * layout.params[i].element_size() for i, spec in layout.shard_specs.items())
    ref = "padded parameter bytes" if layout.shard_specs else "parameter bytes"
    lines = [f"collectives per step (planned from the graph; {ref}: {param_bytes / MIB:.3f} MiB):"]
    measured = {"all-gather": "all_gather_bytes", "reduce-scatter": "reduce_scatter_bytes",
                "all-reduce": "all_reduce_bytes", "broadcast": "broadcast_bytes", "all-to-all": "all_to_all_bytes"}
    for kind, n in counts.calls.items():
        total = counts.nbytes[kind]
        lines.append(f"  {kind}: {n} call(s), {total} B = {total / MIB:.3f} MiB = {total / param_bytes:.2f} x {ref}")
    if comm is not None:
        got = ", ".join(f"{k} {getattr(comm, v)} B" for k, v in measured.items() if getattr(comm, v))
        lines.append(f"  measured on the last step: {got or 'nothing'}; overlap {comm.overlap:.0%}")
        lines += _expert_load_lines(comm)
    return lines


def _expert_load_lines(comm) -> list[str]:
    """Expert parallelism: the tokens each of this rank's experts received on the last step, per experts module."""
    if not comm.expert_tokens:
        return []
    lines = ["  expert load on the last step (tokens per expert this rank computes, from every rank of its ep "
             "group: min / mean / max):"]
    for fqn, calls in comm.expert_tokens.items():
        tokens = [t for call in calls for t in call]
        lines.append(f"    {fqn}: {min(tokens)} / {sum(tokens) / len(tokens):.1f} / {max(tokens)} over "
                     f"{len(calls[0])} experts" + (f", {len(calls)} calls" if len(calls) > 1 else ""))
    return lines


def explain(step, memory: dict | None = None) -> str:
    """The plan of a compiled step (``CompiledStep``) in words; ``memory``: its ``memory()``, once it has run."""
    program: CompiledProgram | None = step.compiled
    if program is None:
        return f"{step.transitions.name}: not compiled yet (call it once)"
    lines = [f"compiled train step `{step.transitions.name}`: {program.backend} backend "
             f"({getattr(step, 'backend_reason', 'the default')}), {len(program.gm.graph.nodes)} nodes in the "
             "executed graph"]
    layout = getattr(step, "layout", None)
    if layout is not None:  # every parallel degree, as one Parallel (a DataParallel or TensorParallel shorthand's)
        lines.append(f"layout: {Parallel.of(layout).describe()}")
    lines.append(f"variants: {len(step.variants)} kept, {step.transitions.traces} traced")
    for i, v in enumerate(step.variants):
        last = " (used by the last call)" if v is program else ""
        lines.append(f"  #{i}: traced because {v.traced_because or '?'}; compiled in {v.compile_seconds:.1f} s; "
                     f"{v.steps_run} step(s) run{last}")
    lines.append("passes (in order):")
    for r in program.passes_applied:
        lines.append(f"  {r}")
    lines += _collective_lines(program, step.comm)
    lines.append("what the passes recorded:")
    lines += [f"  {line}" for line in program.results.lines()]
    rows = _segments(program)
    total = sum(r[3] for r in rows) or 1
    lines.append(f"segments and host nodes ({total / 1e9:.2f} GFLOP of matmuls/convolutions per step):")
    for name, where, n_ops, flops, detail in rows:
        share = f"{flops / total:6.1%} of FLOPs" if flops else "      -      "
        lines.append(f"  {name:24s} {where:14s} {n_ops:5d} op(s)  {share}  {detail}")
    if isinstance(program.executor, GraphedExecutor):
        lines += program.executor.graph_lines()
    elif step.options.cuda_graph:  # asked for, on a backend that is never wrapped
        capture = program.results.get(CapturePlan)
        lines.append(f"CUDA graphs: not used: {unwrapped_reason(step.backend, capture is not None and capture.cuda)}")
    tuner = getattr(step, "tuner", None)
    if tuner is not None:
        decided = tuner.lines(program)
        lines.append("decisions made from measurements (spmd_ort.tuner):" + ("" if decided else " none"))
        lines += [f"  {line}" for line in decided]
    stats = program.executor.stats
    if stats is not None:
        lines.append("host ops and why they stay on the host:")
        lines += [f"  {op}: {why}" for op, why in stats.host_ops.items()]
    if memory is not None:
        mem = memory
        p = mem["persistent"]
        lines.append(f"memory (this rank): persistent {p['total'] / MIB:.2f} MiB (params {p['params'] / MIB:.2f}, "
                     f"grads {p['grads'] / MIB:.2f}, optimizer state {p['opt_state'] / MIB:.2f}), buffers "
                     f"{p['buffers'] / MIB:.2f} MiB; planned peak of the step's values "
                     f"{mem['planned_activation_peak'] / MIB:.2f} MiB (forward values kept for the backward "
                     f"{mem['planned_saved_for_backward'] / MIB:.2f} MiB of it); "
                     f"max RSS {mem['max_rss'] / MIB:.0f} MiB")
    return "\n".join(lines)
