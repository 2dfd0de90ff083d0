"""Data-parallel step time on 2 ranks (gloo, CPU): compiled DP (ort, fx) vs DDP vs DDP + torch.compile.

Run:  .venv/bin/torchrun --standalone --nproc_per_node=2 bench/dp.py [--steps 7] [--micro-batches 4]

gpt-mini (4 layers, d=256, seq 128, vocab 8192), batch 8 per rank (each rank draws
its own batches), clipping at 1.0, AdamW(fused=True) for every runner - the kernel
the compiled step runs - except ``ddp-default``, DDP with ``AdamW()`` as most
scripts write it (the for-loop implementation on CPU), shown for reference.  The
host allocator retains freed memory for every runner from the first step (as
the compiled step does).  The runners alternate step by step in one run, with a
barrier and a short pause before each timed step; rank 0 prints the median
ms/step, the ratio to DDP, and for the compiled runners the collectives,
payload bytes and overlap fraction per step (share of the collectives' time in
flight not spent waiting).  ``--micro-batches N``: gradient accumulation in the step
(N backward passes, one optimizer step); DDP runs ``no_sync`` on all but the last,
the compiled step sums the micro-batch gradients and all-reduces once.  ``--bucket-mb``:
``auto`` (the default) gives spmd_ort ``bucket_cap_mb="auto"`` and DDP its default 25 MiB; a
runner named ``spmd-fx@4`` (``spmd-ort@25``, ...) has that fixed cap.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import spmd_ort  # noqa: E402
from step import gpt_mini, make_adamw, settled, train_step  # noqa: E402


# the "ort" runner is the default backend as users get it (backend="auto"), as in RESULTS' tables
DEFAULT_BACKENDS = {"ort": "auto"}


def accumulate(model, opt, x, y, n: int):
    """nanoGPT's loop: n micro-batches, one backward each (loss / n), then one optimizer step; a DDP model
    skips its all-reduce (no_sync) on all but the last micro-batch, as DDP users write it."""
    ddp = getattr(model, "no_sync", None) or getattr(getattr(model, "_orig_mod", None), "no_sync", None)
    for j, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
        with ddp() if ddp is not None and j + 1 < n else contextlib.nullcontext():
            out = model(xm)
            loss = F.cross_entropy(out.flatten(0, -2), ym.flatten()) / n
            loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--runners", default="ddp,ddp-default,ddp+compile,spmd-fx,spmd-fx@25,spmd-ort,spmd-ort@25")
    ap.add_argument("--bucket-mb", default="auto",
                    help="bucket cap (MiB) for DDP and spmd_ort alike; 'auto' (the default): spmd_ort's "
                         "bucket_cap_mb='auto' (its default) against DDP's default 25 MiB")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="gradient accumulation: each rank's batch in this many micro-batches, one backward each, "
                         "then one optimizer step (DDP: no_sync on all but the last)")
    args = ap.parse_args()
    auto = args.bucket_mb == "auto"
    ddp_cap = 25.0 if auto else float(args.bucket_mb)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spmd_ort.runtime.memory.retain_host_memory()  # every runner, from its first step
    torch.manual_seed(0)
    model, batch = gpt_mini(seed=rank)  # the same model everywhere, each rank its own batches
    runners = {}
    for name in args.runners.split(","):
        m = copy.deepcopy(model)
        step_fn = train_step if args.micro_batches == 1 else functools.partial(accumulate, n=args.micro_batches)
        if name in ("ddp", "ddp-default"):
            runners[name] = (DDP(m, bucket_cap_mb=ddp_cap), step_fn, None)
        elif name == "ddp+compile":
            runners[name] = (torch.compile(DDP(m, bucket_cap_mb=ddp_cap)), step_fn, None)
        else:
            backend, _, cap = name.split("-")[1].partition("@")  # spmd-fx@4: a fixed 4 MiB cap
            mode = spmd_ort.DataParallel(bucket_cap_mb=float(cap) if cap else "auto" if auto else ddp_cap)
            runners[name] = (m, spmd_ort.compile(backend=DEFAULT_BACKENDS.get(backend, backend), parallel_mode=mode)(step_fn), backend)
    opts = {k: make_adamw(m.parameters(), fused=None if k == "ddp-default" else True)
            for k, (m, _, _) in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in runners}
    comm: dict[str, list] = {k: [] for k in runners}
    # 'auto' measures TUNE_STEPS steps after the first, then compiles once more (and checks that program's first run);
    # then on until no tuner work (the bucket cap, inductor's candidate) can land among the timed steps
    warmup = 3 + (spmd_ort.buckets.TUNE_STEPS + 2 if auto else 0)
    compiled_steps = [fn for _, fn, backend in runners.values() if backend is not None]
    calls = 0  # rounds of calls so far
    while calls < warmup + args.steps:
        if calls == warmup and not settled(compiled_steps, args.steps):
            warmup += 1  # one more warm-up round (every rank alike: settled() agrees)
        timing = calls >= warmup
        calls += 1
        x, y = batch()
        for k, (m, fn, backend) in runners.items():
            dist.barrier()
            time.sleep(0.05)
            t0 = time.perf_counter()
            fn(m, opts[k], x, y)
            dt = time.perf_counter() - t0
            if timing:
                times[k].append(dt)
                if backend is not None:
                    comm[k].append(fn.comm)
    if rank == 0:
        ddp = statistics.median(times["ddp"]) if "ddp" in times else None
        params = sum(p.numel() for p in model.parameters())
        print(f"# bench/dp.py — gpt-mini ({params / 1e6:.2f} M params, {params * 4 / 2**20:.1f} MiB of fp32 "
              f"gradients), {world} ranks, gloo, {torch.get_num_threads()} thread(s)/rank, buckets <= "
              f"{'DDP 25 MiB, spmd_ort auto' if auto else f'{ddp_cap:g} MiB'}, {args.micro_batches} micro-batch(es) per step, host memory retained for "
              f"every runner, median of {args.steps}")
        print("| runner | ms/step | x DDP | all-reduce/step | MiB/step | overlap | bucket cap |")
        print("|---|---|---|---|---|---|---|")
        for k in runners:
            ms = statistics.median(times[k]) * 1e3
            ratio = f"{ms / (ddp * 1e3):.2f}" if ddp else "-"
            if comm[k]:
                c = comm[k][-1]
                overlap = statistics.median(s.overlap for s in comm[k])
                step = runners[k][1]
                choice = step.buckets.choice
                cap = f"{choice.cap_mb:g} MiB (auto)" if choice is not None else f"{step.parallel_mode.bucket_cap_mb:g} MiB"
                extra = f"{c.all_reduce_calls} | {c.all_reduce_bytes / 2**20:.2f} | {overlap:.0%} | {cap}"
            else:
                extra = f"- | - | - | {ddp_cap:g} MiB"
            print(f"| {k} | {ms:.1f} | {ratio} | {extra} |", flush=True)
    if rank == 0:
        for k, (m, fn, backend) in runners.items():
            if backend is not None and fn.buckets.choice is not None:
                print(f"{k}: " + "; ".join(line.strip() for line in fn.buckets.choice.lines()))
    runners.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
