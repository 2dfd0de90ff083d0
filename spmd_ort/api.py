"""``spmd_ort.compile``: the decorator users put on their train step.

Per compiled variant (:meth:`CompiledStep._compile`):

    trace (spmd_ort.trace) -> passes (spmd_ort.passes.build_pipeline: clean-up, parallel
    expansion, user transforms, analyses, backend preparation) -> executor (fx, or ORT:
    partition -> export -> execute)
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import time
from pathlib import Path
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx, nn

from spmd_ort import passes as P

from . import amp, parallel
from .collectives import StepComm
from .errors import CollectiveTimeout, CompileError
from .executor import build_executor
from . import timeline
from .explain import explain
from .dynamic import DynamicDims, changed_dims, dims_differing_across, leading_dims
from .inputs import StepInputs, bind_arguments, signature_of
from .memory import host_memory_retained, max_rss_bytes, retain_host_memory
from .opaque_trace import OpaquePlan
from .optim import rule_for
from .options import DebugOptions, Options, configure_logging
from .program import CompiledProgram
from .runtime import StepRuntime
from .sharding import ShardedModule, is_sharded, persistent_bytes, spec_of
from .state import StateLayout, state_device
from .timeline import Recorder
from .trace import trace_step
from .transition import StepKey, TransitionManager

logger = logging.getLogger("spmd_ort")


class Override(ABC):
    """Replace a submodule for tracing, then transform the traced graph.

    ``replacement(fqn, orig_submodule)`` is called for every submodule before
    tracing (children of a submodule that is kept are visited too); return the
    module itself to keep it, or a traceable stand-in.  ``transform(gm,
    flat_state)`` runs on the traced graph after the parallel passes and before
    the backend: ``flat_state`` holds the state tensors of the first
    ``len(flat_state)`` placeholders; a transform may append state (and
    placeholders) but must keep both in the same order.
    """

    @abstractmethod
    def replacement(self, fqn: str, orig_submodule: nn.Module) -> nn.Module: ...

    @abstractmethod
    def transform(self, gm: fx.GraphModule, flat_state: list[torch.Tensor]) -> fx.GraphModule: ...


class OpaqueOverride(Override):
    """Run the submodules whose FQN matches a glob eagerly, as opaque host nodes of the compiled step.

    ``OpaqueOverride("model.layers.*.mlp.experts", "router")``: each matching
    submodule (the outermost, where matches nest) is not traced; its forward and
    backward run in PyTorch with its own autograd, inside the one compiled graph.
    Its parameters and buffers stay graph inputs, so data-parallel all-reduce,
    ZeRO-3 gathers and reduce-scatters, the optimizer and checkpoints cover them.
    Patterns use :func:`fnmatch.fnmatchcase` (``*`` also matches dots).  Untraceable
    submodules become opaque without it (``SPMD_ORT_AUTO_OPAQUE``); this makes it
    explicit (no failed trace first, no warning).
    """

    def __init__(self, *patterns: str):
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise TypeError("OpaqueOverride takes one or more FQN glob patterns, e.g. 'model.layers.*.mlp.experts'")
        self.patterns = tuple(patterns)

    def matches(self, fqn: str) -> bool:
        return any(fnmatch.fnmatchcase(fqn, p) for p in self.patterns)

    def replacement(self, fqn: str, orig_submodule: nn.Module) -> nn.Module:
        return orig_submodule  # kept as is: the trace captures it opaquely

    def transform(self, gm: fx.GraphModule, flat_state: list[torch.Tensor]) -> fx.GraphModule:
        return gm

    def __repr__(self) -> str:
        return f"OpaqueOverride({', '.join(map(repr, self.patterns))})"


def _find_state_owners(args: tuple, kwargs: dict) -> tuple[nn.Module, torch.optim.Optimizer | None,
                                                           amp.GradScaler | None]:
    """The module, the optimizer (if any) and the GradScaler (if any) among the step's arguments."""
    modules, optimizers, scalers = [], [], []
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, nn.Module) and not any(leaf is m for m in modules):
            modules.append(leaf)
        elif isinstance(leaf, torch.optim.Optimizer) and not any(leaf is o for o in optimizers):
            optimizers.append(leaf)
        elif amp.is_scaler(leaf) and not any(leaf is s for s in scalers):
            scalers.append(leaf)
    if len(modules) != 1:
        what = "no nn.Module" if not modules else f"{len(modules)} nn.Modules ({', '.join(type(m).__name__ for m in modules)})"
        raise TypeError(f"spmd_ort.compile: the train step must receive exactly one nn.Module among its "
                        f"arguments; got {what}")
    if len(optimizers) > 1:
        raise TypeError(f"spmd_ort.compile: the train step may receive at most one optimizer; got "
                        f"{len(optimizers)} ({', '.join(type(o).__name__ for o in optimizers)})")
    if len(scalers) > 1:
        raise TypeError(f"spmd_ort.compile: the train step may receive at most one GradScaler; got {len(scalers)}")
    return modules[0], optimizers[0] if optimizers else None, scalers[0] if scalers else None


