"""What a device can do, for a plan's roofline (:class:`DeviceSpec`).

Figures for the GPUs users rent (H100, H200, A100, and the 96 GB H100 of torchtitan's published runs) and for "this
CPU", measured by a short probe (:meth:`DeviceSpec.this_cpu`).  A GPU's entry keeps its data sheet's peaks (dense
FLOP/s, HBM bandwidth, NVLink and NIC rates) apart from what kernels and NCCL achieve of them (:class:`Achieved`:
measured fractions, each with its published source), and a plan is priced on the achieved figures.  Users pass
their own with ``DeviceSpec(...)`` or ``dataclasses.replace(DEVICES["h100"], ...)``.
"""

from __future__ import annotations

import dataclasses
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
class Achieved:
    """What a device's kernels and collectives achieve, as fractions of its data-sheet peaks (1.0 everywhere: the
    peaks themselves, as for a CPU whose rates were measured).  ``sources``: where each figure comes from.

    ``matmul``: large matmuls' FLOP/s over the peak (the best a shape search finds); ``matmul_tile`` and
    ``compute_units``: the output tile one thread block computes and the SMs, for *wave quantization* (a matmul
    whose tiles leave the last wave of SMs part idle runs at the fraction the waves fill; NVIDIA's "Matrix
    Multiplication Background" guide); ``attention``: (forward, backward) of fused attention kernels (flash),
    on torch's FLOP count of them (a causal one half the full count); ``memory``: of the HBM bandwidth, for every op
    a roofline finds memory-bound; ``busbw``: (within a node, across nodes) NCCL's bus bandwidth over the links'
    rate for large messages; ``rails``: NICs of a node that a ring across nodes uses at once (one per GPU on
    rail-optimized clusters: a ring's bus bandwidth across nodes is then all of a node's NICs'); ``latency_s``:
    each collective call's fixed cost (its launch and handshake), besides the per-hop latency; ``overlap``: how
    much slower compute runs while a collective runs beside it (NCCL's kernels take SMs and memory bandwidth);
    ``fragmentation``: the caching allocator's reserved bytes over the allocated peak; ``outside_allocator``:
    bytes a process holds outside the allocator (CUDA context, NCCL's buffers, cuBLAS workspaces)."""

    matmul: float = 1.0
    matmul_tile: tuple[int, int] = (0, 0)
    compute_units: int = 0
    attention: tuple[float, float] = (1.0, 1.0)
    attention_causal: tuple[float, float] | None = None  # a causal kernel's (forward, backward); None: attention's
    memory: float = 1.0
    busbw: tuple[float, float] = (1.0, 1.0)
    rails: int = 1
    latency_s: float = 0.0
    overlap: float = 0.0
    fragmentation: float = 0.0
    outside_allocator: int = 0
    sources: tuple[str, ...] = ()


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
    These are peaks (a data sheet's, or a CPU's measured rates); ``achieved`` says what kernels and collectives get
    of them, and :meth:`figures` which numbers a prediction uses.
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
    achieved: Achieved = field(default_factory=Achieved)

    def flops_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of ``dtype``: its own figure, else fp32's."""
        return self.flops.get(dtype) or self.flops[torch.float32]

    def matmul_rate(self, dtype: torch.dtype, rows: int = 0, cols: int = 0) -> float:
        """FLOP/s a matmul of ``dtype`` achieves whose output is ``rows`` x ``cols`` (batch folded into rows):
        the peak times ``achieved.matmul`` times the share of the last wave its tiles fill."""
        a = self.achieved
        rate = self.flops_for(dtype) * a.matmul
        (tm, tn), units = a.matmul_tile, a.compute_units
        if tm and tn and units and rows > 0 and cols > 0:
            tiles = -(-rows // tm) * -(-cols // tn)
            waves = -(-tiles // units)
            rate *= tiles / (waves * units)
        return rate

    def attention_rate(self, dtype: torch.dtype, backward: bool, causal: bool = False) -> float:
        """FLOP/s a fused attention kernel of ``dtype`` achieves (on torch's FLOP count of it)."""
        a = self.achieved
        shares = a.attention_causal if causal and a.attention_causal is not None else a.attention
        return self.flops_for(dtype) * shares[1 if backward else 0]

    @property
    def achieved_memory_bw(self) -> float:
        return self.memory_bw * self.achieved.memory

    def link_bw(self, group_size: int) -> float:
        """Bytes/s per rank of a collective's ring over ``group_size`` ranks: within a node, the links' rate times
        NCCL's bus efficiency; across nodes, each ring leaves a node through one NIC and ``achieved.rails`` rings
        run at once, so the ring moves the NICs' rate times the rails (never more than within a node)."""
        a = self.achieved
        intra = self.intra_bw * a.busbw[0]
        if group_size <= self.ranks_per_node:
            return intra
        return min(intra, self.inter_bw * a.busbw[1] * max(1, a.rails))

    def figures(self) -> list[tuple[str, str, str]]:
        """(what, data sheet, used by a prediction) for each figure the achieved model changes: the numbers a
        plan's time and memory rest on."""
        a = self.achieved
        main = max(self.flops.values())
        main_dtype = next(d for d, v in self.flops.items() if v == main)
        dt = str(main_dtype).replace("torch.", "")
        rows = [(f"matmul {dt} (large)", f"{main / 1e12:.0f} TFLOP/s", f"{main * a.matmul / 1e12:.0f} TFLOP/s")]
        if a.matmul_tile[0] and a.compute_units:
            rows.append(("matmul wave quantization", "-", f"{a.matmul_tile[0]}x{a.matmul_tile[1]} tiles over "
                                                          f"{a.compute_units} SMs"))
        causal = a.attention_causal or a.attention
        rows += [(f"attention {dt} forward / backward (causal)", f"{main / 1e12:.0f} TFLOP/s",
                  f"{main * a.attention[0] / 1e12:.0f} / {main * a.attention[1] / 1e12:.0f} "
                  f"({main * causal[0] / 1e12:.0f} / {main * causal[1] / 1e12:.0f}) TFLOP/s"),
                 ("memory bandwidth", f"{self.memory_bw / 1e12:.2f} TB/s",
                  f"{self.achieved_memory_bw / 1e12:.2f} TB/s"),
                 ("collective bus bandwidth within a node", f"{self.intra_bw / GB:.0f} GB/s",
                  f"{self.link_bw(1) / GB:.0f} GB/s"),
                 ("collective bus bandwidth across nodes", f"{self.inter_bw / GB:.0f} GB/s a NIC",
                  f"{self.link_bw(self.ranks_per_node + 1) / GB:.0f} GB/s "
                  f"({a.rails} rail{'s' if a.rails > 1 else ''})"),
                 ("per collective / per hop / per op", "-", f"{a.latency_s * 1e6:.0f} / {self.link_latency_s * 1e6:.1f}"
                                                           f" / {self.op_overhead_s * 1e6:.1f} us"),
                 ("compute slowed while a collective runs", "-", f"{100 * a.overlap:.0f}%"),
                 ("allocator fragmentation / outside the allocator", "-",
                  f"{100 * a.fragmentation:.0f}% / {a.outside_allocator / 2**30:.1f} GiB")]
        return rows

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

# Where the achieved figures come from (each entry's ``achieved.sources`` lists those it uses):
MAMF = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS': bf16 H100 SXM "
        "794.5 of 989 TFLOP/s (80.3%; H200 the same), A100 SXM 271.2 of 312 (86.9%)")
FA2_H100 = ("Dao-AILab/flash-attention PR #1791, hopper/benchmark_attn.py on H100, head dim 128, seqlen 8192: "
            "FlashAttention-2 (torch's sdpa flash kernel) forward 369.9 / backward 290.6 TFLOP/s, causal 284.1 / 287.1 "
            "(backward counted as 2.5 forward, as torch's flop counter counts it)")
HBM_H100 = ("Dao-AILab/quack AI/hadamard_roofline_analysis.md: torch.clone on H100 SXM 3003-3029 GB/s, 89.6-90.4% "
            "of 3.35 TB/s")
NCCL_NVLINK = ("stas00/ml-engineering network/README.md (nccl-tests, 8 x H200, NVLink 4 as H100's, 16 GiB): "
               "all-gather 361.4, reduce-scatter 362.9, all-reduce ring 367.2 GB/s busbw of 450 (80-82%)")
NCCL_NIC = ("NVIDIA/nccl-tests#290 (NVIDIA): 46-48 GB/s per 400 Gb/s NDR NIC; nccl-tests#160: on 3+ nodes rings "
            "reflect the total NIC bandwidth (8 rails); nccl-tests#283: 248 nodes of 8 x H200, 8 x 400G: all-reduce "
            "busbw ~350 GB/s")
NCCL_LATENCY = ("NVIDIA/dgxc-benchmarking nccl/README.md: 8-byte all-reduce over 8 x H100 13.0-13.7 us "
                "(2 (n-1) = 14 hops: ~1 us a hop)")
A100_ATTENTION = ("FlashAttention-2 paper (Dao 2023, arXiv 2307.08691): on A100 forward up to 73% of the peak, "
                  "backward up to 63%")
LAUNCH = "meta-pytorch/tritonbench PR #1017: a raw cuLaunchKernel 3.0-3.3 us"
TORCHTITAN_H100 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: H100 with 96 GB HBM2e at "
                   "2.4 TB/s, 500 W power limit, NVLink within a host, 400 Gb/s RDMA per GPU; its bf16 peak is "
                   "'between SXM and NVL' (835-989 TFLOP/s), MFU there is against 989")
