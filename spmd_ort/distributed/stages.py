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
    micro-batch in the schedule's order, their activations and gradients sent point to point.  With
    ``dp_replicate`` (``dp`` > 1) the mesh is ``(pp, dp)``: ``dp`` pipelines, each passing its own batch, whose
    ranks holding one stage average its gradients (one all-reduce each, DDP's arithmetic)."""

    pp: int
    pipeline: Pipeline = field(default_factory=Pipeline)
    dp: int = 1
    sharded = False  # (what the data-parallel passes ask of a mode: nothing of the state is sharded)
    mixed_precision = None

    def __post_init__(self):
        p = self.pipeline
        if p.schedule == "interleaved_1f1b" and p.microbatches % self.pp:
            raise ConfigError(f"Pipeline(schedule='interleaved_1f1b', microbatches={p.microbatches}) on pp={self.pp}: "
                              f"interleaving runs micro-batches in groups of pp; give a multiple of {self.pp}")

    @property
    def stages(self) -> int:
        return self.pipeline.stages(self.pp)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (0 to pp - 1) running ``stage``."""
        return stage % self.pp

    def pp_rank(self, rank: int) -> int:
        """A global rank's place in its pipeline (the mesh is (pp, dp): pp outermost)."""
        return rank // self.dp

    def peer(self, stage: int, rank: int) -> int:
        """The global rank running ``stage`` in the pipeline of global rank ``rank``."""
        return self.rank_of(stage) * self.dp + rank % self.dp

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.stages) if s % self.pp == pp_rank % self.pp]

    def groups(self, world_size: int) -> list[list[int]]:
        """The global ranks of each pipeline: ranks that pass one batch."""
        return [[p * self.dp + d for p in range(self.pp)] for d in range(self.dp)]

    def group_name(self) -> str:
        """The process group of this rank's pipeline ("": the world, pp alone)."""
        return self._names()[0]

    def dp_group_name(self) -> str:
        """The process group of the ranks holding this rank's stages in every pipeline (dp > 1)."""
        return self._names()[1]

    def _names(self) -> tuple[str, str]:
        if self.dp == 1:
            return "", ""
        import torch.distributed as dist

        built = self.__dict__.get("_built")
        if built is None or built[0] is not dist.group.WORLD:  # every rank makes the mesh's groups together
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = init_device_mesh(device, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))
            built = (dist.group.WORLD, (mesh["pp"].get_group().group_name, mesh["dp"].get_group().group_name))
            object.__setattr__(self, "_built", built)
        return built[1]


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" (input gradient, or the whole backward where W is not split) or "W"
    stage: int
    micro: int
    start: float = 0  # on the simulated time line (unit slots, or seconds)
    length: float = 1

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
    def makespan(self) -> float:
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
            cells = ["."] * int(self.makespan)
            for a in acts:
                for t in range(int(a.start), int(a.start + a.length)):
                    cells[t] = self._cell(a)
            rows.append(f"rank {r}: " + " ".join(c.ljust(width) for c in cells))
        return rows

    def _cell(self, a: Action) -> str:
        return f"{a.kind}{a.micro}" + (f"s{a.stage}" if self.stages > self.pp else "")


def simulate(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1,
             costs: dict[str, float] | None = None, link_s: float = 0.0) -> Schedule:
    """Every rank's actions under ``schedule``, greedily on a unit-cost time line.

    A rank, when free, runs the first of its actions that is ready (what it needs has finished), in its
    schedule's priority: GPipe every forward first; 1F1B a backward before a forward, with at most ``pp - r``
    micro-batches in flight on rank ``r`` (the warm-up); interleaved as 1F1B over its stages, deeper stages
    first; zero bubble as 1F1B with the weights' gradients (W) run only when nothing else is ready, and all
    that are left at the end.

    ``costs`` (``{"F": s, "B": s, "W": s}``, B with W where it is not split, or ``{("F", stage): s, ...}`` per
    stage) and ``link_s`` (one transfer between ranks) lay the same rules on a time line in seconds (a plan's
    prediction); the order may then differ from the unit-cost one, which is what the ranks run.
    """
    n_stages = pp * stages_per_rank
    split_w = schedule == "zero_bubble"
    unit = {"F": 1, "B": 1 if split_w else 2, "W": 1}
    given = costs or unit

    class _Lengths(dict):  # length_of[kind] (one cost a kind) or length_of[kind, stage] (each stage its own)
        def __missing__(self, key):
            return given[key] if key in given else given[key[0]]

    length_of = _Lengths()
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro) -> finish time
    todo: list[list[tuple[str, int, int]]] = []
    for r in range(pp):
        mine = [s for s in range(n_stages) if s % pp == r]
        todo.append([(k, s, m) for m in range(microbatches) for s in mine for k in ("F", "B")]
                    + ([("W", s, m) for m in range(microbatches) for s in mine] if split_w else []))
    free = [0] * pp
    out: list[list[Action]] = [[] for _ in range(pp)]
    in_flight = [0] * pp  # micro-batches through the rank's first stage whose backward there has not run yet
    pending_w = [0] * pp  # zero bubble: B's whose W has not run yet
    # 1F1B's warm-up: rank r admits at most pp - r micro-batches (its first stage forwarded, its backward not
    # yet run); interleaved, V - 1 more (the micro-batches its later stages hold meanwhile)
    limit = [10 ** 9 if schedule == "gpipe" else pp - r + stages_per_rank - 1 for r in range(pp)]

    def after(key, here: int):
        """When ``key``'s result is on stage ``here``'s rank (None: not done)."""
        t = done.get(key)
        if t is None:
            return None
        return t + link_s if link_s and key[1] % pp != here % pp else t

    def ready_at(action):
        kind, s, m = action
        if kind == "F":
            return 0 if s == 0 else after(("F", s - 1, m), s)
        if kind == "B":
            return after(("F", s, m), s) if s == n_stages - 1 else after(("B", s + 1, m), s)
        return done.get(("B", s, m))

    def priority(action, r):
        kind, s, m = action
        if schedule == "gpipe":
            return (0 if kind == "F" else 1, m, s if kind == "F" else -s)
        order = {"B": 0, "F": 1, "W": 2}[kind]
        return (order, m, -s if kind == "B" else s)

    if schedule == "interleaved_1f1b":  # Megatron's order, laid on the time line as it is
        return _in_order(schedule, pp, n_stages, microbatches, _interleaved(pp, microbatches, stages_per_rank),
                         ready_at, length_of, done)
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
                if action[0] == "F" and action[1] == r and (in_flight[r] >= limit[r]
                                                            or (split_w and pending_w[r] >= pp)):
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
        length = length_of[kind, s]
        todo[r].remove((kind, s, m))
        done[(kind, s, m)] = start + length
        free[r] = start + length
        if kind == "F" and s == r:
            in_flight[r] += 1
        elif kind == "B":
            in_flight[r] -= s == r
            pending_w[r] += split_w
        else:
            pending_w[r] -= 1
        out[r].append(Action(kind, s, m, start, length))
    return Schedule(schedule, pp, n_stages, microbatches, split_w, tuple(tuple(a) for a in out))


