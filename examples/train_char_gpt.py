"""Train a character-level GPT with the compiled train step on this repository's own text.

Run:  make demo           (sets up .venv, then runs this file on 2 ranks)
  or: torchrun --standalone --nproc_per_node=2 examples/train_char_gpt.py [--steps 300] [--backend fx]
  or: python examples/train_char_gpt.py      (one process)
  or: make demo-zero3   (2 ranks, ZeRO-3: --parallel fully_shard [--offload])
  or: torchrun --standalone --nproc_per_node=2 examples/train_char_gpt.py --parallel tp   (tensor parallel)
  or: torchrun --standalone --nproc_per_node=4 examples/train_char_gpt.py --parallel 2d [--dp-style fully_shard]
      (2 x 2: dp x tp; fully_shard on dp is FSDP2 + TP)

Under torchrun every rank trains on its own batches; the compiled step averages
gradients over ranks (spmd_ort.DataParallel, the default with several ranks), so
the model stays identical everywhere.  With ``--parallel fully_shard`` each rank
holds 1/N of the parameters and optimizer state (ZeRO-3); evaluation and
sampling then run inside ``spmd_ort.gathered_parameters``.  With ``--parallel tp``
torch's Megatron plan (``examples.gpt.tensor_parallel_plan``) splits attention
heads and MLP units over the ranks (``spmd_ort.TensorParallel``): every rank
trains on the same batches, holds DTensor parameters, and evaluates and samples
with the model as it is.  ``--parallel 2d`` (4 ranks) does both on a (dp, tp) mesh:
the plan over ``tp``, gradients averaged over ``dp``; each dp replica draws its
own batches.  Rank 0 prints.

The corpus is the repository's Python sources and docs, so nothing is
downloaded.  It prints loss and steps/s as it goes and a sample at the end; the
loss falls from ln(vocab) ~ 4.5 to about 2 in 300 steps (~20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import math
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
from examples.gpt import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402


def load_corpus() -> str:
    files = sorted(p for ext in ("*.py", "*.md") for p in ROOT.rglob(ext)
                   if ".venv" not in p.parts and ".git" not in p.parts)
    return "\n".join(p.read_text(errors="ignore") for p in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--backend", default=None, help="fx (default from SPMD_ORT_BACKEND)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", default="replicate", choices=["replicate", "fully_shard", "tp", "2d"])
    ap.add_argument("--dp-style", default="replicate", choices=["replicate", "fully_shard"],
                    help="--parallel 2d: what the dp dim does (fully_shard: FSDP2 + TP)")
    ap.add_argument("--offload", action="store_true", help="fully_shard: optimizer and parameters on the host")
    ap.add_argument("--timeline", default=str(ROOT / "out" / "demo_timeline"),
                    help="where the profile of the last two steps goes (<path>.json, <path>.png)")
    ap.add_argument("--explain", action="store_true", help="print train_step.explain() at the end")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))

    text = load_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    log(f"corpus: {len(text):,} characters of this repository, vocabulary {len(chars)}; {world} rank(s)")

    tp = world > 1 and args.parallel in ("tp", "2d")
    if args.parallel == "2d" and (world < 4 or world % 2):
        raise SystemExit(f"--parallel 2d needs an even number of ranks, at least 4 (dp x tp with tp = 2); got {world}")
    cfg = GPTConfig(vocab=len(chars), seq=args.seq, d=128, heads=4, layers=3, split_qkv=tp)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")

    # replicate: bucket sizes chosen from the first steps' measured costs (the default); fully_shard: 1 MiB
    # buckets (its all-gathers too), so a model this small still gets several to overlap
    dp_rank = 0
    if tp and args.parallel == "2d":  # tp = 2 within each pair of ranks, data parallel across the pairs
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        mode = spmd_ort.TensorParallel(tensor_parallel_plan(), mesh=mesh,
                                       data_parallel=spmd_ort.DataParallel(parallel_style=args.dp_style))
        dp_rank = mesh.get_local_rank("dp")
    elif tp:  # q, k, v and the MLP's first linear column-wise, the projections back row-wise
        mode = spmd_ort.TensorParallel(tensor_parallel_plan())
    else:
        mode = spmd_ort.DataParallel(parallel_style=args.parallel,
                                     bucket_cap_mb="auto" if args.parallel == "replicate" else 1.0,
                                     offload_optimizer="cpu" if args.offload else None,
                                     offload_param="cpu" if args.offload else None) if world > 1 else None

    @spmd_ort.compile(backend=args.backend, parallel_mode=mode)
    def train_step(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # data parallel: every rank draws its own batches; tensor parallel: the ranks compute one model, on one batch
    # (2-D: one batch per dp replica)
    g = torch.Generator().manual_seed(args.seed + (dp_rank if args.parallel == "2d" else 0 if tp else rank))

    def batch(source: torch.Tensor):
        ix = torch.randint(len(source) - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([source[i:i + args.seq] for i in ix])
        y = torch.stack([source[i + 1:i + args.seq + 1] for i in ix])
        return x, y

    log(f"initial loss should be about ln({len(chars)}) = {math.log(len(chars)):.2f}")
    t0, t_last = time.perf_counter(), time.perf_counter()
    for step in range(1, args.steps + 1):
        if step == args.steps - 1:  # the timeline of the last two steps: every rank calls profile() here
            train_step.profile(steps=2, path=args.timeline)
        x, y = batch(train)
        loss = train_step(model, opt, x, y, last_train_step=step == args.steps)
        sched.step()
        if step == 1:
            log(f"step    1  loss {loss.item():.3f}  (compiled in {train_step.compiled.compile_seconds:.1f}s)")
            t_last = time.perf_counter()
        elif step % 50 == 0 or step == args.steps:
            now = time.perf_counter()
            rate = (50 if step % 50 == 0 else step % 50) / (now - t_last)
            comm = train_step.comm
            if world > 1 and args.parallel == "fully_shard":
                extra = (f"  {comm.all_gather_calls} all-gather + {comm.reduce_scatter_calls} reduce-scatter/step, "
                         f"{comm.total_bytes / 2**20:.2f} MiB, {comm.overlap:.0%} overlapped")
            elif tp:
                megatron = "Megatron + dp" if args.parallel == "2d" else "Megatron"
                extra = (f"  {comm.all_reduce_calls} all-reduce/step ({megatron}), "
                         f"{comm.all_reduce_bytes / 2**20:.2f} MiB")
                if comm.all_gather_calls:  # 2-D fully_shard: the dp group's gathers and reduce-scatters
                    extra += (f"; dp: {comm.all_gather_calls} all-gather + {comm.reduce_scatter_calls} "
                              "reduce-scatter/step")
            elif world > 1:
                extra = (f"  {comm.all_reduce_calls} all-reduce/step, {comm.all_reduce_bytes / 2**20:.2f} MiB, "
                         f"{comm.overlap:.0%} overlapped")
            else:
                extra = ""
            log(f"step {step:4d}  loss {loss.item():.3f}  {rate:6.1f} steps/s  lr {sched.get_last_lr()[0]:.2e}{extra}")
            t_last = now

    if train_step.profile_paths is not None:
        trace, picture = train_step.profile_paths
        log(f"timeline of the last two steps: {picture} (open {trace} in https://ui.perfetto.dev or chrome://tracing)")
    if args.explain:
        log(train_step.explain())
    if world > 1 and args.parallel == "fully_shard":
        memory = train_step.memory()
        log(f"fully_shard: {memory['persistent']['total'] / 2**20:.2f} MiB of parameters + optimizer state per rank "
            f"(unsharded: {memory['persistent']['total'] * world / 2**20:.2f} MiB); wte.weight is a DTensor "
            f"{tuple(model.wte.weight.placements)} of shape {tuple(model.wte.weight.shape)}, "
            f"{tuple(model.wte.weight.to_local().shape)} on this rank")
    sharded = world > 1 and args.parallel == "fully_shard"
    full = spmd_ort.gathered_parameters(model) if sharded else contextlib.nullcontext()
    with full:  # fully_shard: the full weights, for evaluation and sampling
        model.eval()
        with torch.no_grad():
            vx, vy = batch(val)
            val_loss = F.cross_entropy(model(vx).flatten(0, 1), vy.flatten()).item()
        log(f"validation loss {val_loss:.3f}; {args.steps} steps in {time.perf_counter() - t0:.1f}s "
            f"({train_step.transitions.traces} traces)")
        if tp:
            memory = train_step.memory()["persistent"]
            log(f"tensor parallel: {memory['params'] / 2**20:.2f} MiB of parameters on this rank "
                f"({sum(p.numel() for p in model.parameters()) * 4 / 2**20:.2f} MiB in all); "
                f"blocks.0.q.weight is a DTensor {tuple(model.blocks[0].q.weight.placements)}")
        elif world > 1:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            copies = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(copies, flat)
            log("parameters identical on all ranks:", all(torch.equal(copies[0], c) for c in copies))
        prompt = torch.tensor([[stoi[c] for c in "def "]], dtype=torch.long)
        out = model.generate(prompt, 240, generator=torch.Generator().manual_seed(1))
        log("sample:\n" + "".join(chars[i] for i in out[0].tolist()))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
