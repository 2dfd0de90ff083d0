"""insert_index_checks_pass: eager's index bounds checks on every backend (ORT's Gather wraps -1 silently)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import spmd_ort
from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.passes import PassContext, insert_index_checks_pass, op_counts, run_passes
from spmd_ort.passes.index_checks import IndexChecks
from spmd_ort.graph.ops import check_index
from helpers import assert_ran_on_ort

CHECK = "spmd_ort.check_index.default"


# ---------------------------------------------------------------------- the pass on a small graph
def _graph_step(w, ids, y):
    logits = F.embedding(ids, w) @ w.t()  # ids: an input, checked on the input itself
    loss = F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten())  # y[:, 1:]: computed from an input
    top = logits.topk(2).indices  # computed by the model: never checked
    return loss + w.index_select(0, top.flatten()).sum()


def _graph_inputs(ids_value: int = 1):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 6, generator=g)
    ids = torch.randint(0, 6, (2, 3), generator=g)
    ids[0, 1] = ids_value
    y = torch.randint(0, 6, (2, 4), generator=g)
    y[1, 0] = -7  # only in the column the step drops: eager never reads it
    return w, ids, y


def _slots():
    return [Slot(SlotKind.PARAM, "w", 0), Slot(SlotKind.BATCH, "ids", 0), Slot(SlotKind.BATCH, "batch['y']", 1)]


def test_pass_checks_indices_from_inputs_only_and_keeps_numbers():
    w, ids, y = _graph_inputs()
    gm = make_fx(_graph_step, tracing_mode="fake")(w, ids, y)
    expected = gm(w, ids, y)
    ctx = PassContext(input_slots=_slots(), output_slots=[None], check_contracts=True)
    gm = run_passes(gm, ctx, [insert_index_checks_pass])
    gm.graph.lint()
    assert op_counts(gm)[CHECK] == 2  # ids (embedding and its backward share one), y[:, 1:]; not topk's indices
    checks = [n for n in gm.graph.nodes if n.target is check_index]
    first_op = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is not check_index
                    and not n.meta.get("host_only"))
    assert all(c < first_op for c in checks), "the checks run before anything else"
    embedding = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    assert embedding.args[1].target is check_index and embedding.args[1].args[0].op == "placeholder"
    assert ctx.results.get(IndexChecks).checked == {"ids": ("aten.embedding",),
                                                    "batch['y']": ("aten.nll_loss_forward",)}
    torch.testing.assert_close(gm(w, ids, y), expected, rtol=0, atol=0)
    with pytest.raises(spmd_ort.InputIndexError, match=r"input `ids` holds 6 at \[0, 1\]: .*accepts \[0, 6\)") as err:
        gm(*_graph_inputs(ids_value=6))
    assert (err.value.input, err.value.op, err.value.value, err.value.position) == ("ids", "aten.embedding", 6, (0, 1))


def test_computed_index_is_checked_where_the_op_reads_it():
    w, ids, y = _graph_inputs()
    y[0, 2] = -1  # read by the loss (y[:, 1:]): not its ignore_index
    gm = run_passes(make_fx(_graph_step, tracing_mode="fake")(w, ids, y),
                    PassContext(input_slots=_slots(), output_slots=[None]), [insert_index_checks_pass])
    with pytest.raises(IndexError, match=r"the indices that aten.nll_loss_forward reads, computed from input "
                                         r"`batch\['y'\]`, hold -1 at \[1\]: .*or its ignore_index -100"):
        gm(w, ids, y)


def _step_with_a_constant(w, y):
    h = torch.tanh(w * 2)
    target = torch.where(y == 5, torch.tensor(0), y)  # computed from the input and a constant the trace keeps
    return F.cross_entropy(h, target)


def test_a_computed_index_reading_a_constant_defined_further_down_is_checked_at_the_top():
    """T5 shifts its labels with a tensor constant: the trace keeps it as an attribute read where it is used, and
    the host copy of the index reads it at the top of the graph."""
    w, y = torch.randn(4, 6), torch.tensor([1, 5, 2, 3])
    gm = make_fx(_step_with_a_constant, tracing_mode="fake")(w, y)
    ctx = PassContext(input_slots=[Slot(SlotKind.PARAM, "w", 0), Slot(SlotKind.BATCH, "y", 0)], output_slots=[None],
                      check_contracts=True)
    gm = run_passes(gm, ctx, [insert_index_checks_pass])
    gm.graph.lint()
    torch.testing.assert_close(gm(w, y), _step_with_a_constant(w, y))
    with pytest.raises(spmd_ort.InputIndexError, match="computed from input `y`, hold 6 at \\[3\\]"):
        gm(w, torch.tensor([1, 5, 2, 6]))


# ---------------------------------------------------------------------- compiled steps: eager's errors, state kept
class Indexed(nn.Module):
    """A parameter read through ``op(weight, idx, src)``: each op of the table as a model uses it."""

    def __init__(self, op: Callable):
        super().__init__()
        self.op = op
        self.weight = nn.Parameter(torch.randn(5, 3))
        self.src = nn.Parameter(torch.randn(4, 3))
        self.head = nn.Linear(3, 5)

    def forward(self, idx):
        return self.op(self.weight, idx, self.src, self.head)


def _loss_of(out):
    return (out.float() ** 2).mean()


OPS: dict[str, tuple[Callable, tuple[int, ...], bool]] = {
    # name: (op(weight, idx, src, head), index shape, whether eager wraps negative indices)
    "embedding": (lambda w, i, s, h: _loss_of(F.embedding(i, w)), (4,), False),
    "index_select": (lambda w, i, s, h: _loss_of(w.index_select(0, i)), (4,), False),
    "gather": (lambda w, i, s, h: _loss_of(w.gather(0, i.view(-1, 1).expand(-1, 3))), (4,), False),
    "scatter_add": (lambda w, i, s, h: _loss_of(w.scatter_add(0, i.view(-1, 1).expand(-1, 3), s)), (4,), False),
    "index_add": (lambda w, i, s, h: _loss_of(w.index_add(0, i, s)), (4,), False),
    "index": (lambda w, i, s, h: _loss_of(w[i]), (4,), True),
    "cross_entropy": (lambda w, i, s, h: F.cross_entropy(h(s), i), (4,), False),
    "cross_entropy_2d": (lambda w, i, s, h: F.cross_entropy(h(s).T.reshape(1, 5, 2, 2), i.view(1, 2, 2)), (4,),
                         False),
}


def _step(model, opt, idx):
    loss = model(idx)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            copy.deepcopy(opt.state_dict()))


def _assert_unchanged(before: tuple, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    params, grads, state = before
    now = _snapshot(model, opt)
    for n in params:
        assert torch.equal(params[n], now[0][n]), n
        assert (grads[n] is None) == (now[1][n] is None), n
    assert state["param_groups"] == now[2]["param_groups"]
    assert state["state"].keys() == now[2]["state"].keys()
    for k, entries in state["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, now[2]["state"][k][key]), (k, key)


def _good(shape: tuple[int, ...], high: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if shape == (4,):
        return torch.randperm(high, generator=g)[:4]  # distinct: index_add / scatter_add sums stay exact
    return torch.randint(0, high, shape, generator=g)


@pytest.mark.parametrize("backend,name", [("ort", n) for n in OPS] + [("fx", "embedding"), ("fx", "cross_entropy")])
def test_bad_index_raises_eagers_error_and_changes_nothing(backend, name):
    op, shape, wraps = OPS[name]
    torch.manual_seed(0)
    model_e = Indexed(op)
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model_e, model_c))
    compiled = spmd_ort.compile(backend=backend)(_step)
    for seed in range(2):  # the first (checked) steps, then steady-state steps
        idx = _good(shape, 5, seed)
        torch.testing.assert_close(compiled(model_c, opt_c, idx), _step(model_e, opt_e, idx).detach())
    bad_values = (5, 9) if wraps else (-1, 5)
    for bad in bad_values:
        idx = _good(shape, 5, 7)
        idx[2] = bad
        with pytest.raises((IndexError, RuntimeError)) as eager:
            _step(model_e, opt_e, idx)
        before = _snapshot(model_c, opt_c)
        with pytest.raises(spmd_ort.InputIndexError) as got:
            compiled(model_c, opt_c, idx)
        assert isinstance(got.value, type(eager.value)), (type(eager.value), got.value)
        text = str(got.value)
        assert f"input `idx` holds {bad} at [2]" in text and "Fix: pass" in text, text
        assert got.value.position == (2,) and got.value.value == bad and got.value.input == "idx"
        _assert_unchanged(before, model_c, opt_c)
    if wraps:  # -1 is valid where eager wraps: no check may reject it
        idx = _good(shape, 5, 8)
        idx[1] = -1
        torch.testing.assert_close(compiled(model_c, opt_c, idx), _step(model_e, opt_e, idx).detach())
    idx = _good(shape, 5, 9)  # training goes on as eager's
    torch.testing.assert_close(compiled(model_c, opt_c, idx), _step(model_e, opt_e, idx).detach())


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.wte(idx)))


def _shifted_step(model, opt, batch):
    """nanoGPT's shift, written in the step: inputs and targets are slices of one tensor."""
    x = batch["tokens"]
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), ignore_index=-1)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


