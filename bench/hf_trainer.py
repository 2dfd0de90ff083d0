"""The Hugging Face Trainer compiled against transformers' own, side by side: examples/hf_trainer.py's tiny Llama
(d 128, 2 layers, batch 8 x 128 characters, AdamW, cosine schedule, clipping), one process and 2 ranks.

    python bench/hf_trainer.py [--steps 40] [--repeats 3] [--ranks 1,2]

Each repeat runs transformers.Trainer, then spmd_ort's Trainer on the default backend and on fx, one after the
other (interleaved, so drift hits all alike). A step's time is the interval between the Trainer's ``on_step_end``
callbacks (data, the step, logging: what a user waits for); the figure is the median of the steps after the first
``--warmup`` (compile and the tuner's choices happen in those) over every repeat. Under torchrun (``--ranks 2``)
each rank runs one thread and the Trainer's own DDP is the eager side; rank 0's steps are reported.
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
sys.path.insert(0, str(ROOT))

KINDS = ("eager", "auto", "fx")


def worker(a) -> dict:
    import transformers

    from examples import hf_trainer as ex

    class Timer(transformers.TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    args = ex.parser().parse_args(["--steps", str(a.steps)])
    times = {k: [] for k in KINDS}
    compile_s = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(a.repeats):
            for kind in KINDS:
                args.backend = None if kind == "auto" else kind
                timer = Timer()
                t = ex.trainer(args, out, eager=kind == "eager", callbacks=[timer])
                start = time.perf_counter()
                t.train()
                steps = [b - e for e, b in zip(timer.ends, timer.ends[1:])]
                compile_s[kind].append(timer.ends[0] - start)
                times[kind] += steps[a.warmup:]
    return {k: {"ms": statistics.median(v) * 1e3, "first_s": statistics.median(compile_s[k])} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.worker:
        result = worker(a)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(a.out).write_text(json.dumps(result))
        return
    rows = []
    for n in map(int, a.ranks.split(",")):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "r.json"
            launch = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={n}"]
            env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if n > 1 else {})}
            subprocess.run([*launch, __file__, "--worker", "--out", str(out), "--steps", str(a.steps),
                            "--warmup", str(a.warmup), "--repeats", str(a.repeats)], check=True, env=env, cwd=ROOT,
                           capture_output=True)
            r = json.loads(out.read_text())
        eager = r["eager"]["ms"]
        rows.append(f"| {n} | {eager:.1f} | {r['auto']['ms']:.1f} | {r['auto']['ms'] / eager:.2f}x | "
                    f"{r['fx']['ms']:.1f} | {r['fx']['ms'] / eager:.2f}x | {r['eager']['first_s']:.1f} / "
                    f"{r['auto']['first_s']:.1f} / {r['fx']['first_s']:.1f} |")
    print(f"steps {a.steps} (median after {a.warmup}), {a.repeats} repeats interleaved\n")
    print("| ranks | transformers.Trainer ms/step | spmd_ort Trainer (default) ms | default/eager | spmd_ort (fx) ms |"
          " fx/eager | first step s (eager / default / fx) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
