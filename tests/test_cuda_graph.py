"""``compile(cuda_graph=True)`` on the CPU: the option, its no-op on the CPU, and the graphed runner's plumbing.

A CUDA graph replays the kernels it captured on the buffers it captured: inputs reach a replay only through
those buffers, its outputs are the same tensors every replay, and what the host read at capture is frozen.  The
runner (:class:`spmd_ort.backends.cuda_graph.GraphedExecutor`) is built so that a replay is still the step the
user called: the batch copied into its buffers, hyper-parameters written into theirs, a replaced state tensor or
a changed hyper-parameter captured again, one graph per size.  Here a CPU stands in for the GPU with
:class:`RerunGraph`, which keeps those properties of a graph (what it captured is run again on the buffers it
captured, its outputs written into the tensors the capture returned, the capture itself changes nothing), so
each piece of plumbing is checked against eager, bit for bit, on every step.  The capture and replay on a GPU
are tests/test_cuda.py's (``bash bench/cuda.sh``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_ort
from helpers import train_step
from models import MLP
from spmd_ort.backends.cuda_graph import WARMUP_RUNS, GraphedExecutor


class RerunGraph:
    """A CPU graph: ``capture(fn)`` runs ``fn`` once for its output tensors and puts back every tensor it changed
    (a capture runs nothing), ``replay()`` runs ``fn`` again, on the tensors it captured, and writes its results
    into those outputs (a replay writes the capture's buffers)."""

    def __init__(self, pool=None):
        self.fn = None
        self.outputs: list = []

    def capture(self, fn, reads):
        saved = [(t, t.detach().clone()) for t in reads if isinstance(t, torch.Tensor)]
        self.fn = fn
        self.outputs = fn()
        with torch.no_grad():
            for t, before in saved:
                t.copy_(before)
        return self.outputs

    def replay(self):
        new = self.fn()
        with torch.no_grad():
            for out, value in zip(self.outputs, new, strict=True):
                if isinstance(out, torch.Tensor) and out is not value:
                    out.copy_(value)


class FailingGraph:
    def __init__(self, pool=None):
        pass

    def capture(self, fn, reads):
        raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self):  # pragma: no cover - never captured
        raise AssertionError


CPU = "the step runs on the CPU: there is nothing to capture"


def _graph_on_cpu(step, factory=RerunGraph, segmented: bool = False) -> GraphedExecutor:
    """The CPU stands in for a GPU: the step's program runs as graphs captured with ``factory`` (``segmented``:
    one per run of nodes between host nodes, where no tensor counts as a host tensor)."""
    program = step.compiled
    runner = program.executor
    assert isinstance(runner, GraphedExecutor), type(runner)
    assert runner.disabled == CPU
    program.executor = GraphedExecutor(runner.inner, program.input_slots, graph_factory=factory,
                                       segmented=segmented, host="meta")
    graphed = program.executor
    graphed.runs = 1  # the first run, made by the executor it replaces
    for runs in [graphed.whole] if graphed.whole is not None else [seg.runs for seg in graphed.segments]:
        runs.runs = 1
    return graphed


def _adamw(m, lr=2.0**-7):
    return torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1, fused=True)


def _batches(n: int, sizes=(8,)) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(sizes[i % len(sizes)], 32, generator=g),
             torch.randint(0, 10, (sizes[i % len(sizes)],), generator=g)) for i in range(n)]


def _same(model_e, model_c, opt_e, opt_c, where: str) -> None:
    for (name, a), b in zip(model_e.named_parameters(), model_c.parameters()):
        assert torch.equal(a, b), f"{where}: {name} differs by {float((a - b).abs().max())}"
    sa, sb = opt_e.state_dict(), opt_c.state_dict()
    assert sa["state"].keys() == sb["state"].keys(), where
    for k in sa["state"]:
        for n, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][n]), f"{where}: state {k}.{n} differs"
    assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]], where


def _clipped(m, o, x, y):
    return train_step(m, o, x, y, clip=1.0)


def _train(batches, *, factory=RerunGraph, between=None, segmented=False, **compile_kwargs):
    """Eager and a compiled copy whose runner graphs on the CPU, step by step, checked bit for bit; ``between(i,
    (model, opt, sched) eager, compiled)`` runs after step i on both."""
    torch.manual_seed(0)
    model_e = MLP()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = _adamw(model_e), _adamw(model_c)
    halve = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731 - exact in binary
    sched_e, sched_c = halve(opt_e), halve(opt_c)
    step = spmd_ort.compile(backend="fx", cuda_graph=True, **compile_kwargs)(_clipped)
    runner = None
    for i, (x, y) in enumerate(batches):
        loss_e = _clipped(model_e, opt_e, x, y)
        loss_c = step(model_c, opt_c, x, y)
        if step.compiled.executor.disabled == CPU:  # a new variant: it runs as graphs from its second run
            graphed = _graph_on_cpu(step, factory, segmented)
            runner = runner or graphed
        assert torch.equal(loss_c, loss_e.detach()), f"step {i}: loss {float(loss_c)} vs eager {float(loss_e)}"
        _same(model_e, model_c, opt_e, opt_c, f"step {i}")
        sched_e.step()
        sched_c.step()
        if between is not None:
            between(i, (model_e, opt_e, sched_e), (model_c, opt_c, sched_c))
    return step, runner


