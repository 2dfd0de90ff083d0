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
symbolic (torch specialises them), except where ranks pass different sizes and one of them
passes 1 (the last, short batch of an epoch): then the program is traced size-obliviously
(:attr:`DynamicDims.ones`, torch's ``backed_size_oblivious``) and serves size 1 too, so that
every rank runs the same program.  A dim the model's Python specialises (a
``view`` to a fixed size, a branch on the size) is static in the program
(:attr:`SymbolicShapes.specialised`, logged at INFO with the reason), and every
guard the trace recorded (``s0 <= 128``) is checked before a program runs with
new sizes (:meth:`SymbolicShapes.accepts`).
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from spmd_ort.options import get_logger

logger = get_logger(__name__)

# dynamic=True: the dims of every tensor input made symbolic from the start (batch, sequence)
LEADING_DIMS = 2
# In DynamicDims, the "dim" that stands for a Python number's value: the number is a graph input.
VALUE = -1
LIFTABLE = ("int", "float")  # the Python numbers that can be graph inputs (bool stays a constant)


@dataclass(frozen=True)
class DynamicDims:
    """leaf position in the flattened (args, kwargs) -> dims that are symbolic (:data:`VALUE` for a Python
    number whose value is a graph input).

    ``ones``: a symbolic dim of size 1 stays symbolic (torch specialises 0 and 1): the program is traced
    size-obliviously (:func:`size_oblivious`) and serves size 1 as well.  Set when ranks pass different sizes and
    one of them passes 1, where one program must serve every rank.
    """

    dims: tuple[tuple[int, frozenset[int]], ...] = ()
    ones: bool = False

    @classmethod
    def of(cls, mapping: dict[int, set[int] | frozenset[int]], *, ones: bool = False) -> DynamicDims:
        return cls(tuple(sorted((pos, frozenset(d)) for pos, d in mapping.items() if d)), ones)

    def as_dict(self) -> dict[int, frozenset[int]]:
        return dict(self.dims)

    def __bool__(self) -> bool:
        return bool(self.dims)

    def union(self, other: dict[int, set[int]], *, ones: bool = False) -> DynamicDims:
        merged = {pos: set(d) for pos, d in self.dims}
        for pos, d in other.items():
            merged.setdefault(pos, set()).update(d)
        return DynamicDims.of(merged, ones=self.ones or ones)

    def for_leaf(self, pos: int, shape: tuple[int, ...]) -> frozenset[int]:
        """The dims of this leaf that are symbolic for these sizes (0 and 1 stay static, as in torch; 1 is
        symbolic too with :attr:`ones`)."""
        least = 1 if self.ones else 2
        return frozenset(d for d in self.as_dict().get(pos, ()) if 0 <= d < len(shape) and shape[d] >= least)

    def lifts(self, pos: int, value) -> bool:
        """Whether the Python number ``value`` at leaf ``pos`` is a graph input (its value symbolic)."""
        return type(value).__qualname__ in LIFTABLE and VALUE in self.as_dict().get(pos, ())

    def describe(self, names: dict[int, str] | None = None) -> str:
        names = names or {}
        text = ", ".join(f"{names.get(pos, f'input[{pos}]')} " + ("(its value)" if d == {VALUE} else
                                                                   f"dims {sorted(d)}")
                         for pos, d in self.dims) or "none"
        return text + (" (size 1 included)" if self.ones and self.dims else "")


def size_oblivious_supported() -> bool:
    """Whether this torch can trace sizes size-obliviously (it has ``backed_size_oblivious``; else size 1 stays
    static, and ranks that differ there disagree, as before)."""
    from torch.fx.experimental import _config

    return hasattr(_config, "backed_size_oblivious")


@contextlib.contextmanager
def size_oblivious(dynamic: DynamicDims | None):
    """Trace (and transform) a program of ``dynamic`` as it must be: with :attr:`DynamicDims.ones`, under torch's
    ``backed_size_oblivious``, so that a symbolic size may be 1 (its range starts at 0, and torch's meta functions
    take their general path, the one that is right for 1 as well, without a guard); else as torch traces."""
    if dynamic is None or not dynamic.ones or not size_oblivious_supported():
        yield
        return
    from torch.fx.experimental import _config

    with _config.patch(backed_size_oblivious=True):
        yield


