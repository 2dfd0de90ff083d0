"""``spmd_ort.Parallel``: one layout object for every parallel degree (issue 56 item 1).  Its checks, what it
lowers to, and on real ranks (tests/dist/layout_parity.py) the same graph and numbers as the shorthands."""

from __future__ import annotations

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel

import spmd_ort
from spmd_ort.distributed.parallel import ContextParallel
from spmd_ort.distributed.parallel_dims import Parallel
from test_data_parallel import ROOT, torchrun

PLAN = {"blocks.*.fc": ColwiseParallel()}


@pytest.mark.parametrize("kwargs,said", [
    ({"cp": 2, "tp": 2, "tp_plan": PLAN}, "Parallel(cp=2, tp=2): context parallelism with tensor parallelism is not"),
    ({"cp": 2, "seq_dim": -1}, "Parallel(seq_dim=-1): the batch's sequence dim"),
    ({"pp": 2, "dp_shard": 2}, "Parallel(pp=2, dp_shard=2): pipeline parallelism with dp_shard is not built"),
    ({"ep": 2}, "Parallel(ep=2): give experts, an FQN glob of the expert modules"),
    ({"dp_shard": 4, "tp": 2, "tp_plan": PLAN, "ep": 2, "experts": "layers.*.experts"},
     "expert parallelism with tp is not built in this release yet"),
    ({"tp": 2}, "Parallel(tp=2): give tp_plan"),
    ({"tp_plan": PLAN}, "Parallel(tp_plan=...) needs tp > 1"),
    ({"dp_replicate": 2, "dp_shard": 2}, "replicas of a sharded group (HSDP) are not built yet"),
    ({"dp_shard": 0}, "Parallel(dp_shard=0): a degree is a positive integer"),
    ({"dp_shard": -1, "tp": -1, "tp_plan": PLAN}, "at most one degree may be -1"),
    ({"offload_param": "cpu"}, "it needs dp_shard > 1"),
    ({"dp_shard": 2, "prefetch": -1}, "prefetch=-1 must be >= 0"),
])
def test_bad_layouts_are_config_errors_before_anything_is_traced(kwargs, said):
    with pytest.raises(spmd_ort.ConfigError) as info:
        Parallel(**kwargs)
    assert said in str(info.value), str(info.value)


def test_the_data_parallel_settings_are_data_parallels():
    """Every DataParallel setting but the style (which the degrees say) is a Parallel field with its default."""
    import dataclasses

    from spmd_ort.distributed.parallel_dims import DP_SETTINGS

    settings = {f.name: f.default for f in dataclasses.fields(spmd_ort.DataParallel) if f.name != "parallel_style"}
    assert set(DP_SETTINGS) == set(settings)
    assert {k: Parallel.__dataclass_fields__[k].default for k in DP_SETTINGS} == settings


def test_degrees_must_make_the_world():
    """Their product is the world (one may be -1: the rest); otherwise each degree is named."""
    assert Parallel(dp_shard=-1, tp=2, tp_plan=PLAN).sizes(8) == {"pp": 1, "dp_replicate": 1, "dp_shard": 4,
                                                                   "cp": 1, "tp": 2}
    with pytest.raises(spmd_ort.ConfigError) as info:
        Parallel(dp_shard=3, tp=2, tp_plan=PLAN).sizes(8)
    assert "pp 1 x dp_replicate 1 x dp_shard 3 x cp 1 x tp 2 = 6 ranks, but the world has 8" in str(info.value)
    with pytest.raises(spmd_ort.ConfigError, match="does not divide the world of 8 ranks, so dp_shard=-1"):
        Parallel(dp_shard=-1, tp=3, tp_plan=PLAN).sizes(8)


