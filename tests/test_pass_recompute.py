"""recompute_activations_pass: small graphs by hand, then whole train steps against eager (the oracle)."""

from __future__ import annotations

import copy
import itertools
import operator

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import checkpoint

import spmd_ort
from spmd_ort.passes import PassContext, op_counts, recompute_activations_pass, run_passes
from spmd_ort.passes.recompute import Recomputation
from spmd_ort.passes.recompute import NARROWED_MASK, RECOMPUTED
from spmd_ort.graph import ops
from tests.helpers import ATOL, RTOL, assert_ran_on_ort, assert_same_state, lm_step, train_side_by_side, train_step
from tests.models import GPT, MLP, GPTConfig, ScaleByMax, gpt_batch


# ---------------------------------------------------------------------- small graphs by hand
def _forward_backward(x, w1, w2):
    """A two-layer MLP's forward and its hand-written backward (the graph a trace of loss.backward() gives)."""
    h = x @ w1  # (B, H): saved for relu's backward
    a = torch.relu(h)  # saved for w2's gradient
    loss = (a @ w2).sum()
    gy = torch.ones_like(loss).expand(x.shape[0], w2.shape[1])  # the backward starts here
    gw2 = a.t() @ gy
    ga = gy @ w2.t()
    gh = torch.where(h > 0, ga, torch.zeros_like(ga))
    gw1 = x.t() @ gh
    return loss, gw1, gw2


