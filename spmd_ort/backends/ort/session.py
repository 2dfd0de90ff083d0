"""An ORT session standing in for one graph segment, run through IO binding.

:class:`OrtSegment` binds its inputs to the torch tensors' own memory. On CPU, ORT allocates
each run's outputs and torch takes them over without a copy (DLPack), so they live as long as
the step uses them; on CUDA it writes them into tensors allocated once (per set of sizes in a
dynamic-shape segment, :class:`DynamicSizes`). No input or output is copied.
:func:`open_segment` exports a segment (through the on-disk cache, :mod:`spmd_ort.backends.ort.export`)
and opens it; :func:`load_segment` does the same and falls back to fx per policy.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from torch import fx, nn

from spmd_ort.graph.symbolic import input_sizes, input_symbols
from spmd_ort.errors import CompileError, ConfigError
from spmd_ort.options import Options, get_logger
from spmd_ort.backends.ort.export import export_segment, input_position, save_model
from spmd_ort.backends.ort.stats import OrtStats
from spmd_ort.backends.ort.verify import segment_failure
from spmd_ort.graph.checking import op_summary, short_error, unordered_topks, verify_tolerances
from spmd_ort.runtime.memory import host_memory_retained

logger = get_logger(__name__)

NUMPY_DTYPES = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int64: np.int64,
    torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}

SCALAR_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                "tensor(double)": np.float64, "tensor(bool)": np.bool_}


def providers_for(device: torch.device) -> list:
    """ONNX Runtime execution providers for tensors on ``device``; one that is not installed is a ConfigError."""
    available = ort.get_available_providers()
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise ConfigError(f"the step's tensors are on {device}, but this onnxruntime has no CUDAExecutionProvider "
                              f"(it has {', '.join(available) or 'none'}); install onnxruntime-gpu (extra "
                              "spmd-ort[gpu]) or compile with backend='fx'")
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    if device.type not in ("cpu", "meta") or "CPUExecutionProvider" not in available:  # meta: a plan's
        raise ConfigError(f"the step's tensors are on {device}, which no installed ONNX Runtime execution provider "
                          f"runs (installed: {', '.join(available) or 'none'}); compile with backend='fx'")
    return ["CPUExecutionProvider"]

def _outputs_meta(gm: fx.GraphModule) -> tuple[list[torch.Tensor], bool]:
    out = gm.graph.output_node().args[0]
    is_tuple = isinstance(out, (tuple, list))
    nodes = list(out) if is_tuple else [out]
    return [n.meta["val"] for n in nodes], is_tuple

def segment_device(gm: fx.GraphModule) -> torch.device:
    """Where a segment's tensors live (its first output's device)."""
    metas, _ = _outputs_meta(gm)
    tensors = [m for m in metas if isinstance(m, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")

def is_symbolic(gm: fx.GraphModule) -> bool:
    """Whether any value of ``gm`` has a symbolic size (or is a symbolic int): a dynamic-shape segment."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(
                    isinstance(d, int) for d in v.shape)):
                return True
    return False

