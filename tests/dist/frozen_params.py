"""Parameters frozen (``requires_grad_(False)``) at any point train as eager's do: not at all, and with no new
optimizer state; unfrozen, they train again.  Launched by tests/test_parallelize.py under torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/dist/frozen_params.py --layouts replicate,fully_shard,tp --out DIR
    torchrun --standalone --nproc_per_node=4 tests/dist/frozen_params.py --layouts 2d --out DIR

For each layout x backend (fx, ORT) x when the parameters are frozen:

* ``before``: on the materialised model, before the first step;
* ``parallelize``: after ``spmd_ort.parallelize`` of the materialised model;
* ``load``: after a meta model's ``parallelize``, ``to_empty`` and ``load_safetensors`` (the fine-tuning pattern);
* ``between``: after two compiled steps; two steps frozen, then unfrozen for two more,

the compiled step is compared with one process training eagerly on the global batch with the same schedule: the
loss every step, every parameter after each step (relative per tensor), a frozen parameter bit for bit unchanged
while frozen, and the optimizer holding state for exactly the parameters eager's holds.
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
from examples.gpt import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402
from helpers import ort_report, train_step  # noqa: E402
import spmd_ort  # noqa: E402

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=2, split_qkv=True)
FROZEN = ("wpe.weight", "blocks.0.fc.weight", "blocks.0.fc.bias")  # a replicated and a column-sharded (TP) layer
PER_RANK = 4  # sequences a data-parallel rank takes


def modes(world: int) -> dict:
    fully_shard = spmd_ort.DataParallel(parallel_style="fully_shard")
    return {"replicate": spmd_ort.DataParallel(), "fully_shard": fully_shard,
            "tp": spmd_ort.TensorParallel(tensor_parallel_plan()),
            "2d": spmd_ort.TensorParallel(tensor_parallel_plan(), mesh=(world // 2, 2), data_parallel=fully_shard)}


def data_parallel(layout: str, rank: int, world: int) -> tuple[int, int]:
    """(this rank's data-parallel coordinate, the data-parallel degree)."""
    return {"tp": (0, 1), "2d": (rank // 2, world // 2)}.get(layout, (rank, world))


def global_batch(i: int, dp: int):
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(0, CFG.vocab, (PER_RANK * dp, CFG.seq), generator=g)
    return ids, torch.roll(ids, -1, 1)


def schedule(when: str) -> list[bool]:
    """Per step: whether the FROZEN parameters are frozen during it."""
    return {"between": [False, False, True, True, False, False]}.get(when, [True, True, True])


def set_frozen(model, frozen: bool) -> None:
    for name, p in model.named_parameters():
        if name in FROZEN:
            p.requires_grad_(not frozen)


def full_params(model) -> dict:
    full = spmd_ort.full_state_dict(model, rank0_only=False)
    full = full["model"] if "model" in full else full
    return {n: full[n] for n, _ in model.named_parameters()}


def stateful_names(model, opt) -> set:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in opt.state if opt.state[p]}


def eager_run(when: str, dp: int, init: dict) -> list[tuple[float, dict, set]]:
    model = GPT(CFG)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for i, frozen in enumerate(schedule(when)):
        set_frozen(model, frozen)
        loss = train_step(model, opt, *global_batch(i, dp), clip=1.0)
        out.append((loss.item(), {n: p.detach().clone() for n, p in model.named_parameters()},
                    stateful_names(model, opt)))
    return out


def compiled_run(layout: str, backend: str, when: str, rank: int, world: int, init_path: Path, init: dict):
    mode = modes(world)[layout]
    coord, dp = data_parallel(layout, rank, world)
    if when == "load":
        with torch.device("meta"):
            model = GPT(CFG)
        spmd_ort.parallelize(model, mode)
        model.to_empty(device="cpu")
        spmd_ort.load_safetensors(model, init_path)
    else:
        model = GPT(CFG)
        model.load_state_dict(init)
        if when == "parallelize":
            spmd_ort.parallelize(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = spmd_ort.compile(parallel_mode=mode, backend=backend)(train_step)
    out = []
    for i, frozen in enumerate(schedule(when)):
        set_frozen(model, frozen)
        x, y = (t[coord * PER_RANK:(coord + 1) * PER_RANK] for t in global_batch(i, dp))
        loss = step(model, opt, x, y, clip=1.0)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (coord, float(loss)))  # the global batch's loss: the mean over dp ranks
        loss = sum(dict(everyone).values()) / dp
        out.append((loss, full_params(model), stateful_names(model, opt)))
    return out, step


def compare(layout: str, backend: str, when: str, rank: int, world: int, init_path: Path, init: dict) -> dict:
    _, dp = data_parallel(layout, rank, world)
    want = eager_run(when, dp, init)
    got, step = compiled_run(layout, backend, when, rank, world, init_path, init)
    problems = []
    previous = init
    for i, ((loss, params, state), (ref_loss, ref_params, ref_state)) in enumerate(zip(got, want, strict=True)):
        frozen = schedule(when)[i]
        if abs(loss - ref_loss) > 1e-4:
            problems.append(f"step {i}: loss {loss:.6f}, eager {ref_loss:.6f}")
        if state != ref_state:
            problems.append(f"step {i}: optimizer state for {sorted(state ^ ref_state)} differs from eager's")
        for name, ref in ref_params.items():
            p = params[name]
            if frozen and name in FROZEN:
                if not torch.equal(p, previous[name]):
                    problems.append(f"step {i}: frozen {name} moved by {float((p - previous[name]).abs().max()):.3g}")
            elif float((p - ref).norm() / ref.norm()) > 2e-3:
                problems.append(f"step {i}: {name} {float((p - ref).norm() / ref.norm()):.3g} off eager (relative)")
        previous = params
    return {"problems": problems, "variants": len(step.variants), "traces": step.transitions.traces,
            "ort": ort_report(step) if backend == "ort" else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="replicate,fully_shard,tp")
    ap.add_argument("--backends", default="fx,ort")
    ap.add_argument("--when", default="before,parallelize,load,between")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in GPT(CFG).state_dict().items()}
    init_path = Path(args.out) / "init.safetensors"
    if rank == 0:
        from safetensors.torch import save_file

        init_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(init, str(init_path))  # (tied: both names)
    dist.barrier()
    result = {"rank": rank}
    for layout in args.layouts.split(","):
        for backend in args.backends.split(","):
            for when in args.when.split(","):
                result[f"{layout}/{backend}/{when}"] = compare(layout, backend, when, rank, world, init_path, init)
    finish(args.out, result)


if __name__ == "__main__":
    main()
