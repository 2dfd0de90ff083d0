"""Eager's index bounds checks, kept on every backend: a host check of each index the step's inputs feed to a gather.

ONNX Runtime's Gather wraps a negative index (``-1`` reads the last row) where eager raises
``IndexError``, and a positive index out of range fails deep inside a segment.  So every index
argument that follows from the step's batch inputs alone (an ``nn.Embedding`` id, a
``cross_entropy`` target, an ``index_select`` index, ...) is checked once per step, at the top
of the graph, by ``spmd_ort::check_index`` (:mod:`spmd_ort.runtime.checks`): the same error
class as eager, naming the input, the op and the valid range, before anything has run.
Indices the model computes itself (``topk``, ``argmax``) are not checked: they are in range.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.graph.slots import SlotKind
from spmd_ort.backends.ort.coverage import HOST_ONLY
from spmd_ort.graph.segments import RANDOM_OPS
from spmd_ort.graph.meta import COMPUTED_INDEX, USER_OP
from spmd_ort.graph.ops import LINEAR_CROSS_ENTROPY, check_index

from .context import PassResult
from .contracts import Invariant, VALUES_KNOWN
from .helpers import aten, placeholders, val
from .runner import graph_pass

INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)  # bool and uint8 indices are masks

# Ops that keep the set of values of their input (and reshapes keep the order too): an index reached from an
# input through these alone is checked on the input itself, so the error gives the position in the user's tensor.
SAME_VALUES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
               aten.detach.default, aten.clone.default, aten.unsqueeze.default, aten.squeeze.dim,
               aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.permute.default,
               aten.transpose.int, aten.t.default, aten.lift_fresh_copy.default}


@dataclass(frozen=True)
class IndexUse:
    """One index tensor an op reads: the node, the size that bounds it and what eager accepts.

    Valid values are ``[0, high)``, or ``[-high, high)`` where the op wraps negative indices
    (``wraps``), or ``ignore`` (``cross_entropy``'s ``ignore_index``).  ``user_op`` is the call a
    user writes; ``bound`` says what ``high`` is; ``fix`` how to pass a valid value.
    """

    index: fx.Node
    high: int | torch.SymInt
    wraps: bool
    ignore: int | None
    user_op: str
    bound: str
    fix: str


def _dim(node: fx.Node, dim: int) -> int:
    return dim % max(val(node).dim(), 1)


def _embedding(node: fx.Node) -> list[IndexUse]:
    weight, indices = node.args[0], node.args[1]
    n = val(weight).shape[0]
    return [IndexUse(indices, n, False, None, "nn.Embedding / F.embedding", "the rows of the embedding weight",
                     f"ids in [0, {n}) (num_embeddings); padding_idx does not widen the range")]


def _embedding_backward(node: fx.Node) -> list[IndexUse]:
    n = node.args[2]
    return [IndexUse(node.args[1], n, False, None, "nn.Embedding / F.embedding", "the rows of the embedding weight",
                     f"ids in [0, {n}) (num_embeddings)")]


def _along_dim(user_op: str, *, wraps: bool = False) -> Callable[[fx.Node], list[IndexUse]]:
    """``op(self, dim, index, ...)``: the index selects along ``dim`` of ``self``."""
    def rule(node: fx.Node) -> list[IndexUse]:
        source, dim, index = node.args[0], node.args[1], node.args[2]
        d = _dim(source, dim)
        n = val(source).shape[d] if val(source).dim() else 1
        low = f"-{n}" if wraps else "0"
        return [IndexUse(index, n, wraps, None, user_op, f"dim {d} of the indexed tensor",
                         f"indices in [{low}, {n})")]
    return rule


def _advanced(user_op: str) -> Callable[[fx.Node], list[IndexUse]]:
    """``op(self, indices, ...)`` (``t[idx]``): the k-th index tensor selects along dim k; negatives wrap."""
    def rule(node: fx.Node) -> list[IndexUse]:
        source, indices = node.args[0], node.args[1]
        out = []
        for d, index in enumerate(indices):
            if isinstance(index, fx.Node) and val(index).dtype in INDEX_DTYPES:
                n = val(source).shape[d]
                out.append(IndexUse(index, n, True, None, user_op, f"dim {d} of the indexed tensor",
                                    f"indices in [-{n}, {n})"))
        return out
    return rule


def _nll(*, backward: bool) -> Callable[[fx.Node], list[IndexUse]]:
    """``nll_loss(2d)_forward(self, target, weight, reduction, ignore_index)`` (backward: one argument later)."""
    def rule(node: fx.Node) -> list[IndexUse]:
        first = 1 if backward else 0
        scores, target, ignore = node.args[first], node.args[first + 1], node.args[first + 4]
        shape = val(scores).shape
        n = shape[1] if len(shape) > 1 else shape[0]
        return [IndexUse(target, n, False, ignore, "F.cross_entropy / F.nll_loss", "the number of classes",
                         f"class indices in [0, {n}), or {ignore} at positions to skip "
                         "(F.cross_entropy(..., ignore_index=-1) skips -1 instead)")]
    return rule


def _fused_head(node: fx.Node) -> list[IndexUse]:
    """torch's chunked ``linear_cross_entropy(input, weight, target, bias, class_weight, reduction, ignore_index,
    ...)`` (``fuse_linear_cross_entropy_pass``): the target indexes the weight's rows (the classes)."""
    n = val(node.args[1]).shape[0]
    ignore = node.args[6]
    return [IndexUse(node.args[2], n, False, ignore, "F.cross_entropy / F.nll_loss", "the number of classes",
                     f"class indices in [0, {n}), or {ignore} at positions to skip "
                     "(F.cross_entropy(..., ignore_index=-1) skips -1 instead)")]


