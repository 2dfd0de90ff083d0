"""Bodies of the input-check ops of :mod:`spmd_ort.graph.ops` (host ops that run before anything else).

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
from spmd_ort.runtime.collectives import control_group
from spmd_ort.runtime.step_runtime import current


def check_index(index: Tensor, high: int, wraps: bool, ignore: int | None, op: str, input: str,  # noqa: A002
                fqn: str, message: str) -> Tensor:
    """``index`` itself when every value is in ``[low, high)`` (``low`` is ``-high`` where the op wraps negative
    indices, else 0) or equals ``ignore``; otherwise an :class:`InputIndexError` naming the first bad value.

    ``message`` is the error's text with ``{value}`` and ``{position}`` left to fill in.

    On a GPU the check is eager's own kind, a device-side assert queued with the step's kernels: reading the
    verdict on the host would make every step wait for the GPU to finish the step before it.
    """
    if index.device.type == "cuda":
        _assert_in_range_async(index, high, wraps, ignore, message)
        return index
    failure = _first_bad(index, high, wraps, ignore)
    rt = current()
    if rt is not None and rt.deferred_checks is not None:  # a pipeline rank: agreed at agree_checks
        if failure is None:
            return index
        rt.deferred_checks.append((failure, high, ignore, op, input, fqn, message))
        # what reads it runs on in range (eager's kernel would raise here, alone); every rank raises at agree_checks
        return index.clamp(-high if wraps else 0, high - 1)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        # Every rank runs this check at the same point of the same graph: they agree on whether any of them
        # failed (one small all-reduce), so every rank raises, and none waits in a collective for the others.
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
        if int(flag) == 0:
            return index
        failures: list = [None] * world
        dist.all_gather_object(failures, failure, group=control_group())
        bad_rank = next(r for r, f in enumerate(failures) if f is not None)
        failure = failures[bad_rank]
    elif failure is None:
        return index
    else:
        bad_rank = None
    low, value, position = failure
    text = message.replace("{value}", str(value)).replace("{position}", str(list(position)))
    if bad_rank is not None and bad_rank != dist.get_rank():
        text = f"rank {bad_rank}'s batch: {text} (this rank, {dist.get_rank()}, raises with it)"
    raise InputIndexError(text, input=input, op=op, fqn=fqn or None, value=value, position=position, low=low,
                          high=high, ignore=ignore, rank=bad_rank)


def agree_checks(after: Tensor) -> Tensor:
    """A pipeline's index checks agreed on by every rank at one point all of them reach (each rank's graph holds
    its own stages' checks, so a check cannot agree where it runs): every rank raises the first failure any of
    them found, before any optimizer update; a token otherwise."""
    rt = current()
    found = list(rt.deferred_checks or []) if rt is not None else []
    if rt is not None and rt.deferred_checks is not None:
        rt.deferred_checks.clear()  # (the next run of the graph: a timing run, the next step)
    mine = found[0] if found else None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    bad_rank = None
    if world > 1:
        flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
        if int(flag) == 0:
            return after.new_empty(0)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=control_group())
        bad_rank = next(r for r, f in enumerate(everyone) if f is not None)
        mine = everyone[bad_rank]
    elif mine is None:
        return after.new_empty(0)
    (low, value, position), high, ignore, op, input_, fqn, message = mine
    text = message.replace("{value}", str(value)).replace("{position}", str(list(position)))
    if bad_rank is not None and bad_rank != dist.get_rank():
        text = f"rank {bad_rank}'s batch: {text} (this rank, {dist.get_rank()}, raises with it)"
    raise InputIndexError(text, input=input_, op=op, fqn=fqn or None, value=value, position=position, low=low,
                          high=high, ignore=ignore, rank=bad_rank)


MAX_ASSERT_MESSAGE = 250  # CUDA's device-side assert takes a message shorter than 255 characters


def _assert_in_range_async(index: Tensor, high: int, wraps: bool, ignore: int | None, message: str) -> None:
    """A device-side assert that every index is in range (or ``ignore``): no host synchronisation."""
    if index.numel() == 0:
        return
    ok = (index >= (-high if wraps else 0)) & (index < high)
    if ignore is not None:
        ok |= index == ignore
    text = message.replace("{value}", "an index out of range").replace("{position}", "(on the GPU: not read back)")
    torch._assert_async(ok.all(), text[:MAX_ASSERT_MESSAGE])


def _first_bad(index: Tensor, high: int, wraps: bool, ignore: int | None) -> tuple[int, int, tuple] | None:
    """(low, the first bad value, its position), or None when every index is in range or ``ignore``."""
    if index.numel() == 0:
        return None
    low = -high if wraps else 0
    least, most = torch.aminmax(index)
    if low <= int(least) and int(most) < high:  # one reduction in the common case
        return None
    bad = (index < low) | (index >= high)
    if ignore is not None:
        bad &= index != ignore
    if not bool(bad.any()):
        return None
    position = tuple(int(i) for i in bad.nonzero()[0])
    return low, int(index[position]), position
