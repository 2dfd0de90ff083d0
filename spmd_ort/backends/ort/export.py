"""Translate one graph segment to ONNX and cache the model on disk.

A segment is an aten-level graph with a value on every node, whose ops either
translate directly (:mod:`spmd_ort.backends.ort.coverage`) or carry the decomposition
``lower_to_onnx_ops_pass`` traced for them (:mod:`spmd_ort.backends.ort.decompose`: expanded
here, on a copy).  So it is translated as it is: explicit type
promotion, then each node through :func:`spmd_ort.backends.ort.coverage.registry`
(torchlib plus our translations), then constant folding and clean-up.
``torch.onnx.export(dynamo=True)`` would first trace the segment again with
torch.export and decompose it again (for gpt-mini: ~25 s of a 30 s export
for a graph that is already what it produces); it is used only on a torch
whose exporter lacks the translator this module calls
(:func:`_translate_directly`), with the same translations.

The opset, the cache directory and where debug copies go come from the
step's :class:`~spmd_ort.options.Options` (``SPMD_ORT_ONNX_OPSET_VERSION``,
``SPMD_ORT_CACHE_DIR``, ``SPMD_ORT_SAVE_ONNX_PATH``).  The cache is keyed by
everything the model depends on (graph, shapes, strides, opset, library
versions, our translations' source), written atomically, and a model that
does not load is exported again.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from importlib.metadata import version

import numpy as np
import onnxruntime
import torch
from torch import fx

from spmd_ort.backends.files import exclusive, graph_digest, write_atomic
from spmd_ort.backends.ort import coverage, decompose
from spmd_ort.graph.checking import short_error
from spmd_ort.options import DEFAULT_OPSET, get_logger

logger = get_logger(__name__)
aten = torch.ops.aten

FORMAT_VERSION = 9  # bump when what we export for the same graph changes
# ONNX inputs are named by position: a segment's placeholders carry the names of the parent
# graph's nodes (div, add, view, ...), which the exporter also gives the segment's own values,
# and ONNX Runtime rejects a model where an input and a value share a name.
INPUT_PREFIX = "spmd_in_"
# Constant folding limit (elements, 1 MiB of fp32): folds shape and index arithmetic and small fills (a 128 x 128
# causal mask, an MoE's 2048 x 128 scatter target), never a tensor of an activation's size. ONNX Runtime's own
# folding, which has no limit, is off (session.OrtSegment): what is larger is computed in each run.
FOLD_LIMIT = 2**18


def input_name(position: int) -> str:
    return f"{INPUT_PREFIX}{position}"


def input_position(name: str) -> int:
    """The segment placeholder an ONNX input stands for (``input_name``'s inverse)."""
    if not name.startswith(INPUT_PREFIX) or not name[len(INPUT_PREFIX):].isdigit():
        raise ValueError(f"ONNX input {name!r} is not one of spmd_ort's positional inputs")
    return int(name[len(INPUT_PREFIX):])


@dataclass
class ExportResult:
    model: bytes
    seconds: float
    cache_hit: bool
    key: str


def segment_key(gm: fx.GraphModule, opset: int) -> str:
    """Hash of everything the exported model depends on: the segment (:func:`~spmd_ort.backends.files.graph_digest`:
    its ops, in order, with their arguments and the shape, dtype and strides of every value, nodes named by
    position, the model's inputs positional, ``spmd_in_<k>``; node names left out, so that the same layer repeated
    (a transformer's blocks, under fully_shard split at the same collectives) is one export, and the next block's
    segments are cache hits), the opset and the versions of what translates and runs it."""
    return graph_digest(gm, opset, torch.__version__, version("onnx"), onnxruntime.__version__, version("onnxscript"),
                        FORMAT_VERSION, coverage.table_fingerprint())


@contextlib.contextmanager
def _quiet():
    """Python warnings the exporter raises about its own internals (deprecations, pytree) are not ours to show."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _translate_directly(gm: fx.GraphModule, opset: int):
    """The segment as an ``onnx_ir`` model, translated node by node (no torch.export)."""
    import onnx_ir as ir
    from torch.onnx._internal._lazy_import import onnxscript_apis
    from torch.onnx._internal.exporter import _constants, _core, _ir_passes
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # type promotion edits the graph
    _insert_type_promotion(gm)
    model = ir.Model(graph=ir.Graph([], [], nodes=[], name="spmd_ort_segment"),
                     ir_version=_constants.ONNX_IR_VERSION, producer_name="spmd_ort")
    _core._translate_fx_graph(gm.graph, model, graph_like=model.graph, owned_graphs={}, lower="at_conversion",
                              registry=coverage.registry(opset))
    _ir_passes.add_opset_imports(model)
    onnxscript_apis.convert_version(model, opset)
    return model


def _insert_type_promotion(gm: fx.GraphModule) -> None:
    """Explicit casts where an aten op promotes its inputs' dtypes (ONNX ops do not).

    The exporter's pass re-runs every node on fake tensors to know its value; a segment's nodes
    already carry it (``meta["val"]``), so only nodes the pass changes are run (gpt-mini: ~1 s less).
    """
    from torch.onnx._internal.fx import passes as fx_passes
    from torch.onnx._internal.fx.passes import type_promotion as tp

    promote = fx_passes.InsertTypePromotion(gm)
    base = getattr(tp, "_TypePromotionInterpreter", None)
    if base is not None and hasattr(base, "_maybe_promote_node") and hasattr(tp, "get_type_promotion_rule"):

        class FromMeta(base):
            def run_node(self, n):
                with self._set_current_node(n):
                    if rule := tp.get_type_promotion_rule(n, self.type_promotion_table):
                        self._maybe_promote_node(n, rule)
                if n.op == "call_function" and "val" in n.meta:
                    return n.meta["val"]  # recomputed by the pass if it changed the node
                return fx.Interpreter.run_node(self, n)

        promote.interpreter = FromMeta(gm, promote.interpreter.type_promotion_table)
    promote.run()


def _translate_with_torch_export(gm: fx.GraphModule, opset: int):
    """The stock path (torch.export, decompositions, translation), with our translations."""
    inputs = tuple(torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype, device=n.meta["val"].device)
                   for n in gm.graph.nodes if n.op == "placeholder")
    table = {op: t.function for op, t in coverage.TRANSLATIONS.items()}
    program = torch.onnx.export(gm, inputs, dynamo=True, opset_version=opset, optimize=False, verbose=False,
                                custom_translation_table=table)
    return program.model


def _optimize(model) -> None:
    """Inline torchlib's functions, fold constants, drop what is unused, fix IO names.

    onnxscript's pattern rewriter is left out: ONNX Runtime's own graph
    optimizer (``ORT_ENABLE_ALL``) fuses the same patterns when the session
    loads, and the rewriter took most of the export time (gpt-mini: 34 of 70 s).
    """
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript.optimizer import _constant_folding

    common.InlinePass()(model)
    limits = {"shape_inference": False, "input_size_limit": FOLD_LIMIT, "output_size_limit": FOLD_LIMIT}
    try:
        fold = _constant_folding.FoldConstantsPass(**limits, should_fold=_foldable)
    except TypeError:  # an onnxscript before should_fold: its own rules (a large fill is computed, then dropped)
        logger.info("this onnxscript's constant folder takes no should_fold: it evaluates constants of any size "
                    "before dropping those over %d elements (upgrade onnxscript to keep large fills unevaluated)",
                    FOLD_LIMIT)
        fold = _constant_folding.FoldConstantsPass(**limits)
    try:
        fold(model)
    except Exception as exc:  # noqa: BLE001 - folding is an optimization; the model is valid without it
        # onnxscript's folder raises on some nodes it cannot evaluate (SplitToSequence with a split size known
        # only at run time: sequence parallel's shards of a symbolic length); the nodes before it are folded,
        # each replacement complete, so the model stays valid: it is exported as it is
        logger.info("constant folding stopped early (%s); the segment is exported with the rest unfolded "
                    "(computed in each run)", short_error(exc, 160))
    absorb_transposes(model)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)


def _elements(dims) -> int | None:
    """The product of ``dims`` when every one is a known int; else None."""
    dims = list(dims)
    return math.prod(dims) if all(isinstance(d, int) for d in dims) else None


def _output_elements(node) -> int | None:
    """Elements of ``node``'s first output, from its shape, or from the constant shape an ``Expand`` or a
    ``ConstantOfShape`` is given; None when not known."""
    out = node.outputs[0] if node.outputs else None
    if out is not None and out.shape is not None and (n := _elements(out.shape.dims)) is not None:
        return n
    index = {"Expand": 1, "ConstantOfShape": 0}.get(node.op_type)
    if index is None or len(node.inputs) <= index or node.inputs[index] is None:
        return None
    target = node.inputs[index].const_value
    if target is None:
        return None
    dims = [int(d) for d in target.numpy().reshape(-1)]
    source = node.inputs[0] if node.op_type == "Expand" else None
    if source is not None and source.shape is not None and _elements(source.shape.dims) is not None:
        try:  # Expand broadcasts its input's shape with the target: [N, 1] to [1, M] is N x M
            dims = list(np.broadcast_shapes(tuple(source.shape.dims), tuple(dims)))
        except ValueError:
            return None  # shapes that do not broadcast: the folder's own rules
    return _elements(dims)


def _foldable(node) -> bool | None:
    """Whether the export folds ``node`` (its inputs constant): never when its output exceeds :data:`FOLD_LIMIT`
    elements, always a small ``ConstantOfShape`` (the folder keeps them by default), else the folder's own rules.

    onnxscript's folder evaluates a node with constant inputs and only then drops an output over its size limit:
    an ``Expand`` of a scalar zero to an embedding's gradient (``embedding_dense_backward``: vocabulary x width,
    2 GiB at Llama-3-8B's 128256 x 4096) was computed, twice over in numpy, for nothing (the export's peak 4.8 GiB
    of a 2-layer plan). A small fill folds here because ONNX Runtime's folding, which would, is off.
    """
    n = _output_elements(node)
    if n is not None and n > FOLD_LIMIT:
        return False
    if node.op_type == "ConstantOfShape" and n is not None:
        return True
    return None


# ONNX Runtime's CPU Gemm kernel is registered for these (MatMul for more, which then stays a MatMul)
_GEMM_DTYPES = ("FLOAT", "DOUBLE")


def _transpose_source(value):
    """The value a 2-D transpose read, when ``value`` is one (a ``Transpose`` swapping the two dims); else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    source = node.inputs[0]
    if source is None or source.shape is None or len(source.shape) != 2:
        return None
    perm = node.attributes.get("perm")
    if perm is not None and list(perm.value) != [1, 0]:
        return None
    return source


