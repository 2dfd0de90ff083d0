"""``DataParallel(bucket_cap_mb="auto")``: the gradient bucket cap chosen from measured costs.

A compiled step under ``replicate`` starts with ``AUTO_START_MB`` buckets.  Its first
``TUNE_STEPS`` steps after the checked first run are measured as they run (no extra
runs): the communicator notes each gradient all-reduce's bytes, issue time and
completion time (:attr:`spmd_ort.runtime.collectives.StepComm.reductions`).  From them:

* **the collective's cost**, ``a + b * bytes``: least squares over each all-reduce's own
  duration (completion minus the later of its issue and the previous one's completion:
  a process group runs its collectives one after another);
* **when backward produces the gradients**: the bytes issued so far against the issue
  times, piecewise linear (gradients in between are assumed to arrive at the rate of
  their neighbours).

:func:`predict` replays backward for each candidate cap: the greedy buckets the pass
would build (:func:`spmd_ort.passes.data_parallel._plan_buckets`' rule, on the recorded
gradient sizes), each issued when its last gradient exists, run one after another at
the fitted cost.  What remains in flight once backward has issued the last bucket is
exposed; of the rest, hidden behind compute, the step still pays the measured
**contention** (:func:`contention`: the share of overlapped collective time the step's
thread was off its core -- near 0 with an accelerator or spare cores, near 1 with gloo
on CPU ranks that fill the machine, where small buckets hide communication without
saving time).  The cap that adds the least wins (ties, within ``TIE_S``: the larger cap,
fewer collectives); the ranks agree on the measurements first, so every rank computes
the same choice.  The step then recompiles once with that cap (logged; ``describe()``
shows :class:`BucketChoice`), unless the buckets would be the ones it has.

Under ``fully_shard`` the cap also sizes the parameter all-gathers, which this model
does not time: ``"auto"`` keeps ``AUTO_START_MB`` there and says so.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_ort.distributed.parallel import AUTO_START_MB, DataParallel
from spmd_ort.passes import GradientBuckets, PassResult

logger = logging.getLogger("spmd_ort")

CANDIDATES_MB = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 50.0, 100.0)
MIN_START_MB = 1 / 256  # the smallest starting cap of the measured steps (4 KiB)
TUNE_STEPS = 3  # measured steps after the first (checked) run of the starting program
TIE_S = 2e-4  # predictions closer than this are a tie, which the larger cap wins


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
    """What the measured steps say: the all-reduce cost ``a + b * bytes`` (seconds) and when backward
    had produced how many gradient bytes (``ready``: (seconds after the first issue, bytes so far))."""

    a: float
    b: float
    ready: list[tuple[float, float]]
    contention: float = 0.0  # share of overlapped collective time compute loses (:func:`contention`)

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


def rows_of(reductions: list, nbytes: tuple[int, ...]) -> list[tuple[int, float, float]] | None:
    """One step's gradient all-reduces (those of the buckets of ``nbytes``, in order) as (bytes, issued,
    completed), seconds after the first issue; None when one is missing or its completion time is unknown (a
    backend whose work has no future)."""
    rows, want = [], list(nbytes)
    for kind, n, issued, done in reductions:
        if kind == "all_reduce" and want and n == want[0]:
            want.pop(0)
            rows.append((n, issued, done))
    if want or not rows or not all(done for _, _, done in rows):
        return None
    origin = rows[0][1]
    return [(n, issued - origin, done[0] - origin) for n, issued, done in rows]


def contention(comms: list) -> float:
    """The share of overlapped collective time the step's own thread lost to it, from the measured steps
    (:class:`StepComm`): its wall time not spent blocked in a wait nor running on its CPU, over the collectives'
    time in flight while it computed, in [0, 1].  Near 0 where the collectives run on spare cores or an
    accelerator's engines; near 1 where they compete with the step for the same cores (gloo with a thread per
    rank on every core): hiding communication behind compute then saves nothing."""
    stolen = sum(max(c.wall_s - c.blocked_s - c.cpu_s, 0.0) for c in comms)
    overlapped = sum(max(c.comm_s - c.blocked_s, 0.0) for c in comms)
    return min(max(stolen / overlapped, 0.0), 1.0) if overlapped > 0 else 0.0


def agreed(steps: list, nbytes: tuple[int, ...]) -> list[list[tuple[int, float, float]]] | None:
    """The measured steps as every rank saw them at the latest: a collective starts when its last rank issues
    it (the max over ranks of each issue and completion time, relative to each rank's first issue).  The same
    on every rank; None if any rank could not measure."""
    t = torch.zeros(len(steps), len(nbytes), 2, dtype=torch.float64)
    bad = torch.zeros(1, dtype=torch.float64)
    for i, rows in enumerate(steps):
        if rows is None:
            bad[0] = 1.0
            continue
        t[i] = torch.tensor([[issued, done] for _, issued, done in rows], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad[0] > 0:
        return None
    return [[(n, float(t[i, j, 0]), float(t[i, j, 1])) for j, n in enumerate(nbytes)] for i in range(len(steps))]


def fit(steps: list[list[tuple[int, float, float]]]) -> Costs | None:
    """:class:`Costs` from measured steps' all-reduces (bytes, issued, completed); None when backward issued
    fewer than two buckets (nothing to interpolate)."""
    if not steps or len(steps[0]) < 2 or len({len(rows) for rows in steps}) != 1:
        return None
    own: list[tuple[float, float]] = []  # (bytes, seconds)
    for rows in steps:
        prev_done = float("-inf")
        for nbytes, issued, done in rows:
            own.append((nbytes, max(done - max(issued, prev_done), 0.0)))
            prev_done = done
    totals = [sum(n for n, _, _ in steps[0][:i + 1]) for i in range(len(steps[0]))]
    ready = [(sorted(rows[i][1] for rows in steps)[len(steps) // 2], totals[i]) for i in range(len(totals))]
    x = torch.tensor([n for n, _ in own], dtype=torch.float64)
    y = torch.tensor([s for _, s in own], dtype=torch.float64)
    a, b = 0.0, 0.0
    if len(set(x.tolist())) >= 2:
        design = torch.stack([torch.ones_like(x), x], dim=1)
        a, b = torch.linalg.lstsq(design, y.unsqueeze(1)).solution.squeeze(1).tolist()
    if b <= 0 or a < 0:  # sizes too alike to separate the two terms: all of it per byte
        a, b = 0.0, float((y / x).median())
    return Costs(a=a, b=max(b, 1e-15), ready=ready)


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
    issues its last bucket, plus the share (``costs.contention``) of the rest that compute loses to them."""
    done, total, last_issue, busy = float("-inf"), 0, 0.0, 0.0
    for nbytes in plan(sizes, first_cap, cap):
        total += nbytes
        last_issue = costs.time_of(total)
        done = max(last_issue, done) + costs.a + costs.b * nbytes
        busy += costs.a + costs.b * nbytes
    exposed = max(0.0, done - last_issue)
    return exposed + costs.contention * max(busy - exposed, 0.0)


class BucketTuner:
    """The bucket cap of one compiled step with ``bucket_cap_mb="auto"``: measured, chosen once, then kept."""

    def __init__(self):
        self.choice: BucketChoice | None = None
        self.start_mb: float | None = None  # the cap of the measured steps
        self._steps: list = []
        self._comms: list = []

    def mode(self, mode, module):
        """``mode`` with a number in place of ``"auto"``: the chosen cap, or until then the starting one, a 16th
        of ``module``'s parameter bytes within [``MIN_START_MB``, ``AUTO_START_MB``] (enough buckets that the
        measured steps show when backward produces which gradients)."""
        if not (isinstance(mode, DataParallel) and mode.auto_buckets) or mode.sharded:
            return mode
        if self.choice is not None:
            return dataclasses.replace(mode, bucket_cap_mb=self.choice.cap_mb)
        if self.start_mb is None:
            total = sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0
            self.start_mb = min(max(total / 16 / 2**20, MIN_START_MB), AUTO_START_MB)
        return dataclasses.replace(mode, bucket_cap_mb=self.start_mb)

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
        self._steps.append(rows_of(comm.reductions, buckets.nbytes))
        self._comms.append(comm)
        if len(self._steps) < TUNE_STEPS:
            return False
        steps, stolen = agreed(self._steps, buckets.nbytes), _mean(contention(self._comms))
        self._steps, self._comms = [], []
        costs = fit(steps) if steps is not None else None
        if costs is not None:
            costs.contention = stolen
        if costs is None:
            self.choice = BucketChoice(self.start_mb or AUTO_START_MB,
                                       "the all-reduces' completion times are not observable, or backward issues "
                                       "a single bucket: the starting cap kept")
            program.results.record(self.choice)
            return False
        sizes = [n for bucket in buckets.sizes for n in bucket]
        first = mode.first_bucket_cap_mb * 2**20
        predicted = [predict(costs, sizes, first, c * 2**20) for c in CANDIDATES_MB]
        best = min(range(len(CANDIDATES_MB)), key=lambda i: (round(predicted[i] / TIE_S), -CANDIDATES_MB[i]))
        cap = CANDIDATES_MB[best]
        same = plan(sizes, first, cap * 2**20) == list(buckets.nbytes)
        reason = (f"measured over {TUNE_STEPS} steps with {self.start_mb:g} MiB buckets: all-reduce "
                  f"{costs.a * 1e3:.2f} ms + {costs.b * 2**20 * 1e3:.2f} ms/MiB, {sum(sizes) / 2**20:.1f} MiB of "
                  f"gradients issued over {costs.ready[-1][0] * 1e3:.0f} ms of backward, which loses "
                  f"{costs.contention:.0%} of the time they overlap it")
        self.choice = BucketChoice(cap, reason, tuple((c, p * 1e3) for c, p in zip(CANDIDATES_MB, predicted)))
        logger.info("bucket_cap_mb='auto' chose %g MiB (predicted to add %.1f ms to a step; with the %g MiB "
                    "buckets measured: %.1f ms)%s", cap, predicted[best] * 1e3, self.start_mb,
                    predict(costs, sizes, first, self.start_mb * 2**20) * 1e3,
                    "; the same buckets, no recompile" if same else "; recompiling the schedule once")
        program.results.record(self.choice)
        return not same


def _mean(x: float) -> float:
    """``x`` averaged over the ranks (the same value on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
