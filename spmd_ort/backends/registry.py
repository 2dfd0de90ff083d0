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
