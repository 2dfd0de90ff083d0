"""What ONNX gets for an aten op it cannot translate directly: torch's decomposition of it, traced per node.

``lower_to_onnx_ops_pass`` marks each such node with its decomposition (:func:`annotate`): a graph over the
node's tensor inputs, traced for the node's own shapes with :func:`spmd_ort.backends.ort.coverage.lowering_table`
applied recursively, so it holds only ops that translate directly (or that have no decomposition).  The
compiled graph keeps the op itself: where a segment runs in torch (fx, the checked first run, the float64
re-run), torch's fused kernel runs.  The exporter translates :func:`expand`'s copy of a segment, in which
every marked node is replaced by its decomposition; the operator-support predicate asks
:func:`why_not_lowerable` of a marked node.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.backends.ort import coverage
from spmd_ort.backends.ort.fused import OWN_DECOMPOSITIONS
from spmd_ort.graph.meta import fake_mode_of, refake

aten = torch.ops.aten
DECOMPOSITION = "onnx_decomposition"  # node.meta key: the node's decomposition (an fx.GraphModule)
# node.meta keys carried from a lowered node to the nodes of its decomposition
CARRIED_META = ("custom", "stack_trace", "nn_module_stack")


def annotate(gm: fx.GraphModule) -> dict[str, int]:
    """Mark every aten node of ``gm`` without a direct translation with its decomposition; counts per op.

    The graph is not changed (only ``node.meta``); decompositions are shared between nodes with the same
    op, arguments, shapes and strides.
    """
    marked: dict[str, int] = {}
    cache: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or (getattr(node.target, "namespace", None) != "aten"
                                          and node.target not in OWN_DECOMPOSITIONS):
            continue
        decomposition = coverage.decomposition_for(node)
        if decomposition is None:
            continue
        key = _signature(node)
        if key not in cache:
            cache[key] = _trace_decomposition(node, decomposition)
        node.meta[DECOMPOSITION] = cache[key]
        marked[str(node.target)] = marked.get(str(node.target), 0) + 1
    return dict(sorted(marked.items()))


def stable_sorts(gm: fx.GraphModule) -> int:
    """Make every ``sort`` of ``gm`` stable (equal values keep their input order); how many were not.

    torch's unstable sort leaves the order of equal values unspecified, and its CPU kernel does not keep
    their input order; ONNX Runtime sorts with ``TopK``, which does (ONNX: the lower index first).  An MoE
    sorting its token-expert pairs by expert (transformers' ``grouped_mm`` experts) has thousands of equal
    keys: the segment's permutation out of ORT differed from torch's and its checked first run failed.  A
    stable sort is one of the orders the unstable one may give, so the graph asks for it, and torch (the fx
    side, the checked first run) computes the order ORT does.
    """
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.sort.default, aten.sort.stable):
            continue
        if node.target is aten.sort.default:
            args = dict(zip(("self", "dim", "descending"), node.args), **node.kwargs)
        else:
            args = dict(zip(("self",), node.args), **node.kwargs)
            if args.get("stable"):
                continue
        node.target = aten.sort.stable
        node.args = (args.pop("self"),)
        node.kwargs = {**args, "stable": True}
        changed += 1
    if changed:
        gm.recompile()
    return changed


def why_not_lowerable(node: fx.Node, why_host) -> str | None:
    """None when every op of a marked node's decomposition runs in ORT (``why_host`` of each is None)."""
    sub = node.meta[DECOMPOSITION]
    reasons = getattr(sub, "_spmd_ort_host", None)
    if reasons is None:
        reasons = [f"{n.target}: {r}" for n in sub.graph.nodes if n.op == "call_function"
                   if (r := why_host(n)) is not None]
        sub._spmd_ort_host = reasons
    return f"its decomposition needs the host ({reasons[0]})" if reasons else None


def expand(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every marked node replaced by its decomposition (what ONNX translates)."""
    if not any(_marked(n) for n in gm.graph.nodes):
        return gm
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    fake_mode = fake_mode_of(out)
    for node in [n for n in out.graph.nodes if _marked(n)]:
        _inline(out, node, node.meta[DECOMPOSITION], fake_mode)
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


def fuse_loss_backward(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` in which each cross-entropy backward (``nll_loss_backward`` read only by the
    ``_log_softmax_backward_data`` of the same log-probabilities) is exported as one expression; else ``gm``.

    Translated op by op, the pair makes a zero tensor of the logits' size, scatters -1 into it, multiplies it
    by the per-row weight, then takes ``g - exp(y) * sum(g)``: seven passes over the logits (gpt-mini's
    1024x8192: ~36 ms of ORT's segment, against ~20 ms for torch's two kernels). Since each row of ``g``
    holds one non-zero, ``-w`` at the target, the result is ``exp(y) * w`` with ``-w`` added at the
    target: an Exp, a Mul and a ScatterElements that adds one value per row. The same operations on the
    same values as the pair's (``0 - exp(y) * -w`` is ``exp(y) * w``; the row sum of a single non-zero is
    that value), so the same numbers. Class weights, inputs other than (batch, classes) and float16 keep the pair.
    """
    if not any(_loss_backward_pair(n) is not None for n in gm.graph.nodes):
        return gm
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    fake_mode = fake_mode_of(out)
    for node in [n for n in out.graph.nodes if _loss_backward_pair(n) is not None]:
        nll = node.args[0]
        g, logp, target, _weight, reduction, ignore_index, total_weight = nll.args
        inputs = [g, logp, target, total_weight]
        sub = _trace_over([v.meta["val"] for v in inputs],
                          lambda *ts: _cross_entropy_backward(*ts, reduction=reduction, ignore_index=ignore_index))
        _inline(out, node, sub, fake_mode, inputs=inputs)
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


def _loss_backward_pair(node: fx.Node) -> fx.Node | None:
    """The ``nll_loss_backward`` node a ``_log_softmax_backward_data`` node fuses with (see fuse_loss_backward)."""
    if node.op != "call_function" or node.target is not torch.ops.aten._log_softmax_backward_data.default:
        return None
    nll, output, dim = node.args[:3]
    if not isinstance(nll, fx.Node) or nll.target is not torch.ops.aten.nll_loss_backward.default:
        return None
    if len(nll.users) != 1 or len(nll.args) != 7 or nll.args[1] is not output or nll.args[3] is not None:
        return None
    val = output.meta.get("val")
    # float32 and float64 only: ONNX Runtime's CPU ScatterElements has no float16 kernel with reduction="add"
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or dim not in (1, -1) or \
            val.dtype not in (torch.float32, torch.float64) or node.args[3] != val.dtype:
        return None
    return nll


def _cross_entropy_backward(g, logp, target, total_weight, *, reduction: int, ignore_index: int):
    """``_log_softmax_backward_data(nll_loss_backward(g, logp, target, None, reduction, ignore_index,
    total_weight), logp, 1)`` for a (batch, classes) ``logp``."""
    w = g / total_weight if reduction == 1 else g  # 1: mean (torch's Reduction enum)
    valid = target != ignore_index
    w = torch.where(valid, w, torch.zeros((), dtype=w.dtype)).unsqueeze(1)
    safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype)).unsqueeze(1)
    return torch.scatter_add(torch.exp(logp) * w, 1, safe, -w)


