"""A typical DeepSpeed training script, ported: the same JSON config, the same loop, no DeepSpeed engine.

Run:  torchrun --standalone --nproc_per_node=2 examples/from_deepspeed.py [--config configs/fp16.json] [--steps 30]
  or: python examples/from_deepspeed.py --config configs/bf16.json    (one process: the batch sizes are checked
      against world size 1, so pass --micro-batch to fit, or use a config written for 1 rank)

The DeepSpeed original::

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config="configs/fp16.json")
    for step in range(steps):
        for x, y in micro_batches(engine.gradient_accumulation_steps()):
            loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()          # steps optimizer and scheduler every accumulation boundary

with spmd_ort (what the engine did, as plain PyTorch parts, compiled into one graph)::

    plan = spmd_ort.from_deepspeed_config("configs/fp16.json", model)
    step = spmd_ort.compile(parallel_mode=plan.parallel_mode)(plan.make_train_step(loss_fn))
    for _ in range(steps):
        loss = step(model, plan.optimizer, plan.scaler, micro_batches(plan.gradient_accumulation_steps))
        plan.step_scheduler()      # not after a step skipped for an fp16 overflow, as DeepSpeed

``configs/fp16.json`` is ZeRO-2 with fp16 (parameters cast to fp16 for compute over fp32 masters,
dynamic loss scaling with hysteresis), AdamW, WarmupDecayLR, clipping 1.0 and 2 accumulated
micro-batches of 8 per rank on 2 ranks (train_batch_size 32); ``configs/bf16.json`` is ZeRO-3 with
bf16 and WarmupCosineLR.  The model is the repository's small GPT on random tokens; rank 0 prints
the loss, the loss scale and the learning rate.  On this CPU half-precision matmuls are slow: the
point is the port, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import spmd_ort  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "fp16.json"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    ap.add_argument("--backend", default="fx")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    log = print if rank == 0 else (lambda *a, **k: None)

    config = json.loads(Path(args.config).read_text())
    if args.micro_batch is not None:  # e.g. one process: keep the config's other batch sizes consistent
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
        config["train_batch_size"] = args.micro_batch * config.get("gradient_accumulation_steps", 1) * world
    cfg = GPTConfig(vocab=128, seq=32, d=64, heads=4, layers=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = spmd_ort.from_deepspeed_config(config, model)
    log(f"{Path(args.config).name} on {world} rank(s): {plan.parallel_mode}\n"
        f"  optimizer {type(plan.optimizer).__name__}, scheduler {type(plan.scheduler).__name__}, "
        f"scaler {type(plan.scaler).__name__ if plan.scaler else None}, clip {plan.gradient_clipping}, "
        f"{plan.gradient_accumulation_steps} x {plan.train_micro_batch_size_per_gpu} per rank")
    step = spmd_ort.compile(parallel_mode=plan.parallel_mode, backend=args.backend)(plan.make_train_step(loss_fn))

    g = torch.Generator().manual_seed(1000 + rank)  # every rank its own data

    def micro_batches():
        n = plan.train_micro_batch_size_per_gpu
        return [(torch.randint(0, cfg.vocab, (n, cfg.seq), generator=g),
                 torch.randint(0, cfg.vocab, (n, cfg.seq), generator=g))
                for _ in range(plan.gradient_accumulation_steps)]

    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(model, plan.optimizer, plan.scaler, micro_batches())
        plan.step_scheduler()
        if i % 5 == 0 or i == args.steps - 1:
            scale = float(plan.scaler._scale) if plan.scaler is not None else None
            log(f"step {i:3d}  loss {float(loss):.4f}  scale {scale}  lr {plan.optimizer.param_groups[0]['lr']:.2e}"
                f"  ({time.perf_counter() - t0:.1f} s)")
    log(f"all-gather {step.comm.all_gather_bytes / 2**10:.0f} KiB, reduce-scatter "
        f"{step.comm.reduce_scatter_bytes / 2**10:.0f} KiB, all-reduce {step.comm.all_reduce_bytes / 2**10:.0f} KiB "
        "in the last step")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
