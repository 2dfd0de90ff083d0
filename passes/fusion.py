"""Fusions that change which kernels run, not what they compute: torch's fused operators for whole patterns.

``fuse_linear_cross_entropy_pass``: an LM head's ``logits = h @ W.T`` followed by ``cross_entropy(logits,
target)``, forward and backward, becomes torch's chunked ``linear_cross_entropy`` operator
(``torch_nn::_linear_cross_entropy_batch_chunked``, what ``F.linear_cross_entropy(..., options=...)`` runs).  It
computes the loss and both gradients in one pass over row chunks of the logits (~4 M logits, at least 512 rows, at
a time), so the forward keeps nothing of the logits' size for the backward (gpt-mini: its 32 MiB of
log-probabilities; the logits and their gradient, 32 MiB each, are made a chunk at a time), and the step makes
fewer passes over memory (gpt-mini's fx step 0.96-0.99x the time without the pass).  Its gradients are
computed in the forward for an upstream gradient
of 1; the backward multiplies them by the real one (a ``GradScaler``'s scale, ``1 / accumulation steps``, ...),
as torch's own autograd formula for the operator does.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.graph import ops

from .context import PassResult
from .contracts import VALUES_KNOWN
from .helpers import aten, fake_mode_of, refake, set_phase, val
from .runner import graph_pass

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
TRANSPOSES = (aten.t.default, aten.permute.default, aten.transpose.int)
CARRIED_META = ("custom", "stack_trace", "nn_module_stack")

# When the fused operator pays (bench/fused_head.py; bench/RESULTS.md, "The LM head fused"): a classifier wider
# than its input (classes >= 4x features; measured at 1x and 8x and more) over logits of at least 2 M elements.
# Below that eager's kernels are as fast or faster (1024 rows x 1024 classes from 128 features: 3.6 ms eager,
# 3.8-4.5 ms fused); above it the operator is faster (4096 rows x 1000 classes from 64 features: 13.4 ms eager,
# 10.3 ms in one chunk) and keeps less memory.
MIN_LOGITS = 1 << 21
MIN_WIDENING = 4
# ... and a narrow input: the elementwise work the operator saves is rows x classes, the GEMMs' rows x classes x
# features, so with wide features it saves nothing and its chunked GEMMs lose (512 rows x 50257 classes from 768
# features: 1.02-1.08x eager; 2048 rows x 32000 classes from 512: 0.97-1.02x over three runs; gpt-mini's 1024 rows
# x 8192 classes from 256: 0.86-0.87x)
MAX_FEATURES = 256
# rows per chunk: chunks of ~4 M logits (16 MiB in float32), at least 512 rows (smaller chunks' GEMMs run slower:
# 2048 rows x 32000 classes from 512 features took 704.6 ms in chunks of 128 rows, 638.5 ms in chunks of 512)
CHUNK_LOGITS = 1 << 22
MIN_CHUNK_ROWS = 512


@dataclass(frozen=True)
class FusedLosses(PassResult):
    """``fuse_linear_cross_entropy_pass``: each fused head (rows x classes, rows per chunk), and heads left."""

    fused: tuple[str, ...] = ()
    left: tuple[str, ...] = ()  # linear + cross-entropy heads kept as they are, and why

    def lines(self) -> list[str]:
        out = [f"linear + cross-entropy fused (torch's chunked linear_cross_entropy): {f}" for f in self.fused]
        return out + [f"linear + cross-entropy not fused: {why}" for why in self.left]


def chunk_rows(rows: int, classes: int) -> int:
    """Rows per chunk of the fused operator: ~:data:`CHUNK_LOGITS` logits, at least :data:`MIN_CHUNK_ROWS`
    (a multiple of 16), at most ``rows``."""
    return min(rows, max(MIN_CHUNK_ROWS, CHUNK_LOGITS // classes // 16 * 16))


def _through(node: fx.Node, targets) -> fx.Node:
    """``node``'s source through single-input ops of ``targets``."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets:
        node = node.args[0]
    return node


def _is_transpose(node: fx.Node) -> bool:
    """A 2-D transpose: ``t``, ``permute(x, [1, 0])`` or ``transpose(x, 0, 1)``."""
    if node.op != "call_function" or node.target not in TRANSPOSES or val(node.args[0]).dim() != 2:
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target is aten.transpose.int:
        return {node.args[1] % 2, node.args[2] % 2} == {0, 1}
    return True


def _untransposed(node: fx.Node) -> tuple[fx.Node, int]:
    """``node``'s source through 2-D transposes, and how many there were."""
    count = 0
    while isinstance(node, fx.Node) and _is_transpose(node):
        node, count = node.args[0], count + 1
    return node, count


def _single_chain_down(node: fx.Node, shape) -> fx.Node | None:
    """Follow reshapes that are ``node``'s only user (and their only users) to the last one back at ``shape``."""
    end = node if tuple(val(node).shape) == tuple(shape) else None
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op != "call_function" or user.target not in RESHAPES:
            break
        node = user
        if tuple(val(node).shape) == tuple(shape):
            end = node
    return end


