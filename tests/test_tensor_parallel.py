"""Tensor parallelism (expand mode): compiled against eager DTensor tensor parallelism, on 2 gloo ranks.

The script (tests/dist/tp_parity.py) checks loss, parameters and optimizer state (local shards) against eager
``parallelize_module`` with the same plan after every step (gradients clipped over DTensor and plain
gradients), the loss against one-process eager, and an evaluation forward outside the step; these tests check
what it reports: the collectives against eager DTensor's (``CommDebugMode``), the bytes each rank holds, the
parameters' placements, and (``TensorParallel``) that a failed first call left the model as it was.  2-D (4 ranks,
dp x tp) is checked against eager tensor parallelism on the global batch (the dp replicas' batches together), and
with a bf16 ``MixedPrecisionPolicy`` against FSDP2 + TP under the same policy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import assert_ort_report_clean
from test_data_parallel import ROOT, torchrun

SCRIPT = ROOT / "tests" / "dist" / "tp_parity.py"
pytestmark = pytest.mark.multiproc

CASES = [
    ("fx", "mode", "megatron", 1),  # TensorParallel(plan) applied at the first call, after a failed one was undone
    # parallelize_module by the user, then parallel_mode=None; activation_memory_budget=0 (recompute under TP)
    ("ort", "user", "megatron", 1),
    # sequence parallel: all-gathers, reduce-scatters, partial gradients of norms; the logits sharded over the
    # vocabulary and the loss under torch's loss_parallel() (torchtitan's default), eagerly and compiled
    ("ort", "mode", "sequence", 1),
    # 2-D, 4 ranks (dp 2 x tp 2): DataParallel(replicate) on the dp dim, against eager TP on the global batch
    ("ort", "mode", "sequence", 2),
    # 2-D with a bf16 MixedPrecisionPolicy on the dp dim, against FSDP2 + TP with the same policy
    ("ort", "mode", "megatron", "2-mp"),
    # 2-D fully_shard (FSDP2 + TP): against FSDP2 + TP, parameters 2-D DTensors as FSDP2's, DCP into FSDP2 + TP and
    # a bitwise resume; sequence parallel on ORT
    ("fx", "mode", "megatron", "2-fully-shard"),
    ("ort", "mode", "sequence", "2-fully-shard"),
    # a DeepSpeed ZeRO-3 config with the plan (from_deepspeed_config(..., tensor_parallel_plan=, mesh=)): ZeRO on dp
    ("fx", "mode", "megatron", "2-deepspeed3"),
    # 2-D fully_shard with the bf16 policy: bf16 all-gathers on dp, against FSDP2 + TP with the same policy
    ("ort", "mode", "megatron", "2-mp-fully-shard"),
]


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_policies_gather_the_sequence_again_in_the_backward(tmp_path, policy):
    """torchtitan's checkpointing under sequence parallelism: each block's all-gathered input is not kept for the
    backward but gathered again there, as torchtitan's checkpoint does (the all-gather is recomputed like any op,
    every rank at the same point of the same graph); loss, parameters and optimizer state still match eager tensor
    parallelism each step, while a thread of the user's all-reduces runs beside each step after the first."""
    results, _ = torchrun(tmp_path, "--backend", "fx", "--apply", "mode", "--plan", "sequence", "--steps", "3",
                          "--dp", "1", "--user-collectives", nproc=2, script=SCRIPT,
                          env={"SPMD_ORT_ACTIVATION_MEMORY_BUDGET": policy})
    text = results[0]["describe"]
    assert f"activation_memory_budget={policy!r}" in text, text
    assert results[0]["recomputed_all_gathers"] > 0, text


VARY_SEQ = {("ort", "user", "megatron", 1), ("ort", "mode", "sequence", 1), ("fx", "mode", "megatron", "2-fully-shard")}


