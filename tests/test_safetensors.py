"""Hugging Face safetensors weights: save_safetensors / load_safetensors against transformers' own save_pretrained /
from_pretrained (a tiny Llama from a config, random weights, never downloaded), bit for bit; loads that cannot
succeed list every problem and change nothing; 2 and 4 ranks read only their own parts (tests/dist)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import launch
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import spmd_ort
from spmd_ort.checkpoint.safetensors import local_index

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
NOTHING = "Nothing was loaded: the model is unchanged."


def _llama(tie: bool = True, seed: int = 0, **kw):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   tie_word_embeddings=tie, **kw)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _keys(file: Path) -> dict[str, str]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def _snapshot(model) -> dict:
    """Every tensor's value, and which objects and storage the model holds."""
    sd = model.state_dict(keep_vars=True)
    return {"values": {k: v.detach().clone() for k, v in sd.items()}, "ids": {k: id(v) for k, v in sd.items()},
            "ptrs": {k: v.data_ptr() for k, v in sd.items()}}


def _assert_unchanged(model, before: dict) -> None:
    now = _snapshot(model)
    assert now["ids"] == before["ids"] and now["ptrs"] == before["ptrs"]
    _assert_bitwise(now["values"], before["values"])


# ---------------------------------------------------------------------- which rows a rank holds
def _chunk(idx: torch.Tensor, k: int, c: int) -> torch.Tensor:
    chunks = torch.chunk(idx, k) if len(idx) else ()
    return chunks[c] if c < len(chunks) else idx[:0]


@pytest.mark.parametrize("rows,world", [(5, 4), (3, 4), (75, 2), (1, 2), (8, 2)])
def test_local_index_shard0_is_fully_shards_rows_and_torchs(rows, world):
    """fully_shard's Shard(0): torch.chunk's rows, a trailing rank with fewer or none; torch's
    compute_local_shape_and_global_offset agrees."""
    for c in range(world):
        index = local_index((rows, 3), (world,), [c], [Shard(0)])
        assert torch.equal(index[0], _chunk(torch.arange(rows), world, c)) and torch.equal(index[1], torch.arange(3))
        shape, offset = _compute_local_shape_and_global_offset((rows, 3), (world,), [c], [Shard(0)])
        assert shape == (len(index[0]), 3) and (not len(index[0]) or offset[0] == int(index[0][0]))


def test_local_index_shard1_and_replicate():
    for c in range(2):
        rows, cols = local_index((4, 75), (2,), [c], [Shard(1)])
        assert torch.equal(rows, torch.arange(4)) and torch.equal(cols, _chunk(torch.arange(75), 2, c))
        assert _compute_local_shape_and_global_offset((4, 75), (2,), [c], [Shard(1)]) == ((4, len(cols)), (0, c * 38))
        assert [len(i) for i in local_index((4, 75), (2,), [c], [Replicate()])] == [4, 75]


@pytest.mark.parametrize("rows", [8, 7, 5, 3, 2])
@pytest.mark.parametrize("dp,tp", [(2, 2), (3, 2), (2, 3)])
def test_local_index_2d_strided_is_dp_rows_of_the_tp_piece(rows, dp, tp):
    """FSDP2 + TP's (_StridedShard(0, split_factor=tp), Shard(0)) on a (dp, tp) mesh: dp's chunk of the tensor-parallel
    chunk (as FSDP2 and fully_shard's place_full cut it); a plain Shard(1) over tp keeps its rows' dp chunk."""
    for d in range(dp):
        for t in range(tp):
            index = local_index((rows, 4), (dp, tp), [d, t], [_StridedShard(0, split_factor=tp), Shard(0)])
            assert torch.equal(index[0], _chunk(_chunk(torch.arange(rows), tp, t), dp, d)), (d, t)
            index = local_index((rows, 5), (dp, tp), [d, t], [Shard(0), Shard(1)])
            assert torch.equal(index[0], _chunk(torch.arange(rows), dp, d))
            assert torch.equal(index[1], _chunk(torch.arange(5), tp, t))


