"""What the multi-rank benches share (bench/cp.py, bench/ep.py): a worker's memory and time over its steps, and a
launch of the bench's own script under torchrun that gathers the ranks' results.

Memory and time come from separate launches: for memory, glibc returns freed blocks to the system
(:data:`ALLOCATOR`), so the resident set follows the live tensors; for time, the allocator as users have it
(returning every block would add page faults to each step).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
             "SPMD_ORT_RETAIN_HOST_MEMORY": "0"}
MIB = 2**20


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(run: Callable[[], object], steps: int, warmup: int = 2) -> dict:
    """``run()`` (one step) ``warmup`` times, then, the kernel's high-water mark reset, ``steps`` times, each
    after a barrier: {"peak": resident bytes above the set before them, "ms": the median step}."""
    import torch.distributed as dist

    for _ in range(warmup):
        run()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss("VmRSS")
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"peak": _rss("VmHWM") - base, "ms": statistics.median(times) * 1e3}


def launch(script: str, nproc: int, args: list[str], memory: bool) -> list[dict]:
    """``script --out DIR *args`` under torchrun on ``nproc`` ranks, one thread each (:data:`ALLOCATOR` when
    ``memory``); each rank's ``DIR/rank<r>.json``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(ALLOCATOR if memory else {})}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
               *args, "--out", out]
        subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=ROOT)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]