def _traced(fn, *args, backward_from: str):
    """``fn`` traced, its nodes from the first ``backward_from`` op on tagged as backward (as trace_step does)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    tagged = False
    for node in gm.graph.nodes:
        tagged = tagged or (node.op == "call_function" and str(node.target) == backward_from)
        if tagged and node.op == "call_function":
            node.meta.setdefault("custom", {})["phase"] = "backward"
    return gm


def _run(gm, budget):
    ctx = PassContext(input_slots=[], output_slots=[], activation_memory_budget=budget)
    return run_passes(gm, ctx, [recompute_activations_pass]), ctx


def _mlp_graph():
    args = (torch.randn(8, 64), torch.randn(64, 16), torch.randn(16, 3))
    return _traced(_forward_backward, *args, backward_from="aten.ones_like.default"), args


def test_budget_zero_recomputes_relu_before_its_first_backward_use_and_numbers_are_unchanged():
    gm, args = _mlp_graph()
    expected = gm(*args)
    mm_before = op_counts(gm)["aten.mm.default"]
    gm, ctx = _run(gm, 0.0)
    gm.graph.lint()
    copies = [n for n in gm.graph.nodes if RECOMPUTED in n.meta]
    # relu's output is recomputed (cheap per byte), the matmul output `h` too (nothing is kept at budget 0), and
    # each copy sits in the backward, before its first reader
    assert sorted(str(n.target) for n in copies) == ["aten.mm.default", "aten.relu.default"]
    assert all(n.meta["custom"]["phase"] == "backward" for n in copies)
    for copy_ in copies:
        first_reader = min(copy_.users)
        assert copy_ < first_reader and all(u.meta["custom"]["phase"] == "backward" for u in copy_.users)
    assert op_counts(gm)["aten.mm.default"] == mm_before + 1
    for a, b in zip(gm(*args), expected):
        assert torch.equal(a, b)
    result = ctx.results.get(Recomputation)
    assert result.budget == 0.0 and result.copies == 2 and len(result.recomputed) == 2


def test_budget_one_changes_nothing():
    gm, _ = _mlp_graph()
    before = gm.code
    gm, ctx = _run(gm, 1.0)
    assert gm.code == before and Recomputation not in ctx.results


def test_a_matmul_output_is_the_last_to_be_recomputed():
    """At budget 0.5 the relu output (cheap to recompute per byte) goes and the matmul output `h` stays."""
    gm, args = _mlp_graph()
    expected = gm(*args)
    gm, ctx = _run(gm, 0.5)
    assert [str(n.target) for n in gm.graph.nodes if RECOMPUTED in n.meta] == ["aten.relu.default"]
    for a, b in zip(gm(*args), expected):
        assert torch.equal(a, b)
    assert any("kept within the budget" in k and "`mm`" in k for k in ctx.results.get(Recomputation).kept)


def test_the_cost_model_charges_fresh_memory_and_widening_a_bool_mask():
    """Measured in bench/memory.py's step: recomputing ``gelu`` takes ~0.33 ms per MiB (nearly all of it the fresh
    output), ``bool_mask / 0.9`` 0.63: a byte-count model that charged writes like reads ranked them the other
    way round (25 against 40 per element)."""
    from spmd_ort.passes.recompute import recompute_cost

    def fn(x, m):
        return torch.nn.functional.gelu(x), m / 0.9

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(64, 64), torch.rand(64, 64) > 0.1)
    cost = {n.target: recompute_cost(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert cost[torch.ops.aten.div.Tensor] > 1.4 * cost[torch.ops.aten.gelu.default]


def test_at_budget_half_the_scaled_dropout_masks_are_kept_and_cheaper_values_recomputed():
    """A dropout mask's scaled values recomputed from its packed bits cost ~3x a GELU output per byte (unpacking,
    then widening bool to float): at budget 0.5 the GPT keeps them, masks unpacked, and recomputes the masked
    attention probabilities and GELU outputs instead."""
    step, *_ = _train(0.5, steps=1)
    result = step.compiled.results.get(Recomputation)
    recomputed = {r.split("(")[1].split(",")[0] for r in result.recomputed}
    assert {"mul.Tensor", "gelu.default"} <= recomputed and "div.Scalar" not in recomputed, recomputed
    assert result.narrowed_masks == 0


@pytest.mark.parametrize("shape,kept", [((4, 8), (torch.uint8, (4,))), ((3, 5), (torch.bool, (3, 5)))])
def test_random_outputs_are_kept_so_masks_replay_exactly(shape, kept):
    """The mask stays (its bits packed eight to a byte when its size allows, else as bool) and the backward
    recomputes the float mask from it; the random op runs once."""
    def fn(x, w):
        mask = ops.bernoulli_like(x, 0.5)  # a random op: never run twice
        h = torch.tanh(x * mask) @ w
        loss = h.sum()
        g = torch.ones_like(h) @ w.t()
        return loss, g * mask * (1 - torch.tanh(x * mask) ** 2)

    args = (torch.randn(*shape), torch.randn(shape[1], 2))
    gm = _traced(fn, *args, backward_from="aten.ones_like.default")
    gm, ctx = _run(gm, 0.0)
    copies = [n for n in gm.graph.nodes if RECOMPUTED in n.meta]
    assert copies and not any(n.target is ops.bernoulli_like for n in copies)
    assert op_counts(gm)["spmd_ort.bernoulli_like.default"] == 1
    [narrow] = [n for n in gm.graph.nodes if NARROWED_MASK in n.meta]
    assert (narrow.meta["val"].dtype, tuple(narrow.meta["val"].shape)) == kept
    assert RECOMPUTED not in narrow.meta  # kept; read by the backward's copies (through a view when packed)
    assert all(RECOMPUTED in u.meta or u.target is torch.ops.aten.unsqueeze.default for u in narrow.users)
    assert ctx.results.get(Recomputation).narrowed_masks == 1
    # the forward reads the float mask itself, as traced: only the backward's copies read the compact one
    [mask] = [n for n in gm.graph.nodes if n.target is ops.bernoulli_like]
    assert any(u.target is torch.ops.aten.mul.Tensor and RECOMPUTED not in u.meta for u in mask.users)
    torch.manual_seed(0)
    out = gm(*args)
    torch.manual_seed(0)
    for a, b in zip(out, fn(*args)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- whole steps: eager is the oracle
CFG = GPTConfig(vocab=64, seq=32, d=32, heads=4, layers=2, dropout=0.1)


def _train(budget, backend="fx", steps=3, cfg=CFG, **kwargs):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = spmd_ort.compile(backend=backend, activation_memory_budget=budget, **kwargs)(lm_step)
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        losses.append(step(model, opt, *gpt_batch(cfg, 4, g)).detach())
    return step, model, opt, losses


def _eager(steps=3):
    """The GPT of :func:`_train` trained eagerly on the same batches and seeds: (model, losses)."""
    torch.manual_seed(0)
    eager = GPT(CFG)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(steps):
        x, y = gpt_batch(CFG, 4, g)
        torch.manual_seed(100 + i)
        losses.append(lm_step(eager, opt, x, y).detach())
    return eager, losses


def test_gpt_with_dropout_is_bitwise_equal_to_eager_at_every_budget_on_fx():
    """Recomputation replays no random op and runs eager's kernels on the same inputs: the loss and every parameter
    after three AdamW steps equal eager's bit for bit, at budgets 1.0, 0.5 and 0.0, dropout on."""
    eager, eager_losses = _eager()
    planned = {}
    for budget in (1.0, 0.5, 0.0):
        step, model, _, losses = _train(budget)
        assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses)), budget
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters())), budget
        planned[budget] = step.memory()
    peaks = [planned[b]["planned_activation_peak"] for b in (0.0, 0.5, 1.0)]
    saved = [planned[b]["planned_saved_for_backward"] for b in (0.0, 0.5, 1.0)]
    assert peaks[0] < peaks[1] < peaks[2] and saved[0] < saved[1] < saved[2]


