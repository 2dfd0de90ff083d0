"""Inductor's candidate compiled in the background (spmd_ort.backends.inductor.BackgroundCompile, the tuner): a
forked process compiles it while the steps run, on one process and on 2 ranks; the step then loads it from the
cache that process filled, checks it and times it against what runs.  Every step's numbers are eager's (DDP's)."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch

import spmd_ort
from helpers import assert_same_state, resync, train_step
from launch import torchrun
from models import MLP
from spmd_ort import tuner
from spmd_ort.backends.inductor import cxx_compiler

pytestmark = pytest.mark.skipif(cxx_compiler() is None, reason="inductor's candidate needs a C++ compiler")

ADOPTED = re.compile(r"inductor candidate: compiled at step (\d+) and (kept|dropped) \(compiled in the background in "
                     r"[\d.]+ s, loaded at step \d+ in [\d.]+ s for \d+ nodes; \w+ [\d.]+ ms, inductor [\d.]+ ms\)")


def test_the_candidate_compiles_in_a_forked_process_while_the_steps_run(monkeypatch, tmp_path):
    """The default path with the background on (the segment timed faster on fx), and a cache of inductor's own:
    after the 3 measured steady steps the compile starts in a child; the steps go on (eager's numbers, every
    step) until it exits; the step then builds the candidate from what the child left in inductor's FX graph
    cache (hits, no miss), checks and times it, and keeps the faster."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("SPMD_ORT_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("SPMD_ORT_SEGMENT_EXECUTOR", raising=False)
    monkeypatch.delenv("SPMD_ORT_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuner.CompileCost, "predict", classmethod(lambda cls, nodes: (1e6, f"{nodes} nodes")))
    # the first run's timings fixed so that the steps run on fx until the candidate's choice: eager's kernels, so
    # the hundreds of steps a loaded machine may run while the child compiles carry no ORT rounding
    from spmd_ort.backends.ort import choice
    from spmd_ort.backends.ort import executor as executor_module
    from spmd_ort.backends.ort.stats import WholeChoice

    def fx_wins(runners, inputs, stats, field="whole", keep=None):  # the whole graph too (ORT only is a candidate)
        setattr(stats, field, WholeChoice("fx", (("ort", 2.0), ("fx", 1.0))))
        return "fx"

    monkeypatch.setattr(choice, "fastest", lambda run, args, first: 2e-3)
    monkeypatch.setattr(choice, "timed_fx_runs", lambda run, args, repeat: (1e-3, run(*args)))
    monkeypatch.setattr(executor_module, "choose_whole", fx_wins)
    torch.manual_seed(0)
    model_e = MLP()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model_e, model_c))
    step = spmd_ort.compile(backend="auto", dynamic=False)(train_step)
    g = torch.Generator().manual_seed(0)
    before = dict(counters["inductor"])
    decided, i = [], 0
    # a tiny step, and the child's compile takes seconds, or minutes where other tests load the machine (at the
    # lowest priority it gets what they leave: 4000 steps once passed before it finished, two suites at once)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        i += 1
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        torch.testing.assert_close(step(model_c, opt_c, x, y), train_step(model_e, opt_e, x, y).detach())
        assert_same_state(model_e, model_c, opt_e, opt_c, where=f"step {i}", normwise=True)
        decided = [str(d) for d in step.tuner.decisions if d.subject == "inductor candidate"]
        adopted = ADOPTED.match(decided[-1]) if decided else None
        if adopted and i >= int(adopted.group(1)) + 2:
            break  # two steps ran on what won
        resync(model_c, opt_c, model_e, opt_e)  # each step compared alone (hundreds drift apart by rounding)
        time.sleep(0.05)
    assert decided[0].startswith("inductor candidate: compiling in the background from step 5 (a forked process "
                                 "at the lowest priority, one thread, while the steps run at "), decided
    assert len(decided) == 2 and ADOPTED.match(decided[1]), decided
    assert int(ADOPTED.match(decided[1]).group(1)) > 5
    assert step.compiled.executor.stats.upgrade is not None
    hits = counters["inductor"]["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0)
    misses = counters["inductor"]["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0)
    assert hits >= 1 and misses == 0, (hits, misses)  # this process loaded what the child compiled


def test_two_ranks_adopt_at_the_same_step_once_both_children_exited(tmp_path):
    """2 gloo ranks, each compiling in a child of its own (one compiles under the graph's lock, the other loads
    from the cache): they adopt at the same step, trained against DDP every step."""
    run = torchrun("background_compile.py", out=tmp_path / "out", timeout=400,
                   env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "SPMD_ORT_BACKGROUND_COMPILE": "1",
                        "SPMD_ORT_CACHE_DIR": str(tmp_path / "cache")})
    outcomes = []
    for r in run.ranks:  # (bucket_cap_mb='auto' recompiles once: the dropped variant's child is killed)
        candidate = [d for d in r["decided"] if d.startswith("inductor candidate")]
        assert candidate[0].startswith("inductor candidate: compiling in the background from step 5"), r
        adopted = ADOPTED.match(candidate[-1])
        assert adopted and all("compiling in the background" in d for d in candidate[:-1]), r
        outcomes.append(adopted.groups())
    assert outcomes[0] == outcomes[1], outcomes


@pytest.mark.parametrize("mode,local_ranks,expected", [("auto", 1, True), ("auto", 2, False), ("1", 2, True),
                                                       ("0", 1, False)])
def test_auto_compiles_in_the_background_only_where_a_core_is_idle(monkeypatch, mode, local_ranks, expected):
    """4 cores, 2 torch threads a rank: one rank leaves 2 cores idle (a child compiles there), two ranks leave
    none (the candidate is bought in the step, where a child would slow the steps); ``1`` and ``0`` force it."""
    import os

    from torch import fx

    from spmd_ort.backends.inductor import BackgroundCompile

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert BackgroundCompile.available(fx.symbolic_trace(torch.nn.Linear(2, 2)), mode) is expected
