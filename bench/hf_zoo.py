"""Twenty Hugging Face causal-LM families at their published size, planned for 8 ranks, and each from a tiny
config trained on 2 real ranks against DDP.

    python bench/hf_zoo.py [--families llama3-8b,qwen3-8b] [--world 8] [--skip-train] [--skip-plan] [--json F]

Plan: each family of ``spmd_ort/plan/hf_configs.py`` (the published config.json's architecture, built on the
meta device, nothing downloaded) through ``python -m spmd_ort.plan`` (a subprocess each: its wall time is what a
user waits for) for ``fully_shard`` over 8 fake ranks and for tensor parallel 2 x fully_shard 4 (Megatron's plan
where one fits the family: ``llama_tensor_parallel_plan``, transformers' own plan in torch's styles), one sequence of 4096 tokens per replica (the family's
context where shorter), bf16 parameters with fp32 reductions (FSDP2's policy), AdamW, clipping; on the fx
backend, without the ORT export, priced for an H100. Train: tests/dist/hf_zoo_parity.py on 2 ranks (torchrun):
the tiny config, 3 AdamW steps with clipping, compiled (DataParallel, fx) against torch DDP, and under the
family's tensor-parallel plan (tp 2, fx) against eager in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spmd_ort.plan.hf_configs import CONFIGS, SOURCES, config  # noqa: E402

GIB = 2**30
LAYOUTS = {"fully_shard": "fully_shard", "tp2": "tp:2"}


def plan(name: str, layout: str, world: int, out: Path) -> dict:
    cfg = config(name)
    seq = min(4096, getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 4096))
    target = out / f"{name}-{layout}.json"
    cmd = [sys.executable, "-m", "spmd_ort.plan", "--model", name, "--world-size", str(world), "--parallel",
           LAYOUTS[layout], "--batch", "1", "--seq", str(seq), "--mixed-precision", "bf16", "--backend", "fx",
           "--no-export", "--device", "h100", "--json", str(target), "--no-cache"]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "?")
        return {"ok": False, "error": reason[:300], "wall_s": wall, "seq": seq}
    d = json.loads(target.read_text())
    tp = 2 if layout == "tp2" else 1
    return {"ok": True, "seq": seq, "wall_s": wall, "params": d["params_total"], "device_gib": d["device_bytes"] / GIB,
            "fits": d["fits"], "tflop": d["flops"] / 1e12, "step_s": d["predicted_step_s"],
            "tok_s_gpu": seq / tp / d["predicted_step_s"], "state_gib": (d["per_rank_bytes"]["params"]
                                                                         + d["per_rank_bytes"]["optimizer"]) / GIB}


def train(families: list[str], layout: str = "dp") -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "tests" / "dist" / "hf_zoo_parity.py"), "--families", ",".join(families), "--layout",
               layout, "--out", out]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads((Path(out) / "rank0.json").read_text())


def cell(r: dict) -> str:
    if not r["ok"]:
        return "no plan fits (below)" if "tensor-parallel plan fits" in r["error"] else f"failed: {r['error']}"
    return (f"{r['device_gib']:.1f} GiB{'' if r['fits'] else ' (does not fit)'}, {r['tflop']:.0f} TFLOP, "
            f"{r['step_s']:.2f} s, {r['tok_s_gpu']:,.0f} tok/s/GPU; planned in {r['wall_s']:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(CONFIGS))
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-plan", action="store_true")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", help="write every figure here (or, with --update, update it)")
    ap.add_argument("--update", action="store_true", help="keep the --json file's other entries")
    a = ap.parse_args()
    families = a.families.split(",")
    results = json.loads(Path(a.json).read_text()) if a.update else {}
    for name in families:
        results.setdefault(name, {})
    if not a.skip_plan:
        with tempfile.TemporaryDirectory() as d:
            for name in families:
                for layout in a.layouts.split(","):
                    results[name][layout] = plan(name, layout, a.world, Path(d))
                    print(f"{name} {layout}: {cell(results[name][layout])}", file=sys.stderr, flush=True)
    if not a.skip_train:
        for name, r in train(families).items():
            results[name]["train"] = r
        for name, r in train(families, "tp").items():
            results[name]["train_tp"] = r
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print(table(results, a.world))


def table(results: dict, world: int) -> str:
    rows = [f"| family | config | parameters | fully_shard over {world}: device memory, step FLOPs, predicted step, "
            f"throughput, plan wall time | tp 2 x fully_shard {world // 2}: the same | 2 ranks against DDP, 3 steps | "
            "tp 2 against eager, 3 steps |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def trained(r):
        if r is None:
            return "-"
        if r["ok"]:
            return f"ok, worst parameter {r['worst']:.1e}"
        return "no plan" if "no tensor-parallel plan fits" in r.get("error", "") else \
            f"failed: {r.get('error', 'on another rank')}"

    for name, r in results.items():
        params = next((x["params"] for x in r.values() if x.get("params")), None)
        size = f"{params / 1e9:.2f} B" if params else "-"
        rows.append(f"| {name} | {SOURCES[name]} | {size} | {cell(r['fully_shard']) if 'fully_shard' in r else '-'} | "
                    f"{cell(r['tp2']) if 'tp2' in r else '-'} | {trained(r.get('train'))} | "
                    f"{trained(r.get('train_tp'))} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:  # a saved --json's table again
        print(table(json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[3]) if len(sys.argv) > 3 else 8))
    else:
        main()
