"""The runner checks what each pass declares: what it requires, provides and invalidates."""

from __future__ import annotations

import pytest
import torch

import spmd_ort
from spmd_ort.capture.optim import rule_for
from spmd_ort.passes import (PassContext, PassError, bucket_collectives_pass, expand_data_parallel_pass, graph_pass,
                             run_passes)
from spmd_ort.passes.contracts import NO_GRAD_TAGS
from spmd_ort.capture.state import StateLayout
from spmd_ort.capture.trace import trace_step
from helpers import train_step
from models import MLP


def _traced(tag_grads: bool):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layout = StateLayout.capture(model, opt, rule_for(opt))
    traced = trace_step(train_step, (model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,))), {}, layout,
                        tag_grads=tag_grads)
    ctx = PassContext(input_slots=list(traced.input_slots), output_slots=list(traced.output_slots), world_size=2,
                      mode=spmd_ort.DataParallel(), check_contracts=True)
    return traced.gm, ctx


def test_a_missing_requirement_names_the_pass_and_the_invariant():
    gm, ctx = _traced(tag_grads=False)  # as if the tracing that tags gradients had not happened
    with pytest.raises(PassError, match=r"`expand_data_parallel_pass` requires `grads_tagged`.*no gradient is tagged"):
        run_passes(gm, ctx, [expand_data_parallel_pass])


def test_a_broken_promise_names_the_pass_and_the_invariant():
    @graph_pass(provides=[NO_GRAD_TAGS])
    def forgetful_pass(gm, ctx):
        """Claims to remove gradient tags but does not."""
        return gm

    gm, ctx = _traced(tag_grads=True)
    with pytest.raises(PassError, match=r"`forgetful_pass` provides `no_grad_tags`.*6 tag_grad node\(s\) remain"):
        run_passes(gm, ctx, [forgetful_pass])


def test_io_slots_are_checked_after_every_pass():
    @graph_pass()
    def add_an_input_pass(gm, ctx):
        """Adds a placeholder without updating input_slots."""
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            extra = gm.graph.placeholder("unused")
        extra.meta["val"] = torch.empty(1)
        return gm

    gm, ctx = _traced(tag_grads=True)
    with pytest.raises(PassError, match="`add_an_input_pass` provides `io_matches_slots`"):
        run_passes(gm, ctx, [add_an_input_pass])


def test_contracts_are_not_checked_unless_asked():
    gm, ctx = _traced(tag_grads=False)
    ctx.check_contracts = False
    run_passes(gm, ctx, [expand_data_parallel_pass])  # nothing to expand, nothing checked


def test_a_user_transform_that_breaks_what_a_later_pass_needs_names_both():
    """A gm_transformation declares nothing, so what later passes require is checked after it, always (not only
    with check_passes): here it drops a node's value, which insert_index_checks_pass (the next pass that reads values) needs."""
    def forget_a_value(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        del node.meta["val"]
        return gm

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    step = spmd_ort.compile(backend="ort", gm_transformation=forget_a_value)(train_step)
    with pytest.raises(PassError, match=r"`gm_transformation_pass` broke `values_known`.*which "
                                        r"`insert_index_checks_pass` requires later: node `\w+`.*has no meta\['val'\]"):
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_pass_that_breaks_an_undeclared_fact_is_named_with_the_pass_that_needs_it():
    @graph_pass()
    def untag_pass(gm, ctx):
        """Removes the gradient tags without declaring that it invalidates them."""
        for node in [n for n in gm.graph.nodes if n.target is spmd_ort.graph.ops.tag_grad]:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        return gm

    gm, ctx = _traced(tag_grads=True)
    with pytest.raises(PassError, match=r"`untag_pass` broke `grads_tagged`.*which `expand_data_parallel_pass` "
                                        r"requires later: no gradient is tagged"):
        run_passes(gm, ctx, [untag_pass, expand_data_parallel_pass])


def test_the_order_is_checked_before_any_pass_runs_even_without_contract_checks():
    gm, ctx = _traced(tag_grads=True)
    ctx.check_contracts = False
    code = gm.code
    with pytest.raises(PassError, match=r"`bucket_collectives_pass` requires `per_gradient_reductions`.*"
                                        r"`expand_data_parallel_pass` runs after"):
        run_passes(gm, ctx, [bucket_collectives_pass, expand_data_parallel_pass])
    assert gm.code == code and not ctx.applied  # nothing ran
