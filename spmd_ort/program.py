"""A compiled variant of the train step: graph, IO map, passes applied, executor."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from spmd_ort.passes import PassRecord, PassResults, op_counts
from spmd_ort.passes.pipeline_parallel import PipelineStages
from spmd_ort.passes.shard_schedule import CarriedGather

from spmd_ort.runtime.taps import TapRegistry
from spmd_ort.graph.symbolic import SymbolicShapes
from spmd_ort.backends.registry import Executor
from spmd_ort.runtime.opaque_calls import OpaqueCall
from spmd_ort.options import Options
from spmd_ort.graph import ops
from spmd_ort.runtime.step_runtime import active
from spmd_ort.graph.meta import GRADIENT_OF
from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.trace import TENSOR
from spmd_ort.distributed import dtensor
from spmd_ort.capture.transition import StepKey


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
    opaque: tuple[OpaqueCall, ...] = ()  # parts that run eagerly as host nodes (spmd_ort.runtime.opaque_calls)
    opaque_seconds: tuple[float, ...] = ()  # per opaque call, forward + backward, in the last step
    trace_attempts: int = 1
    symbolic: SymbolicShapes | None = None  # symbolic dims of the batch and their guards (spmd_ort.graph.symbolic)
    traced_because: str = ""  # what made the step trace this variant (spmd_ort.capture.transition)
    taps: TapRegistry | None = None  # the step's activation taps (debug subscribers), which its stats outputs feed
    steps_run: int = 0
    # parameters the last step left alone: no opaque part made their gradient (spmd_ort.capture.presence)
    skipped: list = field(default_factory=list)

    def __post_init__(self):
        # batch tensors whose existing .grad is a graph input, in placeholder order
        self._grads_in = [s.index for s in self.input_slots if s.kind is SlotKind.INPUT_GRAD]

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def backend(self) -> str:
        return self.options.backend

    def batch_inputs(self, args: tuple, kwargs: dict) -> list:
        """The call's graph inputs among its leaves: tensors, and Python numbers lifted to inputs (dynamic shapes)."""
        leaves = pytree.tree_leaves((args, kwargs))
        return [leaves[i] for i in self.batch_positions]

    def graph_inputs(self, args: tuple, kwargs: dict) -> list:
        """The graph's inputs for a call (state, batch, the batch's existing gradients), as :meth:`run` feeds them."""
        batch = self.batch_inputs(args, kwargs)
        return self.layout.gather() + batch + [batch[k].grad for k in self._grads_in]

    def frame(self):
        """The context the graph runs in: with opaque parts, their frame (what their forwards save)."""
        return active().running(self.opaque) if self.opaque else contextlib.nullcontext()

    def run(self, args: tuple, kwargs: dict) -> Any:
        batch = self.batch_inputs(args, kwargs)
        inputs = self.layout.gather() + batch
        inputs += [batch[k].grad for k in self._grads_in]
        # a pipeline rank's index checks are its stages' own: they agree at one point every rank reaches
        active().deferred_checks = [] if self.results.get(PipelineStages) is not None else None
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
            outs = [o.clone() if slot.kind is SlotKind.USER else o for slot, o in zip(self.output_slots, outs)]
        state_slots, state_vals, user_vals, stats, input_grads = [], [], [], [], {}
        for slot, value in zip(self.output_slots, outs, strict=True):
            if slot.kind is SlotKind.USER:
                user_vals.append(value)
            elif slot.kind is SlotKind.STATS:
                stats.append((slot.index, value if owned else value.clone()))
            elif slot.kind is SlotKind.BATCH:
                with torch.no_grad():
                    batch[slot.index].copy_(value)
            elif slot.kind is SlotKind.INPUT_GRAD:
                input_grads[slot.index] = value
            else:
                state_slots.append(slot)
                state_vals.append(value)
        self.skipped = self.layout.write_back(state_slots, state_vals, owned=owned)
        for k in self.grad_inputs:
            _write_grad(batch[k], input_grads.get(k), owned)
        if stats and self.taps is not None:
            self.taps.deliver(stats)
        self.steps_run += 1
        it = iter(user_vals)
        return pytree.tree_unflatten([_user_value(x, it) for x in self.user_leaves], self.user_spec)

    def carry_gathers(self, comm) -> None:
        """After a step: start the gather its next run takes first (``carry_first_gather_pass``), on the state as
        it now is; a program without one drops what an earlier program carried."""
        carried = self.results.get(CarriedGather)
        if carried is None:
            comm.drop_carried()
            return
        # the recipe reads parameter shards, the first placeholders: read them alone (the rest of the layout's
        # state may be gone, e.g. optimizer state a skipped parameter lacks: spmd_ort.capture.presence)
        params = self.layout.params
        if all(i < len(params) for i in carried.inputs):
            sources = [self.layout.held(i, params[i]) for i in carried.inputs]
        else:
            state = self.layout.gather()
            sources = [state[i] for i in carried.inputs]
        with torch.no_grad():
            shard = carried.recipe(*sources)
        comm.carry(carried.slot, shard, carried.world, owner=self, group=carried.group)

    def updates_state_of(self, params: list) -> bool:
        """Whether the step writes new optimizer state for every one of ``params`` (each got a gradient)."""
        index = {id(p): i for i, p in enumerate(self.layout.params)}
        updated = {s.index for s in self.output_slots if s.kind is SlotKind.OPT_STATE}
        return all(index.get(id(p)) in updated for p in params)

    def signature(self) -> str:
        """What every rank must agree on: the final graph and its IO (no values, no object ids).

        In expand mode (DTensor state), and under context parallelism, each rank's graph is its own: DTensor's
        expansion bakes the rank's offsets into it (a vocabulary-sharded embedding subtracts its first row) and
        picks its piece of a split; context parallelism, its chunks of the sequence.
        What the ranks must share there is the collectives, in order, with their sizes: the agreement is on those.
        """
        io = [f"{s.kind} {s.name}" for s in self.input_slots + self.output_slots]
        # (context parallel too: each rank's graph computes its own chunks of the sequence)
        own = self.layout.expands or any(getattr(r, "rank_specific", False) for r in self.results)
        # (a pipeline's stages average their own gradients, each over its data-parallel group: those all-reduces are
        # agreed within the group, stage_signature)
        staged = self.stage_signature() is not None
        code = self.gm.code if not own else "\n".join(
            _collective_line(n) for n in self.gm.graph.nodes
            if ops.is_collective(n) and not (staged and _reduces_a_gradient(n)))
        return code + "\n" + "\n".join(io)

    def stage_signature(self) -> tuple[int, str] | None:
        """A pipeline's (this rank's place in its pipeline, the collectives of its stages): what the ranks holding
        the same stages must agree on (their gradients' all-reduces); None for other programs."""
        stages = self.results.get(PipelineStages)
        if stages is None:
            return None
        return stages.rank, "\n".join(_collective_line(n) for n in self.gm.graph.nodes if ops.is_collective(n))

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
                         + ("; size 1 included (traced size-obliviously)" if self.symbolic.least == 1 else "")
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
        if self.layout.present_params:
            names = [self.layout.param_names[i][0] for i in self.layout.present_params]
            lines.append(f"gradients only opaque parts make ({len(names)}; a step where no part makes one skips that "
                         f"parameter, as eager does): {', '.join(names)}")
        lines += self.results.lines()  # what the passes recorded, as each result renders itself
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


