"""spmd_ort.debug: activation statistics of eager and compiled runs, the divergence finder, explain(), profile()."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import spmd_ort
from spmd_ort.debug import (GlobalSubscriberManager, StatisticsSubscriber, first_divergence, inspect_activation,
                                load_run)
from helpers import assert_ran_on_ort, train_step


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 64)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = self.act2(self.fc2(self.act(self.fc1(x))))
        return self.head(inspect_activation("hidden", h))  # an intermediate, marked by name


class TanhGelu(spmd_ort.Override):
    """Swaps the exact GELU of `act` for its tanh approximation: a small, real change to find."""

    def replacement(self, fqn, orig):
        return nn.GELU(approximate="tanh") if fqn == "act" else orig

    def transform(self, gm, flat_state):
        return gm


STEPS = 4


def _train(kind: str, out, **compile_kwargs):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sub = StatisticsSubscriber(out, override_output_dir=True)
    GlobalSubscriberManager.subscribe(model, [sub])
    step = train_step if kind == "eager" else spmd_ort.compile(backend=kind, **compile_kwargs)(train_step)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(STEPS):
            step(model, opt, torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
        GlobalSubscriberManager.flush()
    finally:
        GlobalSubscriberManager.unsubscribe(model)
    return step


def _compare_cli(a, b) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spmd_ort.debug.compare", str(a), str(b)], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def eager_stats(tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "eager"
    _train("eager", out)
    return out


def test_eager_statistics_files(eager_stats):
    run = load_run(eager_stats)
    assert sorted(run) == list(range(STEPS))
    assert [a.name for a in run[0]] == ["fc1", "act", "fc2", "act2", "hidden", "head"]  # execution order
    act = run[0][1]
    assert act.shape == "(16, 64)" and act.dtype == "torch.float32"
    assert act.stats["nan"] == act.stats["inf"] == 0 and act.stats["min"] < 0 < act.stats["max"]
    relu = run[0][3]
    assert relu.stats["min"] == 0 and relu.stats["zero"] > 0  # ReLU's zeros counted


def test_compiled_fx_statistics_equal_eager_bit_for_bit(eager_stats, tmp_path):
    _train("fx", tmp_path / "fx")
    a, b = load_run(eager_stats), load_run(tmp_path / "fx")
    assert first_divergence(a, b, rtol=0.0) is None  # the same aten ops on the same values


@pytest.mark.on_ort
def test_compiled_ort_statistics_show_no_divergence(eager_stats, tmp_path):
    step = _train("ort", tmp_path / "ort")
    assert_ran_on_ort(step)  # the statistics were computed inside the ORT segment
    out = _compare_cli(eager_stats, tmp_path / "ort")
    assert out.returncode == 0 and out.stdout.strip() == f"no divergence ({STEPS} steps, 6 activations)", out


def test_a_changed_module_is_named_at_step_0(eager_stats, tmp_path):
    _train("fx", tmp_path / "tanh", module_override=[TanhGelu()])
    out = _compare_cli(eager_stats, tmp_path / "tanh")
    assert out.returncode == 1, out
    assert out.stdout.startswith("first divergence: step 0, act, "), out.stdout


def test_merge_writes_side_by_side_summaries(eager_stats, tmp_path):
    _train("fx", tmp_path / "fx")
    out = subprocess.run([sys.executable, "-m", "spmd_ort.debug.merge_activation_summary", "--pt_dir",
                          str(eager_stats), "--ort_dir", str(tmp_path / "fx"), "--output_dir", str(tmp_path / "merged")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"wrote {STEPS * 6} side-by-side" in out.stdout, out
    text = (tmp_path / "merged" / "step_2" / "00001_act.txt").read_text()
    assert text.startswith("name: act") and "mean" in text and "|diff|" in text


def test_step_window_and_existing_directory(tmp_path):
    torch.manual_seed(0)
    model = Net()
    sub = StatisticsSubscriber(tmp_path / "window", start_step=1, end_step=3)
    GlobalSubscriberManager.subscribe(model, [sub])
    step = spmd_ort.compile(backend="fx")(train_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    GlobalSubscriberManager.flush()
    GlobalSubscriberManager.unsubscribe(model)
    assert sorted(load_run(tmp_path / "window")) == [1, 2]
    again = Net()
    GlobalSubscriberManager.subscribe(again, [StatisticsSubscriber(tmp_path / "window")])
    with pytest.raises(FileExistsError, match="override_output_dir=True"):
        again(torch.randn(2, 32))
    GlobalSubscriberManager.unsubscribe(again)


def test_subscribing_after_compiling_retraces_and_records(tmp_path):
    torch.manual_seed(0)
    model = Net()
    step = spmd_ort.compile(backend="fx")(train_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    traces = step.transitions.traces
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "late")])
    step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    GlobalSubscriberManager.flush()
    GlobalSubscriberManager.unsubscribe(model)
    assert step.transitions.traces == traces + 1  # the hooks change the traced graph: a new variant
    assert "hooks" in step.compiled.traced_because
    assert len(load_run(tmp_path / "late")[0]) == 6


def test_explain_states_the_plan():
    torch.manual_seed(0)
    model = Net()
    step = spmd_ort.compile(backend="ort")(train_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    text = step.explain()
    assert "variants: 1 kept, 1 traced" in text  # a fresh AdamW's state is made before the first trace
    assert "#0: traced because first call" in text
    assert "reinplace_optimizer_pass" in text and "collectives: none (one process)" in text
    assert "fused_0" in text and "100.0% of FLOPs" in text and "spmd_ort.adam_.default" in text
    assert "memory (this rank): persistent" in text


def _is_ort(run) -> bool:
    """Whether FirstRun is timing a segment's ORT session (else its fx graph)."""
    return getattr(run, "__name__", "") == "run_ort"


