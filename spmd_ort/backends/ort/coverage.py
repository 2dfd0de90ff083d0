"""Which aten ops ONNX Runtime runs, decided by one table for the partitioner and the exporter alike.

An aten node translates to ONNX **directly** when

* :data:`spmd_ort.backends.ort.translation_table.TRANSLATIONS` has our translation of its op and
  that translation accepts the node's arguments, or
* onnxscript's torchlib translates its op and the op is not in :data:`FIXES`
  (stock translations known to be wrong, which are removed from the registry).

Every other op with a torch decomposition is **lowered** before export:
``lower_to_onnx_ops_pass`` (``passes/lowering.py``) replaces the node by its
decomposition, recursively, until only directly translatable ops (or ops with
no decomposition) remain.  What is left after that stays on the host, and
:func:`why_untranslatable` says why.  The exporter (:mod:`spmd_ort.backends.ort.export`)
translates with :func:`registry`, the same table, so the predicate and the
exporter agree by construction; ``tests/test_coverage.py`` runs both over
every op of the model zoo.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
from torch import fx

from spmd_ort.options import DEFAULT_OPSET, environment_value, logs_filtered
from spmd_ort.backends.ort.translation_table import TRANSLATIONS

aten = torch.ops.aten

# node.meta key: a pass asks that this node run in torch, never in a segment; the value says why (e.g.
# insert_index_checks_pass's host copies of computed indices: their checks run before every segment).
# Such a node is not lowered either: torch runs it as it is.
HOST_ONLY = "host_only"

# op -> why its torchlib translation cannot be used (it is lowered through torch's decomposition instead).
FIXES: dict = {
    # torchlib's nll_loss_forward returns total_weight = 1.0 whatever the batch, ignore_index or class
    # weights: every gradient of a mean-reduced cross-entropy came out N times too large, silently.
    aten.nll_loss_forward.default: "total_weight output is always 1.0",
    # The capture runs BatchNorm as this op (eager's kernel, spmd_ort.capture.trace.FUNCTIONAL_DECOMPS); torchlib's
    # translation of it computes another normalized output (40% off, caught by verification).
    aten._native_batch_norm_legit_functional.default: "wrong normalized output",
}


class _DropIrrelevant(logging.Filter):
    """The exporter's warnings that never concern a spmd_ort graph (which never uses torchvision ops and
    carries no nn.Module stack), so users see the exporter's other warnings and not these."""

    PATTERNS = ("torchvision is not installed", "nn_module_stack not found")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p in message for p in self.PATTERNS)


EXPORTER_LOGGERS = ("torch.onnx._internal.exporter._registration", "torch.onnx._internal.exporter._core")


@contextlib.contextmanager
def exporter_logs_filtered():
    """While the block runs (building the registry, exporting a segment), the exporter's loggers drop the records
    :class:`_DropIrrelevant` names; afterwards they are as they were (the filter is ours, one per block)."""
    with logs_filtered(EXPORTER_LOGGERS, _DropIrrelevant()):
        yield


def registry(opset: int = DEFAULT_OPSET):
    """torchlib's registry for ``opset``, with our translations and without the ops in :data:`FIXES`.

    The predicate asks the default opset's registry: torchlib registers the same ops for opsets 18
    to 22 (23 adds ``rms_norm``, which torch decomposes before it reaches a graph), so the answer
    does not depend on ``SPMD_ORT_ONNX_OPSET_VERSION``, and with the default opset the predicate and
    the exporter share one registry (building one takes ~1 s).
    """
    table = tuple((op, id(t.function)) for op, t in TRANSLATIONS.items()) + tuple(FIXES)
    return _registry(opset, table)


@functools.lru_cache(maxsize=8)
def _registry(opset: int, table: tuple):
    from torch.onnx._internal.exporter import _registration

    with exporter_logs_filtered():
        reg = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    for op in FIXES:
        reg.functions.pop(op.name(), None)
    for op, translation in TRANSLATIONS.items():
        reg.register_op(op, translation.function)
    return reg


