"""The automatic choice remembered across runs (spmd_ort.backends.ort.remembered): a second run of the same program
starts on the first run's choices without timing anything, still checks every ORT segment, trains to eager's
numbers on ORT's outputs; an entry that does not read is measured again and rewritten; inductor's candidate is
never compiled again where it lost, and compiled at the first steady step where it was kept; ranks holding
different entries all measure afresh."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_ort_report_clean, ort_report, train_side_by_side, train_step
from launch import torchrun
from models import MLP
from spmd_ort import tuner
from spmd_ort.backends.ort import choice, executor as ort_executor
from spmd_ort.backends.ort.stats import WholeChoice


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def _remember(monkeypatch, cache) -> None:
    """The user's default (the suite turns remembering off): the automatic choice, its decisions in ``cache``;
    inductor's candidate predicted too dear to compile on these short runs."""
    monkeypatch.setenv("SPMD_ORT_REMEMBER_CHOICES", "1")
    monkeypatch.setenv("SPMD_ORT_CACHE_DIR", str(cache))
    monkeypatch.delenv("SPMD_ORT_SEGMENT_EXECUTOR", raising=False)
    monkeypatch.delenv("SPMD_ORT_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuner.CompileCost, "predict", classmethod(lambda cls, nodes: (1e6, f"{nodes} nodes")))


@pytest.fixture
def remembering(monkeypatch, tmp_path):
    _remember(monkeypatch, tmp_path)
    return tmp_path / "choices"


def _measured_ort_faster(monkeypatch):
    """The first run's timings fixed: ORT faster than fx for the segment, the segments faster than fx whole."""
    def whole(runners, inputs, stats, field="whole"):
        setattr(stats, field, WholeChoice("segments", (("segments", 1.0), ("fx", 2.0))))
        return "segments"

    monkeypatch.setattr(choice, "fastest", lambda run, args, first: 1e-3)
    monkeypatch.setattr(choice, "timed_fx_runs", lambda run, args, repeat: (2e-3, run(*args)))
    monkeypatch.setattr(ort_executor, "choose_whole", whole)


def _no_timing(monkeypatch):
    """Any timing run fails the test: the second run must time nothing."""
    def timed(*args, **kwargs):
        raise AssertionError("a remembered choice was timed again")

    def fx_once(run, args, repeat):
        assert not repeat, "a remembered segment's fx graph was timed again"
        return 0.0, run(*args)

    monkeypatch.setattr(choice, "fastest", timed)
    monkeypatch.setattr(choice, "timed_fx_runs", fx_once)
    monkeypatch.setattr(ort_executor, "choose_whole", timed)


def _train(steps: int = 4):
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _batches(steps), backend="auto",
                                        expect_clean_ort=False, dynamic=False)
    return compiled


def test_a_second_run_starts_on_the_first_runs_choices_checked_and_untimed(remembering, monkeypatch):
    _measured_ort_faster(monkeypatch)
    first = _train()
    (entry,) = remembering.glob("*.json")
    data = json.loads(entry.read_text())
    assert data["segments"] == {"fused_0": {"executor": "ort", "ort_ms": 1.0, "fx_ms": 2.0}}, data
    assert data["whole"] == {"executor": "segments", "times_ms": [["segments", 1.0], ["fx", 2.0]]}, data
    assert "remembered" not in first.explain()

    monkeypatch.undo()  # (the fixture's settings again, without the fixed timings)
    _remember(monkeypatch, remembering.parent)
    _no_timing(monkeypatch)
    second = _train()  # eager's numbers every step (train_side_by_side), and steps 2-4 on ORT's outputs:
    assert_ort_report_clean(ort_report(second), trained=3)  # the segment checked on its first run, then ORT's
    block = second.explain().split("decisions made from measurements (spmd_ort.tuner):")[1]
    assert "segment fused_0: ort (ort 1.00 ms vs fx 2.00 ms, remembered from an earlier run)" in block, block
    assert "whole graph: segments (segments 1.00 ms; fx 2.00 ms, remembered from an earlier run)" in block, block
    assert [p.name for p in remembering.glob("*.json")] == [entry.name]


