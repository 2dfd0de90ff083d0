"""The public API: Override, gm_transformation, inspection, last_train_step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from spmd_ort.graph.slots import SlotKind
import spmd_ort
from helpers import assert_same_state, classification_step
from models import MLP


class Gate(nn.Module):
    """Stands for a submodule that cannot be traced."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: untraceable
            return x * self.scale
        return x * self.scale


class TracedGate(nn.Module):
    """Traceable stand-in with the same parameter and the same maths."""

    def __init__(self, orig: Gate):
        super().__init__()
        self.scale = orig.scale

    def forward(self, x):
        return x * self.scale


class GatedMLP(MLP):
    def __init__(self):
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return self.head(self.gate(F.gelu(self.fc2(torch.relu(self.fc1(x))))))


class ReplaceGates(spmd_ort.Override):
    def __init__(self):
        self.seen: list[str] = []
        self.transforms = 0

    def replacement(self, fqn, orig):
        self.seen.append(fqn)
        return TracedGate(orig) if isinstance(orig, Gate) else orig

    def transform(self, gm, flat_state):
        self.transforms += 1
        assert all(isinstance(t, torch.Tensor) for t in flat_state)
        return gm


def test_override_replacement_makes_untraceable_module_compile():
    torch.manual_seed(0)
    eager = GatedMLP()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.Adam(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.Adam(model.parameters(), lr=1e-2)
    override = ReplaceGates()
    step = spmd_ort.compile(module_override=[override], backend="fx")(classification_step)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for _ in range(4):
        torch.testing.assert_close(step(model, opt_c, x, y), classification_step(eager, opt_e, x, y).detach())
    assert_same_state(eager, model, opt_e, opt_c)
    assert {"fc1", "fc2", "head", "gate"} <= set(override.seen)
    assert override.seen.count("gate") == 1  # replacements are applied once per module
    assert override.transforms == step.transitions.traces == 1  # Adam: its state is created before the trace
    assert isinstance(model.gate, TracedGate) and model.gate.scale is opt_c.param_groups[0]["params"][-1]


def test_failed_compile_undoes_replacements():
    class Broken(ReplaceGates):
        def transform(self, gm, flat_state):
            raise RuntimeError("transform failed")

    model = GatedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate = model.gate
    step = spmd_ort.compile(module_override=[Broken()], backend="fx")(classification_step)
    with pytest.raises(spmd_ort.CompileError, match=r"override_transform_pass\[Broken\].*transform failed"):
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert model.gate is gate  # the replacement was undone


def test_gm_transformation_once_per_variant_and_its_graph_is_what_runs():
    """The transformation doubles the returned loss (after backward has used it): the step returns twice
    eager's loss while the training itself is untouched, on every variant."""
    calls = []

    def double_returned_loss(gm: fx.GraphModule) -> fx.GraphModule:
        calls.append(gm)
        out = gm.graph.output_node()
        loss = out.args[0][0]
        with gm.graph.inserting_before(out):
            doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (loss, 2.0))
            doubled.meta["val"] = loss.meta["val"]
        out.args = ((doubled, *out.args[0][1:]),)
        return gm

    torch.manual_seed(0)
    model = MLP()
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True)
    step = spmd_ort.compile(gm_transformation=double_returned_loss, backend="fx")(classification_step)
    for batch in (8, 8, 8, 4, 4, 8):
        x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
        assert torch.equal(step(model, opt, x, y), 2 * classification_step(eager, opt_e, x, y).detach())
    assert len(calls) == 2 == step.transitions.traces  # batch 8 and batch 4
    assert_same_state(eager, model, opt_e, opt)
    assert any(r.name == "gm_transformation_pass" for r in step.compiled.passes_applied)


def test_last_train_step_changes_nothing_and_leaves_nothing_in_flight():
    """The reference API's flag drains deferred work; spmd_ort defers none, so both runs are identical."""
    torch.manual_seed(0)
    a = MLP()
    b = copy.deepcopy(a)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b))
    step_a, step_b = (spmd_ort.compile(backend="fx")(classification_step) for _ in range(2))
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    for i in range(3):
        la = step_a(a, opt_a, x, y, last_train_step=i == 2)
        lb = step_b(b, opt_b, x, y)
        assert torch.equal(la, lb)
        assert not step_a.runtime.comm.pending and not step_b.runtime.comm.pending
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_inspection():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = spmd_ort.compile(backend="fx")(classification_step)
    step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    prog = step.compiled
    assert isinstance(prog, spmd_ort.CompiledProgram)
    kinds = [s.kind for s in prog.input_slots]
    assert kinds.count(SlotKind.PARAM) == 6 and kinds.count(SlotKind.HPARAM) == 1 and kinds.count(SlotKind.BATCH) == 2
    assert [s.name for s in prog.output_slots if s.kind is SlotKind.OPT_STATE] == [
        f"{n}.momentum_buffer" for n, _ in model.named_parameters()]
    text = prog.describe()
    assert "remove_redundant_copies_pass" in text and "spmd_ort.sgd" in text and "aten.mm.default" in text
    assert sum(1 for n in prog.graph.nodes if n.op == "placeholder") == len(prog.input_slots)
    assert prog.steps_run == 1


def test_failing_pass_is_a_compile_error_naming_it(monkeypatch):
    from spmd_ort import passes as P

    def broken_pass(gm, ctx):
        raise ValueError("boom")

    real = P.build_pipeline
    monkeypatch.setattr(P, "build_pipeline", lambda *a, **k: [broken_pass] + real(*a, **k))
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    step = spmd_ort.compile(backend="fx")(classification_step)
    with pytest.raises(spmd_ort.CompileError, match="`broken_pass`.*boom"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("backend", ["fx", "ort"])
def test_a_torch_compiled_model_is_compiled_through_the_module_it_wraps(backend, caplog):
    """nanoGPT's train.py passes `torch.compile(model)`: that failed with a CompileError about dynamo whose fix
    pointed at the model's own forward.  The module it wraps is compiled (one INFO line says so), its parameters
    are the ones the optimizer steps, and training matches eager step by step."""
    import logging

    torch.manual_seed(0)
    model = MLP()
    eager = copy.deepcopy(model)
    wrapped = torch.compile(model)  # lazy: nothing is compiled by torch until it is called
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = spmd_ort.compile(backend=backend)(classification_step)
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="spmd_ort"):
        for i in range(3):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
            loss_e = classification_step(eager, opt_e, x, y)
            loss = step(wrapped, opt, x, y)
            torch.testing.assert_close(loss, loss_e.detach(), rtol=1e-5, atol=1e-6)
            assert_same_state(eager, model, opt_e, opt, where=f"step {i}", normwise=backend == "ort")
    said = [r.getMessage() for r in caplog.records if "torch.compile'd" in r.getMessage()]
    assert len(said) == 1 and "compiles the module it wraps (MLP)" in said[0], said
    assert len(step.variants) == 1
    assert all(torch.equal(v, model.state_dict()[k.removeprefix("_orig_mod.")])
               for k, v in wrapped.state_dict().items())  # the wrapper sees the trained weights
