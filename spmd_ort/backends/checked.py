"""The checked first run every compiling backend shares (ORT's segments, inductor's): a segment's compiled code
runs once next to its fx graph, its outputs compared, and what failed falls back to fx or raises, per
``Options.fallback_policy``, on every rank alike.

* :func:`checked_run`: one segment's compiled run next to its fx result (the seconds, or None where it failed to
  run or, with verification on, differed beyond the segment's tolerance: recorded in its :class:`CheckStats`);
* :func:`agree_segment`: every rank's outcome for that segment (an error anywhere stops every rank after the
  agreement; a failure anywhere sends the segment to fx on every rank, so replicas compute alike), with the
  ranks' mean times where the backend chooses from them;
* :func:`segment_failure`: the fallback policy's verdict, in words that name the segment and its ops.

Downstream of a checked segment always reads the fx result: the first run's outputs are fx's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmd_ort.errors import CompileError
from spmd_ort.graph.checking import op_summary, output_mismatch, short_error
from spmd_ort.options import get_logger
from spmd_ort.runtime.collectives import control_group
from spmd_ort.runtime.devices import now

logger = get_logger(__name__)


@dataclass
class CheckStats:
    """What a backend's checked first runs found: the segments that fell back to fx (and why), how many were
    verified, which differed, which differed no more than fx does from float64 (ill-conditioned: accepted)."""

    fallbacks: list = field(default_factory=list)  # segments (or "<segment> at sizes ...") that fell back to fx
    fallback_reasons: dict = field(default_factory=dict)  # each of them -> what failed
    verified: int = 0
    mismatches: list = field(default_factory=list)
    ill_conditioned: list = field(default_factory=list)  # mismatches within rounding of float64: not faults
    verify_seconds: float = 0.0  # comparing outputs

    def fell_back(self, segment: str, why: str) -> None:
        """Record that ``segment`` runs on fx because ``why`` (an export, compile, run or verification failure)."""
        self.fallbacks.append(segment)
        self.fallback_reasons[segment] = why


def segment_failure(kind: str, segment: str, what: str, policy: str, ops: str = "") -> None:
    """``kind`` segment ``segment`` failed (``what``): a CompileError under ``FALLBACK_DISABLE``, else a WARNING
    that it runs on fx."""
    where = f"{kind} segment `{segment}`{f' ({ops})' if ops else ''}"
    if policy == "FALLBACK_DISABLE":
        raise CompileError(f"{where}: {what}. SPMD_ORT_FALLBACK_POLICY=FALLBACK_DISABLE, so this is an error; "
                           "unset it to run such segments on the fx executor", op=ops or None)
    logger.warning("%s: %s; it runs on the fx executor instead (SPMD_ORT_FALLBACK_POLICY=FALLBACK_TO_FX)",
                   where, what)


def checked_run(kind: str, name: str, run, fallback, inputs, reference, *, tolerance, unordered,
                stats: CheckStats, policy: str, verify: bool) -> float | None:
    """``run(*inputs)`` (the segment's compiled code) once, next to its fx result ``reference`` (of ``fallback``).

    Returns its seconds, or None when it fails to run or (``verify``) differs beyond ``tolerance`` (recorded in
    ``stats``; an error under ``FALLBACK_DISABLE``)."""
    t0 = now()
    try:
        got = run(*inputs)
    except Exception as exc:  # noqa: BLE001 - any failure falls back per policy
        what = f"{'ONNX Runtime' if kind == 'ORT' else 'its compiled code'} failed to run it: {short_error(exc)}"
        segment_failure(kind, name, what, policy, op_summary(fallback))
        stats.fell_back(name, what)
        return None
    seconds = now() - t0
    if verify:
        t0 = time.perf_counter()
        diff, forgiven = output_mismatch(fallback, inputs, got, reference, tolerance, unordered,
                                         label=kind.lower())
        if forgiven is not None:
            logger.info("%s segment %s differs from its fx graph (%s), but no more than the fx graph itself "
                        "differs from float64: an ill-conditioned computation, not a fault", kind, name, forgiven)
            stats.ill_conditioned.append(name)
        stats.verify_seconds += time.perf_counter() - t0
        stats.verified += 1
        if diff is not None:
            stats.mismatches.append(f"{name}: {diff}")
            segment_failure(kind, name, f"verification failed: {diff}", policy, op_summary(fallback))
            stats.fell_back(name, f"verification failed: {diff}")
            return None
    return seconds


def agree_segment(kind: str, name: str, times: dict[str, float | None], error: Exception | None,
                  failed: str = "compiled", local: bool = False) -> tuple[dict[str, float], bool]:
    """Every rank's outcome for segment ``name``: (the ranks' mean ``times``, whether its compiled run (the
    ``failed`` entry of ``times``: None where it failed) failed on another rank).  ``error`` (this rank's, e.g. a
    FALLBACK_DISABLE error) is re-raised after the agreement, and a rank whose peer raised raises too: nobody waits
    for a failed rank.  ``local``: the ranks' graphs differ (pipeline stages: no segment is another rank's), so
    each rank decides alone, and its caller agrees on the errors once the run is over."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1 or local:
        if error is not None:
            raise error
        return {k: v for k, v in times.items() if v is not None}, False
    mine = times.get(failed) is None or error is not None
    keys = list(times)
    t = torch.tensor([0.0 if times[k] is None or (k == failed and mine) else float(times[k]) for k in keys]
                     + [float(mine), float(error is not None)], dtype=torch.float64)
    dist.all_reduce(t, group=control_group())
    if error is not None:
        raise error
    if t[-1] > 0:
        raise CompileError(f"{kind} segment {name} failed on another rank (see its error); every rank stops",
                           rank=dist.get_rank())
    return {k: float(t[i]) / world for i, k in enumerate(keys)}, bool(t[-2] > 0)