class OrtSegment(nn.Module):
    """One ORT session standing in for the fx segment ``fallback`` (same inputs, same outputs)."""

    def __init__(self, name: str, fallback: fx.GraphModule, model: bytes, *, threads: int, allow_spinning: bool,
                 providers: list | None = None):
        super().__init__()
        self.name = name
        self.fallback = fallback
        self.use_fallback = False
        # steps whose outputs came from ONNX Runtime; a checked run (the first, or a dynamic segment's first at new
        # sizes) runs ORT too, but its outputs are only compared and the fx graph's are used: checked_runs
        self.runs = 0
        self.checked_runs = 0
        self.new_sizes = None  # dynamic shapes: a sizes.NewSizes checks the first runs at new sizes
        self.tolerance = verify_tolerances(fallback)  # per output
        self.unordered = unordered_topks(fallback)  # outputs in an unsorted topk's order: verified as sets
        metas, self.returns_tuple = _outputs_meta(fallback)
        if odd := [type(m).__name__ for m in metas if not isinstance(m, torch.Tensor)]:
            raise RuntimeError(f"segment {name} returns a {odd[0]}, not tensors only")  # the partitioner's fault
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
        if self.device_type == "cpu" and host_memory_retained():
            # The process keeps freed memory for reuse (spmd_ort.runtime.memory.retain_host_memory), so malloc
            # is already an arena: ORT's own arena and memory pattern only hold a second copy of the step's
            # values (gpt-mini: peak RSS 1146 -> 856 MiB, step time unchanged). Without retained memory each
            # large allocation would be a fresh mmap, page-faulted every step: ORT's arena stays then.
            options.enable_cpu_mem_arena = False
            options.enable_mem_pattern = False
        # ONNX Runtime's constant folding has no size limit: a value computed from constants alone (the zeros an
        # attention mask's masked_fill starts from, 4096 x 4096 at Llama-3-8B's length) becomes an initializer
        # held by each session, on the device (64 MiB per attention segment, 4 GiB over 32 layers' forward and
        # backward). The export already folds what is small (export.FOLD_LIMIT); such a value is computed in
        # each run instead, at the cost of writing it once.
        self.session = ort.InferenceSession(model, options, providers=providers or providers_for(device),
                                            disabled_optimizers=["ConstantFolding"])
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
        # On CPU, ORT allocates each run's outputs and torch takes them without a copy (DLPack): a segment's
        # outputs then live as long as the step uses them, as the fx graph's do. Buffers bound once would hold
        # every segment's outputs at once, for good (the sum of all values crossing segment boundaries: with
        # tensor parallelism's 48 segments on gpt-mini, most of the step's values). On CUDA the outputs are
        # bound once (per set of sizes) to tensors allocated by torch, in torch's caching allocator.
        self.ort_allocates = self.device_type == "cpu"
        self.outputs: list[torch.Tensor] = []
        if self.ort_allocates:
            self._bind_fresh_outputs()
        elif self.sizes is None:
            self._bind_outputs([tuple(m.shape) for m in metas])

    def _bind_fresh_outputs(self) -> None:
        """Let ORT allocate the next run's outputs (a binding that holds outputs would write into them again)."""
        self.binding.clear_binding_outputs()
        for name in self.output_names:
            self.binding.bind_output(name, self.device_type, self.device_id)

    def _take_outputs(self) -> list[torch.Tensor]:
        """This run's outputs, allocated by ORT, as torch tensors on the same memory; the binding is cleared for
        the next run. An output sharing memory with another (ORT may return one value under two names) is
        copied, so no in-place update of one (an all-reduce of a gradient) reaches the other."""
        outs = [torch.from_dlpack(v) for v in self.binding.get_outputs()]
        self._bind_fresh_outputs()
        seen: set[int] = set()
        for k, t in enumerate(outs):
            if t.numel() == 0:
                continue
            if t.data_ptr() in seen:
                outs[k] = t.clone()
            seen.add(outs[k].data_ptr())
        return outs

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
        if self.sizes is not None and not self.ort_allocates:  # dynamic shapes: outputs sized for this call's sizes
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
        out = tuple(self._take_outputs() if self.ort_allocates else self.outputs)
        return out if self.returns_tuple else out[0]

    def forward(self, *args: torch.Tensor | int):
        if self.use_fallback:
            return self.fallback(*args)
        if self.new_sizes is not None:
            return self.new_sizes.forward(self, args)
        return self.used(self.run_ort(*args))

    def used(self, outputs):
        """``outputs`` of ORT, which the step uses: counted in :attr:`runs`."""
        self.runs += 1
        return outputs

    def park(self, parked: bool = True) -> None:
        """Run on fx (``parked``) or on ORT again, keeping the session: the automatic choice times the whole
        step with every segment on ORT against the segments as chosen, and may take a parked segment back."""
        self.use_fallback = parked or self.session is None  # (a released segment has no session to go back to)

    @property
    def held(self) -> bool:
        """Whether its session is still held (not released)."""
        return self.session is not None

    @property
    def parked(self) -> bool:
        return self.use_fallback and self.held

    def release(self) -> None:
        """Run on fx from now on, and free what only ONNX Runtime needed: the session (its arena and
        initializers), the IO binding and the output buffers."""
        self.use_fallback = True
        self.session = self.binding = None
        self.outputs = []

