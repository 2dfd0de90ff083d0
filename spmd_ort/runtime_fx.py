"""The "fx" executor: runs the compiled graph with PyTorch, op by op, without autograd.

It is the reference executor (every other backend is checked against it) and
the fallback for graph segments another backend cannot run.
"""

from __future__ import annotations

import torch
from torch import fx

from .runtime import active
from .timeline import TimedInterpreter


def views_as_reshapes(gm: fx.GraphModule) -> fx.GraphModule:
    """Every ``view`` of ``gm`` run as ``reshape`` (in place; returns ``gm``).

    A view was traced on the strides torch's meta kernels give, and some CPU kernels return
    other strides (batch norm: meta keeps a transposed input's strides, the kernel returns a
    contiguous output), so a view valid in the trace can fail when the graph runs (found by
    tests/test_fuzz.py).  ``reshape`` is a view wherever the strides allow one and a copy
    otherwise: the same values, and the graph is functional, so no mutation goes through it.
    """
    aten = torch.ops.aten
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten.view.default, aten._unsafe_view.default):
            node.target = aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


class FxExecutor:
    name = "fx"
    reuses_buffers = False  # every run allocates its outputs

    def __init__(self, gm: fx.GraphModule):
        self.gm = views_as_reshapes(gm)  # the program's final graph, as it runs

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        recorder = active().recorder
        with torch.no_grad():
            if recorder is not None:  # a profiled step: node by node, timed
                return list(TimedInterpreter(self.gm, recorder).run(*inputs))
            return list(self.gm(*inputs))

    def describe(self) -> list[str]:
        return ["fx executor: every op runs in PyTorch"]
