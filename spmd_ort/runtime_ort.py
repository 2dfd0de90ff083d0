"""The "ort" executor: graph segments run in ONNX Runtime, host nodes in torch.

The compiled graph is partitioned (:mod:`.partition`); each segment becomes an
:class:`OrtSegment`, a module that runs an ``InferenceSession`` through IO
binding: inputs are bound to the torch tensors' own memory and outputs are
written into tensors allocated once, so a step copies and allocates nothing
for them.  The top-level graph, with host nodes (the fused optimizer update,
collectives, random ops) between segments, runs as an fx GraphModule.

The first run of each compiled variant goes through :class:`_FirstRun`: every
segment also runs its fx graph; with verification on (``Options.verify``, the
default) the outputs are compared and a mismatch names the segment and the
first differing output.  Both are then timed (:data:`TIMED_RUNS` warm runs
each, interleaved), and with ``Options.segment_executor`` = ``auto`` (the
default) the faster one runs the segment from then on, so no segment is slower
than it would be on the fx executor.  A segment that fails to export, to load,
to run or to verify falls back to its fx graph (``Options.fallback_policy`` =
``FALLBACK_TO_FX``, the default, with one WARNING) or raises
(``FALLBACK_DISABLE``); a configuration ORT cannot honour (a missing execution
provider) is a :class:`~spmd_ort.errors.ConfigError`, never a fallback.  The
graph it gets is finished: this module partitions, exports and runs, and runs no pass.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from .errors import CompileError, ConfigError
from .dynamic import input_symbols
from .export import export_segment, input_position, save_model
from .options import Options
from .partition import partition_for_ort, why_host
from .runtime import active
from .runtime_fx import views_as_reshapes
from .timeline import TimedInterpreter

logger = logging.getLogger("spmd_ort")
progress = logging.getLogger("spmd_ort.progress")  # shown at the default level (options.configure_logging)

NUMPY_DTYPES = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int64: np.int64,
    torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}
SCALAR_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                "tensor(double)": np.float64, "tensor(bool)": np.bool_}
VERIFY_TOLERANCE = 1e-4  # max |ort - fx| relative to max |fx|, per output (fp32 segments)
# A segment that computes in a lower precision (autocast, MixedPrecisionPolicy) is verified to that
# precision: ORT's float16 kernels accumulate and round differently from torch's, one unit in the last
# place (2^-10 relative) apart, and outputs cast back to float32 carry that difference.
VERIFY_ULPS = 4
# Below this, differences are rounding noise of sums that cancel (e.g. the
# analytically zero gradient of an attention key bias, ~1e-13): not a fault.
VERIFY_ABS_FLOOR = {torch.float32: 1e-9, torch.float64: 1e-12, torch.float16: 1e-4, torch.bfloat16: 1e-3}
# An output that is analytically zero (a bias before a batch norm: the norm removes it) is rounding noise of
# sums of terms as large as the segment's other values, and its own max is no scale for that noise.  So a
# difference below NOISE_ULPS units in the last place of the segment's largest output (same dtype) is noise too.
NOISE_ULPS = 8
# Timing on the first run: each executor's checked run is its first sample; then it runs the segment back to
# back (switching between ORT's and torch's thread pools costs more than a small segment: measured up to
# 0.3 s on a loaded 2-core machine) until it has TIMED_RUNS[0] samples, and up to TIMED_RUNS[1] while they
# take less than TIMING_BUDGET_S; the fastest counts.
TIMED_RUNS, TIMING_BUDGET_S = (2, 5), 0.25
# A verification mismatch is no fault when ORT is no further than this many times fx's own distance from the
# segment computed in float64 (_within_rounding_of_float64).
FLOAT64_FACTOR = 10
# A dynamic-shape segment (one ONNX model for every size) is checked at its first CHECKED_SIZES sets of sizes.
CHECKED_SIZES = 3
PROGRESS_AFTER_S = 2.0  # an export still running after this long gets a progress line


def providers_for(device: torch.device) -> list:
    """ONNX Runtime execution providers for tensors on ``device``; one that is not installed is a ConfigError."""
    available = ort.get_available_providers()
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise ConfigError(f"the step's tensors are on {device}, but this onnxruntime has no CUDAExecutionProvider "
                              f"(it has {', '.join(available) or 'none'}); install onnxruntime-gpu (extra "
                              "spmd-ort[gpu]) or compile with backend='fx'")
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    if device.type != "cpu" or "CPUExecutionProvider" not in available:
        raise ConfigError(f"the step's tensors are on {device}, which no installed ONNX Runtime execution provider "
                          f"runs (installed: {', '.join(available) or 'none'}); compile with backend='fx'")
    return ["CPUExecutionProvider"]


def _outputs_meta(gm: fx.GraphModule) -> tuple[list[torch.Tensor], bool]:
    out = gm.graph.output_node().args[0]
    is_tuple = isinstance(out, (tuple, list))
    nodes = list(out) if is_tuple else [out]
    return [n.meta["val"] for n in nodes], is_tuple


class OrtSegment(nn.Module):
    """One ORT session standing in for the fx segment ``fallback`` (same inputs, same outputs)."""

    def __init__(self, name: str, fallback: fx.GraphModule, model: bytes, *, threads: int, allow_spinning: bool,
                 providers: list | None = None):
        super().__init__()
        self.name = name
        self.fallback = fallback
        self.use_fallback = False
        self.runs = 0  # how often ONNX Runtime ran this segment
        self.new_sizes: NewSizes | None = None  # dynamic shapes: checks the first runs at new sizes
        self.tolerance = verify_tolerance(fallback)
        metas, self.returns_tuple = _outputs_meta(fallback)
        device = segment_device(fallback)
        self.device_type = "cuda" if device.type == "cuda" else "cpu"
        self.device_id = device.index or 0
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        # Spinning workers cut ORT's per-op latency (GEMMs up to 1.7x here) but keep
        # the cores busy after a run, while torch runs host nodes; measured, not assumed.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        options.add_session_config_entry("session.force_spinning_stop", "1")  # ...and stop when Run returns
        self.session = ort.InferenceSession(model, options, providers=providers or providers_for(device))
        n_inputs = sum(1 for n in fallback.graph.nodes if n.op == "placeholder")
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.input_index = [input_position(n) for n in self.input_names]
        # a size, or a number computed from sizes (dynamic shapes), is a 0-d input of the model's type
        self.scalar_dtypes = {i.name: SCALAR_TYPES.get(i.type, np.int64) for i in self.session.get_inputs()}
        if any(i >= n_inputs for i in self.input_index):
            raise RuntimeError(f"ONNX inputs {self.input_names} are not inputs of the segment")
        self.output_names = [o.name for o in self.session.get_outputs()]
        if len(self.output_names) != len(metas):
            raise RuntimeError(f"ONNX model has {len(self.output_names)} outputs, the segment {len(metas)}")
        self.metas = metas
        self.sizes = DynamicSizes(fallback, metas) if is_symbolic(fallback) else None
        self.sizes_key: tuple | None = None
        self.binding = self.session.io_binding()
        if self.sizes is None:
            self._bind_outputs([tuple(m.shape) for m in metas])

    def _bind_outputs(self, shapes: list[tuple[int, ...]]) -> None:
        """Allocate the output tensors ORT writes into (once, or per set of sizes in a dynamic segment)."""
        self.outputs = [torch.empty(shape, dtype=m.dtype, device=m.device) for shape, m in zip(shapes, self.metas)]
        for name, t in zip(self.output_names, self.outputs):
            if t.numel() == 0:  # no memory to bind: ORT allocates its (empty) output, ours stands for it
                self.binding.bind_output(name, self.device_type, self.device_id)
                continue
            self.binding.bind_output(name, self.device_type, self.device_id, NUMPY_DTYPES[t.dtype],
                                     tuple(t.shape), t.data_ptr())

    def run_ort(self, *args: torch.Tensor | int):
        if self.sizes is not None:  # dynamic shapes: outputs sized for this call's sizes
            key = self.sizes.key(args)
            if key != self.sizes_key:
                self._bind_outputs(self.sizes.output_shapes(key))
                self.sizes_key = key
        keep = []  # contiguous copies must outlive the run
        for name, idx in zip(self.input_names, self.input_index):
            t = args[idx]
            if not isinstance(t, torch.Tensor):  # a size (dynamic shapes): a 0-d input
                self.binding.bind_cpu_input(name, np.array(t, dtype=self.scalar_dtypes[name]))
                continue
            if t.numel() == 0:  # an empty tensor has no memory to bind
                self.binding.bind_cpu_input(name, np.empty(tuple(t.shape), dtype=NUMPY_DTYPES[t.dtype]))
                continue
            if not t.is_contiguous():
                t = t.contiguous()
                keep.append(t)
            self.binding.bind_input(name, self.device_type, self.device_id, NUMPY_DTYPES[t.dtype],
                                    tuple(t.shape), t.data_ptr())
        if self.device_type == "cuda":
            torch.cuda.current_stream().synchronize()  # inputs written by torch kernels
        self.session.run_with_iobinding(self.binding)
        self.runs += 1
        out = tuple(self.outputs)
        return out if self.returns_tuple else out[0]

    def forward(self, *args: torch.Tensor | int):
        if self.use_fallback:
            return self.fallback(*args)
        if self.new_sizes is not None:
            return self.new_sizes.forward(self, args)
        return self.run_ort(*args)


class DynamicSizes:
    """A dynamic-shape segment's sizes: the symbols its inputs carry, and its output shapes in them.

    Each symbol is read from the first input that has it as a dim (or is it: a size
    the host computed); :meth:`key` is their values for a call and
    :meth:`output_shapes` evaluates each output dim's expression (``s0*s1``) there.
    A symbol an output needs and no input carries is a ValueError (the segment is
    then exported per set of sizes, :class:`SizedSegments`).
    """

    def __init__(self, gm: fx.GraphModule, metas: list[torch.Tensor] | None = None):
        position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        symbols = input_symbols(gm)
        self.symbols: list = list(symbols)
        # (input position, dim; None: the input is the size)
        self.sources: list[tuple[int, int | None]] = [(position[node], dim) for node, dim, _ in symbols.values()]
        self.shapes = [tuple(int(d) if not isinstance(d, torch.SymInt) else d.node.expr for d in m.shape)
                       for m in metas or []]
        needed = set().union(*[d.free_symbols for shape in self.shapes for d in shape if not isinstance(d, int)])
        if missing := needed - set(self.symbols):
            raise ValueError(f"output sizes in {sorted(map(str, missing))} follow from no input's size")

    def key(self, args) -> tuple[int, ...]:
        return tuple(int(args[pos]) if dim is None else args[pos].shape[dim] for pos, dim in self.sources)

    def describe(self, key: tuple[int, ...]) -> str:
        return ", ".join(f"{sym}={v}" for sym, v in zip(self.symbols, key))

    def output_shapes(self, key: tuple[int, ...]) -> list[tuple[int, ...]]:
        env = dict(zip(self.symbols, key))
        return [tuple(d if isinstance(d, int) else int(d.xreplace(env)) for d in shape) for shape in self.shapes]


class NewSizes:
    """A dynamic-shape segment's first runs at new sizes: checked against its fx graph like its first run.

    One ONNX model serves every size; its first :data:`CHECKED_SIZES` distinct sets of
    sizes (the first run's included) each run next to the fx graph and are compared (a
    size the translation baked in shows there), and an ORT failure at any size falls
    back to fx per ``Options.fallback_policy``.
    """

    def __init__(self, stats: OrtStats, policy: str, verify: bool):
        self.stats, self.policy, self.verify = stats, policy, verify
        self.checked: set[tuple] = set()

    def forward(self, seg: OrtSegment, args):
        key = seg.sizes.key(args)
        if len(self.checked) < CHECKED_SIZES and key not in self.checked:
            return self._checked(seg, key, args)
        try:
            return seg.run_ort(*args)
        except Exception as exc:  # noqa: BLE001 - ORT wrote no state: the fx graph runs the step instead
            _failure(seg.name, f"ONNX Runtime failed to run it at new sizes: {_short(exc)}", self.policy,
                     _op_summary(seg.fallback))
            self.stats.fallbacks.append(seg.name)
            seg.use_fallback = True
            return seg.fallback(*args)

    def _checked(self, seg: OrtSegment, key: tuple, args):
        self.checked.add(key)
        reference = seg.fallback(*args)
        where = f"{seg.name} at sizes {seg.sizes.describe(key)}"
        if _checked_first_run(where, seg, args, reference, self.stats, self.policy, self.verify) is None:
            seg.use_fallback = True
        return reference


def verify_tolerance(gm: fx.GraphModule) -> float:
    """The relative tolerance for a segment: 1e-4, or 4 ulps of the lowest float precision it computes in."""
    eps = [torch.finfo(v.dtype).eps for n in gm.graph.nodes
           for v in (n.meta.get("val") if isinstance(n.meta.get("val"), (list, tuple)) else [n.meta.get("val")])
           if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    return max([VERIFY_TOLERANCE] + [VERIFY_ULPS * e for e in eps])


def segment_device(gm: fx.GraphModule) -> torch.device:
    """Where a segment's tensors live (its first output's device)."""
    metas, _ = _outputs_meta(gm)
    tensors = [m for m in metas if isinstance(m, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _first_difference(ort_out, fx_out, tolerance: float = VERIFY_TOLERANCE) -> str | None:
    """Describe the first output that differs beyond ``tolerance`` (relative to the output's max) and beyond
    rounding noise (:data:`VERIFY_ABS_FLOOR`, :data:`NOISE_ULPS` of the segment's largest output), or None."""
    ort_vals = ort_out if isinstance(ort_out, tuple) else (ort_out,)
    fx_vals = fx_out if isinstance(fx_out, (tuple, list)) else (fx_out,)
    largest: dict[torch.dtype, float] = {}  # per dtype: the largest |value| among the segment's outputs
    for b in fx_vals:
        if isinstance(b, torch.Tensor) and b.dtype.is_floating_point and b.numel():
            top = torch.nan_to_num(b.abs(), nan=0.0, posinf=0.0).max().item()
            largest[b.dtype] = max(largest.get(b.dtype, 0.0), top)
    for i, (a, b) in enumerate(zip(ort_vals, fx_vals)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
        if not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                return f"output {i}: integer values differ"
            continue
        if b.numel() == 0:
            continue
        diff = (a - b).abs()  # NaN where either is NaN (or both are the same infinity)
        if torch.isnan(diff).any():
            same = (torch.isnan(a) & torch.isnan(b)) | (a == b)
            if not torch.equal(torch.isnan(diff), torch.isnan(diff) & same):
                return f"output {i}: NaN in one and not the other"
            diff = torch.nan_to_num(diff, nan=0.0)
        err = diff.max().item()
        scale = torch.nan_to_num(b.abs(), nan=0.0, posinf=0.0).max().item()
        floor = max(VERIFY_ABS_FLOOR.get(a.dtype, 1e-9), NOISE_ULPS * torch.finfo(a.dtype).eps * largest[a.dtype])
        if err > tolerance * scale and err > floor:
            return (f"output {i} (shape {tuple(b.shape)}): max |ort - fx| = {err:.3g}, "
                    f"{err / max(scale, 1e-30):.3g} of max |fx| = {scale:.3g}")
    return None


def _failure(segment: str, what: str, policy: str, ops: str = "") -> None:
    where = f"ORT segment `{segment}`{f' ({ops})' if ops else ''}"
    if policy == "FALLBACK_DISABLE":
        raise CompileError(f"{where}: {what}. SPMD_ORT_FALLBACK_POLICY=FALLBACK_DISABLE, so this is an error; "
                           "unset it to run such segments on the fx executor", op=ops or None)
    logger.warning("%s: %s; it runs on the fx executor instead (SPMD_ORT_FALLBACK_POLICY=FALLBACK_TO_FX)",
                   where, what)


def _op_summary(gm: fx.GraphModule, limit: int = 6) -> str:
    ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
    return ", ".join(ops[:limit]) + (f", ... {len(ops) - limit} more" if len(ops) > limit else "")


def _checked_first_run(name: str, seg: OrtSegment, inputs, reference, stats: OrtStats, policy: str,
                       verify: bool) -> float | None:
    """Run ``seg`` in ORT once on ``inputs`` next to its fx result ``reference``.

    Returns the ORT seconds, or None when ORT fails or (``verify``) differs beyond the segment's
    tolerance (recorded in ``stats``; an error under ``FALLBACK_DISABLE``).
    """
    t0 = time.perf_counter()
    try:
        got = seg.run_ort(*inputs)
    except Exception as exc:  # noqa: BLE001 - any ORT failure falls back per policy
        _failure(name, f"ONNX Runtime failed to run it: {_short(exc)}", policy, _op_summary(seg.fallback))
        stats.fallbacks.append(name)
        return None
    ort_s = time.perf_counter() - t0
    if verify:
        t0 = time.perf_counter()
        diff = _first_difference(got, reference, seg.tolerance)
        if diff is not None and _within_rounding_of_float64(seg.fallback, inputs, got, reference):
            logger.info("ORT segment %s differs from its fx graph (%s), but no more than the fx graph itself "
                        "differs from float64: an ill-conditioned computation, not a fault", name, diff)
            stats.ill_conditioned.append(name)
            diff = None
        stats.verify_seconds += time.perf_counter() - t0
        stats.verified += 1
        if diff is not None:
            stats.mismatches.append(f"{name}: {diff}")
            _failure(name, f"verification failed: {diff}", policy, _op_summary(seg.fallback))
            stats.fallbacks.append(name)
            return None
    return ort_s


def _within_rounding_of_float64(gm: fx.GraphModule, inputs, ort_out, fx_out) -> bool:
    """Whether ORT's outputs are as close to the segment computed in float64 as the fx graph's are.

    A verification mismatch may be the rounding of an ill-conditioned float32 computation (a batch
    norm of two nearly equal values: gradients that are analytically zero come out 1e-4 in eager
    float32), where two float32 implementations cannot agree.  The fx graph is run again with its
    float32 inputs in float64 (and every float32 its ops name, e.g. a cast of a count, made
    float64); the mismatch is no fault when every ORT output is within :data:`FLOAT64_FACTOR`
    times fx's own distance from the float64 output (or within the tolerance of it).  Only for
    segments that compute in float32 alone; otherwise, or if the float64 run fails, the mismatch
    stands.
    """
    import copy

    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if any(isinstance(a, torch.dtype) and a not in (torch.float32, torch.int64, torch.bool)
               for a in (*node.args, *node.kwargs.values())):
            return False  # another precision on purpose: not ours to widen
        node.args = tuple(torch.float64 if a is torch.float32 else a for a in node.args)
        node.kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in node.kwargs.items()}
    wide = fx.GraphModule(gm, graph)
    floats = [isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in inputs]
    ort_vals = ort_out if isinstance(ort_out, tuple) else (ort_out,)
    fx_vals = fx_out if isinstance(fx_out, (tuple, list)) else (fx_out,)
    if not any(floats) or any(isinstance(v, torch.Tensor) and v.dtype not in (torch.float32, torch.int64, torch.bool)
                              for v in fx_vals):
        return False
    try:
        with torch.no_grad():
            exact = wide(*[t.double() if f else t for t, f in zip(inputs, floats)])
    except Exception:  # noqa: BLE001 - no float64 reference: the mismatch stands
        return False
    exact_vals = exact if isinstance(exact, (tuple, list)) else (exact,)
    for a, b, x in zip(ort_vals, fx_vals, exact_vals):
        if not isinstance(b, torch.Tensor) or not b.dtype.is_floating_point:
            continue
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float64 or x.shape != b.shape:
            return False
        ort_err, fx_err = (a.double() - x).norm().item(), (b.double() - x).norm().item()
        if not ort_err <= max(VERIFY_TOLERANCE * x.norm().item(), FLOAT64_FACTOR * fx_err):
            return False
    return True


class _FirstRun(fx.Interpreter):
    """Runs every ORT segment and its fx graph, compares and times them; downstream uses the fx result."""

    def __init__(self, executor: OrtExecutor):
        super().__init__(executor.gm)
        self.executor = executor

    def call_module(self, target, args, kwargs):
        seg = self.module.get_submodule(target)
        if not isinstance(seg, OrtSegment) or seg.use_fallback:
            return super().call_module(target, args, kwargs)
        ex = self.executor
        t0 = time.perf_counter()
        reference = seg.fallback(*args)
        fx_s = time.perf_counter() - t0
        ort_s = _checked_first_run(seg.name, seg, args, reference, ex.stats, ex.policy, ex.verify)
        if seg.new_sizes is not None:
            seg.new_sizes.checked.add(seg.sizes.key(args))
        if ort_s is None:
            seg.use_fallback = True
            return reference
        self._choose(seg, args, {"fx": fx_s, "ort": ort_s})
        return reference

    def _choose(self, seg: OrtSegment, args, first: dict[str, float]) -> None:
        """Time both executors on this segment; with ``auto``, keep the faster (ties go to ORT)."""
        mode = self.executor.segment_executor
        if mode != "auto":
            self.executor.stats.choices[seg.name] = SegmentChoice(mode)
            seg.use_fallback = mode == "fx"
            return
        ort_runs = seg.runs
        fx_s, ort_s = _fastest(seg.fallback, args, first["fx"]), _fastest(seg.run_ort, args, first["ort"])
        choice = "fx" if fx_s < ort_s else "ort"
        self.executor.stats.choices[seg.name] = SegmentChoice(choice, ort_ms=ort_s * 1e3, fx_ms=fx_s * 1e3)
        seg.use_fallback = choice == "fx"
        seg.runs = ort_runs  # timing runs are not steps


def _fastest(run, args, first: float) -> float:
    """The fastest of ``first`` (the checked run's time) and further runs of ``run``."""
    least, most = TIMED_RUNS
    samples: list[float] = [first]
    while len(samples) < least or (len(samples) < most and sum(samples) < TIMING_BUDGET_S):
        t0 = time.perf_counter()
        run(*args)
        samples.append(time.perf_counter() - t0)
    return min(samples)


@dataclass(frozen=True)
class SegmentChoice:
    """Which executor runs a segment after the first run, and (``auto``) the warm times that decided it."""

    executor: str
    ort_ms: float | None = None
    fx_ms: float | None = None

    def __str__(self) -> str:
        if self.ort_ms is None:
            return f"{self.executor} (SPMD_ORT_SEGMENT_EXECUTOR={self.executor})"
        return f"{self.executor} (ort {self.ort_ms:.2f} ms, fx {self.fx_ms:.2f} ms)"


@dataclass
class OrtStats:
    segments: int = 0
    host_ops: dict = field(default_factory=dict)  # op -> why it stays on the host
    export_seconds: float = 0.0
    cache_hits: int = 0
    fallbacks: list = field(default_factory=list)
    verified: int = 0
    mismatches: list = field(default_factory=list)
    ill_conditioned: list = field(default_factory=list)  # mismatches within rounding of float64: not faults
    choices: dict = field(default_factory=dict)  # segment -> SegmentChoice
    first_run_seconds: float = 0.0  # the checked first run: both executors, comparison, timing
    verify_seconds: float = 0.0  # of which comparing outputs


class OrtExecutor:
    name = "ort"
    reuses_buffers = True  # segment outputs live in tensors that the next step overwrites

    def __init__(self, gm: fx.GraphModule, *, verify: bool, policy: str, stats: OrtStats,
                 segment_executor: str = "auto"):
        self.gm = gm
        self.verify = verify
        self.policy = policy
        self.stats = stats
        self.segment_executor = segment_executor
        self.first_run_done = False

    @property
    def segments(self) -> list[OrtSegment | SizedSegments]:
        """The ORT segments (a dynamic-shape segment is one module whatever its sizes: an :class:`OrtSegment`
        with dynamic axes, or a :class:`SizedSegments` exported per set of sizes)."""
        return [m for m in self.gm.modules() if isinstance(m, (OrtSegment, SizedSegments))]

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            if not self.first_run_done:
                # On copies: host nodes update state in place, and a segment failing after
                # them (FALLBACK_DISABLE) must leave the real state untouched.
                t0 = time.perf_counter()
                out = _FirstRun(self).run(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
                self.first_run_done = True
                self.stats.first_run_seconds = time.perf_counter() - t0
                return list(out)
            recorder = active().recorder
            if recorder is not None:  # a profiled step: segment by segment, timed
                return list(TimedInterpreter(self.gm, recorder).run(*inputs))
            return list(self.gm(*inputs))

    def describe(self) -> list[str]:
        stats = self.stats
        lines = [f"ORT segments: {stats.segments} (fell back to fx: {', '.join(stats.fallbacks) or 'none'}; "
                 f"export {stats.export_seconds:.2f}s, {stats.cache_hits} from cache; first run "
                 f"{stats.first_run_seconds:.2f}s, {stats.verified} verified in {stats.verify_seconds:.2f}s)"]
        lines += [f"  {name} runs on {choice}" for name, choice in stats.choices.items()]
        lines += [f"  {name}: differs from fx no more than fx from float64 (ill-conditioned; accepted)"
                  for name in stats.ill_conditioned]
        lines += [f"  host: {op} ({why})" for op, why in stats.host_ops.items()]
        return lines


def build_ort_executor(gm: fx.GraphModule, options: Options) -> OrtExecutor:
    """Partition the finished graph ``gm``, export and load each segment into an :class:`OrtExecutor`."""
    policy = options.fallback_policy
    stats = OrtStats()
    for node in gm.graph.nodes:
        reason = why_host(node) if node.op == "call_function" else None
        if reason is not None:
            stats.host_ops[str(node.target)] = reason
    fused, names = partition_for_ort(gm)
    stats.segments = len(names)
    threads = torch.get_num_threads()
    with _Progress(len(names)) as shown:
        for i, name in enumerate(names):
            sub = fused.get_submodule(name)
            providers = providers_for(segment_device(sub))  # a ConfigError, never a fallback
            shown.start(i, name, sum(1 for n in sub.graph.nodes if n.op == "call_function"))
            if is_symbolic(sub):
                segment = _dynamic_segment(name, sub, options, stats, threads=threads, providers=providers)
            else:
                segment = _load_segment(name, sub, options, stats, threads=threads, providers=providers)
            if segment is not None:
                setattr(fused, name, segment)
    # what runs in torch (host nodes, each segment's fx graph), after the exports: views as reshapes
    for module in fused.modules():
        if isinstance(module, fx.GraphModule):  # the top level, and each segment's fallback
            views_as_reshapes(module)
    fused.recompile()
    return OrtExecutor(fused, verify=options.verify, policy=policy, stats=stats,
                       segment_executor=options.segment_executor)


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Whether any value of ``gm`` has a symbolic size (or is a symbolic int): a dynamic-shape segment."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(
                    isinstance(d, int) for d in v.shape)):
                return True
    return False


class SizedSegments(nn.Module):
    """A segment of a program with symbolic sizes: one ONNX model per distinct set of input sizes.

    The segment's graph is specialised to the sizes of a call (re-traced over
    fake tensors of those shapes: size arithmetic folds to constants), exported
    (through the on-disk cache, keyed by the specialised graph) and loaded; the
    first run at each new set of sizes is verified against the fx graph as
    every segment's first run is.  Later calls with those sizes run the stored
    session.  A set of sizes whose export, load or check fails runs on fx (or
    raises, under ``FALLBACK_DISABLE``).
    """

    def __init__(self, name: str, fallback: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                 providers: list):
        super().__init__()
        self.name = name
        self.fallback = fallback
        self.options = options
        self.stats = stats
        self.threads = threads
        self.providers = providers
        self.sessions: dict[tuple, OrtSegment | None] = {}  # sizes -> session (None: runs on fx)
        self.sizes = DynamicSizes(fallback)  # names a set of sizes in messages
        self.runs = 0

    @staticmethod
    def sizes_of(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args)

    def forward(self, *args):
        key = self.sizes_of(args)
        if key not in self.sessions:
            self.sessions[key] = self._specialise(key, args)
            segment = self.sessions[key]
            if segment is not None:
                reference = self.fallback(*args)
                where = f"{self.name} at sizes {self.sizes.describe(self.sizes.key(args))}"
                if _checked_first_run(where, segment, _tensors(args), reference, self.stats,
                                      self.options.fallback_policy, self.options.verify) is None:
                    self.sessions[key] = None
                self.runs += 1
                return reference
        segment = self.sessions[key]
        if segment is None:
            return self.fallback(*args)
        self.runs += 1
        return segment.run_ort(*_tensors(args))


    def _specialise(self, key: tuple, args) -> OrtSegment | None:
        """The segment for these sizes: its sizes constants, its inputs the tensors (in order)."""
        # a size stays an int, a number computed from sizes (n / (n - 1)) a float
        examples = [torch.empty(a.shape, dtype=a.dtype, device=a.device) if isinstance(a, torch.Tensor) else a
                    for a in args]
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def run(*tensors):
            full = list(examples)
            for i, t in zip(positions, tensors):
                full[i] = t
            return self.fallback(*full)

        with torch.no_grad():
            concrete = make_fx(run, tracing_mode="fake")(*[examples[i] for i in positions])
        name = f"{self.name}_{len(self.sessions)}"
        return _load_segment(name, concrete, self.options, self.stats, threads=self.threads,
                             providers=self.providers)


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _dynamic_segment(name: str, sub: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                     providers: list) -> OrtSegment | SizedSegments:
    """A segment with symbolic sizes: one ONNX model with dynamic axes for every size.

    Where that model cannot be built (a translation that needs concrete sizes) or loaded,
    the segment is exported per set of sizes instead (:class:`SizedSegments`), with an INFO line.
    """
    try:
        segment = _open_segment(name, sub, options, stats, threads=threads, providers=providers)
    except CompileError:
        raise
    except Exception as exc:  # noqa: BLE001 - the per-size export still serves the segment
        cause = exc.__cause__ if isinstance(exc, _StageError) and exc.__cause__ is not None else exc
        logger.info("ORT segment %s has no model with dynamic sizes (%s: %s); it is exported per set of sizes",
                    name, getattr(exc, "stage", "export"), _short(cause, 200))
        return SizedSegments(name, sub, options, stats, threads=threads, providers=providers)
    segment.new_sizes = NewSizes(stats, options.fallback_policy, options.verify)
    return segment


def _load_segment(name: str, sub: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                  providers: list) -> OrtSegment | None:
    """Export (or load from the cache) and open one segment; None if it falls back to fx."""
    try:
        return _open_segment(name, sub, options, stats, threads=threads, providers=providers)
    except CompileError:
        raise
    except _StageError as exc:  # export/load failures fall back per policy
        _failure(name, f"{exc.stage} failed: {type(exc.__cause__).__name__}: {_short(exc.__cause__)}",
                 options.fallback_policy, _op_summary(sub))
        stats.fallbacks.append(name)
        return None


class _StageError(Exception):
    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def _open_segment(name: str, sub: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                  providers: list) -> OrtSegment:
    """Export (or load from the cache) and open one segment; a failure is a :class:`_StageError` naming the stage."""
    opset = options.onnx_opset
    stage = "export"
    try:
        result = export_segment(sub, name=name, opset=opset, cache_dir=options.cache_dir)
        stats.export_seconds += result.seconds
        stats.cache_hits += int(result.cache_hit)
        if options.save_onnx:
            path = save_model(result.model, name, options.onnx_prefix, options.save_onnx_path)
            logger.info("saved %s to %s", name, path)
        stage = "loading the exported model into ONNX Runtime"
        make = lambda data: OrtSegment(name, sub, data, threads=threads,  # noqa: E731
                                       allow_spinning=options.allow_spinning, providers=providers)
        try:
            return make(result.model)
        except Exception:
            if not result.cache_hit:
                raise
            logger.info("cached model of %s does not load; exporting it again", name)
            result = export_segment(sub, name=name, opset=opset, cache_dir=options.cache_dir, refresh=True)
            return make(result.model)
    except CompileError:
        raise
    except Exception as exc:
        raise _StageError(stage) from exc


class _Progress:
    """One line when an export takes longer than :data:`PROGRESS_AFTER_S` (big models), and one when all are done."""

    def __init__(self, total: int):
        self.total = total
        self.t0 = time.perf_counter()
        self.timer: threading.Timer | None = None
        self.shown = False

    def __enter__(self) -> _Progress:
        return self

    def start(self, index: int, name: str, ops: int) -> None:
        self._cancel()

        def show() -> None:
            self.shown = True
            progress.info("exporting ORT segment %s (%d of %d, %d ops) ...", name, index + 1, self.total, ops)

        self.timer = threading.Timer(PROGRESS_AFTER_S, show)
        self.timer.daemon = True
        self.timer.start()

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def __exit__(self, *exc) -> None:
        self._cancel()
        if self.shown:
            progress.info("exported %d ORT segment(s) in %.1fs (cached for the next run)", self.total,
                          time.perf_counter() - self.t0)


def _short(exc: BaseException, limit: int = 400) -> str:
    """The error and, when it wraps another (the exporter's ConversionError does), the root cause."""
    def clip(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= limit else text[:limit] + " ..."

    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = clip(str(exc))
    return text if root is exc else f"{text} Cause: {type(root).__name__}: {clip(str(root))}"