def test_describe_lists_what_is_recomputed_and_why():
    step, *_ = _train(0.0, steps=1)
    text = step.compiled.describe()
    assert "activation memory (activation_memory_budget=0)" in text
    assert "recomputed `_safe_softmax`" in text  # attention probabilities: recomputed
    # dropout masks stay, their bits packed (1/32 of the bytes): the scaled mask is recomputed from them
    assert "4 dropout mask(s) kept compact" in text and "recomputed `div`" in text
    assert "the dropout mask `bernoulli_like` with its bits packed eight to a byte: kept so that masks replay " \
           "exactly" in text
    # the residual stream between half-blocks is the spine: kept, recomputation starts from it
    assert "kept `add_2` (add.Tensor, (4, 32, 32), 0.02 MiB): the spine" in text
    assert "recompute_activations_pass" in text
    assert "recomputed" in step.explain()


@pytest.mark.on_ort
@pytest.mark.parametrize("budget", [0.0, "selective"])
def test_ort_backend_recomputing_matches_eager(budget):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=2)
    batches = [gpt_batch(cfg, 4, torch.Generator().manual_seed(i)) for i in range(3)]
    step, *_ = train_side_by_side(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), lm_step,
                                  batches, backend="ort", activation_memory_budget=budget)
    assert step.compiled.results.get(Recomputation).copies > 0
    assert_ran_on_ort(step)


@pytest.mark.on_ort
def test_ort_backend_with_dropout_at_budget_zero_matches_eager():
    """Dropout on ORT: the packed masks are unpacked in the backward; losses and state to ORT's rounding."""
    torch.manual_seed(0)
    eager = GPT(CFG)
    model = copy.deepcopy(eager)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (eager, model)]
    step = spmd_ort.compile(backend="ort", activation_memory_budget=0.0)(lm_step)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        x, y = gpt_batch(CFG, 4, g)
        torch.manual_seed(100 + i)
        le = lm_step(eager, opts[0], x, y).detach()
        torch.manual_seed(100 + i)
        torch.testing.assert_close(step(model, opts[1], x, y), le, rtol=1e-5, atol=0)
    assert_same_state(eager, model, *opts, normwise=True)
    assert_ran_on_ort(step)
    assert step.compiled.results.get(Recomputation).narrowed_masks == 4


def test_dynamic_shapes_at_budget_zero_match_eager():
    """Symbolic batch and sequence sizes: the recomputed nodes read the forward's symbolic sizes."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d=32, heads=4, layers=2)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (b, t), generator=g), torch.randint(0, 64, (b, t), generator=g))
               for b, t in ((4, 16), (3, 24), (2, 32))]
    step, *_ = train_side_by_side(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), lm_step,
                                  batches, dynamic=True, activation_memory_budget=0.0)
    assert len(step.variants) == 1 and step.compiled.symbolic is not None
    assert step.compiled.results.get(Recomputation).copies > 0


def test_dynamic_shapes_with_dropout_recompute_and_are_bitwise_equal_across_budgets():
    """A symbolic trace with dropout: the backward's nodes keep their phase tags (make_fx drops the trace's dead
    size nodes after tracing; tags placed by position once fell off the graph, and nothing was recomputed).
    Budget 0 gives budget 1's losses and parameters bit for bit, and eager's to the usual tolerance."""
    from spmd_ort.graph.meta import phase

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (b, t), generator=g), torch.randint(0, 64, (b, t), generator=g))
               for b, t in ((4, 16), (3, 24))]
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab=64, seq=32, d=32, heads=4, layers=1, dropout=0.1))
    runs = {}
    for budget in ("eager", 1.0, 0.0):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        step = lm_step if budget == "eager" else \
            spmd_ort.compile(backend="fx", dynamic=True, activation_memory_budget=budget)(lm_step)
        losses = []
        for i, (x, y) in enumerate(batches):
            torch.manual_seed(100 + i)
            losses.append(step(model, opt, x, y).detach())
        runs[budget] = (losses, model, opt)
    assert len(step.variants) == 1 and step.compiled.symbolic is not None
    nodes = step.compiled.gm.graph.nodes
    assert all(phase(n) == "backward" for n in nodes if str(n.target) == "aten.native_dropout_backward.default")
    result = step.compiled.results.get(Recomputation)
    assert result.copies > 0 and result.recomputed_bytes > 0
    assert any("_safe_softmax" in r for r in result.recomputed)  # attention probabilities: recomputed
    (l0, m0, _), (l1, m1, _) = runs[0.0], runs[1.0]
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    (le, me, oe) = runs["eager"]
    for i, (a, b) in enumerate(zip(l0, le)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"step {i} loss: {m}")
    assert_same_state(me, m0, oe, runs[0.0][2])


class OpaqueNet(nn.Module):
    """An MLP with a part that cannot be traced (it reads a value as a Python float): it runs opaquely."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = ScaleByMax.apply(torch.tanh(self.fc2(h)))
        return self.head(torch.tanh(h))


