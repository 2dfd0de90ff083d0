"""Per-step activation statistics, on an eager model and on one trained by a compiled step (ORTModule's names).

    from spmd_ort.debug import GlobalSubscriberManager, StatisticsSubscriber, inspect_activation
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])

Every step (a forward of the root module in eager; a call of the compiled step)
writes ``<output_dir>/step_<S>/<order>_<name>.txt`` for each submodule output
(``name`` = the module FQN; tuple/dict outputs get ``.0``, ``.key`` suffixes)
and each ``inspect_activation(name, tensor)``, with shape, dtype and the
statistics of :data:`spmd_ort.runtime.taps.STATS`.  Under ``torchrun`` each rank writes
``<output_dir>/rank<r>`` (no race between ranks).  Eagerly the statistics are
computed in the hook; in a compiled step the hooks run while the step is traced
and tap the activations, and ``insert_activation_stats_pass`` computes the
statistics inside the graph; files are written by a background thread, off the
step's critical path.  Compare two runs with ``python -m spmd_ort.debug.compare``.
"""

from __future__ import annotations

import contextvars
import queue
import shutil
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from spmd_ort.graph import ops
from spmd_ort.runtime import taps
from spmd_ort.capture.trace import is_tracing

_CURRENT: contextvars.ContextVar[tuple] = contextvars.ContextVar("spmd_ort_debug_subscribers", default=())


