"""A compiled variant of the train step: graph, IO map, passes applied, executor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from spmd_ort.passes import PassRecord, PassResults, op_counts

from .executor import Executor
from .options import Options
from .state import Slot, StateLayout
from .trace import TENSOR
from .transition import StepKey


@dataclass
class CompiledProgram:
    """What the compiler produced for one input signature.

    ``gm`` is the final graph (placeholders ``input_slots``, outputs
    ``output_slots``); ``traced_gm`` the graph as captured, before any pass;
    ``passes_applied`` every pass of the pipeline in order; ``results`` what the
    passes recorded (buckets, shard buckets, memory plan, ...).
    """

    key: StepKey
    gm: fx.GraphModule
    traced_gm: fx.GraphModule
    layout: StateLayout
    input_slots: list[Slot]
    output_slots: list[Slot]
    batch_positions: list[int]
    user_spec: pytree.TreeSpec
    user_leaves: list[Any]
    passes_applied: list[PassRecord]
    results: PassResults
    executor: Executor
    options: Options
    trace_seconds: float
    compile_seconds: float
    steps_run: int = 0

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def backend(self) -> str:
        return self.options.backend

    def run(self, args: tuple, kwargs: dict) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = self.layout.gather() + [leaves[i] for i in self.batch_positions]
        outs = self.executor.run(inputs)
        # An executor that reuses its output buffers overwrites them next step:
        # what escapes the step (user outputs, newly assigned state) is copied.
        owned = not self.executor.reuses_buffers
        if not owned:
            outs = [o.clone() if slot.kind == "user" else o for slot, o in zip(self.output_slots, outs)]
        state_slots, state_vals, user_vals = [], [], []
        for slot, value in zip(self.output_slots, outs, strict=True):
            if slot.kind == "user":
                user_vals.append(value)
            elif slot.kind == "batch":
                with torch.no_grad():
                    leaves[self.batch_positions[slot.index]].copy_(value)
            else:
                state_slots.append(slot)
                state_vals.append(value)
        self.layout.write_back(state_slots, state_vals, owned=owned)
        self.steps_run += 1
        it = iter(user_vals)
        return pytree.tree_unflatten([next(it) if x is TENSOR else x for x in self.user_leaves], self.user_spec)

    def signature(self) -> str:
        """What every rank must agree on: the final graph and its IO (no values, no object ids)."""
        io = [f"{s.kind} {s.name}" for s in self.input_slots + self.output_slots]
        return self.gm.code + "\n" + "\n".join(io)

    def describe(self) -> str:
        """A human-readable summary: IO map, op counts, passes."""
        lines = [f"compiled train step ({self.backend} backend): {len(self.gm.graph.nodes)} nodes, "
                 f"traced in {self.trace_seconds:.2f}s, compiled in {self.compile_seconds:.2f}s"]
        kinds: dict[str, int] = {}
        for s in self.input_slots:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        lines.append("inputs: " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
        kinds = {}
        for s in self.output_slots:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        lines.append("outputs: " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
        lines += self.executor.describe()
        results = self.results
        if results.gradient_buckets is not None:
            sizes = results.gradient_buckets.nbytes
            lines.append(f"gradient buckets: {len(sizes)} ({', '.join(f'{b / 2**20:.2f} MiB' for b in sizes)})")
        if results.shard_buckets is not None:
            for kind in ("all_gather", "reduce_scatter"):
                sizes = getattr(results.shard_buckets, kind)
                lines.append(f"{kind} buckets: {len(sizes)} ({', '.join(f'{x / 2**20:.2f} MiB' for x in sizes)})")
        if results.lowering is not None and results.lowering.lowered:
            lowered = ", ".join(f"{op} x{n}" for op, n in results.lowering.lowered.items())
            lines.append(f"lowered for ONNX (torch decompositions): {lowered}")
        if results.memory is not None:
            lines.append(f"planned peak of values the step creates: {results.memory.planned_peak_bytes / 2**20:.2f} MiB")
        if self.layout.shard_specs:
            specs = self.layout.shard_specs.values()
            world = next(iter(specs)).world
            numel = sum(s.numel for s in specs)
            pad = sum(s.pad for s in specs)
            lines.append(f"fully_shard: {len(self.layout.shard_specs)} parameters in {world} shards each "
                         f"({numel / world / 1e6:.3f} M elements per rank, {pad} padding elements in all)")
        lines.append("passes:")
        lines += [f"  {r}" for r in self.passes_applied]
        lines.append("ops:")
        lines += [f"  {n:5d}  {op}" for op, n in op_counts(self.gm).most_common()]
        return "\n".join(lines)
