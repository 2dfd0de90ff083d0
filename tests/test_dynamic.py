"""Dynamic shapes: one compiled program for every sequence length and batch size, checked against eager."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest

import launch
import torch
import torch.nn.functional as F
from torch import nn

import spmd_ort
from helpers import assert_ort_report_clean, assert_same_state, ort_report
from helpers import train_step as lm_step
from models import GPT, GPTConfig
from spmd_ort.backends.ort.sizes import CHECKED_SIZES

ROOT = Path(__file__).resolve().parent.parent
CFG = GPTConfig(vocab=64, seq=32, d=32, heads=2, layers=2)
# (batch, length): 8 distinct lengths, batch sizes changing too, a length seen again at the end
SIZES = [(3, 8), (4, 12), (4, 16), (3, 9), (4, 31), (2, 5), (3, 20), (4, 12)]


def _lm(seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _batches(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    for b, n in sizes:
        yield torch.randint(0, CFG.vocab, (b, n), generator=g), torch.randint(0, CFG.vocab, (b, n), generator=g)


def _train_both(step, sizes, backend):
    model, opt = _lm()
    model_e, opt_e = copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    opt_e = torch.optim.AdamW(model_e.parameters(), lr=3e-3, weight_decay=0.1)
    for i, (x, y) in enumerate(_batches(sizes)):
        loss = step(model, opt, x, y)
        ref = lm_step(model_e, opt_e, x, y)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        assert_same_state(model_e, model, opt_e, opt, where=f"step {i} sizes {tuple(x.shape)}",
                          normwise=backend == "ort")
    return model


@pytest.mark.on_ort
@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_one_program_serves_every_length_and_batch_size(backend, caplog):
    """Automatic: the first call traces statically; the second size makes batch and length symbolic, and that
    one program serves every later size, equal to eager at every step."""
    step = spmd_ort.compile(backend=backend)(lm_step)
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        _train_both(step, SIZES, backend)
    assert step.transitions.traces == 2  # the static first program (a fresh AdamW's state made first) + 1
    program = step.compiled
    assert program.symbolic is not None and program.symbolic.symbolic() == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert program.steps_run == len(SIZES) - 1
    assert "x dims [0, 1], y dims [0, 1] changed since the last call: symbolic from now on" in caplog.text
    assert "symbolic sizes (dynamic shapes): input[0] dim 0 =" in program.describe()
    if backend == "ort":
        report = ort_report(step)
        assert_ort_report_clean(report)
        # one ONNX model with dynamic axes per segment, checked against fx at its first 3 sets of sizes
        assert report[-1]["sized"] == [], report
        assert report[-1]["checked_sizes"] == [CHECKED_SIZES] * report[-1]["segments"], report
        assert report[-1]["segments"] == report[0]["segments"], report  # sizes split no segment


class Pooled(nn.Module):
    """Convolutions (one grouped), batch norm and pooling: images whose batch and size may vary (no bias before
    the batch norm: its gradient is analytically zero, rounding noise that Adam would turn into steps)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


@pytest.mark.on_ort
@pytest.mark.parametrize("vary", ["batch", "image"])
def test_convolutions_with_dynamic_sizes_on_ort(vary):
    """A changing batch or image size: one ONNX model per segment (the convolution, batch norm and pooling
    translations read the sizes at run time), equal to eager at every step.  The symbolic program's first
    CHECKED_SIZES sizes are checked runs (ORT's outputs compared with fx's, fx's used); the steps after them,
    at sizes seen and new, use ORT's outputs, and those steps are compared with eager too."""
    checked = {"batch": [(6, 8), (3, 8), (5, 8)], "image": [(2, 10), (2, 12), (2, 8)]}[vary]
    after = {"batch": [(6, 8), (7, 8), (3, 8), (2, 8)], "image": [(2, 10), (2, 14), (2, 12), (2, 6)]}[vary]
    sizes = [(4, 8) if vary == "batch" else (2, 8)] + checked + after  # the static first program, then symbolic
    torch.manual_seed(0)
    model = Pooled()
    model_e = copy.deepcopy(model)
    opt, opt_e = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, model_e))
    step = spmd_ort.compile(backend="ort")(lm_step)
    g = torch.Generator().manual_seed(0)
    for b, hw in sizes:
        x, y = torch.randn(b, 3, hw, hw, generator=g), torch.randint(0, 10, (b,), generator=g)
        torch.testing.assert_close(step(model, opt, x, y), lm_step(model_e, opt_e, x, y).detach(), rtol=1e-5,
                                   atol=1e-6)
        assert_same_state(model_e, model, opt_e, opt, where=f"sizes {tuple(x.shape)}", normwise=True)
    assert step.transitions.traces == 2, [(p.key, p.symbolic) for p in step.variants]
    report = ort_report(step)
    assert_ort_report_clean(report)
    assert report[-1]["sized"] == [], report
    assert len(checked) == CHECKED_SIZES
    assert report[-1]["checked_sizes"] == [CHECKED_SIZES] * report[-1]["segments"], report
    # every step after the checked sizes used ORT's outputs, in every segment
    assert report[-1]["ort_runs"] == [len(after)] * report[-1]["segments"], report


