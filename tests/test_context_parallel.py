"""Context parallelism (``Parallel(cp=N)``, passes/context_parallel.py) on 2 gloo ranks against one-process eager on
the whole batch (tests/dist/cp_parity.py checks loss, parameters and AdamW state after every step, gradients clipped,
labels padded with -100, the user's own all-reduces beside each step); these tests check what it reports."""

from __future__ import annotations

import pytest

from helpers import assert_ort_report_clean
from test_data_parallel import ROOT, torchrun

SCRIPT = ROOT / "tests" / "dist" / "cp_parity.py"
pytestmark = pytest.mark.multiproc

CASES = [
    ("gpt", "fx", ""),  # nanoGPT: learned positions wpe(arange(T)), causal sdpa, tied head
    ("llama", "fx", ""),  # HF Llama: rotary tables, GQA, its own label shift, -100 labels
    # HF Llama with an attention_mask (a padded sequence): HF's explicit (B, 1, T, T) mask, cut to each rank's rows
    ("llama", "fx", "--mask"),
    ("gpt", "ort", "--vary-seq"),  # lengths 32, 48, 32, 48, 32: one program (the sequence symbolic), on ORT
    ("llama", "ort", ""),
    # 4 ranks: torchtitan's FSDP over dp_shard x cp (parameters sharded over all 4, compared whole), and DDP's
    # replicas of a cp pair on ORT; each replica passes its own batch, one-process eager on both
    ("gpt", "fx", "--dp=shard"),
    ("llama", "ort", "--dp=replicate"),
]


def case_args(model: str, backend: str, extra: str) -> str:
    """The case's options of tests/dist/cp_parity.py, as one --case string."""
    return " ".join(["--model", model, "--backend", backend] + ([extra] if extra else []))


@pytest.mark.on_ort
@pytest.mark.parametrize("nproc", [2, 4])
def test_matches_one_process_eager(tmp_path, nproc):
    """Every case of CASES on its ranks (4: the 2-D ones), all in one launch (each its own models and step)."""
    cases = [c for c in CASES if (nproc == 4) == c[2].startswith("--dp")]
    launched = [f"--case={case_args(*c)}" for c in cases]
    ranks, _ = torchrun(tmp_path, *launched, script=SCRIPT, timeout=900, nproc=nproc)
    for r in ranks:
        assert set(r) == {case_args(*c) for c in cases}, set(r)
    for model, backend, extra in cases:
        check_case([r[case_args(model, backend, extra)] for r in ranks], backend, extra)


def check_case(ranks: list, backend: str, extra: str) -> None:
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the mean loss over the batch's tokens, on both ranks of a pair
    for r in ranks:
        assert max(r["worst"].values()) < 2e-3, r["worst"]
        assert r["traces"] == 1, r["explain"]
        text = r["explain"]
        layout = {"": "Parallel(cp=2): mesh cp 2", "--dp=shard": "Parallel(dp_shard=2, cp=2): mesh dp_shard 2 x cp 2",
                  "--dp=replicate": "Parallel(dp_replicate=2, cp=2): mesh dp_replicate 2 x cp 2"
                  }.get(extra, "Parallel(cp=2): mesh cp 2")
        assert f"layout: {layout}" in text, text
        # torchtitan's balanced layout: rank r holds chunks r and 3 - r; causal attention block by block
        split = "0 causal block by block, 2 with their mask's rows" if extra == "--mask" else \
            "2 causal block by block, 0 with their mask's rows"
        assert "in 4 chunks" in text and f"2 attention op(s): {split}" in text, text
        # per step: one all-gather of K and one of V per layer, their gradients reduce-scattered; the
        # gradients' parts summed in one bucketed all-reduce, and the loss's sum and token count
        if extra != "--dp=shard":  # (fully_shard adds its parameters' gathers and gradients' reduce-scatters)
            assert "all-gather (forward): 4 call(s)" in text and "reduce-scatter: 4 call(s)" in text, text
            assert "all-reduce: 3 call(s)" in text, text
        if backend == "ort":
            assert_ort_report_clean(r["ort"])


def test_what_cannot_be_split_is_refused_on_every_rank(tmp_path):
    """A length that does not divide by 2 * cp names the input and the fix; attention written by hand (a softmax
    over the keys) names the op and what is supported; nothing changed in the model or optimizer."""
    ranks, _ = torchrun(tmp_path, "--refusals", script=SCRIPT)
    for r in ranks:
        assert "splits dim 1 of `x` into 4 equal chunks" in r["length"] and "does not divide by 4" in r["length"], r
        assert "a softmax along the sequence" in r["hand_attention"], r
        assert "F.scaled_dot_product_attention" in r["hand_attention"], r
