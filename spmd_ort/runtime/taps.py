"""Activation taps: what connects a debug subscriber to the compiled graph.

A subscriber (:mod:`spmd_ort.debug`) registers a *sink* once per activation it
watches, in the registry of the step being traced, and gets an integer tap id.
While the step is traced, its hooks put ``spmd_ort::tap(x, tap_id)`` on the
activation; ``insert_activation_stats_pass`` turns each tap into the statistics
of ``x`` computed in the graph, returned as an extra output
(a ``stats`` slot named for the tap); after each run the compiled program hands
them to the sinks (:meth:`TapRegistry.deliver`), and the sinks write them off
the critical path.  The registry (:class:`TapRegistry`) belongs to the compiled
step whose graphs hold the ids, so steps never see each other's taps.

The statistics (:data:`STATS`) of a tensor ``x`` (as float32; float64 stays
float64) are ``min, max, mean, std, norm, nan, inf, zero`` (counts of NaN,
infinite and zero elements).  :func:`tensor_stats` computes them eagerly with
the same aten ops the graph uses, so a faithful fx run reproduces eager's bit
for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

STATS = ("min", "max", "mean", "std", "norm", "nan", "inf", "zero")


@dataclass(frozen=True)
class Tap:
    tap_id: int
    name: str
    owner: object  # whose sink it is (a subscriber); ``owner.subscribed`` False: it gets nothing more
    sink: Callable[[str, torch.Tensor], None]


class TapRegistry:
    """The taps of one compiled step: tap ids in its graphs -> the subscriber sinks they feed.

    Owned by the step's :class:`~spmd_ort.runtime.step_runtime.StepRuntime`, so two compiled steps in
    one process never see each other's taps; ids count from 0 per step.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._taps: dict[int, Tap] = {}
        self._by_key: dict[tuple[int, str], int] = {}

    def register(self, owner: object, name: str, sink: Callable[[str, torch.Tensor], None]) -> int:
        """The tap id for ``owner``'s activation ``name`` (the same id every time it is asked for)."""
        with self._lock:
            key = (id(owner), name)
            tap_id = self._by_key.get(key)
            if tap_id is None or self._taps[tap_id].owner is not owner:
                tap_id = next(self._ids)
                self._taps[tap_id] = Tap(tap_id, name, owner, sink)
                self._by_key[key] = tap_id
            return tap_id

    def known(self, tap_id: int) -> bool:
        """Whether ``tap_id`` is one of this step's and its subscriber is still subscribed."""
        tap = self._taps.get(tap_id)
        return tap is not None and getattr(tap.owner, "subscribed", True)

    def name_of(self, tap_id: int) -> str:
        return self._taps[tap_id].name

    def deliver(self, stats: list[tuple[int, torch.Tensor]]) -> None:
        """One step's statistics, in graph order, to their sinks (subscribers removed since get nothing)."""
        by_owner: dict[int, list] = {}
        for tap_id, value in stats:
            if self.known(tap_id):
                tap = self._taps[tap_id]
                by_owner.setdefault(id(tap.owner), []).append((tap, value))
        for entries in by_owner.values():
            owner = entries[0][0].owner
            for tap, value in entries:
                tap.sink(tap.name, value)
            end = getattr(owner, "finish_step", None)
            if end is not None:
                end()


_COLLECTING: contextvars.ContextVar[TapRegistry | None] = contextvars.ContextVar("spmd_ort_taps", default=None)


@contextlib.contextmanager
def collecting(registry: TapRegistry) -> Iterator[TapRegistry]:
    """Taps made while the block runs (a trace) are registered in ``registry``."""
    token = _COLLECTING.set(registry)
    try:
        yield registry
    finally:
        _COLLECTING.reset(token)


def current() -> TapRegistry:
    """The registry of the step being traced (a throw-away one outside a trace)."""
    registry = _COLLECTING.get()
    return registry if registry is not None else TapRegistry()


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)


def tensor_stats(x: torch.Tensor) -> torch.Tensor:
    """``STATS`` of ``x`` as a float64 vector, by the same ops the compiled graph uses."""
    aten = torch.ops.aten
    xf = _float(x.detach())
    parts = [aten.min.default(xf), aten.max.default(xf), aten.mean.default(xf),
             aten.std.correction(xf, correction=1), aten.linalg_vector_norm.default(xf),
             aten.sum.default(aten.isnan.default(xf)), aten.sum.default(aten.isinf.default(xf)),
             aten.sum.default(aten.eq.Scalar(xf, 0))]
    return aten.stack.default([aten._to_copy.default(p, dtype=torch.float64) for p in parts])
