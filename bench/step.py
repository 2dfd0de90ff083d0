"""Step time of eager PyTorch vs the compiled train step vs torch.compile, measured side by side in one run.

Run:  make bench            (or: .venv/bin/python bench/step.py [--steps 7] [--models gpt-mini,mlp,cnn,mixtral-tiny]
                                  [--device cuda])

Like for like: every runner trains with the same optimizer, AdamW(lr 1e-3,
weight_decay 0.1, ``fused=True``) - the multi-tensor kernel the compiled step
always runs - and clipping at 1.0, in one process with the same threads and
the same host allocator (freed memory retained for reuse from the first step,
``spmd_ort.runtime.memory.retain_host_memory``, as the compiled step does).  Ratios are
to that eager step.

Runners: ``eager`` (the baseline above); ``eager-default`` (``AdamW()`` as most
scripts write it: on CPU torch 2.13 picks the for-loop implementation, ~5x
slower; shown so the gap a kernel choice makes is visible, never used as the
baseline); ``fx`` / ``ort`` (``spmd_ort.compile``; ``ort`` is the default
backend as users get it: each segment runs on the faster of ORT and fx, chosen on
the first run, then the whole step as chosen or the whole graph on fx, whichever
is faster, and, once the tuner buys it, the whole graph compiled by inductor against
that: the bench predicts that compile free, so it comes after the program's
``spmd_ort.tuner.MEASURED_STEPS`` measured steady steps); ``ort-only`` (every segment in ONNX Runtime,
``backend="ort"``); ``spmd-inductor`` (``spmd_ort.compile(backend=
"inductor")``: the whole step's segments compiled by inductor); ``fx+graph`` / ``spmd-inductor+graph`` (those
with ``cuda_graph=True``: on a GPU the whole step replays as one CUDA graph from its third call; on the CPU they
are fx and spmd-inductor); ``inductor`` (``torch.compile(model)`` with the fused optimizer);
``reduce-overhead`` (``torch.compile(model, mode="reduce-overhead")``: CUDA graphs of forward and backward, the
fused optimizer outside them).  The runners alternate step by step with a pause between them,
median of ``--steps`` after ``MEASURED_STEPS`` + 5 warm-up calls (the default backend is
steady from there); "compile s" sums the warm-up calls' time beyond a steady step's.

Models with parts the compiled step runs opaquely (none of these since mixtral-tiny's
experts trace, as ``spmd_ort::grouped_mm``) also get the time those parts took inside the
compiled runners' steps (median).

``--device cuda`` trains every runner on the GPU: each step is timed to the end of its queued kernels
(synchronized), and the most each runner's step allocates above its resting memory (parameters,
optimizer state) is printed under the table, and for the GPT models the achieved TFLOP/s and MFU against the
card's dense peak (float32, or TF32 with ``--tf32``).  The ORT backend there needs ``onnxruntime-gpu``; without
it that runner fails with its ConfigError and the table says so.

Compile time: ``--compile`` also runs the ORT backend's first call (trace,
passes, export or cache load, sessions, checked first run) in a fresh process
with an empty ONNX cache (cold) and then in a second fresh process sharing that
cache (warm: the exported models and the automatic choice's remembered decisions,
so its first run checks but times nothing), and reports each process's peak RSS
against a process that trains the same model eagerly (what the step itself needs);
then ``backend="inductor"``'s first call, cold and warm (inductor's FX graph cache
in the same directory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import spmd_ort  # noqa: E402
from spmd_ort.runtime.devices import now  # noqa: E402
from spmd_ort.backends.inductor import cxx_compiler  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def train_step(model, opt, x, y):
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def make_adamw(params, fused: bool | None = True) -> torch.optim.Optimizer:
    """The optimizer of every bench: fused (the compiled step's kernel) unless asked for torch's default."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=fused)


class BenchMLP(nn.Module):
    def __init__(self, d: int = 1024, depth: int = 4, classes: int = 1000):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(d, d), nn.GELU())])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.layers(x))


def gpt_mini(seed: int = 0):
    cfg = GPTConfig(vocab=8192, seq=128, d=256, heads=4, layers=4)
    g = torch.Generator().manual_seed(seed)
    batch = lambda: (torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g),  # noqa: E731
                     torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g))
    return GPT(cfg), batch