FITTED = ("fitted to torchtitan Table 1 (8 GPUs, FSDP + torch.compile, 6,667 tokens/s/GPU): the share of the H100's "
          "kernel rates its 500 W power limit leaves (bench/plan_vs_published.py --fit)")
FITTED_MEMORY = ("fitted to torchtitan Table 1 (8 GPUs, FSDP + torch.compile, 77.0 GiB peak reserved): torch's caching "
                 "allocator reserves 21.7% over the planned allocated peak (bench/plan_vs_published.py --fit)")
FRAGMENTATION = 0.217
POWER_500W = 0.682

_H100_ACHIEVED = Achieved(
    matmul=794.5 / 989, matmul_tile=(128, 256), compute_units=132, attention=(369.9 / 989, 290.6 / 989),
    attention_causal=(284.1 / 989, 287.1 / 989), memory=0.896, busbw=(0.80, 47 / 50), rails=8, latency_s=0.0,
    overlap=0.0, fragmentation=FRAGMENTATION, outside_allocator=2**30,
    sources=(MAMF, FA2_H100, HBM_H100, NCCL_NVLINK, NCCL_NIC, NCCL_LATENCY, LAUNCH, FITTED_MEMORY))


def _power_capped(achieved: Achieved, share: float, **changes) -> Achieved:
    """``achieved`` with every compute kernel's rate times ``share`` (a power cap lowers the clocks they run at)."""
    causal = achieved.attention_causal
    return dataclasses.replace(achieved, matmul=achieved.matmul * share,
                               attention=tuple(x * share for x in achieved.attention),
                               attention_causal=tuple(x * share for x in causal) if causal else None, **changes)


