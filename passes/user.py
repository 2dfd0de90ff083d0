"""User transforms as passes: ``Override.transform`` and ``compile(gm_transformation=...)``.

They run after the parallel passes, on the distributed graph, in the order the
user gave them; each is one named pass in ``passes_applied``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from spmd_ort.errors import CompileError
from spmd_ort.graph.slots import Slot, SlotKind

from .runner import GraphPass, graph_pass
from .helpers import placeholders


def _check_placeholders(gm: fx.GraphModule, ctx, who: str) -> None:
    n = len(placeholders(gm))
    if n != len(ctx.input_slots):
        raise CompileError(f"{who} left the graph with {n} placeholders but the compiled step has "
                           f"{len(ctx.input_slots)} inputs; keep placeholders and flat_state in step")


def override_transform_pass(override) -> GraphPass:
    """A pass applying ``override.transform(gm, flat_state)``; state the transform appends becomes ``extra`` inputs.

    ``flat_state`` holds the real state tensors of the first ``len(flat_state)``
    placeholders; a transform may append state (and placeholders) but must keep
    both in the same order.
    """
    who = f"{type(override).__name__}.transform"

    @graph_pass()
    def apply(gm: fx.GraphModule, ctx) -> fx.GraphModule:
        layout = ctx.layout
        n_state = sum(1 for s in ctx.input_slots if s.kind.is_state)
        flat_state = layout.gather()
        gm = override.transform(gm, flat_state)
        if not isinstance(gm, fx.GraphModule):
            raise CompileError(f"{who} returned {type(gm).__name__}, not a torch.fx.GraphModule")
        if len(flat_state) < n_state:
            raise CompileError(f"{who} removed state entries; it may only append state")
        added: list[torch.Tensor] = flat_state[n_state:]
        if added:
            start = len(layout.extra_state)
            layout.extra_state.extend(added)
            ctx.input_slots[n_state:n_state] = [Slot(SlotKind.EXTRA, f"extra[{start + i}]", start + i)
                                                for i in range(len(added))]
        _check_placeholders(gm, ctx, who)
        return gm

    apply.__name__ = f"override_transform_pass[{type(override).__name__}]"
    return apply


def gm_transformation_pass(transform: Callable[[fx.GraphModule], fx.GraphModule]) -> GraphPass:
    """A pass applying the user's ``gm_transformation`` (``GraphModule -> GraphModule``)."""

    @graph_pass()
    def gm_transformation_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
        out = transform(gm)
        if not isinstance(out, fx.GraphModule):
            raise CompileError(f"gm_transformation returned {type(out).__name__}, not a torch.fx.GraphModule")
        _check_placeholders(out, ctx, "gm_transformation")
        return out

    return gm_transformation_pass
