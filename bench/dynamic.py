"""Dynamic shapes: 20 distinct sequence lengths, compiled programs, total and steady step time, in one run.

Run:  .venv/bin/python bench/dynamic.py [--lengths 20] [--warmup 2] [--samples 5] [--straggler]
      .venv/bin/python bench/dynamic.py --tp [--lengths 8]

A small LM (GPT, vocab 512, d 128, 2 layers, batch 8) trains over 20 distinct
lengths (16..128, shuffled), then over the same lengths again.  Per runner:
programs compiled (spmd_ort: traced variants; torch.compile: frames compiled),
the wall time of the first pass (what a new length costs: traces, exports,
compiles) and the steady step once each length is compiled: per length,
``--warmup`` untimed calls (the static runners keep 8 programs, so the first
may trace again) then ``--samples`` timed ones, their median; the table shows
the median of those over the lengths.
Runners: ``eager`` (AdamW fused, the baseline); ``fx``/``ort`` with
``dynamic=None`` (automatic), ``True`` and ``False`` (one program per shape);
``inductor`` (``torch.compile(model, dynamic=None)``).  The runners alternate
step by step.  The last column is the median over lengths of the automatic
program's step over the static program's step at the same length.

``--tp``: the same over tensor parallelism on 2 ranks (torchrun, gloo, one thread each; ``--lengths`` of
them): the model with separate q/k/v under Megatron's plan (``examples.gpt.tensor_parallel_plan``), eager
DTensor tensor parallelism against the compiled step with ``TensorParallel(plan)``, ``dynamic=None`` and
``False``, on fx and ORT; the same batch on both ranks.

``--straggler``: 2 ranks (torchrun, gloo, one thread each) train the compiled
step (fx, replicate) on a dataset of lengths drawn from a long-tailed
distribution, one epoch with ``DistributedSampler`` and one with
``spmd_ort.distributed.data.LoadBalancingDistributedSampler`` + batch sampler: the mean
per-step difference in tokens between the ranks and the epoch's wall time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# the "ort" runner is the default backend as users get it (backend="auto"), as in RESULTS' tables
DEFAULT_BACKENDS = {"ort": "auto"}


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import spmd_ort  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab=512, seq=128, d=128, heads=4, layers=2)
BATCH = 8


def train_step(model, opt, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def runners(base) -> dict:
    out = {}
    for name in ("eager", "fx-auto", "fx-true", "fx-false", "ort-auto", "ort-true", "ort-false", "inductor"):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        if name == "eager":
            fn = train_step
        elif name == "inductor":
            cm = torch.compile(m, dynamic=None)
            fn = lambda _m, o, x, y, cm=cm: train_step(cm, o, x, y)  # noqa: E731
        else:
            backend, dyn = name.split("-")
            fn = spmd_ort.compile(backend=DEFAULT_BACKENDS.get(backend, backend), dynamic={"auto": None, "true": True, "false": False}[dyn])(
                train_step)
        out[name] = (m, opt, fn)
    return out


def programs(name: str, fn) -> int:
    if isinstance(fn, spmd_ort.CompiledStep):
        return fn.transitions.traces
    if name == "inductor":
        import torch._dynamo.utils as du

        return int(du.counters["stats"]["unique_graphs"])
    return 0


def measure(rs: dict, lengths: list[int], batches: dict, warmup: int, n_samples: int, sync=lambda: None) -> dict:
    """The first pass over ``lengths`` (every length new) and the steady step per length, runners alternating;
    ``sync`` runs before each timed call (the ranks' barrier)."""
    first = {k: 0.0 for k in rs}
    for n in lengths:  # the first pass: every length is new
        x, y = batches[n]
        for k, (m, opt, fn) in rs.items():
            sync()
            time.sleep(0.02)
            t0 = time.perf_counter()
            fn(m, opt, x, y)
            first[k] += time.perf_counter() - t0
    compiled = {k: programs(k, fn) for k, (_m, _o, fn) in rs.items()}
    # steady: per length, warm-up calls (a static program evicted from the LRU of 8 is traced again by the
    # first, so every runner is timed on a program it holds), then timed samples; runners alternate call by call
    steady: dict[str, dict[int, float]] = {k: {} for k in rs}
    for n in lengths:
        x, y = batches[n]
        samples: dict[str, list[float]] = {k: [] for k in rs}
        for call in range(warmup + n_samples):
            for k, (m, opt, fn) in rs.items():
                sync()
                time.sleep(0.02)
                t0 = time.perf_counter()
                fn(m, opt, x, y)
                if call >= warmup:
                    samples[k].append(time.perf_counter() - t0)
        for k in rs:
            steady[k][n] = statistics.median(samples[k])
    return {"first": first, "compiled": compiled, "steady": {k: {str(n): t for n, t in v.items()}
                                                             for k, v in steady.items()}, "lengths": lengths}


def print_table(r: dict) -> None:
    lengths, steady = r["lengths"], r["steady"]
    eager = statistics.median(steady["eager"].values())
    print("| runner | programs after the first pass | first pass (s) | steady step (ms) | vs eager | "
          "auto / static at the same length |")
    print("|---|---|---|---|---|---|")
    for k in steady:
        med = statistics.median(steady[k].values())
        ratio = ""
        if k.endswith("-auto"):
            static = k.replace("-auto", "-false")
            # same lengths, each step against the static program's step at that length
            ratio = f"{statistics.median(steady[k][str(n)] / steady[static][str(n)] for n in lengths):.2f}"
        print(f"| {k} | {r['compiled'][k]} | {r['first'][k]:.1f} | {med * 1e3:.1f} | {med / eager:.2f} | {ratio} |",
              flush=True)


def length_batches(cfg: GPTConfig, n_lengths: int) -> tuple[list[int], dict]:
    lengths = random.Random(0).sample(range(16, cfg.seq + 1), n_lengths)
    g = torch.Generator().manual_seed(0)  # (under --tp: the same batches on every rank)
    return lengths, {n: (torch.randint(0, cfg.vocab, (BATCH, n), generator=g),
                         torch.randint(0, cfg.vocab, (BATCH, n), generator=g)) for n in lengths}


def bench(n_lengths: int, warmup: int, n_samples: int) -> None:
    torch.manual_seed(0)
    base = GPT(CFG)
    lengths, batches = length_batches(CFG, n_lengths)
    r = measure(runners(base), lengths, batches, warmup, n_samples)
    print(f"{n_lengths} distinct lengths (16..{CFG.seq}), batch {BATCH}, GPT d={CFG.d} x{CFG.layers} layers, "
          f"vocab {CFG.vocab}; torch {torch.__version__}, {torch.get_num_threads()} threads; steady step: per length "
          f"the median of {n_samples} calls after {warmup} warm-up, then the median over lengths")
    print_table(r)


# ---------------------------------------------------------------------- tensor parallelism (2 ranks)
def tp_worker(out: Path, n_lengths: int, warmup: int, n_samples: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    from examples.gpt import tensor_parallel_plan

    dist.init_process_group("gloo")
    spmd_ort.runtime.memory.retain_host_memory()  # every runner, from its first step
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = dataclasses.replace(CFG, split_qkv=True)
    torch.manual_seed(0)
    base = GPT(cfg)
    lengths, batches = length_batches(cfg, n_lengths)

    def eager_step(model, opt, x, y):  # the fused AdamW takes DTensor and plain parameters in one list
        with implicit_replication():
            return train_step(model, opt, x, y)

    rs = {}
    for name in ("eager", "fx-auto", "fx-false", "ort-auto", "ort-false"):
        m = copy.deepcopy(base)
        if name == "eager":
            m = parallelize_module(m, mesh, tensor_parallel_plan())
            fn = eager_step
        else:
            backend, dyn = name.split("-")
            fn = spmd_ort.compile(backend=DEFAULT_BACKENDS.get(backend, backend), dynamic={"auto": None, "false": False}[dyn],
                                  parallel_mode=spmd_ort.TensorParallel(tensor_parallel_plan(), mesh=mesh))(train_step)
        rs[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True), fn)
    r = measure(rs, lengths, batches, warmup, n_samples, sync=dist.barrier)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(r))
    dist.destroy_process_group()