def test_opaque_parts_are_kept_not_recomputed():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    step, *_ = train_side_by_side(OpaqueNet, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), train_step, batches,
                                  activation_memory_budget=0.0)
    gm = step.compiled.gm
    assert len(step.compiled.opaque) == 1
    assert op_counts(gm)["spmd_ort.opaque_forward.default"] == 1
    copies = [n for n in gm.graph.nodes if RECOMPUTED in n.meta]
    assert copies and not any(n.target is operator.getitem and "opaque" in str(n.args[0].target) for n in copies)


class CheckpointedMLP(nn.Module):
    """Blocks the user wrapped in torch.utils.checkpoint: their recomputation is already the backward's."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_a_users_checkpoint_is_respected_and_nothing_is_recomputed_twice():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    counts = {}
    for budget in (1.0, 0.0):
        step, *_ = train_side_by_side(CheckpointedMLP, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                      train_step, batches, activation_memory_budget=budget)
        counts[budget] = op_counts(step.compiled.gm)
        copies = [n for n in step.compiled.gm.graph.nodes if RECOMPUTED in n.meta]
        assert not any(n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default) for n in copies)
    # each block's matmuls run twice already (forward, and the checkpoint's recomputation): not a third time
    assert counts[0.0]["aten.addmm.default"] == counts[1.0]["aten.addmm.default"]


def bf16_lm_step(model, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def test_autocast_bf16_with_dropout_at_budget_zero_is_bitwise_equal_to_eager():
    """Mixed precision: autocast's casts of the weights and activations are recomputed like any op."""
    torch.manual_seed(0)
    eager = GPT(CFG)
    model = copy.deepcopy(eager)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (eager, model)]
    step = spmd_ort.compile(backend="fx", activation_memory_budget=0.0)(bf16_lm_step)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        x, y = gpt_batch(CFG, 4, g)
        torch.manual_seed(100 + i)
        le = bf16_lm_step(eager, opts[0], x, y)
        torch.manual_seed(100 + i)
        assert torch.equal(step(model, opts[1], x, y), le.detach()), i
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
    copies = [n for n in step.compiled.gm.graph.nodes if RECOMPUTED in n.meta]
    assert any(n.meta["val"].dtype == torch.bfloat16 for n in copies)


def test_gradient_accumulation_recomputes_each_micro_batch_from_its_own_forward():
    """Two forwards and backwards in one step: each backward recomputes from values of its own forward."""
    from spmd_ort.graph.meta import phase
    from tests.helpers import accumulation_step

    cfg = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=2)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        xs, ys = zip(*(gpt_batch(cfg, 2, g) for _ in range(2)))
        batches.append((list(xs), list(ys)))

    def step_fn(model, opt, xs, ys):
        return accumulation_step(model, opt, xs, ys)[0]

    torch.manual_seed(0)
    step, *_ = train_side_by_side(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), step_fn,
                                  batches, activation_memory_budget=0.0)
    nodes = list(step.compiled.gm.graph.nodes)
    backward = [i for i, n in enumerate(nodes) if phase(n) == "backward"]
    gaps = [i for a, i in itertools.pairwise(backward) if i != a + 1]  # where the second forward ends
    copies = [i for i, n in enumerate(nodes) if RECOMPUTED in n.meta]
    assert gaps and any(i < gaps[0] for i in copies) and any(i > gaps[0] for i in copies)


