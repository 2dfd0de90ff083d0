"""The ONNX Runtime backend: op coverage against eager, verification, fallback policy, cache, debug output."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_ort
from spmd_ort.backends.ort import coverage
from spmd_ort.backends.ort import export as ort_export
from spmd_ort.backends.ort.session import OrtSegment
from spmd_ort.backends.ort.translations import Translation
from helpers import assert_close_relmax, assert_ran_on_ort, assert_same_state, train_side_by_side, train_step
from models import MLP

pytestmark = pytest.mark.on_ort  # the ORT backend's own tests: every ORT segment runs on ORT

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parent.parent


def _grads_match(make_model, loss_fn, inputs, steps: int = 3):
    """Eager vs ort: loss at rtol 1e-5 and every gradient within 1e-5 of its largest element (SGD, so no
    Adam amplification); parameters elementwise."""
    torch.manual_seed(0)
    eager = make_model()
    model = copy.deepcopy(eager)

    def step(model, opt, *batch):
        loss = loss_fn(model, *batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        return loss, grads

    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = spmd_ort.compile(backend="ort")(step)
    for _ in range(steps):
        le, ge = step(eager, opt_e, *inputs)
        lc, gc = compiled(model, opt_c, *inputs)
        torch.testing.assert_close(lc, le.detach(), rtol=1e-5, atol=1e-6)
        for name in ge:
            assert_close_relmax(gc[name], ge[name], msg=f"grad {name}")
    assert_ran_on_ort(compiled)
    assert_same_state(eager, model, opt_e, opt_c)


class Classifier(nn.Module):
    def __init__(self, vocab=50, d=16, classes=7):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, classes)

    def forward(self, idx):  # (B, T) -> (B, T, classes)
        return self.fc(F.gelu(self.ln(self.emb(idx)), approximate="tanh"))


def _tokens(B=4, T=6, vocab=50, classes=7):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (B, T), generator=g)
    y = torch.randint(0, classes, (B, T), generator=g)
    return x, y


@pytest.mark.parametrize("variant", ["mean", "sum", "ignore_index", "label_smoothing", "class_weights", "all"])
def test_cross_entropy_variants(variant):
    x, y = _tokens()
    y[0, :3] = -100
    y[2, 5] = -100
    weight = torch.linspace(0.5, 2.0, 7)
    kwargs = {"mean": {}, "sum": {"reduction": "sum"}, "ignore_index": {"ignore_index": -100},
              "label_smoothing": {"label_smoothing": 0.1}, "class_weights": {"weight": weight},
              "all": {"ignore_index": -100, "label_smoothing": 0.1, "weight": weight}}[variant]
    if variant in ("mean", "sum", "label_smoothing"):
        y = y.clamp(min=0)

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), **kwargs)

    _grads_match(Classifier, loss_fn, (x, y))


def test_layer_norm_gelu_embedding_attention():
    class Attn(nn.Module):
        def __init__(self, d=16, heads=2):
            super().__init__()
            self.emb = nn.Embedding(50, d)
            self.ln = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.out = nn.Linear(d, 50)
            self.heads = heads

        def forward(self, idx):
            x = self.ln(self.emb(idx))
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            return self.out(F.gelu(x + y))

    x, y = _tokens(classes=50)
    _grads_match(Attn, lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten()), (x, y))


def test_silu_and_mish_run_in_ort():
    """Their backward ops had no ONNX translation: every segment of such a model fell back to fx (found by
    tests/test_fuzz.py); now decomposed before export, they run in ORT and match eager."""
    def make():
        return nn.Sequential(nn.Linear(6, 8), nn.SiLU(), nn.Linear(8, 8), nn.Mish(), nn.Linear(8, 3))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    _grads_match(make, lambda m, x, y: F.cross_entropy(m(x), y), (x, y))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_ORT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _gelu_as_twice(self, approximate: str = "none"):
    return self * 2.0


def _wrong_gelu(monkeypatch):
    """Inject a wrong translation: GELU exported as 2x (as a buggy torchlib function would be)."""
    monkeypatch.setitem(coverage.TRANSLATIONS, aten.gelu.default, Translation(_gelu_as_twice, "injected by a test"))


def test_verification_catches_wrong_translation_and_fallback_keeps_training_correct(
        fresh_cache, monkeypatch, caplog):
    _wrong_gelu(monkeypatch)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        compiled, _, _ = train_side_by_side(MLP, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), train_step,
                                            batches, backend="ort", expect_clean_ort=False)
    assert "verification failed" in caplog.text and "fused_0" in caplog.text and "output" in caplog.text
    stats = compiled.compiled.executor.stats
    assert stats.fallbacks == ["fused_0"] and stats.mismatches


def test_fallback_disable_raises_and_changes_nothing(fresh_cache, monkeypatch):
    _wrong_gelu(monkeypatch)
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    step = spmd_ort.compile(backend="ort")(train_step)
    with pytest.raises(spmd_ort.CompileError, match=r"ORT segment `fused_0`.*verification failed: output \d+"):
        step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert step.transitions.traces == 0


def test_export_failure_falls_back_or_raises(fresh_cache, monkeypatch, caplog):
    def broken(self, approximate: str = "none"):
        raise RuntimeError("no translation for aten.gelu (injected)")

    monkeypatch.setitem(coverage.TRANSLATIONS, aten.gelu.default, Translation(broken, "injected by a test"))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        model = MLP()
        out = spmd_ort.compile(backend="ort")(train_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    assert torch.isfinite(out)
    assert "export failed" in caplog.text and "aten.gelu.default" in caplog.text and "fx executor" in caplog.text
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = MLP()
    with pytest.raises(spmd_ort.CompileError, match="export failed.*injected"):
        spmd_ort.compile(backend="ort")(train_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "SOMETIMES")
    with pytest.raises(ValueError, match="SPMD_ORT_FALLBACK_POLICY='SOMETIMES'"):
        spmd_ort.compile(backend="ort")(train_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)


CACHE_SCRIPT = r"""
import json, sys, time, torch
sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})
import spmd_ort
from spmd_ort.backends.ort import export
from models import MLP
from helpers import train_step
translate = export.translate
def slow_translate(*args, **kwargs):  # an export long enough that the other process must wait for it
    time.sleep({export_delay})
    return translate(*args, **kwargs)