@dataclass
class _Head:
    """One linear + cross-entropy head found in the graph, and where its pieces are."""

    mm: fx.Node  # logits = mm(h, W^T)
    h: fx.Node
    weight: fx.Node
    forward: fx.Node  # nll_loss_forward
    backward: fx.Node  # nll_loss_backward
    reduction: str
    ignore_index: int
    grad_h: fx.Node | None  # mm(G, W): the gradient of h
    grad_w: fx.Node | None  # mm(G^T, h) (V, D), or mm(h^T, G) (D, V): the gradient of W (or of W^T)
    grad_w_transposed: bool


def _match(nll: fx.Node) -> _Head | str | None:
    """The head ending at the ``nll_loss_forward`` node ``nll``; a reason when it cannot be fused; None when it
    is not a linear + cross-entropy head at all."""
    logp, target, weight, reduction, ignore_index = nll.args[:5]
    if logp.op != "call_function" or logp.target is not aten._log_softmax.default:
        return None
    logits2d = logp.args[0]
    if logp.args[1] not in (1, -1) or val(logp).dim() != 2:
        return None
    mm = _through(logits2d, RESHAPES)
    if mm.op != "call_function" or mm.target is not aten.mm.default:
        return None
    h, weight_t = mm.args
    w, flips = _untransposed(weight_t)
    where = _where(mm)
    if flips % 2 != 1:
        return None  # logits = h @ M with M not a transposed (classes, features) weight
    rows, classes = val(logp).shape
    features = val(h).shape[1]
    if not all(isinstance(s, int) for s in (classes, features)) or classes < MIN_WIDENING * features \
            or features > MAX_FEATURES:
        return None  # not a wide classifier over narrow features: eager's kernels are as fast
    if not isinstance(rows, int):
        return f"{where}: symbolic sizes (dynamic shapes)"
    if tuple(val(mm).shape) != (rows, classes):
        return None
    if rows * classes < MIN_LOGITS:
        return None  # eager's kernels are as fast: nothing to say
    if weight is not None or reduction not in (1, 2):
        return f"{where}: class weights or reduction='none'"
    if val(logp).dtype != torch.float32 or val(mm).dtype != torch.float32 or val(w).dtype != torch.float32:
        return f"{where}: {val(mm).dtype} logits (float32 only)"
    if val(logp).device.type != "cpu":
        return f"{where}: on {val(logp).device.type} (measured on CPU only)"
    if val(target).dtype != torch.int64 or val(target).dim() != 1:
        return f"{where}: a target of {val(target).dtype} with {val(target).dim()} dims"
    # the logits feed the loss only: nothing else reads them whole
    node = mm
    while node is not logits2d:
        if len(node.users) != 1:
            return f"{where}: the logits are read besides the loss"
        node = next(iter(node.users))
    if len(logits2d.users) != 1:
        return f"{where}: the logits are read besides the loss"
    loss_users = {u for u in nll.users}
    total_weight = [u for u in loss_users if u.args[1] == 1]
    backward = [u for u in logp.users if u is not nll]
    nll_bwd = [u for u in backward if u.target is aten.nll_loss_backward.default]
    lsm_bwd = [u for u in backward if u.target is aten._log_softmax_backward_data.default]
    if len(nll_bwd) != 1 or len(lsm_bwd) != 1 or len(backward) != 2:
        return f"{where}: no single cross-entropy backward reads the log-probabilities"
    b, lb = nll_bwd[0], lsm_bwd[0]
    if (tuple(b.args[1:6]) != (logp, target, None, reduction, ignore_index) or list(b.users) != [lb]
            or lb.args[0] is not b or lb.args[1] is not logp):
        return f"{where}: the cross-entropy backward is not the loss's own"
    if any(set(t.users) - {b} for t in total_weight) or (len(b.args) > 6 and b.args[6] not in total_weight):
        return f"{where}: the loss's total weight is read besides its backward"
    grad = _single_chain_down(lb, (rows, classes))
    if grad is None:
        return f"{where}: the logits' gradient is read besides the head's matmuls"
    grad_h = grad_w = None
    transposed = False
    for user in grad.users:
        if user.op == "call_function" and user.target is aten.mm.default and user.args[0] is grad:
            src, flips = _untransposed(user.args[1])  # mm(G, W): W through an even number of transposes
            if src is w and flips % 2 == 0 and grad_h is None:
                grad_h = user
                continue
        if user.op == "call_function" and user.target is aten.mm.default and user.args[1] is grad:
            src, flips = _untransposed(user.args[0])  # mm(h^T, G): the gradient of W^T
            if src is h and flips == 1 and grad_w is None:
                grad_w, transposed = user, True
                continue
        if _is_transpose(user) and len(user.users) == 1:
            (mm_w,) = user.users  # mm(G^T, h): the gradient of W
            if mm_w.target is aten.mm.default and mm_w.args[0] is user and mm_w.args[1] is h and grad_w is None:
                grad_w = mm_w
                continue
        return f"{where}: the logits' gradient is read by {user.target} besides the head's matmuls"
    return _Head(mm, h, w, nll, b, "mean" if reduction == 1 else "sum", ignore_index, grad_h, grad_w, transposed)


