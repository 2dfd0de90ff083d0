"""What a device can do, for a plan's roofline (:class:`DeviceSpec`).

Figures for the GPUs users rent (H100, H200, A100: their data sheets' dense peaks, HBM bandwidth and NVLink /
InfiniBand rates per GPU) and for "this CPU", measured by a short probe (:meth:`DeviceSpec.this_cpu`).  Users pass
their own with ``DeviceSpec(...)`` or ``dataclasses.replace(DEVICES["h100"], ...)``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One rank's device, as a roofline sees it.

    ``flops``: peak FLOP/s per dtype of matmul-like ops (``torch.float32`` is fp32 without TF32, as torch runs
    matmuls by default); ``memory_bw``: bytes/s of the device memory every op reads and writes;
    ``write_bw``: bytes/s an op writes its output at (0: ``memory_bw``; on a CPU a fresh output is page-faulted
    in, several times slower than a read; a GPU's caching allocator reuses its memory); ``memory_bytes``: what
    one rank may hold; ``intra_bw`` / ``inter_bw``: bytes/s one rank's collectives move
    within a node / across nodes (``ranks_per_node`` ranks a node); ``link_latency_s``: per hop of a ring;
    ``op_overhead_s``: fixed cost of each op (a kernel launch, an executor's dispatch); ``copies_collective_inputs``:
    the collective library keeps a copy of each reduction's input until it completes (gloo does; NCCL does not).
    """

    name: str
    flops: dict = field(default_factory=dict)
    memory_bw: float = 1e12
    write_bw: float = 0.0
    memory_bytes: int = 80 * 2**30
    intra_bw: float = 100 * GB
    inter_bw: float = 25 * GB
    ranks_per_node: int = 8
    link_latency_s: float = 5e-6
    op_overhead_s: float = 5e-6
    copies_collective_inputs: bool = False

    def flops_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of ``dtype``: its own figure, else fp32's."""
        return self.flops.get(dtype) or self.flops[torch.float32]

    def link_bw(self, group_size: int) -> float:
        """Bytes/s per rank of a collective over ``group_size`` ranks: within a node, or across nodes."""
        return self.intra_bw if group_size <= self.ranks_per_node else self.inter_bw

    @classmethod
    def this_cpu(cls, threads: int | None = None, ranks_per_node: int | None = None) -> DeviceSpec:
        """This machine's CPU, measured now (a second or two; with ``ranks_per_node`` a few more): an fp32 matmul's
        FLOP/s and a copy's bandwidth with ``threads`` threads (default: torch's, as one rank runs), the links, a
        small op's dispatch time, and the rate of writing fresh outputs (a clone: allocation and page faults, as
        this process's allocator gives them). The links: with ``ranks_per_node`` > 1, all-reduces among that many
        gloo processes started for the probe (:func:`_gloo_ring`: a small one gives the hops' latency, a large one
        the bandwidth); else one loopback TCP stream (what gloo uses between local ranks) and 50 us a hop.

        ``ranks_per_node``: the ranks that will share this machine, all computing at once. Their cores share
        floating-point units, caches and memory (on this 2-vCPU machine two concurrent single-thread matmuls run
        at about 0.55x the rate of one alone), so with one thread a rank the probes run in that many threads at
        once and each rank gets the rate one of them measured; with more threads a rank, the rate alone is
        scaled by the cores each rank gets. Unset: the rate of one rank alone, and memory split over as many ranks
        as the machine has cores."""
        threads = threads or torch.get_num_threads()
        cpus = os.cpu_count() or 1
        sharing = max(1, ranks_per_node or 1)
        at_once = sharing if threads == 1 else 1
        scale = 1.0 if threads == 1 else min(1.0, cpus / (threads * sharing))
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            matmul = _rate(lambda a, b: torch.mm(a, b), lambda: (torch.randn(1024, 1024), torch.randn(1024, 1024)),
                           2 * 1024**3, at_once=at_once)
            n = 32 * 2**20 // 4
            copy = _rate(lambda s, d: d.copy_(s), lambda: (torch.randn(n), torch.empty(n)), 2 * n * 4,
                         at_once=at_once)
            fresh = _rate(lambda s: s.clone(), lambda: (torch.randn(n),), n * 4,  # a new output each time
                          at_once=at_once)
            overhead = 1 / _rate(lambda s: torch.add(s, s), lambda: (torch.randn(16),), 1, repeat=200)
        finally:
            torch.set_num_threads(before)
        ring = _gloo_ring(sharing, threads) if sharing > 1 else None
        if ring is not None:  # the ranks' own collectives: a ring's hops and its bytes, as cost.py prices them
            a, b = ring
            link, latency = 2 * (sharing - 1) / sharing / b, a / (2 * (sharing - 1))
        else:
            link, latency = _loopback_bw(), 50e-6
        ranks = ranks_per_node or cpus
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
        name = f"this CPU ({threads} thread{'s' if threads > 1 else ''}"
        if ranks_per_node:
            name += f", {sharing} ranks at once)" if at_once > 1 else f", shared by {sharing} ranks)"
        else:
            name += ")"
        return cls(name=name, flops={torch.float32: matmul * scale}, memory_bw=copy * scale, write_bw=fresh * scale,
                   memory_bytes=memory, intra_bw=link, inter_bw=link, ranks_per_node=ranks, link_latency_s=latency,
                   op_overhead_s=overhead, copies_collective_inputs=True)


