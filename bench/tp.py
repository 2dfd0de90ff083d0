"""Tensor-parallel step time (gloo, CPU): compiled (fx, ort) vs eager DTensor tensor parallelism, 1-D or 2-D.

Run:  .venv/bin/torchrun --standalone --nproc_per_node=2 bench/tp.py [--steps 7]
      .venv/bin/torchrun --standalone --nproc_per_node=4 bench/tp.py --dp 2   # 2-D: dp 2 x tp 2
      .venv/bin/torchrun --standalone --nproc_per_node=2 bench/tp.py --loss-parallel   # head split over the vocab
      .venv/bin/torchrun --standalone --nproc_per_node=2 bench/tp.py --runners eager,spmd-fx,spmd-fx-nosplit
                                            # A/B: a runner without split_replicated_matmuls_pass
      .venv/bin/python bench/tp.py --peak-rss [--nproc 4 --dp 2]            # peak RSS, one torchrun per runner

2-D (``--dp 2``): the plan over ``tp``; the compiled runners average gradients over ``dp`` (``TensorParallel(plan,
mesh, data_parallel=DataParallel())``, bucketed all-reduces; ``spmd-fx+fsdp`` / ``spmd-ort+fsdp``:
``DataParallel(parallel_style="fully_shard")``, FSDP2 + TP compiled), ``eager`` is FSDP2 + TP as torchtitan
builds it (``fully_shard`` of every block and the root on the dp dim of the same mesh); each dp replica draws its
own batch.

gpt-mini (4 layers, d=256, seq 128, vocab 8192, separate q/k/v) parallelized Megatron-style with torch's own plan
(``examples.gpt.tensor_parallel_plan``: q/k/v and the MLP's first linear column-wise, the projections back
row-wise), batch 8, the same batch on every rank (one model per tensor-parallel group), AdamW(fused=True) for
every runner.  ``eager`` runs ``parallelize_module`` and the step as written (DTensor dispatch on every op of every
step); ``spmd-fx`` / ``spmd-ort`` compile the same step with ``parallel_mode=spmd_ort.TensorParallel(plan)``.
The runners alternate step by step in one run, with a barrier and a short pause before each timed step; rank 0
prints the median ms/step, the ratio to eager, the collectives and bytes per step (eager's counted with
``CommDebugMode`` on an untimed step) and the bytes each rank holds between steps.

Peak RSS (``--peak-rss``, run with ``python``, not ``torchrun``): the runners share one process in the timed run,
so each runner's peak resident memory is measured apart: one ``torchrun`` per runner (the same model, plan, mesh
and steps), each rank's ``VmHWM`` after its steps, the largest over the ranks. It includes the Python process,
torch, the framework and compilation, as a user's process would.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import spmd_ort  # noqa: E402
from examples.gpt import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402
from spmd_ort.distributed.sharding import persistent_bytes  # noqa: E402
from step import make_adamw, settled  # noqa: E402


LOSS_PARALLEL = False  # --loss-parallel: the head split over the vocabulary, the loss under loss_parallel()


def train_step(model, opt, x, y):
    out = model(x)
    with loss_parallel() if LOSS_PARALLEL else contextlib.nullcontext():
        loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def eager_step(model, opt, x, y):
    """The step as eager tensor parallelism runs it: the fused AdamW kernel takes one list of parameters, DTensor
    and plain (norms, embeddings) together, which DTensor accepts only with the plain ones implicitly replicated."""
    with implicit_replication():
        return train_step(model, opt, x, y)


@contextlib.contextmanager
def _environ(**values):
    """Environment variables set (an empty value: left unset) while the block runs."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--runners", default="eager,spmd-fx,spmd-ort")
    ap.add_argument("--dp", type=int, default=1, help="2-D: data-parallel replicas (mesh dp x tp)")
    ap.add_argument("--peak-rss", action="store_true", help="peak RSS per runner, each in its own torchrun")
    ap.add_argument("--nproc", type=int, default=2, help="--peak-rss: ranks per torchrun")
    ap.add_argument("--loss-parallel", action="store_true",
                    help="the head untied and split over the vocabulary, the loss under loss_parallel() (every runner)")
    ap.add_argument("--rss-out", help=argparse.SUPPRESS)  # a --peak-rss worker: where rank 0 writes its result
    args = ap.parse_args()
    if args.peak_rss:
        peak_rss(args)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spmd_ort.runtime.memory.retain_host_memory()  # every runner, from its first step
    global LOSS_PARALLEL
    LOSS_PARALLEL = args.loss_parallel
    cfg = GPTConfig(vocab=8192, seq=128, d=256, heads=4, layers=4, split_qkv=True, tie_head=not args.loss_parallel)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh2d = init_device_mesh("cpu", (args.dp, world // args.dp), mesh_dim_names=("dp", "tp")) if args.dp > 1 else None
    dp_rank = mesh2d["dp"].get_local_rank() if mesh2d is not None else 0
    g = torch.Generator().manual_seed(dp_rank)  # the same batches on every rank of a tensor-parallel group

    def batch():
        return (torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g),
                torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g))

    mesh = mesh2d["tp"] if mesh2d is not None else init_device_mesh("cpu", (world,))
    plan = tensor_parallel_plan(loss_parallel=args.loss_parallel)
    runners = {}
    for name in args.runners.split(","):
        m = copy.deepcopy(model)
        if name == "eager":
            m = parallelize_module(m, mesh, plan)
            if mesh2d is not None:  # FSDP2 + TP
                from torch.distributed.fsdp import fully_shard

                for block in m.blocks:
                    fully_shard(block, mesh=mesh2d["dp"])
                fully_shard(m, mesh=mesh2d["dp"])
            runners[name] = (m, eager_step, None)
        else:
            backend, _, style = name.split("-")[1].partition("+")  # spmd-fx, spmd-ort+fsdp (2-D: fully_shard)
            dp_mode = spmd_ort.DataParallel(parallel_style="fully_shard" if style == "fsdp" else "replicate")
            mode = spmd_ort.TensorParallel(plan, mesh=mesh) if mesh2d is None else spmd_ort.TensorParallel(
                plan, mesh=mesh2d, data_parallel=dp_mode)
            without = name.split("-")[2:]  # spmd-fx-nosplit: without split_replicated_matmuls_pass (an A/B runner)
            disabled = ",".join({"nosplit": "split_replicated_matmuls_pass"}[w] for w in without)
            with _environ(SPMD_ORT_DISABLE_PASSES=disabled):
                step = spmd_ort.compile(backend=backend, parallel_mode=mode)
            runners[name] = (m, step(train_step), backend)
    opts = {k: make_adamw(m.parameters()) for k, (m, _, _) in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in runners}
    warmup = 3  # and on until no tuner work (inductor's candidate) can land among the timed steps
    compiled_steps = [fn for _, fn, backend in runners.values() if backend is not None]
    eager_comm = None
    i = 0
    while i < warmup + args.steps:
        if i == warmup and not settled(compiled_steps, args.steps):
            warmup += 1  # one more warm-up round (every rank alike: settled() agrees)
        x, y = batch()
        for k, (m, fn, backend) in runners.items():
            dist.barrier()
            time.sleep(0.05)
            if k == "eager" and i == 1:  # an untimed step, counted
                with CommDebugMode() as eager_comm:
                    fn(m, opts[k], x, y)
                continue
            t0 = time.perf_counter()
            fn(m, opts[k], x, y)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[k].append(dt)
        i += 1
    if args.rss_out:  # a --peak-rss worker: the largest peak over the ranks, and this run's step time
        from spmd_ort.runtime.memory import max_rss_bytes

        peak = torch.tensor([max_rss_bytes()], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            [k] = runners
            Path(args.rss_out).write_text(json.dumps({"rss": peak.item(), "ms": statistics.median(times[k]) * 1e3}))
    elif rank == 0:
        base = statistics.median(times["eager"]) if "eager" in times else None
        params = sum(p.numel() for p in model.parameters())
        layout = (f"tensor parallel over {world} ranks, the same batch of 8 on every rank" if mesh2d is None else
                  f"2-D: dp {args.dp} x tp {world // args.dp} ({world} ranks), a batch of 8 per dp replica; eager is "
                  "FSDP2 + TP")
        head = ", untied head split over the vocabulary, loss_parallel()" if args.loss_parallel else ""
        print(f"# bench/tp.py — gpt-mini split q/k/v{head} ({params / 1e6:.2f} M params), {layout}, gloo, "
              f"{torch.get_num_threads()} thread(s)/rank, host memory retained for every runner, median of "
              f"{args.steps}")
        print("| runner | ms/step | x eager | collectives/step | MiB/step | persistent MiB/rank |")
        print("|---|---|---|---|---|---|")
        for k, (m, fn, backend) in runners.items():
            ms = statistics.median(times[k]) * 1e3
            ratio = f"{ms / (base * 1e3):.2f}" if base else "-"
            if backend is None:
                counts = eager_comm.get_comm_counts() if eager_comm is not None else {}
                calls = ", ".join(f"{str(op).split('.')[-1]} x{n}" for op, n in counts.items()) or "-"
                mib = "-"
            else:
                c = fn.comm
                calls = ", ".join(f"{kind} x{n}" for kind, n in (("all_reduce", c.all_reduce_calls),
                                                                  ("all_gather", c.all_gather_calls),
                                                                  ("reduce_scatter", c.reduce_scatter_calls)) if n)
                mib = f"{(c.all_reduce_bytes + c.all_gather_bytes + c.reduce_scatter_bytes) / 2**20:.2f}"
            held = persistent_bytes(m, opts[k])["total"] / 2**20
            print(f"| {k} | {ms:.1f} | {ratio} | {calls} | {mib} | {held:.1f} |", flush=True)
    runners.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def peak_rss(args) -> None:
    """One ``torchrun`` per runner (``--rss-out``); a table of each one's peak RSS per rank against eager's."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runners.split(","):
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--runners", name, "--steps", str(args.steps), "--dp", str(args.dp),
                   "--rss-out", str(out), *(["--loss-parallel"] if args.loss_parallel else [])]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "SPMD_ORT_LOG_LEVEL": "WARNING"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(f"{name} failed:\n{(proc.stderr or proc.stdout)[-2000:]}")
            results[name] = json.loads(out.read_text())
    layout = f"tensor parallel over {args.nproc} ranks" if args.dp == 1 else \
        f"2-D: dp {args.dp} x tp {args.nproc // args.dp} ({args.nproc} ranks); eager is FSDP2 + TP"
    print(f"# bench/tp.py --peak-rss — gpt-mini split q/k/v, {layout}, one torchrun per runner, "
          f"{args.steps} steps after 3+ warm-up, 1 thread/rank")
    print("| runner | peak RSS MiB/rank | x eager | ms/step (alone, not interleaved) |")
    print("|---|---|---|---|")
    base = results.get("eager", {}).get("rss")
    for name, r in results.items():
        ratio = f"{r['rss'] / base:.2f}" if base else "-"
        print(f"| {name} | {r['rss'] / 2**20:.0f} | {ratio} | {r['ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