def _prefill_optimizer_state(opt, rule, mode, scaler=None) -> list[nn.Parameter]:
    """Create a fresh optimizer's state as its first step would (where the rule says that is exact).

    The first call then traces the steady-state step at once: one variant, one
    export, instead of a throw-away variant for "before the state exists".
    Only for an optimizer with no state at all, not under fully_shard (its
    state is created on shards by the sharding passes), and not with an enabled
    GradScaler (a first step it skips creates no state in eager).  Returns the
    parameters given state, for :func:`_undo_prefill`.
    """
    if (opt is None or rule is None or rule.initial_state is None or opt.state or (mode is not None and mode.sharded)
            or amp.scaler_enabled(scaler)):
        return []
    filled = []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad and p not in opt.state:
                opt.state[p].update(rule.initial_state(group, p))
                filled.append(p)
    return filled


def _undo_prefill(opt, params: list[nn.Parameter]) -> None:
    for p in params:
        opt.state.pop(p, None)


def _updates_state_of(program: CompiledProgram, params: list[nn.Parameter]) -> bool:
    """Whether the compiled step writes new optimizer state for every one of ``params`` (each got a gradient)."""
    index = {id(p): i for i, p in enumerate(program.layout.params)}
    updated = {s.index for s in program.output_slots if s.kind == "opt_state"}
    return all(index.get(id(p)) in updated for p in params)


def _sizes_differ(gathered: list) -> dict[int, set[int]] | None:
    """Ranks' ``(key without sizes, leaf descriptions)``: the dims to make symbolic when only sizes differ."""
    if any(g is None for g in gathered) or len({g[0] for g in gathered}) != 1:
        return None
    return dims_differing_across([g[1] for g in gathered]) or None


def _batch_tensors(program: CompiledProgram, args: tuple, kwargs: dict) -> list:
    """The call's graph inputs among its leaves: tensors, and Python numbers lifted to inputs (dynamic shapes)."""
    leaves = pytree.tree_leaves((args, kwargs))
    return [leaves[i] for i in program.batch_positions]


def _snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph later passes cannot touch."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


