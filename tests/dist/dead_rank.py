"""Run under torchrun (2 ranks): a rank dies inside save_checkpoint; launched again, the run resumes exactly.

    torchrun --standalone --nproc_per_node=2 tests/dist/dead_rank.py --phase kill --mode MODE --how dies \
        --ckpt DIR --out OUT
    torchrun --standalone --nproc_per_node=2 tests/dist/dead_rank.py --phase resume --mode MODE --ckpt DIR --out OUT

MODE is ``replicate`` or ``fully_shard``.  An MLP trains with AdamW on 2 ranks and saves a checkpoint after
every 4th step into DIR/step4, DIR/step8, DIR/step12.

* ``kill``: 12 steps; each rank records its losses and its state (parameters and optimizer state, its
  shards under fully_shard) after step 12: the uninterrupted run.  In the save after step 12 rank 1 stops
  after writing 3 items of its data file, so DIR/step12 is partial on disk: ``--how dies``: its process
  ends (``os._exit(1)``, as a crash or an OOM kill); ``--how hangs``: it sleeps past the process group's
  timeout (``--timeout``), as a stuck rank, until torchrun stops it.  Rank 0, the survivor, ignores the
  SIGTERM torchrun sends it (to see what it would raise if nothing stopped it) and records what its
  ``save_checkpoint`` raised and when, then exits 1 as the uncaught error would: OUT/kill-rank<r>.json.
* ``resume``: fresh processes, a model from another seed.  The newest checkpoint that loads, newest first
  (docs/checkpoints.md's loop; a refusal must change nothing), then on to step 12, saving as before (over
  the partial directory).  Losses of the resumed steps and the state after step 12 must equal the
  uninterrupted run's bit for bit: OUT/resume-rank<r>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import train_step  # noqa: E402
from models import MLP  # noqa: E402

STEPS = 12  # rank 1 stops inside the save after the last step (kill phase)
SAVE_EVERY = 4
BATCH = 4  # per rank


def build(mode: str, seed: int):
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    step = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(parallel_style=mode), backend="fx")(train_step)
    return model, opt, step


def run(model, opt, step, first: int, rank: int, world: int, ckpt: Path, before_save=None) -> list[float]:
    """Steps ``first``..STEPS (1-based), a checkpoint after every SAVE_EVERY-th into ckpt/step<n>."""
    losses = []
    for n in range(first, STEPS + 1):
        g = torch.Generator().manual_seed(1000 + n)  # the global batch of step n
        x, y = torch.randn(BATCH * world, 32, generator=g), torch.randint(0, 10, (BATCH * world,), generator=g)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        losses.append(float(step(model, opt, x[mine], y[mine])))
        if n % SAVE_EVERY == 0:
            if before_save is not None:
                before_save(n, losses)
            spmd_ort.save_checkpoint(ckpt / f"step{n}", step, model, opt)
    return losses


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece (a shard under fully_shard), as a plain tensor."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"optim.{name}.{k}"] = local(v)
    return out


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def stop_inside_the_write(out: Path, how: str, after_items: int, timeout: float) -> None:
    """Make this rank's next DCP write stop after ``after_items`` items of its data file (flushed to disk)."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item
    written = 0

    def write_item(transforms, stream, data, item, *args, **kwargs):
        nonlocal written
        result = real(transforms, stream, data, item, *args, **kwargs)
        written += 1
        if written == after_items:
            stream.flush()
            os.fsync(stream.fileno())
            (out / "kill-rank1.json").write_text(json.dumps({"stopped_at": time.time(), "how": how,
                                                            "file": str(stream.name),
                                                            "bytes": os.path.getsize(stream.name)}))
            if how == "hangs":
                time.sleep(timeout + 20)  # torchrun stops it first, once rank 0 has failed
            os._exit(1)  # no cleanup, no exception
        return result

    fs._write_item = write_item


def kill_phase(args, rank: int, world: int) -> None:
    out, ckpt = Path(args.out), Path(args.ckpt)
    model, opt, step = build(args.mode, 0)
    result: dict = {}

    def before_save(n: int, losses: list[float]) -> None:
        if n != STEPS:
            return
        torch.save({"losses": list(losses), "state": snapshot(model, opt)}, out / f"uninterrupted-rank{rank}.pt")
        if rank == 1:
            stop_inside_the_write(out, args.how, after_items=3, timeout=args.timeout)
        else:  # torchrun would stop it (SIGTERM) once rank 1 is dead: see what it raises if nothing does
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            result["save_started"] = time.time()

    try:
        run(model, opt, step, 1, rank, world, ckpt, before_save)
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 - what the user would see
        result.update(error_at=time.time(), error_type=type(exc).__name__, error=str(exc),
                      error_path=getattr(exc, "path", None), error_rank=getattr(exc, "rank", None))
    (out / f"kill-rank{rank}.json").write_text(json.dumps(result, indent=1))
    os._exit(1)  # as the uncaught error would (the group is broken: no barrier, no destroy_process_group)


def newest_that_loads(ckpt: Path, step, model, opt) -> tuple[int, list[dict]]:
    """The recipe of docs/checkpoints.md: the newest checkpoint that loads; the refusals on the way."""
    refused = []
    for path in sorted(ckpt.glob("step*"), key=lambda p: int(p.name.removeprefix("step")), reverse=True):
        before = snapshot(model, opt)
        try:
            spmd_ort.load_checkpoint(path, step, model, opt)
        except spmd_ort.CheckpointError as exc:
            refused.append({"path": exc.path, "error": str(exc), "unchanged": equal(before, snapshot(model, opt))})
            continue
        return int(path.name.removeprefix("step")), refused
    return 0, refused


def resume_phase(args, rank: int, world: int) -> None:
    out, ckpt = Path(args.out), Path(args.ckpt)
    model, opt, step = build(args.mode, 99 + rank)  # nothing but the checkpoint can carry the state
    resumed_from, refused = newest_that_loads(ckpt, step, model, opt)
    losses = run(model, opt, step, resumed_from + 1, rank, world, ckpt)
    uninterrupted = torch.load(out / f"uninterrupted-rank{rank}.pt")
    result = {"losses": losses, "resumed_from": resumed_from, "refused": refused,
              "losses_equal": losses == uninterrupted["losses"][resumed_from:],
              "state_equal": equal(uninterrupted["state"], snapshot(model, opt)),
              "tensors": len(uninterrupted["state"])}
    finish(out, result, f"resume-rank{rank}.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["kill", "resume"], required=True)
    ap.add_argument("--mode", choices=["replicate", "fully_shard"], required=True)
    ap.add_argument("--how", choices=["dies", "hangs"], default="dies", help="what rank 1 does in the kill phase")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=5.0, help="the process group's timeout, seconds")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (kill_phase if args.phase == "kill" else resume_phase)(args, rank, world)


if __name__ == "__main__":
    main()