def _interleaved(pp: int, microbatches: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Megatron's interleaved 1F1B order for each rank: micro-batches in groups of ``pp``, each group through the
    rank's stages in turn (its backward through them in reverse); ``(pp - r - 1) * 2 + (v - 1) * pp`` forwards
    of warm-up, then one forward and one backward, then the backwards left."""
    orders = []
    groups = [range(g, min(g + pp, microbatches)) for g in range(0, microbatches, pp)]
    for r in range(pp):
        fwd = [("F", c * pp + r, m) for group in groups for c in range(v) for m in group]
        bwd = [("B", c * pp + r, m) for group in groups for c in reversed(range(v)) for m in group]
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, len(fwd))
        order = fwd[:warm]
        for k in range(len(fwd) - warm):
            order += [fwd[warm + k], bwd[k]]
        order += bwd[len(fwd) - warm:]
        orders.append(order)
    return orders


def _in_order(name: str, pp: int, n_stages: int, microbatches: int, orders, ready_at, length_of, done) -> Schedule:
    """Each rank's ``orders`` laid on the time line: an action starts when its rank is free and what it needs is
    done."""
    free = [0] * pp
    nxt = [0] * pp
    out: list[list[Action]] = [[] for _ in range(pp)]
    while any(nxt[r] < len(orders[r]) for r in range(pp)):
        best = None
        for r in range(pp):
            if nxt[r] >= len(orders[r]):
                continue
            t = ready_at(orders[r][nxt[r]])
            if t is not None and (best is None or max(t, free[r]) < best[0]):
                best = (max(t, free[r]), r)
        if best is None:
            raise RuntimeError(f"schedule {name!r} waits in a cycle (pp={pp}, microbatches={microbatches})")
        start, r = best
        kind, s, m = orders[r][nxt[r]]
        nxt[r] += 1
        length = length_of[kind, s]
        done[(kind, s, m)] = start + length
        free[r] = start + length
        out[r].append(Action(kind, s, m, start, length))
    return Schedule(name, pp, n_stages, microbatches, False, tuple(tuple(a) for a in out))


STAGES_ATTR = "_spmd_ort_pipeline_stages"  # on a module a pipelined step trains: (mode, the FQNs this rank steps)


def mark_stages(module, mode: PipelineParallel, stepped: tuple[str, ...]) -> None:
    """Record on ``module`` which of its parameters this rank steps (a pipelined step compiled for it)."""
    setattr(module, STAGES_ATTR, (mode, tuple(stepped)))


def sync_stages(module, optimizer=None) -> None:
    """Every parameter of ``module`` (and its optimizer state) as the rank stepping it holds it, on every rank of
    its pipeline (collective: every rank calls it).  A pipeline rank steps only its stages' parameters; the others'
    values on it are where they were when it compiled, so what reads the whole model (a checkpoint, the full state
    dict, safetensors) takes each from its stage.  Nothing happens for a module no pipelined step trains."""
    import torch.distributed as dist

    from spmd_ort.runtime.collectives import control_group, data_group

    marked = getattr(module, STAGES_ATTR, None)
    if marked is None or not (dist.is_available() and dist.is_initialized()):
        return
    mode, stepped = marked
    rank = dist.get_rank()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stepped, group=control_group())
    mine = mode.groups(dist.get_world_size())[rank % mode.dp]  # this rank's pipeline, by global rank
    owner = {name: r for r in mine for name in everyone[r]}
    group = data_group(mode.group_name())
    with torch.no_grad():
        for name, p in module.named_parameters():
            src = owner.get(name)
            if src is None:  # (a parameter no stage steps: it has no gradient, as eager leaves it)
                continue
            dist.broadcast(p.data, src=src, group=group)
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    dist.broadcast(state[key], src=src, group=group)


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
