"""``python -m spmd_ort.plan``: plan a language model's train step for N ranks before renting them.

    python -m spmd_ort.plan --model llama3-8b --world-size 64 --parallel fully_shard --batch 1 --seq 4096 \\
        --device h100
    python -m spmd_ort.plan --model hf:config.json --world-size 64 --parallel tp:8 --device h200 --picture mem.png
    python -m spmd_ort.plan --world-size 8 --batch 2 --seq 8192 --mixed-precision bf16 --checkpointing selective \\
        --backend inductor --device h100-96gb

The model is built on the meta device with ``transformers`` from a config (``llama3-8b`` is Llama 3 8B's:
32 layers, d 4096, 32 heads / 8 KV heads, FFN 14336, vocabulary 128256), trained by a plain step (cross-entropy
on the next token, ``clip_grad_norm_``, AdamW) compiled with the chosen parallel mode, and planned with
:meth:`spmd_ort.CompiledStep.plan`.  ``--parallel``: ``replicate``, ``fully_shard``, ``tp:T`` (tensor parallel
over ``T`` ranks, fully_shard over the rest: 2-D when ``T`` is less than the world), ``ep:E`` (a mixture-of-
experts model's ``model.layers.*.mlp.experts`` computed by expert over ``E`` ranks, fully_shard over the world),
``pp:P`` (pipeline stages over ``P`` ranks, the world: ``--schedule`` and ``--microbatches``; ``--schedule best``
plans every schedule and names the fastest).
``--mixed-precision bf16``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
``--checkpointing``: ``full``, ``selective`` (torchtitan's two modes) or an ``activation_memory_budget`` from 0 to 1.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import resource
import sys
import time

import torch

import spmd_ort
from spmd_ort.distributed.stages import SCHEDULES

from spmd_ort.plan.hf_configs import CONFIGS, SOURCES, config as published_config  # noqa: E402

MODELS = CONFIGS  # a published model's name: its architecture from spmd_ort/plan/hf_configs.py


def build_model(name: str, layers: int | None = None):
    """A transformers causal LM on the meta device: a known name, or ``hf:<config.json>`` (a file, or a directory
    holding one)."""
    import transformers

    if name.startswith("hf:"):
        config = transformers.AutoConfig.from_pretrained(name[3:])
    else:
        config = published_config(name)
    if layers is not None:
        config.num_hidden_layers = layers
    config.use_cache = False
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                 attn_implementation="sdpa")
        except ValueError:  # a family without an SDPA path (Gemma 2's soft-capping, gpt-oss's sinks): eager's
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                 attn_implementation="eager")


MLP = ("gate_proj", "up_proj", "down_proj")


def _hf_styles() -> dict:
    """transformers' tensor-parallel styles (``config.base_model_tp_plan``) that torch's styles (and ours: a
    per-head norm's replicated weight with its gradient summed over the group) express, as their makers; the
    others (packed, MoE) are left out."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from spmd_ort.distributed.tensor_parallel import replicate_with_grad_all_reduce

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
            "replicated_with_grad_allreduce": replicate_with_grad_all_reduce}


