"""Which aten ops have our own ONNX translation, and which of their nodes it accepts: the table of
:mod:`spmd_ort.backends.ort.translations`, without onnxscript.

:data:`TRANSLATIONS` maps each op to its :class:`Translation`: the function (by name; written with onnxscript
in :mod:`spmd_ort.backends.ort.translations`, imported when the exporter needs it), why it is ours, and
``accepts(node)``,
which says (with a reason) when a node's arguments are outside what the function implements, so the predicate of
:mod:`spmd_ort.backends.ort.coverage` and the exporter agree node by node. A compile whose segments all come from the
export cache partitions with this table alone and never imports onnxscript (~33 MiB and ~0.2 s).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.graph import ops

aten = torch.ops.aten

Accepts = Callable[[fx.Node], "str | None"]


def _always(node: fx.Node) -> str | None:
    return None


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _conv_accepts(node: fx.Node) -> str | None:
    if _arg(node, 7, "transposed"):
        return "the gradient of a transposed convolution is not translated"
    return None


def _avg_pool_accepts(node: fx.Node) -> str | None:
    if _arg(node, 5, "ceil_mode"):
        return "avg_pool2d_backward with ceil_mode=True is not translated"
    if _arg(node, 7, "divisor_override") is not None:
        return "avg_pool2d_backward with divisor_override is not translated"
    if len(node.args[1].meta["val"].shape) not in (3, 4):
        return "avg_pool2d_backward of an input that is not (N, C, H, W) or (C, H, W)"
    return None


def _attention_check(node: fx.Node, query: fx.Node, key: fx.Node, dropout_p) -> str | None:
    if dropout_p:
        return "attention with dropout stays in torch (its RNG)"
    q, k = query.meta["val"], key.meta["val"]
    if q.dim() < 3 or k.dim() < 3 or q.shape[-3] % k.shape[-3]:
        return f"attention over query {tuple(q.shape)} and key {tuple(k.shape)} is not translated"
    return None


def _attention_accepts(node: fx.Node) -> str | None:
    return _attention_check(node, node.args[0], node.args[1], _arg(node, 3, "dropout_p", 0.0))


def _attention_backward_accepts(node: fx.Node) -> str | None:
    return _attention_check(node, node.args[1], node.args[2], _arg(node, 6, "dropout_p", 0.0))


def _sort_accepts(node: fx.Node) -> str | None:
    dtype = node.args[0].meta["val"].dtype
    if dtype is torch.bool or dtype.is_complex:
        return f"a sort of {dtype} is not translated (ONNX's TopK takes numbers)"
    return None


def _grouped_mm_accepts(node: fx.Node) -> str | None:
    a, b = node.args[0].meta["val"], node.args[1].meta["val"]
    offs = _arg(node, 2, "offs")
    if _arg(node, 3, "bias") is not None or _arg(node, 4, "out_dtype") not in (None, a.dtype):
        return "grouped_mm with a bias or another output dtype is not translated"
    if not a.dtype.is_floating_point or b.dtype != a.dtype:
        return f"grouped_mm of {a.dtype} and {b.dtype} is not translated"
    if offs is None:
        return None if a.dim() == b.dim() == 3 else "grouped_mm of a 2-D operand without offs"
    groups = b.shape[0] if b.dim() == 3 else offs.meta["val"].shape[0]
    if a.dim() != 2 or not isinstance(groups, int) or groups < 1:
        return "grouped_mm is translated with offs for 2-D @ 3-D and 2-D @ 2-D, with a static number of groups"
    return None


@dataclass(frozen=True)
class Translation:
    """``impl``: the translation function, or its name in :mod:`spmd_ort.backends.ort.translations` (imported when the
    exporter first asks for it: onnxscript, which the functions are written in, is not needed before)."""

    impl: Callable | str
    why: str  # why ours rather than torchlib's or a torch decomposition
    accepts: Accepts = _always

    @property
    def function(self) -> Callable:
        if callable(self.impl):
            return self.impl
        return getattr(importlib.import_module("spmd_ort.backends.ort.translations"), self.impl)


TRANSLATIONS: dict = {
    aten.elu.default: Translation("elu", "ONNX's Elu computes exp(x) - 1, which cancels for small |x| (1.6% off at "
                                  "-1.8e-6 in onnxruntime 1.32)"),
    aten.silu_backward.default: Translation("silu_backward", "torchlib has none; torch's decomposition is not applied"
                                            " by the exporter"),
    aten.gelu_backward.default: Translation("gelu_backward", "one elementwise pass instead of the decomposition's"),
    aten._softmax_backward_data.default: Translation("_softmax_backward_data", "torchlib has none"),
    aten._log_softmax_backward_data.default: Translation("_log_softmax_backward_data", "torchlib has none"),
    aten.embedding_dense_backward.default: Translation("embedding_dense_backward",
                                                       "one ScatterElements(add): race-free, unlike ScatterND(add)"),
    aten.pow.Tensor_Scalar: Translation("pow_tensor_scalar",
                                        "ONNX Pow is slow on ORT's CPU; torch's kernel special-cases 2, 0.5, -1, ..."),
    aten.squeeze.dims: Translation("squeeze_dims", "torch's decomposition produces prims ops"),
    aten.var_mean.correction: Translation("var_mean", "torch's decomposition produces prims ops"),
    aten.native_layer_norm_backward.default: Translation("native_layer_norm_backward", "torchlib has none"),
    aten.native_batch_norm_backward.default: Translation("native_batch_norm_backward", "torchlib has none"),
    aten.max_pool2d_with_indices.default: Translation(
        "max_pool2d_with_indices", "torchlib's runs a second full MaxPool to make the indices torch's"),
    aten.max_pool2d_with_indices_backward.default: Translation("max_pool2d_with_indices_backward",
                                                               "torchlib and torch's decomposition table have none"),
    aten.avg_pool2d_backward.default: Translation("avg_pool2d_backward", "no translation or decomposition exists",
                                                  _avg_pool_accepts),
    aten.convolution_backward.default: Translation("convolution_backward", "no translation or decomposition exists",
                                                   _conv_accepts),
    ops.grouped_mm: Translation(
        "grouped_mm", "ours (spmd_ort.graph.ops): torch._grouped_mm in a dtype its fake kernel rejects",
        _grouped_mm_accepts),
    aten._grouped_mm.default: Translation(
        "grouped_mm", "torchlib's raises NotImplementedError when offs are given (an MoE's experts always give them)",
        _grouped_mm_accepts),
    aten.sort.stable: Translation("sort_stable", "torchlib translates the default overload only (the graph's sorts "
                                  "are stable: spmd_ort.backends.ort.decompose.stable_sorts)", _sort_accepts),
    aten._scaled_dot_product_flash_attention_for_cpu.default: Translation(
        "_scaled_dot_product_flash_attention_for_cpu", "the fused CPU kernel's forward, with the log-sum-exp",
        _attention_accepts),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: Translation(
        "_scaled_dot_product_flash_attention_for_cpu_backward", "no translation or decomposition exists",
        _attention_backward_accepts),
}
