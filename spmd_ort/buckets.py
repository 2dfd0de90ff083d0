"""``DataParallel(bucket_cap_mb="auto")``: the gradient bucket cap chosen from measured costs.

A compiled step under ``replicate`` starts with small buckets (a 16th of the parameter bytes,
at most ``AUTO_START_MB``).  Its first ``TUNE_STEPS`` steps after the checked first run are
measured as they run: the communicator notes when each gradient all-reduce is issued
(:attr:`spmd_ort.runtime.collectives.StepComm.reductions`), and the step how much of its
wall time its thread spent neither computing nor waiting -- off its core, to the
collectives running beside it (``StepComm.wall_s - blocked_s - cpu_s``).  Then, once, every
rank together:

* **the collective's own cost**, ``a + b * bytes``: a probe all-reduces two buffers (64 KiB
  and 4 MiB, three times each, the fastest counts) while nothing else runs;
* **when backward produces the gradients**: the bytes issued so far against the issue
  times, piecewise linear (the latest rank's times: a collective starts when its last
  rank issues it);
* **contention**: the measured off-core time per byte all-reduced during backward.  Near 0
  where collectives run on an accelerator's engines or spare cores; large where gloo's
  threads compete with the step for the same cores, where hiding communication behind
  compute does not make it free.

:func:`predict` replays backward for each candidate cap: the greedy buckets the pass would
build (the rule of :func:`spmd_ort.passes.data_parallel._plan_buckets`, on the recorded
gradient sizes), each issued when its last gradient exists, run one after another at the
probed cost.  A step pays what is left in flight once backward has issued its last bucket,
plus the contention of the bytes reduced before.  The cap that adds the least wins (ties,
within ``TIE_S``: the larger cap, fewer collectives); every rank computes the same choice
from the same agreed measurements.  The step then recompiles once with that cap (logged;
``describe()`` shows :class:`BucketChoice`), unless the buckets would be the ones it has.

The chosen cap is remembered (``SPMD_ORT_REMEMBER_CHOICES``, on by default) in ``<cache_dir>/choices``, named by
the model's structure, the layout, the world size and the machine: a later run of the same configuration starts on
it, measuring nothing and compiling once (every rank must read the same cap, else every rank measures).

Under ``fully_shard`` the cap also sizes the parameter all-gathers, which this model does
not time: ``"auto"`` keeps ``AUTO_START_MB`` there and says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_ort.distributed.parallel import AUTO_START_MB, DataParallel, world
from spmd_ort.passes import PassResult
from spmd_ort.passes.data_parallel import GradientBuckets
from spmd_ort.runtime.collectives import control_group, data_group, same_on_every_rank
from spmd_ort.backends.files import write_atomic
from spmd_ort.runtime.devices import now
from spmd_ort.options import get_logger

logger = get_logger(__name__)

CANDIDATES_MB = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 50.0, 100.0)
MIN_START_MB = 1 / 256  # the smallest starting cap of the measured steps (4 KiB)
TUNE_STEPS = 3  # measured steps after the first (checked) run of the starting program
TIE_S = 2e-4  # predictions closer than this are a tie, which the larger cap wins
REMEMBERED_FORMAT = 1  # of the kept cap's entry (bump when its meaning changes)


@dataclass(frozen=True)
class BucketChoice(PassResult):
    """What ``bucket_cap_mb="auto"`` chose and why (shown by ``describe()`` / ``explain()``)."""

    cap_mb: float
    reason: str
    predicted_ms: tuple[tuple[float, float], ...] = ()  # (cap MiB, exposed all-reduce ms predicted)

    def lines(self) -> list[str]:
        lines = [f"bucket_cap_mb='auto': {self.cap_mb:g} MiB ({self.reason})"]
        if self.predicted_ms:
            lines.append("  all-reduce time added to a step, predicted per cap: "
                         + ", ".join(f"{cap:g} MiB {ms:.1f} ms" for cap, ms in self.predicted_ms))
        return lines


@dataclass
class Costs:
    """The measured costs: the all-reduce's own ``a + b * bytes`` (seconds), when backward had produced how many
    gradient bytes (``ready``: (seconds after the first issue, bytes so far)), and the step time lost per byte
    all-reduced during backward (``stolen``)."""

    a: float
    b: float
    ready: list[tuple[float, float]]
    stolen: float = 0.0

    def time_of(self, nbytes: float) -> float:
        """When backward had produced ``nbytes`` gradient bytes (linear between the measured points)."""
        pts = self.ready
        if len(pts) == 1:
            return pts[0][0]
        for (t0, b0), (t1, b1) in zip(pts, pts[1:]):
            if nbytes <= b1 or (t1, b1) == pts[-1]:
                rate = (b1 - b0) / max(t1 - t0, 1e-9)
                return t0 + (nbytes - b0) / max(rate, 1e-3)
        return pts[-1][0]


def rows_of(reductions: list, nbytes: tuple[int, ...]) -> list[tuple[int, float]] | None:
    """One step's gradient all-reduces (those of the buckets of ``nbytes``, in order) as (bytes, issued),
    seconds after the first issue; None when one is missing."""
    rows, want = [], list(nbytes)
    for kind, n, issued, _ in reductions:
        if kind == "all_reduce" and want and n == want[0]:
            want.pop(0)
            rows.append((n, issued))
    if want or not rows:
        return None
    return [(n, issued - rows[0][1]) for n, issued in rows]


def off_core_seconds(comms: list) -> float:
    """Per measured step (:class:`StepComm`), the mean wall time its thread spent neither running nor blocked in
    a wait: descheduled, its core given to the collectives beside it (or to anything else on the machine)."""
    return sum(max(c.wall_s - c.blocked_s - c.cpu_s, 0.0) for c in comms) / max(len(comms), 1)


def probe(dtype: torch.dtype, sizes: tuple[int, ...] = (1 << 16, 4 << 20), repeats: int = 3,
          device: torch.device | str = "cpu") -> tuple[float, float]:
    """(a, b): an all-reduce of n bytes on ``device`` (the gradients') takes a + b * n seconds, timed alone (every
    rank calls it)."""
    times = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=control_group())
            t0 = now()
            dist.all_reduce(t, group=data_group())  # where the step's all-reduces run
            best = min(best, now() - t0)
        times.append(best)
    agreed_times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(agreed_times, op=dist.ReduceOp.MAX, group=control_group())  # the same on every rank
    (n0, n1), (t0, t1) = sizes, agreed_times.tolist()
    b = max((t1 - t0) / (n1 - n0), 1e-15)
    return max(t0 - b * n0, 0.0), b


def agreed(steps: list, nbytes: tuple[int, ...], off_core: float) -> tuple[list, float] | None:
    """The measured steps' issue times as the latest rank saw them (a collective starts when its last rank issues
    it; the max over ranks, relative to each rank's first issue) and the ranks' mean off-core seconds per step:
    the same on every rank.  None if any rank could not measure."""
    t = torch.zeros(len(steps), len(nbytes), dtype=torch.float64)
    extra = torch.tensor([0.0, off_core], dtype=torch.float64)  # (failed, off-core seconds)
    for i, rows in enumerate(steps):
        if rows is None:
            extra[0] = 1.0
            continue
        t[i] = torch.tensor([issued for _, issued in rows], dtype=torch.float64)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
        dist.all_reduce(extra, group=control_group())
    if extra[0] > 0:
        return None
    return [[(n, float(t[i, j])) for j, n in enumerate(nbytes)] for i in range(len(steps))], float(extra[1]) / world


def ready_curve(steps: list[list[tuple[int, float]]]) -> list[tuple[float, float]] | None:
    """(seconds after the first issue, gradient bytes issued so far) per bucket, the median over the measured
    steps; None when backward issued fewer than two buckets (nothing to interpolate)."""
    if not steps or len(steps[0]) < 2 or len({len(rows) for rows in steps}) != 1:
        return None
    totals = [sum(n for n, _ in steps[0][:i + 1]) for i in range(len(steps[0]))]
    return [(sorted(rows[i][1] for rows in steps)[len(steps) // 2], totals[i]) for i in range(len(totals))]


def plan(sizes: list[int], first_cap: float, cap: float) -> list[int]:
    """Bucket byte totals of gradients of ``sizes`` (in production order): the bucketing pass's greedy rule."""
    buckets: list[int] = []
    limit = min(first_cap, cap)
    for n in sizes:
        if buckets and buckets[-1] + n <= limit:
            buckets[-1] += n
            continue
        if buckets:
            limit = cap
        buckets.append(n)
    return buckets