def mlp(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch = lambda: (torch.randn(256, 1024, generator=g), torch.randint(0, 1000, (256,), generator=g))  # noqa: E731
    return BenchMLP(), batch


def cnn(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10))
    batch = lambda: (torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g))  # noqa: E731
    return model, batch


class MixtralLM(nn.Module):
    """HF Mixtral (random weights, built from a config) returning logits, for the common train step."""

    def __init__(self, cfg):
        super().__init__()
        import transformers

        self.hf = transformers.MixtralForCausalLM(cfg)

    def forward(self, x):
        return self.hf(input_ids=x).logits


def mixtral_tiny(seed: int = 0):
    """2 layers, d=128, 4 experts (top-2) of 256, transformers' default ``grouped_mm`` experts: the whole step
    is traced (their ``torch._grouped_mm`` as ``spmd_ort::grouped_mm``; until 2026-11-25 they ran opaquely)."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128)
    g = torch.Generator().manual_seed(seed)
    batch = lambda: (torch.randint(0, cfg.vocab_size, (8, 128), generator=g),  # noqa: E731
                     torch.randint(0, cfg.vocab_size, (8, 128), generator=g))
    return MixtralLM(cfg), batch


def gpt2_small(seed: int = 0):
    """GPT-2 small's shape (124 M parameters: 12 layers, d 768, 12 heads, 50257 tokens, 1024 positions, tied head)
    at batch 16 x 1024: about 14 TFLOP a step, where arithmetic takes the time, not issuing ops (for a GPU:
    ``--device cuda --models gpt2-small``; MFU is printed under the table)."""
    cfg = GPTConfig(vocab=50257, seq=1024, d=768, heads=12, layers=12)
    g = torch.Generator().manual_seed(seed)
    batch = lambda: (torch.randint(0, cfg.vocab, (16, cfg.seq), generator=g),  # noqa: E731
                     torch.randint(0, cfg.vocab, (16, cfg.seq), generator=g))
    return GPT(cfg), batch


MODELS = {"gpt-mini": gpt_mini, "mlp": mlp, "cnn": cnn, "mixtral-tiny": mixtral_tiny, "gpt2-small": gpt2_small}


def step_flops(model: nn.Module, x: torch.Tensor) -> float | None:
    """A GPT step's model FLOPs (PaLM's count: 6 per parameter per token for the matmuls of forward and
    backward, plus attention's 12 x layers x d x seq per token), for MFU; None for other models."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, GPTConfig):
        return None
    tokens = x.numel()
    params = sum(p.numel() for p in model.parameters())
    return 6.0 * params * tokens + 12.0 * cfg.layers * cfg.d * cfg.seq * tokens


# dense peak TFLOP/s (float32 on CUDA cores, TF32 and bfloat16 on tensor cores) by device name, for MFU
PEAK_TFLOPS = {"H100": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4},
               "H200": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4},
               "A100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0}}


def peak_tflops(device: torch.device) -> tuple[float, str] | None:
    """The GPU's dense peak for the float32 matmul precision set (``--tf32``: TF32), and which one it is."""
    name = torch.cuda.get_device_name(device)
    kind = "tf32" if torch.get_float32_matmul_precision() != "highest" else "float32"
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[kind], f"{key} {kind}"
    return None


# a runner's name -> the backend it compiles with: "ort" is the default as users get it, backend="auto" (the column
# keeps its name, so that RESULTS' tables compare across runs)
DEFAULT_RUNNERS = {"ort": "auto"}