def _fix_times(monkeypatch, ort_s: float, fx_s: float) -> None:
    """FirstRun's timings of a segment, fixed (ORT's through ``fastest``, fx's through ``timed_fx_runs``)."""
    from spmd_ort.backends.ort import choice

    monkeypatch.setattr(choice, "fastest", lambda run, args, first: ort_s if _is_ort(run) else fx_s)
    monkeypatch.setattr(choice, "timed_fx_runs", lambda run, args, repeat: (fx_s, run(*args)))


def _whole_runs_on(monkeypatch, winner: str) -> None:
    """The whole-step choice fixed: ``winner`` (one of its candidates) is timed fastest."""
    from spmd_ort.backends.ort import executor as executor_module
    from spmd_ort.backends.ort.stats import WholeChoice

    def fixed(runners, inputs, stats, field="whole", keep=None):
        setattr(stats, field, WholeChoice(winner, tuple((k, 1.0 if k == winner else 2.0) for k in runners)))
        return winner

    monkeypatch.setattr(executor_module, "choose_whole", fixed)


@pytest.mark.parametrize("case", ["faster", "forced", "failed", "whole on ort"])
def test_explain_says_why_a_segment_runs_on_fx(case, monkeypatch):
    """A segment on fx is there because it was faster (both times shown), because SPMD_ORT_SEGMENT_EXECUTOR
    asked for fx, or because ORT failed (the failure shown): explain() says which, not "fallback" for all.  One
    timed faster on fx that runs on ORT all the same (the whole step was faster with every segment on ORT) says
    so."""
    from spmd_ort.backends.ort.session import OrtSegment

    if case in ("faster", "whole on ort"):
        monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "auto")
        # the timings decide; fixed here so that fx is the faster, whatever the machine's load
        _fix_times(monkeypatch, ort_s=2e-3, fx_s=1e-3)
        _whole_runs_on(monkeypatch, "fx" if case == "faster" else "ort")
    elif case == "forced":
        monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "fx")
    else:
        def fail(self, *args):
            raise RuntimeError("injected ORT failure")
        monkeypatch.setattr(OrtSegment, "run_ort", fail)
    torch.manual_seed(0)
    model = Net()
    step = spmd_ort.compile(backend="ort")(train_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    row = next(line for line in step.explain().splitlines() if line.strip().startswith("fused_0"))
    assert "fallback)" not in row
    expected = {"faster": r"fx .*chosen: faster on fx \(ort 2\.00 ms, fx 1\.00 ms; SPMD_ORT_SEGMENT_EXECUTOR=auto\)",
                "forced": r"fx .*forced: SPMD_ORT_SEGMENT_EXECUTOR=fx",
                "failed": r"fx .*fell back: ONNX Runtime failed to run it: injected ORT failure",
                "whole on ort": r"ort .*chosen: faster on fx \(ort 2\.00 ms, fx 1\.00 ms; SPMD_ORT_SEGMENT_EXECUTOR=auto\); "
                                r"runs on ort: the whole step was faster with every segment on ORT"}[case]
    assert re.search(r"fused_0\s+" + expected, row), row


def test_explain_says_a_segment_on_ort_was_timed_faster(monkeypatch):
    from spmd_ort.backends.ort import choice

    import time

    from spmd_ort.backends.ort import executor as executor_module

    monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "auto")
    _fix_times(monkeypatch, ort_s=1e-3, fx_s=3e-3)
    choose = choice.choose_whole

    def whole_fx_slower(runners, inputs, stats, field="whole"):
        """The whole graph on fx, the whole step's other candidate, timed slower too (really: on so small a net
        the measured times are a coin toss)."""
        forward = runners["fx"].forward

        def slow(*args):
            time.sleep(0.02)
            return forward(*args)

        runners["fx"].forward = slow
        return choose(runners, inputs, stats, field)

    monkeypatch.setattr(executor_module, "choose_whole", whole_fx_slower)
    model = Net()
    step = spmd_ort.compile(backend="ort")(train_step)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    assert re.search(r"fused_0\s+ort .*chosen: faster on ort \(ort 1\.00 ms, fx 3\.00 ms", step.explain())


