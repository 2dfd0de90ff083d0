"""Run under torchrun: fully_shard failures and full-weight access.

1. A step fully_shard cannot run (an inf-norm clip reads whole gradients) fails with a
   CompileError on every rank, and leaves every rank's model and optimizer exactly as they
   were (full shapes, own initialisation, no state).
2. After a good step, the same model under a replicate step is refused (it is sharded).
3. ``gathered_parameters`` gives the module its full weights for an eager forward, equal
   to ``full_state_dict``, and restores the shards on exit.
4. ``torch.save(model.state_dict())`` holds ``Shard(0)`` DTensors of the full shapes; ``model.load_state_dict``
   takes them back, and takes full plain tensors (each rank keeps its rows).

Writes DIR/rank<r>.json with what each check saw.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Shard
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import train_step  # noqa: E402
from models import GPT  # noqa: E402
from zero_parity import CFG, batches  # noqa: E402


def inf_clip_step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
    opt.step()
    opt.zero_grad()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    x, y = batches(CFG, 0, 4 * world)
    x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    result: dict = {"rank": rank}
    bad = spmd_ort.compile(parallel_mode=mode, backend="fx")(inf_clip_step)
    try:
        bad(model, opt, x, y)
        result["error"] = None
    except spmd_ort.CompileError as exc:
        result["error"] = str(exc)
    after = model.state_dict()
    result["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    result["unsharded"] = not spmd_ort.distributed.sharding.is_sharded(model)
    result["no_opt_state"] = len(opt.state) == 0

    good = spmd_ort.compile(parallel_mode=mode, backend="fx")(train_step)
    good(model, opt, x, y)
    replicate = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(), backend="fx")(train_step)
    try:
        replicate(model, opt, x, y)
        result["mode_error"] = None
    except spmd_ort.CompileError as exc:
        result["mode_error"] = str(exc)

    full = spmd_ort.full_state_dict(model, rank0_only=False)["model"]
    with spmd_ort.gathered_parameters(model):
        result["full_inside"] = all(torch.equal(p, full[n]) for n, p in model.named_parameters())
        with torch.no_grad():
            result["eval_shape"] = list(model(x).shape)
    # torch.save of the sharded state dict and back, and load_state_dict of full (plain) tensors: each rank keeps
    # its piece, as with FSDP2's DTensors
    path = Path(args.out) / f"sd{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    saved = torch.load(path, weights_only=False)
    result["saved_dtensors"] = all(isinstance(v, DTensor) and v.shape == full[k].shape for k, v in saved.items()
                                   if k in dict(model.named_parameters()))
    with torch.no_grad():
        model.load_state_dict({k: v * 0.5 for k, v in full.items()})
        halved = all(torch.equal(p.full_tensor(), full[n] * 0.5) for n, p in model.named_parameters())
        model.load_state_dict(saved)
    result["load_full_and_saved"] = halved and all(torch.equal(p.full_tensor(), full[n])
                                                   for n, p in model.named_parameters())
    # the shards again after the block: Shard(0) DTensors of the full shape, as FSDP2's parameters
    result["sharded_after"] = all(isinstance(p, DTensor) and p.placements == (Shard(0),) and p.shape == full[n].shape
                                  for n, p in model.named_parameters())
    finish(args.out, result)


if __name__ == "__main__":
    main()