export.translate = slow_translate
torch.manual_seed(0)
model = MLP(); opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = spmd_ort.compile(backend="ort")(train_step)
t0 = time.perf_counter()
step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
step(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
stats = [v.executor.stats for v in step.variants]
print(json.dumps({{"seconds": time.perf_counter() - t0, "segments": sum(s.segments for s in stats),
                  "hits": sum(s.cache_hits for s in stats), "export_s": sum(s.export_seconds for s in stats),
                  "fallbacks": sum(len(s.fallbacks) for s in stats),
                  "ort_runs": [seg.runs for v in step.variants for seg in v.executor.segments],
                  "checked_runs": [seg.checked_runs for v in step.variants for seg in v.executor.segments]}}))
"""


def test_concurrent_processes_export_once_and_share_the_cache(fresh_cache):
    """Two processes compile the same step at once (as the ranks of a data-parallel job do): one exports,
    the other waits on the cache's lock and loads that model; both run it in ORT.  (Each export takes
    5 s more than it would, so the two overlap whatever the machine's load.)"""
    script = CACHE_SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT), export_delay=5.0)
    env = {**os.environ, "SPMD_ORT_CACHE_DIR": str(fresh_cache)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        # the exporter's irrelevant warnings are silenced (it used to print 8 about torchvision per process)
        assert "torchvision" not in err and "nn_module_stack" not in err, err[-3000:]
        runs.append(json.loads(out.strip().splitlines()[-1]))
    for run in runs:  # both processes ran the segment of their one variant (AdamW) in ORT on both steps
        assert run["fallbacks"] == 0 and run["segments"] == 1, run
        assert run["checked_runs"] == [1] and run["ort_runs"] == [1], run  # the first checked, the second used
    cold, warm = sorted(runs, key=lambda r: r["hits"])
    assert (cold["hits"], warm["hits"]) == (0, 1), runs
    print(f"exporting process {cold['seconds']:.2f}s (export {cold['export_s']:.2f}s), "
          f"loading process {warm['seconds']:.2f}s (waited and loaded in {warm['export_s']:.2f}s)")
    assert len(list(fresh_cache.glob("*.onnx"))) == 1


def test_save_onnx_and_opset(tmp_path, monkeypatch, fresh_cache):
    monkeypatch.setenv("SPMD_ORT_SAVE_ONNX_PATH", str(tmp_path / "onnx"))
    monkeypatch.setenv("SPMD_ORT_ONNX_OPSET_VERSION", "18")
    model = MLP()
    step = spmd_ort.compile(backend="ort", debug=spmd_ort.DebugOptions(save_onnx=True, onnx_prefix="mlp"))(train_step)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert_ran_on_ort(step, trained=0)  # one checked step: what this checks is the export
    saved = sorted((tmp_path / "onnx").glob("mlp_fused_*.onnx"))
    assert len(saved) == 1
    proto = onnx.load(str(saved[0]))
    onnx.checker.check_model(proto)
    assert {o.domain: o.version for o in proto.opset_import}[""] == 18
    for bad in ("eighteen", "7", "99"):  # read once, when compile() is called: a bad value fails there
        monkeypatch.setenv("SPMD_ORT_ONNX_OPSET_VERSION", bad)
        with pytest.raises(spmd_ort.ConfigError, match=f"SPMD_ORT_ONNX_OPSET_VERSION='{bad}'.*from 18 to 25"):
            spmd_ort.compile(backend="ort")


def test_save_onnx_into_a_file_is_a_config_error_not_a_fallback(tmp_path, monkeypatch, fresh_cache):
    """SPMD_ORT_SAVE_ONNX_PATH naming a file sent every segment to fx (a failed export); it is a ConfigError at
    compile(), and a directory that cannot be written when the first export saves is one too, changing nothing."""
    target = tmp_path / "onnx"
    target.write_text("not a directory")
    monkeypatch.setenv("SPMD_ORT_SAVE_ONNX_PATH", str(target))
    with pytest.raises(spmd_ort.ConfigError, match=r"SPMD_ORT_SAVE_ONNX_PATH=.*expected a directory, but .* is a file"):
        spmd_ort.compile(backend="ort", debug=spmd_ort.DebugOptions(save_onnx=True))
    target.unlink()
    step = spmd_ort.compile(backend="ort", debug=spmd_ort.DebugOptions(save_onnx=True))(train_step)
    target.write_text("made a file after compile()")  # the first export cannot write there
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(spmd_ort.ConfigError, match=r"could not write segment fused_0 into SPMD_ORT_SAVE_ONNX_PATH="):
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not opt.state


def test_host_nodes_are_named():
    """The optimizer update stays on the host, in place, and so does the check of the targets' range;
    describe() shows segments and host ops."""
    model = MLP()
    step = spmd_ort.compile(backend="ort")(train_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert_ran_on_ort(step)
    stats = step.compiled.executor.stats
    assert stats.segments == 1
    assert stats.host_ops == {"spmd_ort.adam_.default": "spmd_ort op (runs in torch)",
                              "spmd_ort.check_index.default": "eager's bounds check of an index from the inputs "
                                                              "(runs in torch, before the segments that read it)"}
    text = step.compiled.describe()
    assert "ORT segments: 1" in text and "spmd_ort.adam_.default" in text


def test_without_verification_segments_still_run_in_ort_and_match_eager(monkeypatch):
    """The path users get with SPMD_ORT_VERIFY=0: nothing compared on the first run, every segment
    still runs in ONNX Runtime on every step, and training matches eager."""
    monkeypatch.setenv("SPMD_ORT_VERIFY", "0")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
    compiled, _, _ = train_side_by_side(MLP, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
                                        train_step, batches, backend="ort", expect_verified=False)
    assert not compiled.options.verify


def _mlp_batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)


def test_verification_is_on_by_default(monkeypatch):
    monkeypatch.delenv("SPMD_ORT_VERIFY", raising=False)
    assert spmd_ort.Options().verify and spmd_ort.DebugOptions().verify is None  # (None: not given)
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _mlp_batches(3), backend="ort")
    assert compiled.options.verify and compiled.compiled.executor.stats.verified == 1  # assert_ran_on_ort too


