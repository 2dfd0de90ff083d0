"""Expert parallelism: each rank's peak memory and step time with ``Parallel(dp_shard=2, ep=2)`` against
``Parallel(dp_shard=2)`` (fully_shard) and torch DDP on the same 2 ranks, and the all-to-all bytes against the plan's.

Run:  .venv/bin/python bench/ep.py [--experts 8,16] [--steps 3] [--repeats 2]
      .venv/bin/python bench/ep.py --plan qwen3-30b-a3b --world 16   (planned at real size on 16 H100s:
          dp_shard=16 against dp_shard=16, ep=16; also mixtral-8x7b --world 16 --ep 8)

An HF Mixtral (transformers' default grouped_mm experts; random weights): 2 layers, d 256, experts of 1024 (gated),
top-2, vocabulary 1024, a batch of 8 x 64 tokens per rank; AdamW, clipping.  Runners, each under torchrun on 2
ranks with one thread per rank: ``ddp`` (eager torch DDP), ``fsdp`` (spmd_ort, ``Parallel(dp_shard=2)``: every
expert gathered for its layer, its gradient reduce-scattered) and ``ep`` (``Parallel(dp_shard=2, ep=2)``: each rank
computes E/2 experts on the tokens routed to them).  After two steps (the compiled step's tuner settles) the
kernel's high-water mark is reset; over ``--steps`` more steps:

* peak MiB: the high-water mark of the resident set minus the resident set before them (the larger rank's);
* ms/step: the median step time (the slower rank's);
* all-to-all: the bytes the ep step counted on its last step (both ranks' mean) and what ``plan()`` predicts for
  the routing's even split, on the meta device over torch's fake process group.

Memory and time come from separate launches (as bench/cp.py: glibc returns freed blocks to the system for the
memory runs, so the resident set follows the live tensors).  Each launch is repeated ``--repeats`` times,
interleaved; the table shows the medians.  The ratios are ep's against fully_shard's and DDP's, in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import multirank
from multirank import MIB, ROOT, measure
RUNNERS = ("ddp", "fsdp", "ep")
BATCH, SEQ, GLOB = 8, 64, "model.layers.*.mlp.experts"


def config(experts: int):
    import transformers as T

    return T.MixtralConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                           num_experts_per_tok=2, max_position_embeddings=SEQ)


def step_fn(model, opt, x):
    import torch

    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def layout(runner: str):
    import spmd_ort

    return spmd_ort.Parallel(dp_shard=2, ep=2, experts=GLOB) if runner == "ep" else spmd_ort.Parallel(dp_shard=2)


def worker(runner: str, experts: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers as T
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(ROOT))
    import spmd_ort

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(config(experts))
    if runner == "ddp":
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = step_fn if runner == "ddp" else spmd_ort.compile(parallel_mode=layout(runner), backend="fx")(step_fn)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 1024, (BATCH, SEQ), generator=g)
    measured = measure(lambda: step(model, opt, x), steps)
    measured["a2a"] = step.comm.all_to_all_bytes if runner == "ep" else 0
    if runner != "ddp":  # the last step leaves nothing in flight (no gather carried into a next step)
        step(model, opt, x, last_train_step=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(measured))
    dist.barrier()
    dist.destroy_process_group()


def launch(runner: str, experts: int, steps: int, memory: bool) -> dict:
    ranks = multirank.launch(__file__, 2, ["--worker", runner, "--experts", str(experts), "--steps", str(steps)],
                             memory)
    return {"peak": max(r["peak"] for r in ranks) / MIB, "ms": max(r["ms"] for r in ranks),
            "a2a": sum(r["a2a"] for r in ranks) / 2}


def planned_all_to_all(experts: int) -> int:
    import torch
    import transformers as T

    sys.path.insert(0, str(ROOT))
    import spmd_ort

    with torch.device("meta"):
        model = T.MixtralForCausalLM(config(experts))
    step = spmd_ort.compile(parallel_mode=layout("ep"), backend="fx")(step_fn)
    x = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return step.plan(model, torch.optim.AdamW(model.parameters()), x, world_size=2, export=False).comm_bytes[
        "all_to_all"]


# published config.json files: Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1: 46.7 B parameters, 8 experts of
# 14336, top-2) and Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B: 30.5 B parameters, 128 experts of 768 per layer, top-8)
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
PLANS = {"mixtral-8x7b": ("MixtralForCausalLM", "MixtralConfig", MIXTRAL_8X7B),
         "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_30B_A3B)}


def plan(name: str, world: int, device: str, ep: int, seq: int = 4096) -> None:
    """``name`` (bf16 parameters, fp32 reductions, every block checkpointed) planned on ``world`` GPUs of
    ``device``, one sequence of ``seq`` tokens per rank: ``Parallel(dp_shard=world)`` against
    ``Parallel(dp_shard=world, ep=ep)``."""
    import torch
    import transformers as T

    sys.path.insert(0, str(ROOT))
    import spmd_ort

    model_cls, config_cls, config = PLANS[name]
    with torch.device("meta"):
        model = getattr(T, model_cls)(getattr(T, config_cls)(**config))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batch = torch.zeros(1, seq, dtype=torch.long, device="meta")
    print(f"{name} on {world} x {device}, {seq} tokens per rank:\n")
    print("| layout | state GiB/rank | activations GiB/rank | reserved GiB/rank | all-gather GiB | reduce-scatter GiB | "
          "all-to-all GiB | predicted step s | exposed comm s | tokens/s/GPU | planned in s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in (spmd_ort.Parallel(dp_shard=world, mixed_precision=policy),
                   spmd_ort.Parallel(dp_shard=world, ep=ep, experts=GLOB, mixed_precision=policy)):
        t0 = time.perf_counter()
        step = spmd_ort.compile(parallel_mode=layout, activation_memory_budget="full", backend="fx")(step_fn)
        p = step.plan(model, opt, batch, world_size=world, device=device, export=False)
        gib = {k: v / 2**30 for k, v in p.comm_bytes.items()}
        held = p.per_rank_bytes
        state = (held["params"] + held["optimizer"] + held["grads"]) / 2**30
        layout_name = f"dp_shard={world}" + (f", ep={layout.ep}" if layout.ep > 1 else "")
        print(f"| {layout_name} | {state:.1f} | {held['activations'] / 2**30:.1f} | {held['reserved'] / 2**30:.1f} | "
              f"{gib.get('all_gather', 0):.1f} | {gib.get('reduce_scatter', 0):.1f} | {gib.get('all_to_all', 0):.2f} | "
              f"{p.predicted_step_s:.2f} | {p.exposed_comm_s:.2f} | {seq / p.predicted_step_s:,.0f} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="8,16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plan", choices=sorted(PLANS), help="instead: plan this published MoE at real size, "
                    "fully_shard against ep over every rank")
    ap.add_argument("--world", type=int, default=8, help="--plan: the ranks")
    ap.add_argument("--device", default="h100", help="--plan: the GPU")
    ap.add_argument("--ep", type=int, default=0, help="--plan: the ranks the experts are spread over (default: all)")
    ap.add_argument("--worker")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, int(args.experts), args.steps, args.out)
        return
    if args.plan:
        plan(args.plan, args.world, args.device, args.ep or args.world)
        return
    print("| experts | ddp: MiB, ms | fully_shard: MiB, ms | ep=2: MiB, ms | ep/fully_shard memory | ep/ddp memory | "
          "ep/fully_shard time | ep/ddp time | all-to-all KiB measured, planned |")
    print("|---|---|---|---|---|---|---|---|---|")
    for experts in (int(e) for e in args.experts.split(",")):
        runs: dict = {name: {"peak": [], "ms": [], "a2a": []} for name in RUNNERS}
        for _ in range(args.repeats):
            for name in RUNNERS:
                runs[name]["peak"].append(launch(name, experts, args.steps, True)["peak"])
                timed = launch(name, experts, args.steps, False)
                runs[name]["ms"].append(timed["ms"])
                runs[name]["a2a"].append(timed["a2a"])
        r = {name: {k: statistics.median(v) for k, v in got.items()} for name, got in runs.items()}
        d, f, e = r["ddp"], r["fsdp"], r["ep"]
        planned = planned_all_to_all(experts)
        print(f"| {experts} | {d['peak']:.0f}, {d['ms']:.0f} | {f['peak']:.0f}, {f['ms']:.0f} | {e['peak']:.0f}, "
              f"{e['ms']:.0f} | {e['peak'] / f['peak']:.2f} | {e['peak'] / d['peak']:.2f} | {e['ms'] / f['ms']:.2f} | "
              f"{e['ms'] / d['ms']:.2f} | {e['a2a'] / 1024:.0f}, {planned / 1024:.0f} |", flush=True)


if __name__ == "__main__":
    main()
