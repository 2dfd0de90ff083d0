"""Lower the ops ONNX cannot translate directly into ops it can (ORT backend): each gets its decomposition."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from spmd_ort.backends.ort import decompose

from .context import PassResult
from .contracts import ONNX_LOWERED, VALUES_KNOWN
from .runner import graph_pass


@dataclass(frozen=True)
class Lowering(PassResult):
    """``lower_to_onnx_ops_pass``: how many nodes of each op ONNX gets as their decomposition."""

    lowered: dict[str, int]
    stable_sorts: int = 0  # unstable sorts made stable: the order of equal values ORT's TopK gives

    def lines(self) -> list[str]:
        out = []
        if self.lowered:
            out.append("lowered for ONNX (exported as torch's decomposition; torch runs the op): "
                       + ", ".join(f"{op} x{n}" for op, n in self.lowered.items()))
        if self.stable_sorts:
            out.append(f"sorts made stable (equal values in input order, as ONNX Runtime sorts): {self.stable_sorts}")
        return out


@graph_pass(requires=[VALUES_KNOWN], provides=[ONNX_LOWERED])
def lower_to_onnx_ops_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Mark every aten node without a direct ONNX translation with torch's decomposition of it.

    The decomposition is traced for the node's own shapes, its ops lowered in turn (make_fx applies
    the table recursively), and kept on the node (``spmd_ort.backends.ort.decompose``): the exporter translates
    it in the node's place, so ONNX gets only ops it translates directly, while the graph keeps the op,
    and wherever a segment runs in torch (the fx side of the executor choice, a fallback, the checked
    first run) torch's fused kernel runs, not the decomposition (measured: the CNN's BatchNorm, nll_loss
    and threshold_backward ran 1.4x slower decomposed).  Numbers equal to rounding (the
    decompositions are torch's own).  Unstable sorts become stable ones first
    (:func:`spmd_ort.backends.ort.decompose.stable_sorts`): ORT's order of equal values is one an unstable sort may
    give, not the one torch's gives.
    """
    stable = decompose.stable_sorts(gm)
    ctx.results.record(Lowering(lowered=decompose.annotate(gm), stable_sorts=stable))
    return gm


