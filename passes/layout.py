"""Random ops draw their values in the memory layout eager's kernels give their inputs.

``t.bernoulli_(p)`` (dropout's mask), ``rand_like(t)``, ``uniform(t)`` ... fill a tensor laid out
like ``t`` in its memory order, so with the same seed a transposed ``t`` gets another mask than a
contiguous one.  Eager's layouts are what its real kernels return, and three things in a compiled
step disagree with them: torch's fake (meta) kernels that the trace records (batch norm keeps a
transposed input's strides; the CPU kernel returns a contiguous tensor), the decompositions
``lower_to_onnx_ops_pass`` puts in place of eager's kernels (the batch norm decomposition keeps its
input's strides too), and ORT segments (their outputs are contiguous).  Only running eager's kernels
tells, so :func:`pin_random_layouts_pass` runs them once, on the graph as traced, and writes what it
finds into the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from spmd_ort.compat import guarding_hint_or_throw
from spmd_ort.graph.segments import UNINITIALIZED_OPS
from spmd_ort.graph import ops

from .context import PassResult
from .contracts import RANDOM_LAYOUTS_PINNED, VALUES_KNOWN
from .helpers import EAGER_LAYOUT_UNKNOWN, fake_mode_of, is_random, refake
from spmd_ort.backends.ort.decompose import CARRIED_META
from .runner import graph_pass
from spmd_ort.options import get_logger

logger = get_logger(__name__)

EAGER_NAMESPACES = ("aten", "prims")  # ops the probe runs with eager's kernels (besides ops.PURE_OPS)


class _Unknown:
    """A value the probe cannot make: a size with no hint (data-dependent), or computed from one."""


UNKNOWN = _Unknown()


@dataclass(frozen=True)
class RandomLayouts(PassResult):
    """``pin_random_layouts_pass``: the inputs of random ops given eager's layout, and which of them the trace
    had laid out otherwise (``op of input: eager (dims, outermost first), traced (...)``)."""

    pinned: int
    moved: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()  # random ops whose input layout the probe could not find

    def lines(self) -> list[str]:
        if not self.moved and not self.unknown:
            return []
        lines = [f"random ops draw in eager's layouts: {len(self.moved)} of {self.pinned} input(s) laid out "
                 "otherwise than traced" + (f" (dims outermost first: {'; '.join(self.moved)})" if self.moved else "")]
        if self.unknown:
            lines.append(f"  eager's layout unknown (they draw in the executor's): {', '.join(self.unknown)}")
        return lines


@graph_pass(requires=[VALUES_KNOWN], provides=[RANDOM_LAYOUTS_PINNED])
def pin_random_layouts_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Read every tensor input of a random op through ``with_layout(x, dim_order, values)``, with the dim
    order eager's kernels give ``x``, so each random op draws the values eager draws whatever layout the
    executor's kernels return (an ORT segment's contiguous output, a lowered op's).

    Eager's layouts come from eager's kernels, run here once on zeros laid out as the graph's inputs
    (the producers of random ops' inputs only; symbolic sizes at their hints; torch's RNG state is
    left as it was).  Runs first, on the graph as traced: its ops are the ones eager ran.
    ``values`` is False for an uninitialised allocation (its values are never read: nothing is copied).
    Per step, ``with_layout`` returns its input when it is laid out so already (the fx executor).
    """
    wanted = list(dict.fromkeys(arg for node in gm.graph.nodes if is_random(node) for arg in _tensor_inputs(node)))
    if not wanted:
        return gm
    eager = eager_dim_orders(gm, set(wanted))
    fake_mode = fake_mode_of(gm)
    moved, unknown = [], []
    for arg in wanted:
        users = [u for u in arg.users if is_random(u)]
        where = f"{min(users).target.__name__} of `{arg.name}`"  # the first random op reading it, in graph order
        order = eager.get(arg)
        if order is None:
            for user in users:
                user.meta[EAGER_LAYOUT_UNKNOWN] = True
            unknown.append(where)
            continue
        traced = _traced_order(arg.meta["val"])
        if traced is not None and traced != order:
            moved.append(f"{where}: eager {order}, traced {traced}")
        _pin(gm, arg, users, order, fake_mode)
    if unknown:
        logger.info("eager's memory layout of the input of %s is unknown (its producers do not run on zeros): "
                    "those draw in the layout the executor gives", ", ".join(unknown))
    gm.graph.lint()
    gm.recompile()
    ctx.results.record(RandomLayouts(pinned=len(wanted) - len(unknown), moved=tuple(moved), unknown=tuple(unknown)))
    return gm


