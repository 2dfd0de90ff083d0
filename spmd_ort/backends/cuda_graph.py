"""``compile(cuda_graph=True)``: the whole step as one CUDA graph, captured once and replayed every step.

A whole train step is what a CUDA graph wants: one launch from Python replays forward, backward, clipping, the
optimizer and a GradScaler's skip, where the fx executor calls each of several hundred ops from Python.  The
finished graph's :class:`~spmd_ort.passes.analysis.CapturePlan` (``plan_graph_capture_pass``) says whether one
graph can hold the step; :func:`graphed` wraps the executor the backend built (fx or inductor: their kernels run
on torch's current stream) in a :class:`GraphedExecutor`, which

* runs the checked first run and one steady run as the executor always does (the second lets lazily made
  things, cuBLAS workspaces and inductor's autotuning, exist before a capture);
* then captures one run of the executor in a ``torch.cuda.CUDAGraph`` (its own memory pool) and replays it:

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
  - a graph of symbolic sizes is captured once per size seen, the last :data:`MAX_SIZES` kept (LRU);

* and returns the graph's output buffers (``reuses_buffers``): the program copies what escapes the step.

A capture that fails (something in the step that a graph cannot hold and the plan did not foresee) is logged
as a WARNING with its cause, and the program runs as it did without graphs from then on; so does one whose
plan says no graph can hold it (``explain()`` names the op and why).  A profiled step runs uncaptured (its
timeline is per op).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spmd_ort.graph import ops
from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.options import get_logger
from spmd_ort.runtime.step_runtime import current

logger = get_logger(__name__)

MAX_SIZES = 8  # graphs kept per program with symbolic sizes (one per size seen; the least recently used goes)
WARMUP_RUNS = 2  # runs before the first capture: the checked first run and one steady run


class CudaGraph:
    """One ``torch.cuda.CUDAGraph`` with its own memory pool: ``capture(fn, reads)`` records ``fn()`` (returning
    its value, the graph's output buffers; ``reads``: the tensors it reads, which a graph keeps by address),
    ``replay()`` runs it."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], list], reads: list) -> list:
        with torch.cuda.graph(self.graph):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class Captured:
    """One capture: the graph, the inputs it reads (its own buffers for the batch, the state tensors
    themselves), its outputs, and the host-side values it froze."""

    graph: object
    static: list
    outputs: list
    numbers: dict[int, tuple]  # hyper-parameters (by input position) the kernels took as numbers: all but lr
    replays: int = 0


class GraphedExecutor:
    """Runs an executor's program as CUDA graphs (see the module docstring); ``disabled``: why it does not (the
    plan, the device, a failed capture): then every run is the wrapped executor's."""

    def __init__(self, inner, input_slots: list[Slot], *, disabled: str | None = None,
                 graph_factory: Callable[[], object] = CudaGraph, max_sizes: int = MAX_SIZES):
        self.inner = inner
        self.gm = inner.gm
        self.disabled = disabled
        self.graph_factory = graph_factory
        self.max_sizes = max_sizes
        # the call's own values: copied into the graph's buffers before each replay
        self.copied = {i for i, s in enumerate(input_slots) if s.kind in (SlotKind.BATCH, SlotKind.INPUT_GRAD)}
        self.hparams = [i for i, s in enumerate(input_slots) if s.kind is SlotKind.HPARAM]
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.runs = self.captures = self.replays = 0
        self.recaptured: dict[str, int] = {}  # why a graph was dropped and captured again -> how often
        self._static_out = False

    # what the tuner and describe() read of the executor: the wrapped one's
    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def reuses_buffers(self) -> bool:
        """Whether the last run's outputs are a graph's buffers (the next replay overwrites them)."""
        return self._static_out or self.inner.reuses_buffers

    def run(self, inputs: list) -> list:
        self.runs += 1
        runtime = current()
        if self.disabled is not None or self.runs <= WARMUP_RUNS or (
                runtime is not None and runtime.recorder is not None):
            self._static_out = False
            return self.inner.run(inputs)
        key = self._key(inputs)
        captured = self.graphs.get(key)
        if captured is not None:
            why = self._stale(captured, inputs)
            if why is not None:
                self.recaptured[why] = self.recaptured.get(why, 0) + 1
                logger.info("CUDA graph: captured again: %s", why)
                del self.graphs[key]
                captured = None
        if captured is None:
            try:
                captured = self._capture(inputs)
            except Exception as exc:  # noqa: BLE001 - any failure to capture runs the step uncaptured
                self.disabled = f"capture failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                self.graphs.clear()
                logger.warning("CUDA graph: %s; the step runs without graphs from now on", self.disabled)
                self._static_out = False
                return self.inner.run(inputs)
            self.graphs[key] = captured
            while len(self.graphs) > self.max_sizes:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        for i in self.copied:
            src, dst = inputs[i], captured.static[i]
            if isinstance(src, torch.Tensor) and src.data_ptr() != dst.data_ptr():
                dst.copy_(src, non_blocking=True)
        captured.graph.replay()
        captured.replays += 1
        self.replays += 1
        self._static_out = True
        return captured.outputs

    def _key(self, inputs: list) -> tuple:
        """What one graph is for: the sizes of the tensors copied in, and any number the program takes (a
        symbolic size lifted to an input)."""
        return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else
                     (None if x is None else ("value", x)) for i, x in enumerate(inputs)
                     if i in self.copied or not isinstance(x, torch.Tensor))

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
            if i in self.copied or not isinstance(now, torch.Tensor):
                continue
            if not isinstance(then, torch.Tensor) or now.data_ptr() != then.data_ptr():
                return f"input {i} is another tensor than the one captured (state replaced, e.g. by load_state_dict)"
        numbers = self._numbers(inputs)
        if numbers != captured.numbers:
            return "a hyper-parameter other than the learning rate changed (they are numbers in the captured kernels)"
        return None

    def _capture(self, inputs: list) -> Captured:
        static = [x.clone() if i in self.copied and isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs)]
        graph = self.graph_factory()
        outputs = graph.capture(lambda: list(self.inner.run(static)), static)
        self.captures += 1
        return Captured(graph, static, outputs, self._numbers(inputs))

    def describe(self) -> list[str]:
        return list(self.inner.describe()) + self.graph_lines()

    def graph_lines(self) -> list[str]:
        """What ``compile(cuda_graph=True)`` did, for ``describe()`` and ``explain()``."""
        if self.disabled is not None:
            return [f"CUDA graphs: not used: {self.disabled}"]
        head = (f"CUDA graphs: the whole step, {len(self.graphs)} kept "
                f"({self.captures} captures, {self.replays} replays in {self.runs} runs; the first "
                f"{WARMUP_RUNS} run uncaptured)")
        return [head] + [f"  captured again {n}x: {why}" for why, n in self.recaptured.items()]