def _scatter_value(node: fx.Node) -> list[IndexUse]:
    """``Tensor.scatter(self, dim, index, value)``; or ``F.one_hot``, which the trace computes as eager does, a
    scatter of 1 into zeros whose last dim has num_classes entries (``spmd_ort.capture.trace.EAGER_FORMS``)."""
    if node.meta.get("custom", {}).get(USER_OP) != "F.one_hot":
        return _along_dim("Tensor.scatter")(node)
    n = val(node).shape[-1]
    return [IndexUse(node.args[2], n, False, None, "F.one_hot", "num_classes",
                     f"class values in [0, {n}) (num_classes)")]


# op -> the index tensors it reads (a table: a new gather is one row)
INDEX_RULES: dict = {
    aten.embedding.default: _embedding,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.index_select.default: _along_dim("torch.index_select"),
    aten.gather.default: _along_dim("torch.gather"),
    aten.scatter.src: _along_dim("Tensor.scatter"),
    aten.scatter.value: _scatter_value,
    aten.scatter.reduce: _along_dim("Tensor.scatter"),
    aten.scatter.value_reduce: _along_dim("Tensor.scatter"),
    aten.scatter_add.default: _along_dim("Tensor.scatter_add"),
    aten.scatter_reduce.two: _along_dim("Tensor.scatter_reduce"),
    aten.index_add.default: _along_dim("Tensor.index_add"),
    aten.index_copy.default: _along_dim("Tensor.index_copy"),
    aten.index_fill.int_Scalar: _along_dim("Tensor.index_fill", wraps=True),
    aten.index_fill.int_Tensor: _along_dim("Tensor.index_fill", wraps=True),
    aten.index.Tensor: _advanced("indexing tensor[indices]"),
    aten.index_put.default: _advanced("indexed assignment tensor[indices] = values"),
    aten.nll_loss_forward.default: _nll(backward=False),
    aten.nll_loss_backward.default: _nll(backward=True),
    aten.nll_loss2d_forward.default: _nll(backward=False),
    aten.nll_loss2d_backward.default: _nll(backward=True),
    **({LINEAR_CROSS_ENTROPY: _fused_head} if LINEAR_CROSS_ENTROPY is not None else {}),
}


@dataclass(frozen=True)
class IndexChecks(PassResult):
    """``insert_index_checks_pass``: the inputs whose indices are checked each step (input -> ops)."""

    checked: dict[str, tuple[str, ...]]
    unchecked: tuple[str, ...] = ()  # index uses from the inputs left unchecked, and why

    def lines(self) -> list[str]:
        if not self.checked and not self.unchecked:
            return []
        lines = ["index checks (eager's bounds checks, before anything runs): "
                 + (", ".join(f"`{name}` for {', '.join(ops)}" for name, ops in self.checked.items()) or "none")]
        lines += [f"  not checked: {why}" for why in self.unchecked]
        return lines


def _input_only(gm: fx.GraphModule, ctx) -> dict[fx.Node, str | None]:
    """Nodes whose value follows from the batch inputs (and constants) alone -> the input they come from.

    The value is the name of one batch input they read (None: constants only).  Only pure aten ops,
    getitems and size arithmetic: a node that reads state, a random op or a host op is not here.
    """
    out: dict[fx.Node, str | None] = {}
    for node, slot in zip(placeholders(gm), ctx.input_slots):
        if slot.kind is SlotKind.BATCH:
            out[node] = slot.name
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            out[node] = None
        if node.op != "call_function" or not _pure(node) or node.meta.get(COMPUTED_INDEX):
            continue
        inputs = node.all_input_nodes
        if all(a in out for a in inputs):
            out[node] = next((out[a] for a in inputs if out[a] is not None), None)
    return out


