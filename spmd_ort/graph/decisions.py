"""A choice made from measurements, as the code that measured it reports it upward.

Backends measure (the ORT executor times each segment on ORT and fx, and the whole graph against its
segments) and report each choice as a :class:`Decision`; :class:`spmd_ort.tuner.Tuner`, above them,
collects them from the program with its own (the inductor candidate, the bucket cap, the recompiles
they cause), and ``explain()`` lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """``subject`` (``"segment fused_3"``, ``"whole graph"``, ``"inductor candidate"``, ``"bucket cap"``,
    ``"recompile"``) runs on / chose ``choice`` because of ``why`` (the measurement behind it)."""

    subject: str
    choice: str
    why: str = ""

    def __str__(self) -> str:
        return f"{self.subject}: {self.choice}" + (f" ({self.why})" if self.why else "")