def test_hf_bert_with_dropout_is_bitwise_equal_across_budgets():
    """HF BERT (attention and hidden dropout, a padding mask): budget 0 gives budget 1's losses and parameters bit
    for bit on fx, with the same seed before every step."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_models import _sgd, cls_step

    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (4, 12), generator=g), torch.randint(0, 3, (4,), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(cfg)
    runs = {}
    for budget in (1.0, 0.0):
        model = copy.deepcopy(base)
        opt = _sgd(model)
        step = spmd_ort.compile(backend="fx", activation_memory_budget=budget)(cls_step)
        losses = []
        for i in range(3):
            torch.manual_seed(10 + i)
            losses.append(step(model, opt, x, mask, y).detach())
        runs[budget] = (losses, list(model.parameters()))
    assert step.compiled.results.get(Recomputation).narrowed_masks > 0
    assert all(torch.equal(a, b) for a, b in zip(runs[0.0][0], runs[1.0][0]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0.0][1], runs[1.0][1]))


# ---------------------------------------------------------------------- with the parallel passes
def _sharded_step(budget, reshard):
    """A GPT step traced over rank 0's shards of 2 and put through the cleanup, memory and parallel stages."""
    from spmd_ort.capture.optim import rule_for
    from spmd_ort.capture.state import StateLayout
    from spmd_ort.capture.trace import trace_step
    from spmd_ort.passes import PARALLEL_STAGES, build_pipeline
    from tests.helpers import shard_without_collectives

    cfg = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shard_without_collectives(model, opt, 2)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    traced = trace_step(lm_step, (model, opt, *gpt_batch(cfg, 2, torch.Generator().manual_seed(0))), {}, layout,
                        tag_grads=True)
    mode = spmd_ort.DataParallel(parallel_style="fully_shard", reshard_after_forward=reshard)
    ctx = PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots), world_size=2,
                      mode=mode, shard_specs=layout.shard_specs, layout=layout, check_contracts=True,
                      activation_memory_budget=budget)
    return run_passes(traced.gm, ctx, build_pipeline(mode, "fx", stages=("cleanup", "memory", *PARALLEL_STAGES)))


@pytest.mark.parametrize("reshard", [True, False])
def test_under_fully_shard_recomputation_reads_the_backwards_gathers_and_adds_none(reshard):
    """The recompute pass runs before the parallel passes: its copies are backward nodes, so they read the
    parameters the backward gathers anyway (re-gathered after resharding, or kept from the forward)."""
    from spmd_ort.graph.meta import phase

    gathers = {}
    for budget in (1.0, 0.0):
        gm = _sharded_step(budget, reshard)
        gathers[budget] = sorted(phase(n) for n in gm.graph.nodes if n.target is ops.all_gather)
        copies = [n for n in gm.graph.nodes if RECOMPUTED in n.meta]
        assert (len(copies) > 0) == (budget == 0.0)
        for node in copies:  # a recomputed matmul reads a gathered weight the backward holds
            for arg in node.all_input_nodes:
                if arg.target is ops.wait_ and reshard:
                    assert phase(arg) == "backward", (node, arg)
    assert gathers[0.0] == gathers[1.0]


@pytest.mark.multiproc
def test_replicate_on_two_ranks_matches_ddp_at_budget_zero(tmp_path):
    """tests/dist/dp_parity.py (2 ranks, gloo) checks loss, parameters, gradients and AdamW state against DDP at
    every step; here with SPMD_ORT_ACTIVATION_MEMORY_BUDGET=0, so the replicated GPT step recomputes."""
    from tests.test_data_parallel import torchrun

    ranks, _ = torchrun(tmp_path, "--model", "gpt", "--opt", "adamw", "--backend", "fx", "--steps", "3",
                        "--bucket-mb", "0.05", env={"SPMD_ORT_ACTIVATION_MEMORY_BUDGET": "0"})
    for r in ranks:
        assert "compile_error" not in r, r.get("compile_error")
        assert len(r["losses"]) == 3
        assert "activation memory (activation_memory_budget=0): the backward recomputes" in r["describe"]


