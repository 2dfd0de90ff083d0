"""Pipeline parallelism (``Parallel(pp=N, pipeline=Pipeline(...))``, passes/pipeline_parallel.py).

On 2 gloo ranks, tests/dist/pp_parity.py trains one copy of a model per schedule against one-process eager on the
whole batch: the loss every step, and every parameter and AdamW state tensor each rank steps after 6 steps with
clipping (the user's own all-reduces beside each step).  The schedules' tables and bubbles are checked here
against the closed forms.
"""

from __future__ import annotations

import pytest

from helpers import assert_ort_report_clean
from test_data_parallel import ROOT, torchrun

import spmd_ort
from spmd_ort.distributed.stages import PipelineParallel, simulate

SCRIPT = ROOT / "tests" / "dist" / "pp_parity.py"
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b")


@pytest.mark.multiproc
def test_every_schedule_trains_as_one_process_eager(tmp_path):
    """A 4-block GPT with a tied head, pp=2, 4 micro-batches of 2: each schedule (interleaved: 2 stages per rank)
    trains as eager on the batch of 8, whose labels are padded unevenly (the mean over counted targets weighs each
    micro-batch by its count), and 1F1B on a summed loss; both ranks together step every parameter, each once;
    after the first, the whole model as eager's on every rank (full_state_dict) and a DCP checkpoint loaded into a
    fresh model whose next step is eager's; then the refusals: a batch the micro-batches do not divide, a split naming no module (a ConfigError on both
    ranks), rank 1 passing another batch (a DifferentBatchError on both), a token past the vocabulary that only
    stage 0 embeds (an InputIndexError on both: the stages' checks agree after the micro-batches, before any
    update), the model and optimizer untouched."""
    ranks, _ = torchrun(tmp_path, "--schedules", ",".join(SCHEDULES + ("1f1b+sum",)), "--refusals", "--checkpoint",
                        script=SCRIPT, timeout=600)
    stepped = [set(r[s]["stepped"]) for r in ranks for s in ("1f1b",)]
    assert not stepped[0] & stepped[1] and len(stepped[0] | stepped[1]) == 48, stepped  # every parameter, once
    for r in ranks:
        for schedule in SCHEDULES:
            case = r[schedule]
            assert case["losses"] == ranks[0][schedule]["losses"]  # the batch's mean loss, on every rank
            assert max(case["worst"].values()) < 2e-3, case["worst"]
            assert case["traces"] == 1, case["explain"]
            assert case["bubble"] == simulate(schedule, 2, 4, 2 if schedule == "interleaved_1f1b" else 1).bubble
            assert "layout: Parallel(pp=2): mesh pp 2" in case["explain"], case["explain"]
            assert f"schedule {schedule}: bubble" in case["explain"], case["explain"]
            assert "rank 0: F0" in case["explain"] and "rank 1: ." in case["explain"], case["explain"]
        assert max(r["1f1b+sum"]["worst"].values()) < 2e-3, r["1f1b+sum"]["worst"]
        ckpt = r["checkpoint"]  # every stage's parameters, though each rank steps only its own
        assert ckpt["full_state_dict"] < 2e-3 and ckpt["loaded"] < 2e-3, ckpt
        assert abs(ckpt["resumed_loss"][0] - ckpt["resumed_loss"][1]) < 1e-4, ckpt
        # stage 1 begins at blocks.2; the tied head's weight is stepped where the embedding reads it (stage 0)
        assert "stage 1 from blocks.2" in r["1f1b"]["lines"][0]
        assert ("wte.weight" in r["1f1b"]["stepped"]) == (r is ranks[0])
        refused = r["refusals"]
        assert "`x` has 4 rows (dim 0), which 3 micro-batches do not divide" in refused["indivisible"], refused
        assert "ConfigError: Pipeline(split=[..., 'blocks.9', ...]) names no module of GPT" in refused["no_module"]
        assert "ConfigError" in refused["indivisible"], refused
        assert refused["bad_index"].startswith("InputIndexError: ") and "71" in refused["bad_index"], refused
        assert refused["different_batch"].startswith("DifferentBatchError: rank 0 and rank 1 of one pipeline group "
                                                     "pass different values for `x`"), refused


@pytest.mark.multiproc
def test_two_pipelines_of_two_stages_train_as_eager_on_both_batches(tmp_path):
    """``Parallel(pp=2, dp_replicate=2)`` on 4 ranks, the mesh (pp, dp): each pipeline passes its own batch, the
    ranks holding one stage average its gradients (one all-reduce each), clipping over each pipeline's stages;
    against one process stepping on the mean of the two batches' losses (DDP's gradient), 1F1B and zero bubble."""
    ranks, _ = torchrun(tmp_path, "--dp", "2", "--schedules", "1f1b,zero_bubble", script=SCRIPT, timeout=600, nproc=4)
    for r, result in enumerate(ranks):
        for schedule in ("1f1b", "zero_bubble"):
            case = result[schedule]
            assert case["losses"] == ranks[r % 2][schedule]["losses"], r  # a pipeline's loss, on its ranks
            assert max(case["worst"].values()) < 2e-3, case["worst"]
            assert "layout: Parallel(pp=2, dp_replicate=2): mesh pp 2 x dp_replicate 2" in case["explain"]
    assert ranks[0]["1f1b"]["losses"] != ranks[1]["1f1b"]["losses"]  # (two batches)


