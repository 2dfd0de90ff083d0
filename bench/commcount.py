"""Count the payload of torch.distributed collectives, once per call, whoever calls them.

``CommCounter().install()`` wraps the public collective functions of
``torch.distributed``.  Several of them call one another (in torch 2.13
``all_gather_into_tensor`` and the deprecated ``_all_gather_base`` reach the same
implementation; DeepSpeed uses the ``*_tensor`` entry points, spmd_ort and
FSDP2 others), so a call is counted only at the outermost wrapped function:
nested calls made while one is running are not counted again.
``tests/test_bench_commcount.py`` checks this with known payloads.

Bytes: gathers count the gathered (output) bytes, reduce-scatters the input
bytes, all-reduce and broadcast the tensor's bytes.
"""

from __future__ import annotations

import threading

import torch

GATHER = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather")
SCATTER = ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter")
WHOLE = ("all_reduce", "broadcast")


def _size(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_size(x) for x in t)
    return 0


class CommCounter:
    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self.enabled = False
        self._depth = threading.local()

    def install(self) -> CommCounter:
        """Wrap the functions in torch.distributed and its c10d module (callers reach them through either)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name in GATHER + SCATTER + WHOLE:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(name, fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    setattr(module, name, wrapped)
        return self

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and self.enabled:
                self.bytes += self.payload(name, args, kwargs)
                self.calls += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        counted.__wrapped__ = fn
        return counted

    @staticmethod
    def payload(name: str, args: tuple, kwargs: dict) -> int:
        if name in GATHER:
            return _size(args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list")))
        if name in SCATTER:
            return _size(args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_list")))
        return _size(args[0] if args else kwargs.get("tensor"))
