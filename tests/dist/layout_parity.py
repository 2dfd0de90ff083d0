"""``spmd_ort.Parallel`` against the shorthands it stands for, under torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/dist/layout_parity.py --out DIR
    torchrun --standalone --nproc_per_node=4 tests/dist/layout_parity.py --out DIR

For each layout of the world (2 ranks: replicate, fully_shard, tensor parallel; 4 ranks: tensor parallel 2 x
replicate 2 and x fully_shard 2), a GPT is trained 3 steps (fx) by a step compiled with ``Parallel(...)`` and by one
compiled with the ``DataParallel``/``TensorParallel`` shorthand: the executed graphs are the same (node by node, groups by their ranks), and the
losses and parameters equal bit for bit.  Also: ``parallelize`` takes a Parallel; ``explain()`` prints the layout;
degrees whose product is not the world are a ConfigError on every rank naming each degree, before anything is
traced.
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


def layouts(world: int) -> dict:
    plan = tensor_parallel_plan()
    shard, rep = spmd_ort.DataParallel(parallel_style="fully_shard", prefetch=0), spmd_ort.DataParallel()
    if world == 2:
        return {"replicate": (spmd_ort.Parallel(dp_replicate=2), rep),
                "fully_shard": (spmd_ort.Parallel(dp_shard=-1, prefetch=0), shard),
                "tp": (spmd_ort.Parallel(tp=2, tp_plan=plan), spmd_ort.TensorParallel(plan))}
    return {"tp x replicate": (spmd_ort.Parallel(dp_replicate=2, tp=2, tp_plan=plan),
                               spmd_ort.TensorParallel(plan, mesh=(2, 2), data_parallel=rep)),
            "tp x fully_shard": (spmd_ort.Parallel(dp_shard=2, tp=2, tp_plan=plan, prefetch=0),
                                 spmd_ort.TensorParallel(plan, mesh=(2, 2), data_parallel=shard))}


def batch(i: int, data_rank: int):
    g = torch.Generator().manual_seed(100 * i + data_rank)
    return (torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g),
            torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g))


def train(base, mode, data_rank: int, parallelize: bool):
    model = copy.deepcopy(base)
    if parallelize:
        spmd_ort.parallelize(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = spmd_ort.compile(parallel_mode=mode, backend="fx")(train_step)
    losses = [float(step(model, opt, *batch(i, data_rank))) for i in range(3)]
    full = spmd_ort.full_state_dict(model, rank0_only=False)
    return losses, full["model"] if "model" in full else full, step


def _ops(step) -> list[str]:
    """The executed graph, node by node (op and arguments), with process groups by their ranks: two meshes of the
    same shape name their groups differently."""
    from spmd_ort.runtime.collectives import process_group

    def arg(a):
        if isinstance(a, str) and a and a.isdigit():
            try:
                return f"group {dist.get_process_group_ranks(process_group(a))}"
            except (RuntimeError, ValueError, KeyError):
                return a
        return str(a)

    return [f"{n.op} {n.target} {[arg(a) for a in n.args]}" for n in step.compiled.gm.graph.nodes]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = GPT(CFG)
    result: dict = {"rank": rank}
    for name, (layout, shorthand) in layouts(world).items():
        tp = "tp" in name
        data_rank = rank // 2 if world == 4 else (0 if tp else rank)
        losses, state, step = train(base, layout, data_rank, parallelize=tp)
        ref_losses, ref_state, ref_step = train(base, shorthand, data_rank, parallelize=tp)
        result[name] = {"same_code": _ops(step) == _ops(ref_step),
                        "losses_equal": losses == ref_losses,
                        "state_equal": all(torch.equal(v, ref_state[k]) for k, v in state.items()),
                        "layout_line": next(ln for ln in step.explain().splitlines() if ln.startswith("layout: ")),
                        "shorthand_line": next(ln for ln in ref_step.explain().splitlines()
                                               if ln.startswith("layout: ")),
                        "describe_equal": spmd_ort.Parallel.of(shorthand).describe() == layout.describe()}
    try:
        bad = spmd_ort.compile(parallel_mode=spmd_ort.Parallel(dp_shard=world + 1), backend="fx")(train_step)
        bad(copy.deepcopy(base), None, *batch(0, rank))
        result["bad_world"] = None
    except spmd_ort.ConfigError as exc:
        result["bad_world"] = str(exc)
    finish(args.out, result)


if __name__ == "__main__":
    main()