def _where(node: fx.Node) -> str:
    """The module that made ``node`` (its FQN), for messages."""
    fqn = node.meta.get("custom", {}).get("module")
    return f"`{fqn}`" if fqn else node.name


def _scaled(graph: fx.Graph, grad: fx.Node, upstream: fx.Node, like: fx.Node) -> fx.Node:
    """``grad * upstream`` (``grad`` itself where the upstream gradient is ``ones_like`` the loss)."""
    if upstream.op == "call_function" and upstream.target is aten.ones_like.default:
        return grad
    node = graph.call_function(aten.mul.Tensor, (grad, upstream))
    node.meta["val"] = val(like).new_empty(val(grad).shape)
    for key in CARRIED_META:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return set_phase(node, "backward")


def _fuse(gm: fx.GraphModule, head: _Head) -> str:
    graph = gm.graph
    fake_mode = fake_mode_of(gm)
    rows, features = val(head.h).shape
    classes = val(head.weight).shape[0]
    chunk = chunk_rows(rows, classes)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk)._adjust(
        rows, features, classes, val(head.h).dtype, val(head.h).device)
    target = head.forward.args[1]

    def node(target_op, *args, **kwargs) -> fx.Node:
        n = graph.call_function(target_op, args, kwargs)
        for key in CARRIED_META:
            if key in head.mm.meta:
                n.meta[key] = head.mm.meta[key]
        refake(n, fake_mode)
        return n

    with graph.inserting_before(head.forward):
        count = class_weight = None
        if head.reduction == "mean":
            # The mean as a sum with every class weighted 1 / (rows that count): where no row counts (a batch of
            # padding), eager's gradients are 0 and its loss NaN (0 / 0), while the operator's mean divides its
            # gradients by 0 too.  Weighted, they are 0; the loss is made NaN below, as eager's.
            count = node(aten.sum.dim_IntList, node(aten.ne.Scalar, target, head.ignore_index), [], dtype=torch.float32)
            counts = node(aten.gt.Scalar, count, 0)
            share = node(aten.where.self, counts, node(aten.reciprocal.default, count),
                         node(aten.zeros_like.default, count))
            class_weight = node(aten.expand.default, node(aten.reshape.default, share, [1]), [classes])
        args = (head.h, head.weight, target, None, class_weight, "sum", head.ignore_index, 0.0,
                options.batch_chunk_size, options.acc_policy, options.acc_dtype, False, head.grad_h is not None,
                head.grad_w is not None, False)
        fused = node(ops.LINEAR_CROSS_ENTROPY, *args)
        outs = []
        for i in range(4):
            item = graph.call_function(operator.getitem, (fused, i))
            item.meta["val"] = fused.meta["val"][i]
            outs.append(item)
        if count is not None:
            nan = node(aten.full_like.default, outs[0], float("nan"))
            outs[0] = node(aten.where.self, counts, outs[0], nan)
    loss, gi, gw = outs[:3]
    for user in list(head.forward.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(loss)
    upstream = head.backward.args[0]
    if head.grad_h is not None:
        with graph.inserting_before(head.grad_h):
            head.grad_h.replace_all_uses_with(_scaled(graph, gi, upstream, head.grad_h))
    if head.grad_w is not None:
        with graph.inserting_before(head.grad_w):
            scaled = _scaled(graph, gw, upstream, head.grad_w)
            if head.grad_w_transposed:
                scaled = graph.call_function(aten.t.default, (scaled,))
                scaled.meta["val"] = val(head.grad_w).new_empty(val(head.grad_w).shape)
                set_phase(scaled, "backward")
            head.grad_w.replace_all_uses_with(scaled)
    return f"{_where(head.mm)}: {rows} rows x {classes} classes, {options.batch_chunk_size} rows per chunk"


@graph_pass(requires=[VALUES_KNOWN])
def fuse_linear_cross_entropy_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace each LM head's ``mm`` + ``log_softmax`` + ``nll_loss`` (forward and backward) by torch's chunked
    ``linear_cross_entropy`` operator where it pays (float32 on CPU, classes >= 4x features, features <= 256,
    >= 2 M logits).

    The operator returns the loss and the gradients of the hidden states and the weight for an upstream
    gradient of 1; the backward's matmuls are replaced by those times the upstream gradient.  A head whose
    logits are read besides the loss (returned, an accuracy) is kept as it is, and says why in ``describe()``.
    Numbers: the same sums over the same values in another order (float32 rounding).
    """
    if ops.LINEAR_CROSS_ENTROPY is None:
        return gm
    fused, left = [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.nll_loss_forward.default:
            continue
        head = _match(node)
        if isinstance(head, str):
            left.append(head)
        elif head is not None:
            fused.append(_fuse(gm, head))
    if fused:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    if fused or left:
        ctx.results.record(FusedLosses(tuple(fused), tuple(left)))
    return gm
