"""Expert parallelism (``Parallel(dp_shard=N, ep=M, experts=...)``: spmd_ort/distributed/experts.py,
passes/expert_parallel.py).

On real gloo ranks, tests/dist/ep_parity.py trains HF Mixtral, Qwen3-MoE and DeepSeek-V3 (tiny configs) with their
experts spread over the ranks against torch DDP on the same ranks and batches, checking the loss, every parameter
and Adam moment after every step, what each rank holds and the all-to-all bytes against the routing; these tests
check what it reports.  The layout's errors and the plan are checked in this process.
"""

from __future__ import annotations

import sys

import pytest
import torch

import spmd_ort
from helpers import assert_ort_report_clean
from test_data_parallel import ROOT, torchrun

from spmd_ort.distributed.experts import ExpertParallel, check_experts

SCRIPT = ROOT / "tests" / "dist" / "ep_parity.py"
sys.path.insert(0, str(ROOT / "tests" / "dist"))
import ep_parity  # noqa: E402

GLOB = "model.layers.*.mlp.experts"


@pytest.mark.multiproc
@pytest.mark.on_ort
def test_two_ranks_match_ddp(tmp_path):
    """dp_shard=2 x ep=2: every scenario matches DDP after every step (ep_parity asserts it on every rank): HF
    Mixtral on fx and ORT, Qwen3-MoE (with its router's auxiliary loss), DeepSeek-V3, a torchtitan-style
    GroupedExperts LM on ORT, gradient accumulation over two micro-batches, every block checkpointed (the
    experts recomputed in backward, their exchanges too), a router that starves an
    expert, a meta-device model parallelized and loaded from safetensors; FSDP2's mixed precision policy against
    fully_shard's; a glob that matches nothing."""
    ranks, _ = torchrun(tmp_path, script=SCRIPT, timeout=900)
    for r in ranks:
        for name in ("mixtral", "mixtral-ort", "qwen3", "deepseek", "titan", "accum", "recompute", "starved",
                     "mixtral-even", "meta"):
            got = r[name]
            assert len(got["losses"]) == ep_parity.STEPS and got["worst_rel"] < 2e-3, (name, got["worst_rel"])
            # 1/ep of every expert parameter on each rank (its optimizer state too, asserted there)
            assert all(shape[0] * 2 == (4 if name != "qwen3" and name != "deepseek" else 8)
                       for shape in got["held"].values()), got["held"]
            assert "expert parallel over 2 ranks" in got["opaque"][0], got["opaque"]
            assert "Parallel(dp_shard=2, ep=2)" in got["explain"] and "expert load on the last step" in got["explain"]
        assert_ort_report_clean(r["mixtral-ort"]["ort"])
        assert_ort_report_clean(r["titan"]["ort"])
        assert "their backward runs their forward again" in r["recompute"]["explain"]
        assert "(GroupedExperts)" in r["titan"]["opaque"][0]  # torchtitan's call: rows sorted by expert, counts
        # built on meta, parallelized, loaded: each rank read its half of the file (its experts' rows among it)
        loaded = r["meta"]["loaded"]
        assert abs(2 * loaded["bytes_read"] - loaded["bytes_total"]) <= 0.02 * loaded["bytes_total"], loaded
        assert r["bf16"]["worst_rel"] < 2e-2  # bf16 compute: the update within bf16's rounding of fully_shard's
        assert "matches no submodule of MixtralForCausalLM" in r["errors"]["error"]
        assert "model.layers.0.mlp.experts" in r["errors"]["error"]  # names the modules it could have meant
    # the rank that computes expert 3 of the starved model reports no token for it, in every layer
    assert all(calls[-1][-1] == 0 for calls in ranks[1]["starved"]["comm"]["expert_tokens"].values())
    # the plan's even split against the bytes the router sent (mixtral-even: 512 routed rows per rank and layer)
    measured = sum(r["mixtral-even"]["comm"]["all_to_all_bytes"] for r in ranks) / len(ranks)
    model, _ = _meta("mixtral-even")
    step = spmd_ort.compile(parallel_mode=spmd_ort.Parallel(dp_shard=2, ep=2, experts=GLOB))(ep_parity.step_fn)
    x = torch.zeros(ep_parity.SHAPES["mixtral-even"], dtype=torch.long, device="meta")
    planned = step.plan(model, torch.optim.AdamW(model.parameters()), x, world_size=2, export=False)
    assert abs(planned.comm_bytes["all_to_all"] / measured - 1) < 0.1, (planned.comm_bytes, measured)


