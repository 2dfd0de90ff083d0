"""Activation taps: what connects a debug subscriber to the compiled graph.

A subscriber (:mod:`spmd_ort.debug`) registers a *sink* once per activation it
watches and gets an integer tap id.  While the step is traced, its hooks put
``spmd_ort::tap(x, tap_id)`` on the activation; ``insert_activation_stats_pass``
turns each tap into the statistics of ``x`` computed in the graph, returned as
an extra output (``Slot("stats", name, tap_id)``); after each run the compiled
program hands them to the sinks with :func:`deliver`, and the sinks write them
off the critical path.  The registry maps ids in graphs to the user's
subscriber objects, which is why it lives for the process (as the objects do).

The statistics (:data:`STATS`) of a tensor ``x`` (as float32; float64 stays
float64) are ``min, max, mean, std, norm, nan, inf, zero`` (counts of NaN,
infinite and zero elements).  :func:`tensor_stats` computes them eagerly with
the same aten ops the graph uses, so a faithful fx run reproduces eager's bit
for bit.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

STATS = ("min", "max", "mean", "std", "norm", "nan", "inf", "zero")


@dataclass(frozen=True)
class Tap:
    tap_id: int
    name: str
    owner: object  # whose sink it is (a subscriber)
    sink: Callable[[str, torch.Tensor], None]


_lock = threading.Lock()
_ids = itertools.count()
_taps: dict[int, Tap] = {}
_by_key: dict[tuple[int, str], int] = {}


def register(owner: object, name: str, sink: Callable[[str, torch.Tensor], None]) -> int:
    """The tap id for ``owner``'s activation ``name`` (the same id every time it is asked for)."""
    with _lock:
        key = (id(owner), name)
        if key not in _by_key:
            tap_id = next(_ids)
            _taps[tap_id] = Tap(tap_id, name, owner, sink)
            _by_key[key] = tap_id
        return _by_key[key]


def unregister(owner: object) -> None:
    with _lock:
        for key in [k for k in _by_key if k[0] == id(owner)]:
            _taps.pop(_by_key.pop(key), None)


def known(tap_id: int) -> bool:
    return tap_id in _taps


def name_of(tap_id: int) -> str:
    return _taps[tap_id].name


def deliver(stats: list[tuple[int, torch.Tensor]]) -> None:
    """One step's statistics, in graph order, to their sinks (taps unregistered since are skipped)."""
    by_owner: dict[int, list] = {}
    for tap_id, value in stats:
        tap = _taps.get(tap_id)
        if tap is not None:
            by_owner.setdefault(id(tap.owner), []).append((tap, value))
    for entries in by_owner.values():
        owner = entries[0][0].owner
        for tap, value in entries:
            tap.sink(tap.name, value)
        end = getattr(owner, "finish_step", None)
        if end is not None:
            end()


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
