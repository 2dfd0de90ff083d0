"""A model bigger than you want on one rank, on 2 ranks (gloo, CPU): each rank's resident memory, three ways.

Run:  .venv/bin/python bench/big_model.py [--steps 3] [--layers 7] [--width 1024] [--malloc-threshold 131072]

A GPT (examples/gpt.py; default 7 layers, d=1024, vocab 8192, seq 128: ~97 M parameters, ~370 MiB of fp32
weights) whose initial weights are one safetensors file, trained with AdamW (fused) under ZeRO-3 / FSDP2,
batch 2 per rank, built and loaded three ways, each its own ``torchrun`` (so each RSS is its own):

* ``materialised``: today's path without ``parallelize``: the whole model built on every rank and loaded
  whole from the file (``load_safetensors`` into the unsharded model), then ``spmd_ort.compile(parallel_mode=
  DataParallel(parallel_style="fully_shard"))``, whose first call shards it;
* ``meta+parallelize``: built on the meta device, ``spmd_ort.parallelize``, ``to_empty``, ``load_safetensors``
  (each rank reads its rows only), then the same compiled step (fx);
* ``fsdp2``: the peer: built on the meta device, FSDP2's ``fully_shard`` per block and root, ``to_empty``, each
  tensor read whole from the file and ``distribute_tensor``'d (one at a time), eager steps.

Per rank (max over the 2 ranks), resident memory above the process's baseline (after imports and the process
group, before the model), in MiB and in units of the full fp32 weights: after loading (``loaded``), and the peak
over the steps (``peak``, ``VmHWM``).  The full training state (weights, gradients, AdamW's two moments) is 4x
the weights; on 2 ranks ZeRO-3's share of it is 2x.

``--malloc-threshold B`` runs every runner with glibc's mmap and trim thresholds fixed at B bytes
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, as bench/memory.py does), so that freed memory goes back
to the system and resident memory follows the bytes live; by default glibc's own (dynamic) thresholds keep
freed heap memory resident, and the peak includes what each runner's allocation pattern leaves there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNERS = ("materialised", "meta+parallelize", "fsdp2")
MIB = 2**20


def config(args):
    from examples.gpt import GPTConfig

    return GPTConfig(vocab=8192, seq=128, d=args.width, heads=16, layers=args.layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--malloc-threshold", type=int, default=None,
                    help="glibc's mmap and trim thresholds for every runner, bytes (default: glibc's own)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        worker(args)
        return
    import torch
    from safetensors.torch import save_file

    from examples.gpt import GPT

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "model.safetensors"
        torch.manual_seed(0)
        model = GPT(config(args))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        params = sum(p.numel() for p in model.parameters())
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}, str(file))
        del model
        for name in args.runners.split(","):
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "--worker", name, "--steps", str(args.steps), "--layers", str(args.layers), "--width", str(args.width),
                   "--file", str(file), "--out", str(out)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "SPMD_ORT_LOG_LEVEL": "WARNING"}
            if args.malloc_threshold is not None:
                env.update(MALLOC_MMAP_THRESHOLD_=str(args.malloc_threshold),
                           MALLOC_TRIM_THRESHOLD_=str(args.malloc_threshold))
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not out.exists():
                results[name] = {"error": " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[-300:]}
            else:
                results[name] = json.loads(out.read_text())
            print(f"{name}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    report(results, args, params, weights)


def report(results: dict, args, params: int, weights: int) -> None:
    print(f"\nGPT {args.layers} layers, d={args.width}: {params / 1e6:.1f} M parameters, {weights / MIB:.0f} MiB of fp32 "
          f"weights; 2 ranks, AdamW, batch 2 x 128 per rank, {args.steps} steps; per rank, max over ranks, above "
          "the process's baseline; glibc's "
          + (f"mmap/trim thresholds fixed at {args.malloc_threshold} B" if args.malloc_threshold is not None
             else "own allocator thresholds") + "\n")
    print("| runner | loaded MiB | loaded / weights | peak MiB | peak / weights | bytes read / weights | s/step |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error']} | | | | | |")
            continue
        print(f"| {name} | {r['loaded'] / MIB:.0f} | {r['loaded'] / weights:.2f}x | {r['peak'] / MIB:.0f} | "
              f"{r['peak'] / weights:.2f}x | {r['read'] / weights:.2f}x | {r['step_s']:.2f} |")


# ------------------------------------------------------------------ workers (under torchrun)
def _rss() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import spmd_ort
    from examples.gpt import GPT

    import safetensors.torch  # noqa: F401 - every runner's imports before the baseline
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = config(args)
    gc.collect()
    base = _rss()[0]
    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    read = 0
    if args.worker == "materialised":
        model = GPT(cfg)
        read = spmd_ort.load_safetensors(model, args.file).bytes_read
    elif args.worker == "meta+parallelize":
        with torch.device("meta"):
            model = GPT(cfg)
        spmd_ort.parallelize(model, mode)
        model.to_empty(device="cpu")
        read = spmd_ort.load_safetensors(model, args.file).bytes_read
    else:
        from safetensors import safe_open
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor

        with torch.device("meta"):
            model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        with safe_open(args.file, framework="pt") as f, torch.no_grad():
            for name, p in model.named_parameters():
                full = f.get_tensor(name)
                read += full.numel() * full.element_size()
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
                del full
    gc.collect()
    loaded = _rss()[0] - base
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def step_fn(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step = step_fn if args.worker == "fsdp2" else spmd_ort.compile(parallel_mode=mode, backend="fx")(step_fn)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps + 1):
        x = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g)
        t0 = time.perf_counter()
        step(model, opt, x, x)
        times.append(time.perf_counter() - t0)
    peak = _rss()[1] - base
    result = torch.tensor([loaded, peak, read], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"loaded": result[0].item(), "peak": result[1].item(),
                                              "read": result[2].item(), "step_s": sorted(times[1:])[len(times[1:]) // 2]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
