"""Bodies of the input-check ops of :mod:`spmd_ort.runtime.ops` (host ops that run before anything else).

``check_index`` is eager's bounds check of an index tensor that the step's inputs feed to a
gather (``nn.Embedding``, ``index_select``, a ``cross_entropy`` target, ...), done once per step
at the top of the graph: ONNX Runtime's Gather reads row ``n - 1`` for an index of ``-1`` where
eager raises, so without it a bad batch would train silently on the ORT backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from spmd_ort.errors import InputIndexError


def check_index(index: Tensor, high: int, wraps: bool, ignore: int | None, op: str, input: str,  # noqa: A002
                fqn: str, message: str) -> Tensor:
    """``index`` itself when every value is in ``[low, high)`` (``low`` is ``-high`` where the op wraps negative
    indices, else 0) or equals ``ignore``; otherwise an :class:`InputIndexError` naming the first bad value.

    ``message`` is the error's text with ``{value}`` and ``{position}`` left to fill in.
    """
    if index.numel() == 0:
        return index
    low = -high if wraps else 0
    least, most = torch.aminmax(index)
    if low <= int(least) and int(most) < high:  # one reduction in the common case
        return index
    bad = (index < low) | (index >= high)
    if ignore is not None:
        bad &= index != ignore
    if not bool(bad.any()):
        return index
    position = tuple(int(i) for i in bad.nonzero()[0])
    value = int(index[position])
    text = message.replace("{value}", str(value)).replace("{position}", str(list(position)))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    raise InputIndexError(text, input=input, op=op, fqn=fqn or None, value=value, position=position, low=low,
                          high=high, ignore=ignore, rank=rank)
