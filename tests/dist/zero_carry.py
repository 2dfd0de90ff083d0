"""Run under torchrun: cross-step prefetch under fully_shard, and everything that must invalidate it.

    torchrun --standalone --nproc_per_node=2 tests/dist/zero_carry.py --out DIR [--backend fx|ort]

Every step of the compiled fully_shard step is compared with eager on the global batch (as zero_parity.py),
while between steps: every rank edits the parameters under no_grad, a checkpoint is loaded, another batch
shape (another program) runs and the first one comes back, and one rank alone edits one element of its shard.
After each of them the next step must gather anew (on every rank: no hang) and still match eager; otherwise
each step takes the gather the previous one carried.  The last call passes last_train_step=True: nothing is
left in flight.  Writes DIR/rank<r>.json with, per step, what happened and the carried gathers it took.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import assert_close_normwise, ort_report, train_step  # noqa: E402
from models import GPT  # noqa: E402
from zero_parity import CFG, batches, make_opt  # noqa: E402

BATCH = 4  # per rank; the "other shape" steps use 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    finish(args.out, run(args, rank, world))


def _scale(model, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


def run(args, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = copy.deepcopy(reference)
    opt_ref, opt = make_opt("adamw", reference.parameters()), make_opt("adamw", model.parameters())
    mode = spmd_ort.DataParallel(parallel_style="fully_shard", bucket_cap_mb=0.02)
    step = spmd_ort.compile(parallel_mode=mode, backend=args.backend, dynamic=False)(train_step)
    ckpt = Path(tempfile.gettempdir()) / f"spmd_ort_zero_carry_{Path(args.out).name}"
    saved_ref, diverged = None, False
    log: list[dict] = []
    # (event before the step, batch per rank)
    plan = [("", BATCH), ("", BATCH), ("", BATCH), ("edit", BATCH), ("save", BATCH), ("", BATCH), ("load", BATCH),
            ("shape", 2), ("shape back", BATCH), ("", BATCH), ("one rank edits", BATCH), ("last", BATCH)]
    for i, (event, batch) in enumerate(plan):
        if event == "edit":  # every rank, under no_grad: the shards the carried gather read are stale
            _scale(model, 0.5)
            _scale(reference, 0.5)
        elif event == "save":
            spmd_ort.save_checkpoint(ckpt, step, model, opt)
            saved_ref = (copy.deepcopy(reference.state_dict()), copy.deepcopy(opt_ref.state_dict()))
        elif event == "load":  # back to the state saved two steps ago
            spmd_ort.load_checkpoint(ckpt, step, model, opt)
            reference.load_state_dict(saved_ref[0])
            opt_ref.load_state_dict(saved_ref[1])
        elif event == "one rank edits":  # the others' shards are as carried: all must gather anew anyway
            if rank == 1:
                with torch.no_grad():
                    next(model.parameters()).to_local().view(-1)[0] += 1.0  # (its Shard(0) piece)
            diverged = True  # from eager, which has no such edit
        x, y = batches(CFG, i, batch * world)
        mine = slice(rank * batch, (rank + 1) * batch)
        loss = step(model, opt, x[mine], y[mine], last_train_step=event == "last")
        train_step(reference, opt_ref, x, y)
        full = spmd_ort.full_state_dict(model, opt, rank0_only=False)
        if not diverged:
            for name, want in reference.state_dict().items():
                assert_close_normwise(full["model"][name], want, msg=f"rank {rank} step {i} ({event}) {name}")
        flat = torch.cat([t.reshape(-1) for t in full["model"].values()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(gathered[0], t) for t in gathered), f"step {i}: ranks hold different parameters"
        log.append({"event": event, "loss": float(loss), "carried_gathers": step.comm.carried_gathers,
                    "all_gather_calls": step.comm.all_gather_calls})
    return {"rank": rank, "log": log, "pending_after_last": len(step.runtime.comm.carried)
            + len(step.runtime.comm.pending), "describe": step.compiled.describe(), "ort": ort_report(step)}


if __name__ == "__main__":
    main()
