"""The table of backends (the interface every one implements: :mod:`spmd_ort.backends.interface`)."""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from spmd_ort.backends.interface import Executor, ExecutorBase
from spmd_ort.options import Options

__all__ = ["BUILDERS", "Executor", "ExecutorBase", "build_executor"]


def _fx(gm: fx.GraphModule, options: Options) -> Executor:
    from spmd_ort.backends.fx import FxExecutor

    return FxExecutor(gm)


def _ort(gm: fx.GraphModule, options: Options) -> Executor:
    from spmd_ort.backends.ort.executor import build_ort_executor  # imports onnxruntime: only when asked for

    return build_ort_executor(gm, options)


def _inductor(gm: fx.GraphModule, options: Options) -> Executor:
    from spmd_ort.backends.inductor import build_inductor_executor  # imports torch._inductor: only when asked for

    return build_inductor_executor(gm, options)


BUILDERS: dict[str, Callable[[fx.GraphModule, Options], Executor]] = {"ort": _ort, "fx": _fx,
                                                                      "inductor": _inductor}


def build_executor(gm: fx.GraphModule, options: Options, capture=None, input_slots=()) -> Executor:
    """The backend's executor of the finished graph ``gm``; with ``compile(cuda_graph=True)``, wrapped to run as CUDA
    graphs where ``capture`` (the CapturePlan ``plan_graph_capture_pass`` recorded) allows
    (:func:`spmd_ort.backends.cuda_graph.graphed`)."""
    built = BUILDERS[options.backend](gm, options)
    if options.cuda_graph:
        from spmd_ort.backends.cuda_graph import graphed

        built = graphed(built, capture, list(input_slots), options.backend)
    return built