def _pure(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem or getattr(target, "__module__", None) in ("_operator", "operator"):
        return True
    schema = getattr(target, "_schema", None)
    return (getattr(target, "namespace", None) == "aten" and schema is not None and not schema.is_mutable
            and target not in RANDOM_OPS)


def _same_values_source(node: fx.Node, input_only: dict) -> fx.Node | None:
    """The placeholder whose values ``node`` holds (through :data:`SAME_VALUES` and widening int casts), or None."""
    while node.op == "call_function":
        if node.target is check_index:
            pass  # an index already checked for another op: its input holds the same values
        elif node.target is aten._to_copy.default:
            src = node.args[0]
            if not (val(src).dtype in INDEX_DTYPES and val(node).dtype in INDEX_DTYPES
                    and val(node).element_size() >= val(src).element_size()):
                return None
        elif node.target not in SAME_VALUES:
            return None
        node = node.args[0]
    return node if node.op == "placeholder" and input_only.get(node) is not None else None


def _module_text(node: fx.Node, ctx) -> tuple[str, str]:
    """(FQN, words) of the module the op ran in, from the capture's tag (:meth:`CallStack.tag_modules`)."""
    fqn = node.meta.get("custom", {}).get("module")
    if fqn is None:
        return "", "in the step function"
    if fqn == "<root>":
        kind = type(ctx.layout.module).__name__ if ctx.layout is not None else "model"
        return fqn, f"in the model ({kind})"
    if ctx.layout is None:
        return fqn, f"in module `{fqn}`"
    try:
        return fqn, f"in module `{fqn}` ({type(ctx.layout.module.get_submodule(fqn)).__name__})"
    except AttributeError:  # a module made while the step runs (named by its class): no FQN
        return "", f"in a {fqn} that is no submodule of the model (made in forward)"


class _Inserter:
    """Builds the checks at the top of the graph: host copies of computed indices, then the check ops."""

    def __init__(self, gm: fx.GraphModule):
        self.graph = gm.graph
        self.anchor = placeholders(gm)[-1]
        self.top: set[fx.Node] = set(placeholders(gm))  # nodes above the anchor: what the checks may read
        self.made: set[fx.Node] = set()  # every node this pass added
        self.copies: dict[fx.Node, fx.Node] = {}
        self.tips: dict[fx.Node, fx.Node] = {}  # checked value -> the last check of it (checks of one value chain)
        self.rules: set[tuple] = set()  # (checked value, high, wraps, ignore) already checked

    def _add(self, target, args: tuple, value) -> fx.Node:
        with self.graph.inserting_after(self.anchor):
            node = self.graph.call_function(target, args)
        node.meta["val"] = value
        self._placed(node)
        self.made.add(node)
        return node

    def _placed(self, node: fx.Node) -> None:
        self.anchor = node
        self.top.add(node)

    def _lift(self, node: fx.Node) -> fx.Node:
        """A constant (``get_attr``) the checks read, moved up to the anchor if it is defined further down."""
        if node.op == "get_attr" and node not in self.top:
            self.anchor.append(node)
            self._placed(node)
        return node

    def host_copy(self, node: fx.Node) -> fx.Node:
        """``node`` recomputed at the top of the graph from the inputs, on the host (marked for the partitioner)."""
        if node.op != "call_function" or node.target is check_index:
            return self._lift(node)
        if node not in self.copies:
            args = [self.host_copy(a) for a in node.all_input_nodes]
            env = dict(zip(node.all_input_nodes, args))
            with self.graph.inserting_after(self.anchor):
                copy = self.graph.node_copy(node, env.__getitem__)
            copy.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "custom")})
            copy.meta[HOST_ONLY] = "recomputes an index from the inputs for its bounds check (spmd_ort::check_index)"
            self._placed(copy)
            self.made.add(copy)
            self.copies[node] = copy
        return self.copies[node]

    def high(self, high, inputs: list[fx.Node]) -> int | fx.Node | None:
        """The bound as the graph's value: an int, a read of an input's symbolic size, or None (not expressible)."""
        if not isinstance(high, torch.SymInt):
            return int(high)
        expr = high.node.expr
        if expr.is_number:
            return int(expr)
        for p in inputs:
            v = val(p)
            for d, size in enumerate(v.shape if isinstance(v, torch.Tensor) else ()):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    return self._add(aten.sym_size.int, (p, d), size)
        return None

    def check(self, origin: fx.Node, source: fx.Node, high, use: IndexUse, strings: tuple[str, ...]) -> None:
        """Check ``source`` (``origin`` itself, or its host copy); every reader of ``origin`` then reads the check.

        Several rules on one value chain their checks, so its readers run after all of them.
        """
        rule = (origin, repr(high), use.wraps, use.ignore)
        if rule in self.rules:
            return
        self.rules.add(rule)
        tip = self.tips.get(origin)
        node = self._add(check_index, (tip if tip is not None else source, high, use.wraps, use.ignore, *strings),
                         val(source))
        # an input's size reads stay on the input (the partitioner reads sizes there); a computed index's move
        # too, so that nothing keeps the original computation alive
        keep_sizes = origin.op == "placeholder"
        (tip if tip is not None else origin).replace_all_uses_with(
            node, delete_user_cb=lambda user: user is not node and user not in self.made
            and not (keep_sizes and user.target in SIZES))
        self.tips[origin] = node