def predict(costs: Costs, sizes: list[int], first_cap: float, cap: float) -> float:
    """Seconds the all-reduces add to a step with buckets of ``cap``: what is left in flight after backward
    issues its last bucket, plus ``costs.stolen`` for every byte reduced before it."""
    done, total, last_issue = float("-inf"), 0, 0.0
    buckets = plan(sizes, first_cap, cap)
    for nbytes in buckets:
        total += nbytes
        last_issue = costs.time_of(total)
        done = max(last_issue, done) + costs.a + costs.b * nbytes
    return max(0.0, done - last_issue) + costs.stolen * (total - buckets[-1])


class BucketTuner:
    """The bucket cap of one compiled step with ``bucket_cap_mb="auto"``: measured, chosen once, then kept; with
    ``options.remember_choices``, kept on disk for the next run of the same model, layout, world and machine
    (:func:`remembered_cap_path`), which then starts on it without measuring or recompiling."""

    def __init__(self, options=None):
        self.options = options
        self.choice: BucketChoice | None = None
        self.start_mb: float | None = None  # the cap of the measured steps
        self._steps: list = []
        self._comms: list = []
        self._program = None  # the variant whose steps are being measured
        self._kept: Path | None = None  # where the choice is remembered

    def mode(self, mode, module, recall: bool = True):
        """``mode`` with a number in place of ``"auto"``: the chosen cap (an earlier run's, where it is remembered
        and ``recall``), or until then the starting one, a 16th of ``module``'s parameter bytes within
        [``MIN_START_MB``, ``AUTO_START_MB``] (enough buckets that the measured steps show when backward produces
        which gradients).  The first call is collective where it recalls (every rank's first call of the step)."""
        if not (isinstance(mode, DataParallel) and mode.auto_buckets) or mode.sharded:
            return mode
        if self.choice is None and self.start_mb is None and recall and module is not None:
            self.choice = self._recall(mode, module)
        if self.choice is not None:
            return dataclasses.replace(mode, bucket_cap_mb=self.choice.cap_mb)
        if self.start_mb is None:
            total = sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0
            self.start_mb = min(max(total / 16 / 2**20, MIN_START_MB), AUTO_START_MB)
        return dataclasses.replace(mode, bucket_cap_mb=self.start_mb)

    def _recall(self, mode, module) -> BucketChoice | None:
        if self.options is None or not self.options.remember_choices:
            return None
        self._kept = remembered_cap_path(self.options.cache_dir, mode, module)
        cap, reason = _read_cap(self._kept)
        if not same_on_every_rank(cap if cap is not None else -1.0):  # the same cap everywhere, or none used
            cap = None
        if cap is None:
            return None
        logger.info("bucket_cap_mb='auto': %g MiB, remembered from an earlier run (%s)", cap, self._kept)
        return BucketChoice(cap, f"remembered from an earlier run: {reason}")

    def _remember(self) -> None:
        if self._kept is not None and self.choice is not None:
            try:
                write_atomic(self._kept, json.dumps({"cap_mb": self.choice.cap_mb,
                                                     "reason": self.choice.reason}).encode())
            except OSError as exc:
                logger.info("bucket_cap_mb='auto': the choice is not remembered (%s)", exc)

    def observe(self, mode, program, comm) -> bool:
        """Note a step of ``program`` (run under ``mode``); True when a cap was just chosen that needs a recompile.

        Every rank calls it after the same steps (the choice is agreed: a collective)."""
        if not (isinstance(mode, DataParallel) and mode.auto_buckets) or self.choice is not None:
            return False
        if mode.sharded:
            self.choice = BucketChoice(AUTO_START_MB, "fully_shard: the cap also sizes the parameter gathers, "
                                                      "which the cost model does not time; the starting cap kept")
            program.results.record(self.choice)
            return False
        buckets = program.results.get(GradientBuckets)
        if program.steps_run < 2 or buckets is None or not buckets.sizes:
            return False  # the first run is the checked one: not a step to measure
        if program is not self._program:  # another variant (a new input shape): measure its own steps
            self._program, self._steps, self._comms = program, [], []
        self._steps.append(rows_of(comm.reductions, buckets.nbytes))
        self._comms.append(comm)
        if len(self._steps) < TUNE_STEPS:
            return False
        measured = agreed(self._steps, buckets.nbytes, off_core_seconds(self._comms))
        self._steps, self._comms = [], []
        ready = ready_curve(measured[0]) if measured is not None else None
        if ready is None:  # the same on every rank: no rank probes alone
            self.choice = BucketChoice(self.start_mb or AUTO_START_MB,
                                       "backward issues a single bucket of gradients: the starting cap kept")
            program.results.record(self.choice)
            return False
        dtype, device = _dtype_and_device(program)
        a, b = probe(dtype, device=device)
        # the off-core time of the measured steps, per byte all-reduced before the last bucket (the rest ran
        # after backward, beside no compute)
        overlapped = sum(buckets.nbytes[:-1])
        costs = Costs(a=a, b=b, ready=ready, stolen=measured[1] / overlapped if overlapped else 0.0)
        sizes = [n for bucket in buckets.sizes for n in bucket]
        first = mode.first_bucket_cap_mb * 2**20
        predicted = [predict(costs, sizes, first, c * 2**20) for c in CANDIDATES_MB]
        best = min(range(len(CANDIDATES_MB)), key=lambda i: (round(predicted[i] / TIE_S), -CANDIDATES_MB[i]))
        cap = CANDIDATES_MB[best]
        same = plan(sizes, first, cap * 2**20) == list(buckets.nbytes)
        reason = (f"measured over {TUNE_STEPS} steps with {self.start_mb:g} MiB buckets: all-reduce alone "
                  f"{costs.a * 1e3:.2f} ms + {costs.b * 2**20 * 1e3:.2f} ms/MiB, {sum(sizes) / 2**20:.1f} MiB of "
                  f"gradients issued over {costs.ready[-1][0] * 1e3:.0f} ms of backward, "
                  f"{costs.stolen * 2**20 * 1e3:.2f} ms of the step lost per MiB reduced during backward")
        self.choice = BucketChoice(cap, reason, tuple((c, p * 1e3) for c, p in zip(CANDIDATES_MB, predicted)))
        self._remember()
        logger.info("bucket_cap_mb='auto' chose %g MiB (predicted to add %.1f ms to a step; with the %g MiB "
                    "buckets measured: %.1f ms)%s", cap, predicted[best] * 1e3, self.start_mb,
                    predict(costs, sizes, first, self.start_mb * 2**20) * 1e3,
                    "; the same buckets, no recompile" if same else "; recompiling the schedule once")
        program.results.record(self.choice)
        return not same


