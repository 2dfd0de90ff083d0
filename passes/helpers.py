"""Node builders and predicates shared by the pass files (each imports them from here)."""

from __future__ import annotations

import operator

import torch
from torch import fx

from spmd_ort.capture.state import SlotKind
from spmd_ort.runtime import ops
from spmd_ort.capture.trace import phase

aten = torch.ops.aten
TAG = ops.tag_grad
AMP_CHECK = aten._amp_foreach_non_finite_check_and_unscale.default  # GradScaler.unscale_, functionalized

# node.meta keys written by analyses and read by later passes
SHARD_OF = "shard_of"  # fully_shard: index of the parameter this value is a shard of (grads, state, updates)
SHARDED_PARAM = "sharded_param"  # fully_shard: a parameter placeholder that holds a shard
PARTIAL_NORM = "partial_norm"  # fully_shard: a 2-norm of a shard (its position among the step's norms)
DEDUP_KEY = "dedup_key"  # what else two identical collectives must share to be merged (e.g. the phase)
GRADIENT_OF = "gradient_of"  # a gradient's collective (all-reduce / reduce-scatter): the parameter index
ACTIVATION_COLLECTIVE = "activation_collective"  # expand mode: a collective whose result the step computes on
PARTIAL_FOUND_INF = "partial_found_inf"  # fully_shard: a GradScaler's inf flag over this rank's gradient shards
EAGER_LAYOUT_UNKNOWN = "eager_layout_unknown"  # a random op whose inputs' eager layout no probe could find


is_random = ops.draws_random  # whether a node draws random numbers (one definition, shared with the partitioner)


def val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def tensor_bytes(v: torch.Tensor) -> int:
    return v.numel() * v.element_size()


def nbytes(node: fx.Node) -> int:
    return tensor_bytes(val(node))


def call(graph: fx.Graph, target, args: tuple, value) -> fx.Node:
    """A ``call_function`` node with its ``meta["val"]`` set."""
    node = graph.call_function(target, args)
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


def is_view_op(target) -> bool:
    """Whether an op returns a view of its first input (a non-writing alias in its schema)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


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


def fake_mode_of(gm: fx.GraphModule):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])


def refake(node: fx.Node, fake_mode) -> None:
    """Recompute ``node.meta["val"]`` from its inputs' (possibly changed) values."""
    args = fx.map_arg(node.args, lambda n: n.meta["val"])
    kwargs = fx.map_arg(node.kwargs, lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


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


__all__ = ["ACTIVATION_COLLECTIVE", "AMP_CHECK", "DEDUP_KEY", "EAGER_LAYOUT_UNKNOWN", "GRADIENT_OF", "PACK_OPS", "PARTIAL_FOUND_INF",
           "PARTIAL_NORM", "SHARDED_PARAM", "SHARD_OF", "TAG", "UNPACK_OPS", "aten", "call", "calls", "fake_mode_of",
           "is_dtype_cast", "is_random", "is_view_op", "move_after_inputs", "nbytes", "phase", "placeholders",
           "producers", "refake", "set_phase", "tensor_bytes", "unpack_chain", "val"]
