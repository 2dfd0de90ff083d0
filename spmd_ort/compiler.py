"""The pipeline of one compiled variant: trace -> passes -> executor.

:meth:`Compiler.compile` is the whole of it, in three calls:

    trace_step (spmd_ort.capture.trace)
        -> run_passes(build_pipeline(...)) (spmd_ort.passes: clean-up, parallel expansion,
           user transforms, analyses, backend preparation)
        -> build_executor (spmd_ort.backends.registry: fx, or ORT: partition -> export -> sessions)

and :meth:`Compiler.compile_everywhere` adds the agreement of every rank on the result.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence

from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from spmd_ort import passes as P
from spmd_ort.passes.analysis import CapturePlan
from spmd_ort.passes.expand import node_signatures
from spmd_ort.distributed.checksums import batch_checksums, state_checksums
from spmd_ort.capture.inputs import StepCall, StepInputs
from spmd_ort.capture.opaque import OpaquePlan
from spmd_ort.distributed.experts import ExpertParallel, check_experts
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.trace import COMPILE_LOCK, gc_paused, trace_step
from spmd_ort.capture.transition import StepKey
from spmd_ort.graph.symbolic import DynamicDims, size_oblivious
from spmd_ort.runtime.taps import TapRegistry
from spmd_ort.distributed import parallel
from spmd_ort.distributed.dtensor import has_dtensor_state
from spmd_ort.distributed.stages import PipelineParallel, micro_batch
from spmd_ort.options import Options, get_logger
from spmd_ort.backends.cuda_graph import hparams_on_device
from spmd_ort.backends.registry import build_executor
from spmd_ort.program import CompiledProgram

logger = get_logger(__name__)


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph later passes cannot touch."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return _LazyGraphModule(gm, graph)  # its code generated if it ever runs (debug tools), not here


@dataclass
class _Traced:
    """A compile's traced stage, handed to the passes after the ranks' exchange (outside the compile lock)."""

    layout: StateLayout
    inputs: StepInputs
    traced: object  # capture.trace's result
    snapshot: fx.GraphModule  # the graph as traced, which later passes cannot touch
    micro_rows: int = 0  # pipeline parallelism: the rows of the micro-batch the step was traced on
    micro_batched: frozenset = frozenset()  # ... and the batch inputs (slot indices) cut into micro-batches


class Compiler:
    """Compiles variants of one train step ``fn`` with one configuration (options, overrides, opaque plan)."""

    def __init__(self, fn: Callable, *, name: str, options: Options, overrides: Sequence,
                 gm_transformation: Callable | None, opaque_plan: OpaquePlan, taps: TapRegistry,
                 mixed_precision=None):
        self.fn = fn
        # the parallel mode's MixedPrecisionPolicy: it applies on one process too, where the mode resolves to None
        self.mixed_precision = mixed_precision
        self.taps = taps  # the step's activation taps (its runtime's): made while tracing, fed after each run
        self.name = name
        self.options = options
        self.overrides = list(overrides)
        self.gm_transformation = gm_transformation
        self.opaque_plan = opaque_plan  # grows as traces find untraceable parts, kept across variants
        self.warned: set = set()  # WARNINGs this step gave while compiling: each once per step, not per variant

    def compile_everywhere(self, call: StepCall, key: StepKey, *, dynamic: DynamicDims,
                           previous: CompiledProgram | None, reason: str, **build) -> CompiledProgram:
        """Compile; on several ranks, also agree that every rank compiled the same graph.

        A rank whose compile failed still takes part in the agreement, so the
        others fail with it instead of waiting for it in a collective.  ``build``: :meth:`compile`'s
        ``executor`` and ``after_passes``.
        """
        if call.world_size == 1 or (call.mode is None and not has_dtensor_state(call.module)):
            return self.compile(call, key, dynamic=dynamic, previous=previous, reason=reason, **build)
        exchanged = False

        def exchange(payload):  # after the trace, before the passes: every rank once (see exchange_traced)
            nonlocal exchanged
            exchanged = True
            return parallel.exchange_traced("the traced graphs", payload)

        try:
            program, error = self.compile(call, key, dynamic=dynamic, previous=previous, reason=reason,
                                          exchange=exchange, **build), None
            description = program.signature()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the agreement
            program, error = None, exc
            description = f"compile failed: {type(exc).__name__}: {getattr(exc, 'detail', exc)}"
        if not exchanged:  # this rank failed before its passes: the others' exchange must not wait for it
            parallel.exchange_traced("the traced graphs", None)
        parallel.check_agreement("the compiled train step", description)
        if error is not None:
            raise error
        staged = program.stage_signature()
        if staged is not None:  # (every rank compiled, or every rank raised above)
            parallel.check_agreement_by_place("the compiled stages", *staged)
        return program

    def compile(self, call: StepCall, key: StepKey, *, dynamic: DynamicDims, previous: CompiledProgram | None,
                reason: str, exchange: Callable | None = None, executor: bool = True,
                after_passes: Callable | None = None) -> CompiledProgram:
        """trace -> passes (the one pipeline) -> executor, one compile in the process at a time (COMPILE_LOCK).

        ``after_passes(gm, ctx)`` sees the finished graph before the executor is built (a plan's cost model);
        ``executor=False`` builds none (a plan that skips the export): the program then only describes the step.

        The lock covers only this local work, not the ranks' exchanges (``exchange`` after the trace, and
        compile_everywhere's agreement after the whole): a rank waiting in one holds nothing another thread's
        compile needs.
        """
        t0 = time.perf_counter()
        with self._locked(key, dynamic):
            stage = self._trace(call, key, dynamic=dynamic, previous=previous)
        # the ranks' exchange waits for every rank: outside the lock, so a rank waiting in it holds nothing another
        # thread's compile needs
        signatures = None
        # context and pipeline parallelism: the ranks of a group pass one batch, each computing its part of it
        split = isinstance(call.mode, (parallel.ContextParallel, PipelineParallel))
        if exchange is not None:
            signatures = exchange({"nodes": node_signatures(stage.traced.gm),
                                   "state": state_checksums(stage.layout, stage.traced.input_slots),
                                   "batch": batch_checksums(call.leaves)}
                                  if stage.layout.expands or split else None)
        if signatures is not None:  # a program's first call: the ranks of a tensor- (context-) parallel group
            groups = call.mode.groups(call.world_size) if split else \
                parallel.tensor_parallel_groups(call.module, call.tensor_parallel)  # passed one batch
            parallel.check_same_batch([s["batch"] for s in signatures], groups, stage.inputs.names, rank=call.rank,
                                      shown=False, kind="pipeline" if isinstance(call.mode, PipelineParallel)
                                      else "context-parallel" if split else "tensor-parallel")
        with self._locked(key, dynamic):
            return self._finish(call, key, stage, signatures, t0=t0, reason=reason, executor=executor,
                                after_passes=after_passes)

    @contextlib.contextmanager
    def _locked(self, key: StepKey, dynamic: DynamicDims):
        """One compile in the process at a time (torch's tracers keep process-wide state), the garbage collector
        paused, sizes traced size-obliviously where the program is symbolic."""
        t_wait = time.perf_counter()
        with COMPILE_LOCK, gc_paused(), size_oblivious(None if key.shapes else dynamic):
            waited = time.perf_counter() - t_wait
            if waited > 0.1:
                logger.debug("%s waited %.2fs for another compile in this process", self.name, waited)
            yield

    def _trace(self, call: StepCall, key: StepKey, *, dynamic: DynamicDims,
               previous: CompiledProgram | None) -> _Traced:
        """The step traced into one stateless graph (its state layout, its inputs, a snapshot of the graph)."""
        layout = StateLayout.capture(call.module, call.opt, call.rule, call.scaler,
                                     device_hparams=hparams_on_device(self.options))
        # Errors rooted in an input name it, and how it differs from the last call that compiled.
        inputs = StepInputs.of(self.fn, call.args, call.kwargs, previous_key=previous.key if previous else None)
        # spmd_ort.backends.ort.translations translates the fused CPU attention kernel (forward and backward), not the
        # CUDA ones: on an accelerator, the ORT backend traces attention in its math form.
        on_accelerator = any(p.device.type not in ("cpu", "meta") for p in layout.params)  # meta: a plan's
        experts = call.mode if isinstance(call.mode, ExpertParallel) else None
        if experts is not None:  # a bad glob or expert count: a ConfigError before anything is traced
            check_experts(call.module, experts, call.world_size)
        self.opaque_plan.experts = experts
        pipelined = isinstance(call.mode, PipelineParallel)
        args, kwargs, micro_rows, cut = micro_batch(call, inputs) if pipelined else (call.args, call.kwargs, 0, ())
        traced = trace_step(self.fn, args, kwargs, layout,
                            sdpa_math=self.options.backend == "ort" and on_accelerator,
                            tag_grads=isinstance(call.mode, (parallel.DataParallel, PipelineParallel)),
                            plan=self.opaque_plan,
                            inputs=inputs,
                            mixed_precision=self.mixed_precision,
                            dynamic=None if key.shapes else dynamic,  # key.shapes: guards rejected the sizes
                            taps=self.taps, warned=self.warned)
        self.opaque_plan.check_forced_met()
        if traced.symbolic is not None and traced.symbolic.specialised:
            names = {k: inputs.names[pos] for k, pos in enumerate(traced.batch_positions)}
            logger.info("%s: the model fixes %s; those dims stay static", self.name,
                        ", ".join(f"the value of `{names[k]}` at {size}" if d is None else
                                  f"dim {d} of `{names[k]}` at {size}"
                                  for (k, d), size in sorted(traced.symbolic.specialised.items(), key=str)))
        return _Traced(layout=layout, inputs=inputs, traced=traced, snapshot=snapshot(traced.gm), micro_rows=micro_rows,
                       micro_batched=frozenset(k for k, pos in enumerate(traced.batch_positions) if pos in cut))

    def _finish(self, call: StepCall, key: StepKey, stage: _Traced, signatures, *, t0: float, reason: str,
                executor: bool, after_passes: Callable | None) -> CompiledProgram:
        """The traced graph through the passes (``signatures``: every rank's traced graph, from the exchange, for
        the passes that must know it) and the executor.  Ranks of a tensor-parallel group whose batches differ
        raised before this, all of them."""
        layout, traced, traced_gm = stage.layout, stage.traced, stage.snapshot
        world, group = call.world_size, ""
        dp_group = call.tensor_parallel.dp_group() if call.tensor_parallel is not None else None
        if dp_group is not None:  # 2-D: the data-parallel passes reduce over the dp dim
            world, group = dp_group.size(), dp_group.group_name
        ctx = P.PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots),
                            mode=call.mode, world_size=world, group=group, rank=call.rank,
                            shard_specs=layout.shard_specs, layout=layout, disabled=self.options.disabled_passes,
                            check_contracts=self.options.check_passes, taps=self.taps,
                            activation_memory_budget=self.options.activation_memory_budget,
                            rank_signatures=signatures, warned=self.warned, opaque=tuple(traced.opaque),
                            micro_rows=stage.micro_rows, micro_batched=stage.micro_batched)
        pipeline = P.build_pipeline(call.mode, self.options.backend, overrides=self.overrides,
                                    gm_transformation=self.gm_transformation, expand=layout.expands)
        gm = P.run_passes(traced.gm, ctx, pipeline)
        if after_passes is not None:
            after_passes(gm, ctx)
        built = build_executor(gm, self.options, ctx.results.get(CapturePlan), ctx.input_slots) if executor else None
        program = CompiledProgram(
            key=key, gm=built.gm if built is not None else gm, traced_gm=traced_gm, layout=layout,
            input_slots=ctx.input_slots,
            output_slots=ctx.output_slots, batch_positions=traced.batch_positions, grad_inputs=traced.grad_inputs,
            user_spec=traced.user_spec, user_leaves=traced.user_leaves, passes_applied=ctx.applied,
            results=ctx.results, executor=built, opaque=traced.opaque, trace_attempts=traced.attempts,
            symbolic=traced.symbolic, options=self.options, trace_seconds=traced.seconds,
            compile_seconds=time.perf_counter() - t0, traced_because=reason, taps=self.taps)
        logger.info("compiled %s: %d graph nodes, trace %.2fs, total %.2fs", self.name,
                    len(gm.graph.nodes), traced.seconds, program.compile_seconds)
        return program
