"""The checked first run of an ORT segment: the one every compiling backend shares
(:mod:`spmd_ort.backends.checked`), on ONNX Runtime's session."""

from __future__ import annotations


from spmd_ort.backends import checked
from spmd_ort.backends.ort.stats import OrtStats


def segment_failure(segment: str, what: str, policy: str, ops: str = "") -> None:
    checked.segment_failure("ORT", segment, what, policy, ops)


def checked_first_run(name: str, seg, inputs, reference, stats: OrtStats, policy: str,
                       verify: bool) -> float | None:
    """Run ``seg`` (an :class:`~spmd_ort.backends.ort.session.OrtSegment`) in ORT once on ``inputs``, next to its fx
    result ``reference`` (:func:`spmd_ort.backends.checked.checked_run`): the ORT seconds, or None when ORT fails
    or (``verify``) differs beyond the segment's tolerance."""
    return checked.checked_run("ORT", name, seg.run_ort, seg.fallback, inputs, reference, tolerance=seg.tolerance,
                               unordered=seg.unordered, stats=stats, policy=policy, verify=verify)
