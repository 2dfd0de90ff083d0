"""The cost of activation statistics: gpt-mini steps with and without a StatisticsSubscriber, side by side.

Run:  .venv/bin/python bench/debug_overhead.py [--steps 7] [--backends fx,ort]

For each backend: two compiled copies of the same model, one subscribed (every submodule
output of every step: statistics computed in the graph, files written by a background
thread), stepped alternately; median ms/step of each and the ratio.  Eager with and
without the subscriber likewise.  AdamW(fused=True), clipping, all cores.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import spmd_ort  # noqa: E402
from spmd_ort.debug import GlobalSubscriberManager, StatisticsSubscriber  # noqa: E402
from step import gpt_mini, make_adamw, train_step  # noqa: E402


# the "ort" runner is the default backend as users get it (backend="auto"), as in RESULTS' tables
DEFAULT_BACKENDS = {"ort": "auto"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--backends", default="eager,fx,ort")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    spmd_ort.runtime.memory.retain_host_memory()
    torch.manual_seed(0)
    model, batch = gpt_mini()
    out = Path(tempfile.mkdtemp(prefix="spmd_ort_stats_"))
    print(f"# bench/debug_overhead.py — gpt-mini, {torch.get_num_threads()} threads, median of {args.steps} steps")
    print("| backend | without ms | with statistics ms | ratio | activations/step |")
    print("|---|---|---|---|---|")
    for backend in args.backends.split(","):
        runs = {}
        for watched in (False, True):
            m = copy.deepcopy(model)
            if watched:
                GlobalSubscriberManager.subscribe(m, [StatisticsSubscriber(out / backend, override_output_dir=True)])
            fn = train_step if backend == "eager" else spmd_ort.compile(backend=DEFAULT_BACKENDS.get(backend, backend))(train_step)
            runs[watched] = (m, make_adamw(m.parameters()), fn, [])
        for i in range(3 + args.steps):
            x, y = batch()
            for watched, (m, opt, fn, times) in runs.items():
                time.sleep(0.05)
                t0 = time.perf_counter()
                fn(m, opt, x, y)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
        GlobalSubscriberManager.flush()
        acts = len(list((out / backend / "step_0").glob("*.txt")))
        a, b = (statistics.median(runs[w][3]) * 1e3 for w in (False, True))
        print(f"| {backend} | {a:.1f} | {b:.1f} | {b / a:.2f} | {acts} |", flush=True)
        GlobalSubscriberManager.unsubscribe(runs[True][0])


if __name__ == "__main__":
    main()
