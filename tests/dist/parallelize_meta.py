"""``spmd_ort.parallelize`` on a meta-device model, 2 ranks (gloo, CPU), launched by tests/test_parallelize.py.

For each layout (``fully_shard``; Megatron tensor parallel): a GPT built on the meta device is parallelized up
front (nothing allocated), ``to_empty`` allocates this rank's part only, ``load_safetensors`` fills it from the
file a materialised copy's initial weights were saved to, and 4 compiled steps (fx) must equal, bit for bit,
the materialised model trained by the same compiled step (which the suite checks against eager / FSDP2 / eager
TP).  Also: a step with another mode is a ConfigError on every rank with nothing changed, and what DTensor
initialisation (``reset_parameters`` on the sharded parameters) gives against a one-process init.
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
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
from examples.gpt import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402
from helpers import train_step  # noqa: E402
import spmd_ort  # noqa: E402

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=2, split_qkv=True)
STEPS = 4


def batch(i: int, data_rank: int):
    g = torch.Generator().manual_seed(100 * i + data_rank)  # ranks of one tensor-parallel group share a batch
    return (torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g),
            torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g))


def local_numel(model) -> int:
    return sum((p._local_tensor if hasattr(p, "_local_tensor") else p).numel() for p in model.parameters())


def train(model, mode, data_rank: int) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = spmd_ort.compile(parallel_mode=mode, backend="fx")(train_step)
    losses = [float(step(model, opt, *batch(i, data_rank))) for i in range(STEPS)]
    full = spmd_ort.full_state_dict(model, rank0_only=False)
    return losses, full["model"] if "model" in full else full


def layout(name: str, mode, root: Path, rank: int, world: int, data_rank: int | None = None) -> dict:
    """``data_rank``: which batches this rank draws (its data-parallel coordinate; default: its rank, or 0 under
    tensor parallelism)."""
    tp = name != "fully_shard"
    data_rank = (0 if tp else rank) if data_rank is None else data_rank
    torch.manual_seed(0)
    eager = GPT(CFG)
    init = root / f"{name}.safetensors"
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.clone() for k, v in eager.state_dict().items()}, str(init))  # (tied: both names)
    dist.barrier()
    full_numel = sum(p.numel() for p in eager.parameters())
    ref_losses, ref_state = train(eager, mode, data_rank)

    with torch.device("meta"):
        model = GPT(CFG)
    out = spmd_ort.parallelize(model, mode)
    meta_after_parallelize = all(p.is_meta for p in model.parameters())
    placements = {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters() if hasattr(p, "placements")}
    twin = copy.deepcopy(model)  # a copy allocates itself (its to_empty is bound to it), the tie kept
    twin.to_empty(device="cpu")
    twin_ok = (all(p.is_meta for p in model.parameters()) and not any(p.is_meta for p in twin.parameters())
               and twin.head.weight is twin.wte.weight and local_numel(twin) == local_numel(model))
    del twin
    model.to_empty(device="cpu")
    allocated = local_numel(model)
    # a step with another mode: refused on every rank, nothing changed
    other = spmd_ort.DataParallel() if not tp else spmd_ort.DataParallel(parallel_style="fully_shard")
    try:
        spmd_ort.compile(parallel_mode=other, backend="fx")(train_step)(model, None, *batch(0, data_rank))
        refused = None
    except spmd_ort.ConfigError as exc:
        refused = str(exc)
    report = spmd_ort.load_safetensors(model, init)
    losses, state = train(model, mode, data_rank)
    return {"returned_model": out is model, "twin_ok": twin_ok, "tied": model.head.weight is model.wte.weight, "meta_after_parallelize": meta_after_parallelize,
            "placements": placements, "allocated": allocated, "full_numel": full_numel,
            "bytes_read": report.bytes_read, "refused": refused,
            "losses": losses, "ref_losses": ref_losses,
            "equal": {k: torch.equal(v, ref_state[k]) for k, v in state.items()}}


def layouts_compared(root: Path, rank: int) -> dict:
    """Issue 55 items 4 and 5, fully_shard on a meta GPT: ``load_safetensors`` straight into the parallelized meta
    model (no ``to_empty``) keeps the layout and trains as the ``to_empty`` path does, bit for bit; compiled with
    ``parallel_mode=None`` the step takes the model's own layout; a mode that differs only in settings that keep
    the layout (prefetch, bucket cap) is taken, a rebuilt equal tensor-parallel plan too; another layout is refused
    naming what differs."""
    init = root / "fully_shard.safetensors"  # written by layout("fully_shard", ...)
    laid = spmd_ort.DataParallel(parallel_style="fully_shard")

    def meta_model(to_empty: bool):
        with torch.device("meta"):
            model = GPT(CFG)
        spmd_ort.parallelize(model, laid)
        if to_empty:
            model.to_empty(device="cpu")
        spmd_ort.load_safetensors(model, init)
        return model

    def run(model, mode):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        step = spmd_ort.compile(parallel_mode=mode, backend="fx")(train_step)
        losses = [float(step(model, opt, *batch(i, rank))) for i in range(3)]
        full = spmd_ort.full_state_dict(model, rank0_only=False)
        return losses, full["model"] if "model" in full else full

    ref_losses, ref_state = run(meta_model(True), laid)
    out = {}
    for name, to_empty, mode in (("load into meta", False, laid), ("parallel_mode=None", True, None),
                                 ("prefetch 0, 5 MiB buckets", True, spmd_ort.DataParallel(
                                     parallel_style="fully_shard", prefetch=0, bucket_cap_mb=5))):
        model = meta_model(to_empty)
        losses, state = run(model, mode)
        out[name] = {"losses_equal": losses == ref_losses,
                     "state_equal": all(torch.equal(v, ref_state[k]) for k, v in state.items()),
                     "sharded": all(hasattr(p, "_spmd_ort_shard") for p in model.parameters())}
    model = meta_model(True)
    try:
        spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(), backend="fx")(train_step)(model, None, *batch(0, rank))
        out["replicate refused"] = None
    except spmd_ort.ConfigError as exc:
        out["replicate refused"] = str(exc)
    # tensor parallel: a plan rebuilt with equal styles is the same layout
    with torch.device("meta"):
        tp_model = GPT(CFG)
    spmd_ort.parallelize(tp_model, spmd_ort.TensorParallel(tensor_parallel_plan()))
    out["tp plan rebuilt"] = spmd_ort.parallelize(tp_model, spmd_ort.TensorParallel(tensor_parallel_plan())) \
        is tp_model
    try:
        plan = {**tensor_parallel_plan(), "blocks.*.fc": tensor_parallel_plan()["blocks.*.out"]}
        spmd_ort.parallelize(tp_model, spmd_ort.TensorParallel(plan))
        out["tp other plan refused"] = None
    except spmd_ort.ConfigError as exc:
        out["tp other plan refused"] = str(exc)
    return out


def dtensor_init(rank: int) -> dict:
    """reset_parameters on the sharded parameters of a meta model, against a one-process init with the seed."""
    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    with torch.device("meta"):
        model = GPT(CFG)
    spmd_ort.parallelize(model, mode).to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    torch.manual_seed(0)
    one = GPT(CFG)  # GPT's constructor initialises as reset_parameters does
    torch.manual_seed(0)
    for m in one.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    full = spmd_ort.full_state_dict(model, rank0_only=False)
    full = full["model"] if "model" in full else full
    return {"init_equal": {k: torch.equal(v, one.state_dict()[k]) for k, v in full.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.dir)
    result = {"rank": rank,
              "fully_shard": layout("fully_shard", spmd_ort.DataParallel(parallel_style="fully_shard"), root, rank,
                                    world),
              "tp": layout("tp", spmd_ort.TensorParallel(tensor_parallel_plan()), root, rank, world),
              **dtensor_init(rank), "layouts": layouts_compared(root, rank)}
    finish(args.out, result)


if __name__ == "__main__":
    main()
