"""The default path, as users get it: ``spmd_ort.compile()`` with no options on one process.

The suite pins no executor (tests/conftest.py): a test that asserts ORT ran says so.  Here the step is compiled with
no option at all (the ORT backend, ``SPMD_ORT_SEGMENT_EXECUTOR=auto``, autotune on, dynamic ``auto``) and trained
beside eager, with real timings deciding: each segment's executor (ORT or fx, both timed on the checked first run),
the whole graph against its segments, and inductor's candidate (compiled, checked and timed against what runs;
kept when faster).  Every choice is asserted to be made and reported, no variant recompiles more than the policy
allows, and the numbers equal eager's every step, whichever executor won.  The 2-rank counterpart is
tests/test_data_parallel.py::test_the_default_path_agrees_across_ranks_and_matches_ddp.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import spmd_ort
from helpers import train_side_by_side, train_step
from models import GPT, GPTConfig
from spmd_ort import tuner
from spmd_ort.backends.inductor import cxx_compiler

STEPS = 8


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=1))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _batches(n, batch=4, seq=16, vocab=64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def test_the_suite_pins_no_executor():
    """The suite trains on the path users get; a test that needs ORT pins it itself (``@pytest.mark.on_ort``)."""
    assert "SPMD_ORT_SEGMENT_EXECUTOR" not in os.environ and "SPMD_ORT_AUTOTUNE" not in os.environ
    assert spmd_ort.Options().segment_executor == "auto" and spmd_ort.Options().autotune


@pytest.mark.skipif(cxx_compiler() is None, reason="inductor's candidate needs a C++ compiler")
def test_the_default_step_chooses_by_measurement_and_matches_eager(monkeypatch):
    """No option: every segment's executor is chosen from its own two timings, the whole graph against its
    segments, then inductor's candidate at its step; the step equals eager every step (per tensor: ORT's and
    inductor's kernels round differently from eager's) and at least 2 steps ran after the candidate's choice on
    whatever won.  The candidate's compile is predicted free, so it is bought after the 3 measured steady steps
    (step 5) rather than after minutes of them (bench/step.py measures the real ski rental)."""
    monkeypatch.setattr(tuner.CompileCost, "predict", classmethod(lambda cls, nodes: (0.0, "predicted free")))
    monkeypatch.setattr(tuner.CompileCost, "seconds_per_node", None)  # restored after the compile calibrates it
    compiled, _, _ = train_side_by_side(_gpt, _adamw, train_step, _batches(STEPS), backend=None, normwise=True,
                                        expect_clean_ort=False)
    assert len(compiled.variants) == 1  # one static program: no recompile was needed or made
    program = compiled.compiled
    ex = program.executor
    stats = ex.stats
    assert not stats.fallbacks and not stats.mismatches and stats.verified == stats.segments >= 1
    # each segment's choice: measured on both executors (real times), the faster kept
    assert set(stats.choices) == {seg.name for seg in ex.segments}
    for name, choice in stats.choices.items():
        assert choice.executor in ("ort", "fx") and choice.ort_ms > 0 and choice.fx_ms > 0, (name, choice)
        faster = "ort" if choice.ort_ms <= choice.fx_ms else "fx"
        assert choice.executor == faster, (name, choice)
    assert stats.whole is not None  # the whole graph against the segments as chosen (or fx: all chose fx)
    decisions = compiled.tuner.lines(program)
    steps = [int(m.group(1)) for d in decisions
             if (m := re.match(r"inductor candidate: compiled at step (\d+) and (?:kept|dropped)", d))]
    assert steps and steps[0] <= STEPS - 2, decisions  # bought, with 2 steps after it
    up = stats.upgrade
    assert up is not None and "inductor" in dict(up.times_ms), up
    if up.executor == "inductor":  # it won: every later step ran on it
        assert ex.runs == "inductor" and all(seg.runs >= 2 for seg in ex.inductor.segments)
    else:
        assert ex.inductor is None  # it lost and was freed
    assert all(n <= tuner.RECOMPILES_PER_VARIANT for n in compiled.tuner.recompiles.values()), decisions
    explained = compiled.explain()
    assert "decisions made from measurements" in explained and "inductor candidate: compiled at step" in explained