# attention's styles that hold only where each rank gets whole heads: the splits, and a per-head norm's gradient
# summed over the group (where the heads are not split, that would double it)
PER_HEAD = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def llama_tensor_parallel_plan(model, tp: int = 1) -> dict:
    """The tensor-parallel plan of a Hugging Face model: transformers' own plan for the family
    (``config.base_model_tp_plan``) in torch's styles -- Megatron's for a Llama-style decoder (attention's q/k/v
    and the MLP's gate/up column-wise, their output projections row-wise), or the family's own (Phi-3's and
    OLMo 2's projections split with their outputs gathered, GPT-NeoX's fused per-head projection, an embedding
    split by rows). Entries whose style torch has no equal for (packed and expert styles) are left out, and so
    are attention's head-splitting entries where ``tp`` does not divide the query and key/value heads. A
    per-head norm (Qwen 3's ``q_norm``, ``"replicated_with_grad_allreduce"``) stays replicated with its gradient
    summed over the group (:func:`spmd_ort.distributed.tensor_parallel.replicate_with_grad_all_reduce`). A family
    without a transformers plan gets Megatron's MLP where it has ``gate_proj``, ``up_proj`` and ``down_proj``.
    A model left with no entry (GPT-2's ``Conv1D``, Falcon) is a ``ValueError`` naming what was looked for."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    names = [name for name, _ in model.named_modules()]
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", 0)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    base = getattr(model, "base_model_prefix", "model")
    theirs = getattr(cfg, "base_model_tp_plan", None) or {}
    styles = _hf_styles()
    plan = {}
    for key, style in theirs.items():
        fqn = f"{base}.{key}"
        if style not in styles or not any(fnmatch.fnmatchcase(n, fqn) for n in names):
            continue
        if ("attn" in key or "attention" in key) and style in PER_HEAD and (heads % tp or kv % tp):
            continue
        plan[fqn] = styles[style]()
    if not theirs and all(f"{base}.layers.0.mlp.{p}" in names for p in MLP):
        col, row = ColwiseParallel(), RowwiseParallel()
        plan = {f"{base}.layers.*.mlp.gate_proj": col, f"{base}.layers.*.mlp.up_proj": col,
                f"{base}.layers.*.mlp.down_proj": row}
    if not plan:
        raise ValueError(f"no tensor-parallel plan fits {type(model).__name__}: transformers has none for it "
                         f"(config.base_model_tp_plan) in styles torch expresses, and it has no "
                         f"mlp.{{{','.join(MLP)}}} in {base}.layers.0 for Megatron's")
    return plan


EXPERTS = "model.layers.*.mlp.experts"  # where transformers' MoE models keep their experts


def parse_parallel(spec: str) -> int | str | tuple[str, int]:
    """``--parallel``: ``"replicate"``, ``"fully_shard"``, the tensor-parallel degree of ``tp:<T>``, or
    ``("ep", E)`` for ``ep:<E>``, ``("pp", P)`` for ``pp:<P>``."""
    if spec in ("replicate", "fully_shard"):
        return spec
    kind, _, degree = spec.partition(":")
    if kind not in ("tp", "ep", "pp") or not degree.isdigit() or int(degree) < 1:
        raise ValueError(f"--parallel {spec!r}: give replicate, fully_shard, tp:<T> (T ranks of tensor "
                         "parallelism), ep:<E> (experts over E ranks) or pp:<P> (pipeline stages over P ranks), a "
                         "positive integer dividing --world-size")
    return int(degree) if kind == "tp" else (kind, int(degree))


PRECISIONS = {"none": None, "bf16": (torch.bfloat16, torch.float32), "fp16": (torch.float16, torch.float32)}


def parallel_mode(spec: str, model, world: int, precision: str = "none", pipeline=None):
    kind = parse_parallel(spec)
    dtypes = PRECISIONS[precision]
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1]) if dtypes else None
    if isinstance(kind, str):
        return spmd_ort.DataParallel(parallel_style=kind, mixed_precision=policy)
    if isinstance(kind, tuple) and kind[0] == "pp":  # the stages over every rank of the world
        return spmd_ort.Parallel(pp=kind[1], pipeline=pipeline or spmd_ort.Pipeline())
    if isinstance(kind, tuple):  # expert parallel: fully_shard over the world, the experts over ep of its ranks
        return spmd_ort.Parallel(dp_shard=world, ep=kind[1], experts=EXPERTS, mixed_precision=policy)
    plan = llama_tensor_parallel_plan(model, kind)
    if kind == world:
        if policy is not None:  # a policy rides on the data-parallel mode: fully_shard over one group
            return spmd_ort.TensorParallel(plan, mesh=(1, kind), data_parallel=spmd_ort.DataParallel(
                parallel_style="fully_shard", mixed_precision=policy))
        return spmd_ort.TensorParallel(plan, mesh=(kind,))
    return spmd_ort.TensorParallel(plan, mesh=(world // kind, kind),
                                   data_parallel=spmd_ort.DataParallel(parallel_style="fully_shard",
                                                                       mixed_precision=policy))


def parse_checkpointing(value: str) -> float | str:
    """``--checkpointing``: none, full, selective, or a budget from 0 to 1."""
    if value in ("full", "selective"):
        return value
    if value == "none":
        return 1.0
    try:
        budget = float(value)
    except ValueError:
        budget = -1.0
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"--checkpointing {value!r}: give none, full, selective or a budget from 0 to 1")
    return budget


def check_arguments(ap: argparse.ArgumentParser, args) -> None:
    """Every bad argument: one line naming it and what is accepted (argparse's usage error, exit status 2),
    before anything is built."""
    from pathlib import Path

    from spmd_ort.plan import DEVICES

    for name in ("world_size", "batch", "seq", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} {value}: give a positive integer")
    if not 0 <= args.rank < args.world_size:
        ap.error(f"--rank {args.rank}: give a rank of the world, 0 to {args.world_size - 1}")
    try:
        kind = parse_parallel(args.parallel)
    except ValueError as exc:
        ap.error(str(exc))
    degree = kind[1] if isinstance(kind, tuple) else kind
    if isinstance(degree, int) and args.world_size % degree:
        ap.error(f"--parallel {args.parallel}: {degree} does not divide --world-size {args.world_size}")
    if isinstance(kind, tuple) and kind[0] == "pp" and degree != args.world_size:
        ap.error(f"--parallel {args.parallel}: pipeline parallelism is built alone: give pp:{args.world_size}")
    if args.schedule not in (*SCHEDULES, "best"):
        ap.error(f"--schedule {args.schedule!r}: give one of {', '.join(SCHEDULES)} or best")
    try:
        parse_checkpointing(args.checkpointing)
    except ValueError as exc:
        ap.error(str(exc))
    devices = [*DEVICES, "cpu"]
    if args.device.lower() not in devices:
        ap.error(f"--device {args.device!r}: give one of {', '.join(devices)}")
    if args.model.startswith("hf:"):
        path = Path(args.model[3:])
        if not (path.is_file() or (path / "config.json").is_file()):
            ap.error(f"--model {args.model!r}: {path} is neither a config.json nor a directory holding one")
    elif args.model not in MODELS:
        ap.error(f"--model {args.model!r}: give one of {', '.join(MODELS)} or hf:<config.json>")


def best_pipeline(planned, args, pp: int, layers: int):
    """``--schedule``'s plan; with ``best``, every schedule planned (interleaved with 2 stages a rank, where the
    micro-batches and layers allow), a line each, and the fastest predicted step's plan."""
    names = SCHEDULES if args.schedule == "best" else (args.schedule,)
    plans = []
    for name in names:
        v = 2 if name == "interleaved_1f1b" else 1
        if v > 1 and (args.microbatches % pp or layers < pp * v):
            continue
        pipeline = spmd_ort.Pipeline(microbatches=args.microbatches, schedule=name, stages_per_rank=v)
        plans.append((name, planned(pipeline)))
    if args.schedule == "best":
        for name, plan in plans:
            print(f"{name}: predicted step {plan.predicted_step_s * 1e3:.1f} ms, peak "
                  f"{plan.per_rank_bytes['peak'] / 2**30:.2f} GiB a rank ({plan.layout_notes[-1]})")
        name, plan = min(plans, key=lambda p: p[1].predicted_step_s)
        print(f"chosen: {name} ({args.microbatches} micro-batches), the fastest predicted step\n")
    return plans[0][1] if args.schedule != "best" else plan