def test_torchs_strided_offsets_differ_from_fsdp2s_for_some_uneven_sizes():
    """Why local_index does not take torch's offsets for FSDP2 + TP: 7 rows on a 3 x 2 mesh, torch puts row 6 on
    (dp 2, tp 0), FSDP2 (chunk of the tp chunk) on (dp 2, tp 1)."""
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    assert _compute_local_shape_and_global_offset((7, 4), (3, 2), [2, 0], placements) == ((1, 4), (6, 0))
    assert local_index((7, 4), (3, 2), [2, 0], placements)[0].tolist() == []
    assert local_index((7, 4), (3, 2), [2, 1], placements)[0].tolist() == [6]


def test_local_index_lone_strided_shard_is_torchs_and_not_contiguous():
    """A strided shard alone: chunk c of each of split_factor row blocks, as torch defines it."""
    placement = _StridedShard(0, split_factor=2)
    for rows in (8, 75, 5):
        for c in range(2):
            want = placement._split_tensor(torch.arange(rows), 2, with_padding=False)[0][c].tolist()
            assert local_index((rows,), (2,), [c], [placement])[0].tolist() == want
    assert local_index((8,), (2,), [1], [placement])[0].tolist() == [2, 3, 6, 7]


# ---------------------------------------------------------------------- one process, against transformers
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_save_safetensors_loads_with_from_pretrained_bitwise(tmp_path, tie):
    """One model.safetensors, {"format": "pt"}, no index; a tied pair written once, under the name save_pretrained
    keeps (model.embed_tokens.weight); from_pretrained gives back every tensor bit for bit."""
    model = _llama(tie)
    spmd_ort.save_safetensors(model, tmp_path / "w")
    model.config.save_pretrained(tmp_path / "w")
    assert sorted(os.listdir(tmp_path / "w")) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "w" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) != tie and "model.embed_tokens.weight" in keys
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "w")
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    _assert_bitwise(loaded.state_dict(), model.state_dict())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_save_pretrained_loads_with_load_safetensors_bitwise(tmp_path, tie):
    """transformers' own files into a fresh model (in place: same parameters, same storage; the tie kept) and
    into a model on the meta device (real CPU parameters, the tie kept); each reads every byte once."""
    src = _llama(tie)
    src.save_pretrained(tmp_path)
    total = (tmp_path / "model.safetensors").stat().st_size
    fresh = _llama(tie, seed=1)
    ids = {n: (id(p), p.data_ptr()) for n, p in fresh.named_parameters()}
    report = spmd_ort.load_safetensors(fresh, tmp_path)
    _assert_bitwise(fresh.state_dict(), src.state_dict())
    assert {n: (id(p), p.data_ptr()) for n, p in fresh.named_parameters()} == ids
    assert (fresh.lm_head.weight is fresh.model.embed_tokens.weight) == tie
    assert report.bytes_read == report.bytes_total and total - 10_000 < report.bytes_total <= total
    assert report.tensors == len(_keys(tmp_path / "model.safetensors")) and report.files == 1

    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(src.config)
    spmd_ort.load_safetensors(meta, tmp_path / "model.safetensors")  # the file itself works as well
    _assert_bitwise(meta.state_dict(), src.state_dict())
    assert all(isinstance(p, torch.nn.Parameter) and p.device.type == "cpu" for p in meta.parameters())
    assert (meta.lm_head.weight is meta.model.embed_tokens.weight) == tie


def test_key_map_renames_prefixes_and_skips(tmp_path):
    """A causal LM's file into the bare LlamaModel: a prefix map (None drops the head), or a callable."""
    src = _llama(tie=False)
    src.save_pretrained(tmp_path)
    want = src.model.state_dict()
    base = transformers.LlamaModel(src.config)
    spmd_ort.load_safetensors(base, tmp_path, key_map={"model.": "", "lm_head.": None})
    _assert_bitwise(base.state_dict(), want)
    base = transformers.LlamaModel(src.config)
    spmd_ort.load_safetensors(base, tmp_path, key_map=lambda k: k.removeprefix("model.") if k != "lm_head.weight"
                              else None)
    _assert_bitwise(base.state_dict(), want)
    base = transformers.LlamaModel(src.config)
    spmd_ort.load_safetensors(base, tmp_path, key_map={"model.": ""}, strict=False)  # lm_head.weight skipped
    _assert_bitwise(base.state_dict(), want)
    with pytest.raises(spmd_ort.CheckpointError) as info:  # no map: the error says which one
        spmd_ort.load_safetensors(transformers.LlamaModel(src.config), tmp_path)
    assert str(info.value).splitlines()[0] == (
        f"cannot load `{tmp_path}` into LlamaModel: `embed_tokens.weight` of LlamaModel is not in the checkpoint. "
        "Fix: load a checkpoint of this model's configuration, or map the file's keys onto the model's with "
        "key_map={\"model.\": \"\"} (the file has `model.embed_tokens.weight`). " + NOTHING)