def _gelu_reading_concrete_sizes(self, approximate: str = "none"):
    """torchlib's GELU, after reading the input's sizes as ints (as a translation written for static shapes
    might): fails on a symbolic dim."""
    from onnxscript.function_libs.torch_lib.ops.nn import aten_gelu

    assert all(int(d) > 0 for d in self.shape)
    return aten_gelu(self, approximate)


@pytest.mark.on_ort
def test_a_segment_whose_translation_needs_concrete_sizes_is_exported_per_size(monkeypatch, caplog):
    """The per-size path: an INFO line says why, each set of sizes gets its own model, verified; eager parity."""
    from spmd_ort.backends.ort import coverage
    from spmd_ort.backends.ort.translations import Translation

    monkeypatch.setitem(coverage.TRANSLATIONS, torch.ops.aten.gelu.default,
                        Translation(_gelu_reading_concrete_sizes, "injected by a test"))
    step = spmd_ort.compile(backend="ort")(lm_step)
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        _train_both(step, SIZES[:5] + SIZES[1:3], "ort")  # sizes seen before train on their models' outputs
    assert "has no model with dynamic sizes" in caplog.text and "it is exported per set of sizes" in caplog.text
    report = ort_report(step)
    assert_ort_report_clean(report)
    assert report[-1]["sized"] and all(n == len(set(SIZES[1:5])) for n in report[-1]["sized"]), report


def test_dynamic_true_traces_once_and_false_traces_every_shape():
    step = spmd_ort.compile(backend="fx", dynamic=True)(lm_step)
    _train_both(step, SIZES, "fx")
    assert step.transitions.traces == 1
    static = spmd_ort.compile(backend="fx", dynamic=False)(lm_step)
    _train_both(static, SIZES[:4], "fx")
    assert static.transitions.traces == 4 and static.compiled.symbolic is None


def test_environment_sets_the_default_and_compile_wins(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_DYNAMIC", "0")
    assert spmd_ort.compile(backend="fx")(lm_step).options.dynamic == "0"
    assert spmd_ort.compile(backend="fx", dynamic=True)(lm_step).options.dynamic == "1"
    monkeypatch.setenv("SPMD_ORT_DYNAMIC", "sometimes")
    with pytest.raises(spmd_ort.ConfigError, match="SPMD_ORT_DYNAMIC"):
        spmd_ort.compile(backend="fx")(lm_step)
    monkeypatch.delenv("SPMD_ORT_DYNAMIC")
    with pytest.raises(spmd_ort.ConfigError, match="dynamic='yes'"):
        spmd_ort.compile(backend="fx", dynamic="yes")(lm_step)


def _small(cls):
    """A model and its eager twin with SGD, a step compiled with dynamic=True, a generator."""
    torch.manual_seed(0)
    model = cls()
    model_e = copy.deepcopy(model)
    opt, opt_e = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model_e.parameters(), lr=0.1)
    return model, model_e, opt, opt_e, spmd_ort.compile(backend="fx", dynamic=True)(lm_step), \
        torch.Generator().manual_seed(0)