def case_options(case: tuple, dcp: Path) -> tuple[list[str], int, str]:
    """A case's options of the script (``dcp``: where it checkpoints, if it does), its ranks and its activation
    memory budget (the launch's environment)."""
    backend, apply, plan, dp = case
    vary_seq = case in VARY_SEQ
    mp, ds = dp in ("2-mp", "2-mp-fully-shard"), dp == "2-deepspeed3"
    fsdp = dp in ("2-fully-shard", "2-deepspeed3", "2-mp-fully-shard")
    dp = int(str(dp).split("-")[0])
    extra = ("--vary-batch", "--checkpoint", str(dcp)) if (backend, plan, dp) == ("fx", "megatron", 1) \
        else ("--checkpoint", str(dcp), "--fully-shard") if fsdp and not (ds or mp) and plan == "megatron" \
        else ("--deepspeed", "3") if ds else ("--fully-shard",) if fsdp else ()
    extra += ("--mp",) if mp else ()
    # sequence lengths 16, 12, 10(, 16, 12, 10): one static program, then one symbolic program for every later length (DTensor's
    # sharding propagation runs on the symbolic sizes; sequence parallel's shards of them included)
    extra += ("--vary-seq",) if vary_seq else ()
    # (with a thread of the user's all-reduces beside each step: loss parallel's max over the vocabulary shards is a
    # collective of ours, never the mesh's group the user shares)
    extra += ("--loss-parallel", "--user-collectives") if (plan, dp) == ("sequence", 1) else ()
    # the head's replicated matmuls (its weight gradient over the tokens, its input gradient over the vocabulary) are
    # below the default threshold in this small model: split them here, so every case runs them
    extra += ("--split-min-k", "16")
    budget = "0" if apply == "user" else "1"
    # dynamic shapes on ORT: lengths 16, 12, 10, 16, 12, 10, so that steps 5 and 6 train on ORT's outputs (the
    # symbolic program's first runs at its first 3 lengths are checked runs, whose outputs are fx's)
    steps = "6" if vary_seq and backend == "ort" else "3"
    return ["--backend", backend, "--apply", apply, "--plan", plan, "--steps", steps, "--dp", str(dp), *extra], \
        2 * dp, budget


def launch_groups(cases: list, size: int = 3) -> list[list]:
    """CASES by launch: those on as many ranks with the same activation budget, at most ``size`` a launch (one
    after the other in it, each its own meshes, models and step)."""
    by_key: dict = {}
    for case in cases:
        _, nproc, budget = case_options(case, Path())
        by_key.setdefault((nproc, budget), []).append(case)
    return [group[i:i + size] for group in by_key.values() for i in range(0, len(group), size)]


GROUPS = launch_groups(CASES)


@pytest.mark.on_ort
@pytest.mark.parametrize("group", GROUPS, ids=["-".join(map(str, g[0])) + (f"-and-{len(g) - 1}" if len(g) > 1 else "")
                                               for g in GROUPS])
def test_matches_eager_tensor_parallel(tmp_path, group):
    options = [case_options(case, tmp_path / f"dcp{i}") for i, case in enumerate(group)]
    launched = [" ".join(args) for args, _, _ in options]
    (_, nproc, budget), = {(0, n, b) for _, n, b in options}  # (one launch: the same ranks and budget)
    results, _ = torchrun(tmp_path, *[f"--case={case}" for case in launched], nproc=nproc, script=SCRIPT,
                          env={"SPMD_ORT_ACTIVATION_MEMORY_BUDGET": budget}, timeout=900)
    for r in results:
        assert set(r) == set(launched), set(r)
    for case, (args, _, _), key in zip(group, options, launched, strict=True):
        check_case(case, args, budget, [r[key] for r in results])