def test_bf16_file_loads_into_fp32_parameters(tmp_path):
    model = _llama()
    spmd_ort.save_safetensors(model, tmp_path / "w", dtype=torch.bfloat16)
    assert set(_keys(tmp_path / "w" / "model.safetensors").values()) == {"BF16"}
    fresh = _llama(seed=1)
    report = spmd_ort.load_safetensors(fresh, tmp_path / "w")
    assert all(p.dtype == torch.float32 for p in fresh.parameters())
    _assert_bitwise(fresh.state_dict(), {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    assert report.bytes_read == sum(p.numel() * 2 for p in model.parameters())


def test_small_shards_write_an_index_and_replace_the_directory(tmp_path):
    """max_shard_bytes 40 kB: model-0000k-of-0000n files (none over the limit unless one tensor is) and an index
    save_pretrained's way; both loaders read them back bit for bit.  Saving again replaces the weights (no stale
    shard or index left), keeps config.json, and leaves no temporary directory next to it."""
    model = _llama(tie=False)
    spmd_ort.save_safetensors(model, tmp_path / "w", max_shard_bytes=40_000)
    files = sorted(f.name for f in (tmp_path / "w").iterdir())
    n = len(files) - 1
    assert n > 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)] \
        + ["model.safetensors.index.json"]
    index = json.loads((tmp_path / "w" / "model.safetensors.index.json").read_text())
    sizes = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert index["weight_map"].keys() == sizes.keys()
    for k in range(1, n + 1):
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        held = _keys(tmp_path / "w" / name)
        assert {key for key, f in index["weight_map"].items() if f == name} == held.keys()
        assert sum(sizes[key] for key in held) <= 40_000 or len(held) == 1
    model.config.save_pretrained(tmp_path / "w")
    _assert_bitwise(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "w").state_dict(), model.state_dict())
    fresh = _llama(tie=False, seed=1)
    report = spmd_ort.load_safetensors(fresh, tmp_path / "w")
    _assert_bitwise(fresh.state_dict(), model.state_dict())
    assert report.files == n

    spmd_ort.save_safetensors(fresh, tmp_path / "w")  # one file now: the shards and the index go, config.json stays
    assert sorted(os.listdir(tmp_path / "w")) == ["config.json", "model.safetensors"] and os.listdir(tmp_path) == ["w"]


