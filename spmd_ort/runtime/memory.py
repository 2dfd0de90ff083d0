"""The host memory of a process that runs compiled steps: its peak resident set (``ru_maxrss``, which also counts
the Python interpreter, torch and ONNX Runtime themselves) and the allocator's settings.  (The planned peak of a
graph's values is :mod:`spmd_ort.graph.liveness`; the persistent bytes a rank holds,
:func:`spmd_ort.distributed.sharding.persistent_bytes`.)

Host memory is also where a step's time can go: glibc hands every allocation
above its mmap threshold (at most 32 MiB by default) to a fresh ``mmap`` and
returns freed heap tops to the system, so a CPU step that allocates the same
large tensors every step page-faults through all of them again (zeroing each
4 KiB page).  :func:`retain_host_memory` makes the process keep freed memory for
reuse, as CUDA's caching allocator does on a GPU; a compiled step calls it on its
first call only when its options ask (``SPMD_ORT_RETAIN_HOST_MEMORY=1``): it changes
the allocator of the whole process, so it is the user's choice, off by default.
The allocator belongs to the process, so whether it was set is remembered here,
once; :func:`host_memory_retained` reads it without setting anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from pathlib import Path


from spmd_ort.options import get_logger

logger = get_logger(__name__)


def max_rss_bytes() -> int:
    """This process's peak resident set.

    Linux: ``VmHWM`` of /proc/self/status (the high-water mark of this process's own memory);
    ``ru_maxrss`` is kept across ``execve``, so a process started from a large one (a torchrun
    worker, a subprocess) would report its parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_RETAIN_MMAP_THRESHOLD = 1 << 30  # allocations up to 1 GiB come from the heap and are reused
_RETAIN_TRIM_THRESHOLD = (1 << 31) - 1  # never give freed heap tops back to the system
_retained: bool | None = None  # None: never asked. The allocator is the process's, so its setting is kept here


def host_memory_retained() -> bool:
    """Whether this process keeps freed host memory for reuse (see :func:`retain_host_memory`)."""
    return bool(_retained)


def _glibc() -> ctypes.CDLL | None:
    """This process's C library, where it is glibc (whose ``mallopt``/``malloc_trim`` the functions below call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def release_free_host_memory() -> bool:
    """Give the memory glibc's heap holds free back to the system (``malloc_trim(0)``), once.

    For a one-off burst of temporary host memory, such as the staging copies of a checkpoint load: glibc keeps
    freed heap memory resident, so without it the process's resident memory after loading stays near its peak
    during loading.  A no-op (False) where the C library is not glibc, or while this process retains freed
    memory on purpose (:func:`retain_host_memory`).
    """
    libc = None if _retained else _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(libc.malloc_trim(0))


def retain_host_memory() -> bool:
    """Keep freed host memory in this process for reuse instead of returning it to the system.

    Sets glibc's mmap threshold to 1 GiB and its trim threshold to the maximum,
    once per process.  The process's resident memory then stays at its peak
    (which ``max_rss`` already reports) and steady-state steps stop
    page-faulting: on gpt-mini's ZeRO-3 step, about 15% of the step time here.
    Returns whether the setting is in force: False where the C library is not
    glibc or mallopt refuses.  Affects the whole process
    (eager code in it too), like an ``LD_PRELOAD``-ed jemalloc or tcmalloc would.
    """
    global _retained
    if _retained is not None:
        return _retained
    _retained = False
    libc = _glibc()  # mallopt's parameter numbers are glibc's
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _RETAIN_MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _RETAIN_TRIM_THRESHOLD) == 1 and ok
    _retained = ok
    logger.info("host memory: freed memory is %s", "retained for reuse" if ok else
                "returned to the system (mallopt refused)")
    return ok
