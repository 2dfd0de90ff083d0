"""Collectives of the compiled graph: the work behind the ``spmd_ort::`` collective ops, counted per step.

Graph passes insert the ops (defined in :mod:`spmd_ort.graph.ops`); the executors run
them as host nodes, and each op calls the :class:`Communicator` of the step that
is running (:mod:`spmd_ort.runtime.step_runtime`):

* ``all_reduce_(t, prescale)`` scales ``t`` in place and starts an asynchronous
  SUM all-reduce of it (DDP's arithmetic: divide by the world size, then sum;
  gloo has no AVG); ``op="max"``/``"min"`` reduce so instead (DTensor's own);
* ``wait_(t)`` waits for the collective on ``t`` to finish;
* ``broadcast_(t, src)`` broadcasts ``t`` from rank ``src`` (synchronous);
* ``all_gather(shard, world)`` starts gathering every rank's ``shard`` into a new
  tensor of ``world`` times its size (rank-major), for ``fully_shard``;
  ``all_gather(shard, world, carried=k)`` takes instead the gather the previous step issued for
  slot ``k`` after its optimizer (:meth:`Communicator.carry`: cross-step prefetch), when every
  rank's shards are still what that gather read (else it gathers anew, on every rank);
* ``reduce_scatter(t, world)`` starts averaging ``t`` over ranks and returns this
  rank's 1/``world`` slice of the result (a new tensor); float16 is divided by the
  world size first and then summed, so the sum cannot overflow (FSDP2's rule: its
  range is too small to sum first; float32 and bfloat16 are averaged by the backend).

A :class:`Communicator` counts, per step, collectives, payload bytes, time in
flight and time blocked in ``wait_``: the overlap fraction is the share of the
collectives' own duration (issue to completion, taken from the work's future)
that the host did not spend waiting for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from spmd_ort.errors import CollectiveTimeout, is_timeout


SUM_AFTER_DIVIDING = (torch.float16,)  # dtypes whose sum over ranks may overflow: divide first
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}  # all_reduce_'s op


# Our groups are kept in torch's own registry of groups, under these tags: destroy_process_group forgets them with the
# default group, so a new default group gets new ones.
CONTROL_GROUP_TAG = "spmd_ort:control"
DATA_GROUP_TAG = "spmd_ort:data"


def control_group():
    """The process group for the host's small agreements between ranks (a digest of the step, a flag, picklable
    objects): a gloo group of ours over every rank, made once per default group.  Gloo whatever the default
    backend: NCCL takes CUDA tensors only (a CPU tensor there raises, and a CUDA one would make the host wait for
    the GPU to read each answer).  Ours, not the default group: a user's own collective between or inside steps
    (a barrier, an all-reduce of the loss) can never pair with one of our agreements.  Every rank reaches its
    first agreement at the same point of the same step, where each makes the group (a collective call)."""
    default = dist.distributed_c10d._get_default_group()
    # (a plan's world is torch's fake process group: its collectives do nothing, and a gloo group needs real peers)
    backend = "fake" if dist.get_backend(default) == "fake" else "gloo"
    return _cached("", CONTROL_GROUP_TAG, lambda: _group_of_ours(
        CONTROL_GROUP_TAG, list(range(dist.get_world_size())), backend=backend, like=default,
        desc="spmd_ort_control"))


def same_on_every_rank(value: int | float) -> bool:
    """Whether every rank holds ``value`` (an int within 63 bits, or a float): one all-reduce over
    :func:`control_group`, so every rank must call it alike; True without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    t = torch.tensor([value, -value], dtype=torch.int64 if isinstance(value, int) else torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return t[0].item() == -t[1].item()


def process_group(name: str):
    """The process group a collective op names: None (the world) for "", else the group registered under the
    name (a DTensor mesh dimension's, as its ``_c10d_functional`` ops name it).  What the name means (its ranks,
    its size); the step's collectives run on :func:`data_group` of it."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def data_group(name: str = ""):
    """The group of ours the step's collectives on ``name``'s group run on: the same ranks, backend and timeout,
    made once (every rank of the world makes every group of a mesh dimension together, at its first collective,
    which every rank reaches at the same point of the step).

    Collectives pair by their order of issue on each group.  On a group of ours, none of ours ever pairs with
    one the user issues on theirs: a barrier or a loss all-reduce between steps, while a carried gather (cross-step
    prefetch) is still in flight, or inside a step, in an opaque part."""
    return _cached(name, DATA_GROUP_TAG, lambda: _make_data_group(name))


def ours(group=None):
    """:func:`data_group` of a process group object (None: the world): where a collective of ours on it runs (the
    broadcasts and gathers that lay a model out, as well as the step's own)."""
    return data_group("" if group is None else group.group_name)


def _make_data_group(name: str):
    group = process_group(name)
    like = group if group is not None else dist.distributed_c10d._get_default_group()
    world = dist.get_world_size()
    ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    backend = dist.get_backend_config(like)
    if len(ranks) == world or dist.distributed_c10d._find_pg_by_ranks_and_tag(DATA_GROUP_TAG, ranks) is not None:
        return _group_of_ours(DATA_GROUP_TAG, ranks, backend=backend, like=like, desc="spmd_ort_data")
    # a group of some ranks: every rank of the world takes part in making each group of ranks (torch's new_group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, ranks, group=control_group())
    for member_ranks in sorted({tuple(r) for r in everyone}):
        _group_of_ours(DATA_GROUP_TAG, list(member_ranks), backend=backend, like=like, desc="spmd_ort_data")
    return dist.distributed_c10d._find_pg_by_ranks_and_tag(DATA_GROUP_TAG, ranks)


_OURS: dict = {}  # (tag, group name) -> (the default group it was made under, our group): lookups per collective


def _cached(name: str, tag: str, make):
    default = dist.distributed_c10d._get_default_group()
    hit = _OURS.get((tag, name))
    if hit is None or hit[0] is not default:  # a new default group (destroyed and made again): new groups
        hit = _OURS[(tag, name)] = (default, make())
    return hit[1]


def _group_of_ours(tag: str, ranks: list[int], *, backend: str, like, desc: str):
    """The group of ``ranks`` registered under ``tag``, made (collectively) where there is none yet, with the
    timeout of ``like`` (the user's group it stands beside: a rank that stops fails the others as theirs would)."""
    c10d = dist.distributed_c10d
    group = c10d._find_pg_by_ranks_and_tag(tag, ranks)
    if group is None:
        group = c10d._new_group_with_tag(ranks, backend=backend, pg_tag=tag, group_desc=desc,
                                         timeout=_timeout_of(like))
    return group


def _timeout_of(group):
    """``group``'s collective timeout (None: torch's default for its backend)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


@dataclass
class StepComm:
    """One step's collectives, counted per kind (payload bytes: the full, unsharded size)."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    broadcast_calls: int = 0
    broadcast_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0  # gathered (output) bytes
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0  # input bytes
    all_to_all_calls: int = 0  # expert parallelism's token exchanges (spmd_ort.distributed.experts)
    all_to_all_bytes: int = 0  # rows sent to other ranks: tokens, results, and their gradients in backward
    p2p_sends: int = 0  # pipeline parallelism: activations, their gradients, a stage's partial sums
    p2p_bytes: int = 0  # sent bytes
    expert_tokens: dict = field(default_factory=dict)  # experts module FQN -> [tokens per expert of this rank]
    carried_gathers: int = 0  # all-gathers served by the one the previous step issued (cross-step prefetch)
    comm_s: float = 0.0  # issue -> completion (the collective's own duration), summed
    blocked_s: float = 0.0  # time the host sat in wait_ (or in a synchronous broadcast)
    # the gradient reductions (all-reduce, reduce-scatter) in issue order: (kind, bytes, issued at, [completed at]);
    # the completion time is there when the backend's work has a future (gloo's all-reduce, NCCL's all)
    reductions: list = field(default_factory=list)
    wall_s: float = 0.0  # the step's duration
    cpu_s: float = 0.0  # CPU time of the thread that ran it (the rest of wall_s: waits, or other threads on its core)

    @property
    def total_bytes(self) -> int:
        return (self.all_reduce_bytes + self.broadcast_bytes + self.all_gather_bytes + self.reduce_scatter_bytes
                + self.all_to_all_bytes + self.p2p_bytes)

    @property
    def overlap(self) -> float:
        """Share of the collectives' duration hidden behind compute (1.0: never waited)."""
        return max(0.0, 1.0 - self.blocked_s / self.comm_s) if self.comm_s > 0 else 1.0


@dataclass
class Carried:
    """A gather issued after one step for the next (cross-step prefetch): its output, work and what it read."""

    out: Tensor
    shard: Tensor  # this rank's input, as it was when issued
    world: int
    owner: object  # the program that issued it (only that program's next run takes it)
    entry: tuple  # (work, issued at, [completed at], kind), as Communicator.pending holds
    group: str = ""  # the process group it gathers over ("": the world)


@dataclass
class Communicator:
    """Outstanding collectives and per-step accounting of one compiled step."""

    pending: dict = field(default_factory=dict)  # data_ptr -> (work, issued at, [completed at], kind)
    step: StepComm = field(default_factory=StepComm)
    recorder: object | None = None  # a spmd_ort.runtime.recorder.Recorder while steps are profiled
    carried: dict = field(default_factory=dict)  # slot -> Carried, issued after the last step for the next
    owner: object | None = None  # the program running now (whose carried gathers it may take)
    sends: list = field(default_factory=list)  # pipeline sends in flight: (work, tensor kept alive, issued at)

    def start_step(self) -> None:
        self.step = StepComm()

    def end_step(self) -> StepComm:
        if self.pending:
            self.finish()
        return self.step

    def all_reduce(self, t: Tensor, prescale: float, group: str = "", op: str = "sum") -> Tensor:
        if prescale != 1.0:
            t.mul_(prescale)
        work = dist.all_reduce(t, op=REDUCE_OPS[op], group=data_group(group), async_op=True)
        done = self._track(t, time.perf_counter(), work, "all_reduce")
        self.step.reductions.append(("all_reduce", t.numel() * t.element_size(), self.pending[t.data_ptr()][1], done))
        self.step.all_reduce_calls += 1
        self.step.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def all_gather(self, shard: Tensor, world: int, carried: int = -1, group: str = "") -> Tensor:
        if carried >= 0 and self.carried:
            out = self._take(carried, shard, world, group)
            if out is not None:
                return out
        out = shard.new_empty(shard.numel() * world)
        issued = time.perf_counter()
        work = dist.all_gather_single(out, shard.reshape(-1), group=data_group(group), async_op=True)
        self._track(out, issued, work, "all_gather")
        self.step.all_gather_calls += 1
        self.step.all_gather_bytes += out.numel() * out.element_size()
        return out

    def carry(self, slot: int, shard: Tensor, world: int, owner: object, group: str = "") -> None:
        """Start, after a step, the gather of ``shard`` that ``owner``'s next run takes at ``slot``."""
        self.drop_carried()
        shard = shard.detach()  # (a view of a parameter: no autograd history may follow it into the collective)
        out = shard.new_empty(shard.numel() * world)
        issued = time.perf_counter()
        with torch.no_grad():
            work = dist.all_gather_single(out, shard.contiguous(), group=data_group(group), async_op=True)
        done: list[float] = []
        try:
            work.get_future().then(lambda fut: done.append(time.perf_counter()))
        except RuntimeError:
            pass
        kind = f"all_gather {out.numel() * out.element_size() / 2**20:.2f} MiB (carried)"
        self.carried[slot] = Carried(out, shard.clone(), world, owner, (work, issued, done, kind), group)

    def _take(self, slot: int, shard: Tensor, world: int, group: str = "") -> Tensor | None:
        """The carried gather for ``slot`` if it is this program's and every rank's shard is unchanged since it
        was issued (ranks agree: one tiny all-reduce), else None (and it is dropped) -- the caller gathers anew.

        Every rank holds a carried gather or none (the same steps ran everywhere), so all take this path."""
        c = self.carried.pop(slot)
        self._wait(*c.entry)  # it ran between the steps; what is left of it is this step's wait
        fresh = (c.owner is self.owner and c.world == world and c.group == group
                 and c.out.numel() == shard.numel() * world
                 and c.shard.dtype == shard.dtype and torch.equal(c.shard, shard))
        if world > 1:
            flag = torch.tensor([0 if fresh else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
            fresh = int(flag) == 0
        if not fresh:
            return None
        self.step.all_gather_calls += 1
        self.step.all_gather_bytes += c.out.numel() * c.out.element_size()
        self.step.carried_gathers += 1
        return c.out  # complete already: its wait_ finds nothing pending

    def drop_carried(self) -> None:
        """Complete and forget the carried gathers (a new one replaces them; the training ends)."""
        for c in self.carried.values():
            self._wait(*c.entry)
        self.carried.clear()

    def reduce_scatter(self, t: Tensor, world: int, group: str = "", mean: bool = True) -> Tensor:
        if t.numel() % world:
            raise ValueError(f"reduce_scatter: {t.numel()} elements do not split into {world} shards")
        out = t.new_empty(t.numel() // world)
        issued = time.perf_counter()
        op = dist.ReduceOp.AVG if mean else dist.ReduceOp.SUM
        if mean and t.dtype in SUM_AFTER_DIVIDING:
            t, op = t / world, dist.ReduceOp.SUM
        work = dist.reduce_scatter_single(out, t.reshape(-1), op=op, group=data_group(group), async_op=True)
        done = self._track(out, issued, work, "reduce_scatter")
        self.step.reductions.append(("reduce_scatter", t.numel() * t.element_size(), issued, done))
        self.step.reduce_scatter_calls += 1
        self.step.reduce_scatter_bytes += t.numel() * t.element_size()
        return out

    def _track(self, t: Tensor, issued: float, work, kind: str) -> list[float]:
        """Hold ``work`` until its wait; returns the list its completion time is appended to (when known)."""
        done: list[float] = []
        try:
            work.get_future().then(lambda fut: done.append(time.perf_counter()))
        except RuntimeError:
            pass  # gloo's all-gather/reduce-scatter work has no future: completion counts at wait
        self.pending[t.data_ptr()] = (work, issued, done, f"{kind} {t.numel() * t.element_size() / 2**20:.2f} MiB")
        return done

    def wait(self, t: Tensor) -> Tensor:
        entry = self.pending.pop(t.data_ptr(), None)
        if entry is None:
            return t  # already finished (e.g. a duplicate wait)
        self._wait(*entry)
        return t

    def _wait(self, work, issued: float, done: list, kind: str) -> None:
        t0 = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as exc:
            if is_timeout(exc):
                raise CollectiveTimeout("a collective of the compiled step", rank=dist.get_rank(), cause=exc) from exc
            raise
        t1 = time.perf_counter()
        self.step.blocked_s += t1 - t0
        # the completion callback may not have run yet when wait() returns
        completed = done[0] if done else t1
        self.step.comm_s += completed - issued
        if self.recorder is not None:
            self.recorder.add(kind, "comm", issued, completed)

    def broadcast(self, t: Tensor, src: int) -> Tensor:
        t0 = time.perf_counter()
        try:
            dist.broadcast(t, src=src, group=data_group())
        except RuntimeError as exc:
            if is_timeout(exc):
                raise CollectiveTimeout("a buffer broadcast of the compiled step", rank=dist.get_rank(),
                                        cause=exc) from exc
            raise
        elapsed = time.perf_counter() - t0
        if self.recorder is not None:
            self.recorder.add(f"broadcast {t.numel() * t.element_size() / 2**20:.2f} MiB", "comm", t0, t0 + elapsed)
        self.step.broadcast_calls += 1
        self.step.broadcast_bytes += t.numel() * t.element_size()
        self.step.comm_s += elapsed
        self.step.blocked_s += elapsed
        return t

    def finish(self) -> None:
        """Wait for everything still in flight (end of a step, ``last_train_step``)."""
        for ptr in list(self.pending):
            self._wait(*self.pending.pop(ptr))
        self.finish_sends()

    # ---------------------------------------------------------------- pipeline parallelism: point to point
    def send(self, t: Tensor, peer: int, tag: int, group: str = "") -> Tensor:
        """Start sending ``t`` to global rank ``peer`` (kept alive until :meth:`finish_sends`); a token."""
        t = t.detach().contiguous()
        issued = time.perf_counter()
        work = dist.isend(t, dst=peer, group=data_group(group), tag=tag)
        self.sends.append((work, t, issued))
        self.step.p2p_sends += 1
        self.step.p2p_bytes += t.numel() * t.element_size()
        return t.new_empty(0)

    def recv(self, size, dtype: torch.dtype, device, peer: int, tag: int, group: str = "") -> Tensor:
        """Post the receive of the tensor global rank ``peer`` sends with ``tag``: its buffer, complete once
        :meth:`wait` returns it."""
        out = torch.empty([int(s) for s in size], dtype=dtype, device=device)
        issued = time.perf_counter()
        work = dist.irecv(out, src=peer, group=data_group(group), tag=tag)
        self._track(out, issued, work, f"recv from {peer}")
        return out

    def finish_sends(self, after: Tensor | None = None) -> Tensor:
        """Wait for the sends in flight (the step's end: nothing of ours is in flight when it returns)."""
        while self.sends:
            work, t, issued = self.sends.pop(0)
            self._wait(work, issued, [], f"send {t.numel() * t.element_size() / 2**20:.2f} MiB")
        return torch.empty(0) if after is None else after.new_empty(0)
