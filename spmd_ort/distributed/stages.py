"""Pipeline parallelism's layout: :class:`Pipeline` (what the user names), :class:`PipelineParallel` (what
``Parallel(pp=N, pipeline=...)`` lowers to) and the schedules, as tables of actions.

The model's stages are cut from the traced step (``passes/pipeline_parallel.py``); stage ``s`` runs on pipeline
rank ``s % pp`` (``stages_per_rank`` V: rank ``r`` holds stages ``r, r + pp, ...``).  A schedule is the order
in which each rank runs its actions: ``F`` (a micro-batch's forward through one stage), ``B`` (its backward:
the gradient of the stage's input, and with it the weights' gradients, unless the schedule splits them off into
``W``).  :func:`simulate` lays every rank's actions on a time line with unit costs (F, B and W one slot each;
B without a W split, two) and gives the order each rank's graph runs them in, the table ``explain()`` prints
and the bubble fraction the plan prices.  Every rank's order is read off one time line in which each action
starts after what it needs, so the graphs that run these orders never wait on each other in a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from spmd_ort.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class Pipeline:
    """How ``Parallel(pp=N)`` pipelines the step.

    ``microbatches``: the batch's dim 0 is cut into this many equal micro-batches (every rank of a pipeline
    passes the same whole batch).  ``schedule``: ``"gpipe"`` (every forward, then every backward), ``"1f1b"``
    (one forward, one backward: at most ``pp - r`` micro-batches' activations held on rank ``r``),
    ``"interleaved_1f1b"`` (``stages_per_rank`` >= 2 stages per rank, round robin: a smaller bubble),
    ``"zero_bubble"`` (1F1B whose backward is split into the input's gradient, B, and the weights', W: the W's
    fill the bubbles).  ``split``: module FQNs where stages begin (``["blocks.2"]``: two stages), one fewer
    than the stages; None: a split of the model's top-level blocks balanced by their FLOPs.
    """

    microbatches: int = 4
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    split: tuple[str, ...] | list[str] | None = None

    def __post_init__(self):
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(f"Pipeline(microbatches={self.microbatches!r}): a positive integer")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"Pipeline(schedule={self.schedule!r}): one of {', '.join(SCHEDULES)}")
        v = self.stages_per_rank
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"Pipeline(stages_per_rank={v!r}): a positive integer")
        if self.schedule == "interleaved_1f1b" and v < 2:
            raise ConfigError(f"Pipeline(schedule='interleaved_1f1b', stages_per_rank={v}): interleaving needs "
                              "stages_per_rank >= 2 (with 1 it is '1f1b')")
        if self.schedule != "interleaved_1f1b" and v != 1:
            raise ConfigError(f"Pipeline(schedule={self.schedule!r}, stages_per_rank={v}): several stages per "
                              "rank are run by schedule='interleaved_1f1b'")
        if self.split is not None:
            if isinstance(self.split, str) or not all(isinstance(s, str) and s for s in self.split):
                raise ConfigError(f"Pipeline(split={self.split!r}): a list of module FQNs where stages begin, "
                                  "e.g. ['blocks.2']")
            object.__setattr__(self, "split", tuple(self.split))

    def stages(self, pp: int) -> int:
        return pp * self.stages_per_rank


@dataclass(frozen=True)
class PipelineParallel:
    """``Parallel(pp=N, pipeline=Pipeline(...))`` lowered: N ranks, each running its stages of every
    micro-batch in the schedule's order, their activations and gradients sent point to point."""

    pp: int
    pipeline: Pipeline = field(default_factory=Pipeline)
    sharded = False  # (what the data-parallel passes ask of a mode: nothing of the state is sharded)
    mixed_precision = None

    @property
    def stages(self) -> int:
        return self.pipeline.stages(self.pp)

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.stages) if s % self.pp == rank % self.pp]

    def group_name(self) -> str:
        """The pp group's process group name: the world (pp alone)."""
        return ""


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" (input gradient, or the whole backward where W is not split) or "W"
    stage: int
    micro: int
    start: int = 0  # unit time slot of the simulated time line
    length: int = 1

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f"s{self.stage}" if self.stage else "")


@dataclass(frozen=True)
class Schedule:
    """Every rank's actions in order, on the simulated time line."""

    name: str
    pp: int
    stages: int
    microbatches: int
    split_w: bool
    actions: tuple[tuple[Action, ...], ...]  # per rank, in the order that rank runs them

    @property
    def makespan(self) -> int:
        return max(a.start + a.length for acts in self.actions for a in acts)

    @property
    def bubble(self) -> float:
        """Idle share of the ranks' time between the step's first and last action (unit costs)."""
        busy = sum(a.length for acts in self.actions for a in acts)
        return 1.0 - busy / (self.makespan * self.pp)

    def table(self, micro_width: int | None = None) -> list[str]:
        """Rank x time slot: ``F3`` a forward of micro-batch 3, ``B``/``W``, ``.`` idle (stage suffixed
        ``sK`` where a rank holds several)."""
        width = micro_width or max(len(self._cell(a)) for acts in self.actions for a in acts)
        rows = []
        for r, acts in enumerate(self.actions):
            cells = ["." * 1] * self.makespan
            for a in acts:
                for t in range(a.start, a.start + a.length):
                    cells[t] = self._cell(a)
            rows.append(f"rank {r}: " + " ".join(c.ljust(width) for c in cells))
        return rows

    def _cell(self, a: Action) -> str:
        return f"{a.kind}{a.micro}" + (f"s{a.stage}" if self.stages > self.pp else "")


