"""``compile(cuda_graph=True)``: the step as CUDA graphs, captured once and replayed every step.

A whole train step is what a CUDA graph wants: one launch from Python replays forward, backward, clipping, the
optimizer and a GradScaler's skip, where the fx executor calls each of several hundred ops from Python.  The
finished graph's :class:`~spmd_ort.passes.analysis.CapturePlan` (``plan_graph_capture_pass``) says whether one
graph can hold the step; :func:`graphed` wraps the executor the backend built (fx or inductor: their kernels run
on torch's current stream) in a :class:`GraphedExecutor`, which

* runs the checked first run and one steady run as the executor always does (the second lets lazily made
  things, cuBLAS workspaces and inductor's autotuning, exist before a capture);
* then captures one run of the executor in a ``torch.cuda.CUDAGraph`` and replays it:

  - state inputs (parameters, gradients, optimizer and scaler state) are persistent tensors the graph reads
    and updates where they are; a state tensor that is replaced (``load_state_dict``, a new ``.grad``) drops
    the graph, and the next run captures again;
  - the batch (and the existing ``.grad`` of arguments that require grad) is copied into the graph's own
    buffers before each replay;
  - each param group's hyper-parameters are a device tensor the host writes before each replay
    (:func:`spmd_ort.capture.state.write_hparams`): the learning rate is read by the fused optimizer kernels on
    the device, so a schedule never re-captures; the others (betas, eps, weight decay, momentum) are numbers
    in the kernels' launches, so a step whose values differ from the captured ones captures again;
  - random ops draw from torch's generator, which torch registers with the graph (each replay advances it as
    an eager step would);
  - a program of symbolic sizes gets a graph per size, captured on that size's second run (its first does the
    size's lazy work uncaptured), the last :data:`MAX_SIZES` kept (LRU);

* and returns the graph's output buffers (``reuses_buffers``): the program copies what escapes the step.

Where the plan finds host nodes (an opaque part, Adam's step counters on the host: eager's default optimizer
on a GPU) and the backend is fx, the graph is split at them (:func:`split_for_graphs`, the segments' grouping of
:mod:`spmd_ort.graph.segments`) and each run of nodes between host nodes is captured on its own
(:class:`SegmentGraph`): an input a host node made is copied into the segment's buffers, one that another
segment's graph wrote is read where it is.

A capture that fails (something in the step that a graph cannot hold and the plan did not foresee) is logged
as a WARNING with its cause, and the program runs as it did without graphs from then on; so does one whose
plan says no graph can hold it (``explain()`` names the op and why).  A profiled step runs uncaptured (its
timeline is per op).
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.operator_support import OperatorSupport

from spmd_ort.graph import ops
from spmd_ort.graph.segments import capture_verdict, partition_with
from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.options import get_logger
from spmd_ort.runtime.step_runtime import current

logger = get_logger(__name__)

MAX_SIZES = 8  # graphs kept per program with symbolic sizes (one per size seen; the least recently used goes)
WARMUP_RUNS = 2  # runs before the first capture: the checked first run and one steady run
GRAPHED_BACKENDS = ("fx", "inductor")  # their kernels run on torch's current stream, which a capture records
MAX_RECAPTURES = 4  # a graph captured again more often than this for one reason runs uncaptured from then on


class CudaGraph:
    """One ``torch.cuda.CUDAGraph``: ``capture(fn, reads)`` records ``fn()`` (returning its value, the graph's
    output buffers; ``reads``: the tensors it reads, which a graph keeps by address) on the device of those
    tensors, ``replay()`` runs it.  ``pool``: the memory pool it shares with the other graphs of one
    :class:`GraphedRuns` (one per size: one replays at a time, and each one's outputs stay allocated while it is
    kept), or None for a new one, which ``pool`` then holds.  A capture fails only for what runs in it: other threads'
    CUDA calls are left alone (``capture_error_mode="thread_local"``: a DataLoader's pinning thread)."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.device: torch.device | None = None

    def capture(self, fn: Callable[[], list], reads: list) -> list:
        self.device = next((t.device for t in reads if isinstance(t, torch.Tensor) and t.is_cuda), None)
        with torch.cuda.device(self.device):
            with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = fn()
        if self.pool is None:
            self.pool = self.graph.pool()
        return outputs

    def replay(self) -> None:
        with torch.cuda.device(self.device):
            self.graph.replay()


@dataclass
class Captured:
    """One capture: the graph, the inputs it reads (its own buffers for what is copied in, the others
    themselves), its outputs, and the host-side values it froze."""

    graph: object
    static: list
    outputs: list
    numbers: dict[int, tuple]  # hyper-parameters (by input position) the kernels took as numbers: all but lr
    shared: frozenset[int] = frozenset()  # copied positions read in place: another graph's output buffers
    replays: int = 0


class GraphedRuns:
    """Captures and replays ``fn(inputs) -> outputs`` (a whole step's executor, or one segment of it).

    ``copied``: input positions whose values are the call's own (the batch, a host op's fresh output): copied
    into the graph's buffers before each replay; every other tensor input (state, a value another graph
    wrote) must be the tensor captured, else the graph is captured again.  ``hparams``: positions of
    hyper-parameter tensors, whose numbers the capture froze.  ``label``: what it runs, for messages."""

    def __init__(self, fn: Callable[[list], list], *, copied: set[int], hparams: list[int], label: str,
                 graph_factory: Callable[[object], object] = CudaGraph, max_sizes: int = MAX_SIZES,
                 buffers: set[int] | None = None):
        self.fn = fn
        self.pool = None  # the memory pool its graphs share (one per size; one replays at a time)
        self.seen: set[tuple] = set()  # sizes run uncaptured once: a size is captured on its second run
        # addresses of the output buffers of the graphs of one step (shared by its segments): an input that is
        # one is read where it is, not copied (the graph that writes it replays first, every step)
        self.buffers = buffers if buffers is not None else set()
        self.copied = copied
        self.hparams = hparams
        self.label = label
        self.graph_factory = graph_factory
        self.max_sizes = max_sizes
        self.disabled: str | None = None
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.runs = self.captures = self.replays = 0
        self.recaptured: dict[str, int] = {}  # why a graph was dropped and captured again -> how often

    def __call__(self, inputs: list) -> tuple[list, bool]:
        """The outputs of one run, and whether they are a graph's buffers (a replay)."""
        self.runs += 1
        if self.disabled is not None:
            return self.fn(inputs), False
        key = self._key(inputs)
        size = tuple(k[:2] if isinstance(k, tuple) and len(k) == 3 else k for k in key)  # the key but addresses
        if self.runs <= WARMUP_RUNS or size not in self.seen:
            # a size's lazy work (cuBLAS workspaces, inductor's autotuning) done before it is captured
            self.seen.add(size)
            return self.fn(inputs), False
        captured = self.graphs.get(key)
        if captured is not None:
            why = self._stale(captured, inputs)
            if why is not None:
                self.recaptured[why] = self.recaptured.get(why, 0) + 1
                self._forget(self.graphs.pop(key))
                captured = None
                if self.recaptured[why] > MAX_RECAPTURES:
                    self._disable(f"captured again {self.recaptured[why]} times: {why}")
                    return self.fn(inputs), False
                logger.info("CUDA graph (%s): captured again: %s", self.label, why)
        if captured is None:
            try:
                captured = self._capture(inputs)
            except Exception as exc:  # noqa: BLE001 - any failure to capture runs it uncaptured
                self._disable(f"capture failed: {_cause(exc)}")
                return self.fn(inputs), False
            self.graphs[key] = captured
            while len(self.graphs) > self.max_sizes:
                self._forget(self.graphs.popitem(last=False)[1])
        self.graphs.move_to_end(key)
        for i in self.copied - captured.shared:
            src, dst = inputs[i], captured.static[i]
            if isinstance(src, torch.Tensor) and src.data_ptr() != dst.data_ptr():
                dst.copy_(src, non_blocking=True)
        captured.graph.replay()
        captured.replays += 1
        self.replays += 1
        return captured.outputs, True

    def _forget(self, captured: Captured) -> None:
        """A graph dropped: its output buffers are no longer any graph's."""
        self.buffers.difference_update(t.data_ptr() for t in captured.outputs if isinstance(t, torch.Tensor))

    def _disable(self, why: str) -> None:
        self.disabled = why
        for captured in self.graphs.values():
            self._forget(captured)
        self.graphs.clear()
        logger.warning("CUDA graph (%s): %s; it runs without graphs from now on", self.label, why)

    def _key(self, inputs: list) -> tuple:
        """What one graph is for: the sizes of the tensors copied in (and the address of one that another graph
        wrote, which it reads in place: that graph's buffer for this size), and any number it takes (a symbolic
        size lifted to an input)."""
        return tuple((tuple(x.shape), x.dtype, x.data_ptr() if x.data_ptr() in self.buffers else None)
                     if isinstance(x, torch.Tensor) else (None if x is None else ("value", x))
                     for i, x in enumerate(inputs) if i in self.copied or not isinstance(x, torch.Tensor))

    def _numbers(self, inputs: list) -> dict[int, tuple]:
        runtime = current()
        values = runtime.hparam_values if runtime is not None else {}
        out = {}
        for i in self.hparams:
            t = inputs[i]
            written = values.get(t.data_ptr()) if t.device.type != "cpu" else tuple(t.tolist())
            out[i] = tuple(written[1:]) if written is not None else None
        return out

    def _stale(self, captured: Captured, inputs: list) -> str | None:
        """Why ``captured`` cannot replay this run (None: it can)."""
        for i, (now, then) in enumerate(zip(inputs, captured.static)):
            if i in self.copied - captured.shared or not isinstance(now, torch.Tensor):
                continue
            if not isinstance(then, torch.Tensor) or now.data_ptr() != then.data_ptr():
                return (f"input {i} is another tensor than the one captured (state replaced, e.g. by "
                        "load_state_dict)")
        if self._numbers(inputs) != captured.numbers:
            return "a hyper-parameter other than the learning rate changed (they are numbers in the captured kernels)"
        return None

    def _capture(self, inputs: list) -> Captured:
        shared = frozenset(i for i in self.copied if isinstance(inputs[i], torch.Tensor)
                           and inputs[i].data_ptr() in self.buffers)
        static = [x.clone() if i in self.copied - shared and isinstance(x, torch.Tensor) else x
                  for i, x in enumerate(inputs)]
        graph = self.graph_factory(self.pool)
        outputs = graph.capture(lambda: list(self.fn(static)), static)
        self.pool = getattr(graph, "pool", None)
        self.captures += 1
        self.buffers.update(t.data_ptr() for t in outputs if isinstance(t, torch.Tensor))
        return Captured(graph, static, outputs, self._numbers(inputs), shared)

    def line(self) -> str:
        if self.disabled is not None:
            return f"{self.label}: not captured: {self.disabled}"
        return (f"{self.label}: {len(self.graphs)} kept ({self.captures} captures, {self.replays} replays in "
                f"{self.runs} runs)") + "".join(f"; captured again {n}x: {why}" for why, n in self.recaptured.items())


def _cause(exc: BaseException) -> str:
    """A failed capture's message, with the error that invalidated it (ending a capture that a forbidden call
    invalidated raises its own error, which hides that call's)."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    inner = exc.__context__ or exc.__cause__
    if inner is not None and inner is not exc:
        text += f" (after {type(inner).__name__}: {' '.join(str(inner).split())[:300]})"
    return text


class GraphedExecutor:
    """Runs an executor's program as CUDA graphs (see the module docstring): the whole step as one graph, or,
    where host nodes split it (fx backend), each run of nodes between them as one (:class:`SegmentGraph`).
    ``disabled``: why it does not (the plan, the device): then every run is the wrapped executor's."""

    def __init__(self, inner, input_slots: list[Slot], *, disabled: str | None = None, segmented: bool = False,
                 graph_factory: Callable[[object], object] = CudaGraph, host: str = "cpu"):
        self.inner = inner
        self.gm = inner.gm
        self.reason = disabled  # why it was built not to capture (None: it captures)
        self.graph_factory = graph_factory
        self._static_out = False
        self.runs = 0
        # the call's own values: copied into the graph's buffers before each replay
        copied = {i for i, s in enumerate(input_slots) if s.kind in (SlotKind.BATCH, SlotKind.INPUT_GRAD)}
        hparams = [i for i, s in enumerate(input_slots) if s.kind is SlotKind.HPARAM]
        self.whole = self.split = None
        self.segments: list[SegmentGraph] = []
        if disabled is None and segmented:
            self.split, self.segments = split_for_graphs(inner.gm, input_slots, graph_factory, host)
        elif disabled is None:
            self.whole = GraphedRuns(lambda xs: list(inner.run(xs)), copied=copied, hparams=hparams,
                                     label="the whole step", graph_factory=graph_factory)

    # what the tuner and describe() read of the executor: the wrapped one's
    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def disabled(self) -> str | None:
        """Why no run is captured: how it was built, or its whole-step capture failing (None: it captures)."""
        return self.reason if self.whole is None else self.whole.disabled

    @property
    def reuses_buffers(self) -> bool:
        """Whether the last run's outputs may be a graph's buffers (the next replay overwrites them)."""
        return self._static_out or self.inner.reuses_buffers

    @property
    def captures(self) -> int:
        return self.whole.captures if self.whole is not None else sum(g.runs.captures for g in self.segments)

    @property
    def replays(self) -> int:
        return self.whole.replays if self.whole is not None else sum(g.runs.replays for g in self.segments)

    def run(self, inputs: list) -> list:
        self.runs += 1
        runtime = current()
        if self.disabled is not None or (runtime is not None and runtime.recorder is not None):
            self._static_out = False  # (a profiled step: its timeline is per op)
            return self.inner.run(inputs)
        if self.whole is not None:
            outputs, self._static_out = self.whole(inputs)
            return outputs
        before = self.replays
        with torch.no_grad():
            outputs = list(self.split(*inputs))
        self._static_out = self.replays > before
        return outputs

    def describe(self) -> list[str]:
        return list(self.inner.describe()) + self.graph_lines()

    def graph_lines(self) -> list[str]:
        """What ``compile(cuda_graph=True)`` did, for ``describe()`` and ``explain()``."""
        if self.disabled is not None:
            return [f"CUDA graphs: not used: {self.disabled}"]
        if self.whole is not None:
            return [f"CUDA graphs: {self.whole.line()} (the first {WARMUP_RUNS} runs uncaptured)"]
        host = [n for n in self.split.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        return ([f"CUDA graphs: one per run of nodes between host nodes: {len(self.segments)} segments "
                 f"({self.captures} captures, {self.replays} replays; the first {WARMUP_RUNS} runs of each "
                 f"uncaptured), {len(host)} host nodes between them"]
                + [f"  {g.runs.line()}" for g in self.segments])


class SegmentGraph(nn.Module):
    """One segment of a step split at its host nodes, run as CUDA graphs (:class:`GraphedRuns`)."""

    def __init__(self, sub: fx.GraphModule, name: str, copied: set[int], hparams: list[int], graph_factory,
                 buffers: set[int]):
        super().__init__()
        self.sub = sub
        self.tuple_out = isinstance(sub.graph.output_node().args[0], (tuple, list))
        self.runs = GraphedRuns(lambda xs: _as_list(sub(*xs)), copied=copied, hparams=hparams,
                                label=f"segment {name}", graph_factory=graph_factory, buffers=buffers)

    def forward(self, *args):
        outputs, _ = self.runs(list(args))
        return tuple(outputs) if self.tuple_out else outputs[0]


def _as_list(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


class _Capturable(OperatorSupport):
    def __init__(self, host: str):
        super().__init__()
        self.host = host

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return node.op == "call_function" and capture_verdict(node, self.host) is None


def split_for_graphs(gm: fx.GraphModule, input_slots: list[Slot], graph_factory,
                     host: str = "cpu") -> tuple[fx.GraphModule, list[SegmentGraph]]:
    """A copy of ``gm`` whose runs of capturable nodes are submodules run as CUDA graphs (:class:`SegmentGraph`),
    the host nodes between them left in the graph.  A segment's input is copied into its buffers when it is
    the call's own or a host node's output; state (and what a segment updates in place) must be the tensor it
    captured."""
    split, names = partition_with(copy.deepcopy(gm), _Capturable(host))
    kinds = {n: input_slots[i].kind for i, n in enumerate(n for n in split.graph.nodes if n.op == "placeholder")}
    # each segment's graphs share a memory pool (one size replays at a time); segments do not: a segment captured
    # again could put its outputs in the scratch memory of a later segment's older graph, which replays over them
    segments, buffers = [], set()
    for node in split.graph.nodes:
        if node.op != "call_module" or node.target not in names:
            continue
        sub = split.get_submodule(node.target)
        written = _written_inputs(sub)
        copied, hparams = set(), []
        for i, arg in enumerate(node.args):
            kind = kinds.get(arg) if isinstance(arg, fx.Node) else None
            if kind is SlotKind.HPARAM:
                hparams.append(i)
            elif (kind is None or kind in (SlotKind.BATCH, SlotKind.INPUT_GRAD)) and i not in written:
                copied.add(i)
        graphed_sub = SegmentGraph(sub, node.target, copied, hparams, graph_factory, buffers)
        setattr(split, node.target, graphed_sub)
        segments.append(graphed_sub)
    split.recompile()
    return split, segments


def _written_inputs(sub: fx.GraphModule) -> set[int]:
    """Positions of ``sub``'s inputs that one of its ops writes in place (a copy in would take the write)."""
    places = {n: i for i, n in enumerate(n for n in sub.graph.nodes if n.op == "placeholder")}
    out = set()
    for node in sub.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for v in value if isinstance(value, (list, tuple)) else [value]:
                    if v in places:
                        out.add(places[v])
    return out


def hparams_on_device(options) -> bool:
    """Whether a step compiled with ``options`` reads its hyper-parameters on the device (a CUDA-graphed one:
    written before each replay, never read back by the host)."""
    return options.cuda_graph and options.backend in GRAPHED_BACKENDS


def unwrapped_reason(backend: str, on_gpu: bool) -> str:
    """Why a backend :func:`graphed` leaves unwrapped runs without CUDA graphs (``explain()`` says it)."""
    if not on_gpu:
        return "the step runs on the CPU: there is nothing to capture"
    return (f"the {backend} backend runs its kernels outside torch's stream; CUDA graphs capture the fx and inductor "
            "backends")


def graphed(executor, plan, input_slots: list[Slot], backend: str):
    """The executor of a step compiled with ``cuda_graph=True``: on the fx and inductor backends a
    :class:`GraphedExecutor` that captures where ``plan`` (the step's CapturePlan) says graphs hold the step,
    else passes every run through and says why (``explain()``); the ORT backend's own executor as it is (its
    sessions run their kernels outside torch's stream; a WARNING on a GPU).  A step with collectives is not
    captured: their bookkeeping (overlap, figures, a gather carried into the next step) runs in Python around
    each one, which a replay would skip."""
    on_gpu = plan is not None and plan.cuda
    if backend not in GRAPHED_BACKENDS:
        if on_gpu:
            logger.warning("CUDA graph: not used: %s", unwrapped_reason(backend, on_gpu))
        return executor
    reason = None
    collective = next((n for n in executor.gm.graph.nodes if n.op == "call_function" and ops.is_collective(n)),
                      None)
    if not on_gpu:
        reason = unwrapped_reason(backend, on_gpu)
    elif collective is not None:
        reason = (f"{collective.name} ({collective.target}) is a collective; capturing collectives across ranks "
                  "is not built yet")
    elif plan.blocker is not None:
        reason = plan.blocker
    elif not plan.regions:
        reason = "no op to capture"
    elif plan.splits and backend != "fx":
        name, why = plan.splits[0]
        reason = (f"the step does not fit one graph ({name}: {why}), and one graph per run of nodes between "
                  f"host nodes is built for the fx backend only")
    if reason is not None and on_gpu:
        logger.warning("CUDA graph: not used: %s", reason)
    return GraphedExecutor(executor, input_slots, disabled=reason, segmented=bool(on_gpu and plan.splits))