def remembered_cap_path(cache_dir, mode: DataParallel, module) -> Path:
    """Where a chosen cap is kept: named by the model's structure (:func:`~spmd_ort.backends.files.module_digest`),
    the layout's other settings, the world size and the machine (what the measured costs depend on)."""
    from spmd_ort.backends.files import module_digest
    from spmd_ort.backends.ort.remembered import machine

    device = next((p.device for p in module.parameters()), None)
    h = hashlib.sha256(f"{REMEMBERED_FORMAT}|{module_digest(module)}|{mode!r}|{world()[1]}|{machine(device)}".encode())
    return Path(cache_dir) / "choices" / f"buckets-{h.hexdigest()[:32]}.json"


def _read_cap(path: Path) -> tuple[float | None, str]:
    try:
        data = json.loads(path.read_text())
        cap = float(data["cap_mb"])
        return (cap, str(data.get("reason", ""))) if cap in CANDIDATES_MB else (None, "")
    except (OSError, ValueError, KeyError, TypeError):
        return None, ""


def _dtype_and_device(program) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the step's gradient buckets (the first all-reduce's), float32 on the CPU if none
    is found."""
    from spmd_ort.graph.ops import all_reduce_

    for node in program.gm.graph.nodes:
        if node.op == "call_function" and node.target is all_reduce_ and "val" in node.meta:
            return node.meta["val"].dtype, node.meta["val"].device
    return torch.float32, torch.device("cpu")
