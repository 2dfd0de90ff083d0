"""Run under torchrun: Hugging Face safetensors weights of sharded models, saved and loaded rank by rank.

    torchrun --standalone --nproc_per_node=2 tests/dist/safetensors_roundtrip.py --dir DIR --out OUT

fully_shard: a tiny Llama (tied embeddings, an MLP of 75 rows: uneven shards) trains 3 steps compiled with
``DataParallel(parallel_style="fully_shard")``; ``save_safetensors`` writes DIR/fs (and rank 0 OUT/fs_full.pt,
``full_state_dict`` for the test to compare with ``from_pretrained``).  A fresh model, sharded by one compiled
step, loads DIR/fs: each rank's local shards must be its rows of the full tensors, read in place (the flat
buffers the step uses stay), its bytes read its share; its next step must equal the trained model's bit for bit.

tensor parallel: rank 0 writes DIR/tp with transformers' ``save_pretrained`` (an untied Llama); models
parallelized with torch's ``parallelize_module`` (``Shard(0)`` / ``Shard(1)``, uneven), one of them on the meta
device, load it; each local shard must be ``distribute_tensor``'s.  A ``_StridedShard`` parameter (rows not
contiguous) loads from a covering slice.

``--phase strided2d`` (4 ranks, a 2 x 2 ("dp", "tp") mesh): parameters laid out as fully_shard's 2-D (FSDP2 +
TP) layout lays them out (``place_full``: a strided dp shard of the tensor-parallel piece, uneven) load their own
rows; and a GPT under the compiled 2-D step (``TensorParallel(plan, mesh, data_parallel=fully_shard)``), built on
the meta device, ``parallelize``d, ``to_empty``'d and loaded from a safetensors file, trains 4 steps equal bit
for bit to the materialised model under the same step (tests/dist/parallelize_meta.py's ``layout``).  Every rank
writes OUT/<phase>-rank<r>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "dist"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
from zoo import lm_step  # noqa: E402
import spmd_ort  # noqa: E402


def llama_config(tie: bool):
    import transformers

    return transformers.LlamaConfig(hidden_size=64, intermediate_size=75, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                    tie_word_embeddings=tie)


def batch(i: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 * i + rank))


def fully_shard(root: Path, out: Path, rank: int, world: int) -> dict:
    import transformers
    from torch.distributed.tensor import DTensor

    mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(tie=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the weights alone carry the trajectory
    step = spmd_ort.compile(parallel_mode=mode, backend="fx")(lm_step)
    for i in range(3):
        step(model, opt, batch(i, rank))
    spmd_ort.save_safetensors(model, root / "fs")
    full = spmd_ort.full_state_dict(model, rank0_only=False)["model"]
    if rank == 0:
        model.config.save_pretrained(root / "fs")
        torch.save(full, out / "fs_full.pt")

    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(llama_config(tie=True))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh_step = spmd_ort.compile(parallel_mode=mode, backend="fx")(lm_step)
    fresh_step(fresh, fresh_opt, batch(0, rank))  # sharded now: DTensors over the step's flat buffers
    traces = fresh_step.transitions.traces
    params = dict(fresh.named_parameters())
    views = {n: p._local_tensor.data_ptr() for n, p in params.items()}
    report = spmd_ort.load_safetensors(fresh, root / "fs")
    rows_ok, mine = {}, 0
    for name, p in params.items():
        rows = -(-p.shape[0] // world)
        expected = full[name][rank * rows:(rank + 1) * rows]
        rows_ok[name] = isinstance(p, DTensor) and torch.equal(p.to_local(), expected)
        mine += expected.numel() * expected.element_size()
    in_place = all(p._local_tensor.data_ptr() == views[n] for n, p in params.items())
    tied = fresh.lm_head.weight is fresh.model.embed_tokens.weight
    failures = agreed_failures(root, fresh, rank)

    loss = step(model, opt, batch(3, rank))
    fresh_loss = fresh_step(fresh, fresh_opt, batch(3, rank))
    after = spmd_ort.full_state_dict(model, rank0_only=False)["model"]
    fresh_after = spmd_ort.full_state_dict(fresh, rank0_only=False)["model"]
    return {**failures, "rows_equal": rows_ok, "in_place": in_place, "tied": tied, "bytes_read": report.bytes_read,
            "bytes_expected": mine, "bytes_total": report.bytes_total,
            "full_bytes": sum(t.numel() * t.element_size() for n, t in full.items() if n != "lm_head.weight"),
            "next_loss_equal": torch.equal(loss, fresh_loss),
            "next_params_equal": {k: torch.equal(after[k], fresh_after[k]) for k in after},
            "retraced": fresh_step.transitions.traces != traces}


def agreed_failures(root: Path, model, rank: int) -> dict:
    """A load whose path is wrong on rank 1 only, and a save whose directory rank 0 cannot create: every rank
    raises, and the sharded model is unchanged (values, parameters, the step's buffers)."""
    def snapshot():
        return {n: (id(p), p._local_tensor.data_ptr(), p.to_local().clone()) for n, p in model.named_parameters()}

    def same(a, b):
        return a.keys() == b.keys() and all(a[k][:2] == b[k][:2] and torch.equal(a[k][2], b[k][2]) for k in a)

    before = snapshot()
    out = {}
    try:
        spmd_ort.load_safetensors(model, root / ("nope" if rank == 1 else "fs"))
        out["load_rank1_error"] = None
    except spmd_ort.CheckpointError as exc:
        out["load_rank1_error"] = str(exc)
    if rank == 0:
        (root / "afile").write_text("x")
    dist.barrier()
    try:
        spmd_ort.save_safetensors(model, root / "afile" / "w")
        out["save_rank0_error"] = None
    except spmd_ort.CheckpointError as exc:
        out["save_rank0_error"] = str(exc)
    out["unchanged_after_failures"] = same(before, snapshot())
    return out


def tensor_parallel(root: Path, rank: int, world: int) -> dict:
    import transformers
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(),
            **{f"model.layers.*.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel()}
    if rank == 0:
        torch.manual_seed(2)
        transformers.LlamaForCausalLM(llama_config(tie=False)).save_pretrained(root / "tp")
    dist.barrier()
    full = load_file(root / "tp" / "model.safetensors")  # the oracle: every rank's whole copy
    mesh = init_device_mesh("cpu", (world,))

    def check(model) -> dict:
        out = {}
        for name, p in model.state_dict().items():
            if isinstance(p, DTensor):
                want = distribute_tensor(full[name], mesh, p.placements, src_data_rank=None).to_local()
                out[name] = [str(pl) for pl in p.placements] if torch.equal(p.to_local(), want) else False
            else:
                out[name] = "plain" if torch.equal(p, full[name]) else False
        return out

    torch.manual_seed(3)
    model = parallelize_module(transformers.LlamaForCausalLM(llama_config(tie=False)), mesh, plan)
    report = spmd_ort.load_safetensors(model, root / "tp")
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(llama_config(tie=False))
    meta = parallelize_module(meta, mesh, plan)
    meta_report = spmd_ort.load_safetensors(meta, root / "tp")
    devices = sorted({(p.to_local() if isinstance(p, DTensor) else p).device.type for p in meta.parameters()})

    # torch's strided shard alone: chunk `rank` of each of 2 row blocks, so rows that are not contiguous
    key = "model.layers.0.mlp.gate_proj.weight"  # (75, 64)
    placement = _StridedShard(0, split_factor=2)
    local = placement._split_tensor(full[key], world, with_padding=False)[0][rank].clone()
    holder = nn.Module()
    holder.w = nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False, shape=full[key].shape,
                                               stride=full[key].stride()))
    strided_layout_ok = torch.equal(holder.w.full_tensor(), full[key])  # torch agrees it is this layout
    with torch.no_grad():
        holder.w._local_tensor.zero_()
    strided_report = spmd_ort.load_safetensors(holder, root / "tp", key_map=lambda k: "w" if k == key else None)
    return {"tp": check(model), "tp_meta": check(meta), "tp_meta_devices": devices,
            "tp_bytes_read": report.bytes_read, "tp_meta_bytes_read": meta_report.bytes_read,
            "tp_bytes_total": report.bytes_total, "strided_layout_ok": strided_layout_ok,
            "strided_equal": torch.equal(holder.w.to_local(), local), "strided_local_rows": local.shape[0],
            "strided_bytes_read": strided_report.bytes_read}