class Branchy(nn.Module):
    """Takes another path for long sequences: tracing records a guard on the length."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.short = nn.Linear(8, 16)
        self.long = nn.Linear(8, 16)

    def forward(self, x):
        h = self.emb(x)
        return self.long(h) if x.shape[1] > 10 else self.short(h)


def test_guards_send_other_sizes_to_another_program():
    """The symbolic program traced on short sequences is not used for long ones (its guard fails): they get a
    static program, and every step equals eager."""
    model, model_e, opt, opt_e, step, g = _small(Branchy)
    for n in (4, 6, 14, 5, 14, 8):
        x, y = torch.randint(0, 16, (2, n), generator=g), torch.randint(0, 16, (2, n), generator=g)
        torch.testing.assert_close(step(model, opt, x, y), lm_step(model_e, opt_e, x, y).detach(), rtol=1e-6, atol=0)
        assert_same_state(model_e, model, opt_e, opt, where=f"length {n}")
    symbolic = [p for p in step.variants if p.symbolic is not None]
    assert symbolic and all(p.symbolic.guards for p in symbolic)
    assert any(p.key.shapes for p in step.variants)  # length 14 traced statically
    assert step.transitions.traces == 2


def test_sizes_the_guards_reject_reuse_the_first_static_program():
    """dynamic=None: length 14 is traced statically, 4 makes the length symbolic (the program guards it <= 10);
    14 again runs the first call's static program instead of tracing it a second time."""
    model = Branchy()
    model_e = copy.deepcopy(model)
    opt, opt_e = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model_e.parameters(), lr=0.1)
    step, g = spmd_ort.compile(backend="fx", dynamic=None)(lm_step), torch.Generator().manual_seed(0)
    for n in (14, 4, 14, 6, 14):
        x, y = torch.randint(0, 16, (2, n), generator=g), torch.randint(0, 16, (2, n), generator=g)
        torch.testing.assert_close(step(model, opt, x, y), lm_step(model_e, opt_e, x, y).detach(), rtol=1e-6, atol=0)
        assert_same_state(model_e, model, opt_e, opt, where=f"length {n}")
    assert step.transitions.traces == 2
    assert sorted(p.symbolic is not None for p in step.variants) == [False, True]