def graphed(executor, plan, input_slots: list[Slot], backend: str):
    """``executor`` as a :class:`GraphedExecutor` for a step compiled with ``cuda_graph=True``: capturing where
    ``plan`` (the step's CapturePlan) says one graph holds it, else passing every run through, saying why.
    A step with collectives is not captured: their bookkeeping (overlap, figures, a gather carried into the next
    step) runs in Python around each one, which a replay would skip."""
    reason = None
    collective = next((n for n in executor.gm.graph.nodes if n.op == "call_function" and (
        n.target in ops.COLLECTIVES or getattr(n.target, "namespace", None) == "_c10d_functional")), None)
    if plan is None or not plan.cuda:
        reason = "the step runs on the CPU: there is nothing to capture"
    elif collective is not None:
        reason = (f"{collective.name} ({collective.target}) is a collective; capturing collectives across ranks "
                  "is not built yet")
    elif backend not in ("fx", "inductor"):
        reason = (f"the {backend} backend runs its own kernels outside torch's stream; CUDA graphs capture the fx "
                  "and inductor backends")
    elif plan.blocker is not None:
        reason = plan.blocker
    elif len(plan.regions) != 1 or plan.splits:
        name, why = plan.splits[0] if plan.splits else ("", "no op to capture")
        reason = (f"the step does not fit one graph: {name}: {why}" +
                  (f" (and {len(plan.splits) - 1} more; see the capture plan)" if len(plan.splits) > 1 else ""))
    if reason is not None and plan is not None and plan.cuda:
        logger.warning("CUDA graph: not used: %s", reason)
    return GraphedExecutor(executor, input_slots, disabled=reason)