def leading_dims(leaves: list) -> DynamicDims:
    """dynamic=True: the batch and sequence dims of every tensor input."""
    return DynamicDims.of({i: set(range(min(LEADING_DIMS, x.dim()))) for i, x in enumerate(leaves)
                           if isinstance(x, torch.Tensor) and x.dim() > 0})


def abstract_shape(shape: tuple[int, ...], dims: frozenset[int]) -> tuple:
    """A shape for the re-trace key: symbolic dims are ``None``."""
    return tuple(None if i in dims else s for i, s in enumerate(shape))


def changed_dims(old: list, new: list) -> dict[int, set[int]] | None:
    """Dims whose sizes differ between two calls' leaves (same structure): {leaf position: dims}.

    A Python number (int or float) whose value differs counts as its :data:`VALUE` dim.  None when
    anything else differs (a dtype, the number of dims, a number's type, another non-tensor value).
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
        elif _number(a) and _number(b) and a[1] == b[1]:
            if a != b:
                out[i] = {VALUE}
        elif a != b:
            return None
    return out


def _number(desc) -> bool:
    """A key's description of a Python number that can be a graph input: ("value", "int"|"float", v)."""
    return isinstance(desc, tuple) and len(desc) == 3 and desc[0] == "value" and desc[1] in LIFTABLE


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


def input_symbols(gm) -> dict:
    """The symbols of a graph's inputs, each where it is first read: {symbol: (placeholder, dim, SymInt)}.

    ``dim`` is None where the placeholder is the size itself (a size the host computed, a lifted int).
    """
    import sympy

    out: dict = {}
    for node, dim, size in input_sizes(gm):
        if isinstance(size.node.expr, sympy.Symbol):
            out.setdefault(size.node.expr, (node, dim, size))
    return out


