"""Views run as reshapes: what torch runs of the graph cannot fail on strides the trace assumed."""

from __future__ import annotations

import torch
from torch import fx

from .contracts import VIEWS_AS_RESHAPES
from .runner import graph_pass

aten = torch.ops.aten
VIEW_OPS = (aten.view.default, aten._unsafe_view.default)


@graph_pass(provides=[VIEWS_AS_RESHAPES])
def replace_views_with_reshapes_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Every ``view`` becomes ``reshape``.

    A view was traced on the strides torch's meta kernels give, and some CPU kernels return
    other strides (batch norm: meta keeps a transposed input's strides, the kernel returns a
    contiguous output), so a view valid in the trace can fail when the graph runs (found by
    tests/test_fuzz.py).  ``reshape`` is a view wherever the strides allow one and a copy
    otherwise: the same values, and the graph is functional, so no mutation goes through it.
    ONNX translates both to one ``Reshape``, so segments export as before.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in VIEW_OPS:
            node.target = aten.reshape.default
    return gm
