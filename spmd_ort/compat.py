"""What differs between the torch releases this package runs on (``torch>=2.6``; tested on 2.13, its CUDA path
on 2.11): one import per name, so that no other module needs to know which release provides it."""

from __future__ import annotations

import torch

try:  # torch >= 2.12
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # the same contract (a hint for sizing decisions, no guard added) under its older name
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

try:  # torch >= 2.12
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw
except ImportError:
    def guarding_hint_or_throw(a: torch.SymInt | torch.SymBool | int | bool) -> int | bool:
        """A concrete hint of a symbolic value (raises where it has none); plain ints and bools as they are."""
        if isinstance(a, (torch.SymInt, torch.SymBool)):
            return a.node.require_hint()
        return a

__all__ = ["guarding_hint_or_throw", "optimization_hint"]
