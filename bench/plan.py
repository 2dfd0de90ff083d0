"""bench/plan.py: ``train_step.plan()`` at real size, and checked against real ranks (issue 44).

1. Llama-3-8B-shaped (transformers' LlamaForCausalLM from its config, on the meta device; batch 1 x 4096):
   ``fully_shard`` over 64 ranks and tensor parallel 8 x fully_shard 8, each planned in a fresh process
   (``python -m spmd_ort.plan``): wall time, peak resident memory, per-rank bytes.
2. Planning time against depth: the same model with 8, 16 and 32 layers (fully_shard, 64 ranks).
3. Plan against measurement: the GPT of tests/dist/plan_check.py (``--size bench``: d 256, 4 layers, T 128) on
   2 real gloo ranks (replicate, fully_shard, tensor parallel) and 4 (2-D), fx: collective and state bytes
   (exact), the step's peak (the planned ``peak`` against the measured peak RSS above the process's baseline
   plus the planned state) and the step time with the "this CPU" spec (1 thread, as torchrun gives each rank).

    python bench/plan.py [--skip-8b] [--skip-real]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "dist")]


def cli(*args: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "plan.json"
        proc = subprocess.run([sys.executable, "-m", "spmd_ort.plan", *args, "--json", str(out)], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        return json.loads(out.read_text())


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def llama() -> None:
    print("### Llama-3-8B-shaped, batch 1 x 4096, AdamW, planned for H100 (one process, fresh each)\n")
    print("| layout | ranks | planned in | peak RSS | params + AdamW / rank (GiB) | 12 B x N / ranks | "
          "activations (GiB) | peak / rank (GiB) | fits 80 GB | all-gather / reduce-scatter / all-reduce (GiB) | "
          "predicted step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, par in (("fully_shard", "fully_shard"), ("tp 8 x fully_shard 8", "tp:8")):
        r = cli("--model", "llama3-8b", "--world-size", "64", "--parallel", par, "--seq", "4096")
        b, c = r["per_rank_bytes"], r["comm_bytes"]
        ideal = 12 * r["params_total"] / 64
        print(f"| {name} | 64 | {r['wall_s']:.1f} s | {gib(r['max_rss'])} GiB | {gib(b['params'] + b['optimizer'])} "
              f"| {gib(ideal)} | {gib(b['activations'])} | {gib(b['peak'])} | {r['fits']} | "
              f"{gib(c.get('all_gather', 0))} / {gib(c.get('reduce_scatter', 0))} / {gib(c.get('all_reduce', 0))} "
              f"| {r['predicted_step_s']:.2f} s |")
    print("\n### Planning time against depth (fully_shard, 64 ranks, batch 1 x 4096)\n")
    print("| layers | parameters | graph nodes | planned in | peak RSS |")
    print("|---|---|---|---|---|")
    first = None
    for layers in (8, 16, 32):
        r = cli("--model", "llama3-8b", "--layers", str(layers), "--world-size", "64", "--seq", "4096")
        first = first or r["wall_s"]
        print(f"| {layers} | {r['params_total'] / 1e9:.2f} B | {r['graph_nodes']:,} | {r['wall_s']:.1f} s "
              f"({r['wall_s'] / first:.2f}x) | {gib(r['max_rss'])} GiB |")


def real() -> None:
    import plan_check
    import torch

    import spmd_ort
    from examples.gpt import GPT
    from helpers import grads_kept_step
    from spmd_ort.plan import DeviceSpec

    spec = DeviceSpec.this_cpu(threads=1)
    print(f"\n### Plan against 2 and 4 real gloo ranks (fx; GPT d 256, 4 layers, T 128, batch 8 per replica); "
          f"device spec measured: {spec.flops[torch.float32] / 1e9:.0f} GFLOP/s, memory "
          f"{spec.memory_bw / 1e9:.1f} GB/s, link {spec.intra_bw / 1e9:.2f} GB/s\n")
    print("| layout | ranks | collective bytes | params / grads / AdamW bytes | planned peak | measured peak | "
          "ratio | predicted step | measured step | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cfg = plan_check.config("bench")
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as d:
            # glibc's thresholds fixed (as bench/big_model.py --malloc-threshold): freed memory leaves the RSS
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
                   "MALLOC_TRIM_THRESHOLD_": "131072"}
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={world}", str(ROOT / "tests" / "dist" / "plan_check.py"),
                                   "--out", d, "--size", "bench", "--batch", "8", "--steps", "6"],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            measured = json.loads((Path(d) / "rank0.json").read_text())
        for name, mode in plan_check.modes(world).items():
            m = measured[name]
            with torch.device("meta"):
                model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            step = spmd_ort.compile(parallel_mode=mode, backend="fx")(grads_kept_step)
            p = step.plan(model, opt, *plan_check.batch(cfg, 8, 0), world_size=world, device=spec)
            b, held = p.per_rank_bytes, m["persistent"]
            comm_ok = p.comm_bytes == m["comm_bytes"] and p.comm_calls == m["comm_calls"]
            state_ok = (b["params"], b["grads"], b["optimizer"]) == (held["params"], held["grads"],
                                                                      held["opt_state"])
            measured_peak = m["peak_above_start"]  # the layout's model, optimizer and steps, from before it was built
            steady = sorted(m["step_s"][2:])[len(m["step_s"][2:]) // 2]
            print(f"| {name} | {world} | {'equal' if comm_ok else 'DIFFER'} | {'equal' if state_ok else 'DIFFER'} | "
                  f"{b['peak'] / 2**20:.1f} MiB | {measured_peak / 2**20:.1f} MiB | {b['peak'] / measured_peak:.2f} | "
                  f"{p.predicted_step_s * 1e3:.1f} ms | {steady * 1e3:.1f} ms | {p.predicted_step_s / steady:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args()
    if not args.skip_8b:
        llama()
    if not args.skip_real:
        real()


if __name__ == "__main__":
    main()