SIZES = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default)  # reads of an input's sizes


def _message(use: IndexUse, op: str, input_name: str, whole_input: bool, where: str) -> str:
    """The error's text; the kernel fills in ``{value}`` and ``{position}``."""
    low = f"-{use.high}" if use.wraps else "0"
    ignored = f" or its ignore_index {use.ignore}" if use.ignore is not None else ""
    subject = (f"input `{input_name}` holds {{value}} at {{position}}" if whole_input else
               f"the indices that {op} reads, computed from input `{input_name}`, hold {{value}} at {{position}}")
    fix = (f"pass {use.fix}" if whole_input else
           f"change input `{input_name}` so that the indices computed from it lie in [{low}, {use.high}){ignored}")
    return (f"{subject}: {use.user_op} ({op}) {where} accepts [{low}, {use.high}) ({use.bound}){ignored}, and "
            f"eager PyTorch raises here too. Fix: {fix}. Nothing ran: the model and optimizer are unchanged")


def _index_uses(gm: fx.GraphModule, ctx):
    """(op node, index use, input name) for every index the batch inputs alone feed to an op of the table."""
    input_only = _input_only(gm, ctx)
    for node in list(gm.graph.nodes):
        rule = INDEX_RULES.get(node.target) if node.op == "call_function" else None
        for use in rule(node) if rule is not None else ():
            name = input_only.get(use.index)
            if name is not None and val(use.index).dtype in INDEX_DTYPES:
                yield node, use, name, input_only


def _unchecked(gm: fx.GraphModule, ctx) -> str | None:
    for node, use, name, _ in _index_uses(gm, ctx):
        if not isinstance(use.high, torch.SymInt):
            return f"`{node.name}` ({node.target}) reads an index from input `{name}` without a bounds check"
    return None


INDICES_CHECKED = Invariant("indices_checked", "every index the batch inputs alone feed to a gather of "
                            "INDEX_RULES is read through spmd_ort::check_index", _unchecked)


@graph_pass(requires=[VALUES_KNOWN], provides=[INDICES_CHECKED])
def insert_index_checks_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Check each index the batch inputs feed to a gather (:data:`INDEX_RULES`) at the top of the graph.

    An index that is an input (or the input reshaped, transposed, widened) is checked on the input
    itself, so the error gives the position in the user's tensor; one computed from the inputs alone
    (a slice, a pad, a mask) is recomputed on the host for its check.  The ops that read the index
    read the check's output, an alias: they run after it, and the check reads only graph inputs, so
    no ORT segment is split.  Bounds are the shapes the trace saw (a symbolic one is read from the
    input size it is).
    """
    inserter = _Inserter(gm)
    checked: dict[str, list[str]] = {}
    unchecked: list[str] = []
    inputs = placeholders(gm)
    for node, use, name, input_only in _index_uses(gm, ctx):
        op = str(node.target.overloadpacket)
        high = inserter.high(use.high, inputs)
        if high is None:
            unchecked.append(f"`{name}` for {op}: its bound {use.high} is no size of an input")
            continue
        fqn, where = _module_text(node, ctx)
        placeholder = _same_values_source(use.index, input_only)
        if placeholder is not None:
            origin, source = placeholder, placeholder
        else:
            origin, source = use.index, inserter.host_copy(use.index)
        message = _message(use, op, name, placeholder is not None, where)
        inserter.check(origin, source, high, use, (op, name, fqn, message))
        if op not in checked.setdefault(name, []):
            checked[name].append(op)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    ctx.results.record(IndexChecks(checked={k: tuple(v) for k, v in checked.items()}, unchecked=tuple(unchecked)))
    return gm
