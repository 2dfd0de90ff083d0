"""Run under torchrun (2 ranks): checkpoint loads that fail change nothing on any rank, and all ranks fail together.

    torchrun --nproc_per_node=2 tests/dist/checkpoint_errors.py --dir DIR

A fully_shard MLP trains 2 AdamW steps and saves; an SGD one saves too.  Then, each
into a sharded model with optimizer state (and one into a fresh, unsharded model):

* SGD state into AdamW;                      * another model size;
* a size that differs on rank 1 only;        * a missing directory on rank 1 only;
* a damaged data file (metadata fine: fails while reading, after the checks);
* saving into a path that is a file.

Each must raise spmd_ort.CheckpointError on both ranks and leave this rank's shards,
gradients, optimizer state and param groups bit for bit as they were (and a fresh model
unsharded); the next step then equals the step of an untouched copy.  Finally the
sharded checkpoint loads into a replicate (unsharded) model.  Sharing the launch: a batch that requires
grad gets each rank's own gradient under fully_shard (as DDP).  Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import sys
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
from spmd_ort.distributed.sharding import is_sharded  # noqa: E402


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def snapshot(model, opt) -> dict:
    """This rank's tensors as they are (shards where sharded), and the optimizer's groups."""
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"g:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for i, (p, st) in enumerate(opt.state.items()):
        out.update({f"s:{i}:{k}": v.clone() for k, v in st.items()})
    out["groups"] = repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    out["shapes"] = repr([tuple(p.shape) for p in model.parameters()])
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args.dir)
    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    result: dict = {"rank": rank}

    def trained(opt_cls, steps, hidden=64, **kw):
        torch.manual_seed(0)
        model = MLP(hidden=hidden)
        opt = opt_cls(model.parameters(), lr=1e-2, **kw)
        step = spmd_ort.compile(parallel_mode=mode, backend="fx")(train_step)
        for i in range(steps):
            step(model, opt, *batch(i, rank))
        return model, opt, step

    model, opt, step = trained(torch.optim.AdamW, 2)
    spmd_ort.save_checkpoint(root / "adamw", step, model, opt)
    saved = spmd_ort.full_state_dict(model, opt, rank0_only=False)
    sgd_model, sgd_opt, sgd_step = trained(torch.optim.SGD, 1, momentum=0.9)
    spmd_ort.save_checkpoint(root / "sgd", sgd_step, sgd_model, sgd_opt)
    small, small_opt, small_step = trained(torch.optim.AdamW, 1, hidden=48)
    spmd_ort.save_checkpoint(root / "small", small_step, small, small_opt)
    # a damaged copy: metadata intact, one data file cut short
    damaged = root / "damaged"
    if rank == 0:
        damaged.mkdir()
        for f in (root / "adamw").iterdir():
            data = f.read_bytes()
            (damaged / f.name).write_bytes(data[:len(data) // 3] if f.suffix == ".distcp" else data)
    dist.barrier()

    twin, twin_opt, twin_step = trained(torch.optim.AdamW, 2)  # untouched: the model must step as this one does
    traces = step.transitions.traces
    before = snapshot(model, opt)
    cases = {
        "sgd_into_adamw": root / "sgd",
        "other_size": root / "small",
        "other_size_rank1": root / ("small" if rank == 1 else "adamw"),
        "missing_rank1": root / ("nope" if rank == 1 else "adamw"),
        "damaged": damaged,
    }
    for name, path in cases.items():
        try:
            spmd_ort.load_checkpoint(path, step, model, opt)
            result[name] = None
        except spmd_ort.CheckpointError as exc:
            result[name] = str(exc)
        result[f"{name}_unchanged"] = same(before, snapshot(model, opt))
    try:
        (root / f"afile{rank}").write_text("not a directory")
        spmd_ort.save_checkpoint(root / "afile0", step, model, opt)  # a file on rank 0, missing on rank 1
        result["save_into_file"] = None
    except spmd_ort.CheckpointError as exc:
        result["save_into_file"] = str(exc)
    # a fresh model: load_checkpoint would shard it; failing, it stays as it was
    torch.manual_seed(5)
    fresh = MLP()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_before = snapshot(fresh, fresh_opt)
    try:
        spmd_ort.load_checkpoint(root / "small", step, fresh, fresh_opt)
        result["fresh"] = None
    except spmd_ort.CheckpointError as exc:
        result["fresh"] = str(exc)
    result["fresh_unchanged"] = same(fresh_before, snapshot(fresh, fresh_opt)) and not is_sharded(fresh)

    # the step is unchanged too: the next step is the untouched twin's, without a re-trace
    x, y = batch(7, rank)
    twin_step(twin, twin_opt, x, y)
    step(model, opt, x, y)
    result["next_step_equal"] = same(snapshot(model, opt), snapshot(twin, twin_opt))
    result["retraced"] = step.transitions.traces != traces

    # (sharing this launch) a batch that requires grad under fully_shard gets this rank's own gradient, as DDP
    # gives it: eager on the local batch with the full weights
    eager = MLP()
    eager.load_state_dict(spmd_ort.full_state_dict(model, rank0_only=False)["model"])
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(model, opt, x_c, y)
    torch.nn.functional.cross_entropy(eager(x_e), y).backward()
    result["input_grad_close"] = x_c.grad is not None and torch.allclose(x_c.grad, x_e.grad, rtol=1e-5, atol=1e-7)

    # the sharded checkpoint loads into an unsharded (replicate) model: the saved full weights and state
    torch.manual_seed(9)
    plain = MLP()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    replicate = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(), backend="fx")(train_step)
    spmd_ort.load_checkpoint(root / "adamw", replicate, plain, plain_opt)
    result["cross_layout_params"] = not is_sharded(plain) and all(
        torch.equal(p, saved["model"][n]) for n, p in plain.named_parameters())
    result["cross_layout_state"] = all(
        torch.equal(plain_opt.state[p][k], v) for p, st in zip(plain.parameters(), saved["optim"]["state"].values())
        for k, v in st.items())
    replicate(plain, plain_opt, x, y)  # and trains on
    finish(root / "out", result)


if __name__ == "__main__":
    main()