class _Swaps:
    """Submodule replacements made for Overrides, undone if the compile fails."""

    def __init__(self):
        self.done: list[tuple[nn.Module, str, nn.Module]] = []

    def apply(self, root: nn.Module, overrides: list[Override]) -> None:
        def visit(prefix: str, module: nn.Module) -> None:
            for name, child in list(module.named_children()):
                fqn = f"{prefix}.{name}" if prefix else name
                new = child
                for override in overrides:
                    new = override.replacement(fqn, new)
                if new is child:
                    visit(fqn, child)
                else:
                    setattr(module, name, new)
                    self.done.append((module, name, child))

        visit("", root)

    def undo(self) -> None:
        for parent, name, orig in reversed(self.done):
            setattr(parent, name, orig)
        self.done.clear()


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
        self.parallel_mode = parallel_mode
        self.options = options
        self.runtime = StepRuntime(options)  # this step's communicator and options, active while it runs
        self.transitions: TransitionManager[CompiledProgram] = TransitionManager(getattr(fn, "__name__", "step"))
        self.compiled: CompiledProgram | None = None
        self.comm: StepComm | None = None  # collectives of the last step
        self._overridden: set[int] = set()
        self._synced: set[int] = set()
        self._started = False
        self._last: tuple | None = None  # (module, optimizer) of the last call
        # which parts run opaquely: grows as traces find untraceable ones, kept across variants
        self.opaque_plan = OpaquePlan(
            custom_autograd=options.custom_autograd, auto_opaque=options.auto_opaque,
            forced=options.opaque_functions,
            patterns=tuple(p for o in self.module_override if isinstance(o, OpaqueOverride) for p in o.patterns))
        self._profile: tuple[int, Path] | None = None  # armed by profile(): (steps, path)
        self.profile_paths: tuple[Path, Path] | None = None  # (trace, picture) written by the last profile
        self._signature = signature_of(fn)
        self.dynamic = DynamicDims()  # dims of tensor inputs traced as symbols; grows (spmd_ort.dynamic)
        self._widened_from: DynamicDims | None = None
        self._refused: dict[int, set[int]] = {}  # dims whose symbolic trace failed once: never widened again

    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def mixed_precision(self) -> amp.MixedPrecisionPolicy | None:
        """The parallel mode's MixedPrecisionPolicy (it applies on one process too)."""
        return getattr(self.parallel_mode, "mixed_precision", None)

    def memory(self) -> dict:
        """Per-rank memory of the last compiled step, in bytes.

        ``persistent``: parameters, gradients and optimizer state held between
        steps (``params``, ``grads``, ``opt_state``, ``total``; ``buffers``
        apart); ``peak``: persistent total + buffers + the planned peak of the
        values the step creates (:func:`spmd_ort.memory.planned_peak_bytes`);
        ``max_rss``: the process's peak resident set so far;
        ``host_memory_retained``: whether freed host memory stays in the process
        for reuse (:func:`spmd_ort.memory.retain_host_memory`).
        """
        if self.compiled is None or self._last is None:
            raise RuntimeError("memory(): the step has not run yet")
        module, opt = self._last
        persistent = persistent_bytes(module, opt)
        planned = self.compiled.results.memory.planned_peak_bytes
        return {"persistent": persistent, "planned_activation_peak": planned,
                "peak": persistent["total"] + persistent["buffers"] + planned, "max_rss": max_rss_bytes(),
                "host_memory_retained": host_memory_retained()}

    def explain(self) -> str:
        """The plan of the last compiled variant in words: variants and why each was traced, passes,
        collectives per step (planned vs measured), segments and host nodes, memory
        (:mod:`spmd_ort.explain`)."""
        return explain(self, self.memory() if self._last is not None and self.compiled is not None else None)

    def profile(self, steps: int = 1, path: str | Path = "spmd_ort_profile") -> None:
        """Record the timeline of the next ``steps`` calls, then write ``<path>.json`` and ``<path>.png``.

        Every rank must call it at the same point of its loop (the ranks' spans are merged on
        rank 0, which writes a Chrome/Perfetto trace with one process per rank and a picture of
        the last profiled step: compute, host and communication lanes, overlap shaded;
        :mod:`spmd_ort.timeline`).  Profiled steps run node by node, so they are a little slower
        than others.  ``profile_paths`` holds the two paths once written.
        """
        if steps < 1:
            raise ValueError(f"profile(steps={steps}): profile at least one step")
        self._profile = (steps, Path(path))
        self.profile_paths = None

    def _start_profile(self) -> None:
        steps, _ = self._profile
        if parallel.world()[1] > 1:
            dist.barrier()  # one origin for every rank's clock
        recorder = Recorder(steps)
        self.runtime.recorder = recorder
        self.runtime.comm.recorder = recorder

    def _finish_profile(self) -> None:
        recorder, (_, path) = self.runtime.recorder, self._profile
        self.runtime.recorder = self.runtime.comm.recorder = None
        self._profile = None
        rank, world = parallel.world()
        recorders = [recorder]
        if world > 1:
            recorders = [None] * world if rank == 0 else None
            dist.gather_object(recorder, recorders, dst=0)
        if rank == 0:
            self.profile_paths = timeline.write(recorders, path)
            logger.info("profile of %d step(s) written to %s and %s", recorder.steps, *self.profile_paths)

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
        mode = parallel.resolve(self.parallel_mode)
        rank, world_size = parallel.world()
        sharding = self._shard_if_needed(module, opt, mode, rank, world_size)
        try:
            yield
        except BaseException:
            if sharding is not None:
                sharding.undo()
            raise
        if sharding is not None:
            sharding.commit()

    @property
    def variants(self) -> list[CompiledProgram]:
        return list(self.transitions.variants.values())

    def __call__(self, *args: Any, last_train_step: bool = False, **kwargs: Any) -> Any:
        # a call that does not match the signature is not a trace failure
        bind_arguments(self.fn, args, kwargs, self._signature)
        module, opt, scaler = _find_state_owners(args, kwargs)
        if not self._started:
            self._started = True
            if self.options.retain_host_memory:
                retain_host_memory()  # steady-state steps reuse host memory instead of page-faulting
        mode = parallel.resolve(self.parallel_mode)
        rank, world_size = parallel.world()
        swaps = _Swaps()
        if self.module_override and id(module) not in self._overridden:
            swaps.apply(module, self.module_override)
        sharding = None
        prefilled: list[nn.Parameter] = []
        try:
            rule = rule_for(opt) if opt is not None else None
            if amp.scaler_enabled(scaler):
                amp.check_scaler(scaler)
            sharding = self._shard_if_needed(module, opt, mode, rank, world_size)
            prefilled = _prefill_optimizer_state(opt, rule, mode, scaler)
            key = self._agreed_key(module, opt, scaler, args, kwargs, rule, mode, world_size)
            program = self.transitions.lookup(key)
            if program is None:
                program, key = self._compile_or_narrow(key, module, opt, scaler, rule, mode, args, kwargs,
                                                       world_size)
                if prefilled and not _updates_state_of(program, prefilled):
                    # a parameter got no gradient, so eager would create no state for it: trace as eager steps
                    _undo_prefill(opt, prefilled)
                    prefilled = []
                    key = self._agreed_key(module, opt, scaler, args, kwargs, rule, mode, world_size)
                    program = self._compile_everywhere(key, module, opt, scaler, rule, mode, args, kwargs)
                if mode is not None and not mode.sharded and id(module) not in self._synced:
                    parallel.broadcast_state(module)  # rank 0's weights everywhere, as DDP does
                    self._synced.add(id(module))
                out = self._first_run(program, args, kwargs)
                self.transitions.insert(key, program)
            else:
                out = self._run(program, args, kwargs)
            self.compiled = program
        except BaseException:
            _undo_prefill(opt, prefilled)
            if sharding is not None:
                sharding.undo()
            swaps.undo()
            raise
        if sharding is not None:
            sharding.commit()
        self._last = (module, opt)
        if swaps.done:
            self._overridden.add(id(module))
        if last_train_step:
            # The reference API's drain of deferred work; every call already completes its collectives
            # (CompiledStep._run), so this finds nothing to wait for.
            self.runtime.comm.finish()
        return out

    def _agreed_key(self, module, opt, scaler, args, kwargs, rule, mode, world_size: int) -> StepKey:
        """The re-trace key of this call, with dynamic dims abstracted, agreed by every rank.

        Automatic dynamic shapes (:mod:`spmd_ort.dynamic`): when the key misses only because sizes of
        tensor inputs changed since the last call, those dims become symbolic before the key is taken
        again; under a parallel mode, ranks whose keys differ only in input sizes make the differing
        dims symbolic on every rank (the same decision everywhere: it is taken from the gathered keys).
        """
        leaves = pytree.tree_leaves((args, kwargs))
        self._widened_from = None  # the dims before this call widened them (a failed trace narrows back)
        if self.options.dynamic == "1" and not self.dynamic:
            self.dynamic = leading_dims(leaves)
        key = self._key(module, opt, scaler, args, kwargs, rule, mode, world_size)
        last = self.transitions.last_key
        if (self.options.dynamic == "auto" and key not in self.transitions.variants and last is not None
                and key.portable(sizes=False) == last.portable(sizes=False)):
            changed = changed_dims(last.leaf_descs(), key.leaf_descs())
            if changed:
                self._widen(changed, args, kwargs, "changed since the last call")
                key = self._key(module, opt, scaler, args, kwargs, rule, mode, world_size)
        if mode is not None:
            # every step: ranks that would run different graphs stop here, all of them
            sizes = (key.portable(sizes=False), key.leaf_descs()) if self.options.dynamic != "0" else None
            differing = parallel.check_agreement("this step's inputs, module and optimizer", key.portable(),
                                                 sizes=sizes, reconcile=_sizes_differ)
            if differing:
                self._widen(differing, args, kwargs, "differ between ranks")
                key = self._key(module, opt, scaler, args, kwargs, rule, mode, world_size)
                parallel.check_agreement("this step's inputs, module and optimizer", key.portable())
        return key

    def _compile_or_narrow(self, key, module, opt, scaler, rule, mode, args, kwargs, world_size: int):
        """Compile; when dims made symbolic by this very call make the trace fail, trace the sizes statically.

        (A wrong input size, e.g. a feature dim, then fails as it would without dynamic shapes, with its
        concrete sizes in the error, and the dims stay static.)
        """
        try:
            return self._compile_everywhere(key, module, opt, scaler, rule, mode, args, kwargs), key
        except Exception as exc:
            if self._widened_from is None:
                raise
            for pos, dims in self.dynamic.as_dict().items():
                self._refused.setdefault(pos, set()).update(dims - self._widened_from.as_dict().get(pos, set()))
            self.dynamic, self._widened_from = self._widened_from, None
            key = self._key(module, opt, scaler, args, kwargs, rule, mode, world_size)
            if mode is not None:
                parallel.check_agreement("this step's inputs, module and optimizer", key.portable())
            reason = " ".join(str(exc).split())
            logger.info("%s: the trace with the new symbolic dims failed (%s: %s); tracing these sizes statically "
                        "(and those dims stay static from now on)",
                        self.transitions.name, type(exc).__name__, reason[:300] + (" ..." if len(reason) > 300 else ""))
            return self._compile_everywhere(key, module, opt, scaler, rule, mode, args, kwargs), key

    def _key(self, module, opt, scaler, args, kwargs, rule, mode, world_size: int) -> StepKey:
        amp_key = (("autocast", amp.autocast_state()), ("scaler", amp.scaler_key(scaler, state_device(module))))
        key = StepKey.of(module, opt, args, kwargs, rule=rule, world=(world_size, repr(mode)), amp=amp_key,
                         dynamic=self.dynamic)
        program = self.transitions.variants.get(key)
        if program is None or program.symbolic is None:
            return key
        batch_shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else x
                        for x in _batch_tensors(program, args, kwargs)]
        if program.symbolic.accepts(batch_shapes):
            return key
        # the symbolic program's guards reject these sizes: a static program for exactly them
        logger.info("%s: sizes %s fail the guards of the symbolic program; tracing them statically",
                    self.transitions.name, batch_shapes)
        return StepKey.of(module, opt, args, kwargs, rule=rule, world=(world_size, repr(mode)), amp=amp_key,
                          shapes=(("static", tuple(batch_shapes)),))

    def _widen(self, dims: dict[int, set[int]], args: tuple, kwargs: dict, why: str) -> None:
        before = self.dynamic
        self.dynamic = self.dynamic.union({pos: set(d) - self._refused.get(pos, set()) for pos, d in dims.items()})
        if self.dynamic != before:
            if self._widened_from is None:
                self._widened_from = before
            names = dict(enumerate(StepInputs.of(self.fn, args, kwargs).names))
            logger.info("%s: %s %s: symbolic from now on, one program serves them all (dynamic shapes; "
                        "SPMD_ORT_DYNAMIC=0 traces every shape and value instead)", self.transitions.name,
                        self.dynamic.describe(names), why)

    def _shard_if_needed(self, module, opt, mode, rank: int, world_size: int) -> ShardedModule | None:
        """fully_shard: shard the module (once) before its key is taken; returns the undo handle."""
        sharded = is_sharded(module)
        if mode is None or not mode.sharded:
            if sharded:
                raise CompileError(
                    f"{type(module).__name__}'s parameters are sharded (fully_shard), but this step compiles "
                    f"for {'one process' if mode is None else mode.parallel_style!r}; keep "
                    "parallel_style='fully_shard' on every rank, or load a full state dict into a fresh model",
                    rank=rank)
            return None
        if sharded:
            spec = next(spec_of(p) for p in module.parameters() if spec_of(p) is not None)
            if spec.world != world_size:
                raise CompileError(f"the module was sharded over {spec.world} ranks but the world is now "
                                   f"{world_size}; save a checkpoint (spmd_ort.state_dict) and load it into a "
                                   "model built for the new world", rank=rank)
            return None
        sharding = ShardedModule(module, opt, rank, world_size, offload_param=mode.offload_param)
        sharding.shard()
        return sharding

    def _first_run(self, program: CompiledProgram, args: tuple, kwargs: dict) -> Any:
        """The first run of a new variant; it may still fail (ORT checks, values fake tensors cannot see).

        A failure after an input changed shape or dtype since the last call that compiled names that input.
        """
        try:
            return self._run(program, args, kwargs)
        except (CompileError, CollectiveTimeout):
            raise
        except Exception as exc:
            previous = self.compiled.key if self.compiled else None
            inputs = StepInputs.of(self.fn, args, kwargs, previous_key=previous)
            blamed = inputs.blame([], None, None, f"{type(exc).__name__}: {' '.join(str(exc).split()[:60])}",
                                  running=True)
            if blamed is None:
                raise
            raise blamed from exc

    def _run(self, program: CompiledProgram, args: tuple, kwargs: dict) -> Any:
        comm = self.runtime.comm
        if self._profile is not None and self.runtime.recorder is None and program.steps_run > 0:
            self._start_profile()  # (a variant's first run is a checked one: profiled from its second)
        recorder = self.runtime.recorder
        comm.start_step()
        t0 = time.perf_counter()
        try:
            with self.runtime.active(), amp.autocast_disabled():  # the graph holds autocast's casts already
                return program.run(args, kwargs)
        finally:
            self.comm = comm.end_step()
            if recorder is not None:
                recorder.step_done(t0, time.perf_counter())
                if recorder.done:
                    self._finish_profile()

    def _compile_everywhere(self, key, module, opt, scaler, rule, mode, args, kwargs) -> CompiledProgram:
        """Compile; on several ranks, also agree that every rank compiled the same graph.

        A rank whose compile failed still takes part in the agreement, so the
        others fail with it instead of waiting for it in a collective.
        """
        if mode is None:
            return self._compile(key, module, opt, scaler, rule, mode, args, kwargs)
        try:
            program, error = self._compile(key, module, opt, scaler, rule, mode, args, kwargs), None
            description = program.signature()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the agreement
            program, error = None, exc
            description = f"compile failed: {type(exc).__name__}: {getattr(exc, 'detail', exc)}"
        parallel.check_agreement("the compiled train step", description)
        if error is not None:
            raise error
        return program

    # ------------------------------------------------------------------ compile
    def _compile(self, key: StepKey, module: nn.Module, opt, scaler, rule, mode, args: tuple,
                 kwargs: dict) -> CompiledProgram:
        """trace -> passes (the one pipeline) -> executor."""
        t0 = time.perf_counter()
        layout = StateLayout.capture(module, opt, rule, scaler)
        # Errors rooted in an input name it, and how it differs from the last call that compiled.
        inputs = StepInputs.of(self.fn, args, kwargs, previous_key=self.compiled.key if self.compiled else None)
        # spmd_ort.translations translates the fused CPU attention kernel (forward and backward), not the
        # CUDA ones: on an accelerator, the ORT backend traces attention in its math form.
        on_accelerator = any(p.device.type != "cpu" for p in layout.params)
        traced = trace_step(self.fn, args, kwargs, layout, sdpa_math=self.backend == "ort" and on_accelerator,
                            tag_grads=mode is not None, plan=self.opaque_plan, inputs=inputs,
                            mixed_precision=self.mixed_precision,
                            dynamic=None if key.shapes else self.dynamic)  # key.shapes: guards rejected the sizes
        if traced.symbolic is not None and traced.symbolic.specialised:
            names = {k: inputs.names[pos] for k, pos in enumerate(traced.batch_positions)}
            logger.info("%s: the model fixes %s; those dims stay static", self.transitions.name,
                        ", ".join(f"the value of `{names[k]}` at {size}" if d is None else
                                  f"dim {d} of `{names[k]}` at {size}"
                                  for (k, d), size in sorted(traced.symbolic.specialised.items(), key=str)))
        traced_gm = _snapshot(traced.gm)
        rank, world_size = parallel.world()
        ctx = P.PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots),
                            mode=mode, world_size=world_size, rank=rank, shard_specs=layout.shard_specs,
                            layout=layout, disabled=self.options.disabled_passes,
                            check_contracts=self.options.check_passes)
        pipeline = P.build_pipeline(mode, self.backend, overrides=self.module_override,
                                    gm_transformation=self.gm_transformation)
        gm = P.run_passes(traced.gm, ctx, pipeline)
        executor = build_executor(gm, self.options)
        program = CompiledProgram(
            key=key, gm=executor.gm, traced_gm=traced_gm, layout=layout, input_slots=ctx.input_slots,
            output_slots=ctx.output_slots, batch_positions=traced.batch_positions, grad_inputs=traced.grad_inputs,
            user_spec=traced.user_spec,
            user_leaves=traced.user_leaves, passes_applied=ctx.applied, results=ctx.results, executor=executor,
            opaque=traced.opaque, trace_attempts=traced.attempts, symbolic=traced.symbolic,
            options=self.options, trace_seconds=traced.seconds, compile_seconds=time.perf_counter() - t0,
            traced_because=self.transitions.reason)
        logger.info("compiled %s: %d graph nodes, trace %.2fs, total %.2fs", self.transitions.name,
                    len(gm.graph.nodes), traced.seconds, program.compile_seconds)
        return program