class _VirtualCosts:
    """Every timing on a virtual clock (this machine's load swings a real one by more than any injected delay):
    the segment's ORT and fx runs and the whole graph on fx cost ``ort``, ``fx`` and ``whole`` seconds, in the
    first run's timings and in the steady steps' runs the executor times.  ``then``: costs that replace these
    once the first run's whole-graph timing is done."""

    def __init__(self, monkeypatch, ort: float, fx: float, whole: float, then: dict | None = None):
        from spmd_ort.backends import checked
        from spmd_ort.backends.ort import choice
        from spmd_ort.backends.ort import executor as executor_module

        self.now = 0.0
        self.cost = {"ort": ort, "fx": fx, "whole": whole}
        self.runners: list[set] = []  # the candidates of each whole-graph timing
        for module in (choice, checked, executor_module):  # first-run timings, the checked ORT run, steady runs
            monkeypatch.setattr(module, "now", lambda: self.now)
        run_ort, init, choose = OrtSegment.run_ort, OrtSegment.__init__, choice.choose_whole

        def patched_init(seg, name, fallback, *args, **kwargs):
            init(seg, name, fallback, *args, **kwargs)
            seg.fallback.forward = self._costing(seg.fallback.forward, "fx")

        def patched_choose(runners, inputs, stats, field="whole", keep=None):
            self.runners.append(set(runners))
            if "fx" in runners and not getattr(runners["fx"], "costed", False):
                runners["fx"].forward, runners["fx"].costed = self._costing(runners["fx"].forward, "whole"), True
            chosen = choose(runners, inputs, stats, field, keep)
            self.cost.update(then or {})
            return chosen

        monkeypatch.setattr(OrtSegment, "run_ort", self._costing(run_ort, "ort"))
        monkeypatch.setattr(OrtSegment, "__init__", patched_init)
        monkeypatch.setattr(executor_module, "choose_whole", patched_choose)

    def _costing(self, fn, what):
        def run(*args, **kwargs):
            self.now += self.cost[what]
            return fn(*args, **kwargs)
        return run