@pytest.mark.parametrize("damage", ["garbage", "another partition"])
def test_an_entry_that_does_not_read_is_measured_again_and_rewritten(remembering, monkeypatch, damage):
    _measured_ort_faster(monkeypatch)
    _train(2)
    (entry,) = remembering.glob("*.json")
    good = json.loads(entry.read_text())
    if damage == "garbage":
        entry.write_text('{"format": 1, "names": ["fused_0"], "segm')
    else:
        entry.write_text(json.dumps({**good, "names": ["fused_0", "fused_1"]}))
    again = _train(2)
    assert "remembered" not in again.explain()  # measured afresh (the fixed timings)
    assert json.loads(entry.read_text()) == good


def _first_run_then(remembering, monkeypatch, outcome: str, detail: str):
    """A first run's entry, with the tuner's verdict on inductor's candidate written into it."""
    _measured_ort_faster(monkeypatch)
    _train(2)
    (entry,) = remembering.glob("*.json")
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "inductor": {"outcome": outcome, "detail": detail}}))
    return entry


def test_inductor_is_not_compiled_again_where_it_lost(remembering, monkeypatch):
    _first_run_then(remembering, monkeypatch, "dropped", "segments 1.00 ms, inductor 3.00 ms")
    monkeypatch.setattr(tuner, "_compile_candidate", lambda *a: pytest.fail("inductor compiled again"))
    compiled = _train(4)
    decided = [str(d) for d in compiled.tuner.decisions if d.subject == "inductor candidate"]
    assert decided == ["inductor candidate: not compiled (it dropped in an earlier run of this program (segments "
                       "1.00 ms, inductor 3.00 ms), remembered)"], decided
    assert compiled.compiled.executor.candidate_source is None


def test_inductor_is_compiled_at_the_first_steady_step_where_it_was_kept(remembering, monkeypatch):
    """A kept candidate (its compile predicted at a million seconds: never bought on this run otherwise) is
    compiled before the second run; here it fails to compile (made to), and that is remembered in its place."""
    entry = _first_run_then(remembering, monkeypatch, "kept", "segments 3.00 ms, inductor 1.00 ms")
    tried = []
    monkeypatch.setattr(tuner, "_compile_candidate", lambda whole, options: tried.append(whole) and None)
    compiled = _train(3)
    assert len(tried) == 1
    decided = [str(d) for d in compiled.tuner.decisions if d.subject == "inductor candidate"]
    assert decided == ["inductor candidate: due at step 2 (it was kept in an earlier run of this program "
                       "(segments 3.00 ms, inductor 1.00 ms), remembered)",
                       "inductor candidate: failed to compile (at step 2)"], decided
    assert json.loads(entry.read_text())["inductor"] == {"outcome": "failed", "detail": "it failed to compile"}


def test_ranks_with_different_entries_measure_afresh(tmp_path):
    """2 gloo ranks, each with its own cache: a first run writes both, the second recalls both; then rank 1's
    entry is damaged and the third run measures afresh on both ranks (neither uses a choice the other lacks),
    each run trained to DDP's numbers."""
    run = torchrun("remembered_choices.py", out=tmp_path, timeout=240, env={"SPMD_ORT_VERIFY": "1"})
    assert run.ranks[0]["runs"] == ["fresh fresh", "recalled recalled", "fresh fresh"], run.output[-3000:]


def test_the_graph_digest_names_a_graph_by_its_ops_and_constants_of_any_dtype():
    """The key of remembered choices, exported models and inductor's lock: the same graph twice has one digest;
    a constant's values or dtype (bfloat16 too, which numpy lacks) change it; a planned graph's meta constants
    have one by shape and dtype."""
    from torch import fx

    from spmd_ort.backends.files import graph_digest

    class Plus(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.register_buffer("c", c)

        def forward(self, x):
            return x + self.c

    def digest(c):
        return graph_digest(fx.symbolic_trace(Plus(c)))

    ones = torch.ones(3)
    assert digest(ones) == digest(ones.clone())
    assert len({digest(ones), digest(torch.zeros(3)), digest(ones.bfloat16()), digest(ones.to("meta"))}) == 4
