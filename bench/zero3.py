"""ZeRO-3 on 2 ranks (gloo, CPU): compiled fully_shard vs DeepSpeed ZeRO-3 vs FSDP2 (+ torch.compile).

Run:  .venv/bin/python bench/zero3.py [--steps 5] [--runners spmd-fx,deepspeed,fsdp2,fsdp2+compile]
                                     [--allocator retain|system]

gpt-mini (4 layers, d=256, seq 128, vocab 8192, 5.3 M params), batch 8 per rank
(each rank its own), torch AdamW (lr 1e-3, weight decay 0.1) with ``fused=True`` for
every runner: the kernel the compiled step runs, so no runner is credited with a
kernel choice; clipping at 1.0 everywhere.  ZeRO-3 settings from ``configs/zero3.json``
for DeepSpeed and spmd_ort alike (``--offload`` uses ``configs/zero3_offload.json``).
Each runner is its own ``torchrun`` (so peak RSS is its own); this script starts
them one after the other in one invocation and prints one table:

Runners: ``spmd-fx`` / ``spmd-ort`` (compiled fully_shard, fx or ORT backend;
``+keep``: ``reshard_after_forward=False``), ``deepspeed`` (ZeRO-3 engine, torch
AdamW, clipping from its config), ``fsdp2`` (``fully_shard`` per block and root),
``fsdp2+compile`` (the same with ``torch.compile(model)``).  ``+bf16`` on ``spmd-*``
and ``fsdp2``: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (spmd_ort's and
FSDP2's; fp32 master parameters and AdamW state, bf16 compute, all-gathers and
reduce-scatters): half the collective bytes; on a CPU without bf16 matmul units
the compute is slower, not faster.

Host allocator: one setting for every runner, as in bench/step.py and bench/dp.py, so that no
runner is credited with it.  ``--allocator retain`` (the default): every worker keeps freed host
memory for reuse from its start (``spmd_ort.runtime.memory.retain_host_memory``: glibc mmap
threshold 1 GiB, no trimming; what the compiled step sets on its first call); ``--allocator
system``: glibc's default for every runner (``SPMD_ORT_RETAIN_HOST_MEMORY=0`` for spmd_ort).  On
gpt-mini the setting was worth ~15% of a step (bench/RESULTS.md).  Each worker reports whether
the setting was in force, and the table's title says which one every runner ran with.

* ms/step: median over ``--steps`` after 3 warm-up steps, or more until no tuner work (inductor's candidate)
  can land among the timed ones (compilation excluded);
* peak RSS per rank (``VmHWM``, max over ranks), which includes the Python
  process, torch and the framework itself;
* persistent MiB per rank: parameters + gradients + optimizer state held between
  steps (counted from the live tensors; DeepSpeed: its fp32 partitions, partitioned
  parameters and optimizer state);
* collective payload per step, counted the same way for every runner by wrapping
  ``torch.distributed``'s collectives, each call once at its outermost entry point
  (``bench/commcount.py``; gathers: bytes gathered; reduce-scatter: bytes in;
  all-reduce / broadcast: tensor bytes), vs the ZeRO-3 floor of 3x the parameter
  bytes (two all-gathers of every parameter, one reduce-scatter of every gradient).

Environment: ``DS_ACCELERATOR=cpu`` is set for DeepSpeed; ``OMP_NUM_THREADS=1``
per rank (2 ranks on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNERS = ("spmd-fx", "spmd-ort", "spmd-fx+keep", "spmd-fx+bf16", "deepspeed", "fsdp2", "fsdp2+compile", "fsdp2+bf16")
# what every runner's worker gets: "retain" calls retain_host_memory() first thing (worker), "system" leaves
# glibc as it ships, spmd_ort's step included
ALLOCATORS = {"retain": {"SPMD_ORT_RETAIN_HOST_MEMORY": "1"}, "system": {"SPMD_ORT_RETAIN_HOST_MEMORY": "0"}}


# ------------------------------------------------------------------ orchestrator
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runners", default="spmd-fx,deepspeed,fsdp2,fsdp2+compile")
    ap.add_argument("--offload", action="store_true", help="configs/zero3_offload.json (optimizer and params)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole list this many times, interleaved; ms/step is the median over all runs")
    ap.add_argument("--allocator", choices=sorted(ALLOCATORS), default="retain",
                    help="host allocator setting for every runner (default: freed memory retained for reuse)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="gradient accumulation: each rank's batch in this many micro-batches, one backward each, then "
                         "one optimizer step (FSDP2: set_requires_gradient_sync(False) on all but the last; DeepSpeed: "
                         "gradient_accumulation_steps)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    config = ROOT / "configs" / ("zero3_offload.json" if args.offload else "zero3.json")
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep, name in [(r, n) for r in range(args.repeat) for n in args.runners.split(",")]:
            if "@" in name:
                raise SystemExit(f"{name}: the allocator is one setting for every runner: --allocator retain|system")
            out = Path(tmp) / f"{name}-{rep}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--worker", name, "--steps", str(args.steps), "--allocator", args.allocator,
                   "--micro-batches", str(args.micro_batches), "--out", str(out)]
            if args.offload:
                cmd.append("--offload")
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # no glibc tuning by env
            env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "SPMD_ORT_LOG_LEVEL": "WARNING",
                        **ALLOCATORS[args.allocator]})
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0 or not out.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                result = {"error": " / ".join(tail)[-300:]}
            else:
                result = json.loads(out.read_text())
            runs.setdefault(name, []).append(result)
            print(f"{name}: done in {wall:.0f}s", file=sys.stderr, flush=True)
    results = {}
    for name, rs in runs.items():
        good = [r for r in rs if "error" not in r]
        if not good:
            results[name] = rs[0]
            continue
        results[name] = {**good[0], "ms": statistics.median(r["ms"] for r in good),
                         "rss": max(r["rss"] for r in good), "runs_ms": [round(r["ms"]) for r in good],
                         "retained": {r["retained"] for r in good}}
    report(results, args, config)


def allocator_title(results: dict, allocator: str) -> str:
    """What the title says about the host allocator: the setting asked for, or which runners did not get it."""
    want = allocator == "retain"
    off = [name for name, r in results.items() if "error" not in r and r["retained"] != {want}]
    said = "host memory retained" if want else "glibc's default host allocator"
    if not off:
        return f"{said} for all runners"
    return f"{said} asked for all runners, NOT IN FORCE for {', '.join(off)}"


def report(results: dict, args, config: Path) -> None:
    ok = [r for r in results.values() if "error" not in r]
    params = ok[0]["params"] if ok else 0
    floor = 3 * params * 4
    ds = results.get("deepspeed", {}).get("ms")
    print(f"# bench/zero3.py — gpt-mini ({params / 1e6:.2f} M params), {args.nproc} ranks, gloo, 1 thread/rank, "
          f"{config.relative_to(ROOT)}, {allocator_title(results, args.allocator)}, {args.micro_batches} "
          f"micro-batch(es) per step, median of {args.steps} steps after 3+ warm-up, {args.repeat} interleaved run(s)")
    print("| runner | ms/step | x DeepSpeed | peak RSS MiB/rank | persistent MiB/rank | collective MiB/step "
          "| x 3*params |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{r['ms'] / ds:.2f}" if ds else "-"
        print(f"| {name} | {r['ms']:.0f} | {ratio} | {r['rss'] / 2**20:.0f} | {r['persistent'] / 2**20:.1f} | "
              f"{r['comm_bytes'] / 2**20:.1f} | {r['comm_bytes'] / floor:.2f} |")
    print(f"\nparameter bytes {params * 4 / 2**20:.1f} MiB; ZeRO-3 floor 3 x params = {floor / 2**20:.1f} MiB/step; "
          f"unsharded params + AdamW state = {3 * params * 4 / 2**20:.1f} MiB, / {args.nproc} ranks = "
          f"{3 * params * 4 / args.nproc / 2**20:.1f} MiB")
    for name, r in results.items():
        if "note" in r or "runs_ms" in r:
            print(f"- {name}: {r.get('note', '')}; ms/step per run {r.get('runs_ms')}")


# ------------------------------------------------------------------ workers (under torchrun)
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from commcount import CommCounter

    counter = CommCounter().install()  # before any framework binds the functions
    from spmd_ort.runtime.memory import host_memory_retained, retain_host_memory

    if args.allocator == "retain":  # every runner from its start, as the compiled step does on its first call
        retain_host_memory()
    name = args.worker
    config = ROOT / "configs" / ("zero3_offload.json" if args.offload else "zero3.json")
    if name.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    from step import gpt_mini, settled

    torch.manual_seed(0)
    model, batch = gpt_mini(seed=rank)  # every rank trains on its own batches
    params = sum(p.numel() for p in model.parameters())
    step, persistent, note = build(name, model, config, args)
    times, comm = [], []
    warmup = 3  # and on until no tuner work (inductor's candidate) can land among the timed steps
    compiled_steps = [step.compiled_step] if hasattr(step, "compiled_step") else []
    i = 0
    while i < warmup + args.steps:
        if i == warmup and not settled(compiled_steps, args.steps):
            warmup += 1  # one more warm-up round (every rank alike: settled() agrees)
        x, y = batch()
        dist.barrier()
        counter.bytes, counter.enabled = 0, True
        t0 = time.perf_counter()
        step(x, y)
        dt = time.perf_counter() - t0
        counter.enabled = False
        if i >= warmup:
            times.append(dt)
            comm.append(counter.bytes)
        i += 1
    from spmd_ort.runtime.memory import max_rss_bytes

    stats = torch.tensor([statistics.median(times), max_rss_bytes(),
                          persistent(), statistics.median(comm)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    in_force = torch.tensor([float(host_memory_retained())])
    dist.all_reduce(in_force, op=dist.ReduceOp.MIN)  # retained only if every rank retained
    retained = bool(in_force.item())
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ms": stats[0].item() * 1e3, "rss": stats[1].item(),
                                              "persistent": stats[2].item(), "comm_bytes": stats[3].item(),
                                              "params": params, "retained": retained,
                                              **({"note": note} if note else {})}))
    dist.barrier()
    dist.destroy_process_group()


def _tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def build(name: str, model, config: Path, args):
    """(step(x, y), persistent-bytes function, note) for one runner."""
    import torch

    from step import make_adamw, train_step

    if name.startswith("spmd"):
        import spmd_ort

        backend = name.split("-")[1].split("+")[0]
        mode = spmd_ort.DataParallel.from_deepspeed_config(config)
        if name.endswith("+keep"):  # parameters stay gathered from forward to backward
            mode = dataclasses.replace(mode, reshard_after_forward=False)
        if name.endswith("+bf16"):
            mode = dataclasses.replace(mode, mixed_precision=spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        opt = make_adamw(model.parameters())
        n = args.micro_batches

        def spmd_step(model, opt, x, y):  # gradient accumulation inside the compiled step
            for xm, ym in zip(x.chunk(n), y.chunk(n)):
                out = model(xm)
                (torch.nn.functional.cross_entropy(out.flatten(0, -2), ym.flatten()) / n).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        compiled = spmd_ort.compile(parallel_mode=mode, backend=backend)(train_step if n == 1 else spmd_step)

        def persistent():
            return spmd_ort.distributed.sharding.persistent_bytes(model, opt)["total"]

        def run(x, y):
            return compiled(model, opt, x, y)

        run.compiled_step = compiled
        return run, persistent, f"{mode}"
    if name.startswith("deepspeed"):
        import deepspeed

        cfg = json.loads(config.read_text())
        cfg["gradient_clipping"] = 1.0  # the other runners clip in the step (bench/step.py train_step)
        n = args.micro_batches
        if n > 1:  # DeepSpeed's own accumulation: the optimizer steps at every n-th engine.step()
            cfg["gradient_accumulation_steps"] = n
            cfg["train_micro_batch_size_per_gpu"] = max(1, cfg.get("train_micro_batch_size_per_gpu", 8) // n)
            cfg.pop("train_batch_size", None)
        opt = make_adamw(model.parameters())
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

        def ds_step(x, y):
            for xm, ym in zip(x.chunk(n), y.chunk(n)):
                out = engine(xm)
                loss = torch.nn.functional.cross_entropy(out.flatten(0, -2), ym.flatten())
                engine.backward(loss)  # (DeepSpeed scales the loss by 1 / gradient_accumulation_steps)
                engine.step()

        def persistent():
            inner = engine.optimizer
            ts = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
            ts += list(getattr(inner, "fp32_partitioned_groups_flat", []))
            for st in inner.optimizer.state.values():
                ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
            ts += [g for g in getattr(inner, "averaged_gradients", {}).values() if isinstance(g, torch.Tensor)]
            return _tensor_bytes(ts)

        return ds_step, persistent, "clips through its config (gradient_clipping 1.0); fp32 partitions counted"
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if name.endswith("+bf16") else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = make_adamw(model.parameters())
        fwd = torch.compile(model) if name.endswith("+compile") else model

        n = args.micro_batches

        def fsdp_step(x, y):
            for j, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
                model.set_requires_gradient_sync(j + 1 == n)  # reduce-scatter after the last micro-batch only
                out = fwd(xm)
                loss = torch.nn.functional.cross_entropy(out.flatten(0, -2), ym.flatten()) / n
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def persistent():
            ts = [p.to_local() for p in model.parameters()]
            for st in opt.state.values():
                ts += [v.to_local() if hasattr(v, "to_local") else v for v in st.values()
                       if isinstance(v, torch.Tensor)]
            return _tensor_bytes(ts)

        return fsdp_step, persistent, "fully_shard per block + root" + (", torch.compile(model)"
                                                                        if name.endswith("+compile") else "") \
            + (", mp_policy param_dtype=bfloat16" if name.endswith("+bf16") else "")
    raise SystemExit(f"unknown runner {name}; choose from {', '.join(RUNNERS)}")


if __name__ == "__main__":
    main()
