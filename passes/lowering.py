"""Lower the ops ONNX cannot translate directly into ops it can (ORT backend)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.ort import coverage

from .context import PassResult
from .contracts import ONNX_LOWERED, VALUES_KNOWN
from .helpers import fake_mode_of, refake
from .runner import graph_pass

# node.meta keys carried from a lowered node to the nodes of its decomposition
CARRIED_META = ("custom", "stack_trace", "nn_module_stack")


@dataclass(frozen=True)
class Lowering(PassResult):
    """``lower_to_onnx_ops_pass``: how many nodes of each op were replaced by their decomposition."""

    lowered: dict[str, int]

    def lines(self) -> list[str]:
        if not self.lowered:
            return []
        return ["lowered for ONNX (torch decompositions): " + ", ".join(f"{op} x{n}" for op, n in self.lowered.items())]


@graph_pass(requires=[VALUES_KNOWN], provides=[ONNX_LOWERED])
def lower_to_onnx_ops_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace every aten node without a direct ONNX translation by torch's decomposition of it.

    The decomposition is traced for the node's own shapes and inlined, and the
    ops it produces are lowered in turn (make_fx applies the table
    recursively), so afterwards every aten node either translates directly
    (``spmd_ort.ort.coverage.why_untranslatable`` is None) or has no decomposition
    and stays on the host.  Nodes that translate directly are left alone, so
    torch's fused kernels still run wherever a segment runs on fx.
    Numbers are equal to rounding (the decompositions are torch's own).
    """
    lowered: dict[str, int] = {}
    cache: dict = {}
    fake_mode = fake_mode_of(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "aten":
            continue
        decomposition = coverage.decomposition_for(node)
        if decomposition is None:
            continue
        _inline(gm, node, decomposition, cache, fake_mode)
        lowered[str(node.target)] = lowered.get(str(node.target), 0) + 1
    gm.graph.eliminate_dead_code()
    ctx.results.record(Lowering(lowered=dict(sorted(lowered.items()))))
    return gm


def _signature(node: fx.Node) -> tuple:
    def describe(a):
        v = a.meta["val"]
        return ("T", tuple(v.shape), v.dtype, v.device.type, tuple(v.stride())) if isinstance(v, torch.Tensor) \
            else ("V", repr(v))

    leaves = fx.node.map_aggregate((node.args, node.kwargs),
                                   lambda a: describe(a) if isinstance(a, fx.Node) else repr(a))
    return node.target, repr(leaves)


def _trace_decomposition(node: fx.Node, decomposition) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The decomposition of ``node`` as a graph over its tensor inputs (in ``all_input_nodes`` order)."""
    inputs = node.all_input_nodes

    def rebuild(*tensors):
        env = dict(zip(inputs, tensors))
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        out = decomposition(*args, **kwargs)
        return tuple(out) if isinstance(out, tuple) else out  # a plain tuple, not torch's return_types

    vals = [n.meta["val"] for n in inputs]
    if any(not all(isinstance(s, int) for s in v.shape) for v in vals):
        # symbolic sizes (dynamic shapes): traced over the graph's own fake values, so the
        # decomposition's size arithmetic becomes nodes over its inputs' sizes
        sub = make_fx(rebuild, decomposition_table=coverage.lowering_table(), tracing_mode="symbolic")(*vals)
        return sub, inputs
    examples = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals]
    sub = make_fx(rebuild, decomposition_table=coverage.lowering_table(), tracing_mode="fake")(*examples)
    return sub, inputs


def _inline(gm: fx.GraphModule, node: fx.Node, decomposition, cache: dict, fake_mode) -> None:
    """Copy the (cached) decomposition graph in place of ``node``; values recomputed in the graph's fake mode."""
    key = _signature(node)
    if key not in cache:
        cache[key] = _trace_decomposition(node, decomposition)[0]
    sub = cache[key]
    graph = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    placeholders = iter(node.all_input_nodes)
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
