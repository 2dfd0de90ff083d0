"""A graph run node by node and timed, for profiled steps: every backend's runs under ``train_step.profile``."""

from __future__ import annotations

import operator
import time

from torch import fx

from spmd_ort.graph import ops
from spmd_ort.runtime.interpreter import RunInterpreter
from spmd_ort.runtime.recorder import Recorder

HOST_TARGETS = frozenset(ops.OPTIMIZER_OPS) | {ops.wait_, ops.broadcast_}


class TimedInterpreter(RunInterpreter):
    """Runs a graph node by node, recording segments, host nodes and runs of other ops as spans."""

    def __init__(self, gm: fx.GraphModule, recorder: Recorder):
        super().__init__(gm)
        self.recorder = recorder
        self._run_start: float | None = None
        self._run_ops = 0

    def _flush_run(self, now: float) -> None:
        if self._run_ops:
            self.recorder.add(f"{self._run_ops} op(s)", "compute", self._run_start, now)
        self._run_start, self._run_ops = None, 0

    def run_node(self, n: fx.Node):
        if n.op in ("placeholder", "output") or n.target is operator.getitem:
            return super().run_node(n)
        t0 = time.perf_counter()
        out = super().run_node(n)
        t1 = time.perf_counter()
        if n.op == "call_module":
            self._flush_run(t0)
            self.recorder.add(str(n.target), "compute", t0, t1)
        elif n.op == "call_function" and (n.target in HOST_TARGETS or n.target in ops.STARTS
                                          or getattr(n.target, "namespace", None) == "spmd_ort"):
            self._flush_run(t0)
            self.recorder.add(str(n.target).replace("spmd_ort.", "").replace(".default", ""), "host", t0, t1)
        else:
            if self._run_start is None:
                self._run_start = t0
            self._run_ops += 1
        return out

    def run(self, *args, **kwargs):
        try:
            return super().run(*args, **kwargs)
        finally:
            self._flush_run(time.perf_counter())
