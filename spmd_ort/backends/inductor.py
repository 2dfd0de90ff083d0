"""The "inductor" executor: graph segments compiled by torch's inductor, host nodes in torch.

The finished graph is split like the ORT backend's (:func:`spmd_ort.graph.segments.partition_with`) with
its own predicate (:func:`why_host`): every aten op of static shapes is compiled, and what keeps the
step's semantics stays on the host (collectives, the optimizer update, opaque parts, random ops with
torch's RNG, allocations a host op fills).  A segment already is a functional aten graph of the whole
step's forward, backward and clipping, so inductor fuses across those boundaries, which
``torch.compile(model)`` cannot; each is compiled with ``compile_fx`` on examples of its traced shapes,
through inductor's own caches.  The first run of each program runs every compiled segment next to its
fx graph and compares them as the ORT backend does (:mod:`spmd_ort.graph.checking`); a segment that fails
to compile, to run or to verify runs on fx (one WARNING, ``FALLBACK_TO_FX``) or raises
(``FALLBACK_DISABLE``).  Numbers: inductor's fused loops round differently from torch's kernels, so
parity with eager is to fp32 rounding, as on ORT.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import os
import signal
import shutil
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx, nn
from torch.fx.passes.operator_support import OperatorSupport

from spmd_ort.backends.files import exclusive, graph_digest
from spmd_ort.backends.checked import CheckStats, agree_segment, checked_run, segment_failure
from spmd_ort.backends.interface import ExecutorBase
from spmd_ort.backends.timed import TimedInterpreter
from spmd_ort.errors import CompileError, ConfigError
from spmd_ort.options import Options, get_logger
from spmd_ort.graph.segments import HOST_NAMESPACES, RANDOM_OPS, UNINITIALIZED_OPS, partition_with
from spmd_ort.graph.checking import op_summary, short_error, unordered_topks, verify_tolerances
from spmd_ort.runtime.interpreter import RunInterpreter
from spmd_ort.runtime.step_runtime import active
from spmd_ort.runtime.devices import rng_kept
from spmd_ort.graph.ops import OPAQUE_OPS, draws_random, grouped_mm

logger = get_logger(__name__)


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU code needs (its own choice, ``torch._inductor.config.cpp.cxx``), or None."""
    from torch._inductor import cpp_builder

    try:
        return shutil.which(cpp_builder.get_cpp_compiler())
    except Exception:  # noqa: BLE001 - inductor raises when it finds none
        return None


# our ops inductor compiles into its code as extern kernels (pure: their outputs from their arguments alone)
INDUCTOR_EXTERN_OPS = (grouped_mm,)


def why_host(node: fx.Node) -> str | None:
    """None if inductor compiles ``node``; otherwise why it stays on the host."""
    if node.op != "call_function":
        return "not an op"
    target = node.target
    if target is operator.getitem:
        return why_host(node.args[0]) if isinstance(node.args[0], fx.Node) else "getitem of a Python value"
    if not isinstance(target, torch._ops.OpOverload):
        return f"Python callable {getattr(target, '__name__', target)}"
    if target in OPAQUE_OPS:
        return "opaque part: the user's code, run eagerly"
    if target.namespace in HOST_NAMESPACES and target not in INDUCTOR_EXTERN_OPS:
        return f"{target.namespace} op (runs in torch)"
    if target in RANDOM_OPS or draws_random(node):  # (an attention kernel's dropout too)
        return "random op (keeps torch's RNG: the masks eager draws)"
    if target in UNINITIALIZED_OPS:
        return "allocation with an undefined value (the host op that fills it runs in torch)"
    for v in _values(node):
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
                isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape)):
            return "symbolic sizes (the inductor executor compiles segments of static shapes)"
    return None


def _values(node: fx.Node) -> list:
    vals = []
    for n in (node, *node.all_input_nodes):
        v = n.meta.get("val")
        vals += list(v) if isinstance(v, (list, tuple)) else [v]
    return vals


class InductorSupport(OperatorSupport):
    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return why_host(node) is None