def test_failed_load_lists_every_problem_and_changes_nothing(tmp_path):
    """A missing key, a wrong shape, an integer file entry for a float parameter and an unexpected key: one
    CheckpointError naming the file per key; with strict=False the missing and unexpected keys are no longer
    problems (skipped and reported, as load_state_dict does)."""
    src = _llama(tie=False)
    sd = {k: v.clone() for k, v in src.state_dict().items() if k != "model.norm.weight"}
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    sd["model.layers.1.input_layernorm.weight"] = torch.zeros(64, dtype=torch.int32)
    sd["extra.bias"] = torch.zeros(3)
    save_file(sd, str(tmp_path / "bad.safetensors"))
    model = _llama(tie=False, seed=1)
    before = _snapshot(model)
    shape = ("`model.layers.0.mlp.up_proj.weight` (in bad.safetensors) has shape (95, 64) in the checkpoint but "
             "(96, 64) in LlamaForCausalLM")
    dtype = ("`model.layers.1.input_layernorm.weight` (in bad.safetensors) is I32 in the checkpoint and does not "
             "convert to LlamaForCausalLM's float32. Fix: load it into a tensor of a dtype that holds its values "
             "(floating point to floating point; integers to a wider integer type).")
    missing = ("`model.norm.weight` of LlamaForCausalLM is not in the checkpoint. Fix: load a checkpoint of this "
               "model's configuration, or map the file's keys onto the model's with key_map.")
    unexpected = ("`extra.bias` in bad.safetensors is not in LlamaForCausalLM's state dict. Fix: pass strict=False "
                  "to skip the entries the model does not have, or map the file's keys onto the model's with key_map.")
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.load_safetensors(model, tmp_path / "bad.safetensors")
    assert str(info.value).splitlines() == [
        f"cannot load `{tmp_path / 'bad.safetensors'}` into LlamaForCausalLM: {shape}. Fix: build the "
        f"LlamaForCausalLM with the configuration the checkpoint was saved from. {NOTHING}",
        "3 more problems:", f"  {dtype}", f"  {missing}", f"  {unexpected}"]
    assert info.value.key == "model.layers.0.mlp.up_proj.weight" and info.value.path == str(tmp_path / "bad.safetensors")
    _assert_unchanged(model, before)
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.load_safetensors(model, tmp_path / "bad.safetensors", strict=False)
    assert str(info.value).splitlines()[1:] == ["1 more problem:", f"  {dtype}"]
    _assert_unchanged(model, before)
    # each alone, in a file otherwise right
    for drop, add in [("model.norm.weight", {}), (None, {"model.norm.weight": torch.zeros(63)}),
                      (None, {"extra.bias": torch.zeros(3)})]:
        one = {**{k: v for k, v in src.state_dict().items() if k != drop}, **add}
        save_file(one, str(tmp_path / "one.safetensors"))
        with pytest.raises(spmd_ort.CheckpointError) as info:
            spmd_ort.load_safetensors(model, tmp_path / "one.safetensors")
        assert len(str(info.value).splitlines()) == 1
        _assert_unchanged(model, before)
    report = spmd_ort.load_safetensors(model, tmp_path / "one.safetensors", strict=False)  # an unexpected key
    _assert_bitwise(model.state_dict(), src.state_dict())
    assert report.unexpected == ("extra.bias",) and report.missing == ()
    one = {k: v for k, v in src.state_dict().items() if k != "model.norm.weight"}
    save_file(one, str(tmp_path / "one.safetensors"))
    fresh = _llama(tie=False, seed=1)
    norm = fresh.model.norm.weight.detach().clone()
    report = spmd_ort.load_safetensors(fresh, tmp_path / "one.safetensors", strict=False)  # a missing key: kept
    assert report.missing == ("model.norm.weight",) and report.unexpected == ()
    assert torch.equal(fresh.model.norm.weight, norm)
    _assert_bitwise({k: v for k, v in fresh.state_dict().items() if k != "model.norm.weight"}, one)


def test_unreadable_checkpoints_change_nothing(tmp_path):
    src = _llama()
    src.save_pretrained(tmp_path / "ok")
    model = _llama(seed=1)
    before = _snapshot(model)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes()[:5000])
    sharded = tmp_path / "sharded"
    spmd_ort.save_safetensors(src, sharded, max_shard_bytes=100_000)
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    (tmp_path / "empty").mkdir()
    fix = "Fix: pass a .safetensors file or a directory that save_pretrained or save_safetensors wrote."
    for path, first in [
        (tmp_path / "nope", f"it does not exist. {fix}"),
        (tmp_path / "empty", f"it holds no model.safetensors.index.json and not one model.safetensors "
                             f"(no .safetensors file). {fix}"),
        (sharded, "its index model.safetensors.index.json names files that are not there: "
                  f"{victim.name}. Fix: copy the missing shard files into the directory."),
        (damaged, "damaged.safetensors cannot be read (SafetensorError: Error while deserializing header: "),
    ]:
        with pytest.raises(spmd_ort.CheckpointError) as info:
            spmd_ort.load_safetensors(model, path)
        assert str(info.value).startswith(f"cannot load `{path}` into LlamaForCausalLM: {first}"), str(info.value)
        assert str(info.value).endswith(NOTHING)
        _assert_unchanged(model, before)


