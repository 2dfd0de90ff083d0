"""What a run on an accelerator needs that a run on the CPU does not: clocks that wait for the device, and
random-number states saved for every device a run may draw on.

On a CPU-only machine (or before torch has touched CUDA) both are the plain CPU versions.
"""

from __future__ import annotations

import time

import torch


def cuda_devices() -> list[int]:
    """The CUDA devices of this process, once torch has initialised CUDA (before that nothing ran there)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def rng_kept():
    """A context that gives back torch's random-number states as it found them: the CPU's and every CUDA
    device's (a compile that benchmarks on random inputs, or a timing run of a step with dropout, draws there)."""
    return torch.random.fork_rng(devices=cuda_devices())


def now() -> float:
    """``time.perf_counter()`` after the work queued on every CUDA device has finished: a GPU runs asynchronously,
    so a timing that does not wait measures how fast kernels were queued, not run."""
    if cuda_devices():
        torch.cuda.synchronize()
    return time.perf_counter()
