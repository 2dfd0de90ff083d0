"""Dynamic shapes: which sizes of the step's tensor inputs are symbolic, and what a program built on them accepts.

``compile(dynamic=None)`` (``SPMD_ORT_DYNAMIC=auto``) traces the first call
with static shapes.  When a later call misses only because sizes of tensor
inputs changed (same number of dims, same dtypes, everything else equal), the
dims that changed become symbolic (:func:`changed_dims`) and one program serves
every later size.  ``dynamic=True`` makes the leading two dims (batch, sequence)
of every tensor input symbolic from the start; ``False`` keeps one program per
shape.  Across ranks, sizes that differ between ranks become symbolic the same
way, on every rank (:func:`dims_differing_across`).

The trace (:func:`fake_inputs`) runs over fake tensors of one
:class:`~torch._subclasses.fake_tensor.FakeTensorMode` with a ShapeEnv: the
symbolic dims get symbols (no duck sizing: two dims that happen to be equal stay
two symbols), every state tensor stays static.  Sizes 0 and 1 are never
symbolic (torch specialises them).  A dim the model's Python specialises (a
``view`` to a fixed size, a branch on the size) is static in the program
(:attr:`SymbolicShapes.specialised`, logged at INFO with the reason), and every
guard the trace recorded (``s0 <= 128``) is checked before a program runs with
new sizes (:meth:`SymbolicShapes.accepts`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("spmd_ort")

# dynamic=True: the dims of every tensor input made symbolic from the start (batch, sequence)
LEADING_DIMS = 2


@dataclass(frozen=True)
class DynamicDims:
    """leaf position in the flattened (args, kwargs) -> dims that are symbolic."""

    dims: tuple[tuple[int, frozenset[int]], ...] = ()

    @classmethod
    def of(cls, mapping: dict[int, set[int] | frozenset[int]]) -> DynamicDims:
        return cls(tuple(sorted((pos, frozenset(d)) for pos, d in mapping.items() if d)))

    def as_dict(self) -> dict[int, frozenset[int]]:
        return dict(self.dims)

    def __bool__(self) -> bool:
        return bool(self.dims)

    def union(self, other: dict[int, set[int]]) -> DynamicDims:
        merged = {pos: set(d) for pos, d in self.dims}
        for pos, d in other.items():
            merged.setdefault(pos, set()).update(d)
        return DynamicDims.of(merged)

    def for_leaf(self, pos: int, shape: tuple[int, ...]) -> frozenset[int]:
        """The dims of this leaf that are symbolic for these sizes (0 and 1 stay static, as in torch)."""
        return frozenset(d for d in self.as_dict().get(pos, ()) if d < len(shape) and shape[d] > 1)

    def describe(self, names: dict[int, str] | None = None) -> str:
        names = names or {}
        return ", ".join(f"{names.get(pos, f'input[{pos}]')} dims {sorted(d)}" for pos, d in self.dims) or "none"


def leading_dims(leaves: list) -> DynamicDims:
    """dynamic=True: the batch and sequence dims of every tensor input."""
    return DynamicDims.of({i: set(range(min(LEADING_DIMS, x.dim()))) for i, x in enumerate(leaves)
                           if isinstance(x, torch.Tensor) and x.dim() > 0})


def abstract_shape(shape: tuple[int, ...], dims: frozenset[int]) -> tuple:
    """A shape for the re-trace key: symbolic dims are ``None``."""
    return tuple(None if i in dims else s for i, s in enumerate(shape))


def changed_dims(old: list, new: list) -> dict[int, set[int]] | None:
    """Dims whose sizes differ between two calls' leaves (same structure): {leaf position: dims}.

    None when anything but sizes differs (a dtype, the number of dims, a non-tensor value).
    """
    if len(old) != len(new):
        return None
    out: dict[int, set[int]] = {}
    for i, (a, b) in enumerate(zip(old, new)):
        if isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("tensor",):
            if len(a[1]) != len(b[1]) or a[2:] != b[2:]:
                return None
            dims = {d for d, (x, y) in enumerate(zip(a[1], b[1])) if x != y}
            if dims:
                out[i] = dims
        elif a != b:
            return None
    return out


def dims_differing_across(shapes_per_rank: list[list]) -> dict[int, set[int]] | None:
    """Dims whose sizes differ between ranks (each rank's :func:`changed_dims` input): {leaf position: dims}."""
    out: dict[int, set[int]] = {}
    first = shapes_per_rank[0]
    for other in shapes_per_rank[1:]:
        diff = changed_dims(first, other)
        if diff is None:
            return None
        for pos, dims in diff.items():
            out.setdefault(pos, set()).update(dims)
    return out


def fake_inputs(state: list[torch.Tensor], batch: list[torch.Tensor], batch_dims: list[frozenset[int]],
                names: list[str]):
    """Fake tensors for a symbolic trace: state static, the batch's ``batch_dims`` symbolic.

    Returns ``(fake_mode, fake_state, fake_batch)``; the fakes are leaves with the originals' ``requires_grad``.
    """
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)

    def fake(t: torch.Tensor, dims: frozenset[int], name: str) -> torch.Tensor:
        t = t.detach()
        if isinstance(t, FakeTensor):  # a shard's full-shape stand-in (fully_shard): rebuild in this mode
            with mode:
                out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        elif not dims:
            out = mode.from_tensor(t, static_shapes=True)
        else:
            ctx = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())])
            out = mode.from_tensor(t, source=ConstantSource(name), symbolic_context=ctx)
        return out

    fake_state = [fake(t, frozenset(), f"state{i}").requires_grad_(t.requires_grad) for i, t in enumerate(state)]
    fake_batch = [fake(t, d, n).requires_grad_(t.requires_grad) for t, d, n in zip(batch, batch_dims, names)]
    return mode, fake_state, fake_batch


