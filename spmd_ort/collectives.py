"""Collectives of the compiled graph: ops over torch.distributed, counted in one place.

Graph passes insert these ops; the executors run them as host nodes:

* ``spmd_ort::all_reduce_(t, prescale)`` scales ``t`` in place and starts an
  asynchronous SUM all-reduce of it (DDP's arithmetic: divide by the world size,
  then sum; gloo has no AVG);
* ``spmd_ort::wait_(t)`` waits for the collective on ``t`` to finish;
* ``spmd_ort::broadcast_(t, src)`` broadcasts ``t`` from rank ``src`` (synchronous).

Each returns its input (an alias, as the schemas say), so graph order follows data
dependencies and no copy is made.  :data:`COMM` counts, per step, collectives,
payload bytes, time in flight and time blocked in ``wait_``: the overlap fraction
is the share of the collectives' own duration (issue to completion, taken from
the work's future) that the host did not spend waiting for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

_lib = torch.library.Library("spmd_ort", "FRAGMENT")
_lib.define("all_reduce_(Tensor(a!) t, float prescale) -> Tensor(a!)")
_lib.define("wait_(Tensor(a!) t) -> Tensor(a!)")
_lib.define("broadcast_(Tensor(a!) t, int src) -> Tensor(a!)")


@dataclass
class StepComm:
    """One step's collectives: all-reduces (gradients) and broadcasts (buffers) counted apart."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    broadcast_calls: int = 0
    broadcast_bytes: int = 0
    comm_s: float = 0.0  # issue -> completion (the collective's own duration), summed
    blocked_s: float = 0.0  # time the host sat in wait_ (or in a synchronous broadcast)

    @property
    def overlap(self) -> float:
        """Share of the collectives' duration hidden behind compute (1.0: never waited)."""
        return max(0.0, 1.0 - self.blocked_s / self.comm_s) if self.comm_s > 0 else 1.0


@dataclass
class Communicator:
    """Outstanding work and per-step accounting for this process."""

    pending: dict = field(default_factory=dict)  # data_ptr -> (work, issued at, [completed at])
    step: StepComm = field(default_factory=StepComm)

    def start_step(self) -> None:
        self.step = StepComm()

    def end_step(self) -> StepComm:
        if self.pending:
            self.finish()
        return self.step

    def all_reduce(self, t: Tensor, prescale: float) -> Tensor:
        if prescale != 1.0:
            t.mul_(prescale)
        issued = time.perf_counter()
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
        nbytes = t.numel() * t.element_size()
        done: list[float] = []
        work.get_future().then(lambda fut: done.append(time.perf_counter()))
        self.pending[t.data_ptr()] = (work, issued, done)
        self.step.all_reduce_calls += 1
        self.step.all_reduce_bytes += nbytes
        return t

    def wait(self, t: Tensor) -> Tensor:
        entry = self.pending.pop(t.data_ptr(), None)
        if entry is None:
            return t  # already finished (e.g. a duplicate wait)
        self._wait(*entry)
        return t

    def _wait(self, work, issued: float, done: list) -> None:
        t0 = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        self.step.blocked_s += t1 - t0
        # the completion callback may not have run yet when wait() returns
        self.step.comm_s += (done[0] if done else t1) - issued

    def broadcast(self, t: Tensor, src: int) -> Tensor:
        t0 = time.perf_counter()
        dist.broadcast(t, src=src)
        elapsed = time.perf_counter() - t0
        self.step.broadcast_calls += 1
        self.step.broadcast_bytes += t.numel() * t.element_size()
        self.step.comm_s += elapsed
        self.step.blocked_s += elapsed
        return t

    def finish(self) -> None:
        """Wait for everything still in flight (end of a step, ``last_train_step``)."""
        for ptr in list(self.pending):
            self._wait(*self.pending.pop(ptr))


COMM = Communicator()


def _all_reduce_impl(t: Tensor, prescale: float) -> Tensor:
    return COMM.all_reduce(t, prescale)


def _wait_impl(t: Tensor) -> Tensor:
    return COMM.wait(t)


def _broadcast_impl(t: Tensor, src: int) -> Tensor:
    return COMM.broadcast(t, src)


for _key in ("CPU", "CUDA"):
    _lib.impl("all_reduce_", _all_reduce_impl, _key)
    _lib.impl("wait_", _wait_impl, _key)
    _lib.impl("broadcast_", _broadcast_impl, _key)
_lib.impl("all_reduce_", lambda t, prescale: t, "Meta")
_lib.impl("wait_", lambda t: t, "Meta")
_lib.impl("broadcast_", lambda t, src: t, "Meta")

all_reduce_ = torch.ops.spmd_ort.all_reduce_.default
wait_ = torch.ops.spmd_ort.wait_.default
broadcast_ = torch.ops.spmd_ort.broadcast_.default