def _trace_over(vals: list, fn) -> fx.GraphModule:
    """``fn`` traced over tensors like ``vals`` (symbolic where their sizes are), lowered to ONNX-translatable ops."""
    if any(not all(isinstance(s, int) for s in v.shape) for v in vals):
        return make_fx(fn, decomposition_table=coverage.lowering_table(), tracing_mode="symbolic")(*vals)
    examples = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals]
    return make_fx(fn, decomposition_table=coverage.lowering_table(), tracing_mode="fake")(*examples)


def _marked(node: fx.Node) -> bool:
    """An op marked with its decomposition (a segment's placeholder for such an op's value carries the mark
    too: the partitioner copies a value's meta onto the placeholder that receives it)."""
    return node.op == "call_function" and DECOMPOSITION in node.meta


def _signature(node: fx.Node) -> tuple:
    def describe(a):
        v = a.meta["val"]
        return ("T", tuple(v.shape), v.dtype, v.device.type, tuple(v.stride())) if isinstance(v, torch.Tensor) \
            else ("V", repr(v))

    leaves = fx.node.map_aggregate((node.args, node.kwargs),
                                   lambda a: describe(a) if isinstance(a, fx.Node) else repr(a))
    return node.target, repr(leaves)


def _trace_decomposition(node: fx.Node, decomposition) -> fx.GraphModule:
    """The decomposition of ``node`` as a graph over its tensor inputs (in ``all_input_nodes`` order)."""
    inputs = node.all_input_nodes

    def rebuild(*tensors):
        env = dict(zip(inputs, tensors))
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        out = decomposition(*args, **kwargs)
        return tuple(out) if isinstance(out, tuple) else out  # a plain tuple, not torch's return_types

    # symbolic sizes (dynamic shapes): traced over the graph's own fake values, so the
    # decomposition's size arithmetic becomes nodes over its inputs' sizes
    return _trace_over([n.meta["val"] for n in inputs], rebuild)


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, fake_mode,
            inputs: list[fx.Node] | None = None) -> None:
    """Copy the graph ``sub`` in place of ``node``, its placeholders reading ``inputs`` (default: the node's
    inputs); values recomputed in the graph's fake mode."""
    graph = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    placeholders = iter(node.all_input_nodes if inputs is None else inputs)
    carried = {k: node.meta[k] for k in CARRIED_META if k in node.meta}
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "get_attr":
                constant = getattr(sub, n.target)
                env[n] = graph.get_attr(_fresh_attr(gm, constant))
                env[n].meta["val"] = fake_mode.from_tensor(constant) if fake_mode is not None else constant
            elif n.op == "call_function":
                env[n] = graph.node_copy(n, env.__getitem__)
                env[n].meta.update(carried)
                if fake_mode is not None:
                    refake(env[n], fake_mode)
            elif n.op == "output":
                result = fx.map_arg(n.args[0], env.__getitem__)
    _replace(node, result)


def _fresh_attr(gm: fx.GraphModule, value: torch.Tensor) -> str:
    i = 0
    while hasattr(gm, f"_lowered_constant{i}"):
        i += 1
    name = f"_lowered_constant{i}"
    gm.register_buffer(name, value)
    return name


def _replace(node: fx.Node, result) -> None:
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"{node.format_node()} returns several values but {user.name} reads them whole")
            user.replace_all_uses_with(result[user.args[1]])
            user.graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    node.graph.erase_node(node)