@pytest.mark.on_ort
@pytest.mark.multiproc
def test_replicate_on_ort_on_two_ranks_matches_ddp_and_budget_one_at_budget_zero(tmp_path):
    """tests/dist/dp_parity.py --budget 0 on ORT: every step equals DDP and a copy compiled at budget 1.0 (to the
    usual tolerances, checked in the script), and every segment runs in ONNX Runtime: a recomputed multi-output
    op's getitems stay next to it, so no tuple crosses the segments split at the gradient all-reduces."""
    from tests.helpers import assert_ort_report_clean
    from tests.test_data_parallel import torchrun

    ranks, _ = torchrun(tmp_path, "--model", "gpt", "--opt", "adamw", "--backend", "ort", "--steps", "3",
                        "--bucket-mb", "0.05", "--budget", "0")
    for r in ranks:
        assert "compile_error" not in r, r.get("compile_error")
        assert len(r["losses"]) == 3 and r["recomputed_copies"] > 0
        assert_ort_report_clean(r["ort"])


def _amp_parity(tmp_path, *args: str) -> list[dict]:
    """tests/dist/amp_parity.py on 2 ranks (gloo); each rank's result."""

    import launch  # (not at the top: this module also runs as `python -m tests.test_pass_recompute`)

    return launch.torchrun("amp_parity.py", *args, timeout=400, out=tmp_path / "out").ranks


@pytest.mark.multiproc
def test_replicate_with_a_bf16_policy_on_two_ranks_is_bitwise_equal_to_fsdp2_and_budget_one_at_budget_zero(tmp_path):
    """A MixedPrecisionPolicy (bf16 compute and reductions): replicate at budget 0 recomputes the bf16 casts and
    activations, and every step's loss and parameters equal torch FSDP2's with the same policy and the copy
    compiled at budget 1.0 bit for bit (checked in tests/dist/amp_parity.py).  DDP's own mixed precision needs
    CUDA events, so FSDP2 is the eager oracle here, as in tests/test_amp.py."""
    ranks = _amp_parity(tmp_path, "--suite", "bf16", "--styles", "replicate", "--steps", "3", "--budget", "0")
    for r in ranks:
        d = r["bf16"]
        assert len(d["losses"]) == 3 and d["max_param_diff"] == {"replicate": 0.0, "replicate@1.0": 0.0}
        assert d["recomputed_copies"]["replicate"] > 0 and d["recomputed_copies"]["replicate@1.0"] == 0


@pytest.mark.multiproc
def test_fully_shard_on_two_ranks_matches_eager_at_budget_zero_with_the_same_gathers(tmp_path):
    """tests/dist/zero_parity.py (2 ranks, reshard after forward) checks loss, every full parameter and the AdamW
    state against eager on the global batch at each step; at budget 0 the communicator counts no more all-gather
    calls than at budget 1 (the recomputed reads can pack the buckets differently); their bytes grow only by the parameters the recomputed forward reads and the backward did not
    (biases of recomputed matmuls and layer norms: under 1% here)."""

    runs = {}
    for budget in ("1", "0"):
        import launch  # (see above)

        runs[budget] = launch.torchrun("zero_parity.py", "--steps", "3", "--reshard", "1", timeout=400,
                                       env={"SPMD_ORT_ACTIVATION_MEMORY_BUDGET": budget},
                                       out=tmp_path / budget).ranks
    for r in runs["0"]:
        assert "compile_error" not in r, r.get("compile_error")
        assert "activation memory (activation_memory_budget=0): the backward recomputes" in r["describe"]
    for r0, r1 in zip(runs["0"], runs["1"]):
        assert all(c0["all_gather_calls"] <= c1["all_gather_calls"] for c0, c1 in zip(r0["comm"], r1["comm"]))
        for c0, c1 in zip(r0["comm"], r1["comm"]):
            assert c1["all_gather_bytes"] <= c0["all_gather_bytes"] <= 1.01 * c1["all_gather_bytes"], (c0, c1)


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize("value", [1.5, -0.1, "half", True, float("nan")])
def test_a_bad_budget_is_a_config_error_naming_the_option_and_the_fix(value):
    with pytest.raises(spmd_ort.ConfigError, match=r"compile\(activation_memory_budget=.*\) is not valid: expected a "
                                                   r"number from 0\.0 .* to 1\.0"):
        spmd_ort.compile(activation_memory_budget=value)