@pytest.mark.multiproc
def test_four_ranks_shard_each_block(tmp_path):
    """dp_shard=4 x ep=2: each block of E/2 experts is sharded over 2 ranks (gathered over them, its gradient
    reduce-scattered over them), and matches DDP on 4 ranks; with 2 experts, fewer than the ranks, too."""
    ranks, _ = torchrun(tmp_path, "--scenarios", "mixtral,qwen3,few", script=SCRIPT, timeout=900, nproc=4)
    for rank, r in enumerate(ranks):
        for name, experts in (("mixtral", 4), ("qwen3", 8), ("few", 2)):
            assert r[name]["worst_rel"] < 2e-3
            rows = experts // 4 if experts >= 4 else int(rank < experts)  # (few: ranks 2 and 3 hold padding)
            assert all(shape[0] == rows for shape in r[name]["held"].values()), r[name]["held"]
            assert "gathered over 2 ranks" in r[name]["explain"], r[name]["explain"]


def _meta(name: str):
    with torch.device("meta"):
        return ep_parity.build(name)


def test_layout_errors_name_the_fix():
    """Bad layouts are ConfigErrors before anything is traced, naming the degree or the module."""
    with pytest.raises(spmd_ort.ConfigError, match="give experts"):
        spmd_ort.Parallel(dp_shard=2, ep=2)
    with pytest.raises(spmd_ort.ConfigError, match="needs ep > 1"):
        spmd_ort.Parallel(dp_shard=2, experts=GLOB)
    with pytest.raises(spmd_ort.ConfigError, match="borrows its ranks from dp_shard"):
        spmd_ort.Parallel(dp_replicate=2, ep=2, experts=GLOB)
    with pytest.raises(spmd_ort.ConfigError, match="must divide dp_shard"):
        spmd_ort.Parallel(dp_shard=6, ep=4, experts=GLOB)
    with pytest.raises(spmd_ort.ConfigError, match="with cp is not built"):
        spmd_ort.Parallel(dp_shard=2, cp=2, ep=2, experts=GLOB)
    lowered = spmd_ort.Parallel(dp_shard=4, ep=2, experts=GLOB).lower(4)
    assert isinstance(lowered, ExpertParallel) and lowered.sharded and lowered.ep == 2
    assert lowered.groups(4, 4) == {"ep": [[0, 2], [1, 3]], "efsdp": [[0, 1], [2, 3]]}
    # 2 experts on 4 ranks: ranks 0 and 1 hold them (fully_shard's rows), 2 and 3 padding; each block's group has
    # its holder and a padding rank
    assert lowered.groups(2, 4) == {"ep": [[0, 1], [2, 3]], "efsdp": [[0, 2], [1, 3]]}
    # 8 experts on 16 ranks, ep 8: each expert held by one rank, gathered with one padding rank
    assert ExpertParallel(ep=8, experts=GLOB, parallel_style="fully_shard").groups(8, 16)["efsdp"][3] == [3, 11]
    assert spmd_ort.Parallel.of(lowered, 4) == spmd_ort.Parallel(dp_shard=4, ep=2, experts=GLOB)

    model, _ = _meta("mixtral")  # 4 experts
    with pytest.raises(spmd_ort.ConfigError, match="4 experts, which do not split into 3"):
        check_experts(model, ExpertParallel(ep=3, experts=GLOB, parallel_style="fully_shard"), 6)
    import transformers as T

    with torch.device("meta"):  # 6 experts on 4 ranks: fully_shard's 2 rows per rank straddle the blocks of 3
        six = T.MixtralForCausalLM(T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                   num_local_experts=6, num_experts_per_tok=2))
    with pytest.raises(spmd_ort.ConfigError, match="which do not tile its blocks of 3"):
        check_experts(six, ExpertParallel(ep=2, experts=GLOB, parallel_style="fully_shard"), 4)
    check_experts(model, ExpertParallel(ep=2, experts=GLOB, parallel_style="fully_shard"), 8)  # fewer than ranks
    with pytest.raises(spmd_ort.ConfigError, match="share no leading dim; expected parameters with a leading expert dim"):
        check_experts(model, ExpertParallel(ep=2, experts="model.layers.*.self_attn", parallel_style="fully_shard"), 2)
    with pytest.raises(spmd_ort.ConfigError, match=r"takes \(hidden_states\), which is not an experts module"):
        check_experts(model, ExpertParallel(ep=2, experts="model.layers.*.mlp.gate", parallel_style="fully_shard"), 2)
    assert [f for f, _ in check_experts(model, ExpertParallel(ep=2, experts=GLOB, parallel_style="fully_shard"), 4)] \
        == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_plan_prices_the_exchange_instead_of_the_gathers():
    """On 8 fake ranks, a Mixtral-shaped MoE (8 experts of 1024 x 3584, top-2): ep=8 gathers no expert and sends
    each token's rows to its experts' ranks: the all-to-all bytes are the even split's, the all-gathers fall by
    the experts' share, the FLOPs are those of fully_shard (every row still meets its expert), and the experts'
    saved activations are priced."""
    import transformers as T

    cfg = T.MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
                          num_attention_heads=16, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        model = T.MixtralForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.zeros(2, 1024, dtype=torch.long, device="meta")
    plans = {}
    for name, layout in (("fsdp", spmd_ort.Parallel(dp_shard=8)),
                         ("ep", spmd_ort.Parallel(dp_shard=8, ep=8, experts=GLOB))):
        step = spmd_ort.compile(parallel_mode=layout, backend="fx")(ep_parity.step_fn)
        plans[name] = step.plan(model, opt, x, world_size=8)
    fsdp, ep = plans["fsdp"], plans["ep"]
    rows = 2 * 1024 * 2  # tokens x top-k, per layer
    assert ep.comm_bytes["all_to_all"] == 2 * 4 * (rows * 7 // 8) * 1024 * 4  # layers x (out, back, 2 in backward)
    experts_bytes = 2 * 8 * 3 * 3584 * 1024 * 4
    # fully_shard gathers every expert in forward and again in backward; ep none of them
    assert fsdp.comm_bytes["all_gather"] - ep.comm_bytes["all_gather"] >= 2 * experts_bytes
    assert ep.flops == pytest.approx(fsdp.flops, rel=0.02)
    assert ep.per_rank_bytes["activations"] == pytest.approx(fsdp.per_rank_bytes["activations"], rel=0.1)
    assert "all_to_all" in ep.compute_s_by_kind or ep.comm_s > 0
    assert not ep.unpriced


def test_the_command_line_plans_a_mixture_of_experts_config(tmp_path):
    """``python -m spmd_ort.plan --model hf:<config.json> --parallel ep:4`` on 8 ranks: a Mixtral config built on
    the meta device, fully_shard over 8 ranks with its experts computed over 4 of them; the all-to-all in the
    plan's collectives."""
    import json
    import subprocess

    import transformers

    config = transformers.MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2)
    config.save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "spmd_ort.plan", "--model", f"hf:{tmp_path / 'config.json'}",
                           "--world-size", "8", "--parallel", "ep:4", "--seq", "32", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fully_shard x expert parallel 4 (model.layers.*.mlp.experts)" in proc.stdout, proc.stdout
    got = json.loads(out.read_text())
    rows = 32 * 2  # tokens x top-k, per layer (batch 1)
    assert got["comm_bytes"]["all_to_all"] == 2 * 4 * (rows * 3 // 4) * 64 * 4  # layers x (2 forward, 2 backward)