def input_sizes(gm):
    """Every symbolic size of a graph's inputs, in order: ``(placeholder, dim, SymInt)``, ``dim`` None where the
    input is the size itself."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        found = [(None, val)] if isinstance(val, torch.SymInt) else \
            list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else []
        for dim, size in found:
            if isinstance(size, torch.SymInt):
                yield node, dim, size


class SizeEmitter:
    """Host nodes at the top of ``graph`` computing a size expression from reads of the inputs' sizes."""

    def __init__(self, graph: fx.Graph, after: fx.Node, sources: dict):
        self.graph, self.anchor, self.sources, self.made = graph, after, sources, {}

    @classmethod
    def of(cls, gm: fx.GraphModule) -> SizeEmitter:
        """An emitter after ``gm``'s inputs, reading every symbol they carry (tensor dims and lifted ints)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return cls(gm.graph, placeholders[-1] if placeholders else None, input_symbols(gm))

    def size(self, value):
        """``value`` (an int, or a SymInt of the inputs' sizes) as a node argument: an int, or a node computing it.
        Raises ValueError where the inputs' sizes cannot rebuild it."""
        if not isinstance(value, torch.SymInt):
            return value
        if not value.node.expr.free_symbols:
            return int(value)
        made = self(value.node.expr) if self.anchor is not None else None
        if made is None:
            raise ValueError(f"the size {value.node.expr} is not computed from the graph inputs' sizes")
        return made

    def __call__(self, expr) -> fx.Node | int | None:
        import sympy
        from torch.utils._sympy.functions import FloorDiv

        if expr in self.made:
            return self.made[expr]
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            if expr not in self.sources:
                return None
            node, d, _ = self.sources[expr]
            if d is None:  # the input is the size itself (a lifted int)
                return node
            return self._add(expr, torch.ops.aten.sym_size.int, (node, d))
        if isinstance(expr, (sympy.Mul, sympy.Add)):
            combine = operator.mul if isinstance(expr, sympy.Mul) else operator.add
            parts = [self(a) for a in expr.args]
            if any(p is None for p in parts):
                return None
            out = parts[0]
            for i, part in enumerate(parts[1:], 2):
                out = self._add(expr.func(*expr.args[:i]), combine, (out, part))
            return out
        if isinstance(expr, FloorDiv):
            a, b = self(expr.args[0]), self(expr.args[1])
            return None if a is None or b is None else self._add(expr, operator.floordiv, (a, b))
        return None

    def _add(self, expr, target, args) -> fx.Node:
        """A node for ``expr``; its value is the same arithmetic on the inputs' symbolic sizes."""
        if expr in self.made:
            return self.made[expr]
        with self.graph.inserting_after(self.anchor):
            node = self.graph.call_function(target, args)
        if target is torch.ops.aten.sym_size.int:
            node.meta["val"] = self.sources[expr][2]
        else:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        self.anchor = self.made[expr] = node
        return node


def fake_inputs(state: list[torch.Tensor], batch: list, batch_dims: list[frozenset[int]], names: list[str]):
    """Fake tensors for a symbolic trace: state static, the batch's ``batch_dims`` symbolic.

    A Python number in ``batch`` (a lifted scalar) becomes a symbolic int or float.
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

    def number(value, name: str):
        source = ConstantSource(name)
        symbol = shape_env.create_unspecified_symbol(value, source=source, dynamic_dim=DimDynamic.DYNAMIC)
        if isinstance(value, float):
            return shape_env.create_symfloatnode(symbol, hint=value, source=source)
        return shape_env.create_symintnode(symbol, hint=value, source=source)

    fake_state = [fake(t, frozenset(), f"state{i}").requires_grad_(t.requires_grad) for i, t in enumerate(state)]
    fake_batch = [fake(t, d, n).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else number(t, n)
                  for t, d, n in zip(batch, batch_dims, names)]
    return mode, fake_state, fake_batch


@dataclass
class SymbolicShapes:
    """What a program traced with symbolic dims accepts: its symbols, where they come from, its guards."""

    sources: dict[str, tuple[int, int | None]]  # symbol name -> (batch index, dim; None: the number itself)
    guards: list = field(default_factory=list)  # sympy expressions over the symbols, all must hold
    specialised: dict[tuple[int, int | None], int] = field(default_factory=dict)  # (batch index, dim) -> size fixed
    least: int = 2  # the smallest size a symbolic dim may take: 2 (torch specialises 0 and 1), 1 size-obliviously

    @classmethod
    def after_trace(cls, mode, fake_batch: list[torch.Tensor]) -> SymbolicShapes:
        import sympy

        shape_env = mode.shape_env
        sources: dict[str, tuple[int, int]] = {}
        specialised: dict[tuple[int, int], int] = {}
        for k, t in enumerate(fake_batch):
            if isinstance(t, (torch.SymInt, torch.SymFloat)):  # a lifted Python number
                simplified = shape_env.simplify(t.node.expr)
                if simplified.is_number:
                    specialised[(k, None)] = t.node.hint
                else:
                    sources.setdefault(str(t.node.expr), (k, None))
                continue
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
        # traced size-obliviously (size_oblivious), the symbols' ranges start at 0: the program serves size 1 too
        lowest = [r.lower for s, r in shape_env.var_to_range.items() if sources.get(str(s), (0, None))[1] is not None]
        least = 1 if lowest and all(low <= 1 for low in lowest) else 2
        return cls(sources, guards, specialised, least)

    def symbolic(self) -> set[tuple[int, int | None]]:
        return set(self.sources.values())

    def accepts(self, batch_shapes: list) -> bool:
        """Whether the program's guards and specialised sizes hold for these batch sizes (a batch tensor's
        shape, a lifted number's value)."""
        def at(k, d):
            return batch_shapes[k] if d is None else batch_shapes[k][d]

        for (k, d), size in self.specialised.items():
            if at(k, d) != size:
                return False
        values = {}
        for name, (k, d) in self.sources.items():
            size = at(k, d)
            if d is not None and size < self.least:
                return False  # traced for sizes >= 2 (torch specialises 0 and 1), or >= 1 size-obliviously
            values[name] = size
        for g in self.guards:
            mapping = {s: values[str(s)] for s in g.free_symbols if str(s) in values}
            if len(mapping) != len(g.free_symbols):
                continue  # a guard on something other than an input size
            if not bool(g.xreplace(mapping)):
                return False
        return True
