"""The one place that decides whether a call can reuse a compiled variant.

A :class:`StepKey` describes everything the traced graph was specialised on:
the structure, shapes, dtypes, devices and ``requires_grad`` of the inputs
(for one that requires grad, whether it has a ``.grad``, its shape and dtype;
which leaves are the same tensor; the memory layout of one that is not
contiguous) and their non-tensor values, the module's training modes, its parameters and
buffers (identity, shape, dtype, whether a gradient is present, a layout that
is not contiguous), its forward hooks (they run while tracing), the optimizer's param groups (parameters,
options baked into the graph) and state layout, and mixed precision: autocast
entered outside the step and the GradScaler's class, whether it is enabled and
its update constants (growth and backoff factors, growth interval).  Symbolic
dims (:mod:`spmd_ort.graph.symbolic`) and the values of Python numbers lifted to graph inputs appear as
``None``.  Values that are graph
inputs (tensor contents, the scalar
hyper-parameters an optimizer rule lifts: lr, betas, weight decay, eps,
momentum, dampening) and the GradScaler's scale and growth tracker are not
part of it, so changing them never re-traces.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from spmd_ort.graph.symbolic import DynamicDims, abstract_shape
from spmd_ort.graph import ops
from spmd_ort.options import get_logger

logger = get_logger(__name__)

MAX_VARIANTS = 8
T = TypeVar("T")


def _tensor_desc(t: torch.Tensor) -> tuple:
    return ("tensor", tuple(t.shape), str(t.dtype), str(t.device), bool(t.requires_grad))


def _layout_desc(t: torch.Tensor) -> tuple:
    """A tensor's memory layout when it is not contiguous (nothing when it is, as in keys made before layouts
    counted): the graph's random ops draw in the layouts eager's kernels make from the inputs' own, found once
    when the graph is compiled (``pin_random_layouts_pass``), so another layout needs another graph."""
    if t.is_contiguous():
        return ()
    order = ops.memory_order(t)
    return (("layout", order if order is not None else tuple(t.stride())),)


def _input_desc(t: torch.Tensor, dims: frozenset[int] = frozenset()) -> tuple:
    """A batch tensor: what the graph is specialised on (``None`` for a symbolic size), for one that requires
    grad, its ``.grad``, and a layout that is not contiguous."""
    desc = ("tensor", abstract_shape(tuple(t.shape), dims), str(t.dtype), str(t.device), bool(t.requires_grad))
    if t.requires_grad:
        g = t.grad if t.is_leaf else None
        desc += (None if g is None else ("grad", tuple(g.shape), str(g.dtype)),)
    return desc + _layout_desc(t)


def _leaf_desc(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _tensor_desc(x)
    if isinstance(x, nn.Module):
        return ("module", type(x).__qualname__)
    if isinstance(x, torch.optim.Optimizer):
        return ("optimizer", type(x).__qualname__)
    if isinstance(x, torch.amp.GradScaler):
        return ("grad_scaler", type(x).__qualname__)  # what the graph depends on: StepKey.amp
    try:
        hash(x)
        return ("value", type(x).__qualname__, x)
    except TypeError:
        return ("value", type(x).__qualname__, repr(x))


def _group_desc(group: dict, lifted: tuple[str, ...]) -> tuple:
    items = []
    for k, v in sorted(group.items()):
        if k == "params":
            items.append((k, len(v)))  # which parameters: StepKey.identity
        elif k in lifted:
            items.append((k, "lifted"))
        elif isinstance(v, torch.Tensor):
            items.append((k, _tensor_desc(v), float(v) if v.numel() == 1 else None))
        else:
            items.append((k, _leaf_desc(v)))
    return tuple(items)


@dataclass(frozen=True)
class StepKey:
    inputs: tuple
    training: tuple
    params: tuple
    buffers: tuple
    optimizer: tuple
    world: tuple
    amp: tuple = ()  # autocast entered outside the step; the GradScaler's class, switch and update constants
    shapes: tuple = ()  # dynamic shapes: ("guards", "hold") or the sizes a symbolic program's guards reject

    identity: tuple = ()  # id() of module, optimizer, parameters, buffers: differs between processes

    COMPONENTS = ("inputs", "training", "params", "buffers", "optimizer", "world", "amp", "shapes", "identity")

    def leaf_descs(self) -> list:
        """The description of each leaf of the call (what :func:`spmd_ort.graph.symbolic.changed_dims` compares)."""
        return [desc for label, desc in self.inputs if label.startswith("leaf[")]

    def portable(self, sizes: bool = True) -> str:
        """The key without object identities, one line per entry: equal on every rank running the same step.

        ``sizes=False`` leaves out the inputs' descriptions (to tell keys that differ only in sizes).
        """
        lines = []
        for name in self.COMPONENTS:
            if name == "identity" or (name == "inputs" and not sizes):
                continue
            for entry in getattr(self, name):
                if _labelled(entry):
                    lines.append(f"{name} {entry[0]}: {entry[1]!r}")
                else:
                    lines.append(f"{name}: {entry!r}")
        return "\n".join(lines)

    @classmethod
    def of(cls, module: nn.Module, opt: torch.optim.Optimizer | None, args: tuple, kwargs: dict,
           rule=None, world: tuple = (), amp: tuple = (), dynamic: DynamicDims | None = None,
           shapes: tuple = ()) -> StepKey:
        # Every component is a tuple of (label, value) pairs so that diff() can say what changed.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        dynamic = dynamic or DynamicDims()
        inputs = (("structure", str(spec)),) + tuple(
            (f"leaf[{i}]", _input_desc(x, dynamic.for_leaf(i, tuple(x.shape))) if isinstance(x, torch.Tensor)
             else ("value", type(x).__qualname__, None) if dynamic.lifts(i, x) else _leaf_desc(x))
            for i, x in enumerate(leaves))
        first: dict[int, int] = {}
        aliases = tuple((i, first.setdefault(id(x), i)) for i, x in enumerate(leaves)
                        if isinstance(x, torch.Tensor) and first.setdefault(id(x), i) != i)
        if aliases:  # the same tensor passed twice is one graph input
            inputs += (("aliases", aliases),)
        if dynamic.ones and dynamic:  # a program traced size-obliviously: another one than the plain symbolic one
            inputs += (("symbolic sizes", "from 1"),)
        # each of the module's walks once (a call's key is made on every step: ~50 parameters walked seven times
        # cost more than the rest of the key)
        modules = list(module.named_modules())
        named_params = list(module.named_parameters(remove_duplicate=False))
        named_buffers = list(module.named_buffers(remove_duplicate=False))
        training = tuple((fqn or "<root>", m.training) for fqn, m in modules)
        params = tuple(
            (name, (tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad,
                    None if p.grad is None else ("grad", tuple(p.grad.shape), str(p.grad.dtype))) + _layout_desc(p))
            for name, p in named_params)
        buffers = tuple((name, (tuple(b.shape), str(b.dtype), str(b.device)) + _layout_desc(b))
                        for name, b in named_buffers)
        identity = (
            ("objects", tuple(id(x) for x in leaves
                              if isinstance(x, (nn.Module, torch.optim.Optimizer, torch.amp.GradScaler)))),
            ("parameters", tuple(id(p) for _, p in named_params)),
            ("buffers", tuple(id(b) for _, b in named_buffers)),
            ("param_groups", tuple(tuple(id(p) for p in g["params"]) for g in opt.param_groups) if opt else ()),
            # hooks run while tracing and can change the graph (debug subscribers tap activations)
            ("hooks", tuple((fqn, tuple(m._forward_pre_hooks), tuple(m._forward_hooks))
                            for fqn, m in modules if m._forward_pre_hooks or m._forward_hooks)),
        )
        optimizer: tuple = ()
        if opt is not None:
            names: dict[int, str] = {}
            for n, p in named_params:  # the first name of each (named_parameters' deduplication)
                names.setdefault(id(p), n)
            state = tuple(
                (f"state[{names.get(id(p), '?')}]",
                 tuple((k, _tensor_desc(v) if isinstance(v, torch.Tensor) else _leaf_desc(v))
                       for k, v in sorted(opt.state[p].items())) if p in opt.state else ())
                for g in opt.param_groups for p in g["params"])
            lifted = rule.lifted if rule is not None else ()
            optimizer = (("class", type(opt).__qualname__),) + tuple(
                (f"param_groups[{i}]", _group_desc(g, lifted) + (("structure", rule.structure(g) if rule else ()),))
                for i, g in enumerate(opt.param_groups)) + state
        return cls(inputs, training, params, buffers, optimizer, world, amp, shapes, identity)

    def changes(self, other: StepKey) -> list[tuple[str, tuple[str, ...], Any, Any]]:
        """What differs from ``other``, per component: (component, labels down to the first differing
        entry, e.g. ``("leaf[4]",)``, the old entry, the new entry)."""
        out = []
        for name in self.COMPONENTS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append((name, *_first_difference(theirs, mine)))
        return out

    def diff(self, other: StepKey) -> str:
        """A short account of what differs from ``other`` (for the re-trace log)."""
        return "; ".join(_describe_change(*change) for change in self.changes(other)) or "nothing"


def _describe_change(component: str, path: tuple[str, ...], old: Any, new: Any) -> str:
    where = f" ({' / '.join(path)})" if path else ""
    return f"{component} changed{where}: {_short(old)} -> {_short(new)}"


def _first_difference(old: Any, new: Any) -> tuple[tuple[str, ...], Any, Any]:
    """Follow two labelled key components to the first differing entry: (labels on the way, old, new)."""
    path = []
    while isinstance(old, tuple) and isinstance(new, tuple):
        if len(old) != len(new) and not all(_labelled(x) for x in old + new):
            break
        idx = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), None)
        if idx is None:
            if len(old) != len(new):  # labelled entries, one more on one side (``("symbolic sizes", "from 1")``)
                n = min(len(old), len(new))
                extra = old[n] if len(old) > n else new[n]
                path.append(extra[0])
                old, new = (extra[1], None) if len(old) > n else (None, extra[1])
            break
        a, b = old[idx], new[idx]
        if _labelled(a) and _labelled(b) and a[0] == b[0]:
            path.append(a[0])
            old, new = a[1], b[1]
        else:
            old, new = a, b
            break
    return tuple(path), old, new


def _labelled(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)


def _short(x: Any, limit: int = 160) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."


class TransitionManager(Generic[T]):
    """Compiled variants keyed by :class:`StepKey`, most recently used last (LRU, 8)."""

    def __init__(self, name: str, max_variants: int = MAX_VARIANTS):
        self.name = name
        self.max_variants = max_variants
        self.variants: OrderedDict[StepKey, T] = OrderedDict()
        self.last_key: StepKey | None = None
        self.traces = 0
        self.reason = ""  # why the last lookup that missed must trace
        self.retrace_counts: dict[str, int] = {}  # what changed (key path) -> re-traces it caused
        self._invalidated = ""  # why every variant was dropped (the next miss traces for this reason)

    REPEATED = 3  # re-traces for the same reason before one WARNING

    def lookup(self, key: StepKey) -> T | None:
        found = self.variants.get(key)
        if found is not None:
            self.variants.move_to_end(key)
        elif self._invalidated:
            self.reason, self._invalidated = self._invalidated, ""
            logger.info("re-tracing %s: %s", self.name, self.reason)
        elif self.last_key is not None:
            self.reason = key.diff(self.last_key)
            logger.info("re-tracing %s: %s", self.name, self.reason)
            self._count(key, self.last_key)
        else:
            self.reason = "first call"
        self.last_key = key
        return found

    def _count(self, key: StepKey, last: StepKey) -> None:
        """One WARNING when the same thing keeps changing (like torch.compile's recompile warning)."""
        changes = key.changes(last)
        if not changes:
            return
        component, path, old, new = changes[0]
        what = f"{component} changed" + (f" ({' / '.join(path)})" if path else "")
        n = self.retrace_counts[what] = self.retrace_counts.get(what, 0) + 1
        if n == self.REPEATED:
            desc = dict(key.inputs).get(path[0]) if component == "inputs" and path else None
            scalar = isinstance(desc, tuple) and desc[:1] == ("value",)
            fix = ("let it be a graph input: compile(dynamic=None) (SPMD_ORT_DYNAMIC=auto, the default) makes an "
                   "int or float that changes one; or pass it as a tensor, or keep it constant"
                   if scalar else "keep it constant between calls, or let sizes be symbolic "
                   "(compile(dynamic=None/True), SPMD_ORT_DYNAMIC=auto/1)")
            logger.warning("%s has re-traced %d times because %s between calls (last: %s -> %s); every new value "
                           "compiles a new program. Fix: %s", self.name, n, what, _short(old), _short(new), fix)

    def invalidate(self, reason: str) -> None:
        """Drop every variant: the next call compiles anew, for ``reason`` (a schedule choice changed)."""
        self.variants.clear()
        self._invalidated = reason

    def insert(self, key: StepKey, value: T) -> None:
        self.traces += 1
        self.variants[key] = value
        self.variants.move_to_end(key)
        while len(self.variants) > self.max_variants:
            evicted, _ = self.variants.popitem(last=False)
            logger.info("%s: dropping least recently used compiled variant (%d kept)", self.name,
                        self.max_variants)
