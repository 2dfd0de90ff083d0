"""Opaque parts of the train step: user code that runs eagerly, as host nodes inside the one graph.

Some parts of a model cannot be traced: a ``torch.autograd.Function`` that reads
a value (``float(x.max())``), calls numpy or a collective; a submodule whose
routing depends on tensor values (an MoE's ``nonzero()``), or whose op has no
fake kernel.  :mod:`spmd_ort.capture.opaque` captures each such call as two host
ops of the graph (``spmd_ort::opaque_forward`` / ``opaque_backward``, defined in
:mod:`spmd_ort.graph.ops`) and records here, in an :class:`OpaqueCall`, how to run it.

At run time the forward op runs the user's code on real tensors with autograd
on (a Function through its own ``apply``, so its ``ctx`` is real; a module's
``forward`` with its parameters bound to the graph's tensors), and the backward
op runs ``torch.autograd.grad`` on what that forward recorded: the user's
``backward`` with that same ``ctx``.  It also says which inputs that backward reached:
an input it did not reach (an MoE expert that got no tokens) gets zeros, where eager
leaves ``.grad`` None (:mod:`spmd_ort.capture.presence` makes the step skip it as
eager does).  What a forward saves for its backward lives in the :class:`OpaqueFrame`
of the running step (one per step, dropped when the step ends), never in a global.

Shapes: the graph needs each opaque output's shape and dtype at trace time,
without running the user's code on the step's data.  They come from a *sample
run* at trace time (:mod:`spmd_ort.capture.opaque`): first on fake tensors; when
that fails (the code reads values), on real random tensors of the inputs'
shapes.  So an opaque part's output shapes must depend only on its input
shapes; every run checks it and names the part when they do not.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from spmd_ort.errors import CompileError


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: Tensor) -> TensorMeta:
        return cls(tuple(int(s) for s in t.shape), t.dtype, t.device)

    def empty(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}"


@dataclass
class OpaqueCall:
    """One call site of an opaque part: what runs, on which inputs, with which outputs, and why.

    ``run(tensors)`` calls the user's code on the flat tensor inputs (activations,
    then, for a module, its parameters and buffers) and returns its raw result,
    whose Python (non-tensor) leaves every run must reproduce (``out_consts``).
    ``updates`` are the inputs (a module's buffers, e.g. running statistics) the
    code updates in place: it gets copies, returned as new values after its outputs.
    """

    index: int
    kind: str  # "function" or "module"
    name: str  # the Function's qualified class name, or the module's class
    fqn: str | None  # the module (for a Function: the module it was called in)
    reason: str
    run: Callable[[list[Tensor]], Any]
    inputs: tuple[TensorMeta, ...]
    needs_grad: tuple[bool, ...]  # per input: whether it gets a gradient
    outputs: tuple[TensorMeta, ...] = ()  # tensor outputs, then the new values of ``updates``
    differentiable: tuple[bool, ...] = ()  # per tensor output
    out_consts: list = field(default_factory=list)
    updates: tuple[int, ...] = ()
    saves_for_backward: bool = False  # set after tracing: a backward op reads what this call saves
    shapes_from: str = "fake tensors"  # how the sample run got the output shapes
    # expert parallelism (spmd_ort.distributed.experts): the input positions of the experts' parameters, which
    # the call receives as this rank's block of experts (spmd_ort.passes.expert_parallel)
    expert_params: tuple[int, ...] = ()
    # the backward runs the forward again instead of keeping what its autograd saved (activation checkpointing
    # of an experts module under expert parallelism: spmd_ort.passes.expert_parallel sets it under a budget)
    recompute: bool = False

    @property
    def what(self) -> str:
        if self.kind == "module":
            return f"module `{self.fqn}` ({self.name})"
        return f"autograd.Function {self.name}" + (f" in module `{self.fqn}`" if self.fqn else "")

    def describe(self) -> str:
        grad = "forward + backward" if self.saves_for_backward else "forward"
        outs = ", ".join(str(m) for m in self.outputs) or "none"
        return f"opaque[{self.index}] {self.what}: {grad}; outputs {outs} (shapes from {self.shapes_from}); " \
               f"why: {self.reason}"

    def split_outputs(self, raw: Any) -> list[Tensor]:
        """The tensor outputs of one real run, checked against what the graph was traced with."""
        leaves = pytree.tree_leaves(raw)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        others = [x for x in leaves if not isinstance(x, Tensor)]
        n_out = len(self.outputs) - len(self.updates)
        if len(tensors) != n_out or others != self.out_consts:
            raise CompileError(
                f"opaque {self.what} returned {len(tensors)} tensors and Python values {others!r}, but was traced "
                f"returning {n_out} tensors and {self.out_consts!r}; an opaque part must return the same "
                "structure on every call (its Python return values cannot depend on tensor values)",
                fqn=self.fqn, op=self.name)
        for i, (t, meta) in enumerate(zip(tensors, self.outputs)):
            if tuple(t.shape) != meta.shape or t.dtype != meta.dtype:
                raise CompileError(
                    f"opaque {self.what}: output {i} is {TensorMeta.of(t)} but the graph was traced with {meta} "
                    f"(shapes from {self.shapes_from}); the output shapes of an opaque part must depend only on "
                    "its input shapes, not on their values", fqn=self.fqn, op=self.name)
        return tensors


def _clone_if_alias(t: Tensor, inputs: list[Tensor]) -> Tensor:
    """Graph ops return new tensors: an output that shares memory with an input is copied."""
    ptr = t.untyped_storage().data_ptr()
    if any(x.untyped_storage().data_ptr() == ptr for x in inputs):
        return t.clone()
    return t


class OpaqueFrame:
    """One step's run-time state of its opaque calls: what each forward recorded for its backward."""

    def __init__(self, calls: tuple[OpaqueCall, ...]):
        self.calls = calls
        self.saved: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        self.seconds = [0.0] * len(calls)  # per call, forward + backward: what the opaque parts cost this step

    def forward(self, index: int, inputs: list[Tensor]) -> list[Tensor]:
        with self._timed(index):
            return self._forward(index, inputs)

    def backward(self, index: int, grads: list[Tensor]) -> list[Tensor]:
        with self._timed(index):
            return self._backward(index, grads)

    @contextlib.contextmanager
    def _timed(self, index: int) -> Iterator[None]:
        """Adds the block's wall time to call ``index``'s cost this step (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[index] += time.perf_counter() - t0

    def _forward(self, index: int, inputs: list[Tensor]) -> list[Tensor]:
        call = self.calls[index]
        leaves = [t.detach().requires_grad_(True) if g else t.detach() for t, g in zip(inputs, call.needs_grad)]
        for i in call.updates:  # the user's code updates these in place: give it copies, return them as new values
            leaves[i] = leaves[i].clone()
        keep = call.saves_for_backward and not call.recompute
        with torch.enable_grad() if keep else torch.no_grad():
            raw = call.run(leaves)
        outs = call.split_outputs(raw)
        if call.saves_for_backward:  # (recompute: the inputs only; the backward runs the forward again)
            self.saved[index] = (leaves, outs if keep else None)
        values = [_clone_if_alias(o.detach(), inputs).contiguous() for o in outs]
        values += [leaves[i].detach() for i in call.updates]
        return values + [torch.tensor(index)]

    def _backward(self, index: int, grads: list[Tensor]) -> list[Tensor]:
        call = self.calls[index]
        if index not in self.saved:
            raise RuntimeError(f"opaque {call.what}: backward ran without its forward in this step")
        leaves, outs = self.saved.pop(index)
        if outs is None:  # recomputed: the forward again, with autograd recording it
            token = RERUN.set(True)
            try:
                with torch.enable_grad():
                    outs = call.split_outputs(call.run(leaves))
            finally:
                RERUN.reset(token)
        diff = [o for o, d in zip(outs, call.differentiable) if d]
        pairs = [(o, g) for o, g in zip(diff, grads) if o.requires_grad]
        wrt = [leaf for leaf, g in zip(leaves, call.needs_grad) if g]
        if pairs:
            with torch.enable_grad():
                got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        else:
            got = [None] * len(wrt)
        # An input backward did not reach (an expert that got no tokens) gets zeros, and a 0 in the presence
        # vector: eager would leave its .grad None (spmd_ort.capture.presence)
        present = torch.tensor([float(g is not None) for g in got], device=_device_of(wrt))
        return [torch.zeros_like(w) if g is None else g.contiguous() for w, g in zip(wrt, got)] + [present]


# set while a backward runs its call's forward again (``OpaqueCall.recompute``): what the forward counts
# (tokens per expert) is not counted twice
RERUN: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_ort_opaque_rerun", default=False)


# ---------------------------------------------------------------------- while tracing
_TRACING: contextvars.ContextVar[list[OpaqueCall] | None] = contextvars.ContextVar("spmd_ort_opaque_calls",
                                                                                    default=None)


@contextlib.contextmanager
def tracing(calls: list[OpaqueCall]) -> Iterator[list[OpaqueCall]]:
    """Make ``calls`` the table the fake kernels of the opaque ops read (while a step is traced)."""
    token = _TRACING.set(calls)
    try:
        yield calls
    finally:
        _TRACING.reset(token)


def _traced_call(index: int) -> OpaqueCall:
    calls = _TRACING.get()
    if calls is None or index >= len(calls):
        raise RuntimeError("spmd_ort::opaque_forward/opaque_backward have shapes only while their step is traced")
    return calls[index]


def fake_forward(inputs: list[Tensor], index: int) -> list[Tensor]:
    """Shapes of an opaque forward's outputs (its tensor outputs, new buffer values, then the token)."""
    call = _traced_call(index)
    return [m.empty() for m in call.outputs] + [torch.empty((), dtype=torch.int64)]


def fake_backward(token: Tensor, grads: list[Tensor], index: int) -> list[Tensor]:
    """Shapes of an opaque backward's outputs: one gradient per input that needs one, then their presence vector."""
    call = _traced_call(index)
    wrt = [m.empty() for m, g in zip(call.inputs, call.needs_grad) if g]
    return wrt + [torch.empty(len(wrt), device=_device_of(wrt))]


def _device_of(tensors: list[Tensor]) -> torch.device:
    """Where a presence vector lives: with the gradients it describes (a collective may sum it over ranks)."""
    return tensors[0].device if tensors else torch.device("cpu")