def build_runners(model: nn.Module, backends: list[str]) -> dict:
    """name -> (model copy, optimizer, step function)."""
    runners = {}
    for name in ["eager", "eager-default", *backends]:
        m = copy.deepcopy(model)
        opt = make_adamw(m.parameters(), fused=None if name == "eager-default" else True)
        if name in ("eager", "eager-default"):
            fn = train_step
        elif name == "ort-only":  # backend="ort": every segment ORT supports on ORT
            fn = spmd_ort.compile(backend="ort")(train_step)
        elif name == "spmd-inductor":  # the whole step's graph, segments compiled by inductor
            fn = spmd_ort.compile(backend="inductor")(train_step)
        elif name.endswith("+graph"):  # the whole step as one CUDA graph (fx+graph, spmd-inductor+graph)
            base = name.removesuffix("+graph").removeprefix("spmd-")
            fn = spmd_ort.compile(backend=base, cuda_graph=True)(train_step)
        elif name == "reduce-overhead":  # torch.compile's CUDA graphs of forward and backward; the fused optimizer
            compiled_model = torch.compile(m, mode="reduce-overhead")
            fn = lambda _m, o, x, y, cm=compiled_model: train_step(cm, o, x, y)  # noqa: E731
        elif name == "inductor":
            compiled_model = torch.compile(m)  # backward through AOT autograd; the fused optimizer
            fn = lambda _m, o, x, y, cm=compiled_model: train_step(cm, o, x, y)  # noqa: E731
        else:  # "ort": the default backend as users get it (backend="auto"); "fx"
            fn = spmd_ort.compile(backend=DEFAULT_RUNNERS.get(name, name))(train_step)
        runners[name] = (m, opt, fn)
    return runners


def _on(device: torch.device, batch):
    """The batch function moved to ``device`` (batches are drawn on the CPU: the same numbers on every device)."""
    return batch if device.type == "cpu" else lambda: tuple(t.to(device) for t in batch())


def bench_model(name: str, steps: int, backends: list[str], device: torch.device = torch.device("cpu")) -> dict:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model, batch = model.to(device), _on(device, batch)
    runners = build_runners(model, backends)
    times: dict[str, list[float]] = {k: [] for k in runners}
    # CUDA: the most a runner's measured step allocates above what is allocated when it starts (its activations
    # and temporaries; parameters and optimizer state are resident before and after)
    step_peak_mib: dict[str, float] = {}
    compile_s: dict[str, float] = {}
    failed: dict[str, str] = {}
    opaque_ms: dict[str, list[float]] = {}  # compiled runners: time in opaque parts (spmd_ort.runtime.opaque_calls) per step
    # compiled calls 1-2 trace (before / after optimizer state exists); 3 warms caches; the default backend's
    # tuner times its program's first MEASURED_STEPS steady steps, then buys inductor's candidate once they paid
    # its predicted compile: predicted free here, so it comes at once and the steady steps measured are the
    # automatic choice's final ones (its compile counts in "compile s")
    from spmd_ort import tuner

    tuner.CompileCost.predict = classmethod(lambda cls, nodes: (0.0, "the bench predicts it free"))
    warmup = tuner.MEASURED_STEPS + 5
    for i in range(warmup + steps):
        x, y = batch()
        for k, (m, opt, fn) in runners.items():  # alternate, so drift affects all alike
            if k in failed:
                continue
            time.sleep(0.05)  # let any runtime's worker threads go idle: each is timed on quiet cores
            now()  # the last runner's queued kernels finish before this one starts
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                resting = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            try:
                fn(m, opt, x, y)
                dt = now() - t0  # the step's queued kernels are part of its time
            except Exception as exc:  # noqa: BLE001 - a runner that cannot run this model is reported, not fatal
                failed[k] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:80]}"
                continue
            if i >= warmup:
                times[k].append(dt)
                if device.type == "cuda":
                    above = (torch.cuda.max_memory_allocated(device) - resting) / 2**20
                    step_peak_mib[k] = max(step_peak_mib.get(k, 0.0), above)
                program = getattr(fn, "compiled", None)
                if program is not None and program.opaque:
                    opaque_ms.setdefault(k, []).append(sum(program.opaque_seconds) * 1e3)
            elif k not in ("eager", "eager-default"):
                compile_s[k] = compile_s.get(k, 0.0) + dt
    for k in compile_s:  # what the warm-up calls took beyond steady steps: compiling, checking, choosing
        if times[k]:
            compile_s[k] = max(compile_s[k] - warmup * statistics.median(times[k]), 0.0)
    params = sum(p.numel() for p in model.parameters())
    flops = step_flops(model, x)
    return {"model": name, "params": params, "flops": flops, "compile_s": compile_s, "failed": failed, "step_peak_mib": step_peak_mib,
            "opaque_ms": {k: statistics.median(v) for k, v in opaque_ms.items()},
            "ms": {k: statistics.median(v) * 1e3 for k, v in times.items() if k not in failed}}