def compile(  # noqa: A001 - the reference API's name
    module_override: list[Override] | None = None,
    gm_transformation: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
    parallel_mode: Any = None,
    backend: str | None = None,
    debug: DebugOptions | None = None,
    dynamic: bool | None = None,
) -> Callable[[Callable], CompiledStep]:
    """Compile a whole train step (forward, backward, optimizer step) into one graph.

    The decorated function receives one ``nn.Module``, at most one optimizer and
    the batch.  Parameters, buffers, gradients, optimizer state and each param
    group's ``lr`` become graph inputs; after each call the module and optimizer
    hold what an eager step would have produced.  The wrapper accepts
    ``last_train_step=True`` (the reference API's flag; every call already completes its work).

    Args:
        module_override: :class:`Override` objects for submodules that cannot be traced.
        gm_transformation: ``GraphModule -> GraphModule`` applied once per compiled variant.
        parallel_mode: a :class:`spmd_ort.DataParallel`; ``None`` means DataParallel() when
            torch.distributed is initialized with more than one rank, else a single process.
        backend: ``"ort"`` (ONNX Runtime segments + torch host nodes, the default) or ``"fx"``
            (PyTorch op by op); default from ``SPMD_ORT_BACKEND``.
        debug: :class:`DebugOptions`.
        dynamic: ``None`` (automatic, the default): the first trace is static and sizes of tensor
            inputs (and int/float arguments) that change later become symbolic, so one program serves
            them all; ``True``: the
            batch and sequence dims (the first two) of every tensor input are symbolic from the start;
            ``False``: one program per shape.  Default from ``SPMD_ORT_DYNAMIC`` (``auto``/``1``/``0``).

    The configuration (these arguments and every ``SPMD_ORT_*`` environment variable,
    :data:`spmd_ort.options.ENV_VARS`) is read here, once; a bad value is a
    :class:`~spmd_ort.errors.ConfigError` naming it.
    """
    options = Options.resolve(debug=debug, backend=backend, dynamic=dynamic)
    configure_logging(options.log_level)
    P.check_disabled(options.disabled_passes)

    def decorate(fn: Callable) -> CompiledStep:
        return CompiledStep(fn, module_override=module_override, gm_transformation=gm_transformation,
                            parallel_mode=parallel_mode, options=options)

    return decorate