def tensor_parallel(n_lengths: int, warmup: int, n_samples: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--tp-worker", str(out), "--lengths", str(n_lengths), "--warmup", str(warmup),
               "--samples", str(n_samples)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        r = json.loads(out.read_text())
    print(f"\ntensor parallelism, 2 ranks (gloo, 1 thread each): {n_lengths} distinct lengths (16..{CFG.seq}), "
          f"batch {BATCH} (the same on both ranks), GPT d={CFG.d} x{CFG.layers} layers with separate q/k/v, vocab "
          f"{CFG.vocab}, Megatron's plan; eager = DTensor tensor parallelism (parallelize_module); steady step: per "
          f"length the median of {n_samples} calls after {warmup} warm-up, then the median over lengths")
    print_table(r)


# ---------------------------------------------------------------------- straggler (2 ranks)
def straggler_worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    from spmd_ort.distributed.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = random.Random(1)
    lengths = [min(CFG.seq, max(8, int(rng.lognormvariate(3.4, 0.6)))) for _ in range(384)]
    per_step = 8

    def batches_plain(epoch):
        sampler = DistributedSampler(range(len(lengths)), num_replicas=world, rank=rank, seed=0)
        sampler.set_epoch(epoch)
        idx = list(sampler)
        return [idx[i:i + per_step] for i in range(0, len(idx) - per_step + 1, per_step)]

    def batches_balanced(epoch):
        sampler = LoadBalancingDistributedSampler(range(len(lengths)), complexity_fn=lambda i: lengths[i],
                                                  num_replicas=world, rank=rank, seed=0)
        bs = LoadBalancingDistributedBatchSampler(
            sampler, batch_fn=lambda idx: [idx[i:i + per_step] for i in range(0, len(idx) - per_step + 1, per_step)])
        bs.set_epoch(epoch)
        return list(bs)

    result = {}
    for name, make in (("DistributedSampler", batches_plain), ("LoadBalancingDistributedSampler", batches_balanced)):
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        step = spmd_ort.compile(backend="fx")(train_step)
        g = torch.Generator().manual_seed(rank)
        spreads, t_total = [], 0.0
        for epoch in range(2):  # epoch 0 warms up (compiles); epoch 1 is measured
            dist.barrier()
            t0 = time.perf_counter()
            for idx in make(epoch):
                n = max(lengths[i] for i in idx)  # padded to the batch's longest sample
                x = torch.randint(0, CFG.vocab, (len(idx), n), generator=g)
                step(model, opt, x, x)
                if epoch == 1:
                    tokens = torch.tensor([float(n * len(idx))])
                    both = [torch.zeros(1) for _ in range(world)]
                    dist.all_gather(both, tokens)
                    spreads.append(float(max(both) - min(both)) / float(max(both)))
            dist.barrier()
            t_total = time.perf_counter() - t0
        result[name] = {"epoch_s": t_total, "spread": statistics.mean(spreads), "traces": step.transitions.traces}
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def straggler() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "straggler.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--straggler-worker", str(out)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        result = json.loads(out.read_text())
    print("\n2 ranks, compiled step (fx, replicate, dynamic shapes automatic), 384 samples of long-tailed lengths "
          "8..128, 8 per batch per rank padded to the batch's longest; second epoch:")
    print("| sampler | mean per-step token spread between ranks | epoch wall time (s) | programs |")
    print("|---|---|---|---|")
    for name, r in result.items():
        print(f"| {name} | {r['spread']:.0%} | {r['epoch_s']:.1f} | {r['traces']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per length and runner before the samples")
    ap.add_argument("--samples", type=int, default=5, help="timed calls per length and runner (their median)")
    ap.add_argument("--straggler", action="store_true")
    ap.add_argument("--tp", action="store_true", help="only the tensor-parallel table (2 ranks)")
    ap.add_argument("--straggler-worker", help=argparse.SUPPRESS)
    ap.add_argument("--tp-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.straggler_worker:
        straggler_worker(Path(args.straggler_worker))
        return
    if args.tp_worker:
        tp_worker(Path(args.tp_worker), args.lengths, args.warmup, args.samples)
        return
    # an empty ONNX cache for this run (the workers inherit it): the first pass's time is what new lengths cost,
    # exports included, not what an earlier run left on disk
    cache = tempfile.mkdtemp(prefix="bench_dynamic_onnx_cache_")
    os.environ["SPMD_ORT_CACHE_DIR"] = cache
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; "
          f"onnxruntime {__import__('onnxruntime').__version__}; an empty ONNX cache ({cache})")
    if args.warmup < 1 or args.samples < 1:
        raise SystemExit("--warmup and --samples must be at least 1")
    if args.tp:
        tensor_parallel(args.lengths, args.warmup, args.samples)
        return
    bench(args.lengths, args.warmup, args.samples)
    if args.straggler:
        straggler()


if __name__ == "__main__":
    main()
