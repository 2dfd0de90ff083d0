"""Run under torchrun: a fully_shard checkpoint saved at step 5 resumes the exact trajectory.

    torchrun ... tests/dist/zero_checkpoint.py --phase save --ckpt DIR --out OUT   # 10 steps, saves after 5
    torchrun ... tests/dist/zero_checkpoint.py --phase load --ckpt DIR --out OUT   # fresh processes: steps 6-10
    torchrun --nproc_per_node=4 ... --phase reshard ...   # another world size: loaded state == saved state

The save phase also writes, at step 5, ``DIR-legacy`` (the flattened layout checkpoints had before
fully_shard parameters were DTensors) and ``DIR-dcp`` (torch's DCP on ``model.state_dict()`` alone);
the reshard phase loads the first into a fresh step and the second into an FSDP2 model.

Both phases write OUT/<phase>-rank<r>.json with the losses of steps 6-10 and the
final full parameters' checksum; the test compares them.  The load phase builds its
model from another seed, so nothing but the checkpoint can carry the state.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import train_step  # noqa: E402
from models import GPT  # noqa: E402
from zero_parity import CFG, batches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "load", "reshard"], required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = CFG
    torch.manual_seed(0 if args.phase == "save" else 99 + rank)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    mode = spmd_ort.DataParallel(parallel_style="fully_shard", bucket_cap_mb=0.02)
    step = spmd_ort.compile(parallel_mode=mode, backend="fx")(lambda m, o, x, y: train_step(m, o, x, y, clip=1.0))
    first = 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase in ("load", "reshard"):
        spmd_ort.load_checkpoint(args.ckpt, step, model, opt)
        first = 5
    if args.phase == "reshard":  # another world size: the loaded state, gathered, is the saved one
        full = spmd_ort.full_state_dict(model, opt)
        if rank == 0:
            saved = torch.load(out / "step5-full.pt")
            same = all(torch.equal(full["model"][k], saved["model"][k]) for k in saved["model"])
            same_state = all(torch.equal(full["optim"]["state"][i][key], v)
                             for i, st in saved["optim"]["state"].items() for key, v in st.items())
        else:
            saved = None
        # a checkpoint of the old, flattened layout loads (and reshards) as well
        legacy_model = GPT(cfg)
        legacy_opt = torch.optim.AdamW(legacy_model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        legacy_step = spmd_ort.compile(parallel_mode=mode, backend="fx")(train_step)
        spmd_ort.load_checkpoint(args.ckpt + "-legacy", legacy_step, legacy_model, legacy_opt)
        legacy = spmd_ort.full_state_dict(legacy_model, legacy_opt)
        # torch's DCP on the sharded model's own state_dict() (Shard(0) DTensors) loads into FSDP2 (2 -> 4 ranks)
        fsdp = _fsdp2(GPT(cfg))
        sd = {"model": fsdp.state_dict()}
        dcp.load(sd, checkpoint_id=args.ckpt + "-dcp")
        fsdp_full = {k: v.full_tensor() for k, v in fsdp.state_dict().items()}
        if rank == 0:
            res = {"world": world, "params_equal": same, "state_equal": same_state,
                   "legacy_params_equal": all(torch.equal(legacy["model"][k], v) for k, v in saved["model"].items()),
                   "legacy_state_equal": all(torch.equal(legacy["optim"]["state"][i][key], v)
                                             for i, st in saved["optim"]["state"].items() for key, v in st.items()),
                   "fsdp2_params_equal": all(torch.equal(fsdp_full[k], v) for k, v in saved["model"].items())}
            (out / "reshard.json").write_text(json.dumps(res))
        # as dist_common.finish: what holds collectives dies before the process group (the exit otherwise
        # aborted now and then: "terminate called without an active exception", 4 ranks on 2 cores)
        del step, model, opt, full, legacy_step, legacy_model, legacy_opt, fsdp, sd
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        return
    losses = []
    for i in range(first, 10):
        x, y = batches(cfg, i, args.batch * world)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        loss = step(model, opt, x[mine], y[mine])
        if i >= 5:
            losses.append(float(loss))
        if args.phase == "save" and i == 4:
            spmd_ort.save_checkpoint(args.ckpt, step, model, opt)
            _save_legacy(args.ckpt + "-legacy", step, model, opt)
            dcp.save({"model": model.state_dict()}, checkpoint_id=args.ckpt + "-dcp")
            full5 = spmd_ort.full_state_dict(model, opt)
            if rank == 0:
                torch.save(full5, out / "step5-full.pt")
    full = spmd_ort.full_state_dict(model, opt)
    result = {"losses": losses, "traces": step.transitions.traces}
    if rank == 0:
        result["params"] = {k: v.double().sum().item() for k, v in full["model"].items()}
        result["exp_avg_sq"] = sum(st["exp_avg_sq"].double().sum().item() for st in full["optim"]["state"].values())
        result["step"] = [float(st["step"]) for st in full["optim"]["state"].values()]
        torch.save(full["model"], out / f"{args.phase}-full.pt")
    finish(out, result, f"{args.phase}-rank{rank}.json")


def _save_legacy(path: str, step, model, opt) -> None:
    """The checkpoint spmd_ort wrote before fully_shard parameters were DTensors: every sharded tensor as
    ``Shard(0)`` of its flattened elements, ``ceil(numel / world)`` per rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", torch.arange(world))

    def flat(t):
        if not isinstance(t, DTensor):
            return t
        full = t.full_tensor().reshape(-1)
        n = -(-full.numel() // world)
        return DTensor.from_local(full[rank * n:(rank + 1) * n].clone(), mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([full.numel()]), stride=(1,))

    sd = spmd_ort.state_dict(step, model, opt)
    sd["model"] = {k: flat(v) for k, v in sd["model"].items()}
    sd["optim"]["state"] = {p: {k: flat(v) for k, v in st.items()} for p, st in sd["optim"]["state"].items()}
    dcp.save(sd, checkpoint_id=path)


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


if __name__ == "__main__":
    main()
