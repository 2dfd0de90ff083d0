"""The LM head fused: eager's linear + cross-entropy against torch's chunked operator, measured side by side.

Run:  .venv/bin/python bench/fused_head.py [--reps 7]

Part 1, the head alone (forward and both gradients, fp32, 2 threads, host memory retained as the compiled
step retains it): eager's ``h @ W.T`` + ``F.cross_entropy`` + autograd against torch's chunked operator
(``torch_nn::_linear_cross_entropy_batch_chunked``) at several chunk sizes, for heads of several shapes; the
``pass`` column is the chunk ``fuse_linear_cross_entropy_pass`` picks (``-``: it keeps eager's kernels).
These numbers set the pass's thresholds (``MIN_WIDENING``, ``MIN_LOGITS``, ``CHUNK_LOGITS``,
``MAX_FEATURES``, ``MIN_CHUNK_ROWS`` in ``passes/fusion.py``).

Part 2, bench/step.py's gpt-mini trained on the fx backend with and without the pass
(``SPMD_ORT_DISABLE_PASSES``), interleaved with eager: step time and the planned peak of the values a step
makes (``describe()``'s memory plan).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import spmd_ort  # noqa: E402
from spmd_ort.passes.analysis import MemoryPlan  # noqa: E402
from optim import timed  # noqa: E402 - median ms of reps calls, after one warm-up
from spmd_ort.passes.fusion import MAX_FEATURES, MIN_LOGITS, MIN_WIDENING, chunk_rows  # noqa: E402

SHAPES = [(1024, 256, 8192), (1024, 128, 1024), (2048, 512, 32000), (512, 768, 50257), (4096, 64, 1000),
          (256, 1024, 1000)]  # (rows, features, classes)
CHUNKS = (128, 256, 512, 1024, 2048, 4096)


def head_table(reps: int) -> list[str]:
    from torch.nn import LinearCrossEntropyOptions

    rows_out = ["| rows x features x classes | eager ms | " + " | ".join(f"chunk {c} ms" for c in CHUNKS)
                + " | pass: chunk | pass / eager |", "|---" * (len(CHUNKS) + 4) + "|"]
    print("\n".join(rows_out), flush=True)
    for rows, features, classes in SHAPES:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(rows, features, generator=g, requires_grad=True)
        w = (torch.randn(classes, features, generator=g) * 0.02).requires_grad_()
        y = torch.randint(0, classes, (rows,), generator=g)

        def run(options):
            def f():
                loss = F.linear_cross_entropy(h, w, y, options=options)
                torch.autograd.grad(loss, (h, w))
            return f

        eager = timed(run(None), reps)
        chunks = {c: timed(run(LinearCrossEntropyOptions(batch_chunk_size=c)), reps) for c in CHUNKS if c <= rows}
        fused = classes >= MIN_WIDENING * features and features <= MAX_FEATURES and rows * classes >= MIN_LOGITS
        pick = chunk_rows(rows, classes) if fused else None
        picked = timed(run(LinearCrossEntropyOptions(batch_chunk_size=pick)), reps) if fused else None
        cells = [f"{chunks[c]:.1f}" if c in chunks else "" for c in CHUNKS]
        rows_out.append(f"| {rows} x {features} x {classes} | {eager:.1f} | " + " | ".join(cells)
                        + (f" | {pick} | {picked / eager:.2f} |" if fused else " | - | |"))
        print(rows_out[-1], flush=True)
    return rows_out


def step_table(steps: int) -> list[str]:
    from step import MODELS, make_adamw, train_step

    torch.manual_seed(0)
    model, batch = MODELS["gpt-mini"]()
    runners = {}
    for name in ("eager", "fx (fused)", "fx (unfused)"):
        m = copy.deepcopy(model)
        opt = make_adamw(m.parameters(), fused=True)
        if name == "fx (unfused)":
            os.environ["SPMD_ORT_DISABLE_PASSES"] = "fuse_linear_cross_entropy_pass"  # read by compile()
        fn = train_step if name == "eager" else spmd_ort.compile(backend="fx")(train_step)
        os.environ.pop("SPMD_ORT_DISABLE_PASSES", None)
        runners[name] = (m, opt, fn)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(3 + steps):
        x, y = batch()
        for name, (m, opt, fn) in runners.items():  # interleaved: drift affects all alike
            time.sleep(0.05)
            t0 = time.perf_counter()
            fn(m, opt, x, y)
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    eager = statistics.median(times["eager"])
    out = ["| gpt-mini runner | step ms | / eager | planned peak MiB | of it kept for the backward MiB |",
           "|---|---|---|---|---|"]
    for name, (m, opt, fn) in runners.items():
        ms = statistics.median(times[name])
        plan = fn.compiled.results.get(MemoryPlan) if name != "eager" else None
        mem = (f"{plan.planned_peak_bytes / 2**20:.1f} | {plan.saved_for_backward_bytes / 2**20:.1f}" if plan
               else " | ")
        out.append(f"| {name} | {ms * 1e3:.1f} | {ms / eager:.2f} | {mem} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per head (median)")
    ap.add_argument("--steps", type=int, default=9, help="measured gpt-mini steps per runner (median)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    retained = spmd_ort.runtime.memory.retain_host_memory()  # as the compiled step does on its first call
    print(f"# bench/fused_head.py — torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, host memory "
          f"{'retained' if retained else 'glibc default'}, median of {args.reps}")
    head_table(args.reps)
    print()
    print("\n".join(step_table(args.steps)))


if __name__ == "__main__":
    main()
