"""Read two runs' activation statistics, find where they first diverge, write them side by side."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from spmd_ort.runtime.taps import STATS

# Measured on an MLP over 6 AdamW steps: eager vs ORT (kernels that round differently) keep every
# statistic within 2.2e-7 of the activation's magnitude; exact vs tanh GELU differ by 3.4e-5 at
# step 0 already (2.2e-4 later).  1e-5 sits between them (tests/test_debug.py checks both).
DEFAULT_RTOL = 1e-5
COUNTS = ("nan", "inf", "zero")
ZERO_COUNT_RTOL = 1e-3  # exact zeros (ReLU, masks) may flip where a value is ~0: a share of the elements


@dataclass(frozen=True)
class Activation:
    order: int
    name: str
    shape: str
    dtype: str
    stats: dict[str, float]

    @property
    def magnitude(self) -> float:
        return max(abs(self.stats["min"]), abs(self.stats["max"]))

    @property
    def numel(self) -> int:
        return math.prod(int(d) for d in re.findall(r"\d+", self.shape)) if self.shape != "()" else 1


Run = dict[int, list[Activation]]  # step -> activations in execution order


def load_run(directory: str | Path) -> Run:
    """``{step: [Activation, ...]}`` from a StatisticsSubscriber's ``output_dir`` (or its ``rank<r>``)."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory of activation statistics")
    run: Run = {}
    for step_dir in root.glob("step_*"):
        step = int(step_dir.name.split("_", 1)[1])
        acts = []
        for f in sorted(step_dir.glob("*.txt")):
            fields = dict(line.split(": ", 1) for line in f.read_text().splitlines() if ": " in line)
            acts.append(Activation(int(f.name.split("_", 1)[0]), fields["name"], fields["shape"], fields["dtype"],
                                   {k: float(fields[k]) for k in STATS}))
        run[step] = sorted(acts, key=lambda a: a.order)
    if not run:
        raise FileNotFoundError(f"{root} holds no step_<S> directories of activation statistics")
    return run


@dataclass(frozen=True)
class Divergence:
    step: int
    name: str
    statistic: str
    a: object
    b: object

    def __str__(self) -> str:
        return f"first divergence: step {self.step}, {self.name}, {self.statistic}: {self.a} vs {self.b}"


def _diverges(stat: str, a: Activation, b: Activation, rtol: float) -> bool:
    x, y = a.stats[stat], b.stats[stat]
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) != math.isnan(y)
    if stat in ("nan", "inf"):
        return x != y
    if stat == "zero":
        return abs(x - y) > max(1.0, ZERO_COUNT_RTOL * a.numel)
    scale = max(abs(x), abs(y)) if stat == "norm" else max(a.magnitude, b.magnitude)
    return abs(x - y) > rtol * scale


def first_divergence(a: Run, b: Run, rtol: float = DEFAULT_RTOL) -> Divergence | None:
    """The first statistic, in step order and then run ``a``'s execution order, where the runs differ."""
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            return Divergence(step, "<step>", "present", step in a, step in b)
        theirs = {act.name: act for act in b[step]}
        for act in a[step]:
            other = theirs.get(act.name)
            if other is None:
                return Divergence(step, act.name, "present", True, False)
            for field in ("shape", "dtype"):
                if getattr(act, field) != getattr(other, field):
                    return Divergence(step, act.name, field, getattr(act, field), getattr(other, field))
            for stat in STATS:
                if _diverges(stat, act, other, rtol):
                    return Divergence(step, act.name, stat, act.stats[stat], other.stats[stat])
        missing = [n for n in theirs if n not in {x.name for x in a[step]}]
        if missing:
            return Divergence(step, missing[0], "present", False, True)
    return None


def count(run: Run) -> tuple[int, int]:
    """(steps, activations per step at most)."""
    return len(run), max((len(v) for v in run.values()), default=0)


def merge(a_dir: str | Path, b_dir: str | Path, out_dir: str | Path, labels: tuple[str, str] = ("pt", "ort")) -> int:
    """Write ``out_dir/step_<S>/<order>_<name>.txt`` with both runs' statistics side by side; returns files written."""
    a, b = load_run(a_dir), load_run(b_dir)
    out = Path(out_dir)
    written = 0
    for step in sorted(set(a) & set(b)):
        theirs = {act.name: act for act in b[step]}
        for act in a[step]:
            other = theirs.get(act.name)
            lines = [f"name: {act.name}", f"{'':8s} {labels[0]:>24s} {labels[1]:>24s} {'|diff|':>12s}"]
            lines.append(f"{'shape':8s} {act.shape:>24s} {other.shape if other else '-':>24s}")
            lines.append(f"{'dtype':8s} {act.dtype:>24s} {other.dtype if other else '-':>24s}")
            for stat in STATS:
                x = act.stats[stat]
                y = other.stats[stat] if other else float("nan")
                lines.append(f"{stat:8s} {x:>24.17g} {y:>24.17g} {abs(x - y):>12.3g}")
            path = out / f"step_{step}" / f"{act.order:05d}_{act.name}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines) + "\n")
            written += 1
    return written
