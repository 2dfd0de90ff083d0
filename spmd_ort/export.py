"""Export one graph segment to ONNX, with our fixes to the stock translation, and cache it on disk.

The stock path is ``torch.onnx.export(dynamo=True)``: torch.export, torch's
decompositions, then onnxscript's torchlib.  It covers few ``*_backward`` ops
and some of what it covers is wrong without any error, so before export a
segment is re-traced with :data:`EXPORT_DECOMPOSITIONS`: the ops listed there
are replaced by torch's own decompositions into ops torchlib translates
correctly.  Each entry names the fault it fixes and has a test; verification
(:mod:`spmd_ort.runtime_ort`) catches the ones nobody has found yet.

The opset, the cache directory and where debug copies go come from the
step's :class:`~spmd_ort.options.Options` (``SPMD_ORT_ONNX_OPSET_VERSION``,
``SPMD_ORT_CACHE_DIR``, ``SPMD_ORT_SAVE_ONNX_PATH``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime
import torch
from torch import fx
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from .options import DEFAULT_OPSET

logger = logging.getLogger("spmd_ort")
aten = torch.ops.aten

# op -> why the stock translation cannot be used.  Values are looked up in
# torch's decomposition registry; the reasons are documentation and test ids.
EXPORT_FIXES: dict = {
    # torchlib's nll_loss_forward returns total_weight = 1.0 whatever the batch,
    # ignore_index or class weights: every gradient of a mean-reduced
    # cross-entropy came out N times too large, silently.
    aten.nll_loss_forward.default: "total_weight output is always 1.0",
    # Neither torchlib nor the exporter's own decompositions translate these backward ops ("No ONNX
    # function found"), so every segment of a model with SiLU (LLaMA's MLP) or Mish fell back to fx,
    # with one WARNING.  Found by the differential fuzzer (tests/test_fuzz.py).
    aten.silu_backward.default: "no translation (the segment fell back to fx)",
    aten.mish_backward.default: "no translation (the segment fell back to fx)",
    # The capture runs BatchNorm as this op (eager's kernel, spmd_ort.trace.FUNCTIONAL_DECOMPS); torchlib's
    # translation of it computes another normalized output (40% off, caught by verification).
    aten._native_batch_norm_legit_functional.default: "wrong normalized output",
}
EXPORT_DECOMPOSITIONS = get_decompositions(list(EXPORT_FIXES))

FORMAT_VERSION = 3  # bump when what we export for the same graph changes
# ONNX inputs are named by position: a segment's placeholders carry the names of the parent
# graph's nodes (div, add, view, ...), which the exporter also gives the segment's own values,
# and ONNX Runtime rejects a model where an input and a value share a name.
INPUT_PREFIX = "spmd_in_"


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


def _example(node: fx.Node) -> torch.Tensor:
    val = node.meta["val"]
    return torch.zeros(val.shape, dtype=val.dtype, device=val.device)


def segment_key(gm: fx.GraphModule, opset: int) -> str:
    """Hash of everything the exported model depends on."""
    h = hashlib.sha256()
    for part in (gm.code, str(opset), torch.__version__, onnx.__version__, onnxruntime.__version__,
                 str(FORMAT_VERSION), ",".join(sorted(map(str, EXPORT_FIXES)))):
        h.update(part.encode())
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            h.update(f"{node.name}:{tuple(val.shape)}:{val.dtype}:{val.stride()}".encode())
    for name, t in sorted(gm.state_dict(keep_vars=True).items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


@contextlib.contextmanager
def _quiet():
    """The exporter warns about things that do not concern our graphs (torchvision ops, training mode)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def apply_export_fixes(gm: fx.GraphModule) -> fx.GraphModule:
    """Re-trace ``gm`` with :data:`EXPORT_DECOMPOSITIONS` if it uses any fixed op."""
    if not any(n.op == "call_function" and n.target in EXPORT_DECOMPOSITIONS for n in gm.graph.nodes):
        return gm
    inputs = [_example(n) for n in gm.graph.nodes if n.op == "placeholder"]
    return make_fx(gm, decomposition_table=EXPORT_DECOMPOSITIONS, tracing_mode="fake")(*inputs)


def export_segment(gm: fx.GraphModule, *, name: str, opset: int = DEFAULT_OPSET, cache_dir: Path | None = None,
                   refresh: bool = False) -> ExportResult:
    """ONNX bytes for ``gm`` (placeholders -> tuple of outputs), from the cache in ``cache_dir`` when possible.

    ``cache_dir=None`` exports without a cache; ``refresh`` exports again and overwrites the cached model.
    """
    t0 = time.perf_counter()
    key = segment_key(gm, opset)
    use_cache = cache_dir is not None
    path = Path(cache_dir or ".") / f"{key}.onnx"
    if use_cache and not refresh and path.exists():
        data = path.read_bytes()
        return ExportResult(data, time.perf_counter() - t0, True, key)
    fixed = apply_export_fixes(gm)
    inputs = tuple(_example(n) for n in fixed.graph.nodes if n.op == "placeholder")
    names = [input_name(i) for i in range(len(inputs))]
    with _quiet():
        program = torch.onnx.export(fixed, inputs, dynamo=True, opset_version=opset, input_names=names,
                                    optimize=True, verbose=False)
    data = program.model_proto.SerializeToString()
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
                f.write(data)
            os.replace(f.name, path)  # atomic: concurrent ranks never read half a file
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
