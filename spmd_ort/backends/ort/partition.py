"""Split the compiled graph into segments ONNX Runtime runs and host nodes torch runs.

Two pieces, as torch.fx's ``CapabilityBasedPartitioner``:

* :class:`OrtSupport`, the operator-support predicate: can ORT run this node?
  Host nodes are collectives, our own ``spmd_ort::`` ops but the ones we translate (the fused optimizer
  update runs in torch, in place; opaque parts run the user's code; ``grouped_mm`` has a translation), random
  ops (they keep torch's RNG, so runs
  are reproducible and verifiable), allocations whose value is undefined (the
  buffer a random op fills: exported, it would be a segment output of garbage),
  ops on float64 host scalars, values in a dtype the provider has no kernels
  for (bfloat16 on CPU), ops whose translation it has no kernel for in their dtype
  (:data:`PROVIDER_GAPS`: a Scatter with a reduction in float16 on CPU), and aten ops that do not translate to ONNX
  (:func:`spmd_ort.backends.ort.coverage.why_untranslatable`: the same table the exporter
  translates with; an op ``lower_to_onnx_ops_pass`` marked with its decomposition
  runs in ORT when every op of the decomposition does), and nodes a pass
  marked :data:`HOST_ONLY` (an index recomputed for its bounds check).
* the grouping, torch.fx's partitioner: deterministic, largest possible
  segments of connected supported nodes, no cycles through host nodes.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.operator_support import OperatorSupport

from spmd_ort.backends.ort.coverage import HOST_ONLY, why_untranslatable
from spmd_ort.backends.ort.decompose import DECOMPOSITION, why_not_lowerable
from spmd_ort.backends.ort.translation_table import TRANSLATIONS
from spmd_ort.graph.ops import OPAQUE_OPS, check_index
from spmd_ort.graph.segments import HOST_NAMESPACES, RANDOM_OPS, UNINITIALIZED_OPS, partition_with, sizes_from_inputs

aten = torch.ops.aten

ONNX_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
               torch.uint8, torch.bool}
# Dtypes an execution provider has (almost) no kernels for: ORT's CPU provider runs bfloat16 only in
# Cast, Transpose, LayerNormalization and a few predicates (onnxruntime 1.32; no Add, MatMul, Relu), so
# bf16 compute (autocast, MixedPrecisionPolicy) stays in torch there.  float16 has CPU kernels.
HOST_DTYPES = {"cpu": {torch.bfloat16}}
# Ops whose translation is a Scatter with a reduction ('add'), which ORT's CPU provider runs in float32, float64 and
# integers but not float16 (onnxruntime 1.32: "MLFloat16 data type is not supported with ScatterND opset 16 when
# reduction is 'add'"): in float16 on CPU they stay in torch, so nothing is attempted (the segment holding one
# failed on its first run and fell back to fx whole, after ORT printed its error).  op -> whether a node reduces.
SCATTER_REDUCTIONS = {
    aten.embedding_dense_backward.default: lambda node: True,
    aten.scatter_add.default: lambda node: True,
    aten.scatter_reduce.two: lambda node: True,
    aten.index_add.default: lambda node: True,
    aten.max_pool2d_with_indices_backward.default: lambda node: True,
    aten.index_put.default: lambda node: bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate")),
}
PROVIDER_GAPS = {("cpu", torch.float16): (SCATTER_REDUCTIONS, "a Scatter with reduction='add'")}
# Ops whose (torchlib) translation is a ScatterND with reduction 'add'.  ONNX Runtime's CPU ScatterND splits the
# updates over its threads, and two updates of one element race: repeated indices are summed wrongly, now and then
# (onnxruntime 1.32, 2 threads: 6 runs in 200; tests/test_translations.py).  On CPU they stay in torch (our
# embedding_dense_backward is a ScatterElements, which sums alike every run).  op -> whether a node reduces.
_ACCUMULATES = SCATTER_REDUCTIONS[aten.index_put.default]
RACY_SCATTERS = {aten.index_put.default: _ACCUMULATES, aten._unsafe_index_put.default: _ACCUMULATES}


def why_host(node: fx.Node) -> str | None:
    """None if ORT can run ``node``; otherwise the reason it stays on the host."""
    if node.op != "call_function":
        return "not an op"
    target = node.target
    if node.meta.get(HOST_ONLY):
        return node.meta[HOST_ONLY]
    if target is operator.getitem:
        return why_host(node.args[0]) if isinstance(node.args[0], fx.Node) else "getitem of a Python value"
    if not isinstance(target, torch._ops.OpOverload):
        return f"Python callable {getattr(target, '__name__', target)}"
    namespace = target.namespace
    if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "size arithmetic (symbolic sizes: runs in torch; each segment gets the sizes as values)"
    if target is check_index:
        return "eager's bounds check of an index from the inputs (runs in torch, before the segments that read it)"
    if target in OPAQUE_OPS:
        return "opaque part: the user's code, run eagerly (CompiledProgram.describe() lists each)"
    if namespace in HOST_NAMESPACES and target not in TRANSLATIONS:
        return f"{namespace} op (runs in torch)"
    if target in RANDOM_OPS:
        return "random op (keeps torch's RNG)"
    if target in UNINITIALIZED_OPS:
        return "allocation with an undefined value (the host op that fills it runs in torch)"
    for val in _vals(node):
        if val.dtype not in ONNX_DTYPES:
            return f"dtype {val.dtype}"
        if val.device.type not in ("cpu", "cuda", "meta"):
            return f"device {val.device}"
        device = "cpu" if val.device.type == "meta" else val.device.type  # meta: a plan's, exported for the CPU
        if val.dtype in HOST_DTYPES.get(device, ()):
            return f"{val.dtype} on {device} (ONNX Runtime's {device} provider lacks its kernels)"
        ops, what = PROVIDER_GAPS.get((device, val.dtype), ({}, ""))
        if target in ops and ops[target](node):
            return (f"{target} in {val.dtype} on {device}: its translation is {what}, which ONNX Runtime's "
                    f"{device} provider has no {val.dtype} kernel for")
    if target in RACY_SCATTERS and RACY_SCATTERS[target](node) and any(v.device.type in ("cpu", "meta")
                                                                       for v in _vals(node)):
        return (f"{target} with accumulate=True: its translation, a ScatterND with reduction='add', sums repeated "
                "indices wrongly now and then on ONNX Runtime's CPU provider (its threads race)")
    if namespace != "aten" and target not in TRANSLATIONS and DECOMPOSITION not in node.meta:
        return f"{namespace} op has no ONNX translation"
    if DECOMPOSITION in node.meta:  # exported as its decomposition (lower_to_onnx_ops_pass)
        return why_not_lowerable(node, why_host)
    return why_untranslatable(node)


def _vals(node: fx.Node):
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    for arg in node.all_input_nodes:
        v = arg.meta.get("val")
        vals = [*vals, *(v if isinstance(v, (list, tuple)) else [v])]
    return [v for v in vals if isinstance(v, torch.Tensor)]


class OrtSupport(OperatorSupport):
    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return why_host(node) is None


def partition_for_ort(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """Fuse ORT-supported regions into submodules ``fused_<i>``; returns (graph, their names)."""
    sizes_from_inputs(gm)
    return partition_with(gm, OrtSupport())
