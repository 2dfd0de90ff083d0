"""Kept plans (spmd_ort/plan/cache.py): the same ``plan()`` again is read from ``SPMD_ORT_CACHE_DIR/plans``, equal
to a fresh one; anything that decides a plan (the call, the model, the optimizer, the step, the user's code) plans
afresh; a damaged entry is planned again and rewritten."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

import spmd_ort
from examples.gpt import GPT, GPTConfig
from helpers import train_step
from spmd_ort import compiler
from spmd_ort.plan import cache as plans

CFG = GPTConfig(vocab=96, seq=16, d=64, heads=4, layers=2, split_qkv=True)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Plans kept, in a cache of this test's own."""
    monkeypatch.setenv("SPMD_ORT_PLAN_CACHE", "1")
    monkeypatch.setenv("SPMD_ORT_CACHE_DIR", str(tmp_path))
    return tmp_path / "plans"


def _plan(step=None, cfg: GPTConfig = CFG, lr: float = 1e-3, batch: int = 4, **kwargs):
    with torch.device("meta"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    step = step or spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(parallel_style="fully_shard"),
                                    backend="fx")(train_step)
    tokens = torch.empty(batch, cfg.seq, dtype=torch.long, device="meta")
    return step.plan(model, opt, tokens, tokens.clone(), **{"world_size": 8, "device": "h100", **kwargs})


def _figures(plan) -> dict:
    out = plan.as_dict()
    for k in ("planning_s", "cached_from", "first_planning_s"):
        out.pop(k)
    return out


def test_the_same_plan_again_is_read_from_the_cache_without_tracing(kept, monkeypatch):
    first = _plan()
    assert first.cached_from is None and len(list(kept.glob("*.pkl"))) == 1
    monkeypatch.setattr(compiler.Compiler, "compile", lambda *a, **k: pytest.fail("traced again"))
    again = _plan()
    assert again.cached_from == str(next(kept.glob("*.pkl"))) and again.first_planning_s == first.planning_s
    assert _figures(again) == _figures(first) and again.memory_over_step == first.memory_over_step
    assert "from the cache, planned in" in again.explain()
    monkeypatch.undo()  # (the fixture's settings too: plan.on plans again, here uncached)
    assert _figures(again.on("a100")) == _figures(first.on("a100"))  # a kept plan has no graph: planned again


@pytest.mark.parametrize("change", ["world size", "batch", "model", "optimizer", "options", "step"])
def test_what_decides_a_plan_plans_afresh(kept, change):
    _plan()
    changed = {"world size": lambda: _plan(world_size=16),
               "batch": lambda: _plan(batch=2),
               "model": lambda: _plan(cfg=GPTConfig(vocab=96, seq=16, d=64, heads=2, layers=2, split_qkv=True)),
               "optimizer": lambda: _plan(lr=2e-3),
               "options": lambda: _plan(step=spmd_ort.compile(
                   parallel_mode=spmd_ort.DataParallel(parallel_style="fully_shard"), backend="fx",
                   activation_memory_budget=0.5)(train_step)),
               "step": lambda: _plan(step=spmd_ort.compile(
                   parallel_mode=spmd_ort.DataParallel(parallel_style="fully_shard"), backend="fx")(
                   lambda model, opt, x, y: train_step(model, opt, x, y)))}[change]
    assert changed().cached_from is None
    assert len(list(kept.glob("*.pkl"))) == 2


def test_an_edit_to_the_users_code_plans_afresh(kept, tmp_path, monkeypatch):
    """The step's helper lives in a module of the user's: an edit to it (the step function itself unchanged)
    changes the key."""
    src = tmp_path / "user_code" / "user_loss.py"
    src.parent.mkdir()
    src.write_text("def scale():\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(src.parent))
    import user_loss

    def step_fn(model, opt, x, y):
        return train_step(model, opt, x, y) * user_loss.scale()

    step = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(parallel_style="fully_shard"), backend="fx")(step_fn)
    assert _plan(step=step).cached_from is None
    assert _plan(step=step).cached_from is not None
    src.write_text("def scale():\n    return 2.0\n")
    importlib.reload(user_loss)
    try:
        assert _plan(step=step).cached_from is None
    finally:
        sys.modules.pop("user_loss", None)


def test_a_damaged_entry_is_planned_again_and_rewritten(kept, caplog):
    first = _plan()
    (entry,) = kept.glob("*.pkl")
    entry.write_bytes(b"\x80\x04garbage")
    with caplog.at_level(logging.WARNING, logger="spmd_ort.plan.cache"):
        again = _plan()
    assert again.cached_from is None and "does not load" in caplog.text
    assert _figures(again) == _figures(first)
    assert _plan().cached_from == str(entry)  # rewritten


def test_cache_false_neither_reads_nor_keeps(kept):
    _plan(cache=False)
    assert not kept.exists()
    _plan()
    assert _plan(cache=False).cached_from is None


def test_a_value_without_a_stable_form_never_matches():
    """An object printed with its address gives a key of its own each time it is made (a miss, never a stale
    plan); numbers, strings, dtypes and tensors' shapes are stable."""
    assert plans._plain(object()) != plans._plain(object())
    assert plans._plain((1, "a", torch.float32, {"k": 2.0})) == plans._plain((1, "a", torch.float32, {"k": 2.0}))
    assert plans._plain(torch.empty(2, 3, device="meta")) == plans._plain(torch.empty(2, 3))