def check_case(case: tuple, extra: list, budget: str, results: list) -> None:
    backend, apply, plan, dp = case
    vary_seq = case in VARY_SEQ
    mp = dp in ("2-mp", "2-mp-fully-shard")
    fsdp = dp in ("2-fully-shard", "2-deepspeed3", "2-mp-fully-shard")
    dp = int(str(dp).split("-")[0])
    recomputed = "the backward recomputes" in results[0]["describe"]
    assert recomputed == (budget == "0"), results[0]["describe"]
    # batch sizes 4, 3, 2 (every step checked against eager inside the script): a static program for 4, then the
    # batch symbolic at 3; DTensor's propagation of the loss's reshape guards that the batch is odd (whether it
    # divides by the mesh), so 2 gets a static program, and the resume step reuses the batch-4 one; a DCP round
    # trip of the DTensor state, and a resume from spmd_ort.save_checkpoint that continues bit for bit
    if "--vary-batch" in extra:
        assert results[0]["traces"] == 3
    if vary_seq:
        assert results[0]["traces"] == 2
        # one ONNX model per segment serves every length (sequence parallel's shards: sizes read whole)
        assert "exported per set of sizes" not in results[0]["describe"], results[0]["describe"]
    for r in results:
        if backend == "ort":  # every segment on ORT, and at least 2 steps trained on its outputs, on every rank
            assert_ort_report_clean(r["ort"])
        # Megatron's plan leaves the head replicated: its weight gradient (rows: the vocabulary) and, but where the
        # tokens are symbolic, its input gradient (rows: the tokens) are split over the tp ranks, each rank computing
        # its share of the rows, each one all-gather more; sequence parallel's head is column-wise, not replicated
        split = r["split_matmuls"]
        assert split == (0 if plan == "sequence" else 1 if vary_seq else 2), (split, r["describe"])
        # the ranks of a TP group compute one model on one batch
        assert r["losses"] == results[r["tp"] * (results.index(r) // r["tp"])]["losses"]
        eager = {k.split(".")[-1]: n for k, n in r["eager_collectives"].items()}
        # the tp all-reduces of input gradients: one per activation the column-wise layers read (q, k and v's
        # summed first); bf16 ones (the MixedPrecisionPolicy) one per column-wise layer, as eager DTensor's
        backward = r["colwise"] if mp else r["colwise_inputs"]
        if fsdp:  # FSDP2 + TP's layout: each rank holds its dp piece of its tp piece, as FSDP2 + TP does
            replicated = r["full_param_bytes"] - r["sharded_param_bytes"]
            assert r["local_param_bytes"] == r["eager_local_param_bytes"] == (
                r["sharded_param_bytes"] // r["tp"] + replicated) // dp
            # on dp: the parameters gathered in one bucket for forward and one for backward, the gradients
            # reduce-scattered in one; on tp: what eager DTensor issues (sequence parallel: its gathers, scatters)
            assert r["all_gather_calls"] == 2 + eager.get("all_gather_into_tensor", 0) + split
            assert r["reduce_scatter_calls"] == 1 + eager.get("reduce_scatter_tensor", 0)
            if plan == "megatron":  # Megatron's, the tp norm's, and the dp shards' norm completion
                assert r["all_reduce_calls"] == r["rowwise"] + backward + 1 + 1
            assert r["placements"]["blocks.0.attn.q.weight"] == ["_S(0, 2)", "S(0)"]
            assert r["placements"]["blocks.1.out.weight"] == ["S(0)", "S(1)"]
            assert r["placements"]["blocks.1.ln1.weight"] == (["S(0)"] if plan == "megatron" else ["S(0)", "R"])
            continue
        if mp:  # eager is FSDP2 + TP (all-gathers and reduce-scatters over dp); ours: Megatron's + one dp bucket
            assert r["all_reduce_calls"] == r["rowwise"] + backward + 1 + 1
            assert r["all_gather_calls"] == split and r["reduce_scatter_calls"] == 0
        elif plan == "megatron":
            # eager DTensor: one all-reduce per row-wise layer forward and per column-wise layer backward, and the
            # gradient norm's; the compiled step: one per activation the column-wise layers read (q, k and v's
            # input gradients summed, then all-reduced once) (2-D: and the gradients' over dp, one bucket)
            assert eager["all_reduce"] == r["rowwise"] + r["colwise"] + 1
            assert r["all_reduce_calls"] == r["rowwise"] + r["colwise_inputs"] + 1 + (dp > 1)
            assert r["all_gather_calls"] == split and r["reduce_scatter_calls"] == 0
            assert set(eager) == {"all_reduce"}
        else:
            assert r["all_gather_calls"] == eager["all_gather_into_tensor"] > 0
            assert r["reduce_scatter_calls"] == eager["reduce_scatter_tensor"] > 0
            # eager reduces a norm's partial gradient in each foreach op of clipping and AdamW that reads it; the
            # compiled step once (the duplicates are one collective after dedup)
            assert r["all_reduce_calls"] < eager["all_reduce"]
        # each rank holds its shard of the sharded parameters and all of the replicated ones
        replicated = r["full_param_bytes"] - r["sharded_param_bytes"]
        assert r["local_param_bytes"] == r["sharded_param_bytes"] // r["tp"] + replicated
        assert r["optimizer_params_are_dtensors"] == sum(1 for p in r["placements"].values() if p)
        assert r["placements"]["blocks.0.attn.q.weight"] == ["S(0)"]
        assert r["placements"]["blocks.1.out.weight"] == ["S(1)"]
        assert r["placements"]["blocks.1.ln1.weight"] == ([] if plan == "megatron" else ["R"])
    assert "adopt_dtensor_collectives_pass" in results[0]["describe"]


def test_the_users_collectives_never_pair_with_ours(tmp_path):
    """2-D (tp 2 x fully_shard 2, 4 ranks): while each compiled step after the first runs, a thread of the user's
    all-reduces on the default group; the step's collectives run on groups of ours beside each mesh dimension's
    (every rank makes every dp and tp twin together), so every step equals FSDP2 + TP (checked in the script).
    The first call lays the model out with torch's parallelize_module on the mesh's own groups (docs)."""
    results, _ = torchrun(tmp_path, "--steps", "3", "--dp", "2", "--fully-shard", "--user-collectives", nproc=4,
                          script=SCRIPT)
    assert len(results) == 4