def _pin(gm: fx.GraphModule, arg: fx.Node, users: list[fx.Node], order: tuple[int, ...], fake_mode) -> None:
    """``users`` (random ops) read ``arg`` through one ``with_layout`` node, placed before the first of them."""
    first = min(users)
    with gm.graph.inserting_before(first):
        pin = gm.graph.call_function(ops.with_layout, (arg, list(order), arg.target not in UNINITIALIZED_OPS))
    pin.meta.update({k: first.meta[k] for k in CARRIED_META if k in first.meta})
    if fake_mode is not None:
        refake(pin, fake_mode)
    else:  # a graph built by hand: plain tensors as values
        pin.meta["val"] = ops.with_layout(arg.meta["val"], list(order), True)
    for user in users:
        user.replace_input_with(arg, pin)


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs of a random op whose layout may set the order it draws in (already pinned ones left out)."""
    return [a for a in node.all_input_nodes
            if isinstance(a.meta.get("val"), torch.Tensor) and a.target is not ops.with_layout]


def _traced_order(val: torch.Tensor) -> tuple[int, ...] | None:
    concrete = _concrete(val)
    return None if concrete is UNKNOWN else ops.dense_dim_order(concrete)


# ---------------------------------------------------------------------- the probe: eager's kernels, once
def eager_dim_orders(gm: fx.GraphModule, wanted: set[fx.Node]) -> dict[fx.Node, tuple[int, ...]]:
    """For each node in ``wanted``, the dim order (:func:`spmd_ort.graph.ops.dense_dim_order`) of the value
    eager's kernels give it; a node whose value the probe cannot make is left out.

    Runs the nodes ``wanted`` depends on, in graph order, on zeros laid out as the placeholders' values
    (aten and prims ops and :data:`~spmd_ort.graph.ops.PURE_OPS` with their own kernels; any other op,
    e.g. an opaque part, stands in by its traced value), freeing each value after its last use there.
    """
    needed = _ancestors(wanted)
    uses = {n: sum(1 for u in n.users if u in needed) for n in needed}
    env: dict[fx.Node, object] = {}
    orders: dict[fx.Node, tuple[int, ...]] = {}
    devices = sorted({v.device.index or 0 for n in needed for v in _tensors(n.meta.get("val"))
                      if v.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):  # the probe's random ops draw nothing of eager's
        for node in gm.graph.nodes:
            if node not in needed or (node.op == "placeholder" and node not in wanted):
                continue  # a placeholder's zeros are made when first read: a parameter lives for its uses only
            for arg in node.all_input_nodes:
                if arg not in env:
                    env[arg] = _concrete(arg.meta.get("val"))
            env[node] = _eager_value(gm, node, env)
            if node in wanted and isinstance(env[node], torch.Tensor):
                orders[node] = ops.dense_dim_order(env[node])
            for arg in node.all_input_nodes:
                uses[arg] -= 1
            for done in (*node.all_input_nodes, node):
                if uses[done] == 0:
                    env.pop(done, None)  # freed after its last use: the probe never holds a whole forward
    return orders


def _ancestors(nodes: set[fx.Node]) -> set[fx.Node]:
    seen, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += node.all_input_nodes
    return seen


def _eager_value(gm: fx.GraphModule, node: fx.Node, env: dict):
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    traced = node.meta.get("val")
    if node.op == "call_function" and _runs_eagerly(node.target):
        args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        if any(a is UNKNOWN for a in pytree.tree_leaves((args, kwargs))):
            return UNKNOWN
        try:
            out = node.target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. an op that checks its values: the traced value stands in
            logger.debug("layout probe: %s failed on zeros (%s); its traced value stands in", node.name, exc)
        else:
            if _same_shapes(out, traced):
                return out
    return _concrete(traced)  # a placeholder, or what cannot run here: laid out as traced


def _runs_eagerly(target) -> bool:
    if target is operator.getitem or target in ops.PURE_OPS:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.namespace in EAGER_NAMESPACES


def _same_shapes(out, traced) -> bool:
    """Whether eager's result has the traced structure and shapes (a data-dependent size on zeros may not)."""
    out_leaves, traced_leaves = pytree.tree_leaves(out), pytree.tree_leaves(traced)
    if len(out_leaves) != len(traced_leaves):
        return False
    for o, t in zip(out_leaves, traced_leaves):
        if isinstance(t, torch.Tensor):
            concrete = _hints(t.shape)
            if not isinstance(o, torch.Tensor) or concrete is UNKNOWN or tuple(o.shape) != tuple(concrete):
                return False
    return True


def _concrete(val):
    """Zeros in the layout of a traced value (symbolic sizes at their hints), or :data:`UNKNOWN`."""
    if isinstance(val, torch.Tensor):
        size, stride = _hints(val.shape), _hints(val.stride())
        if size is UNKNOWN or stride is UNKNOWN:
            return UNKNOWN
        extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
        return torch.zeros(extent, dtype=val.dtype, device=val.device).as_strided(size, stride)
    if isinstance(val, (list, tuple)):
        items = [_concrete(v) for v in val]
        return UNKNOWN if any(i is UNKNOWN for i in items) else type(val)(items)
    if isinstance(val, (torch.SymInt, torch.SymBool)):
        return _hint(val)
    if isinstance(val, torch.SymFloat):
        return UNKNOWN if val.node.hint is None else float(val.node.hint)
    return val


def _hints(sizes) -> list[int] | _Unknown:
    out = [_hint(s) for s in sizes]
    return UNKNOWN if any(s is UNKNOWN for s in out) else out


def _hint(s):
    try:
        return guarding_hint_or_throw(s)
    except Exception:  # noqa: BLE001 - an unbacked (data-dependent) size has no hint
        return UNKNOWN


def _tensors(val) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]