@pytest.mark.on_ort  # the ORT segment's span (fused_0): every segment on ORT, not the faster of ORT and fx
def test_profile_writes_a_trace_and_a_picture(tmp_path):
    torch.manual_seed(0)
    model = Net()
    step = spmd_ort.compile(backend="ort")(train_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step.profile(steps=2, path=tmp_path / "timeline")
    for _ in range(5):
        step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    trace_path, png = step.profile_paths
    trace = json.loads(trace_path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"fused_0", "adam_"}
    assert {e["args"]["step"] for e in spans} == {0, 1}
    assert all(e["dur"] >= 0 for e in spans)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_compiled_steps_keep_their_taps_and_statistics_apart(tmp_path):
    """Two models, each with its own subscriber, trained by two compiled steps (one of them checking its
    passes, the other not) in one process: each step's graph taps only its own model, its registry knows only
    its own subscriber, and each output directory holds only its own model's statistics."""
    torch.manual_seed(0)
    models = {"a": Net(), "b": Net()}
    subs = {name: StatisticsSubscriber(tmp_path / name) for name in models}
    steps = {"a": spmd_ort.compile(backend="fx", debug=spmd_ort.DebugOptions(check_passes=True))(train_step),
             "b": spmd_ort.compile(backend="fx")(train_step)}
    for name, model in models.items():
        GlobalSubscriberManager.subscribe(model, [subs[name]])
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for _ in range(2):
        for name in models:  # interleaved, as two trainings in one process would
            steps[name](models[name], opts[name], x, y)
    GlobalSubscriberManager.flush()
    for name, model in models.items():
        GlobalSubscriberManager.unsubscribe(model)
    registry = {name: step.runtime.taps for name, step in steps.items()}
    assert registry["a"] is not registry["b"]
    for name, step in steps.items():
        taps = {s.index for s in step.compiled.output_slots if s.kind.value == "stats"}
        assert len(taps) == 6
        assert {registry[name]._taps[t].owner for t in taps} == {subs[name]}  # its own subscriber only
        run = load_run(tmp_path / name)
        assert sorted(run) == [0, 1] and len(run[0]) == 6  # two steps, six activations each, nothing else
    # the same kind of model and batch: the same activations in each run, each written once
    assert [a.name for a in load_run(tmp_path / "a")[1]] == [a.name for a in load_run(tmp_path / "b")[1]]


def test_an_unsubscribed_subscriber_gets_nothing_more(tmp_path):
    torch.manual_seed(0)
    model = Net()
    sub = StatisticsSubscriber(tmp_path / "gone")
    GlobalSubscriberManager.subscribe(model, [sub])
    step = spmd_ort.compile(backend="fx")(train_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    GlobalSubscriberManager.flush()
    GlobalSubscriberManager.unsubscribe(model)
    assert not sub.subscribed
    step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))  # a new variant without hooks
    sub.flush()
    assert sorted(load_run(tmp_path / "gone")) == [0]