def settled(compiled_steps, timed_steps: int) -> bool:
    """Whether the next ``timed_steps`` calls of every compiled step are steady (``CompiledStep.settled_for``: no
    bucket cap being measured, no inductor candidate undecided or due among them), on every rank (a collective:
    every rank calls it at the same call).  A bench warms up until it holds, so that no tuner work lands among
    the timed steps."""
    ok = all(step.settled_for(timed_steps) for step in compiled_steps)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    return ok


def compile_probe(name: str, backend: str) -> None:
    """In this (fresh) process: the first two calls of a compiled step (``eager``: two eager steps); one JSON line.

    The first call traces (once: AdamW's state is created before the trace), runs the passes, exports or
    loads each segment, opens the sessions and runs the checked first run (both executors, compared and
    timed); the second is a plain step.
    """
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    opt = make_adamw(model.parameters())
    if backend == "eager":
        spmd_ort.runtime.memory.retain_host_memory()  # as the compiled step does on its first call
    step = train_step if backend == "eager" else spmd_ort.compile(backend=DEFAULT_RUNNERS.get(backend, backend))(
        train_step)
    t0 = time.perf_counter()
    step(model, opt, *batch())
    first = time.perf_counter() - t0
    step(model, opt, *batch())
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "first_s": first, "rss_mib": spmd_ort.runtime.memory.max_rss_bytes() / 2**20}
    if backend == "ort":
        stats = [v.executor.stats for v in step.variants]
        result.update(export_s=sum(s.export_seconds for s in stats), hits=sum(s.cache_hits for s in stats),
                      segments=sum(s.segments for s in stats), variants=len(step.variants),
                      compile_s=sum(v.compile_seconds for v in step.variants),
                      first_run_s=sum(s.first_run_seconds for s in stats),
                      verify_s=sum(s.verify_seconds for s in stats),
                      choices=[str(c) for s in stats for c in s.choices.values()],
                      fell_back=[f"{name} fell back to fx: {why}" for s in stats for name, why in s.fallback_reasons.items()])
    print(json.dumps(result))


