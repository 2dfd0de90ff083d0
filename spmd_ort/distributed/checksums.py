"""What the ranks compare of a step before they compile it: checksums of the state each holds and of the batch
each passed (exact, order-independent sums of the bytes), beside the agreement that exchanges them
(:func:`spmd_ort.distributed.parallel.exchange_traced`, ``check_same_batch``)."""

from __future__ import annotations

import torch

from spmd_ort.distributed.dtensor import is_dtensor, local
from spmd_ort.graph.slots import SlotKind


def state_checksums(layout, input_slots) -> list[tuple[float, float] | None]:
    """Per graph input, for a parameter or buffer: a checksum of what this rank holds (:func:`checksum`); else
    None.  The ranks compare them with the node signatures (``rank_signatures``): a parameter outside
    the plan is alike on the tensor-parallel group only where every rank holds the same values."""
    out: list[tuple[float, float] | None] = []
    with torch.no_grad():
        for slot in input_slots:
            t = None
            if slot.kind is SlotKind.PARAM:
                t = layout.held(slot.index, layout.params[slot.index])
            elif slot.kind is SlotKind.BUFFER:
                t = layout.buffers[slot.index]
            out.append(checksum(local(t).detach()) if isinstance(t, torch.Tensor) else None)
    return out


def batch_checksums(leaves: list) -> list:
    """Per leaf of the call: for a plain tensor, its shape, dtype and a checksum of its values (:func:`checksum`);
    a Python number's repr; else None.  The ranks of a tensor-parallel group compare them at each program's
    first call (``parallel.check_same_batch``): they must pass the same batch."""
    out: list = []
    with torch.no_grad():
        for x in leaves:
            if isinstance(x, torch.Tensor) and not is_dtensor(x):  # a DTensor batch: its placements say
                out.append((tuple(x.shape), str(x.dtype), checksum(x.detach())))
            else:
                out.append(repr(x) if isinstance(x, (int, float)) else None)  # (repr: NaN equals NaN)
    return out


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two integer sums over ``t``'s bytes (read as int32 where they divide into them): exact and independent of the
    order of the additions, so equal values give equal sums on any device and thread count.  A meta tensor (a
    plan's: no values) sums to (0, 0): every rank of a plan holds the same nothing."""
    if t.is_meta:
        return 0, 0
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    plain = weighted = 0
    for start in range(0, words.numel(), 1 << 22):  # in pieces: the int64 temporaries stay small
        ints = words[start:start + (1 << 22)].to(torch.int64)
        weights = torch.arange(start, start + ints.numel(), device=ints.device) % 65521 + 1  # a permutation differs
        plain += int(ints.sum())
        weighted += int((ints * weights).sum())
    return plain, weighted
