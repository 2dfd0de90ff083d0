"""The parameters' precision under a parallel mode: FSDP2's :class:`MixedPrecisionPolicy` (tracing applies it:
``spmd_ort.capture.amp.apply_policy``; the passes cast the collectives it names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy (same names, same meaning), for ``DataParallel(mixed_precision=...)``.

    * ``param_dtype``: forward and backward compute with the parameters cast to it
      (the fp32 parameters and the optimizer state stay the master copy); under
      ``fully_shard`` the all-gather moves it.
    * ``reduce_dtype``: gradients are all-reduced / reduce-scattered in it
      (default: ``param_dtype``, as FSDP2), then updated in the parameter's dtype.
    * ``output_dtype``: floating outputs of the module's forward are cast to it.
    * ``cast_forward_inputs``: floating inputs of the module's forward are cast to
      ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy({name}={value!r}): expected a floating torch.dtype or None")

    def gradient_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradient reductions run in (FSDP2: ``reduce_dtype``, else ``param_dtype``)."""
        return self.reduce_dtype or self.param_dtype
