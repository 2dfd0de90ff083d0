"""The checked first run of an ORT segment: its outputs compared with its fx graph's.

:func:`checked_first_run` runs a segment in ONNX Runtime next to the fx result and, with verification on,
compares them (:func:`spmd_ort.graph.checking.output_mismatch`).  A failure falls back to fx or raises, per
``Options.fallback_policy`` (:func:`segment_failure`).
"""

from __future__ import annotations

import time

from spmd_ort.backends.ort.stats import OrtStats
from spmd_ort.errors import CompileError
from spmd_ort.graph.checking import op_summary, output_mismatch, short_error
from spmd_ort.runtime.devices import now
from spmd_ort.options import get_logger

logger = get_logger(__name__)


def segment_failure(segment: str, what: str, policy: str, ops: str = "") -> None:
    where = f"ORT segment `{segment}`{f' ({ops})' if ops else ''}"
    if policy == "FALLBACK_DISABLE":
        raise CompileError(f"{where}: {what}. SPMD_ORT_FALLBACK_POLICY=FALLBACK_DISABLE, so this is an error; "
                           "unset it to run such segments on the fx executor", op=ops or None)
    logger.warning("%s: %s; it runs on the fx executor instead (SPMD_ORT_FALLBACK_POLICY=FALLBACK_TO_FX)",
                   where, what)


def checked_first_run(name: str, seg, inputs, reference, stats: OrtStats, policy: str,
                       verify: bool) -> float | None:
    """Run ``seg`` (an :class:`~spmd_ort.backends.ort.session.OrtSegment`) in ORT once on ``inputs``, next to its fx
    result ``reference``.

    Returns the ORT seconds, or None when ORT fails or (``verify``) differs beyond the segment's
    tolerance (recorded in ``stats``; an error under ``FALLBACK_DISABLE``).
    """
    t0 = now()
    try:
        got = seg.run_ort(*inputs)
    except Exception as exc:  # noqa: BLE001 - any ORT failure falls back per policy
        what = f"ONNX Runtime failed to run it: {short_error(exc)}"
        segment_failure(name, what, policy, op_summary(seg.fallback))
        stats.fell_back(name, what)
        return None
    ort_s = now() - t0
    if verify:
        t0 = time.perf_counter()
        diff, forgiven = output_mismatch(seg.fallback, inputs, got, reference, seg.tolerance, seg.unordered)
        if forgiven is not None:
            logger.info("ORT segment %s differs from its fx graph (%s), but no more than the fx graph itself "
                        "differs from float64: an ill-conditioned computation, not a fault", name, forgiven)
            stats.ill_conditioned.append(name)
        stats.verify_seconds += time.perf_counter() - t0
        stats.verified += 1
        if diff is not None:
            stats.mismatches.append(f"{name}: {diff}")
            segment_failure(name, f"verification failed: {diff}", policy, op_summary(seg.fallback))
            stats.fell_back(name, f"verification failed: {diff}")
            return None
    return ort_s
