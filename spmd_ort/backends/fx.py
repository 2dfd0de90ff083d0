"""The "fx" executor: runs the compiled graph with PyTorch, op by op, without autograd.

It is the reference executor (every other backend is checked against it) and
the fallback for graph segments another backend cannot run.  It runs the graph
it is given, unchanged.
"""

from __future__ import annotations

import torch
from torch import fx

from spmd_ort.backends.interface import ExecutorBase
from spmd_ort.runtime.step_runtime import active
from spmd_ort.backends.timed import TimedInterpreter


class FxExecutor(ExecutorBase):
    name = "fx"
    reuses_buffers = False  # every run allocates its outputs

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm  # the program's final graph, as it runs

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        recorder = active().recorder
        with torch.no_grad():
            if recorder is not None:  # a profiled step: node by node, timed
                return list(TimedInterpreter(self.gm, recorder).run(*inputs))
            return list(self.gm(*inputs))

    def describe(self) -> list[str]:
        return ["fx executor: every op runs in PyTorch"]
