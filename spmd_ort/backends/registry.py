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


def build_executor(gm: fx.GraphModule, options: Options) -> Executor:
    return BUILDERS[options.backend](gm, options)