def _probe(name: str, backend: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--compile-probe", name, "--probe-backend", backend], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_times(name: str) -> str:
    """Cold (empty ONNX cache) and warm (a second process, same cache) first calls of the ORT backend,
    and the peak RSS of a process that trains the same model eagerly (the step's own memory)."""
    cache = tempfile.mkdtemp(prefix="spmd_ort_bench_cache_")
    # a cache of inductor's own, empty at first: its cold and warm first calls measured as the ORT backend's
    env = {**os.environ, "SPMD_ORT_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": str(Path(cache) / "inductor")}
    eager = _probe(name, "eager", env)
    cells = []
    for _ in ("cold", "warm"):
        r = _probe(name, "ort", env)
        cells.append(f"{r['first_s']:.1f} s: compile {r['compile_s']:.1f} s (export {r['export_s']:.1f} s, "
                     f"{r['hits']}/{r['segments']} cached), first run {r['first_run_s']:.1f} s (verify "
                     f"{r['verify_s']:.2f} s); peak RSS {r['rss_mib']:.0f} MiB "
                     f"({r['rss_mib'] / eager['rss_mib']:.2f}x eager)")
    choices = r["choices"] + r["fell_back"]
    if cxx_compiler() is not None:
        cells += [f"{_probe(name, 'inductor', env)['first_s']:.1f} s" for _ in ("cold", "warm")]
    else:
        cells += ["-", "-"]
    return f"| {name} | {eager['rss_mib']:.0f} MiB | " + " | ".join(cells) + f" | {'; '.join(choices)} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7, help="measured steps per model (median reported)")
    ap.add_argument("--models", default="gpt-mini,mlp,cnn,mixtral-tiny")
    ap.add_argument("--backends", default="fx,ort,ort-only,spmd-inductor,inductor")
    ap.add_argument("--compile", action="store_true", help="also measure cold/warm ORT compile in fresh processes")
    ap.add_argument("--device", default="cpu", help="where the models train: cpu (default) or cuda")
    ap.add_argument("--tf32", action="store_true", help="float32 matmuls in TF32 for every runner (CUDA)")
    ap.add_argument("--compile-probe", help=argparse.SUPPRESS)
    ap.add_argument("--probe-backend", default="ort", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_probe:
        compile_probe(args.compile_probe, args.probe_backend)
        return
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    retained = spmd_ort.runtime.memory.retain_host_memory()  # every runner, from its first step
    backends = args.backends.split(",")
    device = torch.device(args.device)
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    where = f"{platform.machine()}, {threads} threads"
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}), host {where}"
    print(f"# bench/step.py — torch {torch.__version__}, {where}, host memory "
          f"{'retained' if retained else 'glibc default'} for all runners, AdamW(fused=True) for all but "
          f"eager-default, median of {args.steps} steps")
    cols = ["eager-default", *backends]
    print("| model | params | eager ms | " + " | ".join(f"{b} ms | {b}/eager" for b in cols)
          + " | " + " | ".join(f"{b} compile s" for b in backends) + " |")
    print("|" + "---|" * (3 + 2 * len(cols) + len(backends)))
    notes: list[str] = []  # printed under the table, which stays one block of rows
    for name in args.models.split(","):
        r = bench_model(name, args.steps, backends, device)
        cells = [name, f"{r['params'] / 1e6:.2f} M", f"{r['ms']['eager']:.1f}"]
        for b in cols:
            cells += [f"{r['ms'][b]:.1f}", f"{r['ms'][b] / r['ms']['eager']:.2f}"] if b in r["ms"] else ["fails", "-"]
        cells += [f"{r['compile_s'][b]:.1f}" if b in r["ms"] else "-" for b in backends]
        print("| " + " | ".join(cells) + " |", flush=True)
        notes += [f"  ({name}: {b} fails: {why})" for b, why in r["failed"].items()]
        if r["step_peak_mib"]:
            graphs = [b for b in r["step_peak_mib"] if b.endswith("+graph") or b == "reduce-overhead"]
            notes.append(f"  ({name}: most a step allocated above its resting memory, MiB: "
                         + ", ".join(f"{b} {v:.1f}" for b, v in r["step_peak_mib"].items())
                         + (f"; {', '.join(graphs)}: their CUDA graphs' memory pools stay allocated between steps, "
                            "in the resting memory, so the graphs' activations are left out" if graphs else "")
                         + ")")
        if r["flops"] and device.type == "cuda":
            peak = peak_tflops(device)
            notes.append(f"  ({name}: {r['flops'] / 1e12:.2f} TFLOP per step; achieved TFLOP/s, MFU"
                         + (f" against the {peak[1]} dense peak of {peak[0]:.0f}" if peak else "") + ": "
                         + ", ".join(f"{b} {r['flops'] / ms * 1e-9:.1f}"
                                     + (f" ({r['flops'] / ms * 1e-9 / peak[0]:.1%})" if peak else "")
                                     for b, ms in r["ms"].items()) + ")")
        notes += [f"  ({name}: opaque parts run eagerly in {b}'s step: {ms:.1f} ms of {r['ms'][b]:.1f} ms, "
                  f"{ms / r['ms'][b]:.0%})" for b, ms in r["opaque_ms"].items()]
    if notes:
        print("\n" + "\n".join(notes), flush=True)
    if args.compile and device.type != "cpu":
        print("\n(--compile measures host processes' peak RSS and the ORT backend: CPU only; left out here)")
    elif args.compile:
        print("\nort backend, first call in a fresh process (trace, passes, export or cache load, sessions, checked "
              "first run: both executors compared and timed); peak RSS of the process after two calls, against a "
              "process that trains the same model eagerly for two steps:")
        print("| model | eager peak RSS | cold (empty cache) | warm (second process, same cache) | inductor cold | "
              "inductor warm | segments run on (warm) |")
        print("|---|---|---|---|---|---|---|")
        for name in args.models.split(","):
            print(compile_times(name), flush=True)


if __name__ == "__main__":
    main()