@pytest.mark.parametrize("slow,whole_cost", [("ort", 0.020), ("ort", 0.100), ("fx", 0.050), ("fx", 0.0005)])
def test_auto_keeps_the_faster_executor_per_segment(monkeypatch, slow, whole_cost):
    """SPMD_ORT_SEGMENT_EXECUTOR=auto times both executors on the first run and keeps the faster per segment,
    then times the step as chosen against every segment on ORT (where one chose fx) and the whole graph on fx,
    unsplit, and keeps the fastest; the losers are kept through 3 steady steps (which do not lose here: the
    choice is final) and freed then; the choices and times are in describe(); training matches eager either
    way.  ``whole_cost`` is the whole graph's on fx."""
    monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "auto")
    costs = _VirtualCosts(monkeypatch, ort=0.050 if slow == "ort" else 0.001, fx=0.050 if slow == "fx" else 0.001,
                          whole=whole_cost)
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _mlp_batches(5), backend="ort",
                                        expect_clean_ort=False)
    ex = compiled.compiled.executor
    stats = ex.stats
    picked = stats.choices["fused_0"]
    fast = "fx" if slow == "ort" else "ort"
    assert picked.executor == fast, picked
    assert (picked.ort_ms, picked.fx_ms) == pytest.approx((costs.cost["ort"] * 1e3, costs.cost["fx"] * 1e3))
    described = compiled.compiled.describe()
    assert f"fused_0 runs on {fast} (ort " in described
    assert not stats.fallbacks and stats.verified == 1
    segment = ex.segments[0]
    assert segment.checked_runs == 1  # ORT ran the first step, checked: its outputs compared, fx's used
    # the segment chose fx: its ORT session is the "ort" candidate (the segments as chosen are fx, split)
    assert costs.runners == [{"ort", "fx"} if fast == "fx" else {"segments", "fx"}]
    times = dict(stats.whole.times_ms)
    winner = min(times, key=times.get)
    assert stats.whole.executor == winner and times["fx"] == pytest.approx(whole_cost * 1e3)
    assert not ex.revisit_pending and ex.runs == winner, ex.runs  # final after the steady steps
    assert f"whole graph: {winner} final after 3 steady steps" in compiled.explain()
    if winner in ("segments", "ort"):  # ORT runs the segment from step 2 on, even where it chose fx
        assert segment.runs == 4  # the steps after the first (timing runs are no steps)
        assert segment.session is not None and ex.whole is None  # the fx candidate freed
    else:  # the whole graph on fx, unsplit, beats both
        assert "the whole graph runs on fx, unsplit (" in described
        assert segment.runs == 0 and segment.session is None  # no segment runs again: its session freed


