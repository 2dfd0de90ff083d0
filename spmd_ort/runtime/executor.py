"""The executor interface every backend implements, and the table of backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import fx

from spmd_ort.options import Options


@runtime_checkable
class Executor(Protocol):
    """Runs a finished graph (placeholders in, outputs out); it runs no graph passes of its own."""

    name: str
    gm: fx.GraphModule  # what runs (for ORT: segments as submodules, host nodes between them)
    reuses_buffers: bool  # outputs live in buffers the next run overwrites: what escapes a step is copied

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def describe(self) -> list[str]: ...


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


def _fx(gm: fx.GraphModule, options: Options) -> Executor:
    from spmd_ort.runtime.fx_executor import FxExecutor

    return FxExecutor(gm)


def _ort(gm: fx.GraphModule, options: Options) -> Executor:
    from spmd_ort.ort.executor import build_ort_executor  # imports onnxruntime: only when asked for

    return build_ort_executor(gm, options)


BUILDERS: dict[str, Callable[[fx.GraphModule, Options], Executor]] = {"ort": _ort, "fx": _fx}


def build_executor(gm: fx.GraphModule, options: Options) -> Executor:
    return BUILDERS[options.backend](gm, options)
