"""Node builders and predicates shared by the pass files (each imports them from here)."""

from __future__ import annotations

import operator

import torch
from torch import fx

from spmd_ort.graph.slots import SlotKind
from spmd_ort.graph import ops
from spmd_ort.graph.aliasing import is_view_op  # noqa: F401 - the passes import it from here
from spmd_ort.graph.liveness import value_bytes
# the pass files import the node-meta vocabulary (spmd_ort.graph.meta) from here, with the builders below
from spmd_ort.graph.meta import (ACTIVATION_COLLECTIVE, DEDUP_KEY, EAGER_LAYOUT_UNKNOWN,  # noqa: F401
                                 EXPERT_BLOCK, GRADIENT_OF, PARTIAL_FOUND_INF, PARTIAL_NORM, PP_ACTION, PP_SCHEDULE,
                                 SHARD_OF, SHARDED_PARAM, fake_mode_of, phase, refake)

aten = torch.ops.aten
TAG = ops.tag_grad
AMP_CHECK = aten._amp_foreach_non_finite_check_and_unscale.default  # GradScaler.unscale_, functionalized

is_random = ops.draws_random  # whether a node draws random numbers (one definition, shared with the partitioner)


def val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


tensor_bytes = value_bytes  # the one byte count (a symbolic size at the size the program was traced with)


def nbytes(node: fx.Node) -> int:
    return value_bytes(val(node))


def call(graph: fx.Graph, target, args: tuple, value, kwargs: dict | None = None) -> fx.Node:
    """A ``call_function`` node with its ``meta["val"]`` set."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = value
    return node


def calls(gm: fx.GraphModule, *targets) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


# where each collective op takes its process group's name ("": the world)
_GROUP_ARG = {ops.all_gather: 3, ops.reduce_scatter: 2, ops.all_reduce_: 2}


def group_of(node: fx.Node) -> str:
    """The process group a collective node runs on, by name ("": the world)."""
    pos = _GROUP_ARG.get(node.target)
    if pos is None:
        return ""
    return node.args[pos] if len(node.args) > pos else node.kwargs.get("group", "")


def shard_calls(gm: fx.GraphModule, ctx, *targets) -> list[fx.Node]:
    """``calls`` of the data-parallel group's collectives only: in 2-D the graph also holds the tensor-parallel
    group's (DTensor's), which the fully_shard passes neither bucket, prefetch nor carry."""
    return [n for n in calls(gm, *targets) if group_of(n) == ctx.group]


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def compute_device(gm: fx.GraphModule, input_slots) -> torch.device:
    """Where the step computes: the device of its batch tensors (not of lifted Python numbers); CPU without."""
    batch = [val(n) for n, s in zip(placeholders(gm), input_slots)
             if s.kind is SlotKind.BATCH and isinstance(val(n), torch.Tensor)]
    return batch[0].device if batch else torch.device("cpu")


def set_phase(node: fx.Node, ph: str) -> fx.Node:
    if ph == "backward":
        node.meta.setdefault("custom", {})["phase"] = "backward"
    return node


def is_dtype_cast(node: fx.Node) -> bool:
    """``_to_copy`` that changes only the dtype (autocast's and a MixedPrecisionPolicy's casts)."""
    if node.op != "call_function" or node.target is not aten._to_copy.default:
        return False
    kwargs = dict(node.kwargs)
    if set(kwargs) - {"dtype", "layout", "device"} or "dtype" not in kwargs or len(node.args) != 1:
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.device == out.device
            and src.layout == out.layout)


UNPACK_OPS = (aten.split_with_sizes.default, aten.view.default, aten.reshape.default, aten.slice.Tensor,
              operator.getitem)
PACK_OPS = (aten.cat.default, aten.clone.default, aten.reshape.default, aten.view.default,
            aten.constant_pad_nd.default, aten._to_copy.default)


def unpack_chain(wait: fx.Node) -> set[fx.Node]:
    """``wait`` and the split/getitem/slice/view nodes downstream of it that only unpack the bucket."""
    chain, todo = {wait}, [wait]
    while todo:
        for user in todo.pop().users:
            if user.op == "call_function" and user.target in UNPACK_OPS and user not in chain:
                chain.add(user)
                todo.append(user)
    return chain


def producers(node: fx.Node) -> list[fx.Node]:
    """The nodes that only pack a collective's input (cat/reshape/pad/copy of single-use values), innermost first."""
    out: list[fx.Node] = []

    def visit(n: fx.Node) -> None:
        if n.op != "call_function" or n.target not in PACK_OPS or len(n.users) != 1 or n in out:
            return
        for arg in n.all_input_nodes:
            visit(arg)
        out.append(n)

    visit(node)
    return out


def move_after_inputs(node: fx.Node) -> None:
    """Move ``node`` up to just after the last of its inputs (fx nodes compare by graph position)."""
    inputs = node.all_input_nodes
    if not inputs:
        return
    last = max(inputs)
    if last.next is not node:
        last.append(node)


__all__ = ["ACTIVATION_COLLECTIVE", "AMP_CHECK", "DEDUP_KEY", "EAGER_LAYOUT_UNKNOWN", "EXPERT_BLOCK",
           "GRADIENT_OF", "PACK_OPS",
           "PARTIAL_FOUND_INF", "PARTIAL_NORM", "PP_ACTION", "PP_SCHEDULE", "SHARDED_PARAM", "SHARD_OF", "TAG",
           "UNPACK_OPS", "aten", "call",
           "calls", "fake_mode_of",
           "is_dtype_cast", "is_random", "is_view_op", "move_after_inputs", "nbytes", "phase", "placeholders",
           "producers", "refake", "set_phase", "tensor_bytes", "unpack_chain", "val"]