def _count(n: int) -> str:
    """A parameter count as people write it: 8.03 B, 124.4 M, 52.3 K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "B" else f"{n / scale:.1f} {unit}"
    return str(n)


def lm_step(model, opt, tokens, labels):
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmd_ort.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b",
                    help=f"a published model ({', '.join(MODELS)}), or hf:<config.json>")
    ap.add_argument("--layers", type=int, help="override the config's number of layers")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--parallel", default="fully_shard", help="replicate | fully_shard | tp:<ranks>")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank (per data-parallel replica)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--device", default="h100", help="h100 | h100-96gb | h200 | a100 | cpu (this CPU, measured)")
    ap.add_argument("--mixed-precision", default="none", choices=tuple(PRECISIONS),
                    help="parameters in bf16 (or fp16) for compute, fp32 gradient reductions (FSDP2's policy)")
    ap.add_argument("--checkpointing", default="none",
                    help="none | full | selective (torchtitan's) | an activation_memory_budget from 0 to 1")
    ap.add_argument("--backend", default="ort", choices=("ort", "fx", "inductor"),
                    help="the executor the plan compiles for")
    ap.add_argument("--no-export", action="store_true", help="skip building the executor (the ORT export)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--picture", help="write the memory over the step to this PNG")
    ap.add_argument("--json", help="write the plan's figures to this file")
    ap.add_argument("--no-cache", action="store_true", help="plan afresh: neither read nor keep the plan in "
                                                           "SPMD_ORT_CACHE_DIR/plans")
    ap.add_argument("--schedule", default="1f1b", help=f"pp: {' | '.join(SCHEDULES)} | best (plan each, name the "
                                                       "fastest)")
    ap.add_argument("--microbatches", type=int, default=8, help="pp: micro-batches a step (the batch's dim 0 cut)")
    args = ap.parse_args(argv)
    check_arguments(ap, args)

    t0 = time.perf_counter()
    model = build_model(args.model, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    vocab = model.config.vocab_size
    tokens = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")

    def planned(pipeline=None):
        mode = parallel_mode(args.parallel, model, args.world_size, args.mixed_precision, pipeline)
        step = spmd_ort.compile(parallel_mode=mode, backend=args.backend,
                                activation_memory_budget=parse_checkpointing(args.checkpointing))(lm_step)
        return step.plan(model, opt, tokens, tokens.clone(), world_size=args.world_size, device=args.device,
                         rank=args.rank, export=not args.no_export, cache=False if args.no_cache else None)

    kind = parse_parallel(args.parallel)
    if isinstance(kind, tuple) and kind[0] == "pp":
        plan = best_pipeline(planned, args, kind[1], model.config.num_hidden_layers)
    else:
        plan = planned()
    n = sum(p.numel() for p in model.parameters())
    source = f" ({SOURCES[args.model]}'s config)" if args.model in SOURCES else ""
    print(f"{args.model}{source}: {_count(n)} parameters, {model.config.num_hidden_layers} layers, vocabulary "
          f"{vocab}; batch {args.batch} x {args.seq} tokens per replica")
    print(plan.explain(args.picture))
    ranks = kind if isinstance(kind, int) else kind[1] if isinstance(kind, tuple) and kind[0] == "pp" else 1
    per_gpu = args.batch * args.seq / ranks / plan.predicted_step_s  # (the ranks that share one replica's batch)
    print(f"throughput: {per_gpu:,.0f} tokens/s per GPU (tokens of a data-parallel replica over its ranks)")
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    full_state = 16 * n / args.world_size
    b = plan.per_rank_bytes
    print(f"\nper rank: parameters + AdamW state {(b['params'] + b['optimizer']) / 2**30:.2f} GiB, gradients held "
          f"between steps {b['grads'] / 2**30:.2f} GiB (the step's own are in the peak); the rule of thumb 16 bytes "
          f"x N / world (fp32 parameters, gradients and AdamW's two moments) = {full_state / 2**30:.2f} GiB")
    print(f"planned in {wall:.1f} s, peak resident memory {rss / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
            json.dump({**plan.as_dict(), "params_total": n, "largest_module_params": largest, "wall_s": wall,
                       "max_rss": rss}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