def test_a_whole_choice_that_loses_in_the_steady_steps_is_revisited_once(monkeypatch):
    """The first run times ORT faster (the segments as chosen, 1 ms, against fx's 5 ms); then ORT slows to 50 ms a
    run and so do the steady steps, slower than fx measured: before step 5 the candidates are timed again,
    the step switches to the whole graph on fx, and the segment's session is freed.  Numbers are eager's
    throughout, and nothing is revisited a second time."""
    monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "auto")
    costs = _VirtualCosts(monkeypatch, ort=0.001, fx=0.010, whole=0.005, then={"ort": 0.050})
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _mlp_batches(8), backend="ort",
                                        expect_clean_ort=False)
    ex = compiled.compiled.executor
    assert costs.runners == [{"segments", "fx"}] * 2
    decided = [str(d) for d in compiled.tuner.decisions if d.subject == "whole graph"]
    assert decided[0].startswith("whole graph: segments lost to fx in the steady steps: timed again at step 5 "
                                 "(steady steps 50.00 ms against fx's 5.00 ms on the first run)"), decided
    assert decided[1] == "whole graph: revisited at step 5: segments -> fx (segments 50.00 ms; fx 5.00 ms)", decided
    assert len(decided) == 2  # once
    assert ex.runs == "fx" and not ex.revisit_pending and ex.segments[0].session is None
    assert "revisited at step 5: the whole graph runs on fx, unsplit" in compiled.compiled.describe()


def test_forced_fx_segment_executor(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "fx")
    compiled, _, _ = train_side_by_side(MLP, _adamw, train_step, _mlp_batches(2), backend="ort",
                                        expect_clean_ort=False)
    stats = compiled.compiled.executor.stats
    assert str(stats.choices["fused_0"]) == "fx (SPMD_ORT_SEGMENT_EXECUTOR=fx)" and stats.verified == 1
    segment = compiled.compiled.executor.segments[0]
    assert (segment.checked_runs, segment.runs) == (1, 0)
    monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "fastest")
    with pytest.raises(spmd_ort.ConfigError, match="SPMD_ORT_SEGMENT_EXECUTOR='fastest'.*auto or ort or fx"):
        spmd_ort.compile(backend="ort")


def test_missing_execution_provider_is_a_config_error_not_a_fallback(monkeypatch):
    """Whatever the fallback policy: ORT cannot run the step as configured, so nothing is compiled or changed."""
    from spmd_ort.backends.ort import session

    monkeypatch.setattr(session.ort, "get_available_providers", lambda: ["AzureExecutionProvider"])
    with pytest.raises(spmd_ort.ConfigError, match="onnxruntime-gpu"):
        session.providers_for(torch.device("cuda", 0))
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    step = spmd_ort.compile(backend="ort")(train_step)  # FALLBACK_TO_FX, the default
    with pytest.raises(spmd_ort.ConfigError, match="no installed ONNX Runtime execution provider.*backend='fx'"):
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state


