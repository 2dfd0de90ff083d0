"""The Hugging Face families of spmd_ort.plan.hf_configs: each published config builds on the meta device at its
published size, Megatron's tensor-parallel plan applies where it fits each family, and each family's tiny config
trains on 2 real ranks as DDP does (tests/dist/hf_zoo_parity.py). bench/hf_zoo.py plans them at real size."""

from __future__ import annotations

import pytest
import torch

import launch

transformers = pytest.importorskip("transformers")

from spmd_ort.plan.__main__ import llama_tensor_parallel_plan  # noqa: E402
from spmd_ort.plan.hf_configs import CONFIGS, SOURCES, config  # noqa: E402

# the parameter counts the model cards (SOURCES) state, in billions (embeddings and head included)
PUBLISHED_B = {"llama3-8b": 8.03, "mistral-7b": 7.25, "mixtral-8x7b": 46.7, "qwen2-7b": 7.62, "qwen3-8b": 8.19,
               "qwen3-30b-a3b": 30.5, "gemma-7b": 8.54, "gemma2-9b": 9.24, "gemma3-1b": 1.0, "phi3-mini": 3.82,
               "falcon-7b": 6.92, "gpt2-xl": 1.56, "pythia-6.9b": 6.86, "olmo2-7b": 7.3, "stablelm-2-1.6b": 1.64,
               "granite-3-8b": 8.17, "aya-23-8b": 8.03, "deepseek-v3": 671.0, "gpt-oss-20b": 20.9,
               "smollm3-3b": 3.08}


def meta_model(name: str, **kw):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config(name, **kw))


def test_twenty_families_build_on_meta_at_their_published_size():
    assert len(CONFIGS) == 20 and set(CONFIGS) == set(SOURCES) == set(PUBLISHED_B)
    for name in CONFIGS:
        n = sum(p.numel() for p in meta_model(name).parameters()) / 1e9
        assert n == pytest.approx(PUBLISHED_B[name], rel=0.01), (name, n)


@pytest.mark.parametrize("name,parts", [
    ("llama3-8b", {"self_attn", "mlp"}), ("mixtral-8x7b", {"self_attn"}), ("gemma3-1b", {"mlp"}),
    ("olmo2-7b", {"self_attn", "mlp"}), ("phi3-mini", {"self_attn", "mlp"}),
    ("pythia-6.9b", {"embed_in", "attention", "mlp"}), ("gpt-oss-20b", {"embed_tokens"}), ("stablelm-2-1.6b", {"mlp"}),
    ("deepseek-v3", {"mlp"}), ("qwen3-8b", {"self_attn", "mlp"}), ("qwen3-30b-a3b", {"self_attn"}), ("gpt2-xl", None),
    ("falcon-7b", None)])
def test_the_tensor_parallel_plan_is_transformers_own_in_torchs_styles(name, parts):
    """Transformers' plan for the family (Megatron's for Llama-style attention and MLPs; Phi-3's and OLMo 2's
    projections with their outputs gathered; GPT-NeoX's fused per-head projection; an embedding by rows), less
    what torch's styles cannot express (packed experts: Mixtral's MLP, DeepSeek's experts) and attention's head
    splits where 2 does not divide the heads (Gemma 3 1B's one key/value head); Qwen 3's per-head norms replicated
    with their gradient summed over the group; StableLM, without a transformers plan, gets Megatron's MLP; GPT-2
    and Falcon get none."""
    model = meta_model(name, num_hidden_layers=1)
    if parts is None:
        with pytest.raises(ValueError, match="no tensor-parallel plan fits"):
            llama_tensor_parallel_plan(model, 2)
        return
    plan = llama_tensor_parallel_plan(model, 2)
    assert {key.split(".")[3] if ".layers." in key else key.split(".")[-1] for key in plan} == parts, plan


@pytest.mark.multiproc
def test_every_family_trains_on_two_ranks_as_ddp_and_under_its_tensor_parallel_plan_as_eager(tmp_path):
    """One launch (tests/dist/hf_zoo_parity.py --layout dp,tp), each family's tiny config:

    * dp: 3 AdamW steps with clipping, compiled (DataParallel, fx) against torch DDP on 2 ranks: loss within 1e-4
      and every parameter within 2e-3 relative after every step;
    * tp: under its tensor-parallel plan over 2 ranks (the same batches on each), 3 SGD steps with clipping (whose
      update follows the gradient's scale; Qwen 3 with momentum, its buffers DTensors too), against the model
      trained eagerly in one process: loss within 1e-4, every gathered parameter within 2e-3 relative (Qwen 3's
      per-head q_norm / k_norm included: their gradient summed over the group). GPT-2 and Falcon have no plan (the
      error says so)."""
    run = launch.torchrun("hf_zoo_parity.py", "--layout", "dp,tp", nproc=2, out=tmp_path, timeout=900)
    for r in run.ranks:
        assert set(r) == {"dp", "tp"}, set(r)
        failed = {name: v.get("error", "on another rank") for name, v in r["dp"].items() if not v["ok"]}
        assert not failed and set(r["dp"]) == set(CONFIGS), failed
        failed = {name: v.get("error", "on another rank") for name, v in r["tp"].items() if not v["ok"]}
        assert set(r["tp"]) == set(CONFIGS) and set(failed) == {"gpt2-xl", "falcon-7b"}, failed
        assert all("no tensor-parallel plan fits" in e for e in failed.values()), failed


def test_deepseeks_latent_attention_plans_with_values_narrower_than_queries(tmp_path):
    """DeepSeek-V3's attention at its real width: 192-wide queries and keys, 128-wide values (a plan traces
    attention as the fused CPU kernel, which takes one head size: the values are padded and the output cut back;
    before, the output kept the queries' width and o_proj failed)."""
    import json

    from spmd_ort.plan.__main__ import main

    out = tmp_path / "plan.json"
    assert main(["--model", "deepseek-v3", "--layers", "1", "--world-size", "8", "--seq", "512", "--backend", "fx",
                 "--no-export", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["flops"] > 0 and not got["unpriced"], got["unpriced"]
