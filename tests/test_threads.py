"""Compiled steps in several threads of one process.

torch's tracers keep process-wide state, so compiles are serialized
(``spmd_ort.capture.trace.COMPILE_LOCK``); runs are not, and a run must not be
disturbed by another step's compile going on meanwhile.  Eager PyTorch is the
oracle for every step of every thread.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch import fx

import spmd_ort
from helpers import assert_same_state, train_side_by_side, train_step
from models import MLP, FunctionMLP, ScaleByMax
from spmd_ort.backends.timed import TimedInterpreter
from spmd_ort.backends.ort.choice import FirstRun
from spmd_ort.runtime.interpreter import RunInterpreter

STEPS = 2


def _batches(d_in: int, seed: int, n: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, d_in, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def _case(make_model, d_in: int, seed: int) -> dict:
    """A model, its optimizer and batches, and the eager reference: the state after each step."""
    torch.manual_seed(seed)
    model = make_model()
    compiled_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    batches = _batches(d_in, seed)
    eager = []
    for x, y in batches:
        train_step(model, opt, x, y)
        eager.append((copy.deepcopy(model), copy.deepcopy(opt.state_dict())))
    return {"model": compiled_model, "opt": torch.optim.AdamW(compiled_model.parameters(), lr=1e-2, fused=True),
            "batches": batches, "eager": eager, "eager_model": model, "eager_opt": opt}


def _check(case: dict, backend: str, where: str) -> None:
    # fused AdamW: on fx the compiled update is eager's own kernel, bit for bit; ORT rounds differently (normwise)
    assert_same_state(case["eager_model"], case["model"], case["eager_opt"], case["opt"], where=where,
                      normwise=backend == "ort")
    if backend == "fx":
        for (name, a), b in zip(case["eager_model"].named_parameters(), case["model"].parameters(), strict=True):
            assert torch.equal(a, b), f"{where}: {name} not bitwise equal to eager"


@pytest.mark.parametrize("backend,rounds", [("fx", 20), ("ort", 3)])
def test_first_calls_of_two_steps_from_two_threads(backend, rounds):
    """Two compiled steps make their first call at the same moment from two threads, ``rounds`` times: each
    trains as eager does, and afterwards torch.fx's preserve-node-meta flag is unset and a new compile works.

    (Before compiles were serialized: torch-internal assertions such as ``CURRENT_PATCHER is None in finally
    block``, and the flag left set, so that every later compile in the process failed.)  One step has an
    opaque Function: its first run executes the Function eagerly while the other step may be tracing."""
    for r in range(rounds):
        cases = [_case(MLP, 32, seed=2 * r), _case(lambda: FunctionMLP(ScaleByMax), 16, seed=2 * r + 1)]
        start = threading.Barrier(len(cases))
        errors: list[BaseException] = []

        def work(case: dict) -> None:
            try:
                step = spmd_ort.compile(backend=backend)(train_step)
                start.wait()
                for x, y in case["batches"]:
                    step(case["model"], case["opt"], x, y)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(c,)) for c in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for k, case in enumerate(cases):
            _check(case, backend, f"round {r} thread {k}")
    assert not fx_traceback.has_preserved_node_meta()
    torch.manual_seed(7)
    train_side_by_side(MLP, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), train_step,
                       _batches(32, seed=99, n=3), backend=backend)  # (3: steps 2 and 3 on the backend's outputs)


def test_runs_go_on_while_another_step_compiles():
    """A compiled step keeps running, with eager's results and without waiting, while another step compiles.

    The compiling step's model uses the same untraceable Function: its trace patches ``Function.apply`` and
    installs module hooks for the whole process, which must leave the running step's eager parts alone."""
    torch.manual_seed(0)
    model = FunctionMLP(ScaleByMax)
    eager_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, fused=True)
    x, y = _batches(16, seed=1, n=1)[0]
    running = spmd_ort.compile(backend="fx")(train_step)
    running(model, opt, x, y)
    train_step(eager_model, eager_opt, x, y)
    stop = threading.Event()
    finished: list[float] = []  # when each step of the running thread ended
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                running(model, opt, x, y)
                train_step(eager_model, eager_opt, x, y)  # eager, in this thread, also while the other traces
                finished.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        other = FunctionMLP(ScaleByMax)
        t0 = time.perf_counter()
        spmd_ort.compile(backend="fx")(train_step)(other, torch.optim.AdamW(other.parameters()), x, y)
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]
    assert any(t0 < t < t1 for t in finished), "the running step waited for the other step's compile"
    assert_same_state(eager_model, model, eager_opt, opt, where=f"after {len(finished) + 1} steps")


def test_running_a_graph_leaves_torch_fx_current_meta_alone():
    """Run-time interpreters (first run, float64 check, profiled steps) do not publish node meta into
    torch.fx's process-wide current meta, which a trace in another thread copies onto its new nodes while
    ``preserve_node_meta`` is on: that trace's nodes would take this graph's phase tags."""
    from spmd_ort.graph.checking import _Float64

    assert all(issubclass(cls, RunInterpreter) for cls in (FirstRun, TimedInterpreter, _Float64))
    seen: list[dict] = []

    def probe(x):
        seen.append(dict(fx_traceback.get_current_meta()))
        return x + 1

    graph = fx.Graph()
    out = graph.call_function(probe, (graph.placeholder("x"),))
    out.meta["custom"] = {"phase": "backward"}
    graph.output(out)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with fx_traceback.preserve_node_meta():  # as another thread's trace holds it
        assert torch.equal(RunInterpreter(gm).run(torch.zeros(2)), torch.ones(2))
    assert seen == [{}]


@pytest.mark.parametrize("user_disabled", [False, True])
def test_the_garbage_collector_is_paused_while_compiling_and_left_as_it_was(user_disabled):
    """A compile runs with Python's cyclic collector off (it would walk every object the process holds some
    190 times in a gpt-mini compile), then leaves it as the user had it; training is unchanged."""
    import gc

    case = _case(MLP, 32, seed=3)
    seen = []

    def step(model, opt, x, y):
        seen.append(gc.isenabled())
        return train_step(model, opt, x, y)

    compiled = spmd_ort.compile(backend="fx")(step)
    was = gc.isenabled()
    if user_disabled:
        gc.disable()
    try:
        for x, y in case["batches"]:
            compiled(case["model"], case["opt"], x, y)
        assert gc.isenabled() is not user_disabled
    finally:
        if was:
            gc.enable()
    assert seen == [False], "the step ran under the trace once, with the collector off"
    _check(case, "fx", "after the compiled steps")