def test_long_export_shows_a_progress_line(monkeypatch, fresh_cache, caplog):
    from spmd_ort.backends.ort import executor

    monkeypatch.setattr(executor, "PROGRESS_AFTER_S", 0.0)
    with caplog.at_level(logging.INFO, logger="spmd_ort.progress"):
        model = MLP()
        spmd_ort.compile(backend="ort")(train_step)(model, _adamw(model), *_mlp_batches(1)[0])
    assert "exporting ORT segment fused_0 (1 of 1," in caplog.text
    assert "exported 1 ORT segment(s) in" in caplog.text
    spmd_ort.compile(backend="ort")  # (caplog restored the level it found; any compile() sets it again)
    assert logging.getLogger("spmd_ort.progress").getEffectiveLevel() <= logging.INFO  # shown by default


PROGRESS_SCRIPT = """
import sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})
import torch, spmd_ort
from spmd_ort.backends.ort import executor
from helpers import train_step
from models import MLP
executor.PROGRESS_AFTER_S = 0.0
model = MLP()
step = spmd_ort.compile(backend="ort")(train_step)
step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.randn(8, 32), torch.randint(0, 10, (8,)))
"""


def test_progress_lines_carry_the_rank_for_every_handler(fresh_cache, capfd):
    """`spmd_ort.progress` is a child logger: its records skip the parent's filters, so they lacked `rank` and every
    handler formatting `%(rank)s` printed `--- Logging error ---` instead of the line."""
    import io

    from spmd_ort.backends.ort import executor

    # the handler spmd_ort adds itself (a process whose logging is not configured)
    env = {**os.environ, "SPMD_ORT_CACHE_DIR": str(fresh_cache), "SPMD_ORT_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", PROGRESS_SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Logging error" not in proc.stderr, proc.stderr[-3000:]
    assert "[spmd_ort INFO] exporting ORT segment fused_0 (1 of 1," in proc.stderr, proc.stderr[-3000:]
    assert "[spmd_ort INFO] exported 1 ORT segment(s) in" in proc.stderr
    # a user's handler on the root logger that uses %(rank)s, as docs/debugging.md offers
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("<%(name)s%(rank)s> %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        executor.PROGRESS_AFTER_S = 0.0
        model = MLP()
        spmd_ort.compile(backend="ort")(train_step)(model, _adamw(model), *_mlp_batches(1)[0])
    finally:
        root.removeHandler(handler)
        executor.PROGRESS_AFTER_S = 2.0
    assert "Logging error" not in capfd.readouterr().err
    assert "<spmd_ort.progress> exporting ORT segment fused_0 (1 of 1," in stream.getvalue(), stream.getvalue()


def test_stock_exporter_path_gives_the_same_model(fresh_cache):
    """Where torch lacks the direct translator, segments go through torch.onnx.export with the same
    translations: the two models compute the same outputs."""
    model = MLP()
    step = spmd_ort.compile(backend="ort")(train_step)
    x, y = _mlp_batches(1)[0]
    step(model, _adamw(model), x, y)
    segment = step.compiled.executor.segments[0]
    inputs = [torch.randn(n.meta["val"].shape) if n.meta["val"].dtype.is_floating_point
              else torch.randint(0, 10, n.meta["val"].shape) for n in segment.fallback.graph.nodes
              if n.op == "placeholder"]
    outs = []
    for via in (False, True):
        seg = OrtSegment("probe", segment.fallback, ort_export.translate(segment.fallback, via_torch_export=via),
                         threads=1, allow_spinning=False)
        outs.append([t.clone() for t in seg.run_ort(*inputs)])
    for a, b in zip(*outs):
        assert_close_relmax(a, b, rtol=1e-6)


def test_verification_checks_each_output_to_its_own_scale():
    """A small output beside a large one is checked to its own scale: no floor borrowed from the segment's largest
    output (issue 42: a weight gradient of 1e-4 beside logits of 10 went unchecked).  Only the dtype's absolute
    floor (1e-9 for float32) is shared."""
    from spmd_ort.graph.checking import first_difference

    big = torch.linspace(-10.0, 10.0, 64)
    small = torch.full((8,), 1e-4)
    assert first_difference((big, small), (big, small.clone())) is None
    assert "output 1" in first_difference((big, small * (1 + 5e-4)), (big, small))
    noise = torch.full((8,), 1.1e-10)
    assert first_difference((big, noise * 3), (big, noise)) is None  # below the absolute floor
    # per-output tolerances: the second output may differ by 1e-3 of its max, the first not
    assert first_difference((big * (1 + 5e-4), small), (big, small), tolerance=(1e-4, 1e-3)) is not None
    assert first_difference((big, small * (1 + 5e-4)), (big, small), tolerance=(1e-4, 1e-3)) is None


class ConvBiasBatchNorm(nn.Module):
    """A convolution with a bias before a batch norm (common in user models): the bias's gradient is
    analytically zero, rounding noise in both executors."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def test_a_conv_bias_before_batch_norm_runs_on_ort_verified():
    """Verification used to take the bias gradient's noise (2e-8 against 1e-8) for a fault and send the whole
    backward segment to fx.  SGD: Adam would turn that noise into +-lr steps in either executor."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]
    train_side_by_side(ConvBiasBatchNorm, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), train_step, batches,
                       backend="ort")


def test_a_mismatch_within_rounding_of_float64_is_not_a_fault():
    """An ill-conditioned float32 computation: ORT and fx may differ, element by element, by as much as fx differs
    from float64 (the segment run again in float64); a wrong output is still a mismatch."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd_ort.graph.checking import within_rounding_of_float64

    x = 1000.0 + torch.arange(16, dtype=torch.float32) * 0.37
    gm = make_fx(lambda t: ((t + 1e-3) - t, t * 2))(x)  # the first output: 6% rounding error in float32
    fx_out = gm(x)
    exact = ((x.double() + 1e-3) - x.double(), x.double() * 2)
    assert (fx_out[0].double() - exact[0]).norm() > 1e-2 * exact[0].norm()  # fx itself is far from exact
    other = ((fx_out[0].double() + exact[0]) / 2).float()  # another float32 implementation: closer to exact
    assert within_rounding_of_float64(gm, [x], (other, fx_out[1]), fx_out)
    assert not within_rounding_of_float64(gm, [x], (fx_out[0] * 3, fx_out[1]), fx_out)
    assert not within_rounding_of_float64(gm, [x], (other, fx_out[1] * (1 + 1e-3)), fx_out)


def test_rounding_noise_of_a_cancelling_sum_is_not_a_fault_and_a_wrong_element_is():
    """An analytically zero output computed from large terms (a bias's gradient before a batch norm: a sum that
    cancels) is float32 rounding noise of those terms, in fx and in ORT alike, and fx may happen to compute it
    almost exactly (found when the machine's CPU changed: fuzz case ort_batchnorm_of_two_values_shared_clipped,
    1e-14 in fx, 8e-7 in ORT).  The float64 check judges it by the rounding noise of *its own* terms (the segment
    run in float64 with each op rounded at random by a float32 ulp), not by another output's scale; and element
    by element, so one wrong element among millions of right ones is caught (issue 42: an L2 norm let it through)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd_ort.graph.checking import within_rounding_of_float64

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g) * 3
    w = torch.randn(4096, generator=g)
    gm = make_fx(lambda x, w: (((x - x.mean(0)) * w).sum(0), (x * w).sum(0) * 0.5))(x, w)
    fx_out = gm(x, w)
    # another float32 implementation: the same sums in another order
    other = (((x - x.mean(0)) * w).flip(0).sum(0), (x * w).flip(0).sum(0) * 0.5)
    assert not torch.equal(other[0], fx_out[0])
    assert within_rounding_of_float64(gm, [x, w], other, fx_out)
    assert within_rounding_of_float64(gm, [x, w], (torch.zeros_like(other[0]), other[1]), fx_out)  # exact zeros
    assert not within_rounding_of_float64(gm, [x, w], (other[0] * 1000, other[1]), fx_out)  # far above the noise
    wrong = other[1].clone()
    wrong[17] *= 1.005  # one element of 4096, 0.5% off
    assert not within_rounding_of_float64(gm, [x, w], (other[0], wrong), fx_out)
    big = torch.randn(2_000_000, generator=g)
    line = make_fx(lambda t: t * 3)(big)
    mutated = line(big)
    mutated[123_456] += 0.005 * mutated.abs().max()
    assert not within_rounding_of_float64(line, [big], (mutated,), line(big))