def test_saving_into_a_directory_replaces_only_the_weights(tmp_path):
    """Issue 55 item 6: a save into an existing directory (a model saved by save_pretrained, with its config, a
    note and another checkpoint beside it) replaces the weight files and the index and keeps the rest, as
    save_pretrained does: sharded over three files, then into one, the stale shards and index go; from_pretrained
    reads the newest weights."""
    model = _llama()
    d = tmp_path / "w"
    model.save_pretrained(d)
    (d / "notes.txt").write_text("keep me")
    (d / "checkpoint-10").mkdir()
    (d / "checkpoint-10" / "model.safetensors").write_text("another checkpoint")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    spmd_ort.save_safetensors(model, d, max_shard_bytes=size // 3 + 1)
    names = sorted(os.listdir(d))
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in names and "model.safetensors" not in names, names
    assert {"config.json", "notes.txt", "checkpoint-10"} <= set(names)
    spmd_ort.save_safetensors(model, d)
    assert sorted(os.listdir(d)) == sorted(["config.json", "generation_config.json", "notes.txt", "checkpoint-10",
                                            "model.safetensors"]), sorted(os.listdir(d))
    assert (d / "notes.txt").read_text() == "keep me"
    assert (d / "checkpoint-10" / "model.safetensors").read_text() == "another checkpoint"
    _assert_bitwise(transformers.LlamaForCausalLM.from_pretrained(d).state_dict(), model.state_dict())
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".w.")]  # no temporary directory left


def test_save_errors(tmp_path):
    (tmp_path / "afile").write_text("x")
    model = _llama()
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.save_safetensors(model, tmp_path / "afile")
    assert str(info.value) == (f"cannot save safetensors to `{tmp_path / 'afile'}`: it is a file, and the weights "
                               "are a directory. Fix: choose a directory path in a writable location (it is created "
                               "if missing).")
    with pytest.raises(spmd_ort.CheckpointError, match="cannot create a directory in"):
        spmd_ort.save_safetensors(model, tmp_path / "afile" / "w")
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(model.config)
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.save_safetensors(meta, tmp_path / "w")
    assert str(info.value).startswith(f"cannot save safetensors to `{tmp_path / 'w'}`: `model.embed_tokens.weight` "
                                      "and 19 more tensors are on the meta device.")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


# ---------------------------------------------------------------------- ranks
def _torchrun(nproc: int, *args: str) -> None:
    launch.torchrun("safetensors_roundtrip.py", *args, nproc=nproc, timeout=600)