class InductorSegment(nn.Module):
    """One segment compiled by inductor, standing in for its fx graph ``fallback`` (same inputs and outputs)."""

    def __init__(self, name: str, fallback: fx.GraphModule, threads: int | None = None):
        super().__init__()
        self.name = name
        self.fallback = fallback
        self.use_fallback = False
        self.runs = 0  # steps whose outputs came from the compiled code
        self.tolerance = verify_tolerances(fallback)  # per output
        self.unordered = unordered_topks(fallback)  # outputs in an unsorted topk's order: verified as sets
        out = fallback.graph.output_node().args[0]
        self.returns_tuple = isinstance(out, (tuple, list))
        examples = [_example(n.meta["val"]) for n in fallback.graph.nodes if n.op == "placeholder"]
        # the code inductor generates asserts its inputs' strides: an input that arrives in another layout (an
        # opaque part's output, whose layout the trace could not see) is copied into the traced one
        self.strides = [e.stride() if isinstance(e, torch.Tensor) else None for e in examples]
        from torch._guards import TracingContext, tracing
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        copy_of = fx.GraphModule(fallback, copy.deepcopy(fallback.graph))  # compile_fx edits the graph it gets
        # inductor draws random inputs while it compiles (benchmarking choices): torch's RNG must stay where the
        # step's random ops (dropout) will find it, as in eager.  A tracing context with a shape environment (static
        # shapes) is what inductor's FX graph cache asks of a graph before it caches it ("No shape env": bypassed):
        # with it, a process that compiles a segment compiled before (another rank, a later run) loads its code
        fake = FakeTensorMode(static_shapes=True, shape_env=ShapeEnv())
        fakes = [fake.from_tensor(e, static_shapes=True) if isinstance(e, torch.Tensor) else e for e in examples]
        # the CPU code's thread count (inductor's own default: torch's threads, here and now) named in its config,
        # so that a compile on another thread count (BackgroundCompile's single-threaded child) writes the same
        # cache entry as this process's would
        from torch._inductor import config

        threads = config.cpp.threads if config.cpp.threads >= 1 else threads or torch.get_num_threads()
        with torch.no_grad(), rng_kept(), tracing(TracingContext(fake)), config.patch({"cpp.threads": threads}):
            self.compiled = compile_fx(copy_of, fakes)

    def run_compiled(self, *args):
        out = self.compiled(*[_in_layout(a, s) for a, s in zip(args, self.strides)])
        out = tuple(out) if isinstance(out, (list, tuple)) else (out,)
        return out if self.returns_tuple else out[0]

    def forward(self, *args):
        if self.use_fallback:
            return self.fallback(*args)
        self.runs += 1
        return self.run_compiled(*args)


def _in_layout(t, stride):
    """``t`` with ``stride`` (a copy when its own differs in a dim longer than 1)."""
    if stride is None or not isinstance(t, torch.Tensor) or all(
            a == b or n <= 1 for a, b, n in zip(t.stride(), stride, t.shape)):
        return t
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _example(v) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).zero_()
    return v


@dataclass
class InductorStats(CheckStats):
    segments: int = 0
    host_ops: dict = field(default_factory=dict)  # op -> why it stays on the host
    compile_seconds: float = 0.0
    first_run_seconds: float = 0.0


