"""What every torchrun script of tests/dist does last: write this rank's result, leave the group together."""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


def finish(out: str | Path, result: dict, name: str | None = None) -> None:
    """Write ``result`` to ``out/<name>`` (default ``rank<r>.json``), then barrier and destroy the process group.

    Objects holding collectives (DDP's reducer, pending work) are collected first, so they die before the
    process group does.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / (name or f"rank{dist.get_rank()}.json")).write_text(json.dumps(result, indent=1))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


class UserTraffic(threading.Thread):
    """While a step runs, the user's own all-reduces on the default group, from another thread (each checked):
    ours must never pair with them, in whatever order the two threads issue theirs on each rank."""

    CALLS = 8  # each rank's thread issues as many (a collective every rank calls)

    def __init__(self, rank: int, world: int):
        super().__init__(daemon=True)
        self.rank, self.world, self.calls, self.error = rank, world, 0, None

    def run(self) -> None:
        try:
            for _ in range(self.CALLS):
                t = torch.full((1000,), float(self.rank + 1))
                dist.all_reduce(t)
                assert torch.all(t == self.world * (self.world + 1) / 2), f"the user's all-reduce got {t[:4]}"
                self.calls += 1
                time.sleep(0.002)  # spread over the step
        except Exception as exc:  # noqa: BLE001 - raised in the main thread
            self.error = exc

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.join(timeout=120)
        if self.error is not None:
            raise AssertionError(f"rank {self.rank}: the user's thread failed: {self.error}")


def mlp_against_ddp(rank: int, steps: int = 3, until=None, **compile_kwargs):
    """An MLP (tests/models.py) trained ``steps`` steps with AdamW by ``spmd_ort.compile(**compile_kwargs)`` (the
    default layout under torchrun: replicate) next to DDP on this rank's batches: loss, every parameter and
    optimizer state (per tensor) asserted equal each step; ``until(step, i)`` after step ``i`` (from 1) may stop
    it sooner (the same on every rank), and then DDP starts each step from the compiled step's state (a run of
    hundreds of steps drifts apart by rounding: each step is compared alone).  Returns the compiled step."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd_ort
    from helpers import assert_same_state, resync, train_step
    from models import MLP

    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_d = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    step = spmd_ort.compile(**compile_kwargs)(train_step)
    g = torch.Generator().manual_seed(10 + rank)
    for i in range(steps):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = step(model, opt, x, y)
        loss_d = train_step(ddp, opt_d, x, y)
        torch.testing.assert_close(loss, loss_d.detach(), rtol=1e-5, atol=1e-6)
        assert_same_state(ddp.module, model, opt_d, opt, where=f"rank {rank} step {i}", normwise=True)
        if until is not None:
            if until(step, i + 1):
                break
            resync(model, opt, ddp.module, opt_d)
    return step

