"""Running a finished graph node by node, without touching torch.fx's process-wide tracing state."""

from __future__ import annotations

from torch import fx


class RunInterpreter(fx.Interpreter):
    """An ``fx.Interpreter`` that runs a finished graph node by node (first runs, checks, profiled steps).

    Unlike its base it does not publish each node's meta as torch.fx's process-wide current meta: that
    global is what a trace under ``preserve_node_meta`` copies onto the nodes it creates, and another
    thread may be compiling meanwhile (its nodes would take this graph's phase tags).  Running a graph
    needs no meta.
    """

    def run_node(self, n: fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return getattr(self, n.op)(n.target, args, kwargs)
