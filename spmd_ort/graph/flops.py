"""The one FLOP count of a graph node: torch's formulas (``torch.utils.flop_counter``), and ours for the ops torch's
registry has none for, so that nothing with FLOPs is counted as free.

What reads it: the plan's roofline (``spmd_ort.plan.cost``), the recompute pass's cost of running a node again,
``explain()``'s share of each segment.

Attention counts what its kernels compute: every ``F.scaled_dot_product_attention`` variant a trace takes (math is
matmuls; the flash, efficient, cudnn and overrideable kernels, and the CPU flash kernel a CPU or meta trace takes,
which torch's registry lacks), forward and backward, with ``is_causal`` as half the full count (the kernels skip
the masked half; an explicit mask is computed in full).

:func:`unpriced` names the ops that do compute but have no formula here (an opaque part's Python, a matmul-like
op of another library): the plan lists them rather than count them as free.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from spmd_ort.compat import optimization_hint
from spmd_ort.graph import ops

aten = torch.ops.aten

# (query, key, value) argument positions of each attention kernel's packet; its backward's
ATTENTION_FORWARD = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_for_cpu,
                     aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
                     aten._scaled_dot_product_fused_attention_overrideable}
ATTENTION_BACKWARD = {aten._scaled_dot_product_flash_attention_backward,
                      aten._scaled_dot_product_flash_attention_for_cpu_backward,
                      aten._scaled_dot_product_efficient_attention_backward,
                      aten._scaled_dot_product_cudnn_attention_backward,
                      aten._scaled_dot_product_fused_attention_overrideable_backward}

# ops with compute whose cost is not their bytes, by name: one without a formula is listed as not priced
_HEAVY_NAMES = ("mm", "matmul", "conv", "attention", "einsum", "linear", "addbmm", "tensordot")
# ops of ours that run the user's Python: what they compute is unknown
_OPAQUE = (ops.opaque_forward, ops.opaque_backward)
EXPERT_COST = "expert_parallel"  # passes.expert_parallel's node meta: an experts host node's FLOPs and exchanges


def hint(x) -> int:
    """An int, or a symbolic size at the size the program was traced with."""
    return int(optimization_hint(x, fallback=4096)) if isinstance(x, torch.SymInt) else int(x)


def _value(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def argument(node: fx.Node, name: str, default=None):
    """``node``'s argument ``name`` (positional or keyword), by the op's schema."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def attention_flops(node: fx.Node) -> int | None:
    """FLOPs of an attention kernel's node (None: not one): torch's sdpa counts on the traced shapes, a causal one
    halved."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet in ATTENTION_FORWARD:
        q, k, v = (_value(a) for a in node.args[:3])
        flops = sdpa_flop_count(q.shape, k.shape, v.shape)
    elif packet in ATTENTION_BACKWARD:
        g, q, k, v = (_value(a) for a in node.args[:4])
        flops = sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape)
    else:
        return None
    return hint(flops) // 2 if is_causal(node) else hint(flops)


def is_causal(node: fx.Node) -> bool:
    """Whether an attention kernel's node computes causal attention (its ``is_causal`` argument)."""
    return bool(argument(node, "is_causal", False))


def node_flops(node: fx.Node) -> int:
    """FLOPs of one op (2 per multiply-add): attention by :func:`attention_flops`, others by torch's formula;
    0 where there is none (elementwise ops, whose cost is their bytes) or it cannot read these sizes."""
    if node.op != "call_function":
        return 0
    if EXPERT_COST in node.meta:  # an experts module computed by expert (spmd_ort.passes.expert_parallel)
        return node.meta[EXPERT_COST]["flops"]
    try:
        flops = attention_flops(node)
        if flops is not None:
            return flops
        formula = _formula(node)
        if formula is None:
            return 0
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        return hint(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read these sizes: bytes alone (and unpriced says so)
        return 0


def _formula(node: fx.Node):
    packet = getattr(node.target, "overloadpacket", None)
    if packet is aten._grouped_mm:  # torch's registry lacks it: ours (registered, shapes in) stands in for it
        return flop_registry.get(torch.ops.spmd_ort.grouped_mm)
    return flop_registry.get(packet)


def unpriced(node: fx.Node) -> str | None:
    """The name of ``node``'s op where it computes more than its bytes but no formula prices it (an opaque part's
    Python, a matmul-like op without a formula, a formula that failed on these sizes); else None."""
    if node.op != "call_function":
        return None
    if node.target in _OPAQUE and EXPERT_COST not in node.meta:
        return f"{node.target} (the user's Python)"
    try:
        if attention_flops(node) is not None:
            return None
    except Exception:  # noqa: BLE001 - shapes the count cannot read: listed below by name
        pass
    formula = _formula(node)
    name = str(getattr(node.target, "__name__", node.target))
    if formula is None:
        return str(node.target) if any(h in name.split(".")[0].lower() for h in _HEAVY_NAMES) else None
    if node_flops(node) == 0 and all(hint(d) > 0 for a in node.all_input_nodes
                                     if isinstance(v := a.meta.get("val"), torch.Tensor) for d in v.shape):
        return f"{node.target} (its formula failed on these sizes)"
    return None

