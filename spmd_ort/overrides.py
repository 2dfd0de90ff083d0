"""``Override`` and ``OpaqueOverride``: stand-ins for submodules that cannot be traced as they are.

``Override.replacement`` acts before tracing (:mod:`spmd_ort.capture.prepare` swaps the
submodules, undone if the compile fails), ``Override.transform`` after the parallel
passes (``override_transform_pass``); ``OpaqueOverride`` runs matching submodules
eagerly, as opaque host nodes (:mod:`spmd_ort.capture.opaque`).
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod

import torch
from torch import fx, nn


class Override(ABC):
    """Replace a submodule for tracing, then transform the traced graph.

    ``replacement(fqn, orig_submodule)`` is called for every submodule before
    tracing (children of a submodule that is kept are visited too); return the
    module itself to keep it, or a traceable stand-in.  ``transform(gm,
    flat_state)`` runs on the traced graph after the parallel passes and before
    the backend: ``flat_state`` holds the state tensors of the first
    ``len(flat_state)`` placeholders; a transform may append state (and
    placeholders) but must keep both in the same order.
    """

    @abstractmethod
    def replacement(self, fqn: str, orig_submodule: nn.Module) -> nn.Module: ...

    @abstractmethod
    def transform(self, gm: fx.GraphModule, flat_state: list[torch.Tensor]) -> fx.GraphModule: ...


class OpaqueOverride(Override):
    """Run the submodules whose FQN matches a glob eagerly, as opaque host nodes of the compiled step.

    ``OpaqueOverride("model.layers.*.mlp.experts", "router")``: each matching
    submodule (the outermost, where matches nest) is not traced; its forward and
    backward run in PyTorch with its own autograd, inside the one compiled graph.
    Its parameters and buffers stay graph inputs, so data-parallel all-reduce,
    ZeRO-3 gathers and reduce-scatters, the optimizer and checkpoints cover them.
    Patterns use :func:`fnmatch.fnmatchcase` (``*`` also matches dots).  Untraceable
    submodules become opaque without it (``SPMD_ORT_AUTO_OPAQUE``); this makes it
    explicit (no failed trace first, no warning).
    """

    def __init__(self, *patterns: str):
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise TypeError("OpaqueOverride takes one or more FQN glob patterns, e.g. 'model.layers.*.mlp.experts'")
        self.patterns = tuple(patterns)

    def matches(self, fqn: str) -> bool:
        return any(fnmatch.fnmatchcase(fqn, p) for p in self.patterns)

    def replacement(self, fqn: str, orig_submodule: nn.Module) -> nn.Module:
        return orig_submodule  # kept as is: the trace captures it opaquely

    def transform(self, gm: fx.GraphModule, flat_state: list[torch.Tensor]) -> fx.GraphModule:
        return gm

    def __repr__(self) -> str:
        return f"OpaqueOverride({', '.join(map(repr, self.patterns))})"


def as_overrides(module_override: object) -> list[Override]:
    """``compile(module_override=...)`` as a list: None, one :class:`Override`, or a list or tuple of them.

    Anything else is a ``TypeError`` saying what was given (a bare ``OpaqueOverride(...)`` used to fail with
    "'OpaqueOverride' object is not iterable").
    """
    if module_override is None:
        return []
    if isinstance(module_override, Override):
        return [module_override]
    example = "e.g. [spmd_ort.OpaqueOverride('model.layers.*.mlp')]"
    if not isinstance(module_override, (list, tuple)):
        raise TypeError(f"spmd_ort.compile(module_override=...) takes a spmd_ort.Override or a list of them "
                        f"({example}), not {type(module_override).__name__}")
    for i, item in enumerate(module_override):
        if not isinstance(item, Override):
            raise TypeError(f"spmd_ort.compile(module_override=...): item {i} is {type(item).__name__} {item!r:.80}, "
                            f"not a spmd_ort.Override (subclass Override, or use OpaqueOverride; {example})")
    return list(module_override)
