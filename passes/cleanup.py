"""Clean-up passes for the functionalized capture."""

from __future__ import annotations

import torch
from torch import fx

from .contracts import VALUES_KNOWN
from .runner import graph_pass

aten = torch.ops.aten


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    return (va.shape == vb.shape and va.dtype == vb.dtype and va.device == vb.device
            and va.stride() == vb.stride())


@graph_pass(requires=[VALUES_KNOWN])
def remove_redundant_copies_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace ``aten.copy(dst, src)`` by ``src`` where both have the same shape, dtype, device and strides.

    Functionalization turns every ``dst.copy_(src)`` (optimizer write-back,
    in-place state updates) into a functional ``copy`` whose result is just
    ``src``; each would cost a pass over memory.
    No such copy remains; numbers unchanged.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.copy.default and len(node.args) == 2:
            dst, src = node.args
            if isinstance(src, fx.Node) and _same_layout(dst, src):
                node.replace_all_uses_with(src)
                gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    return gm


IDENTITY_OPS = (aten.detach.default, aten.alias.default, aten.lift_fresh.default)


@graph_pass()
def remove_identity_views_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Drop ``detach``/``alias``/``lift_fresh`` nodes: the graph runs without autograd, so they are identities.

    Capture keeps views (only mutations are functionalized), and autograd
    leaves a ``detach`` for every saved tensor.  No identity view remains; numbers unchanged.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in IDENTITY_OPS:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm
