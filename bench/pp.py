"""Pipeline parallelism: each schedule's step time and bubble on 2 (and 4) ranks, against
torch.distributed.pipelining's own schedules on the same model and split (the eager peer), and the plan's prediction.

Run:  .venv/bin/python bench/pp.py [--ranks 2,4] [--microbatches 4,8] [--steps 5]

An untied GPT (examples/gpt.py: d 256, 8 heads, 8 blocks, vocabulary 1024, 128 tokens), a batch of 16 sequences,
AdamW and clipping at 1.0 over the whole model; the blocks split evenly over the stages (2 per rank for the
interleaved schedule).  Under torchrun, one thread per rank, each launch trains, for each schedule, a copy of the
model compiled with ``Parallel(pp=N, pipeline=Pipeline(...))`` (fx) and one driven by torch's schedule
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``; torch's stages hold the same blocks, clipping
over the stages by one all-reduce of the squared norms, as torchtitan's); zero bubble's peer is torch's 1F1B.  After
3 warm-up steps each, the two alternate step by step, ``--steps`` times; the table shows medians (the slower
rank's):

* ms/step, ours and torch's, and their ratio;
* bubble: ours measured, the share of the step the rank sat in a receive (the slower rank's), and the schedule's
  table on unit costs (what ``explain()`` prints);
* planned: ``plan()``'s step for rank 0 on this CPU with one thread a rank (the schedule simulated with the
  graph's priced F, B and W), and measured / planned.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
BATCH, SEQ, VOCAB, LAYERS = 16, 128, 1024, 8


def config():
    from examples.gpt import GPTConfig

    return GPTConfig(vocab=VOCAB, seq=SEQ, d=256, heads=8, layers=LAYERS, tie_head=False)


def gpt_step(model, opt, x, y):
    import torch
    import torch.nn.functional as F

    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def pipeline(schedule: str, world: int, m: int):
    import spmd_ort

    v = 2 if schedule == "interleaved_1f1b" else 1
    stages = world * v
    split = [f"blocks.{k * LAYERS // stages}" for k in range(1, stages)]
    return spmd_ort.Pipeline(microbatches=m, schedule=schedule, stages_per_rank=v, split=split)


class Stage:
    """Blocks [lo, hi) of a GPT, with the embeddings on the first stage and the head on the last (torch's
    pipelining takes one module per stage)."""

    def __new__(cls, model, lo: int, hi: int, first: bool, last: bool):
        import torch
        from torch import nn

        class _Stage(nn.Module):
            def __init__(self):
                super().__init__()
                self.wte, self.wpe = (model.wte, model.wpe) if first else (None, None)
                self.blocks = nn.ModuleList(model.blocks[lo:hi])
                self.ln_f, self.head = (model.ln_f, model.head) if last else (None, None)

            def forward(self, x):
                if self.wte is not None:
                    x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
                for block in self.blocks:
                    x = block(x)
                return self.head(self.ln_f(x)) if self.head is not None else x

        return _Stage()


def torch_runner(schedule: str, model, world: int, rank: int, m: int):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    v = 2 if schedule == "interleaved_1f1b" else 1
    n = world * v
    per = LAYERS // n
    mine = [s for s in range(n) if s % world == rank]
    modules = [Stage(model, s * per, (s + 1) * per, s == 0, s == n - 1) for s in mine]
    stages = [PipelineStage(mod, s, n, torch.device("cpu")) for mod, s in zip(modules, mine)]
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, -2), y.flatten())

    if schedule == "interleaved_1f1b":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    else:
        sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stages[0], m, loss_fn=loss_fn)

    def run(x, y):
        losses = []
        kwargs = {}
        if 0 in mine:
            args = (x,)
        else:
            args = ()
        if n - 1 in mine:
            kwargs = {"target": y, "losses": losses}
        sched.step(*args, **kwargs)
        norm2 = sum((p.grad.detach() ** 2).sum() for p in params if p.grad is not None)
        dist.all_reduce(norm2)  # the whole model's norm, over the stages
        coef = torch.clamp(1.0 / (norm2.sqrt() + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import spmd_ort
    from examples.gpt import GPT

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = GPT(config())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    out = {}
    for schedule in args.schedules.split(","):
        ours_model = copy.deepcopy(base)
        opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-3)
        step = spmd_ort.compile(parallel_mode=spmd_ort.Parallel(pp=world, pipeline=pipeline(schedule, world,
                                                                                              args.micro)),
                                backend="fx")(gpt_step)
        peer = "1f1b" if schedule == "zero_bubble" else schedule
        theirs = torch_runner(peer, copy.deepcopy(base), world, rank, args.micro)

        def ours():
            step(ours_model, opt, x, y)

        for _ in range(3):
            ours()
            theirs(x, y)
        times = {"ours": [], "torch": []}
        blocked = []
        for _ in range(args.steps):
            for name, run in (("ours", ours), ("torch", lambda: theirs(x, y))):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
                if name == "ours":
                    blocked.append(step.comm.blocked_s / step.comm.wall_s)
        out[schedule] = {"ours_ms": statistics.median(times["ours"]) * 1e3,
                         "torch_ms": statistics.median(times["torch"]) * 1e3,
                         "blocked": statistics.median(blocked), "traces": len(step.variants)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def planned(schedule: str, world: int, m: int, spec) -> tuple[float, float]:
    """plan()'s step for rank 0 and its simulated bubble, on the meta device in a fake world."""
    import torch

    import spmd_ort
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT(config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd_ort.compile(parallel_mode=spmd_ort.Parallel(pp=world, pipeline=pipeline(schedule, world, m)),
                            backend="fx")(gpt_step)
    x = torch.zeros(BATCH, SEQ, dtype=torch.long)
    plan = step.plan(model, opt, x, x, world_size=world, device=spec, export=False)
    return plan.predicted_step_s * 1e3, plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--micro", type=int, default=4)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import multirank
    from spmd_ort.distributed.stages import simulate
    from spmd_ort.plan.device import DeviceSpec

    rows = []
    for world in [int(w) for w in args.ranks.split(",")]:
        spec = DeviceSpec.this_cpu(threads=1, ranks_per_node=world)
        for m in [int(k) for k in args.microbatches.split(",")]:
            ranks = multirank.launch(__file__, world, ["--worker", "--micro", str(m), "--steps", str(args.steps),
                                                       "--schedules", args.schedules], memory=False)
            for schedule in args.schedules.split(","):
                ours = max(r[schedule]["ours_ms"] for r in ranks)
                theirs = max(r[schedule]["torch_ms"] for r in ranks)
                blocked = max(r[schedule]["blocked"] for r in ranks)
                v = 2 if schedule == "interleaved_1f1b" else 1
                table = simulate(schedule, world, m, v).bubble
                plan_ms, _ = planned(schedule, world, m, spec)
                rows.append((world, m, schedule, ours, theirs, blocked, table, plan_ms))
    print("| ranks | micro-batches | schedule | ours (ms/step) | torch.distributed.pipelining (ms/step) | ours / torch "
          "| bubble measured (blocked in receives) | bubble of the table | planned (ms/step) | measured / planned |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for world, m, schedule, ours, theirs, blocked, table, plan_ms in rows:
        peer = " (vs 1f1b)" if schedule == "zero_bubble" else ""
        print(f"| {world} | {m} | {schedule} | {ours:.1f} | {theirs:.1f}{peer} | {ours / theirs:.2f} | "
              f"{blocked:.1%} | {table:.1%} | {plan_ms:.1f} | {ours / plan_ms:.2f} |")
    by = {(w, m, s): o for w, m, s, o, *_ in rows}
    for world, m, schedule, *_ in rows:
        if schedule == "zero_bubble" and (world, m, "1f1b") in by:
            print(f"zero bubble / 1F1B, {world} ranks, {m} micro-batches: "
                  f"{by[(world, m, 'zero_bubble')] / by[(world, m, '1f1b')]:.2f}")


if __name__ == "__main__":
    main()
