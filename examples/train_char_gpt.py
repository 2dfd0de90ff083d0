"""Train a character-level GPT with the compiled train step on this repository's own text.

Run:  make demo           (sets up .venv, then runs this file on 2 ranks)
  or: torchrun --standalone --nproc_per_node=2 examples/train_char_gpt.py [--steps 300] [--backend fx]
  or: python examples/train_char_gpt.py      (one process)
  or: make demo-zero3   (2 ranks, ZeRO-3: --parallel fully_shard [--offload])
  or: torchrun --standalone --nproc_per_node=2 examples/train_char_gpt.py --parallel tp   (tensor parallel)
  or: torchrun --standalone --nproc_per_node=4 examples/train_char_gpt.py --parallel 2d [--dp-style fully_shard]
      (2 x 2: dp x tp; fully_shard on dp is FSDP2 + TP)
  or: make demo-big     (2 ranks: --big, a model bigger than one rank; fully_shard unless --parallel tp / 2d)
  or: torchrun --standalone --nproc_per_node=2 examples/train_char_gpt.py --big [--init-from out/demo_big]

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

``--big`` trains a bigger GPT (4 layers, d=256: 3.2 M parameters, 12 MiB of fp32 weights; fully_shard unless
``--parallel`` says otherwise, fx unless ``--backend`` does) the way a model bigger than one rank is built
(docs/big-models.md): on the meta device, ``spmd_ort.parallelize``, ``to_empty`` (each rank allocates its part
only), then values for that part: the GPT's own init run on the DTensor shards (each shard drawn from a seed of
its own, replicated tensors from a seed every rank shares), or ``--init-from`` a safetensors file or Hugging Face
directory read with ``spmd_ort.load_safetensors`` (each rank reads its part only).  Then the optimizer and the
compiled step; after training it prints each rank's memory against the full model's (its parameters and
optimizer state, its resident memory after loading and at its peak, the bytes it read) and saves the weights
with ``spmd_ort.save_safetensors`` to ``--save`` (out/demo_big/, with char_gpt.json, the shape and vocabulary,
so ``--init-from out/demo_big`` trains on from them, in any ``--parallel`` layout).

The corpus is the repository's Python sources and docs, so nothing is
downloaded.  It prints loss and steps/s as it goes and a sample at the end; the
loss falls from ln(vocab) ~ 4.5 to about 2 in 300 steps (~20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import sys
import time
import warnings
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


MIB = 2**20
CONFIG = "char_gpt.json"  # next to --big's saved weights: the model's shape and vocabulary


def resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, in bytes: resident now and its peak."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak_resident() -> None:
    """Start VmHWM again from VmRSS (Linux: ``5`` to /proc/self/clear_refs), so the peak is the training's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def init_weights(model: GPT, seed: int) -> None:
    """The GPT's own init (examples/gpt.py: ``GPT._init`` on every module, unit norms, then GPT-2's scaled
    residual projections) on a parallelized model's DTensor parameters, each rank drawing its own part.

    On the CPU every rank would draw the same values into its shard from one seed (one row of every pair of
    ``fully_shard`` rows, one head of every pair of tensor-parallel heads, alike: symmetries training may never
    break), so each random weight is drawn under a seed of its own: the seed, the module's index and this rank's
    coordinates on the mesh dimensions the weight is sharded over, and none for a replicated one, which every
    rank then draws alike.  Not a one-process init's values (docs/big-models.md)."""
    from torch.distributed.tensor import DTensor

    def seeded(weight: torch.Tensor, *key: int) -> None:
        coordinate = ()
        if isinstance(weight, DTensor):
            coordinate = tuple(c for c, pl in zip(weight.device_mesh.get_coordinate(), weight.placements)
                               if pl.is_shard())
        torch.manual_seed(hash((seed, *key, *coordinate)) & (2**63 - 1))  # a tuple of ints: the same on every rank

    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DTensor random operators")  # on the CPU: why the seeds above
        for index, (name, module) in enumerate(model.named_modules()):
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                seeded(module.weight, index)
                GPT._init(module)
            elif isinstance(module, torch.nn.LayerNorm):
                module.reset_parameters()
            if name.endswith(".out"):  # residual projections, scaled as in GPT-2
                seeded(module.weight, index, 1)
                torch.nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * model.cfg.layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="300 (--big: 150)")
    ap.add_argument("--batch", type=int, default=None, help="16 (--big: 8)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--big", action="store_true",
                    help="a bigger GPT built on the meta device, parallelized, given values on each rank's part; "
                         "prints each rank's memory against the full model's and saves the weights to --save")
    ap.add_argument("--width", type=int, default=None, help="the model's width d (128; --big: 256)")
    ap.add_argument("--layers", type=int, default=None, help="its blocks (3; --big: 4)")
    ap.add_argument("--init-from", default=None,
                    help="--big: the initial weights from this safetensors file or Hugging Face directory (a "
                         "directory --save wrote: its shape and vocabulary too) instead of the model's init")
    ap.add_argument("--save", default=str(ROOT / "out" / "demo_big"),
                    help="--big: where spmd_ort.save_safetensors writes the trained weights (a directory)")
    ap.add_argument("--backend", default=None,
                    help="fx (default from SPMD_ORT_BACKEND; --big: fx, the first run of ORT's ~100 segments takes "
                         "longer than the training, and their sessions hold more than the model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", default=None, choices=["replicate", "fully_shard", "tp", "2d", "cp"],
                    help="replicate (--big: fully_shard)")
    ap.add_argument("--dp-style", default="replicate", choices=["replicate", "fully_shard"],
                    help="--parallel 2d: what the dp dim does (fully_shard: FSDP2 + TP)")
    ap.add_argument("--offload", action="store_true", help="fully_shard: optimizer and parameters on the host")
    ap.add_argument("--timeline", default=str(ROOT / "out" / "demo_timeline"),
                    help="where the profile of the last two steps goes (<path>.json, <path>.png)")
    ap.add_argument("--explain", action="store_true", help="print train_step.explain() at the end")
    args = ap.parse_args()
    if args.init_from and not args.big:
        ap.error("--init-from goes with --big")
    args.parallel = args.parallel or ("fully_shard" if args.big else "replicate")
    args.steps = args.steps or (150 if args.big else 300)
    args.backend = args.backend or ("fx" if args.big else None)
    args.batch = args.batch or (8 if args.big else 16)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))

    text = load_corpus()
    chars = sorted(set(text))
    saved = Path(args.init_from) / CONFIG if args.init_from else None
    if saved is not None and saved.is_file():  # the shape and vocabulary the weights were trained with
        saved = json.loads(saved.read_text())
        chars, args.seq, args.width, args.layers = saved["chars"], saved["seq"], saved["d"], saved["layers"]
        known = set(chars)
        text = "".join(c for c in text if c in known)
    else:
        saved = None
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    log(f"corpus: {len(text):,} characters of this repository, vocabulary {len(chars)}; {world} rank(s)")

    tp = world > 1 and args.parallel in ("tp", "2d")
    if args.parallel == "2d" and (world < 4 or world % 2):
        raise SystemExit(f"--parallel 2d needs an even number of ranks, at least 4 (dp x tp with tp = 2); got {world}")
    if args.big:  # q, k, v apart in every layout, so one saved model loads into any of them
        d = args.width or 256
        cfg = GPTConfig(vocab=len(chars), seq=args.seq, d=d, heads=saved["heads"] if saved else max(2, d // 64),
                        layers=args.layers or 4, split_qkv=True)
    else:
        cfg = GPTConfig(vocab=len(chars), seq=args.seq, d=args.width or 128, heads=4, layers=args.layers or 3,
                        split_qkv=tp)

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
    elif args.parallel == "cp":  # context parallel: each sequence split over the ranks (docs/context-parallel.md)
        mode = spmd_ort.Parallel(cp=-1)
    else:
        mode = spmd_ort.DataParallel(parallel_style=args.parallel,
                                     bucket_cap_mb="auto" if args.parallel == "replicate" else 1.0,
                                     offload_optimizer="cpu" if args.offload else None,
                                     offload_param="cpu" if args.offload else None) if world > 1 else None

    if args.big:  # docs/big-models.md: meta, parallelize, to_empty, values for this rank's part; no rank holds it all
        for name in ("safetensors.torch", "torch.distributed.tensor.parallel"):  # what building and loading
            importlib.import_module(name)                                     # import, before the baseline
        with torch.device("meta"):  # and torch's meta kernels (~30 MiB, loaded by the first module built on meta)
            GPT(GPTConfig(vocab=2, seq=2, d=2, heads=1, layers=1))
        gc.collect()
        base = resident()[0]  # after imports, process group and corpus; before the model
        reset_peak_resident()
        with torch.device("meta"):
            model = GPT(cfg)
        if mode is not None:
            spmd_ort.parallelize(model, mode)
        model.to_empty(device="cpu")
        if mode is None:  # one process: torch's to_empty gives each module that held the tied weight its own
            model.head.weight = model.wte.weight
        read = None
        if args.init_from:
            read = spmd_ort.load_safetensors(model, args.init_from)
        else:
            init_weights(model, args.seed)
        gc.collect()
        loaded = resident()[0] - base
        how = f"loaded from {args.init_from}" if args.init_from else "the GPT's init on each rank's part"
        layout = f"parallelize ({args.parallel}), " if mode is not None else ""
        log(f"model: GPT {cfg.layers} layers, d={cfg.d}, {cfg.heads} heads: "
            f"{sum(p.numel() for p in model.parameters()):,} parameters; built on meta, {layout}to_empty, {how}")
        lr = 1e-3
    else:
        model = GPT(cfg)
        lr = 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.steps,
                                                pct_start=max(0.1, 2 / args.steps))
    if not args.big:
        log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")

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
    # (context parallel: the ranks split one batch's sequences)
    g = torch.Generator().manual_seed(args.seed + (dp_rank if args.parallel == "2d" else 0 if tp or
                                                   args.parallel == "cp" else rank))

    def batch(source: torch.Tensor):
        ix = torch.randint(len(source) - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([source[i:i + args.seq] for i in ix])
        y = torch.stack([source[i + 1:i + args.seq + 1] for i in ix])
        return x, y

    log(f"initial loss should be about ln({len(chars)}) = {math.log(len(chars)):.2f}"
        + (" from a fresh init; lower from trained weights" if args.init_from else ""))
    t0, t_last = time.perf_counter(), time.perf_counter()
    for step in range(1, args.steps + 1):
        # the timeline of the last two steps: every rank calls profile() here (--big: not, its steps run node by node)
        if step == args.steps - 1 and not args.big:
            train_step.profile(steps=2, path=args.timeline)
        x, y = batch(train)
        loss = train_step(model, opt, x, y, last_train_step=step == args.steps)
        sched.step()
        if step == 1:
            log(f"step    1  loss {loss.item():.3f}  (compiled in {train_step.compiled.compile_seconds:.1f}s)")
            if args.big:  # the peak while compiling; then VmHWM again from now, for the training's own
                compile_peak = resident()[1] - base
                reset_peak_resident()
            t_last = time.perf_counter()
        elif step % 50 == 0 or step == args.steps:
            now = time.perf_counter()
            rate = (50 if step % 50 == 0 else step % 50) / (now - t_last)
            comm = train_step.comm
            if world > 1 and args.parallel == "fully_shard":
                extra = (f"  {comm.all_gather_calls} all-gather + {comm.reduce_scatter_calls} reduce-scatter/step, "
                         f"{comm.total_bytes / 2**20:.2f} MiB, {comm.overlap:.0%} overlapped")
            elif args.parallel == "cp":
                extra = (f"  {comm.all_gather_calls} all-gather (K, V) + {comm.reduce_scatter_calls} reduce-scatter "
                         f"(their gradients) + {comm.all_reduce_calls} all-reduce/step, {comm.total_bytes / 2**20:.2f} "
                         "MiB")
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

    if args.big:
        peak = resident()[1] - base
        memory_report(log, model, train_step.memory(), loaded, compile_peak, peak, read, world)
    if train_step.profile_paths is not None:
        trace, picture = train_step.profile_paths
        log(f"timeline of the last two steps: {picture} (open {trace} in https://ui.perfetto.dev or chrome://tracing)")
    if args.explain:
        log(train_step.explain())
    if world > 1 and args.parallel == "fully_shard" and not args.big:
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
        if tp and not args.big:
            memory = train_step.memory()["persistent"]
            log(f"tensor parallel: {memory['params'] / 2**20:.2f} MiB of parameters on this rank "
                f"({sum(p.numel() for p in model.parameters()) * 4 / 2**20:.2f} MiB in all); "
                f"blocks.0.q.weight is a DTensor {tuple(model.blocks[0].q.weight.placements)}")
        elif world > 1 and not tp:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            copies = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(copies, flat)
            log("parameters identical on all ranks:", all(torch.equal(copies[0], c) for c in copies))
        prompt = torch.tensor([[stoi[c] for c in "def "]], dtype=torch.long)
        out = model.generate(prompt, 240, generator=torch.Generator().manual_seed(1))
        log("sample:\n" + "".join(chars[i] for i in out[0].tolist()))
    if args.big:  # Hugging Face's layout (each tensor gathered in turn; rank 0 writes), then the shape and vocabulary
        spmd_ort.save_safetensors(model, args.save)
        if rank == 0:
            shape = {"seq": cfg.seq, "d": cfg.d, "heads": cfg.heads, "layers": cfg.layers}
            (Path(args.save) / CONFIG).write_text(json.dumps({**shape, "chars": chars}))
        shown = os.path.relpath(args.save)
        shown = args.save if shown.startswith("..") else shown
        log(f"saved to {shown} (model.safetensors, {CONFIG}); train on from it: --big --init-from {shown}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def memory_report(log, model: GPT, memory: dict, loaded: int, compile_peak: int, peak: int, read,
                  world: int) -> None:
    """Rank 0 prints every rank's memory against the full model's, in MiB and in units of the full fp32 weights
    (collective: every rank calls it)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # global shapes, also of DTensors
    persistent = memory["persistent"]
    mine = [persistent["params"], persistent["opt_state"], persistent["params"] + persistent["opt_state"],
            memory["peak"], loaded, compile_peak, peak, read.bytes_read if read is not None else 0]
    every = torch.tensor(mine, dtype=torch.float64)
    if dist.is_initialized():
        gathered = [torch.empty_like(every) for _ in range(world)]
        dist.all_gather(gathered, every)
        every = torch.stack(gathered)
    else:
        every = every[None]

    def cells(i: int) -> str:
        return "  ".join(f"{v / MIB:8.1f} MiB {v / weights:6.2f}x" for v in every[:, i].tolist())

    log(f"memory per rank against the full model ({world} rank(s); x: units of the full fp32 weights)")
    log(f"  full model: weights {weights / MIB:.1f} MiB (1x), training state (weights, gradients, AdamW's 2 "
        f"moments) {4 * weights / MIB:.1f} MiB (4x)")
    log("  " + " " * 40 + "  ".join(f"{'rank ' + str(r):>20}" for r in range(world)))
    rows = ["parameters (step.memory())", "optimizer state (step.memory())", "parameters + optimizer state",
            "planned peak of a step (step.memory())", "resident after loading (VmRSS)",
            "peak in step 1, compiling (VmHWM)", "peak over the later steps (VmHWM)"]
    rows += ["read from the file (load_safetensors)"] if read is not None else []
    for i, row in enumerate(rows):
        log(f"  {row:<40}{cells(i)}")


if __name__ == "__main__":
    main()