def test_the_environment_sets_the_budget_and_the_argument_wins(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_ACTIVATION_MEMORY_BUDGET", "0.25")
    assert spmd_ort.compile()(train_step).options.activation_memory_budget == 0.25
    assert spmd_ort.compile(activation_memory_budget=0)(train_step).options.activation_memory_budget == 0.0


def test_mlp_at_every_budget_matches_eager():
    """A model without a spine inside its blocks (a plain stack): parity at every budget."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(2)]
    for budget in (0.0, 0.5):
        train_side_by_side(MLP, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), train_step, batches,
                           activation_memory_budget=budget)


# ---------------------------------------------------------------------- accounting against the real peak
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
             "SPMD_ORT_RETAIN_HOST_MEMORY": "0"}


def _measure(budget: float) -> str:
    """In this process (started with ALLOCATOR): a GPT step's resident-set high-water mark above the resident set
    before it (steps 2 and 3, after compilation), and what memory() planned."""
    import json
    from pathlib import Path

    def rss(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    cfg = GPTConfig(vocab=128, seq=256, d=128, heads=4, layers=2, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = spmd_ort.compile(backend="fx", activation_memory_budget=budget)(lm_step)
    g = torch.Generator().manual_seed(0)
    peaks = []
    for i in range(3):
        x, y = gpt_batch(cfg, 8, g)
        if i:
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS
            base = rss("VmRSS")
        step(model, opt, x, y)
        if i:
            peaks.append(rss("VmHWM") - base)
    mem = step.memory()
    return json.dumps({"measured": max(peaks), "planned": mem["planned_activation_peak"],
                       "saved": mem["planned_saved_for_backward"]})


def test_planned_peak_and_saved_bytes_match_the_measured_peak():
    """memory()'s planned peak of the step's values is within 15% of the real one: the resident set's high-water
    mark over a step, above the resident set before it, with glibc returning freed memory to the system; at
    budget 0 the step keeps a small share of what budget 1 keeps for the backward, and its peak falls with it."""
    import json
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the high-water mark")
    runs = {}
    for budget in (1.0, 0.0):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **ALLOCATOR}
        proc = subprocess.run([sys.executable, "-m", "tests.test_pass_recompute", str(budget)], env=env, capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        runs[budget] = json.loads(proc.stdout.strip().splitlines()[-1])
    for budget, r in runs.items():
        assert abs(r["planned"] - r["measured"]) <= 0.15 * r["measured"], (budget, r)
    assert runs[0.0]["saved"] < 0.2 * runs[1.0]["saved"], runs
    assert runs[0.0]["measured"] < 0.6 * runs[1.0]["measured"], runs


if __name__ == "__main__":  # the worker of test_planned_peak_and_saved_bytes_match_the_measured_peak
    import sys

    print(_measure(float(sys.argv[1])))


# ---------------------------------------------------------------------- torchtitan's checkpointing: "full", "selective"
def test_full_and_selective_checkpointing_are_bitwise_equal_to_eager_on_fx():
    """Both policies recompute inside each block (``blocks.N``) and replay no random op: loss and parameters equal
    eager's bit for bit after three AdamW steps, dropout on."""
    eager, eager_losses = _eager()
    for policy in ("full", "selective"):
        step, model, _, losses = _train(policy)
        assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses)), policy
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters())), policy
        result = step.compiled.results.get(Recomputation)
        assert result.budget == policy and result.copies > 0
        assert f"activation_memory_budget={policy!r}" in step.compiled.describe()


def test_selective_keeps_every_other_matmul_of_each_block_and_attention_and_full_keeps_block_inputs():
    """torchtitan's op policy, counted per block: the 1st, 3rd, ... matmul outputs are kept, the others and the
    elementwise values between them recomputed; "full" keeps only what a block reads from outside it (its input)
    and values outside every block (the head, the loss) are kept by both, as per-block checkpointing keeps them."""
    from spmd_ort.passes.recompute import block_of

    results = {}
    for policy in ("full", "selective"):
        step, *_ = _train(policy, steps=1, cfg=GPTConfig(vocab=64, seq=32, d=32, heads=4, layers=2))
        results[policy] = step.compiled.results.get(Recomputation)
    sel, full = results["selective"], results["full"]
    kept_matmuls = [k for k in sel.kept if "'selective': matmul" in k]
    assert kept_matmuls and all("(odd ones are kept)" in k for k in kept_matmuls)
    counts = {int(k.split("matmul ")[1].split(" ")[0]) for k in kept_matmuls}
    assert counts >= {1, 3} and all(c % 2 for c in counts), counts
    assert {k.split("block `")[1].split("`")[0] for k in kept_matmuls} == {"blocks.0", "blocks.1"}
    assert not any("matmul" in k for k in full.kept)
    assert full.recomputed_bytes > sel.recomputed_bytes and full.kept_bytes < sel.kept_bytes
    for result in (sel, full):
        assert any("a block's input" in k for k in result.kept)
        assert all("recomputed with block `blocks." in r for r in result.recomputed)
    assert block_of(type("N", (), {"meta": {"custom": {"module": "model.layers.3.mlp.up_proj"}}})()) == \
        "model.layers.3"