@pytest.mark.parametrize("backend", ["ort", "fx"])
def test_indices_sliced_from_an_input_are_checked_as_the_ops_read_them(backend):
    torch.manual_seed(0)
    model_e = TinyLM()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model_e, model_c))
    compiled = spmd_ort.compile(backend=backend)(_shifted_step)
    tokens = torch.randint(0, 11, (3, 7))
    tokens[:, -1] = -1  # only targets read the last column, and -1 is their ignore_index: valid in eager
    for _ in range(3):
        batch = {"tokens": tokens}
        torch.testing.assert_close(compiled(model_c, opt_c, batch), _shifted_step(model_e, opt_e, batch).detach())
    assert compiled.compiled.results.get(IndexChecks).checked == {
        "batch['tokens']": ("aten.embedding", "aten.nll_loss_forward")}
    bad = tokens.clone()
    bad[1, 2] = -1  # now an input id too
    with pytest.raises(IndexError):
        _shifted_step(model_e, opt_e, {"tokens": bad})
    before = _snapshot(model_c, opt_c)
    with pytest.raises(spmd_ort.InputIndexError, match=r"the indices that aten.embedding reads, computed from input "
                                                       r"`batch\['tokens'\]`, hold -1 at \[1, 2\]: .* in module "
                                                       r"`wte` \(Embedding\) accepts \[0, 11\)"):
        compiled(model_c, opt_c, {"tokens": bad})
    _assert_unchanged(before, model_c, opt_c)