@pytest.mark.multiproc
def test_two_ranks_fully_shard_and_tensor_parallel(tmp_path):
    """fully_shard (tied Llama, uneven rows, 3 compiled steps): save_safetensors -> from_pretrained equals
    full_state_dict bit for bit; loaded into a sharded model each rank reads only its rows, into the step's own
    buffers, and the next step equals the trained model's bit for bit.  Tensor parallel (Shard(0) / Shard(1),
    uneven; also on the meta device; a lone strided shard from a covering slice): local shards equal
    distribute_tensor's."""
    out = tmp_path / "out"
    _torchrun(2, "--dir", str(tmp_path), "--out", str(out))
    full = torch.load(out / "fs_full.pt")
    _assert_bitwise(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fs").state_dict(), full)
    ranks = [json.loads((out / f"sharded-rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert all(r["rows_equal"].values()) and len(r["rows_equal"]) == 20, r["rows_equal"]
        assert r["in_place"] and r["tied"] and not r["retraced"]
        assert r["next_loss_equal"] and all(r["next_params_equal"].values())
        # only its own rows: 75-row MLP weights split 38 / 37
        assert r["bytes_read"] == r["bytes_expected"] and r["bytes_total"] == r["full_bytes"]
        print(f"rank {r['rank']}: fully_shard read {r['bytes_read']} of {r['bytes_total']} B; tensor parallel "
              f"{r['tp_bytes_read']} of {r['tp_bytes_total']} B; strided {r['strided_bytes_read']} B for "
              f"{r['strided_local_rows']} rows of 64 fp32")
        for case in ("tp", "tp_meta"):
            assert all(r[case].values()), r[case]
            assert r[case]["model.layers.0.mlp.down_proj.weight"] == ["S(1)"]
            assert r[case]["model.layers.0.mlp.gate_proj.weight"] == ["S(0)"]
            assert r[case]["model.norm.weight"] == "plain"
        assert r["tp_meta_devices"] == ["cpu"] and r["tp_meta_bytes_read"] == r["tp_bytes_read"]
        assert r["strided_layout_ok"] and r["strided_equal"]
        assert r["strided_local_rows"] * 64 * 4 < r["strided_bytes_read"] < 75 * 64 * 4  # a covering slice
        # failures on one rank raise on every rank and change nothing
        assert r["load_rank1_error"] == (
            f"cannot load `{tmp_path / 'nope'}` into LlamaForCausalLM: it does not exist. Fix: pass a .safetensors "
            f"file or a directory that save_pretrained or save_safetensors wrote. {NOTHING} (failed on rank 1; this "
            f"is rank {r['rank']})")
        assert r["save_rank0_error"].startswith(
            f"cannot save safetensors to `{tmp_path / 'afile' / 'w'}`: cannot create a directory in "), r
        assert r["save_rank0_error"].endswith(f"(failed on rank 0; this is rank {r['rank']})")
        assert r["unchanged_after_failures"]
    assert sum(r["bytes_read"] for r in ranks) == ranks[0]["full_bytes"]
    assert ranks[0]["tp_bytes_read"] + ranks[1]["tp_bytes_read"] < 1.05 * ranks[0]["tp_bytes_total"]


@pytest.mark.multiproc
def test_four_ranks_read_fully_shards_2d_strided_layout(tmp_path):
    """A 2 x 2 (dp, tp) mesh: parameters in fully_shard's 2-D layout (a strided dp shard of the tp piece, 7 rows:
    2, 2, 2, 1; a Shard(0)/Shard(1) one; a dp-only one) load exactly their own elements; and a meta GPT under the
    compiled 2-D step, parallelized and loaded from safetensors, trains as the materialised one bit for bit."""
    out = tmp_path / "out"
    _torchrun(4, "--phase", "strided2d", "--dir", str(tmp_path), "--out", str(out))
    ranks = [json.loads((out / f"strided2d-rank{r}.json").read_text()) for r in range(4)]
    assert [r["local_rows"]["colwise"] for r in ranks] == [2, 2, 2, 1]
    for r in ranks:
        assert all(r["equal"].values()), r
        assert r["bytes_read"] == r["bytes_expected"]
        # the compiled 2-D step (fully_shard over dp, Megatron TP): a meta GPT parallelized, to_empty'd and loaded
        # from the file trains as the materialised one, bit for bit; each rank allocated and read its part only
        x = r["compiled_2d"]
        assert x["returned_model"] and x["meta_after_parallelize"] and x["twin_ok"] and x["tied"], x
        assert x["losses"] == x["ref_losses"], (x["losses"], x["ref_losses"])
        assert all(x["equal"].values()), [k for k, v in x["equal"].items() if not v]
        assert x["refused"] is not None and "was parallelized with" in x["refused"], x["refused"]
        assert x["placements"]["blocks.0.out.weight"][-1] == "S(1)", x["placements"]
        assert 4 * x["allocated"] <= x["full_numel"] + 4 * 1024 and x["bytes_read"] == 4 * x["allocated"], x


def test_an_io_error_during_the_read_says_the_model_is_partly_loaded(tmp_path, monkeypatch):
    """After every check passed, the read goes straight into the model's tensors: a read that fails part way (a
    failing disk, here the 3rd read) is a CheckpointError saying the model is partly loaded (the tensors read so
    far hold the file's values, the others their old ones); loading again then gives the file's values."""
    import spmd_ort.checkpoint.safetensors as st

    src = _llama()
    src.save_pretrained(tmp_path / "ok")
    model = _llama(seed=1)
    before = _snapshot(model)
    calls = {"n": 0}
    real = os.preadv

    def failing(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(st.os, "preadv", failing)
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.load_safetensors(model, tmp_path / "ok")
    message = str(info.value)
    assert message.startswith(f"cannot load `{tmp_path / 'ok'}` into LlamaForCausalLM: "), message
    assert "Input/output error" in message and message.endswith(st.PARTLY_LOADED), message
    now = _snapshot(model)
    assert now["ids"] == before["ids"] and now["ptrs"] == before["ptrs"]  # in place: the same tensors
    want = src.state_dict()
    changed = [k for k, v in now["values"].items() if not torch.equal(v, before["values"][k])]
    assert changed and all(torch.equal(now["values"][k], want[k]) for k in changed), changed
    assert len(changed) < len(want)
    monkeypatch.setattr(st.os, "preadv", real)
    spmd_ort.load_safetensors(model, tmp_path / "ok")
    _assert_bitwise(model.state_dict(), want)