def absorb_transposes(model) -> int:
    """2-D transposes read by GEMMs become the GEMMs' ``transA``/``transB``; a transpose of a transpose is its source.

    aten transposes a weight (``t``) for the forward GEMM and transposes that again for the input gradient, and
    transposes an activation gradient for the weight gradient: in torch these are views the GEMM reads with
    its transpose flags. ONNX Runtime fuses a ``Transpose`` into the ``MatMul`` or ``Gemm`` after it only when
    the two are alone together: a weight's ``t`` read twice, or a ``MatMul`` its ``MatMulAddFusion`` first
    turns into a ``Gemm`` with the next ``Add`` (a tied weight's two gradients), keeps a ``Transpose`` that
    copies the whole tensor every step (gpt-mini: the loss gradient's, 1024x8192, 16 ms of a 209 ms segment).
    So the model says what torch did: each GEMM reads the untransposed value with its flag set (a ``MatMul``
    of 2-D float operands becomes a ``Gemm``), and transposes nothing reads any more are dropped by the
    clean-up after. The same products, summed the same way by the same GEMM kernel. Returns how many inputs
    were rewritten.
    """
    import onnx_ir as ir

    graph, changed = model.graph, 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Transpose":  # Transpose(Transpose(x)) -> x
            out, source = node.outputs[0], _transpose_source(node.inputs[0])
            if source is not None and _transpose_source(out) is not None and not out.is_graph_output():
                out.replace_all_uses_with(source)
                changed += 1
            continue
        if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        a, b = node.inputs[0], node.inputs[1]
        if a is None or b is None or a.dtype is None or a.dtype.name not in _GEMM_DTYPES:
            continue
        if node.op_type == "MatMul" and (a.shape is None or b.shape is None or len(a.shape) != 2 or len(b.shape) != 2):
            continue  # batched: ONNX Runtime's own fusion folds the last two dims' transpose (FusedMatMul)
        sources = (_transpose_source(a), _transpose_source(b))
        if sources == (None, None):
            continue
        flags = [node.attributes.get(f"trans{x}") for x in "AB"]
        flags = [int(f.value) if f is not None else 0 for f in flags]
        inputs = list(node.inputs)
        for i, source in enumerate(sources):
            if source is not None:
                inputs[i], flags[i] = source, 1 - flags[i]
                changed += 1
        if node.op_type == "Gemm":
            for i in (0, 1):
                node.replace_input_with(i, inputs[i])
            node.attributes["transA"] = ir.AttrInt64("transA", flags[0])
            node.attributes["transB"] = ir.AttrInt64("transB", flags[1])
            continue
        gemm = ir.Node("", "Gemm", inputs[:2], [ir.AttrInt64("transA", flags[0]), ir.AttrInt64("transB", flags[1])],
                       name=f"{node.name}_gemm" if node.name else None)
        old, new = node.outputs[0], gemm.outputs[0]
        new.shape, new.type = old.shape, old.type
        graph.insert_before(node, gemm)
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        name, old.name = old.name, None
        new.name = name
        graph.remove(node, safe=True)
    return changed