def simulate(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """Every rank's actions under ``schedule``, greedily on a unit-cost time line.

    A rank, when free, runs the first of its actions that is ready (what it needs has finished), in its
    schedule's priority: GPipe every forward first; 1F1B a backward before a forward, with at most ``pp - r``
    micro-batches in flight on rank ``r`` (the warm-up); interleaved as 1F1B over its stages, deeper stages
    first; zero bubble as 1F1B with the weights' gradients (W) run only when nothing else is ready, and all
    that are left at the end.
    """
    n_stages = pp * stages_per_rank
    split_w = schedule == "zero_bubble"
    b_len = 1 if split_w else 2
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro) -> finish time
    todo: list[list[tuple[str, int, int]]] = []
    for r in range(pp):
        mine = [s for s in range(n_stages) if s % pp == r]
        todo.append([(k, s, m) for m in range(microbatches) for s in mine for k in ("F", "B")]
                    + ([("W", s, m) for m in range(microbatches) for s in mine] if split_w else []))
    free = [0] * pp
    out: list[list[Action]] = [[] for _ in range(pp)]
    in_flight = [0] * pp  # micro-batch-stages forwarded whose backward has not run yet
    pending_w = [0] * pp  # zero bubble: B's whose W has not run yet
    # 1F1B's warm-up: rank r holds at most pp - r micro-batches' activations; interleaved, Megatron's
    # (pp - r - 1) * 2 + (V - 1) * pp forwards before its first backward
    limit = [10 ** 9 if schedule == "gpipe" else
             pp - r if stages_per_rank == 1 else (pp - r - 1) * 2 + (stages_per_rank - 1) * pp + 1
             for r in range(pp)]

    def ready_at(action) -> int | None:
        kind, s, m = action
        if kind == "F":
            return 0 if s == 0 else done.get(("F", s - 1, m))
        if kind == "B":
            return done.get(("F", s, m)) if s == n_stages - 1 else done.get(("B", s + 1, m))
        return done.get(("B", s, m))

    def priority(action, r):
        kind, s, m = action
        if schedule == "gpipe":
            return (0 if kind == "F" else 1, m, s if kind == "F" else -s)
        order = {"B": 0, "F": 1, "W": 2}[kind]
        return (order, m, -s if kind == "B" else s)

    while any(todo):
        # the rank that can start something earliest goes next (ties: lower rank)
        best = None
        for r in range(pp):
            if not todo[r]:
                continue
            candidates = []
            for action in todo[r]:
                t = ready_at(action)
                if t is None:
                    continue
                if action[0] == "F" and (in_flight[r] >= limit[r] or (split_w and pending_w[r] >= pp)):
                    continue  # (zero bubble: W's wait at most pp deep)
                candidates.append((max(t, free[r]), action))
            if not candidates:
                continue
            start = min(t for t, _ in candidates)
            now = [a for t, a in candidates if t == start]
            if split_w:  # a W only where no F or B can start as early
                fb = [a for a in now if a[0] != "W"]
                later_fb = [(t, a) for t, a in candidates if a[0] != "W"]
                if not fb and later_fb and min(t for t, _ in later_fb) <= start:
                    now = [a for t, a in later_fb if t == start]
            action = min(now, key=lambda a: priority(a, r))
            if best is None or (start, r) < (best[0], best[1]):
                best = (start, r, action)
        if best is None:
            raise RuntimeError(f"schedule {schedule!r} cannot proceed (pp={pp}, microbatches={microbatches})")
        start, r, (kind, s, m) = best
        length = b_len if kind == "B" else 1
        todo[r].remove((kind, s, m))
        done[(kind, s, m)] = start + length
        free[r] = start + length
        if kind == "F":
            in_flight[r] += 1
        elif kind == "B":
            in_flight[r] -= 1
            pending_w[r] += split_w
        else:
            pending_w[r] -= 1
        out[r].append(Action(kind, s, m, start, length))
    return Schedule(schedule, pp, n_stages, microbatches, split_w, tuple(tuple(a) for a in out))


def micro_batch(call, inputs) -> tuple[tuple, dict, int, frozenset]:
    """The call with its batch cut to the first micro-batch (what the step is traced on), the micro-batch's rows,
    and the positions of the leaves cut: every tensor whose dim 0 is the batch's (the first tensor's dim 0).
    A batch that ``microbatches`` does not divide is a ConfigError naming it."""
    mode = call.mode
    m = mode.pipeline.microbatches
    leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
    tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not tensors:
        raise ConfigError("Parallel(pp=...): the step takes no batch tensor to cut into micro-batches")
    rows = tensors[0][1].shape[0]
    if rows % m:
        name = inputs.names[tensors[0][0]] if inputs is not None else "the batch"
        raise ConfigError(f"Pipeline(microbatches={m}): `{name}` has {rows} rows (dim 0), which {m} micro-batches "
                          f"do not divide. Fix: a batch of a multiple of {m} rows, or microbatches dividing {rows}",
                          rank=call.rank)
    cut = frozenset(i for i, t in tensors if t.shape[0] == rows)
    new = [t[: rows // m] if i in cut else t for i, t in enumerate(leaves)]
    args, kwargs = pytree.tree_unflatten(new, spec)
    return args, kwargs, rows // m, cut
