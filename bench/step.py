"""Step time of eager PyTorch vs the compiled train step, measured side by side in one run.

Run:  make bench            (or: .venv/bin/python bench/step.py [--steps 5] [--models gpt-mini,mlp])

For each model it trains an eager copy and a compiled copy on the same batches,
alternating, and prints the median ms/step of each, the ratio to eager and the
compile time.  AdamW with clipping, fp32, all cores of this machine.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import spmd_ort  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def train_step(model, opt, x, y):
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


class BenchMLP(nn.Module):
    def __init__(self, d: int = 1024, depth: int = 4, classes: int = 1000):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(d, d), nn.GELU())])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.layers(x))


def gpt_mini():
    cfg = GPTConfig(vocab=8192, seq=128, d=256, heads=4, layers=4)
    g = torch.Generator().manual_seed(0)
    batch = lambda: (torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g),  # noqa: E731
                     torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g))
    return GPT(cfg), batch


def mlp():
    g = torch.Generator().manual_seed(0)
    batch = lambda: (torch.randn(256, 1024, generator=g), torch.randint(0, 1000, (256,), generator=g))  # noqa: E731
    return BenchMLP(), batch


def cnn():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10))
    batch = lambda: (torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g))  # noqa: E731
    return model, batch


MODELS = {"gpt-mini": gpt_mini, "mlp": mlp, "cnn": cnn}


def bench_model(name: str, steps: int, backends: list[str]) -> dict:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    runners = {"eager": (model, train_step)}
    compile_s = {}
    for backend in backends:
        m = copy.deepcopy(model)
        if backend == "inductor":
            # torch.compile's default (inductor) on the model; backward via AOT autograd, optimizer eager
            compiled_model = torch.compile(m)
            runners[backend] = (m, lambda _m, opt, x, y, cm=compiled_model: train_step(cm, opt, x, y))
        else:
            runners[backend] = (m, spmd_ort.compile(backend=backend)(train_step))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for k, (m, _) in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in runners}
    warmup = 3  # compiled calls 1-2 trace (before / after optimizer state exists); 3 warms caches
    for i in range(warmup + steps):
        x, y = batch()
        for k, (m, fn) in runners.items():  # alternate, so drift affects all alike
            time.sleep(0.05)  # let any runtime's worker threads go idle: each is timed on quiet cores
            t0 = time.perf_counter()
            fn(m, opts[k], x, y)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[k].append(dt)
            elif k != "eager":
                compile_s[k] = compile_s.get(k, 0.0) + dt
    params = sum(p.numel() for p in model.parameters())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"model": name, "params": params, "ms": med, "compile_s": compile_s}


def compile_times(name: str) -> str:
    """Cold (empty ONNX cache) and warm (cache filled by the cold run) compile of the ort backend."""
    import tempfile

    saved = os.environ.get("SPMD_ORT_CACHE_DIR")
    os.environ["SPMD_ORT_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd_ort_bench_cache_")
    try:
        torch.manual_seed(0)
        model, batch = MODELS[name]()
        cells = []
        for _ in ("cold", "warm"):
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            step = spmd_ort.compile(backend="ort")(train_step)
            t0 = time.perf_counter()
            for _ in range(2):  # both variants: before and after the optimizer state exists
                step(m, opt, *batch())
            stats = [v.executor.stats for v in step.variants]
            cells.append(f"{time.perf_counter() - t0:.1f} s (export {sum(s.export_seconds for s in stats):.1f} s, "
                         f"{sum(s.cache_hits for s in stats)}/{sum(s.segments for s in stats)} segments cached)")
        return f"| {name} | " + " | ".join(cells) + " |"
    finally:
        if saved is None:
            os.environ.pop("SPMD_ORT_CACHE_DIR", None)
        else:
            os.environ["SPMD_ORT_CACHE_DIR"] = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="measured steps per model (median reported)")
    ap.add_argument("--models", default="gpt-mini,mlp,cnn")
    ap.add_argument("--backends", default="fx,ort,inductor")
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    backends = args.backends.split(",")
    print(f"# bench/step.py — torch {torch.__version__}, {platform.machine()}, {threads} threads, "
          f"median of {args.steps} steps")
    header = "| model | params | eager ms | " + " | ".join(f"{b} ms | {b}/eager | {b} compile s" for b in backends) + " |"
    print(header)
    print("|" + "---|" * (3 + 3 * len(backends)))
    for name in args.models.split(","):
        r = bench_model(name, args.steps, backends)
        cells = [name, f"{r['params'] / 1e6:.2f} M", f"{r['ms']['eager']:.1f}"]
        for b in backends:
            cells += [f"{r['ms'][b]:.1f}", f"{r['ms'][b] / r['ms']['eager']:.2f}", f"{r['compile_s'][b]:.1f}"]
        print("| " + " | ".join(cells) + " |", flush=True)
    if "ort" in backends:
        print("\nort backend, first two calls (two traces, export or cache load, session creation, checked first run):")
        print("| model | cold (empty cache) | warm (second process / new step) |")
        print("|---|---|---|")
        for name in args.models.split(","):
            print(compile_times(name), flush=True)


if __name__ == "__main__":
    main()
