"""Context parallelism: each rank's peak memory and step time with ``Parallel(cp=2)`` against one rank on the whole
sequence, at sequence lengths 1K-16K.

Run:  .venv/bin/python bench/cp.py [--lengths 1024,2048,4096,8192,16384] [--steps 2]
      .venv/bin/python bench/cp.py --plan 131072   (Llama-3-8B planned on 64 H100s: dp_shard=64 against 8 x cp=8)

A GPT (examples/gpt.py: 4 layers, d 128, 2 heads, vocabulary 256, batch 1, causal sdpa), AdamW, clipping.  Three
runners, each under torchrun with one thread per rank (what a rank gets under torchrun, and the same compute per
rank in every runner): ``eager`` and ``fx`` (spmd_ort.compile, backend fx) on one rank with the whole sequence, and
``cp2`` (``Parallel(cp=2)``, fx) on two ranks, each passing the whole batch.  After a first step (and a second:
the compiled step's tuner) the kernel's high-water mark is reset; over ``--steps`` more steps:

* peak MiB: the high-water mark of the resident set minus the resident set before them, per rank (the largest);
* ms/step: the median step time (the slowest rank's).

Memory and time come from separate launches: for memory, glibc returns freed blocks to the system
(``MALLOC_MMAP_THRESHOLD_``), so the resident set follows the live tensors; for time, the allocator as users have it
(returning every block would add page faults to each step).
The ratios are cp2's against one rank's (eager and fx), in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import multirank
from multirank import MIB, ROOT, measure
RUNNERS = {"eager": 1, "fx": 1, "cp2": 2}


def worker(runner: str, seq: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    import spmd_ort
    from examples.gpt import GPT, GPTConfig

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=seq, d=128, heads=2, layers=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if runner != "eager":
        mode = spmd_ort.Parallel(cp=2) if runner == "cp2" else None
        step = spmd_ort.compile(parallel_mode=mode, backend="fx")(step)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (1, seq), generator=g) for _ in range(2))
    measured = measure(lambda: step(model, opt, x, y), steps)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(measured))
    dist.barrier()
    dist.destroy_process_group()


def launch(runner: str, seq: int, steps: int, memory: bool) -> dict:
    ranks = multirank.launch(__file__, RUNNERS[runner], ["--worker", runner, "--seq", str(seq), "--steps", str(steps)],
                             memory)
    return {"peak": max(r["peak"] for r in ranks) / MIB, "ms": max(r["ms"] for r in ranks)}


def plan(tokens: int) -> None:
    """Llama-3-8B (examples/llama3.py, bf16 parameters, fp32 reductions) planned for 64 H100s at ``tokens`` tokens
    per sequence, activation_memory_budget=0: ``Parallel(dp_shard=64)`` against ``Parallel(dp_shard=8, cp=8)``."""
    import dataclasses

    import torch

    sys.path.insert(0, str(ROOT))
    import spmd_ort
    from examples.llama3 import LLAMA3_8B, Llama3, train_step

    with torch.device("meta"):
        model = Llama3(dataclasses.replace(LLAMA3_8B, max_seq_len=tokens))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batch = torch.empty(1, tokens, dtype=torch.long, device="meta")
    print("| layout | activations GiB/rank | reserved GiB/rank | all-gather GiB (calls) | reduce-scatter GiB (calls) | "
          "predicted step s | tokens/s/GPU |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for layout in (spmd_ort.Parallel(dp_shard=64, mixed_precision=policy),
                   spmd_ort.Parallel(dp_shard=8, cp=8, mixed_precision=policy)):
        step = spmd_ort.compile(parallel_mode=layout, activation_memory_budget=0.0, backend="fx")(train_step)
        p = step.plan(model, opt, batch, batch.clone(), world_size=64, export=False)
        name = "dp_shard=64" if layout.cp == 1 else "dp_shard=8, cp=8"
        rows[name] = p
        per_gpu = tokens / layout.cp / p.predicted_step_s
        print(f"| {name} | {p.per_rank_bytes['activations'] / 2**30:.1f} | {p.per_rank_bytes['reserved'] / 2**30:.1f} | "
              f"{p.comm_bytes['all_gather'] / 2**30:.1f} ({p.comm_calls['all_gather']}) | "
              f"{p.comm_bytes['reduce_scatter'] / 2**30:.1f} ({p.comm_calls['reduce_scatter']}) | "
              f"{p.predicted_step_s:.2f} | {per_gpu:,.0f} |", flush=True)
    a, b = (rows[k].per_rank_bytes["activations"] for k in ("dp_shard=8, cp=8", "dp_shard=64"))
    print(f"\nactivations per rank, cp=8 against dp_shard=64: {a / b:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=int, default=0, metavar="TOKENS",
                    help="instead: plan Llama-3-8B on 64 H100s at TOKENS tokens, dp_shard=64 against dp_shard=8 x cp=8")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--worker")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.seq, args.steps, args.out)
        return
    if args.plan:
        plan(args.plan)
        return
    print("| tokens | eager 1 rank: MiB, ms | fx 1 rank: MiB, ms | cp=2 per rank: MiB, ms | cp2/eager memory | "
          "cp2/fx memory | cp2/eager time | cp2/fx time |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.lengths.split(",")):
        r = {name: {"peak": launch(name, seq, args.steps, True)["peak"], "ms": launch(name, seq, args.steps, False)["ms"]}
             for name in RUNNERS}
        e, f, c = r["eager"], r["fx"], r["cp2"]
        print(f"| {seq} | {e['peak']:.0f}, {e['ms']:.0f} | {f['peak']:.0f}, {f['ms']:.0f} | {c['peak']:.0f}, "
              f"{c['ms']:.0f} | {c['peak'] / e['peak']:.2f} | {c['peak'] / f['peak']:.2f} | {c['ms'] / e['ms']:.2f} | "
              f"{c['ms'] / f['ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