def test_the_option_is_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(spmd_ort.ConfigError, match="cuda_graph='yes'"):
        spmd_ort.compile(cuda_graph="yes")
    monkeypatch.setenv("SPMD_ORT_CUDA_GRAPH", "1")
    assert spmd_ort.compile(backend="fx")(_clipped).options.cuda_graph
    assert not spmd_ort.compile(backend="fx", cuda_graph=False)(_clipped).options.cuda_graph
    monkeypatch.setenv("SPMD_ORT_CUDA_GRAPH", "maybe")
    with pytest.raises(spmd_ort.ConfigError, match="SPMD_ORT_CUDA_GRAPH='maybe'"):
        spmd_ort.compile(backend="fx")


def test_on_the_cpu_the_option_changes_nothing_and_says_why():
    """No graph on the CPU: every run is the fx executor's, bit for bit eager's, and explain() says why."""
    torch.manual_seed(0)
    model_e = MLP()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = _adamw(model_e), _adamw(model_c)
    step = spmd_ort.compile(backend="fx", cuda_graph=True)(_clipped)
    for i, (x, y) in enumerate(_batches(4)):
        assert torch.equal(step(model_c, opt_c, x, y), _clipped(model_e, opt_e, x, y).detach()), i
        _same(model_e, model_c, opt_e, opt_c, f"step {i}")
    runner = step.compiled.executor
    assert runner.captures == 0 and runner.runs == 4 and not runner.reuses_buffers
    assert "CUDA graphs: not used: the step runs on the CPU" in step.explain()
    assert all(t.device.type == "cpu" for t in step.compiled.layout.hparam_tensors)


@pytest.mark.on_ort
def test_explain_says_why_on_every_backend():
    """Issue 55 item 8: the ORT backend is never wrapped (its sessions run outside torch's stream), and explain()
    said nothing of the option there; it now says, as fx and inductor do, why no graph is used."""
    torch.manual_seed(0)
    model = MLP()
    opt = _adamw(model)
    step = spmd_ort.compile(backend="ort", cuda_graph=True)(_clipped)
    for x, y in _batches(2):
        step(model, opt, x, y)
    assert "CUDA graphs: not used: the step runs on the CPU: there is nothing to capture" in step.explain()
    assert spmd_ort.backends.cuda_graph.unwrapped_reason("ort", True).startswith(
        "the ort backend runs its kernels outside torch's stream")


def test_a_replay_sees_each_batch_and_learning_rate_through_its_buffers():
    """After the warm-up runs, one capture, then replays: each step's batch is copied into the graph's buffers
    and its learning rate (StepLR halves it every 2 steps) written into the group's hyper-parameter tensor, and
    the outputs, the same tensors every replay, are copied where they escape: eager's numbers every step."""
    batches = _batches(8)
    step, runner = _train(batches)
    assert (runner.captures, runner.replays, runner.runs) == (1, len(batches) - WARMUP_RUNS, len(batches))
    assert runner.reuses_buffers and not runner.whole.recaptured
    assert "CUDA graphs: the whole step: 1 kept (1 captures, 6 replays in 8 runs)" in step.explain()


def test_a_replaced_state_tensor_or_a_changed_hyper_parameter_captures_again():
    """A graph reads the tensors it captured: an optimizer state loaded from a checkpoint (new tensors) is
    captured again (else its replays would update the state it replaced), and so is a weight decay changed by
    the user (a number in the captured kernels; on the CPU the kernels read it anyway, so here the count is what
    shows it); the learning rate, a device tensor, never is."""
    saved = {}

    def between(i, eager, compiled):
        if i == 1:
            for k, (_, opt, _) in enumerate((eager, compiled)):
                saved[k] = copy.deepcopy(opt.state_dict())
        if i == 3:  # the optimizer's state of step 1, from a checkpoint: new tensors, other values
            for k, (_, opt, _) in enumerate((eager, compiled)):
                opt.load_state_dict(saved[k])
        if i == 5:
            for _, opt, _ in (eager, compiled):
                opt.param_groups[0]["weight_decay"] = 0.05

    step, runner = _train(_batches(9), between=between)
    assert runner.captures == 3, runner.describe()
    assert sorted(runner.whole.recaptured.values()) == [1, 1], runner.whole.recaptured
    assert any("another tensor than the one captured" in why for why in runner.whole.recaptured)
    assert any("other than the learning rate" in why for why in runner.whole.recaptured)