class FixedLength(nn.Module):
    """Adds a position table of a fixed length: the model itself fixes the sequence dim."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.pos = nn.Parameter(torch.randn(1, 6, 8))
        self.out = nn.Linear(8, 16)

    def forward(self, x):
        return self.out(self.emb(x) + self.pos)


def test_a_dim_the_model_fixes_stays_static(caplog):
    model, model_e, opt, opt_e, step, g = _small(FixedLength)
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        for b in (2, 3, 5):
            x, y = torch.randint(0, 16, (b, 6), generator=g), torch.randint(0, 16, (b, 6), generator=g)
            torch.testing.assert_close(step(model, opt, x, y), lm_step(model_e, opt_e, x, y).detach(),
                                       rtol=1e-6, atol=0)
    assert_same_state(model_e, model, opt_e, opt)
    assert step.transitions.traces == 1
    assert step.compiled.symbolic.specialised == {(0, 1): 6}  # y's length follows from x's (a guard)
    assert "the model fixes dim 1 of `x` at 6; those dims stay static" in caplog.text


def test_a_scalar_that_changes_every_call_warns_once(caplog):
    def scaled_step(model, opt, x, y, scale):
        loss = lm_step_loss(model, x, y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model, opt = _lm()
    step = spmd_ort.compile(backend="fx", dynamic=False)(scaled_step)
    (x, y), = _batches([(2, 8)])
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        for i in range(5):
            step(model, opt, x, y, 1.0 + i / 10)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert ("scaled_step has re-traced 3 times because inputs changed (leaf[4]) between calls" in warnings[0].message
            and "Fix: let it be a graph input: compile(dynamic=None)" in warnings[0].message), warnings[0].message


def sliced_scaled_step(model, opt, x, y, scale, keep):
    loss = lm_step_loss(model, x[:, :keep], y[:, :keep]) * scale
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.on_ort
@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_python_numbers_that_change_become_graph_inputs(backend, caplog):
    """Automatic: a float (a loss scale) and an int (a length to keep) that change every call become graph
    inputs after the second call: one program serves every value, equal to eager at every step.  A value the
    program's guards reject (keeping the whole length: torch's slice specialises it) gets a static program."""
    model, opt = _lm()
    model_e, opt_e = copy.deepcopy(model), None
    opt_e = torch.optim.AdamW(model_e.parameters(), lr=3e-3, weight_decay=0.1)
    step = spmd_ort.compile(backend=backend)(sliced_scaled_step)
    calls = [(1.0, 9), (0.5, 10), (2.0, 7), (0.25, 11), (1.5, 12), (0.75, 8), (1.25, 10)]  # (10 again: on ORT)
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        for i, (x, y) in enumerate(_batches([(2, 12)] * len(calls))):
            scale, keep = calls[i]
            loss = step(model, opt, x, y, scale, keep)
            torch.testing.assert_close(loss, sliced_scaled_step(model_e, opt_e, x, y, scale, keep).detach(),
                                       rtol=1e-5, atol=1e-6)
            assert_same_state(model_e, model, opt_e, opt, where=f"call {i}", normwise=backend == "ort")
    assert "scale (its value), keep (its value) changed since the last call: symbolic from now on" in caplog.text
    symbolic = [p for p in step.variants if p.symbolic is not None]
    assert len(symbolic) == 1 and symbolic[0].symbolic.symbolic() == {(2, None), (3, None)}, symbolic
    assert symbolic[0].steps_run == len(calls) - 2  # every call but the first and the one keeping all 12
    assert step.transitions.traces == 3
    if backend == "ort":
        assert_ort_report_clean(ort_report(step))


def test_a_returned_number_computed_from_symbolic_values_is_an_error(caplog):
    """It would have no one value: the symbolic trace fails, and that value is traced statically from then on
    (one INFO line saying why, no second attempt)."""
    def step_fn(model, opt, x, y, scale):
        loss = lm_step_loss(model, x, y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, scale * 2

    model, opt = _lm()
    step = spmd_ort.compile(backend="fx")(step_fn)
    (x, y), = _batches([(2, 8)])
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        assert [step(model, opt, x, y, s)[1] for s in (1.0, 1.5, 2.5)] == [2.0, 3.0, 5.0]
    assert all(p.symbolic is None for p in step.variants) and step.transitions.traces == 3
    assert caplog.text.count("the trace with the new symbolic dims failed (CompileError: could not trace the "
                             "train step outside any submodule (in the step function or backward): the step "
                             "returns the Python number 2.0*zf") == 1, caplog.text


def lm_step_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


@pytest.mark.on_ort
@pytest.mark.multiproc
def test_ranks_with_different_sizes_every_step_match_ddp(tmp_path):
    """2 ranks, each with its own batch size, length and loss scale (a Python float) at every step: replicate
    and fully_shard equal DDP (checked in the script at every step), on fx and on ORT (one launch, one backend
    after the other); one symbolic program after the first step on each rank."""
    out = tmp_path / "out"
    launch.torchrun("dynamic_parity.py", "--backend", "fx,ort", "--out", str(out), timeout=600)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for backend in ("fx", "ort"):
        for r in ranks:
            r = r[backend]
            assert r["traces"] == {"replicate": 2, "fully_shard": 2}, (backend, r["traces"])
            assert r["symbolic"] == {"replicate": True, "fully_shard": True}, backend
            assert all("(its value)" in d for d in r["dynamic"].values()), (backend, r["dynamic"])  # the loss scale
            if backend == "ort":
                for report in r["ort"].values():
                    assert_ort_report_clean(report)
        assert ranks[0][backend]["losses"] != ranks[1][backend]["losses"], backend


@pytest.mark.on_ort
@pytest.mark.multiproc
@pytest.mark.parametrize("style,backend", [("replicate", "fx"), ("fully_shard", "ort")])
def test_a_short_last_batch_on_one_rank_trains_as_ddp(tmp_path, style, backend):
    """Rank 1's last batch is (1, 9) where rank 0's is (4, 16), then rank 0 passes length 1: torch specialises
    sizes 1, so this raised "ranks disagree on this step's inputs" on every rank.  Now the differing dims become
    symbolic with size 1 included: one program more than the first step's, and loss, parameters and AdamW state
    equal DDP's at every step (checked in tests/dist/short_batch.py; fx bit for bit)."""
    out = tmp_path / "out"
    launch.torchrun("short_batch.py", "--style", style, "--backend", backend, "--out", str(out), timeout=300)
    for r in range(2):
        res = json.loads((out / f"rank{r}.json").read_text())
        assert res["traces"] == 2, res  # the first step's static program, and one more
        assert res["dynamic"] == "input[2] dims [0, 1], input[3] dims [0, 1] (size 1 included)", res["dynamic"]
        assert "size 1 included (traced size-obliviously)" in res["describe"], res["describe"]
        if backend == "ort":
            assert_ort_report_clean(res["ort"])


@pytest.mark.multiproc
def test_tensor_parallel_ranks_with_different_batches_fail_on_every_rank(tmp_path):
    """The ranks of a tensor-parallel group must pass one batch; other tokens on rank 1 trained silently (eager
    too).  Now every rank raises, naming `ids` and the ranks, and changes nothing, whether the values differ (the
    checksums the ranks exchange at a program's first call) or the shapes (their agreement on the step's inputs);
    then the same batch trains (tests/dist/tp_batches.py)."""
    out = tmp_path / "out"
    launch.torchrun("tp_batches.py", "--out", str(out), timeout=300)
    for r in range(2):
        res = json.loads((out / f"rank{r}.json").read_text())
        for case, what in (("values", "values for `ids`"), ("shapes", "`ids` (shape (4, 8) vs shape (4, 6))")):
            seen = res[case]
            assert seen["type"] == "DifferentBatchError", (case, seen)
            assert f"rank 0 and rank 1 of one tensor-parallel group pass different {what}" in seen["error"], seen
            assert "DistributedSampler" in seen["error"] and seen["unchanged"] and seen["plain"], (case, seen)
        assert res["sharded"] and res["loss"] > 0, res