def test_under_mixed_precision_recomputation_starts_from_the_block_inputs():
    """A bf16 block input is not read by the backward itself (RMSNorm reads its float32 copy), so before, it was
    no kept value and "full" (or budget 0) recomputed every block from the embedding at the start of the backward,
    holding all of them: planned on torchtitan's Llama at 4 layers under fully_shard, "full" now plans less than
    "selective", which plans less than no checkpointing."""
    from examples.llama3 import Llama3, Llama3Config, train_step as llama_step

    cfg = Llama3Config(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=1000, ffn_dim=512, max_seq_len=512)
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    planned = {}
    for budget in ("full", "selective", 1.0):
        with torch.device("meta"):
            model = Llama3(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        step = spmd_ort.compile(parallel_mode=spmd_ort.DataParallel(parallel_style="fully_shard",
                                                                    mixed_precision=policy),
                                activation_memory_budget=budget, backend="fx")(llama_step)
        tokens = torch.empty(2, 512, dtype=torch.long, device="meta")
        planned[budget] = step.plan(model, opt, tokens, tokens, world_size=8, export=False)
    activations = {b: p.per_rank_bytes["activations"] for b, p in planned.items()}
    assert activations["full"] < activations["selective"] < activations[1.0], activations
    assert planned["full"].recompute_flops > planned["selective"].recompute_flops > 0 == planned[1.0].recompute_flops


def test_full_recomputes_attention_kernels_whose_results_hold_sizes_and_seeds():
    """CUDA's flash attention returns sizes and seeds besides its tensors: under "full" the kernel itself is
    copied into the backward when the outputs the backward reads are recomputed (no dropout: the same values);
    before, a result that is not all tensors made it unrecomputable and its outputs stayed for every block."""
    def fn(x, w):
        h = (x @ w).view(1, 2, 8, 16)
        out = torch.ops.aten._scaled_dot_product_flash_attention(h, h, h, 0.0, True)
        y = out[0].sum() + out[1].sum()
        gy = torch.ones_like(y)  # the backward starts here, reading the attention's output and logsumexp
        return y, out[0] * gy, out[1] * gy

    gm = _traced(fn, torch.randn(8, 32), torch.randn(32, 32), backward_from="aten.ones_like.default")
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get("custom", {}).get("phase") != "backward":
            node.meta.setdefault("custom", {})["module"] = "layers.0.attention"
    out, ctx = _run(gm, "full")
    flash = [n for n in out.graph.nodes if "flash_attention" in str(n.target)]
    assert len(flash) == 2 and RECOMPUTED in flash[1].meta and flash[1].meta["custom"]["phase"] == "backward"
    assert ctx.results.get(Recomputation).copies >= 3  # the kernel and the two outputs read


class _MaskedBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h, mask):
        return h + self.out(torch.relu(self.fc(h))) * mask


class _MaskedStack(nn.Module):
    """Blocks that all read a mask made from the batch: no value is alone between blocks (no spine)."""

    def __init__(self, d: int = 16, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(_MaskedBlock(d) for _ in range(layers))

    def forward(self, ids):
        mask = (ids > 0).float().unsqueeze(-1)
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, mask)
        return h


def test_full_keeps_what_each_block_reads_from_outside_it_even_without_a_spine():
    """A mask made from the batch, read by every block, leaves no spine: before, "full" kept no block input and
    recomputed every block from the embedding at the backward's start. A checkpoint of each block saves what it
    reads from outside: each block's recomputation now sits with its own backward (the last block's first), and
    the step equals eager's."""
    def step_fn(model, opt, ids):
        loss = model(ids).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    batches = [(torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i)),) for i in range(2)]
    step, *_ = train_side_by_side(lambda: _MaskedStack(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), step_fn,
                                  batches, activation_memory_budget="full")
    nodes = list(step.compiled.gm.graph.nodes)
    first = {}
    for i, node in enumerate(nodes):
        block = node.meta.get("custom", {}).get("module", "")[:8]
        if RECOMPUTED in node.meta and block.startswith("blocks."):
            first.setdefault(block, i)
    assert first["blocks.2"] < first["blocks.1"] < first["blocks.0"], first
    kept = step.compiled.results.get(Recomputation).kept
    assert sum("a block's input" in k for k in kept) >= 3, kept