def test_it_lowers_to_the_shorthands_and_back():
    """The mesh in torchtitan's order (outermost first, dims above 1); what the passes consume is the shorthand's
    mode, equal field by field; ``Parallel.of`` gives the layout a shorthand stands for."""
    shard = spmd_ort.DataParallel(parallel_style="fully_shard", prefetch=0)
    assert Parallel(dp_shard=-1, prefetch=0).lower(4) == shard
    assert Parallel(dp_replicate=4).lower(4) == spmd_ort.DataParallel()
    tp = Parallel(dp_shard=2, tp=4, tp_plan=PLAN, prefetch=0)
    assert tp.mesh_shape(8) == (("dp_shard", "tp"), (2, 4))
    lowered = tp.lower(8)
    assert lowered.mesh == (2, 4) and lowered.data_parallel == shard and lowered.plan == PLAN
    assert Parallel.of(shard, 4) == Parallel(dp_shard=4, prefetch=0)
    assert Parallel.of(lowered, 8) == Parallel(dp_shard=2, tp=4, tp_plan=PLAN, prefetch=0)
    assert repr(Parallel(dp_shard=4, prefetch=0)) == "Parallel(dp_shard=4, prefetch=0)"
    assert tp.describe(8) == "Parallel(dp_shard=2, tp=4): mesh dp_shard 2 x tp 4"
    cp = Parallel(cp=-1, seq_dim=2).lower(4)
    assert cp == ContextParallel(cp=4, seq_dim=2) and Parallel.of(cp, 4) == Parallel(cp=4, seq_dim=2)
    # with dp_shard: fully_shard over every rank (torchtitan's FSDP over dp_shard x cp), the sequence over cp
    both = Parallel(dp_shard=2, cp=2, prefetch=0).lower(4)
    assert both == ContextParallel(cp=2, parallel_style="fully_shard", prefetch=0)
    assert Parallel.of(both, 4) == Parallel(dp_shard=2, cp=2, prefetch=0)


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_layout_trains_as_its_shorthand(tmp_path, nproc):
    """2 ranks: replicate, fully_shard, tensor parallel; 4: tp 2 x replicate 2, tp 2 x fully_shard 2 (parallelize
    takes the layout too): the same executed graph code, losses and parameters bit for bit; explain() prints the
    layout; degrees that do not make the world are a ConfigError on every rank, naming each."""
    ranks, _ = torchrun(tmp_path, nproc=nproc, script=ROOT / "tests" / "dist" / "layout_parity.py", timeout=600)
    for r in ranks:
        cases = {k: v for k, v in r.items() if k not in ("rank", "bad_world")}
        assert len(cases) == (3 if nproc == 2 else 2)
        for name, c in cases.items():
            assert c["same_code"] and c["losses_equal"] and c["state_equal"], (name, c)
            assert c["describe_equal"] and c["layout_line"] == c["shorthand_line"], (name, c)
            assert c["layout_line"].startswith("layout: Parallel("), c
        assert f"dp_shard {nproc + 1} x cp 1 x tp 1 = {nproc + 1} ranks, but the world has {nproc}" in r["bad_world"]
        assert r["bad_world"].endswith(f"(rank {r['rank']})"), r["bad_world"]


def test_a_plan_takes_a_layout():
    """plan() lowers the layout for the world it plans (dp_shard=-1: all 64 fake ranks), priced as its shorthand."""
    import torch

    from examples.gpt import GPT, GPTConfig
    from helpers import train_step

    cfg = GPTConfig(vocab=256, seq=32, d=64, heads=4, layers=2)
    plans = []
    for mode in (Parallel(dp_shard=-1), spmd_ort.DataParallel(parallel_style="fully_shard")):
        with torch.device("meta"):
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.empty(2, cfg.seq, dtype=torch.long, device="meta")
        step = spmd_ort.compile(parallel_mode=mode, backend="fx")(train_step)
        plans.append(step.plan(model, opt, ids, ids, world_size=64, export=False))
    layout, shorthand = plans
    assert layout.per_rank_bytes == shorthand.per_rank_bytes and layout.comm_bytes == shorthand.comm_bytes
    assert layout.parallel == shorthand.parallel == "fully_shard" and layout.flops == shorthand.flops


def test_a_cp_layout_is_planned_with_its_share_of_the_sequence():
    """plan() prices context parallelism (issue 58): Llama 3's architecture (examples/llama3.py, small) at 1,024
    tokens on 8 fake ranks, activation_memory_budget=0: Parallel(dp_shard=2, cp=4) plans at most 0.3x the per-rank
    activation bytes of Parallel(dp_shard=8) (each rank computes a quarter of the sequence; ideal 0.25), and the
    attention's gathers of K and V and reduce-scatters of their gradients are in its collectives and explain()."""
    import torch

    from examples.llama3 import Llama3, Llama3Config, train_step

    cfg = Llama3Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, max_seq_len=1024)
    with torch.device("meta"):
        model = Llama3(cfg)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.empty(1, 1024, dtype=torch.long, device="meta")
    plans = {}
    for name, layout in (("dp", Parallel(dp_shard=8)), ("cp", Parallel(dp_shard=2, cp=4))):
        step = spmd_ort.compile(parallel_mode=layout, activation_memory_budget=0.0, backend="fx")(train_step)
        plans[name] = step.plan(model, opt, tokens, tokens.clone(), world_size=8, export=False)
    ratio = plans["cp"].per_rank_bytes["activations"] / plans["dp"].per_rank_bytes["activations"]
    assert ratio <= 0.3, ratio
    # per layer: K and V gathered in the forward and again in the backward, their gradients reduce-scattered
    extra = {k: plans["cp"].comm_calls.get(k, 0) - plans["dp"].comm_calls.get(k, 0) for k in plans["cp"].comm_calls}
    assert extra["all_gather"] >= 4 * cfg.n_layers and extra["reduce_scatter"] >= 2 * cfg.n_layers, extra
    assert "context parallel: the sequence (dim 1 of the batch) in 8 chunks" in plans["cp"].explain()
    assert not opt.state