class DynamicSizes:
    """A dynamic-shape segment's sizes: the symbols its inputs carry, and its output shapes in them.

    Each symbol is read from the first input that has it as a dim (or is it: a size
    the host computed); :meth:`key` is their values for a call and
    :meth:`output_shapes` evaluates each output dim's expression (``s0*s1``) there.
    An input size that is an expression of symbols no input carries alone (a shard of a symbolic
    length under sequence parallelism: ``(s0 + 1)//2``) is read whole, where the outputs' sizes are
    written in it.  A symbol an output needs otherwise is a ValueError (the segment is then exported
    per set of sizes, :class:`SizedSegments`).
    """

    def __init__(self, gm: fx.GraphModule, metas: list[torch.Tensor] | None = None):
        import sympy

        position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        symbols = input_symbols(gm)
        self.symbols: list = list(symbols)
        # (input position, dim; None: the input is the size)
        self.sources: list[tuple[int, int | None]] = [(position[node], dim) for node, dim, _ in symbols.values()]
        self.shapes = [tuple(int(d) if not isinstance(d, torch.SymInt) else d.node.expr for d in m.shape)
                       for m in metas or []]
        if missing := self._needed() - set(self.symbols):
            whole: dict = {}  # expression -> (input position, dim), each read as one size
            for node, dim, size in input_sizes(gm):
                expr = size.node.expr
                if not isinstance(expr, sympy.Symbol) and expr.free_symbols & missing:
                    whole.setdefault(expr, (position[node], dim))
            names = {expr: sympy.Symbol(str(expr)) for expr in whole}
            self.shapes = [tuple(d if isinstance(d, int) else d.xreplace(names) for d in shape)
                           for shape in self.shapes]
            for expr, source in whole.items():
                self.symbols.append(names[expr])
                self.sources.append(source)
            if missing := self._needed() - set(self.symbols):
                raise ValueError(f"output sizes in {sorted(map(str, missing))} follow from no input's size")

    def _needed(self) -> set:
        return set().union(*[d.free_symbols for shape in self.shapes for d in shape if not isinstance(d, int)])

    def key(self, args) -> tuple[int, ...]:
        return tuple(int(args[pos]) if dim is None else args[pos].shape[dim] for pos, dim in self.sources)

    def describe(self, key: tuple[int, ...]) -> str:
        return ", ".join(f"{sym}={v}" for sym, v in zip(self.symbols, key))

    def output_shapes(self, key: tuple[int, ...]) -> list[tuple[int, ...]]:
        env = dict(zip(self.symbols, key))
        return [tuple(d if isinstance(d, int) else int(d.xreplace(env)) for d in shape) for shape in self.shapes]

class StageError(Exception):
    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage

def open_segment(name: str, sub: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                  providers: list) -> OrtSegment:
    """Export (or load from the cache) and open one segment; a failure is a :class:`StageError` naming the stage."""
    opset = options.onnx_opset
    stage = "export"
    try:
        result = export_segment(sub, name=name, opset=opset, cache_dir=options.cache_dir)
        stats.export_seconds += result.seconds
        stats.cache_hits += int(result.cache_hit)
        if options.save_onnx:
            try:
                path = save_model(result.model, name, options.onnx_prefix, options.save_onnx_path)
            except OSError as exc:  # the configuration's fault, not the segment's: no fallback to fx
                where = (f"SPMD_ORT_SAVE_ONNX_PATH={str(options.save_onnx_path)!r}" if options.save_onnx_path
                         else "the working directory (SPMD_ORT_SAVE_ONNX_PATH unset)")
                raise ConfigError(f"DebugOptions(save_onnx=True) could not write segment {name} into {where}: "
                                  f"{exc}. Fix: set SPMD_ORT_SAVE_ONNX_PATH to a writable directory") from exc
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
        raise StageError(stage) from exc

def load_segment(name: str, sub: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                  providers: list) -> OrtSegment | None:
    """Export (or load from the cache) and open one segment; None if it falls back to fx."""
    try:
        return open_segment(name, sub, options, stats, threads=threads, providers=providers)
    except CompileError:
        raise
    except StageError as exc:  # export/load failures fall back per policy
        what = f"{exc.stage} failed: {type(exc.__cause__).__name__}: {short_error(exc.__cause__)}"
        segment_failure(name, what, options.fallback_policy, op_summary(sub))
        stats.fell_back(name, what)
        return None
