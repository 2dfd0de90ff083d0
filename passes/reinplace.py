"""Let the optimizer update its state tensors in place."""

from __future__ import annotations

import operator

from torch import fx

from spmd_ort.graph.slots import SlotKind
from spmd_ort.graph.ops import INPLACE_TWINS

from .helpers import is_view_op
from .contracts import IO_MATCHES_SLOTS
from .runner import graph_pass


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and is_view_op(node.target)


def _aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every view derived from it (they share its storage)."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo += [u for u in n.users if _is_view(u) and u.args and u.args[0] is n]
    return out


@graph_pass(requires=[IO_MATCHES_SLOTS])
def reinplace_optimizer_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Swap a functional optimizer op (``spmd_ort::adam``/``sgd``) for its in-place twin.

    The functional op allocates a fresh copy of every parameter and state tensor
    each step; on CPU that allocation alone costs ~20x the update.  Where each
    mutated list argument is a state placeholder whose new value goes only to the
    graph output for that same state, and nothing reads the old value after the
    op, the op can update the placeholders in place; the outputs become the
    placeholders themselves, which write-back recognizes and skips.  It reads
    ``ctx.input_slots``/``ctx.output_slots``; every rewritten op's outputs are
    its inputs; numbers unchanged.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    in_slot = dict(zip(placeholders, ctx.input_slots))
    out_node = graph.output_node()
    outs = list(out_node.args[0])
    out_slot_of_pos = dict(enumerate(ctx.output_slots))

    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in INPLACE_TWINS:
            continue
        twin, mutated = INPLACE_TWINS[node.target]
        schema_args = [a.name for a in node.target._schema.arguments]
        kwargs = dict(zip(schema_args, node.args)) | dict(node.kwargs)
        inputs = [t for name in mutated for t in kwargs[name]]
        getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(getitems) != len(node.users) or len(getitems) != len(inputs):
            continue  # e.g. first SGD momentum step: buffers are created, not updated
        ok = True
        for k, inp in enumerate(inputs):
            gi = getitems.get(k)
            if gi is None or in_slot.get(inp) is None or in_slot[inp].kind not in (SlotKind.PARAM, SlotKind.OPT_STATE):
                ok = False
                break
            # the new value must only be returned as this same state
            positions = [p for p, o in enumerate(outs) if o is gi]
            if list(gi.users) != [out_node] or not positions or any(
                    out_slot_of_pos[p] != in_slot[inp] for p in positions):
                ok = False
                break
            # nothing may read the old value (or a view of it) after the update
            if any(u > node for a in _aliases(inp) for u in a.users if u is not node):
                ok = False
                break
        if not ok:
            continue
        with graph.inserting_before(node):
            graph.call_function(twin, node.args, node.kwargs).meta["val"] = None  # returns nothing
        for k, inp in enumerate(inputs):
            outs = [inp if o is getitems[k] else o for o in outs]
        out_node.args = (tuple(outs),)
        for gi in getitems.values():
            graph.erase_node(gi)
        graph.erase_node(node)
    return gm