def strided_2d(root: Path, rank: int) -> dict:
    """fully_shard's 2-D layout (``place_full``, as ``ShardedModule`` shards a tensor-parallel model over dp)."""
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from spmd_ort.distributed.sharding import place_full

    g = torch.Generator().manual_seed(0)
    full = {"colwise": torch.randn(7, 5, generator=g), "rowwise": torch.randn(6, 11, generator=g),
            "even": torch.randn(8, 3, generator=g), "norm": torch.randn(5, generator=g)}
    if rank == 0:
        save_file(full, str(root / "2d.safetensors"))
    dist.barrier()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = {"colwise": (_StridedShard(0, split_factor=2), Shard(0)), "rowwise": (Shard(0), Shard(1)),
               "even": (_StridedShard(0, split_factor=2), Shard(0)), "norm": (Shard(0),)}
    holder = nn.Module()
    expected = {}
    for name, placements in layouts.items():
        where = mesh if len(placements) == 2 else mesh["dp"]
        like = DTensor.from_local(torch.empty(0), where, placements, run_check=False, shape=full[name].shape,
                                  stride=full[name].stride())
        expected[name] = place_full(full[name], like).to_local()
        local = torch.zeros_like(expected[name])
        setattr(holder, name, nn.Parameter(DTensor.from_local(local, where, placements, run_check=False,
                                                              shape=full[name].shape, stride=full[name].stride())))
    report = spmd_ort.load_safetensors(holder, root / "2d.safetensors")
    return {"equal": {n: torch.equal(getattr(holder, n).to_local(), expected[n]) for n in full},
            "local_rows": {n: expected[n].shape[0] for n in full}, "bytes_read": report.bytes_read,
            "bytes_expected": sum(t.numel() * 4 for t in expected.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["sharded", "strided2d"], default="sharded")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root, out = Path(args.dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "strided2d":
        from torch.distributed.device_mesh import init_device_mesh

        from examples.gpt import tensor_parallel_plan
        from parallelize_meta import layout

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mode = spmd_ort.TensorParallel(tensor_parallel_plan(), mesh=mesh,
                                       data_parallel=spmd_ort.DataParallel(parallel_style="fully_shard"))
        result = {**strided_2d(root, rank), "compiled_2d": layout("2d", mode, root, rank, world,
                                                                         data_rank=mesh["dp"].get_local_rank())}
    else:
        result = {**fully_shard(root, out, rank, world), **tensor_parallel(root, rank, world)}
    finish(out, {"rank": rank, **result}, f"{args.phase}-rank{rank}.json")


if __name__ == "__main__":
    main()