class _Writer:
    """A subscriber's background thread: writes its statistics files in the order they were queued."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, path: Path, text: str) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="spmd_ort-stats-writer", daemon=True)
                self._thread.start()
        self._queue.put((path, text))

    def _run(self) -> None:
        while True:
            path, text = self._queue.get()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()


def format_stats(name: str, shape, dtype, values: torch.Tensor) -> str:
    lines = [f"name: {name}", f"shape: {tuple(shape)}", f"dtype: {dtype}"]
    for key, v in zip(taps.STATS, values.tolist()):
        lines.append(f"{key}: {int(v) if key in ('nan', 'inf', 'zero') else repr(float(v))}")
    return "\n".join(lines) + "\n"


class StatisticsSubscriber:
    """Writes the statistics of every watched activation, per step, into ``output_dir``.

    ``start_step`` / ``end_step`` (exclusive): the steps to record (default all).
    ``override_output_dir``: replace an existing ``output_dir`` (else it is an error).
    ``run_on_cpu``: compute eager statistics on a host copy (to spare device memory; on a
    CPU-only machine nothing changes).  ``bucket_size``: eager statistics of a tensor are
    computed in chunks of at most this many elements (bounds their temporaries; compiled
    statistics are planned in the graph).
    """

    def __init__(self, output_dir: str | Path, start_step: int | None = None, end_step: int | None = None,
                 override_output_dir: bool = False, run_on_cpu: bool = False, bucket_size: int | None = None):
        self.base_dir = Path(output_dir)
        self.start_step = start_step
        self.end_step = end_step
        self.override_output_dir = override_output_dir
        self.run_on_cpu = run_on_cpu
        self.bucket_size = bucket_size
        self.step = 0
        self._order = 0
        self._prepared = False
        self.output_dir = self.base_dir
        self.subscriptions = 0  # models it watches (GlobalSubscriberManager.subscribe)
        self._writer = _Writer()

    @property
    def subscribed(self) -> bool:
        """Whether it still watches a model (a compiled step's taps deliver only while it does)."""
        return self.subscriptions > 0

    # ------------------------------------------------------------------ output
    def _prepare(self) -> None:
        if self._prepared:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.output_dir = self.base_dir / f"rank{dist.get_rank()}"
        if self.output_dir.exists() and any(self.output_dir.iterdir()):
            if not self.override_output_dir:
                raise FileExistsError(f"StatisticsSubscriber: {self.output_dir} already exists and is not empty; "
                                      "pass override_output_dir=True or choose another output_dir")
            shutil.rmtree(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._prepared = True

    def recording(self) -> bool:
        return (self.start_step is None or self.step >= self.start_step) and \
            (self.end_step is None or self.step < self.end_step)

    def record(self, name: str, stats: torch.Tensor, shape, dtype) -> None:
        """One activation's statistics for the current step (queued for the writer)."""
        if not self.recording():
            return
        self._prepare()
        path = self.output_dir / f"step_{self.step}" / f"{self._order:05d}_{name}.txt"
        self._order += 1
        self._writer.put(path, format_stats(name, shape, dtype, stats.detach().cpu()))

    def finish_step(self) -> None:
        self.step += 1
        self._order = 0

    def flush(self) -> None:
        """Wait until every statistics file it queued is written."""
        self._writer.flush()

    # ------------------------------------------------------------------ eager
    def stats_of(self, x: torch.Tensor) -> torch.Tensor:
        if self.run_on_cpu:
            x = x.detach().to("cpu")
        if self.bucket_size is None or x.numel() <= self.bucket_size:
            return taps.tensor_stats(x)
        return _bucketed_stats(x, self.bucket_size)


def _bucketed_stats(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """``taps.STATS`` over chunks of ``bucket`` elements (sum-based mean/std/norm, exact extrema and counts)."""
    flat = x.detach().reshape(-1)
    parts = [taps.tensor_stats(flat[i:i + bucket]) for i in range(0, flat.numel(), bucket)]
    n = flat.numel()
    sums = sum(float(flat[i:i + bucket].double().sum()) for i in range(0, n, bucket))
    mean = sums / n
    sq = sum(float(((flat[i:i + bucket].double() - mean) ** 2).sum()) for i in range(0, n, bucket))
    norm = sum(float(p[4]) ** 2 for p in parts) ** 0.5
    std = (sq / (n - 1)) ** 0.5 if n > 1 else float("nan")
    return torch.tensor([min(float(p[0]) for p in parts), max(float(p[1]) for p in parts), mean, std, norm,
                         sum(float(p[5]) for p in parts), sum(float(p[6]) for p in parts),
                         sum(float(p[7]) for p in parts)], dtype=torch.float64)


class _Subscription:
    """The hooks of one subscriber on one model."""

    def __init__(self, model: nn.Module, subscriber: StatisticsSubscriber):
        self.subscriber = subscriber
        subscriber.subscriptions += 1
        self.handles = []
        for fqn, module in model.named_modules():
            if module is model:
                continue
            self.handles.append(module.register_forward_hook(self._hook(fqn)))
        self.handles.append(model.register_forward_pre_hook(self._root_pre))
        self.handles.append(model.register_forward_hook(self._root_post, always_call=True))
        self._in_eager_step = False
        self._tokens: list = []

    def _root_pre(self, module, args):
        if not is_tracing():  # a compiled step counts its own steps (spmd_ort.runtime.taps.deliver)
            if self._in_eager_step:  # a new forward of the root: the previous step is complete
                self.subscriber.finish_step()
            self._in_eager_step = True
        self._tokens.append(_CURRENT.set(_CURRENT.get() + (self.subscriber,)))

    def _root_post(self, module, args, out):
        if self._tokens:
            _CURRENT.reset(self._tokens.pop())
        return None

    def _hook(self, fqn: str):
        def hook(module, args, out):
            return watch(fqn, out, (self.subscriber,))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.subscriber.subscriptions -= 1


def watch(name: str, value, subscribers) -> object:
    """Record (eager) or tap (while tracing) every tensor in ``value`` for ``subscribers``; returns ``value``
    with tapped tensors in place of the originals when tracing."""
    leaves, spec = pytree.tree_flatten(value)
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.numel() > 0]
    if not tensors or not subscribers:
        return value
    out = list(leaves)
    for i in tensors:
        leaf_name = name if len(leaves) == 1 else f"{name}.{i}"
        for sub in subscribers:
            if is_tracing():
                tap_id = taps.current().register(sub, leaf_name, _sink(sub, tuple(leaves[i].shape), leaves[i].dtype))
                out[i] = ops.tap(out[i], tap_id)
            else:
                sub.record(leaf_name, sub.stats_of(leaves[i]), leaves[i].shape, leaves[i].dtype)
    return pytree.tree_unflatten(out, spec) if is_tracing() else value


def _sink(sub: StatisticsSubscriber, shape, dtype):
    ref = weakref.ref(sub)

    def sink(name: str, stats: torch.Tensor) -> None:
        s = ref()
        if s is not None:
            s.record(name, stats, shape, dtype)

    return sink


class GlobalSubscriberManager:
    """Attaches subscribers to models (ORTModule's entry point).

    Subscriptions are kept per model (weakly: they go with the model); each subscriber
    writes through its own thread, and a compiled step keeps its taps in its own
    registry, so two steps (or two models) never see each other's statistics.
    """

    _subscriptions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [_Subscription]

    @classmethod
    def subscribe(cls, model: nn.Module, subscribers: list[StatisticsSubscriber]) -> None:
        """Watch every submodule output of ``model`` with each subscriber (works before or after compiling)."""
        for sub in subscribers:
            cls._subscriptions.setdefault(model, []).append(_Subscription(model, sub))

    @classmethod
    def unsubscribe(cls, model: nn.Module) -> None:
        for s in cls._subscriptions.pop(model, []):
            s.remove()

    @classmethod
    def flush(cls, model: nn.Module | None = None) -> None:
        """Wait until the statistics files queued by ``model``'s subscribers (default: every model's) are written."""
        models = [model] if model is not None else list(cls._subscriptions.keys())
        for m in models:
            for s in cls._subscriptions.get(m, []):
                s.subscriber.flush()


def inspect_activation(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Record any intermediate tensor under ``name`` for the subscribers of the model running now.

    Use the returned tensor in place of ``tensor`` (in a compiled step it carries the tap).
    """
    return watch(name, tensor, _CURRENT.get())
