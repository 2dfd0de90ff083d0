"""``CompiledStep``: the callable that ``@spmd_ort.compile()`` returns.

One call, top to bottom (:meth:`CompiledStep.__call__`):

    bind the call (StepCall) -> prepare the module and optimizer (capture.prepare: one undo)
    -> the agreed key under the shape policy (capture.shapes) -> a kept variant, or a new one
    (compiler: trace -> passes -> executor; its first run checked) -> run (runtime.program)

Everything the call changed is undone if it raises; the model and optimizer are then as
the call found them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spmd_ort.capture import amp
from spmd_ort.capture.inputs import (StepCall, StepInputs, bind_arguments, find_state_owners, refuse_meta,
                                     signature_of, unwrap_torch_compiled)
from spmd_ort.capture.opaque import OpaquePlan
from spmd_ort.capture.optim import rule_for
from spmd_ort.capture.prepare import Preparation
from spmd_ort.capture.shapes import ShapePolicy
from spmd_ort.capture.transition import StepKey, TransitionManager
from spmd_ort.compiler import Compiler
from spmd_ort.debug.explain import explain
from spmd_ort.debug.profile import Profiler
from spmd_ort.distributed import parallel
from spmd_ort.distributed.sharding import persistent_bytes
from spmd_ort.distributed.parallel_dims import as_mode
from spmd_ort.distributed.parallel import TensorParallel
from spmd_ort.errors import CollectiveTimeout, CompileError, ConfigError, InputIndexError
from spmd_ort.options import Options, get_logger
from spmd_ort.passes.analysis import MemoryPlan
from spmd_ort.overrides import OpaqueOverride
from spmd_ort.runtime.collectives import StepComm
from spmd_ort.runtime.step_runtime import StepRuntime
from spmd_ort.runtime.memory import host_memory_retained, max_rss_bytes, retain_host_memory
from spmd_ort.program import CompiledProgram
from spmd_ort.distributed.stages import mark_stages
from spmd_ort.passes.pipeline_parallel import PipelineStages
from spmd_ort.tuner import Tuner

logger = get_logger(__name__)


class CompiledStep:
    """The callable that ``@spmd_ort.compile()`` returns.

    ``compiled`` is the variant used by the last call (a :class:`CompiledProgram`:
    ``.gm``, ``.input_slots``, ``.output_slots``, ``.passes_applied``,
    ``.describe()``); ``variants`` lists all kept variants.
    """

    def __init__(self, fn: Callable, *, module_override, gm_transformation, parallel_mode, options: Options):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.module_override = list(module_override or [])
        self.gm_transformation = gm_transformation
        self.layout = parallel_mode  # as the user gave it: a Parallel, a DataParallel or TensorParallel shorthand
        self.options = options
        self.runtime = StepRuntime(options)  # this step's communicator and options, active while it runs
        self.transitions: TransitionManager[CompiledProgram] = TransitionManager(getattr(fn, "__name__", "step"))
        self.shapes = ShapePolicy(options.dynamic, fn, self.transitions)
        # which parts run opaquely: grows as traces find untraceable ones, kept across variants
        self.opaque_plan = OpaquePlan(
            custom_autograd=options.custom_autograd, auto_opaque=options.auto_opaque,
            forced=options.opaque_functions,
            patterns=tuple(p for o in self.module_override if isinstance(o, OpaqueOverride) for p in o.patterns))
        self.compiler = Compiler(fn, name=self.transitions.name, options=options, overrides=self.module_override,
                                 gm_transformation=gm_transformation, opaque_plan=self.opaque_plan,
                                 taps=self.runtime.taps, mixed_precision=self.mixed_precision)
        self.profiler = Profiler(self.runtime)
        # every choice made from measurements after compile, and the recompiles they cause (spmd_ort.tuner)
        self.tuner = Tuner(options, self.transitions.name, self.transitions, self.runtime)
        self.compiled: CompiledProgram | None = None
        self.comm: StepComm | None = None  # collectives of the last step
        self._overridden: set[int] = set()  # modules whose Override replacements are in place
        self._synced: set[int] = set()  # modules given rank 0's weights (replicate)
        self._started = False
        self._last: tuple | None = None  # (module, optimizer) of the last call
        self._signature = signature_of(fn)
        self._unwrapped = False  # said once that a torch.compile'd model is compiled through the module it wraps
        self.backend_reason = "chosen by the user" if options.backend_given else "the default"
        self._backend_settled = options.backend_given  # a default backend is settled by the first call's device

    # ------------------------------------------------------------------ the call
    def __call__(self, *args: Any, last_train_step: bool = False, **kwargs: Any) -> Any:
        call = self.bind(args, kwargs)
        overrides = self.module_override if id(call.module) not in self._overridden else ()
        with Preparation(call, overrides=overrides) as prep:
            key = self.shapes.agreed_key(call)
            program = self.transitions.lookup(key)
            if program is not None:
                out = self._run(program, call)
            else:
                program, key = self.build(call, key, prep)
                out = self._first_run(program, call)
                prep.undo_prefill(program.skipped)  # eager creates no state for what its first step skips
                self.transitions.insert(key, program)
        if prep.swapped:
            self._overridden.add(id(call.module))
        self.compiled, self._last = program, (call.module, call.opt)
        self.tuner.after_run(program, parallel.resolve(self.parallel_mode) if call.mode is not None else None,
                             self.comm)
        if last_train_step:  # the reference API's drain: nothing is left in flight when training ends
            self.runtime.comm.drop_carried()
            self.runtime.comm.finish()
        elif call.mode is not None and self.transitions.variants:
            program.carry_gathers(self.runtime.comm)  # the next step's first gather starts now
        return out

    def bind(self, args: tuple, kwargs: dict, planning: bool = False) -> StepCall:
        """The call's parts (module, optimizer, scaler, mode, rank); ``planning``: a plan's meta copies, which
        are never run (no meta refusal, no process-wide settings)."""
        bind_arguments(self.fn, args, kwargs, self._signature)  # a call that does not match is no trace failure
        args, kwargs, wrappers = unwrap_torch_compiled(args, kwargs)
        if wrappers and not self._unwrapped:
            self._unwrapped = True
            logger.info("%s: the model passed is torch.compile'd (%s); spmd_ort compiles the module it wraps (%s) "
                        "instead: the same parameters, and torch.compile's own compilation is not used",
                        self.transitions.name, type(wrappers[0]).__name__, type(wrappers[0]._orig_mod).__name__)
        module, opt, scaler = find_state_owners(args, kwargs)
        rank, world_size = parallel.world()
        stepped = self._last is not None and self._last[0] is module and self._last[1] is opt  # its state had values
        if not planning:
            refuse_meta(module, opt, args, kwargs, self._signature, rank if world_size > 1 else None,
                        state=not stepped)
        laid_out = getattr(module, parallel.PARALLELIZED_ATTR, None)  # spmd_ort.parallelize's mode
        if laid_out is not None and self.parallel_mode is None:
            self._adopt(laid_out)
        elif laid_out is not None and (difference := parallel.layout_difference(laid_out, self.parallel_mode)):
            raise ConfigError(f"{type(module).__name__} was parallelized with {laid_out!r}, but this step compiles "
                              f"with parallel_mode={self.parallel_mode!r}, another layout ({difference}). Fix: "
                              "compile with the layout the model was parallelized with (or parallel_mode=None: "
                              "the model's own); settings that keep the layout (bucket caps, prefetch, resharding, "
                              "offloaded optimizer state, mixed precision) may differ. Nothing was changed",
                              rank=rank if world_size > 1 else None)
        if not self._backend_settled and not planning:
            self._settle_backend(module)
        if not self._started and not planning:
            self._started = True
            if self.options.retain_host_memory:  # opt-in (SPMD_ORT_RETAIN_HOST_MEMORY=1): acts on the process
                retain_host_memory()  # steady-state steps reuse host memory instead of page-faulting
        return StepCall(args=args, kwargs=kwargs, module=module, opt=opt, scaler=scaler,
                        rule=rule_for(opt) if opt is not None else None,
                        mode=self.tuner.bucket_mode(parallel.resolve(self.parallel_mode, module), module,
                                                    recall=not planning),
                        rank=rank, world_size=world_size, tensor_parallel=self._tensor_parallel)

    def _adopt(self, mode) -> None:
        """``parallel_mode=None`` on a model :func:`spmd_ort.parallelize` laid out: the step compiles with the mode it
        was laid out with (fully_shard included), once, said at INFO."""
        logger.info("%s: parallel_mode=None: the model was parallelized with %r; the step compiles with it",
                    self.transitions.name, mode)
        self.layout = mode
        self.compiler.mixed_precision = self.mixed_precision

    def _settle_backend(self, module: nn.Module) -> None:
        """The default backend for the device the module's tensors are on (:func:`spmd_ort.options.
        default_backend_for`): on a GPU without onnxruntime-gpu, inductor or fx instead of a ConfigError."""
        self._backend_settled = True
        device = next((p.device.type for p in module.parameters()), "cpu")
        if device != "cuda" or self.options.backend != "ort":
            return
        import onnxruntime
        from torch.utils._triton import has_triton

        from spmd_ort.options import default_backend_for

        backend, self.backend_reason = default_backend_for(device, onnxruntime.get_available_providers(),
                                                           has_triton())
        if backend != self.options.backend:
            logger.warning("%s: backend %s: %s", self.transitions.name, backend, self.backend_reason)
            self.options = self.options.replace(backend=backend)
            for holder in (self.runtime, self.compiler, self.tuner):
                holder.options = self.options

    def build(self, call: StepCall, key: StepKey, prep: Preparation, *, planning: bool = False,
              **build) -> tuple[CompiledProgram, StepKey]:
        """A new variant of ``call`` for ``key``: compiled on every rank and agreed (retried with static dims where
        new symbolic ones fail to trace, and without prefilled optimizer state where a parameter gets no
        gradient).  The one build path: a call's (``__call__``) and a plan's (``planning``: a twin on meta copies
        in a fake world, nothing broadcast; ``build``: :meth:`spmd_ort.compiler.Compiler.compile`'s ``executor``
        and ``after_passes``)."""
        try:
            program = self._compile_everywhere(call, key, **build)
        except Exception as exc:
            key = self.shapes.narrow(call, exc)
            if key is None:
                raise
            program = self._compile_everywhere(call, key, **build)
        if prep.prefilled and not program.updates_state_of(prep.prefilled):
            # a parameter got no gradient, so eager would create no state for it: trace as eager steps
            prep.undo_prefill()
            key = self.shapes.agreed_key(call)
            program = self._compile_everywhere(call, key, **build)
        self.tuner.compiled(program)  # the cap its buckets were built with; its inductor candidate or not
        stages = program.results.get(PipelineStages)
        if stages is not None and not planning:  # what a checkpoint of the model reads from each stage
            mark_stages(call.module, call.mode, stages.stepped)
        if call.mode is not None and not call.mode.sharded and id(call.module) not in self._synced and not planning:
            tp = self._tensor_parallel
            # rank 0's weights everywhere, as DDP does (2-D: within each data-parallel group)
            parallel.broadcast_state(call.module, group=tp.dp_group() if tp is not None else None)
            self._synced.add(id(call.module))
        return program, key

    def _compile_everywhere(self, call: StepCall, key: StepKey, **build) -> CompiledProgram:
        return self.compiler.compile_everywhere(call, key, dynamic=self.shapes.dynamic, previous=self.compiled,
                                                reason=self.transitions.reason, **build)

    def twin(self) -> CompiledStep:
        """A new step of the same function and configuration, sharing nothing with this one's variants, shapes,
        opaque parts or tuner (what a plan compiles)."""
        return type(self)(self.fn, module_override=self.module_override, gm_transformation=self.gm_transformation,
                          parallel_mode=self.layout, options=self.options)

    def check_call(self, args: tuple, kwargs: dict) -> None:
        """A call that does not match the step function's signature is a TypeError, as calling it would be."""
        bind_arguments(self.fn, args, kwargs, self._signature)

    def _first_run(self, program: CompiledProgram, call: StepCall) -> Any:
        """The first run of a new variant; it may still fail (ORT checks, values fake tensors cannot see).

        A failure after an input changed shape or dtype since the last call that compiled names that input.
        """
        try:
            return self._run(program, call)
        except (CompileError, CollectiveTimeout, InputIndexError):  # InputIndexError names the input itself
            raise
        except Exception as exc:
            previous = self.compiled.key if self.compiled else None
            inputs = StepInputs.of(self.fn, call.args, call.kwargs, previous_key=previous)
            blamed = inputs.blame([], None, None, f"{type(exc).__name__}: {' '.join(str(exc).split()[:60])}",
                                  running=True)
            if blamed is None:
                raise
            raise blamed from exc

    def _run(self, program: CompiledProgram, call: StepCall) -> Any:
        comm = self.runtime.comm
        self.profiler.before_run(program.steps_run)
        comm.start_step()
        comm.owner = program  # its carried gathers are this program's to take
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            with self.runtime.active(), amp.autocast_disabled():  # the graph holds autocast's casts already
                self.tuner.before_run(program, call.args, call.kwargs)  # inductor's candidate, when it is due
                return program.run(call.args, call.kwargs)
        finally:
            self.comm = comm.end_step()
            t1 = time.perf_counter()
            self.comm.wall_s, self.comm.cpu_s = t1 - t0, time.thread_time() - cpu0
            self.profiler.after_run(t0, t1)

    @property
    def parallel_mode(self):
        """What the passes consume: the layout lowered for this process's world (:meth:`spmd_ort.Parallel.lower`),
        or the shorthand mode as given."""
        return as_mode(self.layout)

    @property
    def _tensor_parallel(self) -> TensorParallel | None:
        return self.parallel_mode if isinstance(self.parallel_mode, TensorParallel) else None

    # ------------------------------------------------------------------ what users ask of it
    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def mixed_precision(self) -> amp.MixedPrecisionPolicy | None:
        """The parallel mode's MixedPrecisionPolicy (it applies on one process too)."""
        return getattr(self.layout, "mixed_precision", None)

    @property
    def buckets(self):
        """``bucket_cap_mb="auto"``'s tuner (:class:`spmd_ort.buckets.BucketTuner`: ``.choice``)."""
        return self.tuner.buckets

    def settled_for(self, steps: int) -> bool:
        """Whether the next ``steps`` calls (on the last call's program) are steady: the tuner has nothing left to
        measure, compile or time in them (:meth:`spmd_ort.tuner.Tuner.settled_for`).  For benchmarks: warm up
        until it holds, then time."""
        program = self.compiled
        return program is None or self.tuner.settled_for(program, steps)

    @property
    def variants(self) -> list[CompiledProgram]:
        return list(self.transitions.variants.values())

    @property
    def dynamic(self):
        """The dims of tensor inputs traced as symbols (:class:`spmd_ort.graph.symbolic.DynamicDims`)."""
        return self.shapes.dynamic

    @property
    def profile_paths(self) -> tuple[Path, Path] | None:
        """(trace, picture) written by the last :meth:`profile`."""
        return self.profiler.paths

    def memory(self) -> dict:
        """Per-rank memory of the last compiled step, in bytes.

        ``persistent``: parameters, gradients and optimizer state held between
        steps (``params``, ``grads``, ``opt_state``, ``total``; ``buffers``
        apart); ``peak``: persistent total + buffers + the planned peak of the
        values the step creates (``planned_activation_peak``,
        :func:`spmd_ort.graph.liveness.plan_activation_memory`), of which
        ``planned_saved_for_backward`` are forward values kept for the backward at that peak
        (what ``activation_memory_budget`` trades for recomputation);
        ``max_rss``: the process's peak resident set so far;
        ``host_memory_retained``: whether freed host memory stays in the process
        for reuse (:func:`spmd_ort.runtime.memory.retain_host_memory`).
        """
        if self.compiled is None or self._last is None:
            raise RuntimeError("memory(): the step has not run yet")
        module, opt = self._last
        persistent = persistent_bytes(module, opt)
        plan = self.compiled.results.get(MemoryPlan)
        planned = plan.planned_peak_bytes
        return {"persistent": persistent, "planned_activation_peak": planned,
                "planned_saved_for_backward": plan.saved_for_backward_bytes,
                "peak": persistent["total"] + persistent["buffers"] + planned, "max_rss": max_rss_bytes(),
                "host_memory_retained": host_memory_retained()}

    def explain(self) -> str:
        """The plan of the last compiled variant in words: variants and why each was traced, passes,
        collectives per step (planned vs measured), segments and host nodes, memory
        (:mod:`spmd_ort.debug.explain`)."""
        return explain(self, self.memory() if self._last is not None and self.compiled is not None else None)

    def plan(self, *args: Any, world_size: int, device="h100", rank: int = 0, export: bool = True,
             cache: bool | None = None, **kwargs: Any):
        """Plan this step for ``world_size`` ranks without them: a :class:`spmd_ort.plan.Plan` of what rank
        ``rank`` holds (parameters, gradients, optimizer state, the activations' and collectives' peak), sends
        (bytes per collective kind) and computes (FLOPs), its predicted step time on ``device`` (``"h100"``,
        ``"h200"``, ``"a100"``, ``"cpu"`` (this CPU, measured), or a :class:`spmd_ort.plan.DeviceSpec`) and
        whether it fits.

        Called as the step is (``train_step.plan(model, opt, x, y, world_size=64)``), in a process without a
        process group: the whole pipeline runs on meta copies of the model and optimizer (build the model on the
        meta device: nothing of its size is allocated) over torch's fake process group, with the step's
        ``parallel_mode`` (a ``TensorParallel`` takes its mesh as a shape, ``mesh=(8, 8)``) and options;
        on the ORT backend the segments are exported and loaded as a run would (for the CPU provider; the plan's
        tensors are meta), unless ``export=False``; fx and inductor build no executor.  The model, optimizer and
        this step are left as they were (the plan compiles a twin of the step).

        ``cache`` (default: ``SPMD_ORT_PLAN_CACHE``, on): the same plan again (the same model, optimizer, call,
        step, code and arguments) is read from ``SPMD_ORT_CACHE_DIR/plans``, where its first call kept it
        (:mod:`spmd_ort.plan.cache`).
        """
        from spmd_ort.plan.planner import plan_step

        return plan_step(self, args, kwargs, world_size=world_size, device=device, rank=rank, export=export,
                         cache=cache)

    def profile(self, steps: int = 1, path: str | Path = "spmd_ort_profile") -> None:
        """Record the timeline of the next ``steps`` calls, then write ``<path>.json`` and ``<path>.png``.

        Every rank must call it at the same point of its loop (the ranks' spans are merged on
        rank 0, which writes a Chrome/Perfetto trace with one process per rank and a picture of
        the last profiled step: compute, host and communication lanes, overlap shaded;
        :mod:`spmd_ort.debug.timeline`).  Profiled steps run node by node, so they are a little slower
        than others.  ``profile_paths`` holds the two paths once written.
        """
        self.profiler.arm(steps, path)

    def prepare(self, module: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
        """Put ``module`` (and ``opt``'s state) in the layout this step trains it in, as its first call would.

        Under ``fully_shard`` an unsharded module is sharded now (collective:
        every rank calls it), e.g. to load a checkpoint into it before the
        first step; otherwise nothing changes.
        """
        with self.preparing(module, opt):
            pass

    @contextlib.contextmanager
    def preparing(self, module: nn.Module, opt: torch.optim.Optimizer | None = None):
        """:meth:`prepare` for the duration of a block that may fail: undone if it raises, kept if it ends.

        (A checkpoint load that fails leaves a fresh model unsharded, as it found it.)
        """
        rank, world_size = parallel.world()
        (module,), _, _ = unwrap_torch_compiled((module,), {})
        call = StepCall(args=(), kwargs={}, module=module, opt=opt, scaler=None, rule=None,
                        mode=parallel.resolve(self.parallel_mode, module), rank=rank, world_size=world_size,
                        tensor_parallel=self._tensor_parallel)
        with Preparation(call, prefill=False):
            yield
