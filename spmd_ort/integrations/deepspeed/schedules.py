"""DeepSpeed's LR schedules (``scheduler.type`` in a DeepSpeed config) as torch LR schedulers.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and ``OneCycle`` follow the
formulas of DeepSpeed's ``deepspeed.runtime.lr_schedules`` (checked against
DeepSpeed 0.19.8 in ``tests/test_deepspeed_plan.py``) and are
``torch.optim.lr_scheduler.LRScheduler`` subclasses: ``step()`` once per
optimizer step, ``state_dict()``, ``get_last_lr()`` as usual.  A compiled step
reads ``lr`` (and Adam's betas, which ``OneCycle`` cycles) from the param groups
every call, so a schedule never re-traces.

One difference of convention is absorbed: DeepSpeed counts its iteration from
-1 at construction, torch's ``last_epoch`` from 0, so the value at torch's
``last_epoch = e`` is DeepSpeed's at iteration ``e - 1`` - the same learning
rate for the same optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

LOG, LINEAR = "log", "linear"


def _per_group(opt: torch.optim.Optimizer, value, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(opt.param_groups):
            raise ValueError(f"{name}: {len(value)} values for {len(opt.param_groups)} param groups")
        return [float(v) for v in value]
    return [float(value)] * len(opt.param_groups)


def _warmup_fraction(iteration: int, steps: int, kind: str) -> float:
    """How far warmup has come at ``iteration`` (0 at the start): log(i + 1) / log(steps), or i / steps."""
    if kind == LINEAR:
        return iteration / steps
    return math.log(iteration + 1) / math.log(steps)


def _check_kind(kind: str) -> str:
    if kind not in (LOG, LINEAR):
        raise ValueError(f"warmup_type={kind!r}: expected 'log' or 'linear'")
    return kind


class DeepSpeedSchedule(LRScheduler):
    """Base: ``value(iteration)`` per group, with DeepSpeed's iteration = ``last_epoch - 1``."""

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)


class WarmupLR(DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (log or linear), then flat."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = LOG, last_epoch: int = -1):
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        if int(warmup_num_steps) <= 0:
            raise ValueError(f"warmup_num_steps={warmup_num_steps}: expected a positive integer")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_kind(warmup_type)
        super().__init__(optimizer, last_epoch)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        g = self.gamma(iteration)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG, last_epoch: int = -1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(DeepSpeedSchedule):
    """A ratio of the optimizer's lr: from ``warmup_min_ratio`` to 1 over the warmup, then a cosine down to
    ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = LOG, last_epoch: int = -1):
        if int(warmup_num_steps) <= 0:
            raise ValueError(f"warmup_num_steps={warmup_num_steps}: expected a positive integer")
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_kind(warmup_type)
        super().__init__(optimizer, last_epoch)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            r = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def lrs_at(self, iteration: int) -> list[float]:
        r = self.ratio(iteration)
        return [base * r for base in self.base_lrs]


class OneCycle(DeepSpeedSchedule):
    """One triangular cycle of lr (and, for Adam-style optimizers, of beta1 the other way), then decay."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size=None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count=None, decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate: float = 0.0, last_epoch: int = -1):
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError(f"OneCycle: cycle_first_step_size={first} must be > 0, "
                             f"cycle_second_step_size={second} >= 0")
        self.first_size, self.second_size, self.total_size = first, second, first + second
        self.step_ratio = first / self.total_size
        self.first_stairs = int(cycle_first_stair_count)
        self.second_stairs = self.first_stairs if cycle_second_stair_count is None else int(cycle_second_stair_count)
        self.decay_step_size = float(decay_step_size)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_lr = not (no_decay or math.isclose(self.decay_lr_rate, 0))
        # DeepSpeed cycles beta1 of optimizers that have betas (and sets beta2 to 0.99), no other momentum
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.decay_mom = not (no_decay or math.isclose(self.decay_mom_rate, 0))
        super().__init__(optimizer, last_epoch)

    def _factor(self, iteration: int) -> float:
        """Position in the cycle at DeepSpeed's ``iteration`` (0 at the bottom, 1 at the peak)."""
        b = iteration + 1
        x = 1.0 + b / self.total_size - math.floor(1 + b / self.total_size)
        if x <= self.step_ratio:
            factor, stairs = x / self.step_ratio, self.first_stairs
        else:
            factor, stairs = (x - 1) / (self.step_ratio - 1), self.second_stairs
        if stairs > 0:  # held flat over each stair, counted from the integer step
            c = b % self.total_size
            position = c * stairs / self.first_size if c <= self.first_size else \
                (self.total_size - c) * stairs / self.second_size
            factor = math.floor(position) / stairs
        return factor

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            f = self._factor(iteration)
            return [lo + (hi - lo) * f for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if not self.decay_lr:
            return list(self.min_lrs)
        d = (iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * d) for lo in self.min_lrs]

    def moms_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            f = self._factor(iteration)
            return [hi - (hi - lo) * f for lo, hi in zip(self.min_moms, self.max_moms)]
        if not self.decay_mom:
            return list(self.max_moms)
        d = (iteration - self.total_size + 1) / self.decay_step_size
        return [hi * (1 + self.decay_mom_rate * d) for hi in self.max_moms]

    def step(self, epoch=None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.moms_at(self.last_epoch - 1)):
                group["betas"] = (mom, 0.99)


SCHEDULES: dict[str, type[DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
}


def build_schedule(kind: str, optimizer: torch.optim.Optimizer, params: dict) -> DeepSpeedSchedule:
    return SCHEDULES[kind](optimizer, **params)


__all__: Sequence[str] = ["DeepSpeedSchedule", "OneCycle", "SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
                          "build_schedule"]
