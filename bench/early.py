"""The first steps of a run, cold and warm: how long a fresh process takes to reach its steady rate.

Run:  .venv/bin/python bench/early.py [--models gpt-mini,cnn] [--steps 300] [--runners ...]

Users restart the same run often (preemption, a new learning rate, a sweep), so what a run pays before it is
steady counts as much as the steady rate.  Each runner trains ``--steps`` steps of bench/step.py's model (its
train step: AdamW fused, clipping) in a fresh process, one process after another, timing every step:

* ``eager``; ``torch.compile`` (``torch.compile(model)``, the default mode);
* ``default cold``: ``spmd_ort.compile()`` as users get it, with empty caches (ONNX models, remembered
  choices, inductor's FX graph cache: directories of this run's own);
* ``default warm``: the same again in a second process on those caches;
* ``background cold``: ``SPMD_ORT_BACKGROUND_COMPILE=1`` (inductor's candidate compiled by a forked child
  from step 5 on, even where the steps' threads use every core: what ``auto`` avoids), empty caches;
* ``ort-only`` and ``fx``: the single executors the default chooses among (``autotune=False``, whole graph).

Columns: the first step (seconds: trace, compile, checked first run), steps 1-20 (seconds, all of them),
the median of steps 5-19 and of the last 50 steps (ms) with their ratio to eager's, the whole-graph choice
(the first run's, then final or revisited after the steady steps) and the step at which inductor's candidate
was adopted or dropped.  Processes run one after another: the machine drifts between
them by ±10-20% (compare ratios within one run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNERS = "eager,torch.compile,default cold,default warm,background cold,ort-only,fx"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-mini,cnn")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runners", default=RUNNERS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    print(f"# bench/early.py — torch {torch.__version__}, {os.cpu_count()} cores, {args.steps} steps per process, "
          "AdamW(fused=True), clipping")
    print("| model | runner | first step s | steps 1-20 s | steps 5-19 ms | x eager | last 50 ms | x eager | "
          "whole graph | candidate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.runners.split(","):
                cache = Path(tmp) / ("background" if name.startswith("background") else "default")
                env = {**os.environ, "SPMD_ORT_CACHE_DIR": str(cache),
                       "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "SPMD_ORT_LOG_LEVEL": "WARNING"}
                if name.startswith("background"):
                    env["SPMD_ORT_BACKGROUND_COMPILE"] = "1"
                out = Path(tmp) / "out.json"
                out.unlink(missing_ok=True)
                cmd = [sys.executable, __file__, "--worker", name, "--model", model, "--steps", str(args.steps),
                       "--out", str(out)]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0 or not out.exists():
                    results[name] = {"error": " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])}
                else:
                    results[name] = json.loads(out.read_text())
                print(f"{model} {name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        report(model, results)


def _median(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def report(model: str, results: dict) -> None:
    eager = results.get("eager", {}).get("times")
    for name, r in results.items():
        if "error" in r:
            print(f"| {model} | {name} | failed: {r['error'][-200:]} | | | | | | | |")
            continue
        t = r["times"]
        early, late = _median(t[4:19]), _median(t[-50:])
        ratio = (lambda v, lo, hi: f"{v / _median(eager[lo:hi]):.2f}") if eager else (lambda v, lo, hi: "-")
        print(f"| {model} | {name} | {t[0]:.1f} | {sum(t[:20]):.1f} | {early:.1f} | {ratio(early, 4, 19)} | "
              f"{late:.1f} | {ratio(late, -50, None)} | {r.get('whole') or '-'} | {r.get('candidate') or '-'} |",
              flush=True)


# ------------------------------------------------------------------ one runner, in its own process
def worker(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import spmd_ort
    from step import MODELS, make_adamw, train_step

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    torch.manual_seed(0)
    model, batch = MODELS[args.model]()
    opt = make_adamw(model.parameters())
    name = args.worker
    compiled = None
    if name == "eager":
        step = lambda *b: train_step(model, opt, *b)  # noqa: E731
    elif name == "torch.compile":
        fast = torch.compile(model)
        step = lambda *b: train_step(fast, opt, *b)  # noqa: E731
    else:
        kwargs = {"ort-only": {"backend": "ort", "autotune": False}, "fx": {"backend": "fx"}}.get(name, {})
        compiled = spmd_ort.compile(**kwargs)(train_step)
        step = lambda *b: compiled(model, opt, *b)  # noqa: E731
    times = []
    for _ in range(args.steps):
        b = batch()
        t0 = time.perf_counter()
        step(*b)
        times.append(time.perf_counter() - t0)
    out = {"times": times}
    if compiled is not None:
        decided = [str(d) for d in compiled.tuner.decisions if str(d).startswith("inductor candidate")]
        out["candidate"] = decided[-1].split(" (")[0].removeprefix("inductor candidate: ") if decided else None
        whole = [d for d in compiled.compiled.executor.decisions() if d.subject == "whole graph"]
        whole += [d for d in compiled.tuner.decisions if d.subject == "whole graph"]  # final, or revisited
        out["whole"] = "; ".join(d.choice.split(" in the steady")[0] for d in whole) or None
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