@dataclass
class SymbolicShapes:
    """What a program traced with symbolic dims accepts: its symbols, where they come from, its guards."""

    sources: dict[str, tuple[int, int]]  # symbol name -> (batch index, dim)
    guards: list = field(default_factory=list)  # sympy expressions over the symbols, all must hold
    specialised: dict[tuple[int, int], int] = field(default_factory=dict)  # (batch index, dim) -> the size fixed

    @classmethod
    def after_trace(cls, mode, fake_batch: list[torch.Tensor]) -> SymbolicShapes:
        import sympy

        shape_env = mode.shape_env
        sources: dict[str, tuple[int, int]] = {}
        specialised: dict[tuple[int, int], int] = {}
        for k, t in enumerate(fake_batch):
            for d, size in enumerate(t.shape):
                if not isinstance(size, torch.SymInt):
                    continue
                expr = size.node.expr
                simplified = shape_env.simplify(expr)
                if isinstance(simplified, sympy.Integer) or simplified.is_number:
                    specialised[(k, d)] = int(simplified)
                elif isinstance(expr, sympy.Symbol):
                    sources.setdefault(str(expr), (k, d))
        guards = [g.expr for g in shape_env.guards]
        return cls(sources, guards, specialised)

    def symbolic(self) -> set[tuple[int, int]]:
        return set(self.sources.values())

    def accepts(self, batch_shapes: list[tuple[int, ...]]) -> bool:
        """Whether the program's guards and specialised sizes hold for these batch sizes."""
        for (k, d), size in self.specialised.items():
            if batch_shapes[k][d] != size:
                return False
        values = {}
        for name, (k, d) in self.sources.items():
            size = batch_shapes[k][d]
            if size < 2:
                return False  # traced for sizes >= 2 (torch specialises 0 and 1)
            values[name] = size
        for g in self.guards:
            mapping = {s: values[str(s)] for s in g.free_symbols if str(s) in values}
            if len(mapping) != len(g.free_symbols):
                continue  # a guard on something other than an input size
            if not bool(g.xreplace(mapping)):
                return False
        return True