def test_symbolic_sizes_get_one_graph_per_size():
    """One program for every batch size (dynamic shapes), a graph for each size seen twice, reused when it comes
    back."""
    batches = _batches(8, sizes=(8, 8, 8, 4, 8, 4, 6, 8))
    step, runner = _train(batches, dynamic=True)
    assert len(step.variants) == 1 and step.compiled.symbolic is not None
    # a size is captured on its second run (its first does its lazy work): 8 on the third call, 4 on the sixth;
    # 6, seen once, runs uncaptured
    assert runner.captures == 2 and len(runner.whole.graphs) == 2 and runner.replays == 4, runner.describe()


def test_a_capture_that_fails_runs_the_step_as_before_and_says_why(caplog):
    """A capture that fails (what a GPU says of a host sync in the step) is a WARNING; the step runs uncaptured
    from then on, eager's numbers, and explain() names the cause."""
    with caplog.at_level("WARNING", logger="spmd_ort"):
        step, runner = _train(_batches(5), factory=FailingGraph)
    assert runner.captures == 0 and runner.disabled.startswith("capture failed: RuntimeError")
    assert "CUDA graphs: not used: capture failed" in step.explain()
    assert sum("runs without graphs from now on" in r.getMessage() for r in caplog.records) == 1


def test_a_step_split_by_host_nodes_runs_each_run_between_them_as_a_graph():
    """An opaque part (the user's Python, run as host nodes) splits the step: each run of nodes between host
    nodes is a graph of its own, whose inputs made by a host node (the opaque forward's output, its backward's
    gradients) are copied into its buffers each step and whose inputs another graph wrote are read in place:
    eager's numbers, bit for bit, every step.  (The optimizer, which skips the parameters no opaque part gave a
    gradient by reading which on the host, runs between graphs.)"""
    batches = _batches(7)
    step, runner = _train(batches, segmented=True, module_override=spmd_ort.OpaqueOverride("fc2"))
    assert step.compiled.opaque, "fc2 runs opaquely"
    assert len(runner.segments) >= 2, runner.describe()
    copied = [seg.runs.copied - next(iter(seg.runs.graphs.values())).shared for seg in runner.segments]
    shared = [next(iter(seg.runs.graphs.values())).shared for seg in runner.segments]
    assert any(copied) and any(shared), (copied, shared)  # both paths taken
    host = {n.target for n in runner.split.graph.nodes if n.op == "call_function"}
    assert torch.ops.spmd_ort.grads_present.default in host and torch.ops.spmd_ort.adam_.default in host, host
    assert all(seg.runs.captures == 1 and seg.runs.replays == len(batches) - WARMUP_RUNS
               for seg in runner.segments), runner.describe()
    lines = "\n".join(runner.graph_lines())
    assert f"one per run of nodes between host nodes: {len(runner.segments)} segments" in lines, lines


def test_what_the_plan_says_decides_how_a_gpu_step_is_graphed():
    """On a GPU: one graph where the capture plan finds no host node, one per run between host nodes on fx
    where it finds some, none (and why) where it is blocked, for other backends' split steps and for steps with
    collectives."""
    from spmd_ort.backends.cuda_graph import graphed
    from spmd_ort.passes.analysis import CapturePlan

    torch.manual_seed(0)
    model = MLP()
    step = spmd_ort.compile(backend="fx", cuda_graph=True)(_clipped)
    step(model, _adamw(model), *_batches(1)[0])
    inner, slots = step.compiled.executor.inner, step.compiled.input_slots
    whole = graphed(inner, CapturePlan(cuda=True, regions=(40,)), slots, "fx")
    assert whole.disabled is None and whole.whole is not None
    split = graphed(inner, CapturePlan(cuda=True, regions=(20, 20), splits=(("x", "why"),)), slots, "fx")
    assert split.disabled is None and split.whole is None and split.split is not None
    other = graphed(inner, CapturePlan(cuda=True, regions=(20, 20), splits=(("adam", "reads steps"),)), slots,
                    "inductor")
    assert "adam: reads steps" in other.disabled and "fx backend only" in other.disabled
    blocked = graphed(inner, CapturePlan(cuda=True, blocker="nonzero: sizes"), slots, "fx")
    assert blocked.disabled == "nonzero: sizes"
    assert graphed(inner, CapturePlan(cuda=True, regions=(4,)), slots, "ort") is inner  # ORT: as it is


def test_a_split_step_graphs_each_size_in_every_segment():
    """Sizes that alternate, in a step split by an opaque part (a program per size: opaque parts keep sizes
    static): every segment of each keeps its graph, none captured again or given up, eager's numbers."""
    batches = _batches(10, sizes=(8, 8, 8, 4, 8, 4, 8, 4, 8, 4))
    step, _ = _train(batches, segmented=True, module_override=spmd_ort.OpaqueOverride("fc2"))
    assert len(step.variants) == 2
    for program in step.variants:
        for seg in program.executor.segments:
            assert seg.runs.disabled is None and not seg.runs.recaptured, program.executor.describe()
            assert seg.runs.captures == 1 and seg.runs.replays >= 2, program.executor.describe()