class InductorExecutor(ExecutorBase):
    name = "inductor"
    reuses_buffers = False  # every run allocates its outputs

    def __init__(self, gm: fx.GraphModule, *, verify: bool, policy: str, stats: InductorStats):
        self.gm = gm
        self.verify = verify
        self.policy = policy
        self.stats = stats
        self.first_run_done = False

    @property
    def segments(self) -> list[InductorSegment]:
        return [m for m in self.gm.modules() if isinstance(m, InductorSegment)]

    def run(self, inputs: list[torch.Tensor], *, copies: bool = False) -> list[torch.Tensor]:
        """One step on ``inputs``; ``copies``: they are the caller's copies of the step's values, which the first
        run may update in place (the automatic choice's candidate: no second copy of the state)."""
        with torch.no_grad():
            if not self.first_run_done:
                # on copies: host nodes update state in place, and a failure after them must change nothing
                t0 = time.perf_counter()
                if not copies:
                    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
                out = _CheckedRun(self).run(*inputs)
                self.first_run_done = True
                self.stats.first_run_seconds = time.perf_counter() - t0
                return list(out)
            recorder = active().recorder
            if recorder is not None:  # a profiled step: segment by segment, timed
                return list(TimedInterpreter(self.gm, recorder).run(*inputs))
            return list(self.gm(*inputs))

    def describe(self) -> list[str]:
        s = self.stats
        lines = [f"inductor segments: {s.segments} (fell back to fx: {', '.join(s.fallbacks) or 'none'}; compiled "
                 f"in {s.compile_seconds:.2f}s; first run {s.first_run_seconds:.2f}s, {s.verified} verified)"]
        lines += [f"  {name}: differs from fx no more than fx from float64 (ill-conditioned; accepted)"
                  for name in s.ill_conditioned]
        lines += [f"  host: {op} ({why})" for op, why in s.host_ops.items()]
        return lines


class _CheckedRun(RunInterpreter):
    """The first run: each compiled segment next to its fx graph, compared (:func:`spmd_ort.backends.checked.
    checked_run`), every rank agreeing on the outcome (a segment that failed anywhere runs on fx everywhere);
    downstream reads the fx result."""

    def __init__(self, executor: InductorExecutor):
        super().__init__(executor.gm)
        self.executor = executor

    def call_module(self, target, args, kwargs):
        seg = self.module.get_submodule(target)
        if not isinstance(seg, InductorSegment) or seg.use_fallback:
            return super().call_module(target, args, kwargs)
        ex = self.executor
        reference = seg.fallback(*args)

        def compiled(*a):
            with rng_kept():  # (its first call may still draw: see InductorSegment)
                return seg.run_compiled(*a)

        try:
            seconds, error = checked_run("inductor", seg.name, compiled, seg.fallback, args, reference,
                                         tolerance=seg.tolerance, unordered=seg.unordered, stats=ex.stats,
                                         policy=ex.policy, verify=ex.verify), None
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks' agreement (no rank left waiting)
            seconds, error = None, exc
        _, failed_elsewhere = agree_segment("inductor", seg.name, {"compiled": seconds}, error)
        if seconds is None or failed_elsewhere:
            if seconds is not None:
                ex.stats.fell_back(seg.name, "it failed on another rank: every rank runs it on fx, so all compute "
                                             "alike")
            seg.use_fallback = True
        return reference


def _fall_back(seg: InductorSegment, what: str, ex: InductorExecutor) -> None:
    """A segment inductor could not compile: fx runs it, or (FALLBACK_DISABLE) an error."""
    segment_failure("inductor", seg.name, what, ex.policy, op_summary(seg.fallback))
    ex.stats.fell_back(seg.name, what)
    seg.use_fallback = True


def build_inductor_executor(gm: fx.GraphModule, options: Options, threads: int | None = None) -> InductorExecutor:
    """Partition the finished graph ``gm`` and compile each segment with inductor, for ``threads`` of torch's
    (default: this process's)."""
    if cxx_compiler() is None:
        raise ConfigError("backend='inductor' compiles C++ on the CPU and no C++ compiler was found (g++); install "
                          "one or compile with backend='fx' or 'ort'")
    stats = InductorStats()
    for node in gm.graph.nodes:
        reason = why_host(node) if node.op == "call_function" else None
        if reason is not None:
            stats.host_ops[str(node.target)] = reason
    fused, names = partition_with(gm, InductorSupport())
    stats.segments = len(names)
    executor = InductorExecutor(fused, verify=options.verify, policy=options.fallback_policy, stats=stats)
    # one process at a time per graph: the ranks of a machine (and runs sharing a cache directory) compile each
    # distinct graph once; the others wait, then find every segment in inductor's FX graph cache
    with exclusive(Path(options.cache_dir) / "inductor" / f"{graph_digest(gm, torch.__version__)}.lock"):
        for name in names:
            sub = fused.get_submodule(name)
            t0 = time.perf_counter()
            try:
                segment = InductorSegment(name, sub, threads)
            except CompileError:
                raise
            except Exception as exc:  # noqa: BLE001 - per policy: the segment runs on fx, or the compile fails
                stub = _Uncompiled(name, sub)
                _fall_back(stub, f"inductor could not compile it: {short_error(exc)}", executor)
                continue
            finally:
                stats.compile_seconds += time.perf_counter() - t0
            setattr(fused, name, segment)
    return executor


