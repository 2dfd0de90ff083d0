"""Run under torchrun: spmd_ort's Trainer against the Hugging Face Trainer's own DDP on the same ranks.

    torchrun --standalone --nproc_per_node=2 tests/dist/hf_trainer.py --mode replicate|fully_shard --dir DIR --out OUT

replicate is the Trainer's default under torchrun (``parallel_mode=None``: ``DataParallel()``).

Both train tests/trainer_case.py's tiny Llama from the same weights on the same sharded data (the Trainer's
accelerate dataloader), 2 micro-batches per step, a cosine schedule with warm-up, clipping, evaluation every 3
steps. Each rank checks the logged losses (the mean over ranks), gradient norms and learning rates against the
Trainer's, and every parameter (``fully_shard``: gathered) within 2e-3 relative. Then:

- replicate: a run checkpointed at step 3 and resumed by a new Trainer ends bit-equal to the uninterrupted one
  (fx);
- fully_shard: each rank holds half of every parameter's rows; ``save_model`` writes Hugging Face's layout that
  ``AutoModelForCausalLM.from_pretrained`` reads back equal to the gathered weights; ``from_pretrained(dir,
  "fully_shard")`` gives each rank its rows of them; and a run resumed from its step-3 checkpoint (optimizer
  state saved per rank with DCP) ends bit-equal to the uninterrupted one (fx).

Every rank writes OUT/rank<r>.json with ``checked``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "dist"))
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402

import trainer_case as case  # noqa: E402
from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from spmd_ort.integrations.transformers import SHARDED_OPTIMIZER_DIR, Trainer, from_pretrained  # noqa: E402

FX = {"backend": "fx"}


def train(cls, model, out, resume=None, **kw):
    extra = {k: kw.pop(k) for k in ("parallel_mode", "compile_options") if k in kw}
    trainer = cls(model=model, args=case.training_args(out, eval_strategy="steps", eval_steps=3, **kw),
                  train_dataset=case.dataset(), eval_dataset=case.dataset(8, seed=1), **extra)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def full_params(model) -> dict:
    with spmd_ort.gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    root = Path(a.dir)
    base = case.llama()
    theirs = train(transformers.Trainer, copy.deepcopy(base), root / "hf")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2 and isinstance(theirs.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    # replicate: the Trainer's default under torchrun (parallel_mode=None: DataParallel())
    kw = dict(parallel_mode=None if a.mode == "replicate" else a.mode, compile_options=FX, save_strategy="steps",
              save_steps=3)
    ours = train(Trainer, copy.deepcopy(base), root / "ours", **kw)
    got, want = case.record(ours), case.record(theirs)
    assert got["lr"] == want["lr"] and len(got["loss"]) == 6, (got, want)
    for key in ("loss", "grad_norm", "eval_loss"):
        assert all(abs(x - y) <= 1e-3 * max(1, abs(y)) for x, y in zip(got[key], want[key], strict=True)), \
            (key, got, want)
    trained = full_params(ours.model)
    for name, q in theirs.model.named_parameters():
        rel = ((trained[name] - q.detach()).norm() / q.detach().norm()).item()
        assert rel <= 2e-3, (rank, name, rel)
    result = {"mode": a.mode, "loss": got["loss"], "want": want["loss"]}

    checkpoint = root / "ours" / "checkpoint-3"
    if a.mode == "fully_shard":
        for name, p in ours.model.named_parameters():
            local = p.to_local()
            assert local.shape[0] == -(-p.shape[0] // world) or rank == world - 1, (name, local.shape)
        assert (checkpoint / SHARDED_OPTIMIZER_DIR).is_dir()
        ours.save_model(root / "saved")
        dist.barrier()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "saved")
        for name, t in loaded.named_parameters():
            assert torch.equal(t, trained[name]), name
        sharded = from_pretrained(root / "saved", "fully_shard")
        for (name, p), q in zip(sharded.named_parameters(), loaded.parameters()):
            rows = -(-q.shape[0] // world)
            assert torch.equal(p.to_local()[: max(0, min(rows, q.shape[0] - rank * rows))],
                               q[rank * rows:(rank + 1) * rows]), name
        result["saved"] = sorted(p.name for p in (root / "saved").iterdir())

    resumed = train(Trainer, case.llama(seed=1), root / "resumed", resume=str(checkpoint), **kw)
    assert case.record(resumed)["loss"] == got["loss"], (case.record(resumed), got)
    again = full_params(resumed.model)
    for name, t in trained.items():
        assert torch.equal(again[name], t), (rank, name)
    result["checked"] = True
    finish(a.out, result)


if __name__ == "__main__":
    main()