def _reduces_a_gradient(node: fx.Node) -> bool:
    """A gradient's all-reduce, or its wait."""
    start = node.args[0] if node.target is ops.wait_ and node.args and isinstance(node.args[0], fx.Node) else node
    return GRADIENT_OF in start.meta


def _collective_line(node: fx.Node) -> str:
    """A collective as the ranks must agree on it: the op, its non-tensor arguments, what it moves.  A process
    group by its size: ranks of different groups of one mesh dim (2-D) name different groups."""
    from spmd_ort.runtime.collectives import process_group

    names = [a.name for a in node.target._schema.arguments] if hasattr(node.target, "_schema") else []
    args = [f"group of {process_group(a).size()}" if i < len(names) and names[i] in ("group", "group_name") and a
            else a for i, a in enumerate(node.args) if not isinstance(a, fx.Node)]
    v = node.meta.get("val")
    moved = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else ""
    return f"{node.target} {args} {moved}"


def _user_value(leaf, outputs):
    """A leaf of the step's return value: the next graph output where the trace returned a tensor (wrapped in
    its DTensorSpec where it was a DTensor), the traced constant otherwise."""
    if leaf is TENSOR:
        return next(outputs)
    if isinstance(leaf, dtensor.LocalOf):
        return dtensor.wrap(next(outputs), leaf.spec)
    return leaf
