"""Memory accounting of a compiled step: what a rank holds between steps and at its peak.

* persistent bytes: parameters, gradients and optimizer state this rank keeps
  between steps (:func:`spmd_ort.sharding.persistent_bytes`); under
  ``fully_shard`` about 1/N of the unsharded total, plus padding;
* planned peak: a liveness walk over the compiled graph (every value from the
  op that makes it to its last use, views sharing their base's storage, as the
  fx executor frees them) added to the persistent bytes;
* the process's peak resident set (``ru_maxrss``), which also counts the Python
  interpreter, torch and ONNX Runtime themselves.
"""

from __future__ import annotations

import operator
import resource
import sys

import torch
from torch import fx


def _aliases(node: fx.Node) -> bool:
    """Whether the node's output shares storage with its first input (views, in-place ops, getitem)."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None)


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def planned_peak_bytes(gm: fx.GraphModule) -> int:
    """Peak bytes of the values the graph creates (inputs excluded), freed after their last use."""
    nodes = list(gm.graph.nodes)
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and _aliases(node) and node.args and isinstance(node.args[0], fx.Node):
            base = node.args[0]
            root[node] = root.get(base, base)
        else:
            root[node] = node
    last: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last[root[arg]] = i
    frees: dict[int, list[fx.Node]] = {}
    for r, i in last.items():
        frees.setdefault(i, []).append(r)
    live = peak = 0
    for i, node in enumerate(nodes):
        if node.op == "call_function" and root[node] is node:
            live += _nbytes(node.meta.get("val"))
        peak = max(peak, live)
        if node.op == "output":
            continue  # outputs outlive the step
        for r in frees.get(i, []):
            if r.op == "call_function":
                live -= _nbytes(r.meta.get("val"))
    return peak


def max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
