"""What a planned step is, measured: 2 gloo ranks train the GPT of tests/test_plan.py with each layout
(replicate, fully_shard, Megatron tensor parallel; 2-D on 4 ranks) and write, per layout, the last step's
collectives (``train_step.comm``), ``train_step.memory()`` and the steps' times, for the test (and bench/plan.py)
to compare with ``train_step.plan(...)`` made in one process."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
from examples.gpt import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402
from helpers import grads_kept_step  # noqa: E402
import spmd_ort  # noqa: E402
from spmd_ort.runtime.memory import release_free_host_memory  # noqa: E402

COMM = ("all_gather", "all_reduce", "broadcast", "reduce_scatter")


def config(size: str) -> GPTConfig:
    return {"test": GPTConfig(vocab=96, seq=16, d=64, heads=4, layers=2, split_qkv=True),
            "bench": GPTConfig(vocab=512, seq=128, d=256, heads=8, layers=4, split_qkv=True)}[size]


def modes(world: int) -> dict:
    fs = spmd_ort.DataParallel(parallel_style="fully_shard")
    out = {"replicate": spmd_ort.DataParallel(), "fully_shard": fs,
           "tp": spmd_ort.TensorParallel(tensor_parallel_plan(), mesh=(world,))}
    if world == 4:
        out = {"2d": spmd_ort.TensorParallel(tensor_parallel_plan(), mesh=(2, 2), data_parallel=fs)}
    return out


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def batch(cfg: GPTConfig, size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab, (size, cfg.seq), generator=g),
            torch.randint(0, cfg.vocab, (size, cfg.seq), generator=g))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="test")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="fx")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(args.size)
    result: dict = {"rank": rank}
    for name, mode in modes(world).items():
        gc.collect()
        release_free_host_memory()  # what the last layout freed goes back to the system
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        step = spmd_ort.compile(parallel_mode=mode, backend=args.backend)(grads_kept_step)
        data = rank if name in ("replicate", "fully_shard") else (rank // 2 if name == "2d" else 0)
        times, blocked = [], []  # each step's seconds, and those it spent blocked in collectives' waits
        for i in range(args.steps):
            x, y = batch(cfg, args.batch, 100 * i + data)
            if i == min(2, args.steps - 1):  # compiled and steady: the steps' own memory from here on
                gc.collect()
                Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS
                steady = _rss("VmRSS")
            dist.barrier()
            t0 = time.perf_counter()
            step(model, opt, x, y)
            times.append(time.perf_counter() - t0)
            blocked.append(step.comm.blocked_s)
        rss_above = _rss("VmHWM") - steady
        # the steps' tensor bytes, counted by torch's MemTracker (a dispatch mode: every tensor the step creates,
        # until its storage is freed; the CPU's torch.cuda.max_memory_allocated) in one more step, above what is
        # live when it starts
        tracker = MemTracker()
        tracker.track_external(model, opt)
        x, y = batch(cfg, args.batch, 100 * args.steps + data)
        with tracker:
            start = tracker.get_tracker_snapshot("current")
            step(model, opt, x, y)
            peak = tracker.get_tracker_snapshot("peak")
        cpu = torch.device("cpu")
        tensors_above = peak[cpu]["Total"] - start.get(cpu, {}).get("Total", 0)
        comm = step.comm
        mem = step.memory()
        result[name] = {"comm_bytes": {k: getattr(comm, f"{k}_bytes") for k in COMM if getattr(comm, f"{k}_calls")},
                        "comm_calls": {k: getattr(comm, f"{k}_calls") for k in COMM if getattr(comm, f"{k}_calls")},
                        "persistent": mem["persistent"], "planned_activation_peak": mem["planned_activation_peak"],
                        "step_peak_above_steady": rss_above, "step_s": times, "blocked_s": blocked,
                        "step_tensor_peak_above_start": tensors_above}
    finish(args.out, result)


if __name__ == "__main__":
    main()