@pytest.mark.multiproc
@pytest.mark.on_ort
def test_hf_llama_with_a_balanced_split_trains_on_ort(tmp_path):
    """HF LlamaForCausalLM (untied head, rotary tables, GQA, its own label shift) with split=None: the stages
    balanced by the forward's FLOPs, zero bubble, its segments on ONNX Runtime; 6 steps as eager."""
    ranks, _ = torchrun(tmp_path, "--model", "llama", "--split", "none", "--backend", "ort",
                        "--schedules", "zero_bubble", script=SCRIPT, timeout=900)
    for r in ranks:
        case = r["zero_bubble"]
        assert max(case["worst"].values()) < 2e-3, case["worst"]
        assert "stage 1 from model.layers.2" in case["lines"][0], case["lines"]
        assert_ort_report_clean(case["ort"])


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8)])
def test_bubbles_are_the_closed_forms(pp, m):
    """On unit costs (a backward twice a forward): GPipe's and 1F1B's bubble is (pp-1)/(m+pp-1); zero bubble,
    whose W's fill it, is smaller; every rank runs each micro-batch's F and B once per stage, and W's only with
    zero bubble."""
    for name in ("gpipe", "1f1b"):
        assert simulate(name, pp, m).bubble == pytest.approx((pp - 1) / (m + pp - 1))
    assert simulate("zero_bubble", pp, m).bubble < simulate("1f1b", pp, m).bubble
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)):
        schedule = simulate(name, pp, m, v)
        for r, actions in enumerate(schedule.actions):
            kinds = "FBW" if name == "zero_bubble" else "FB"
            assert sorted((a.kind, a.stage, a.micro) for a in actions) == sorted(
                (k, s, mb) for k in kinds for s in range(r, pp * v, pp) for mb in range(m))
    # 1F1B holds at most pp - r micro-batches' activations on rank r; GPipe all of them
    for r, actions in enumerate(simulate("1f1b", pp, m).actions):
        held = peak = 0
        for a in actions:
            held += {"F": 1, "B": -1}[a.kind]
            peak = max(peak, held)
        assert peak == min(pp - r, m)


def test_the_plan_names_the_fastest_schedule(tmp_path, capsys):
    """``python -m spmd_ort.plan --parallel pp:2 --schedule best``: a tiny Llama (the meta device, a fake world of
    2 ranks) planned with every schedule, each priced by its graph's F, B and W on the schedule's time line; the
    one named is the fastest predicted, and the interleaved one runs 4 stages."""
    import re

    import transformers

    from spmd_ort.plan.__main__ import main

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    assert main(["--model", f"hf:{tmp_path / 'config.json'}", "--world-size", "2", "--parallel", "pp:2",
                 "--schedule", "best", "--microbatches", "4", "--batch", "4", "--seq", "32", "--no-export",
                 "--no-cache"]) == 0
    out = capsys.readouterr().out
    predicted = {name: float(ms) for name, ms in re.findall(r"^(\w+): predicted step ([\d.]+) ms", out, re.M)}
    assert set(predicted) == set(SCHEDULES), out
    chosen = re.search(r"^chosen: (\w+) \(4 micro-batches\)", out, re.M).group(1)
    assert predicted[chosen] == min(predicted.values()), out
    assert f"pipeline parallel 2 ({chosen}, 4 micro-batches)" in out, out
    assert "4 stages over 2 ranks" in out or chosen != "interleaved_1f1b", out


def test_the_table_of_1f1b_on_two_ranks():
    assert simulate("1f1b", 2, 4).table() == [
        "rank 0: F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3",
        "rank 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  . "]


def test_layouts_are_checked_before_anything_is_traced():
    with pytest.raises(spmd_ort.ConfigError, match="interleaving needs stages_per_rank >= 2"):
        spmd_ort.Pipeline(schedule="interleaved_1f1b")
    with pytest.raises(spmd_ort.ConfigError, match="one of gpipe, 1f1b"):
        spmd_ort.Pipeline(schedule="dualpipe")
    with pytest.raises(spmd_ort.ConfigError, match=r"pipeline=\.\.\.\) needs pp > 1"):
        spmd_ort.Parallel(pipeline=spmd_ort.Pipeline())
    with pytest.raises(spmd_ort.ConfigError, match="pipeline parallelism with dp_shard is not built"):
        spmd_ort.Parallel(pp=2, dp_shard=2)
    mode = spmd_ort.Parallel(pp=2, dp_replicate=-1).lower(8)
    assert isinstance(mode, PipelineParallel) and (mode.pp, mode.dp) == (2, 4)
    assert mode.groups(8) == [[0, 4], [1, 5], [2, 6], [3, 7]] and mode.peer(1, 6) == 6 and mode.peer(0, 6) == 2
    mode = spmd_ort.Parallel(pp=2, pipeline=spmd_ort.Pipeline(microbatches=8, split=["blocks.2"])).lower(2)
    assert isinstance(mode, PipelineParallel) and mode.stages == 2 and mode.pipeline.split == ("blocks.2",)
    assert spmd_ort.Parallel.of(mode, 2) == spmd_ort.Parallel(pp=2, pipeline=mode.pipeline)