def _rate(fn, make_args, work: float, repeat: int = 5, at_once: int = 1) -> float:
    """``work`` per second of ``fn(*make_args())``: the best of ``repeat`` timed calls after one warm-up. With
    ``at_once`` > 1, as many threads run it at the same time (each on arguments of its own; torch's ops release
    the GIL), each timing its ``repeat`` calls together (the best single call would be one the others happened
    not to overlap), and the rate is their mean."""
    threads = torch.get_num_threads()

    def one(out: list, start: threading.Barrier | None = None) -> None:
        torch.set_num_threads(threads)  # OpenMP's thread count is per thread: a new one starts at the default
        args = make_args()
        fn(*args)
        if start is not None:
            start.wait()
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn(*args)
            out.append(work * repeat / max(time.perf_counter() - t0, 1e-9))
            return
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn(*args)
            best = min(best, time.perf_counter() - t0)
        out.append(work / max(best, 1e-9))

    rates: list[float] = []
    if at_once <= 1:
        one(rates)
        return rates[0]
    start = threading.Barrier(at_once, timeout=60)
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            one(rates, start)
        except threading.BrokenBarrierError:
            pass  # another thread failed first: its error is the one raised
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            start.abort()  # the others stop waiting for this one

    workers = [threading.Thread(target=guarded) for _ in range(at_once)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors or len(rates) < at_once:
        raise RuntimeError("the CPU probe failed in one of its threads") from (errors[0] if errors else None)
    return sum(rates) / len(rates)


# One rank of the ring probe (:func:`_gloo_ring`), run by ``python -c``: torch alone, not this package, is imported.
_RING_RANK = r"""
import json, sys, time
import torch, torch.distributed as dist
rank, world, path, threads, repeat = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
means = []
for nbytes in (int(n) for n in sys.argv[6].split(",")):
    t = torch.zeros(nbytes // 4)
    for _ in range(3):
        dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(repeat):
        dist.all_reduce(t)
    means.append((time.perf_counter() - t0) / repeat)
dist.destroy_process_group()
print(json.dumps(means))
"""


def _gloo_ring(ranks: int, threads: int, sizes: tuple[int, int] = (4096, 8 * 2**20), repeat: int = 20,
               timeout: float = 120.0) -> tuple[float, float] | None:
    """(a, b): an all-reduce of n bytes among ``ranks`` gloo processes on this machine, ``threads`` threads each,
    takes a + b * n seconds: the mean of ``repeat`` back-to-back calls per size (a step waits for each of its
    collectives, so the mean, slow calls included, is what adds up), over the ranks. Ranks that share cores
    wait for each other to be scheduled: with 4 ranks on 2 cores a small all-reduce took 0.44 ms and a 64 KiB
    one about 5 ms, where one TCP stream's bandwidth and a fixed hop latency predicted 0.3 and 0.4 ms. None
    (logged) where the processes fail or time out."""
    with tempfile.TemporaryDirectory() as d:
        args = [os.path.join(d, "store"), str(threads), str(repeat), ",".join(map(str, sizes))]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        procs = [subprocess.Popen([sys.executable, "-c", _RING_RANK, str(r), str(ranks), *args], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(ranks)]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            outs = None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if outs is None or any(p.returncode for p in procs):
        why = "timed out" if outs is None else next(err for p, (_, err) in zip(procs, outs) if p.returncode)[-500:]
        logger.info("the CPU probe's gloo ring of %d processes failed (%s): links priced from loopback TCP", ranks,
                    why)
        return None
    means = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    small, large = (sum(m[i] for m in means) / ranks for i in range(2))
    b = max((large - small) / (sizes[1] - sizes[0]), 1e-15)
    return max(small - b * sizes[0], 0.0), b


def _loopback_bw(nbytes: int = 32 * 2**20) -> float:
    """Bytes/s of one TCP stream over loopback (a receiving thread draining it)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    payload = bytearray(nbytes)

    def drain():
        conn, _ = server.accept()
        with conn:
            view, got = memoryview(bytearray(nbytes)), 0
            while got < nbytes:
                got += conn.recv_into(view[got:])
            conn.sendall(b"k")

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with socket.create_connection(server.getsockname()) as client:
        t0 = time.perf_counter()
        client.sendall(payload)
        client.recv(1)
        seconds = time.perf_counter() - t0
    reader.join()
    server.close()
    return nbytes / seconds


_BF16 = (torch.bfloat16, torch.float16)

# Data-sheet figures per GPU (SXM parts, dense): fp32 without TF32 (torch's default for matmuls), bf16/fp16
# tensor cores; NVLink per GPU in one direction (H100/H200 900 GB/s both ways, A100 600); across nodes one
# 400 Gb/s InfiniBand NIC per GPU (50 GB/s).
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("H100 SXM 80GB", flops={torch.float32: 67e12, **{d: 989e12 for d in _BF16}},
                       memory_bw=3.35e12, memory_bytes=80 * 2**30, intra_bw=450 * GB, inter_bw=50 * GB),
    "h200": DeviceSpec("H200 SXM 141GB", flops={torch.float32: 67e12, **{d: 989e12 for d in _BF16}},
                       memory_bw=4.8e12, memory_bytes=141 * 10**9, intra_bw=450 * GB, inter_bw=50 * GB),
    "a100": DeviceSpec("A100 SXM 80GB", flops={torch.float32: 19.5e12, **{d: 312e12 for d in _BF16}},
                       memory_bw=2.04e12, memory_bytes=80 * 2**30, intra_bw=300 * GB, inter_bw=25 * GB),
}


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """A :class:`DeviceSpec` from a name (``"h100"``, ``"h200"``, ``"a100"``, ``"cpu"``: this CPU, measured) or
    the spec itself."""
    if isinstance(device, DeviceSpec):
        return device
    key = str(device).lower()
    if key == "cpu":
        return DeviceSpec.this_cpu()
    if key not in DEVICES:
        raise ValueError(f"device={device!r}: give one of {', '.join([*DEVICES, 'cpu'])} or a spmd_ort.DeviceSpec")
    return DEVICES[key]


__all__ = ["DEVICES", "DeviceSpec", "device_spec"]