@dataclass
class _Uncompiled:
    """A segment inductor could not compile (named in the fallback message; its fx graph stays in place)."""

    name: str
    fallback: fx.GraphModule
    use_fallback: bool = True


class BackgroundCompile:
    """:func:`build_inductor_executor` of ``whole`` in a forked child process while this one trains.

    The child runs at the lowest priority (``nice`` 19) on one thread and compiles in-process (no worker pool),
    so it takes the CPU time the steps leave and the running steps barely feel it.  What it leaves behind is
    inductor's FX graph cache filled with every segment (each distinct graph once per machine, under the
    lock); the step then builds the same executor from that cache in a fraction of the compile.  Nothing
    crosses back but the exit code.  A child whose compile is no longer wanted (its program dropped, the
    process exiting) is killed."""

    def __init__(self, whole: fx.GraphModule, options: Options):
        self.t0 = time.perf_counter()
        self.seconds: float | None = None  # until the child exited
        self.ok: bool | None = None
        threads = torch.get_num_threads()
        pid = os.fork()
        if pid == 0:  # the child: compile, then leave without running this process's exit handlers
            code = 1
            try:
                os.nice(19)
                # one thread: OpenMP's pool does not survive a fork (a parallel op would hang), and the steps
                # keep the cores; the code is still generated for this process's threads
                torch.set_num_threads(1)
                from torch._inductor import config

                config.compile_threads = 1  # in-process: this process's worker pool is not the child's to use
                build_inductor_executor(whole, dataclasses.replace(options, fallback_policy="FALLBACK_TO_FX"),
                                        threads)
                code = 0
            except BaseException:  # noqa: BLE001 - the exit code says it; this process's parent compiles again
                pass
            finally:
                os._exit(code)
        self.pid = pid
        self._finalizer = weakref.finalize(self, _kill, pid)  # dropped or at exit: no orphan compiling on

    @staticmethod
    def available(whole: fx.GraphModule, mode: str) -> bool:
        """Whether ``whole`` is compiled in a forked child (``mode``: ``Options.background_compile``): a POSIX
        fork, no CUDA in this process (a forked CUDA context is unusable) and, with ``auto``, a core that the
        steps leave idle (:func:`idle_cores`).  On a machine whose cores the steps' threads all use, a child
        even at the lowest priority slows them: a CNN's 20 ms steps on a 2-core host ran at 1.65x eager's
        while one compiled, 0.98x without (OpenMP's threads wait at each op's end for the one it preempted)."""
        if mode == "0" or not hasattr(os, "fork") or torch.cuda.is_initialized():
            return False
        if mode == "auto" and idle_cores() < 1:
            return False
        return not any(isinstance(v, torch.Tensor) and v.device.type != "cpu"
                       for n in whole.graph.nodes for v in _values(n))

    def poll(self) -> bool | None:
        """None while the child compiles; then whether it compiled."""
        if self.ok is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                ok = os.waitstatus_to_exitcode(status) == 0
            except ChildProcessError:  # reaped by someone else (a SIGCHLD handler): its outcome is unknown
                pid, ok = self.pid, False
            if pid:
                self.ok, self.seconds = ok, time.perf_counter() - self.t0
                self._finalizer.detach()
        return self.ok


def idle_cores() -> int:
    """The cores this process may run on that no rank of this machine's torch threads use (each rank as many
    threads as this one; ``LOCAL_WORLD_SIZE`` ranks, torchrun's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores - torch.get_num_threads() * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