# Data-sheet figures per GPU (SXM parts, dense): fp32 without TF32 (torch's default for matmuls), bf16/fp16
# tensor cores; NVLink per GPU in one direction (H100/H200 900 GB/s both ways, A100 600); across nodes one
# 400 Gb/s InfiniBand NIC per GPU (50 GB/s; A100 nodes 200 Gb/s). What kernels and NCCL achieve of them:
# ``Achieved`` above, with its sources.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("H100 SXM 80GB (700 W)", flops={torch.float32: 67e12, **{d: 989e12 for d in _BF16}},
                       memory_bw=3.35e12, memory_bytes=80 * 2**30, intra_bw=450 * GB, inter_bw=50 * GB,
                       link_latency_s=1e-6, op_overhead_s=3e-6, achieved=_H100_ACHIEVED),
    # torchtitan's published Llama 3.1 runs: the same H100 with 96 GB of HBM2e (2.4 TB/s) at a 500 W power limit
    "h100-96gb": DeviceSpec("H100 96GB HBM2e (500 W)", flops={torch.float32: 67e12, **{d: 989e12 for d in _BF16}},
                            memory_bw=2.4e12, memory_bytes=96 * 2**30, intra_bw=450 * GB, inter_bw=50 * GB,
                            link_latency_s=1e-6, op_overhead_s=3e-6,
                            achieved=_power_capped(_H100_ACHIEVED, POWER_500W,
                                                   sources=(*_H100_ACHIEVED.sources, TORCHTITAN_H100, FITTED))),
    "h200": DeviceSpec("H200 SXM 141GB", flops={torch.float32: 67e12, **{d: 989e12 for d in _BF16}},
                       memory_bw=4.8e12, memory_bytes=141 * 10**9, intra_bw=450 * GB, inter_bw=50 * GB,
                       link_latency_s=1e-6, op_overhead_s=3e-6, achieved=_H100_ACHIEVED),
    "a100": DeviceSpec("A100 SXM 80GB", flops={torch.float32: 19.5e12, **{d: 312e12 for d in _BF16}},
                       memory_bw=2.04e12, memory_bytes=80 * 2**30, intra_bw=300 * GB, inter_bw=25 * GB,
                       link_latency_s=1e-6, op_overhead_s=3e-6,
                       achieved=dataclasses.replace(_H100_ACHIEVED, matmul=271.2 / 312, compute_units=108,
                                                    attention=(0.73, 0.63), attention_causal=None,
                                                    sources=(MAMF, A100_ATTENTION, HBM_H100, NCCL_NVLINK, NCCL_NIC,
                                                             NCCL_LATENCY, LAUNCH, FITTED_MEMORY))),
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


__all__ = ["Achieved", "DEVICES", "DeviceSpec", "device_spec"]
