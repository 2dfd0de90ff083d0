"""The tuner (spmd_ort.tuner): every choice made from measurements after compile, shown by explain(); the static
choices with SPMD_ORT_AUTOTUNE=0; the recompile budget; inductor's candidate bought only once the steady steps
have spent its predicted compile.  Every run's numbers are eager's."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

import spmd_ort
from helpers import train_side_by_side, train_step
from models import MLP
from spmd_ort import tuner
from spmd_ort.capture.transition import TransitionManager
from spmd_ort.distributed.parallel import AUTO_START_MB
from spmd_ort.options import Options


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def _fix_times(monkeypatch, ort_s: float, fx_s: float) -> None:
    """The first run's timings of a segment, fixed (ORT's through ``fastest``, fx's through ``timed_fx_runs``)."""
    from spmd_ort.backends.ort import choice

    monkeypatch.setattr(choice, "fastest", lambda run, args, first: ort_s if run.__name__ == "run_ort" else fx_s)
    monkeypatch.setattr(choice, "timed_fx_runs", lambda run, args, repeat: (fx_s, run(*args)))


class Clock:
    """A virtual clock: every reading is ``step`` seconds after the last (a step, from before_run to after_run,
    takes ``step``)."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_the_default_path_records_each_decision_and_explain_shows_it(monkeypatch):
    """SPMD_ORT_AUTOTUNE=1 and SPMD_ORT_SEGMENT_EXECUTOR unset (the default outside the suite's pin): the
    segment's executor (timings fixed: fx faster), the whole graph (every segment chose fx) and inductor's
    candidate (predicted to cost 1000 s: deferred on this short run, never compiled) are listed by explain()
    with the numbers behind them."""
    monkeypatch.delenv("SPMD_ORT_SEGMENT_EXECUTOR", raising=False)
    monkeypatch.delenv("SPMD_ORT_AUTOTUNE", raising=False)
    _fix_times(monkeypatch, ort_s=2e-3, fx_s=1e-3)
    monkeypatch.setattr(tuner.CompileCost, "predict", classmethod(lambda cls, nodes: (1000.0, f"{nodes} nodes")))
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _batches(5), backend="auto", expect_clean_ort=False)
    assert compiled.options.autotune and compiled.options.segment_executor == "auto"
    text = compiled.explain()
    block = text.split("decisions made from measurements (spmd_ort.tuner):")[1]
    assert "segment fused_0: fx (ort 2.00 ms vs fx 1.00 ms)" in block
    assert re.search(r"whole graph: (fx|ort) \(ort [\d.]+ ms; fx [\d.]+ ms\)", block), block
    assert re.search(r"whole graph: (fx|ort) (final after 3 steady steps|lost to)", block), block
    assert re.search(r"inductor candidate: deferred until step \d+ \(until [\d.]+ s of steady steps at [\d.]+ "
                     r"ms/step; predicted compile 1000\.0 s: \d+ nodes\)", block), block
    ex = compiled.compiled.executor
    assert ex.stats.upgrade is None and ex.candidate_source is not None  # never compiled: the run was short
    assert not compiled.tuner.recompiles


@pytest.mark.parametrize("how", ["env", "compile"])
def test_autotune_off_gives_the_static_choices(monkeypatch, how):
    """Every segment ORT supports runs on ORT, no whole-graph choice, no inductor candidate, no recompiles."""
    monkeypatch.delenv("SPMD_ORT_SEGMENT_EXECUTOR", raising=False)
    kwargs = {}
    if how == "env":
        monkeypatch.setenv("SPMD_ORT_AUTOTUNE", "0")
    else:
        monkeypatch.delenv("SPMD_ORT_AUTOTUNE", raising=False)
        kwargs["autotune"] = False
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _batches(4), backend="ort", **kwargs)
    assert not compiled.options.autotune and compiled.options.segment_executor == "ort"
    ex = compiled.compiled.executor
    assert ex.stats.choices and all(c.executor == "ort" and c.ort_ms is None for c in ex.stats.choices.values())
    assert ex.stats.whole is None and ex.whole is None and ex.runs == "segments"
    assert ex.candidate_source is None and ex.stats.upgrade is None
    assert compiled.tuner.decisions == [] and not compiled.tuner.recompiles
    block = compiled.explain().split("decisions made from measurements (spmd_ort.tuner):")[1]
    assert "autotune: off" in block and "segment fused_0: ort (static: SPMD_ORT_SEGMENT_EXECUTOR=ort)" in block
    assert "inductor candidate" not in block


def test_autotune_off_resolves_static_options():
    assert Options.resolve(environ={"SPMD_ORT_AUTOTUNE": "0"}).segment_executor == "ort"
    assert Options.resolve(environ={"SPMD_ORT_AUTOTUNE": "0", "SPMD_ORT_SEGMENT_EXECUTOR": "fx"}).segment_executor \
        == "fx"  # a static choice asked for stays
    assert Options.resolve(environ={}).autotune and Options.resolve(environ={}).segment_executor == "auto"
    assert not Options.resolve(environ={"SPMD_ORT_AUTOTUNE": "1"}, autotune=False).autotune
    with pytest.raises(spmd_ort.ConfigError, match="SPMD_ORT_AUTOTUNE"):
        Options.resolve(environ={"SPMD_ORT_AUTOTUNE": "maybe"})
    # bucket_cap_mb='auto' without autotune: the static starting cap, never measured
    mode = spmd_ort.DataParallel()
    off = tuner.Tuner(Options.resolve(environ={}, autotune=False), "t", TransitionManager("t"), None)
    assert off.bucket_mode(mode, torch.nn.Linear(2, 2)).bucket_cap_mb == AUTO_START_MB


def test_at_most_one_tuner_recompile_per_variant(caplog):
    dropped = []
    runtime = SimpleNamespace(comm=SimpleNamespace(drop_carried=lambda: dropped.append(True)))
    transitions = TransitionManager("step")
    t = tuner.Tuner(Options.resolve(environ={}), "step", transitions, runtime)
    a, b = SimpleNamespace(key="a"), SimpleNamespace(key="b")
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        assert t.recompile(a, "bucket_cap_mb='auto' chose 4 MiB buckets")
        assert not t.recompile(a, "another reason")  # the budget of variant a is spent
        assert t.recompile(b, "bucket_cap_mb='auto' chose 4 MiB buckets")
    assert t.recompiles == {"a": 1, "b": 1} and len(dropped) == 2
    assert [d.choice for d in t.decisions] == ["every variant compiles anew", "refused", "every variant compiles anew"]
    assert "recompile: every variant compiles anew (bucket_cap_mb='auto' chose 4 MiB buckets)" in caplog.text
    assert "recompile: refused (another reason; this variant's budget of 1 tuner recompile is spent)" in caplog.text
    off = tuner.Tuner(Options.resolve(environ={}, autotune=False), "step", transitions, runtime)
    assert not off.recompile(a, "anything")  # autotune off: no recompiles at all


needs_cxx = pytest.mark.skipif(
    __import__("spmd_ort.backends.inductor", fromlist=["cxx_compiler"]).cxx_compiler() is None,
    reason="inductor's CPU code needs a C++ compiler")


@needs_cxx
@pytest.mark.parametrize("steps", [6, 9])
def test_the_inductor_candidate_waits_until_the_steady_steps_paid_its_predicted_compile(monkeypatch, steps):
    """A virtual clock makes each step 1 s and the compile is predicted at 6 s: after the 3 measured steady
    steps (runs 2-4) the candidate is due once 6 steady steps ran (before run 8).  A 6-step run never compiles
    it; a 9-step run compiles it before its 8th and times it against what runs.  Numbers are eager's."""
    monkeypatch.delenv("SPMD_ORT_SEGMENT_EXECUTOR", raising=False)
    monkeypatch.delenv("SPMD_ORT_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuner, "now", Clock(1.0))
    monkeypatch.setattr(tuner.CompileCost, "predict", classmethod(lambda cls, nodes: (6.0, f"{nodes} nodes")))
    monkeypatch.setattr(tuner.CompileCost, "seconds_per_node", None)  # restored after calibrate() sets it
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _batches(steps), backend="auto",
                                        expect_clean_ort=False, dynamic=False)
    ex = compiled.compiled.executor
    decided = [str(d) for d in compiled.tuner.decisions if d.subject == "inductor candidate"]
    assert decided[0].startswith("inductor candidate: deferred until step 7 (until 6.0 s of steady steps at "
                                 "1000.0 ms/step; predicted compile 6.0 s")
    if steps == 6:
        assert ex.stats.upgrade is None and ex.candidate_source is not None and len(decided) == 1
    else:
        assert ex.stats.upgrade is not None and ex.stats.upgrade_step == 8 and ex.candidate_source is None
        assert re.match(r"inductor candidate: compiled at step 8 and (kept|dropped) \(compile [\d.]+ s for \d+ "
                        r"nodes; \w+ [\d.]+ ms, inductor [\d.]+ ms\)", decided[1]), decided
        assert tuner.CompileCost.seconds_per_node is not None  # calibrated by this compile
        assert "inductor candidate: compiled at step 8" in compiled.explain()