def _registered(target) -> bool:
    """Whether :func:`registry` translates ``target`` (what ``registry().is_registered`` says), without building
    the registry for an op overload: its name is looked up in :func:`registered_names`."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name() in registered_names()
    return registry().is_registered(target)


def registered_names() -> frozenset[str]:
    """The names of the op overloads :func:`registry` translates (the registry's keys for them).

    Building the registry takes ~1 s, a third of a warm compile, and a compile whose segments all come from the
    export cache needs only this set (to partition and lower), not the translations: it is kept in the export
    cache directory (``SPMD_ORT_CACHE_DIR``), under a name made of what decides it (torch's and onnxscript's
    versions, the opset, our translations' and fixes' ops). A file that cannot be read or written only costs
    the build.
    """
    return _registered_names(_names_key(frozenset(TRANSLATIONS), frozenset(FIXES)), _cache_dir())


@functools.lru_cache(maxsize=8)
def _names_key(translated: frozenset, fixes: frozenset) -> str:
    """Keyed by the tables, as :func:`registry` is: a translation put in the table later gets its own names."""
    parts = [torch.__version__, version("onnxscript"), str(DEFAULT_OPSET),
             *sorted(op.name() for op in translated), "fixes", *sorted(op.name() for op in fixes)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _cache_dir() -> Path:
    return Path(environment_value("cache_dir"))


@functools.lru_cache(maxsize=4)
def _registered_names(key: str, cache_dir: Path) -> frozenset[str]:
    path = cache_dir / f"torchlib-ops-{key}.json"
    with contextlib.suppress(OSError, ValueError):
        names = json.loads(path.read_text())
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return frozenset(names)
    names = frozenset(k for k, v in registry().functions.items() if isinstance(k, str) and v)
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(names)))
        tmp.replace(path)  # atomic: a process reading it meanwhile sees the whole file or none
    return names


@functools.lru_cache(maxsize=1)
def _torch_decompositions() -> dict:
    from torch._decomp import decomposition_table

    from spmd_ort.backends.ort.fused import OWN_DECOMPOSITIONS

    return {**decomposition_table, **torch.export.default_decompositions(), **OWN_DECOMPOSITIONS}


def lowering_table() -> dict:
    """op -> torch decomposition, for every op that has no direct translation (what make_fx applies, recursively)."""
    return _lowering_table(registered_names())


@functools.lru_cache(maxsize=8)
def _lowering_table(names: frozenset[str]) -> dict:
    return {op: fn for op, fn in _torch_decompositions().items()
            if isinstance(op, torch._ops.OpOverload) and (op in FIXES or op.name() not in names)}


def why_untranslatable(node: fx.Node) -> str | None:
    """None if ``node`` (an aten op) translates to ONNX directly; otherwise why not."""
    target = node.target
    translation = TRANSLATIONS.get(target)
    if translation is not None:
        return translation.accepts(node)
    if target in FIXES:
        return f"{target}'s ONNX translation is wrong ({FIXES[target]}); it must be lowered first"
    if _registered(target):
        return None
    if target in _torch_decompositions():
        return f"{target} has no ONNX translation (lower_to_onnx_ops_pass lowers it through its decomposition)"
    return f"{target} has no ONNX translation and no torch decomposition"


def decomposition_for(node: fx.Node) -> Callable | None:
    """The decomposition that lowers ``node``, or None when it translates directly or cannot be lowered.

    Size arithmetic is never lowered (it runs on the host).  An op we translate ourselves is never
    lowered either, even where our translation declines its arguments: we translate it because its
    decomposition is bad (e.g. the flash attention decomposition's real strides differ from its traced
    ones, which breaks later views when the segment runs on fx).
    """
    if node.target in TRANSLATIONS or node.meta.get(HOST_ONLY) or why_untranslatable(node) is None:
        return None
    if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return None  # size arithmetic (dynamic shapes): runs on the host, never in a segment
    return _torch_decompositions().get(node.target)


def table_fingerprint() -> str:
    """Changes whenever what we translate changes: part of the exported-model cache key."""
    h = hashlib.sha256()
    # their source, read (not imported: onnxscript); fused.py's decompositions are what ONNX gets for fused ops
    for module in ("translations.py", "translation_table.py", "fused.py"):
        h.update(Path(__file__).with_name(module).read_bytes())
    for op, t in sorted(TRANSLATIONS.items(), key=lambda kv: str(kv[0])):
        if not callable(t.impl):  # a function of spmd_ort.backends.ort.translations, whose source is hashed above
            h.update(f"{op}:{t.impl}".encode())
            continue
        h.update(f"{op}:{t.impl.__module__}.{t.impl.__qualname__}".encode())  # one put in the table otherwise
        with contextlib.suppress(OSError, TypeError):
            h.update(inspect.getsource(t.impl).encode())
    h.update(",".join(sorted(map(str, FIXES))).encode())
    return h.hexdigest()[:16]
