"""Context parallelism (``Parallel(cp=N)``) against one-process eager on the whole batch, under torchrun (gloo).

    torchrun --standalone --nproc_per_node=2 tests/dist/cp_parity.py --out DIR [--model gpt|llama] [--backend ort]
    torchrun --standalone --nproc_per_node=2 tests/dist/cp_parity.py --out DIR --case="--model gpt" --case=...

Every rank passes the same whole batch; the compiled step computes its share of the sequence.  After every
step: the loss equals one-process eager's (1e-4) on every rank, and every parameter and AdamW state tensor is
within 2e-3 of eager's relative to its size (the Adam noise floor), gradients clipped at 1.0 over the whole model.
Labels hold ``-100`` at some positions (padding), so the loss is a mean over unequal token counts per rank.
``--vary-seq``: lengths 32, 48, 32: one program serves them (the sequence is symbolic).  From the second step a
thread of the user's own all-reduces runs beside each step (ours never pair with them).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shlex
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

VOCAB = 64


def gpt_loss(model, x, y, mask=None):
    return F.cross_entropy(model(x).flatten(0, -2), y.flatten())


def hf_loss(model, x, y, mask=None):
    return model(input_ids=x, labels=y, attention_mask=mask).loss


def update(model, opt, loss):
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def gpt_step(model, opt, x, y, mask=None):
    return update(model, opt, gpt_loss(model, x, y))


def hf_step(model, opt, x, y, mask=None):
    return update(model, opt, hf_loss(model, x, y, mask))


def eager_step(loss_fn, model, opt, batches):
    """One process on every data-parallel replica's batch: the mean of their losses (DDP's gradient)."""
    losses = [loss_fn(model, *b) for b in batches]
    update(model, opt, sum(losses) / len(losses))
    return [float(loss) for loss in losses]


def build(name: str, seq: int):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab=VOCAB, seq=seq, d=32, heads=4, layers=2)), gpt_step, gpt_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg), hf_step, hf_loss


class HandAttention(torch.nn.Module):
    """Attention written out (matmul + softmax over the keys): what context parallel refuses, naming it."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, VOCAB)

    def forward(self, x):
        q, k, v = self.qkv(self.emb(x)).chunk(3, -1)
        return self.head(torch.softmax(q @ k.transpose(1, 2) / 4, -1) @ v)


def refusals(world: int) -> dict:
    """A length that does not divide by 2 * cp, and attention written by hand: a CompileError on every rank, naming
    the input or the op, the model and optimizer unchanged."""
    out = {}
    for name, model, t in (("length", build("gpt", 32)[0], 30), ("hand_attention", HandAttention(), 32)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = [p.detach().clone() for p in model.parameters()]
        step = spmd_ort.compile(parallel_mode=spmd_ort.Parallel(cp=world), backend="fx")(gpt_step)
        x = torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(0))
        try:
            step(model, opt, x, x)
            out[name] = "no error"
        except spmd_ort.CompileError as exc:
            out[name] = str(exc)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state, name
    return out


def make_batch(i: int, t: int, replica: int, masked: bool) -> tuple:
    g = torch.Generator().manual_seed(100 * i + replica)
    x = torch.randint(0, VOCAB, (2, t), generator=g)
    y = torch.randint(0, VOCAB, (2, t), generator=g)
    y[0, -5:] = -100  # padding: the ranks hold different numbers of counted tokens
    y[1, :3] = -100
    if not masked:
        return x, y
    mask = torch.ones_like(x)  # the second sequence left-padded: HF builds an explicit (B, 1, T, T) mask from it
    mask[1, :3] = 0
    return x, y, mask


def full(t: torch.Tensor) -> torch.Tensor:
    """A fully_shard parameter's or state's whole value (a collective: every rank calls it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vary-seq", action="store_true")
    ap.add_argument("--refusals", action="store_true")
    ap.add_argument("--mask", action="store_true", help="llama: an attention_mask with padding (HF's explicit mask)")
    ap.add_argument("--dp", default="", choices=["", "replicate", "shard"],
                    help="2-D on 4 ranks: dp_replicate=2 or dp_shard=2 x cp=2")
    ap.add_argument("--case", action="append", default=[],
                    help="several cases in one launch, one after the other (each with its own models, optimizers "
                         "and compiled step): each --case=\"--model llama --backend ort\" this script's options; "
                         "OUT/rank<r>.json maps each case's string to its result")
    return ap


def run(args, rank: int, world: int) -> dict:
    """One case: the compiled step against one-process eager (asserted at every step); the result to write."""
    lengths = [32, 48, 32, 48, 32] if args.vary_seq else [32] * args.steps
    base, step_fn, loss_fn = build(args.model, max(lengths))
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2, weight_decay=0.1)
    dp = 2 if args.dp else 1
    # (ORT: a fixed bucket cap, so that no recompile after the measured steps leaves too few steps on ORT's outputs)
    layout = spmd_ort.Parallel(cp=world // dp, **({"dp_replicate": dp} if args.dp == "replicate" else
                                                  {"dp_shard": dp, "prefetch": 0} if args.dp == "shard" else {}),
                               **({"bucket_cap_mb": 25.0} if args.backend == "ort" else {}))
    replica = rank // (world // dp)  # the mesh (dp, cp): cp the inner dim
    step = spmd_ort.compile(parallel_mode=layout, backend=args.backend)(step_fn)
    losses, worst = [], {}
    for i, t in enumerate(lengths[:args.steps]):
        batches = [make_batch(i, t, d, args.mask) for d in range(dp)]  # each replica's own
        le = eager_step(loss_fn, eager, opt_e, batches)
        with UserTraffic(rank, world) if i > 0 else contextlib.nullcontext():  # the user's all-reduces beside it
            lc = step(compiled, opt_c, *batches[replica])
        assert abs(float(lc) - le[replica]) < 1e-4, (i, float(lc), le[replica])  # the replica's loss, as DDP's
        losses.append(float(lc))
        for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            worst[name] = max(worst.get(name, 0.0), rel(full(pc.detach()), pe.detach()))
            assert worst[name] < 2e-3, (i, name, worst[name])
            se, sc = opt_e.state[pe], opt_c.state[pc]
            for key in ("exp_avg", "exp_avg_sq"):
                assert rel(full(sc[key]), se[key]) < 2e-3 or (se[key].norm() < 1e-9), (i, name, key)
    x = batches[replica][0]
    if args.dp == "shard":  # (fully_shard: the parameters are shards between steps)
        return {"losses": losses, "worst": worst, "explain": step.explain(), "traces": len(step.variants),
                "ort": ort_report(step) if args.backend == "ort" else None}
    # an evaluation forward outside the step: the model's own, on the whole sequence
    with torch.no_grad():
        out_e = eager(x) if args.model == "gpt" else eager(input_ids=x).logits
        out_c = compiled(x) if args.model == "gpt" else compiled(input_ids=x).logits
    torch.testing.assert_close(out_c, out_e, rtol=1e-3, atol=1e-3)
    return {"losses": losses, "worst": worst, "explain": step.explain(), "describe": step.compiled.describe(),
            "traces": len(step.variants), "ort": ort_report(step) if args.backend == "ort" else None}


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.refusals:
        finish(args.out, refusals(world))
    elif args.case:
        finish(args.out, {case: run(ap.parse_args([*shlex.split(case), "--out", args.out]), rank, world)
                          for case in args.case})
    else:
        finish(args.out, run(args, rank, world))


if __name__ == "__main__":
    main()
