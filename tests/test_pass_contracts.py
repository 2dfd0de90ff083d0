"""The runner checks what each pass declares it requires and ensures."""

from __future__ import annotations

import pytest
import torch

import spmd_ort
from spmd_ort.optim import rule_for
from spmd_ort.passes import (PassContext, PassError, expand_data_parallel_pass, graph_pass, run_passes)
from spmd_ort.passes.contracts import NO_GRAD_TAGS
from spmd_ort.state import StateLayout
from spmd_ort.trace import trace_step
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
    @graph_pass(ensures=[NO_GRAD_TAGS])
    def forgetful_pass(gm, ctx):
        """Claims to remove gradient tags but does not."""
        return gm

    gm, ctx = _traced(tag_grads=True)
    with pytest.raises(PassError, match=r"`forgetful_pass` ensures `no_grad_tags`.*6 tag_grad node\(s\) remain"):
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
    with pytest.raises(PassError, match="`add_an_input_pass` ensures `io_matches_slots`"):
        run_passes(gm, ctx, [add_an_input_pass])


def test_contracts_are_not_checked_unless_asked():
    gm, ctx = _traced(tag_grads=False)
    ctx.check_contracts = False
    run_passes(gm, ctx, [expand_data_parallel_pass])  # nothing to expand, nothing checked
