"""reinplace_optimizer_pass: functional optimizer op -> in-place twin where safe."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spmd_ort.graph.slots import SlotKind
import spmd_ort
from spmd_ort.passes import PassContext, op_counts, reinplace_optimizer_pass, run_passes
from models import MLP


def _captured(opt_cls, **kw):
    """The captured graph of an MLP step (before backend passes) and real inputs for it."""
    model = MLP()
    opt = opt_cls(model.parameters(), **kw)

    def step(model, opt, x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    compiled = spmd_ort.compile(backend="fx", )(step)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    compiled(model, opt, x, y)  # creates optimizer state
    compiled(model, opt, x, y)
    prog = compiled.compiled
    gm = torch.fx.GraphModule(prog.traced_gm, prog.traced_gm.graph)
    from spmd_ort.passes import remove_redundant_copies_pass
    ctx = PassContext(input_slots=list(prog.input_slots), output_slots=list(prog.output_slots))
    gm = run_passes(gm, ctx, [remove_redundant_copies_pass])
    inputs = prog.layout.gather() + [x, y]
    return gm, ctx, inputs


def _run(gm, inputs):
    fresh = [t.detach().clone() for t in inputs]
    with torch.no_grad():
        return [o.clone() for o in gm(*fresh)]


def test_adam_is_reinplaced_and_numbers_unchanged():
    gm, ctx, inputs = _captured(torch.optim.AdamW, lr=1e-2)
    assert op_counts(gm)["spmd_ort.adam.default"] == 1
    expected = _run(gm, inputs)
    gm = run_passes(gm, ctx, [reinplace_optimizer_pass])
    gm.graph.lint()
    counts = op_counts(gm)
    assert counts["spmd_ort.adam.default"] == 0 and counts["spmd_ort.adam_.default"] == 1
    for a, b in zip(_run(gm, inputs), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # every updated param / state output is now the placeholder itself
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outs = list(gm.graph.output_node().args[0])
    for node, slot in zip(outs, ctx.output_slots):
        if slot.kind in (SlotKind.PARAM, SlotKind.OPT_STATE):
            assert node in placeholders


def test_first_sgd_momentum_step_is_not_reinplaced():
    """Momentum buffers are created on the first step: nothing to update in place."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(model, opt, x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    compiled = spmd_ort.compile(backend="fx")(step)
    compiled(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    counts = op_counts(compiled.compiled.gm)
    assert counts["spmd_ort.sgd.default"] == 1 and counts["spmd_ort.sgd_.default"] == 0
    compiled(model, opt, torch.randn(8, 32), torch.randint(0, 10, (8,)))
    counts = op_counts(compiled.compiled.gm)
    assert counts["spmd_ort.sgd.default"] == 0 and counts["spmd_ort.sgd_.default"] == 1


def test_old_value_read_after_update_blocks_reinplace():
    """A step that reads a parameter after opt.step() must see both old and new values correctly."""
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step(model, opt, x, y):
        before = model.fc1.weight * 1.0
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return (model.fc1.weight - before).abs().sum()

    compiled = spmd_ort.compile(backend="fx")(step)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    compiled(model, opt, x, y)
    w0 = model.fc1.weight.detach().clone()
    moved = compiled(model, opt, x, y)
    torch.testing.assert_close(moved, (model.fc1.weight - w0).abs().sum().detach())
    assert float(moved) > 0


def test_view_of_param_taken_before_update_follows_eager_semantics():
    """In eager, a view taken before opt.step() shows the updated values afterwards; so must the graph."""
    import copy
    model = MLP()
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.5)

    def step(model, opt, x, y):
        view = model.fc1.weight.t()
        snapshot = view.clone()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return (view - snapshot).abs().sum()  # the view moved with the parameter

    compiled = spmd_ort.compile(backend="fx")(step)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for _ in range(2):
        got, want = compiled(model, opt, x, y), step(eager, opt_e, x, y)
        torch.testing.assert_close(got, want)
        assert float(want.detach()) > 0
    torch.testing.assert_close(model.fc1.weight, eager.fc1.weight)
