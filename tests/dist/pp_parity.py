"""Pipeline parallelism (``Parallel(pp=N, pipeline=Pipeline(...))``) against one-process eager on the whole batch,
under torchrun (gloo).

    torchrun --standalone --nproc_per_node=2 tests/dist/pp_parity.py --out DIR [--schedules gpipe,1f1b,...]
        [--model gpt|gpt-untied|llama] [--backend ort] [--split blocks.2 | --split none]

Every rank passes the same whole batch; each schedule trains its own copy of the model for ``--steps`` AdamW
steps with clipping at 1.0.  The labels hold ``-100`` (padding) in rows of different micro-batches, so the loss, a
mean over the counted targets, weighs the micro-batches by their counts; ``<schedule>+sum`` trains the GPT on a
sum (scaled) instead.  After every step: the loss equals eager's (1e-4) on every rank, and every parameter
(and its AdamW state) of the stages the rank steps is within 2e-3 of eager's relative to its size.  From the
second step a thread of the user's own all-reduces runs beside each step (ours never pair with them).
``--refusals`` (after the schedules): a batch the micro-batches do not divide, and a split that names no module: a
ConfigError on every rank, the model and optimizer unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import UserTraffic, finish  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from helpers import ort_report  # noqa: E402
import spmd_ort  # noqa: E402
from spmd_ort.passes.pipeline_parallel import PipelineStages  # noqa: E402

VOCAB = 64


def gpt_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, -2), y.flatten())  # a mean over the targets other than -100


def gpt_sum_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, -2), y.flatten(), reduction="sum") / 100  # a sum, scaled


def hf_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def update(model, opt, loss):
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def stepper(loss_fn):
    """The user's train step on ``loss_fn``'s loss."""
    def train_step(model, opt, x, y):
        return update(model, opt, loss_fn(model, x, y))
    return train_step


def build(name: str):
    torch.manual_seed(0)
    if name.startswith("gpt"):
        return GPT(GPTConfig(vocab=VOCAB, seq=16, d=32, heads=4, layers=4, tie_head=name == "gpt")), gpt_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg), hf_loss


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def refusals(world: int) -> dict:
    """A batch the micro-batches do not divide, a split naming no module, rank 1 passing another batch than rank 0,
    and a token past the vocabulary (only stage 0 embeds it): an error on every rank, the model and optimizer
    untouched."""
    out = {}
    cases = (("indivisible", spmd_ort.Pipeline(microbatches=3, split=["blocks.2"]), 4, 0),
             ("no_module", spmd_ort.Pipeline(microbatches=2, split=["blocks.9"]), 4, 0),
             ("different_batch", spmd_ort.Pipeline(microbatches=2, split=["blocks.2"]), 4, dist.get_rank()),
             ("bad_index", spmd_ort.Pipeline(microbatches=2, split=["blocks.2"]), 4, -1))
    for name, pipeline, rows, seed in cases:
        model, loss_fn = build("gpt")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = [p.detach().clone() for p in model.parameters()]
        step = spmd_ort.compile(parallel_mode=spmd_ort.Parallel(pp=world, pipeline=pipeline),
                                backend="fx")(stepper(loss_fn))
        x = torch.randint(0, VOCAB, (rows, 16), generator=torch.Generator().manual_seed(max(seed, 0)))
        if seed < 0:  # a token past the vocabulary in the last micro-batch: stage 0's embedding check fails
            x[3, 5] = VOCAB + 7
        try:
            step(model, opt, x, x)
            out[name] = "no error"
        except (spmd_ort.CompileError, spmd_ort.InputIndexError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state, name
    return out


def checkpoint(path: Path, step, compiled, opt_c, eager, opt_e, loss_fn, batch, layout, backend) -> dict:
    """Each rank steps only its stages, yet the whole model reads as eager's: ``full_state_dict`` on every rank,
    and a DCP checkpoint loaded into a fresh model and optimizer, whose next step equals eager's next step."""
    full = spmd_ort.full_state_dict(compiled, opt_c, rank0_only=False)
    worst = max(rel(full["model"][name], t.detach()) for name, t in eager.state_dict().items())
    spmd_ort.save_checkpoint(path, step, compiled, opt_c)
    fresh = copy.deepcopy(eager)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    opt_f = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    resumed = spmd_ort.compile(parallel_mode=layout, backend=backend)(stepper(loss_fn))
    spmd_ort.load_checkpoint(path, resumed, fresh, opt_f)
    loaded = max(rel(a.detach(), b.detach()) for a, b in zip(fresh.parameters(), eager.parameters()))
    le = float(update(eager, opt_e, loss_fn(eager, *batch)))  # (one pipeline: its batch is the whole batch)
    lf = float(resumed(fresh, opt_f, *batch))
    return {"full_state_dict": worst, "loaded": loaded, "resumed_loss": [lf, le]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="gpt", choices=["gpt", "gpt-untied", "llama"])
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedules", default="gpipe,1f1b,zero_bubble,interleaved_1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--split", default="", help="module FQNs where stages begin (comma-separated), or 'none'")
    ap.add_argument("--refusals", action="store_true")
    ap.add_argument("--dp", type=int, default=1, help="dp_replicate: pipelines, each on its own batch")
    ap.add_argument("--checkpoint", action="store_true", help="after the first case: full_state_dict, a DCP "
                                                              "checkpoint saved and loaded into a fresh model, a step")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp, replica = world // args.dp, rank % args.dp  # the mesh (pp, dp): pp outermost
    base, base_loss = build(args.model)
    result = {}
    for case in filter(None, args.schedules.split(",")):
        schedule, _, loss = case.partition("+")  # "1f1b+sum": the GPT's loss a sum
        loss_fn = gpt_sum_loss if loss == "sum" else base_loss
        v = 2 if schedule == "interleaved_1f1b" else 1
        stages = pp * v
        blocks = "model.layers" if args.model == "llama" else "blocks"
        split = None if args.split == "none" else (args.split.split(",") if args.split else
                                                   [f"{blocks}.{k * 4 // stages}" for k in range(1, stages)])
        pipeline = spmd_ort.Pipeline(microbatches=args.microbatches, schedule=schedule, stages_per_rank=v,
                                     split=split)
        eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
        opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
        opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2, weight_decay=0.1)
        layout = spmd_ort.Parallel(pp=pp, pipeline=pipeline, **({"dp_replicate": args.dp} if args.dp > 1 else {}))
        step = spmd_ort.compile(parallel_mode=layout, backend=args.backend)(stepper(loss_fn))
        losses, worst = [], {}
        for i in range(args.steps):
            batches = []
            for d in range(args.dp):  # each pipeline's own batch
                g = torch.Generator().manual_seed(100 * d + i)
                x = torch.randint(0, VOCAB, (8, 16), generator=g)
                y = torch.randint(0, VOCAB, (8, 16), generator=g)
                y[0, -5:] = -100  # padding: the micro-batches count different numbers of targets
                y[5, :3 + i] = -100
                batches.append((x, y))
            eager_losses = [loss_fn(eager, *b) for b in batches]  # one process, DDP's gradient: their mean
            update(eager, opt_e, sum(eager_losses) / args.dp)
            le = float(eager_losses[replica])
            with UserTraffic(rank, world) if i > 0 else contextlib.nullcontext():
                lc = float(step(compiled, opt_c, *batches[replica]))
            assert abs(lc - le) < 1e-4 * max(1.0, abs(le)), (case, i, lc, le)
            losses.append(lc)
        stages_result = step.compiled.results.get(PipelineStages)
        stepped, owned = set(), set(stages_result.stepped)
        for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            if name not in owned:
                continue
            stepped.add(name)
            worst[name] = rel(pc.detach(), pe.detach())
            assert worst[name] < 2e-3, (case, name, worst[name])
            se, sc = opt_e.state[pe], opt_c.state[pc]
            for key in ("exp_avg", "exp_avg_sq"):
                assert rel(sc[key], se[key]) < 2e-3 or se[key].norm() < 1e-9, (case, name, key)
        if args.checkpoint and not result:  # the first case: the whole model as eager's, saved, loaded, resumed
            result["checkpoint"] = checkpoint(Path(args.out) / "ckpt", step, compiled, opt_c, eager, opt_e,
                                              loss_fn, batches[replica], layout, args.backend)
        result[case] = {"losses": losses, "worst": worst, "stepped": sorted(stepped),
                            "explain": step.explain(), "lines": stages_result.lines(),
                            "bubble": stages_result.schedule.bubble, "traces": len(step.variants),
                            "ort": ort_report(step) if args.backend == "ort" else None}
    if args.refusals:
        result["refusals"] = refusals(world)
    finish(args.out, result)


if __name__ == "__main__":
    main()