def has_direct_translator() -> bool:
    try:
        from torch.onnx._internal.exporter import _core
    except ImportError:
        return False
    return hasattr(_core, "_translate_fx_graph")


def translate(gm: fx.GraphModule, opset: int = DEFAULT_OPSET, *, via_torch_export: bool | None = None) -> bytes:
    """ONNX bytes of ``gm`` (placeholders -> tuple of outputs); inputs named ``spmd_in_<position>``.

    ``via_torch_export``: None translates directly where this torch allows it; True forces the stock path.
    """
    import onnx_ir as ir

    if via_torch_export is None:
        via_torch_export = not has_direct_translator()
    gm = decompose.expand(decompose.fuse_loss_backward(gm))  # marked ops as their decompositions: ops ONNX translates
    with _quiet(), coverage.exporter_logs_filtered():
        model = _translate_with_torch_export(gm, opset) if via_torch_export else _translate_directly(gm, opset)
        n_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        if len(model.graph.inputs) != n_inputs:
            raise RuntimeError(f"the ONNX model has {len(model.graph.inputs)} inputs, the segment {n_inputs}")
        for i, value in enumerate(model.graph.inputs):
            value.name = input_name(i)
        _optimize(model)
        return ir.serde.serialize_model(model).SerializeToString()


def export_segment(gm: fx.GraphModule, *, name: str, opset: int = DEFAULT_OPSET, cache_dir: Path | None = None,
                   refresh: bool = False) -> ExportResult:
    """ONNX bytes for ``gm``, from the cache in ``cache_dir`` when possible.

    ``cache_dir=None`` exports without a cache; ``refresh`` exports again and overwrites the cached model.
    Processes that export the same segment at once (the ranks of a data-parallel job) take turns on a
    lock file: the first exports, the others read its model.
    """
    t0 = time.perf_counter()
    key = segment_key(gm, opset)
    if cache_dir is None:
        data = translate(gm, opset)
        return ExportResult(data, time.perf_counter() - t0, False, key)
    path = Path(cache_dir) / f"{key}.onnx"
    if not refresh and path.exists():
        return ExportResult(path.read_bytes(), time.perf_counter() - t0, True, key)
    with exclusive(path.with_suffix(".lock")):
        if not refresh and path.exists():  # another process exported it while this one waited
            return ExportResult(path.read_bytes(), time.perf_counter() - t0, True, key)
        data = translate(gm, opset)
        try:
            write_atomic(path, data)
        except OSError as exc:
            logger.warning("could not write the ONNX cache %s: %s", path, exc)
    logger.info("exported %s to ONNX (opset %d) in %.2fs", name, opset, time.perf_counter() - t0)
    return ExportResult(data, time.perf_counter() - t0, False, key)


def save_model(data: bytes, name: str, prefix: str, directory: Path | None = None) -> Path:
    """Write a segment for inspection (opens in Netron); ``directory`` defaults to the working directory."""
    out_dir = Path(directory or os.getcwd())
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}_{name}.onnx"
    path.write_bytes(data)
    return path
