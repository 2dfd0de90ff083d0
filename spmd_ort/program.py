"""A compiled variant of the train step: graph, IO map, passes applied, executor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from spmd_ort.passes import PassRecord, PassResults, op_counts

from . import taps
from .dynamic import SymbolicShapes
from .executor import Executor
from .opaque import OpaqueCall
from .options import Options
from .runtime import active
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
    grad_inputs: list[int]  # batch tensors (indices into batch_positions) that require grad: their .grad is ours
    user_spec: pytree.TreeSpec
    user_leaves: list[Any]
    passes_applied: list[PassRecord]
    results: PassResults
    executor: Executor
    options: Options
    trace_seconds: float
    compile_seconds: float
    opaque: tuple[OpaqueCall, ...] = ()  # parts that run eagerly as host nodes (spmd_ort.opaque)
    opaque_seconds: tuple[float, ...] = ()  # per opaque call, forward + backward, in the last step
    trace_attempts: int = 1
    symbolic: SymbolicShapes | None = None  # symbolic dims of the batch and their guards (spmd_ort.dynamic)
    traced_because: str = ""  # what made the step trace this variant (spmd_ort.transition)
    steps_run: int = 0

    def __post_init__(self):
        # batch tensors whose existing .grad is a graph input, in placeholder order
        self._grads_in = [s.index for s in self.input_slots if s.kind == "input_grad"]

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def backend(self) -> str:
        return self.options.backend

    def run(self, args: tuple, kwargs: dict) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        batch = [leaves[i] for i in self.batch_positions]
        inputs = self.layout.gather() + batch
        inputs += [batch[k].grad for k in self._grads_in]
        if self.opaque:
            with active().running(self.opaque) as frame:  # what opaque forwards save for their backwards, this step
                outs = self.executor.run(inputs)
            self.opaque_seconds = tuple(frame.seconds)
        else:
            outs = self.executor.run(inputs)
        # An executor that reuses its output buffers overwrites them next step:
        # what escapes the step (user outputs, newly assigned state) is copied.
        owned = not self.executor.reuses_buffers
        if not owned:
            outs = [o.clone() if slot.kind == "user" else o for slot, o in zip(self.output_slots, outs)]
        state_slots, state_vals, user_vals, stats, input_grads = [], [], [], [], {}
        for slot, value in zip(self.output_slots, outs, strict=True):
            if slot.kind == "user":
                user_vals.append(value)
            elif slot.kind == "stats":
                stats.append((slot.index, value if owned else value.clone()))
            elif slot.kind == "batch":
                with torch.no_grad():
                    batch[slot.index].copy_(value)
            elif slot.kind == "input_grad":
                input_grads[slot.index] = value
            else:
                state_slots.append(slot)
                state_vals.append(value)
        self.layout.write_back(state_slots, state_vals, owned=owned)
        for k in self.grad_inputs:
            _write_grad(batch[k], input_grads.get(k), owned)
        if stats:
            taps.deliver(stats)
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
        if self.symbolic is not None:
            lines.append("symbolic sizes (dynamic shapes): " + (", ".join(
                f"input[{k}] {'value' if d is None else f'dim {d}'} = {name}"
                for name, (k, d) in sorted(self.symbolic.sources.items(), key=lambda kv: str(kv[1]))) or "none")
                         + (f"; {len(self.symbolic.guards)} guards" if self.symbolic.guards else "")
                         + (f"; fixed by the model: {self.symbolic.specialised}" if self.symbolic.specialised else ""))
        if self.opaque:
            retraced = (f"; {self.trace_attempts} traces, each failed one made one more part opaque"
                        if self.trace_attempts > 1 else "")
            lines.append(f"opaque parts: {len(self.opaque)} (the user's code runs eagerly in torch, as host nodes "
                         f"opaque_forward/opaque_backward{retraced})")
            seconds = self.opaque_seconds or (None,) * len(self.opaque)
            lines += [f"  {call.describe()}" + (f"; last step {t * 1e3:.1f} ms" if t is not None else "")
                      for call, t in zip(self.opaque, seconds)]
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


def _write_grad(t: torch.Tensor, g: torch.Tensor | None, owned: bool) -> None:
    """An input's ``.grad`` after the step, as eager leaves it: None, accumulated in place, or a new tensor."""
    with torch.no_grad():
        if g is None:
            t.grad = None
        elif t.grad is not None and t.grad.shape == g.shape and t.grad.dtype == g.dtype:
            if g is not t.grad:
                t.grad.copy_(g)
        else:
            t.grad = g if owned else g.clone()