class SmoothedHead(nn.Module):
    """A classifier head whose loss reads the labels through ``F.one_hot`` (label smoothing written out)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, h, y):
        target = F.one_hot(y, 5).float() * 0.9 + 0.02
        return -(target * self.proj(h).log_softmax(-1)).sum(-1).mean()


class OneHotClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = SmoothedHead()

    def forward(self, x, y):
        return self.head(torch.tanh(self.body(x)), y)


def _labelled_step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


@pytest.mark.on_ort
@pytest.mark.parametrize("backend", ["ort", "fx"])
def test_one_hot_of_a_class_out_of_range_raises_as_eager_and_changes_nothing(backend):
    """torch's ``F.one_hot`` on fake tensors (an ``eq`` with ``arange``) skips eager's check of the classes, so a
    class of 7 (of 5) or -1 gave a row of zeros and the step trained on it where eager raises (issue 42).  Traced as
    eager computes it, a scatter into zeros, its classes are checked with the other indices, before anything runs."""
    torch.manual_seed(0)
    model_e = OneHotClassifier()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model_e, model_c))
    compiled = spmd_ort.compile(backend=backend)(_labelled_step)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    for _ in range(3):
        y = torch.randint(0, 5, (4,), generator=g)
        torch.testing.assert_close(compiled(model_c, opt_c, x, y), _labelled_step(model_e, opt_e, x, y).detach())
    for bad in (7, -1):
        y = torch.tensor([0, 1, bad, 3])
        with pytest.raises(RuntimeError, match="Class values must be"):
            _labelled_step(model_e, opt_e, x, y)
        before = _snapshot(model_c, opt_c)
        with pytest.raises(spmd_ort.InputIndexError, match=rf"input `y` holds {bad} at \[2\]: F.one_hot \(aten.scatter\) "
                                                           r"in module `head` \(SmoothedHead\) accepts \[0, 5\) "
                                                           r"\(num_classes\).*Fix: pass class values in \[0, 5\)"):
            compiled(model_c, opt_c, x, y)
        _assert_unchanged(before, model_c, opt_c)
    y = torch.tensor([4, 0, 2, 1])  # training goes on as eager's
    torch.testing.assert_close(compiled(model_c, opt_c, x, y), _labelled_step(model_e, opt_e, x, y).detach())
    for a, b in zip(model_e.parameters(), model_c.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert compiled.compiled.results.get(IndexChecks).checked == {"y": ("aten.scatter",)}
    if backend == "ort":
        assert_ran_on_ort(compiled)


def test_checks_split_no_ort_segment(monkeypatch):
    """The checks read graph inputs only and run first; the segments are those of the graph without them."""
    from examples.gpt import GPT, GPTConfig

    def compiled(disabled: str | None):
        if disabled is None:
            monkeypatch.delenv("SPMD_ORT_DISABLE_PASSES", raising=False)
        else:
            monkeypatch.setenv("SPMD_ORT_DISABLE_PASSES", disabled)
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = spmd_ort.compile(backend="ort")(_lm_step)
        x = torch.randint(0, 32, (2, 8))
        step(model, opt, x, x)
        return step.compiled

    plain, checked = compiled("insert_index_checks_pass"), compiled(None)
    assert op_counts(plain.gm)[CHECK] == 0 and op_counts(checked.gm)[CHECK] == 2
    assert checked.executor.stats.segments == plain.executor.stats.segments
    order = [n for n in checked.gm.graph.nodes if n.op == "call_module" or n.target is check_index]
    assert [n.target for n in order[:2]] == [check_index] * 2 and all(n.op == "call_module" for n in order[2:])


def _lm_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


@pytest.mark.parametrize("values,wraps,ignore,ok", [
    ([0, 5], False, None, True), ([0, 6], False, None, False), ([-1, 2], False, None, False),
    ([-6, 5], True, None, True), ([-7, 0], True, None, False), ([-100, 3], False, -100, True),
    ([], False, None, True)])
def test_the_gpus_check_is_an_assert_queued_with_the_kernels(values, wraps, ignore, ok):
    """On CUDA, check_index asserts on the device (eager's own kind of check: reading the verdict on the host
    would make every step wait for the GPU); the condition it asserts, run here on the CPU, where the same
    assert raises at once."""
    from spmd_ort.runtime.checks import _assert_in_range_async

    index = torch.tensor(values, dtype=torch.int64)
    message = "batch ids: {value} at {position} is out of range"
    if ok:
        _assert_in_range_async(index, 6, wraps, ignore, message)
        return
    with pytest.raises(RuntimeError, match=r"batch ids: an index out of range at \(on the GPU: not read back\)"):
        _assert_in_range_async(index, 6, wraps, ignore, message)
