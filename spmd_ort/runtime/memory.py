"""Memory accounting of a compiled step: what a rank holds between steps and at its peak.

* persistent bytes: parameters, gradients and optimizer state this rank keeps
  between steps (:func:`spmd_ort.distributed.sharding.persistent_bytes`); under
  ``fully_shard`` about 1/N of the unsharded total, plus padding;
* planned peak: a liveness walk over the compiled graph (every value from the
  op that makes it to its last use, views sharing their base's storage, as the
  fx executor frees them) added to the persistent bytes;
* the process's peak resident set (``ru_maxrss``), which also counts the Python
  interpreter, torch and ONNX Runtime themselves.

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
import operator
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from spmd_ort.options import get_logger

logger = get_logger(__name__)


def _aliases(node: fx.Node) -> bool:
    """Whether the node's output shares storage with its first input (views, in-place ops, an element of a list of
    views); an element of a multi-output op's results (a layer norm's output, mean and rstd) is storage of its
    own, freed after its own last use."""
    if node.target is operator.getitem:
        src = node.args[0]
        return not (isinstance(src, fx.Node) and src.op == "call_function" and not _aliases(src))
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None)


def value_bytes(val) -> int:
    """Bytes of a value; a symbolic size counts at the size the program was traced with."""
    if isinstance(val, torch.Tensor):
        from spmd_ort.compat import optimization_hint

        return optimization_hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(value_bytes(v) for v in val)
    return 0


@dataclass(frozen=True)
class ActivationPlan:
    """The liveness walk's result: the peak bytes of the values the graph creates, and how many of those live
    at the peak are forward values kept for the backward (read by a node autograd recorded); ``live``: the bytes
    live while each node runs, in graph order (a picture of memory over the step)."""

    peak: int
    saved_for_backward: int
    live: tuple = ()


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("custom", {}).get("phase") == "backward"  # the trace's tag (spmd_ort.capture.trace)


def plan_activation_memory(gm: fx.GraphModule) -> ActivationPlan:
    """Peak bytes of the values the graph creates (inputs excluded), freed after their last use, and the bytes of
    forward values the backward reads among those live at the peak (the first such peak).

    With symbolic sizes (dynamic shapes), at the sizes the program was traced with.
    """
    nodes = list(gm.graph.nodes)
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and _aliases(node) and node.args and isinstance(node.args[0], fx.Node):
            base = node.args[0]
            root[node] = root.get(base, base)
        else:
            root[node] = node
    # a multi-output op holds what no getitem takes out; each element taken out is counted at its getitem
    own = {n: value_bytes(n.meta.get("val")) for n in nodes if n.op == "call_function" and root[n] is n}
    for node in nodes:
        if node.target is operator.getitem and root[node] is node and node.args[0] in own:
            own[node.args[0]] -= value_bytes(node.meta.get("val"))
    last: dict[fx.Node, int] = {}
    saved: set[fx.Node] = set()  # roots of forward values a backward node reads
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last[root[arg]] = i
            if _is_backward(node) and not _is_backward(arg):
                saved.add(root[arg])
    frees: dict[int, list[fx.Node]] = {}
    for r, i in last.items():
        frees.setdefault(i, []).append(r)
    live: set[fx.Node] = set()
    size = peak = peak_saved = 0
    at: list[int] = []
    for i, node in enumerate(nodes):
        if node.op == "call_function" and root[node] is node:
            live.add(node)
            size += own[node]
        at.append(size)
        if size > peak:
            peak = size
            peak_saved = sum(own[r] for r in live if r in saved)
        if node.op == "output":
            continue  # outputs outlive the step
        for r in frees.get(i, []):
            if r.op == "call_function":
                live.discard(r)
                size -= own[r]
    return ActivationPlan(peak=peak, saved_for_backward=peak_saved, live=tuple(at))


def planned_peak_bytes(gm: fx.GraphModule) -> int:
    """Peak bytes of the values the graph creates (inputs excluded), freed after their last use
    (:func:`plan_activation_memory`)."""
    return plan_activation_memory(gm).peak


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
