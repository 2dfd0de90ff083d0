"""bench/plan.py: ``train_step.plan()`` at real size, and checked against real ranks (issue 44).

1. Llama-3-8B-shaped (transformers' LlamaForCausalLM from its config, on the meta device; batch 1 x 4096):
   ``fully_shard`` over 64 ranks and tensor parallel 8 x fully_shard 8, each planned in a fresh process
   (``python -m spmd_ort.plan``): wall time, peak resident memory, per-rank bytes.
2. Planning time against depth: the same model with 8, 16 and 32 layers (fully_shard, 64 ranks).
3. Plan against measurement: the GPT of tests/dist/plan_check.py (``--size bench``: d 256, 4 layers, T 128) on
   2 real gloo ranks (replicate, fully_shard, tensor parallel) and 4 (2-D), fx: collective and state bytes
   (exact), the step's peak (the planned ``peak`` less the state, against the tensor bytes torch's MemTracker
   counted at a real step's peak, and against the resident set's rise) and the step time with the "this CPU"
   spec (1 thread a rank, as torchrun gives each, probed with all the run's ranks at once).

    python bench/plan.py [--skip-8b] [--skip-real] [--backends ort,fx]
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
        proc = subprocess.run([sys.executable, "-m", "spmd_ort.plan", *args, "--json", str(out), "--no-cache"],
                              cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        return json.loads(out.read_text())


def deepspeed_estimate(total: int, largest: int, world: int) -> float | None:
    """DeepSpeed's ZeRO-3 estimate of one GPU's model states (its formula: fp16 mixed precision, 18 bytes a
    parameter over the GPUs, plus the largest layer's fp32 parameters), or None without DeepSpeed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator when imported
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except Exception:  # noqa: BLE001 - not installed (make bench-deps), or it cannot load here
        return None
    _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=min(world, 8),
                                                      num_nodes=max(1, world // 8), cpu_offload=False,
                                                      cpu_offload_params=False, zero_init=True)
    return gpu


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def ds_text(r: dict) -> str:
    est = deepspeed_estimate(r["params_total"], r["largest_module_params"], 64)
    return "DeepSpeed not installed" if est is None else f"{gib(est)} GiB"


def llama(backends: list[str]) -> None:
    print("### Llama-3-8B-shaped, batch 1 x 4096, AdamW, planned for H100 (one process, fresh each)\n")
    print("| layout | backend | ranks | planned in | peak RSS | params + AdamW / rank (GiB) | 12 B x N / ranks | "
          "activations (GiB) | peak / rank (GiB) | fits 80 GB | all-gather / reduce-scatter / all-reduce (GiB) | "
          "predicted step | DeepSpeed's ZeRO-3 estimate (model states only) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, par), backend in [(x, b) for x in (("fully_shard", "fully_shard"), ("tp 8 x fully_shard 8", "tp:8"))
                                 for b in backends]:
        r = cli("--model", "llama3-8b", "--world-size", "64", "--parallel", par, "--seq", "4096",
                "--backend", backend)
        b, c = r["per_rank_bytes"], r["comm_bytes"]
        ideal = 12 * r["params_total"] / 64
        exported = (f" ({r['export']['segments']} segments exported in {r['export']['export_s']:.0f} s, "
                    f"{len(r['export']['fallbacks'])} fall back)" if r.get("export") else "")
        print(f"| {name} | {backend}{exported} | 64 | {r['wall_s']:.1f} s | {gib(r['max_rss'])} GiB | {gib(b['params'] + b['optimizer'])} "
              f"| {gib(ideal)} | {gib(b['activations'])} | {gib(b['peak'])} | {r['fits']} | "
              f"{gib(c.get('all_gather', 0))} / {gib(c.get('reduce_scatter', 0))} / {gib(c.get('all_reduce', 0))} "
              f"| {r['predicted_step_s']:.2f} s | {ds_text(r) if par == 'fully_shard' else '-'} |")
    print(f"\n### Planning time against depth (fully_shard, 64 ranks, batch 1 x 4096, {backends[0]})\n")
    print("| layers | parameters | graph nodes | planned in | peak RSS |")
    print("|---|---|---|---|---|")
    first = None
    for layers in (8, 16, 32):
        r = cli("--model", "llama3-8b", "--layers", str(layers), "--world-size", "64", "--seq", "4096",
                "--backend", backends[0])
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

    print("\n### Plan against 2 and 4 real gloo ranks (fx; GPT d 256, 4 layers, T 128, batch 8 per replica); "
          "device spec: this CPU, 1 thread a rank, probed with as many ranks at once as the run has\n")
    print("| layout | ranks | collective bytes (calls) | params / grads / AdamW bytes | planned step peak above "
          "state | tensors at the peak (MemTracker) | ratio | resident set | ratio | predicted step (of which waits) | "
          "measured step (blocked in waits) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cfg = plan_check.config("bench")
    specs: list[str] = []
    for world in (2, 4):
        spec = DeviceSpec.this_cpu(threads=1, ranks_per_node=world)
        specs.append(f"{world} ranks: {spec.flops[torch.float32] / 1e9:.0f} GFLOP/s a rank, memory "
                     f"{spec.memory_bw / 1e9:.1f} GB/s, fresh writes {spec.write_bw / 1e9:.2f} GB/s, link "
                     f"{spec.intra_bw / 1e9:.2f} GB/s and {spec.link_latency_s * 1e3:.2f} ms a hop")
        # Memory in a run with glibc's thresholds fixed (as bench/big_model.py --malloc-threshold: freed memory
        # leaves the resident set, so its rise is the step's); time in a run with glibc's defaults, as users run.
        # Fixed thresholds map every allocation above 128 KiB afresh and page-fault it in each step: measured
        # here, 1.25-1.39x the step time of the defaults, which the probe (run in this process) does not pay.
        measured = check_run(world, {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"})
        timed = check_run(world, {})
        for name, mode in plan_check.modes(world).items():
            m = measured[name]
            with torch.device("meta"):
                model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            step = spmd_ort.compile(parallel_mode=mode, backend="fx", autotune=False)(grads_kept_step)
            p = step.plan(model, opt, *plan_check.batch(cfg, 8, 0), world_size=world, device=spec)
            b, held = p.per_rank_bytes, m["persistent"]
            comm_ok = p.comm_bytes == m["comm_bytes"]
            calls_ok = p.comm_calls == m["comm_calls"]
            state_ok = (b["params"], b["grads"], b["optimizer"]) == (held["params"], held["grads"],
                                                                      held["opt_state"])
            # the steps' own memory above the steady state (state allocated, freed memory returned to the system),
            # against the plan's peak less the state it holds between steps
            state = b["params"] + b["grads"] + b["optimizer"] + b["buffers"]
            planned_peak, measured_peak = b["peak"] - state, m["step_peak_above_steady"]
            tensors = m["step_tensor_peak_above_start"]
            times = timed[name]["step_s"][2:]
            middle = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
            steady, blocked = times[middle], timed[name]["blocked_s"][2:][middle]
            calls = "equal" if calls_ok else f"{p.comm_calls} planned, {m['comm_calls']} run"
            print(f"| {name} | {world} | {'equal' if comm_ok else 'DIFFER'} ({calls}) | {'equal' if state_ok else 'DIFFER'} | "
                  f"{planned_peak / 2**20:.1f} MiB | {tensors / 2**20:.1f} MiB | {planned_peak / tensors:.2f} | "
                  f"{measured_peak / 2**20:.1f} MiB | {planned_peak / measured_peak:.2f} | "
                  f"{p.predicted_step_s * 1e3:.1f} ms ({p.exposed_comm_s * 1e3:.0f} ms) | {steady * 1e3:.1f} ms "
                  f"({blocked * 1e3:.0f} ms) | {p.predicted_step_s / steady:.2f} |")
    print("\nThe specs, measured: " + "; ".join(specs))


def check_run(world: int, env: dict) -> dict:
    """tests/dist/plan_check.py (``--size bench``, batch 8, 6 steps) on ``world`` gloo ranks, one thread each,
    with ``env`` added: rank 0's measurements. Autotune off (as in the plans): ``bucket_cap_mb="auto"`` would
    measure the first steps and recompile with other buckets among the steps timed."""
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={world}", str(ROOT / "tests" / "dist" / "plan_check.py"),
                               "--out", d, "--size", "bench", "--batch", "8", "--steps", "6"],
                              env={**os.environ, "OMP_NUM_THREADS": "1", "SPMD_ORT_AUTOTUNE": "0", **env},
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        return json.loads((Path(d) / "rank0.json").read_text())


def big() -> None:
    """The 97 M GPT of bench/big_model.py (fully_shard, 2 ranks, batch 2 x 128, AdamW, fx) planned on the GPU
    specs and this CPU: its per-rank figures, for the peaks bench/big_model.py measures for it and for FSDP2."""
    import torch
    import torch.nn.functional as F

    import spmd_ort
    from examples.gpt import GPT, GPTConfig
    from spmd_ort.plan import DeviceSpec

    def step_fn(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cfg = GPTConfig(vocab=8192, seq=128, d=1024, heads=16, layers=7)
    print("\n### bench/big_model.py's GPT (7 layers, d 1024, 97 M parameters), fully_shard over 2 ranks, fx\n")
    print("| device | params + AdamW / rank | activations | collective buffers | planned peak | predicted step |")
    print("|---|---|---|---|---|---|")
    for device in ("h100", DeviceSpec.this_cpu(threads=1)):
        with torch.device("meta"):
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        step = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(parallel_style="fully_shard"),
                                backend="fx")(step_fn)
        tokens = torch.empty(2, cfg.seq, dtype=torch.long, device="meta")
        p = step.plan(model, opt, tokens, tokens, world_size=2, device=device)
        b = p.per_rank_bytes
        print(f"| {p.device.name} | {(b['params'] + b['optimizer']) / 2**20:.0f} MiB | "
              f"{b['activations'] / 2**20:.0f} MiB | {b['comm_buffers'] / 2**20:.0f} MiB | {b['peak'] / 2**20:.0f} MiB "
              f"| {p.predicted_step_s * 1e3:.0f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--backends", default="ort,fx", help="executors of the Llama plans (the first: the depth table)")
    args = ap.parse_args()
    if not args.skip_8b:
        llama(args.backends.split(","))
    if not args.skip_real:
        big()
        real()


if __name__ == "__main__":
    main()
