"""Is a compiled segment's output the fx graph's? The comparison every backend's checked first run makes.

:func:`output_mismatch` compares a backend's outputs with the fx graph's (:func:`first_difference`): per output,
each element within the output's tolerance of the output's largest value (the tolerance follows the precisions the
output is computed from: :func:`verify_tolerances`), and for an ill-conditioned float32 computation, element by
element against the segment run in float64 (:func:`within_rounding_of_float64`).  The ORT backend's first run
(``spmd_ort.backends.ort.verify``) and the inductor backend's use it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.graph.aliasing import is_view_op
from spmd_ort.runtime.interpreter import RunInterpreter

VERIFY_TOLERANCE = 1e-4  # max |ort - fx| relative to max |fx|, per output (fp32 segments)

# A segment that computes in a lower precision (autocast, MixedPrecisionPolicy) is verified to that
# precision: ORT's float16 kernels accumulate and round differently from torch's, one unit in the last
# place (2^-10 relative) apart, and outputs cast back to float32 carry that difference.
VERIFY_ULPS = 4

# Below this, differences are rounding noise of sums that cancel (e.g. the
# analytically zero gradient of an attention key bias, ~1e-13): not a fault.
VERIFY_ABS_FLOOR = {torch.float32: 1e-9, torch.float64: 1e-12, torch.float16: 1e-4, torch.bfloat16: 1e-3}

# A verification mismatch is no fault where, element by element, ORT is no further from the segment computed in
# float64 than this many times fx's own distance from it, or than the float32 rounding noise of that output
# (within_rounding_of_float64).
FLOAT64_FACTOR = 10


def verify_tolerances(gm: fx.GraphModule) -> tuple[float, ...]:
    """The relative tolerance of each of a segment's outputs: 1e-4, or 4 ulps of the lowest float precision the
    output is computed from (a float32 output of a float16 matmul: float16's), with TensorFloat-32 among them where
    the output depends on an op torch's settings let a GPU compute in it (:func:`may_use_tf32`).  Only an output's
    own ancestors count: a float32 loss beside a float16 branch keeps float32's tolerance."""
    eps: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        own = [torch.finfo(v.dtype).eps for v in (val if isinstance(val, (list, tuple)) else [val])
               if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
        if may_use_tf32(node):
            own.append(TF32_EPS)
        eps[node] = max([0.0, *own, *(eps[a] for a in node.all_input_nodes)])
    out = gm.graph.output_node().args[0]
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(max(VERIFY_TOLERANCE, VERIFY_ULPS * eps[o]) if isinstance(o, fx.Node) else VERIFY_TOLERANCE
                 for o in outputs)


TF32_EPS = 2.0**-10  # TensorFloat-32 keeps 10 bits of float32's 23-bit mantissa
_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default)


def may_use_tf32(node: fx.Node) -> bool:
    """Whether torch's settings let a GPU compute ``node`` in TensorFloat-32: a float32 convolution with cuDNN's
    TF32 allowed (``torch.backends.cudnn.allow_tf32``, on by default), a float32 matmul with
    ``torch.set_float32_matmul_precision`` below "highest".  Two implementations of such an op (eager's NCHW
    convolution, inductor's channels-last one) may pick kernels that differ in whether they use it: their
    results agree to TF32's precision, not float32's, both within what the user allowed."""
    if node.op != "call_function" or not (node.target in _CONVOLUTIONS or node.target in _MATMULS):
        return False
    val = node.meta.get("val")
    v = next((t for t in val if isinstance(t, torch.Tensor)), None) if isinstance(val, (list, tuple)) else val
    if not (isinstance(v, torch.Tensor) and v.device.type == "cuda" and v.dtype == torch.float32):
        return False
    if node.target in _CONVOLUTIONS:
        return torch.backends.cudnn.allow_tf32
    return torch.get_float32_matmul_precision() != "highest"


@dataclass(frozen=True)
class UnorderedTopk:
    """Outputs of a segment laid out in the order of one ``topk(..., sorted=False)`` along ``dim``.

    That order is unspecified (ONNX Runtime returns the same k elements per row as torch, in
    another order), so these outputs are compared in a defined order: each row sorted by the
    topk's indices (``indices``: their position among the outputs) with the same permutation for
    every member, values and indices together; without the indices among the outputs, each member
    is sorted by itself.  ``members``: positions of the outputs in that order (the indices included).
    """

    dim: int
    indices: int | None
    members: tuple[int, ...]


# ops whose output keeps its input's order along every dim (with the other inputs broadcast along the topk dim)
_ORDER_KEEPING = (torch.ops.aten._to_copy.default, torch.ops.aten.alias.default, torch.ops.aten.detach.default)


def unordered_topks(gm: fx.GraphModule) -> tuple[UnorderedTopk, ...]:
    """The segment's outputs that follow the order of a ``topk(sorted=False)``, found in its graph.

    A value follows a topk's order when it is one of its results, or computed from them elementwise
    (a pointwise op whose other inputs do not vary along the topk dim) or by a ``gather`` along that dim
    with them as the index, keeping their shape.  Any other use (a reduction, a reshape) is compared
    exactly, as every output not in a group.
    """
    follows: dict[fx.Node, int] = {}  # node -> its topk (index into tops)
    tops: list[tuple[int, torch.Size]] = []  # (dim, shape) per topk
    indices: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.topk.default and not _topk_arg(node, 4, "sorted", True):
            shape = node.meta["val"][0].shape
            follows[node] = len(tops)
            tops.append((_topk_arg(node, 2, "dim", -1) % max(len(shape), 1), shape))
        elif node.target is operator.getitem and node.args[0] in follows:
            follows[node] = follows[node.args[0]]
            if node.args[1] == 1:
                indices[follows[node]] = node
        elif (group := _follower_of(node, follows, tops)) is not None:
            follows[node] = group
    if not tops:
        return ()
    out = gm.graph.output_node().args[0]
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    groups = []
    for g, (dim, _) in enumerate(tops):
        members = tuple(i for i, o in enumerate(outputs) if isinstance(o, fx.Node) and follows.get(o) == g
                        and o.target is not torch.ops.aten.topk.default)
        if members:
            at = next((i for i in members if outputs[i] is indices.get(g)), None)
            groups.append(UnorderedTopk(dim=dim, indices=at, members=members))
    return tuple(groups)


def _topk_arg(node: fx.Node, position: int, name: str, default):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _follower_of(node: fx.Node, follows: dict, tops: list) -> int | None:
    """The topk whose order ``node`` keeps (see :func:`unordered_topks`), or None."""
    groups = {follows[a] for a in node.all_input_nodes if a in follows}
    val = node.meta.get("val")
    if len(groups) != 1 or not isinstance(val, torch.Tensor):
        return None
    (group,) = groups
    dim, shape = tops[group]
    if val.shape != shape:
        return None
    target = node.target
    if target is torch.ops.aten.gather.default:
        source, along, index = node.args[:3]
        return group if index in follows and along % len(shape) == dim and source not in follows else None
    if target in _ORDER_KEEPING or torch.Tag.pointwise in getattr(target, "tags", ()):
        for a in node.all_input_nodes:
            v = a.meta.get("val")
            if a in follows or not isinstance(v, torch.Tensor):
                continue
            offset = len(shape) - v.dim()  # broadcast aligns trailing dims
            if dim >= offset and v.shape[dim - offset] != 1:
                return None  # varies along the topk dim in its own order
        return group
    return None


def in_defined_order(outputs, groups: tuple[UnorderedTopk, ...]):
    """``outputs`` with each :class:`UnorderedTopk` group's members in a defined order (see there)."""
    if not groups:
        return outputs
    vals = list(outputs if isinstance(outputs, (tuple, list)) else (outputs,))
    for group in groups:
        if group.indices is not None:
            order = torch.argsort(vals[group.indices], dim=group.dim, stable=True)
            for i in group.members:
                vals[i] = torch.take_along_dim(vals[i], order, dim=group.dim)
        else:
            for i in group.members:
                vals[i] = torch.sort(vals[i], dim=group.dim, stable=True).values
    return tuple(vals) if isinstance(outputs, (tuple, list)) else vals[0]


# Elements compared at a time: the check's temporaries (|a - b|, |b|, NaN masks) stay a few MiB whatever an
# output's size.  Whole-tensor temporaries of a loss head's logits (8 M elements) held ~250 MiB beside the two
# executors' outputs in a tensor-parallel first run (the process's peak).
VERIFY_CHUNK = 1 << 20


def _pieces(*tensors: torch.Tensor):
    """The same consecutive pieces of equally shaped tensors, about :data:`VERIFY_CHUNK` elements each: flat views
    when all are contiguous, else slices of dim 0."""
    first = tensors[0]
    if first.dim() == 0:
        yield tensors
    elif all(t.is_contiguous() for t in tensors):
        flat = [t.view(-1) for t in tensors]
        for start in range(0, first.numel(), VERIFY_CHUNK):
            yield tuple(f[start:start + VERIFY_CHUNK] for f in flat)
    else:
        rows = max(1, VERIFY_CHUNK // max(1, first[0].numel()))
        for start in range(0, first.shape[0], rows):
            yield tuple(t[start:start + rows] for t in tensors)


def _finite_abs_max(t: torch.Tensor) -> float:
    """max |t| over its finite elements (0 where there are none), piece by piece."""
    return max(torch.nan_to_num(p.abs(), nan=0.0, posinf=0.0).max().item() for (p,) in _pieces(t))


def _tolerance_of(tolerance: float | Sequence[float], i: int) -> float:
    return tolerance if isinstance(tolerance, (int, float)) else tolerance[i]


def first_difference(ort_out, fx_out, tolerance: float | Sequence[float] = VERIFY_TOLERANCE,
                     label: str = "ort") -> str | None:
    """Describe the first output that differs beyond its tolerance, or None: each element of output ``i`` within
    ``tolerance[i]`` (one float: every output's) of the output's largest |value|, or within the dtype's absolute
    floor (:data:`VERIFY_ABS_FLOOR`).  No floor is taken from another output: an output of small values beside
    large ones is checked to its own scale.  ``label`` names the executor compared with fx in the description.

    Compared :data:`VERIFY_CHUNK` elements at a time (maxima: the same result as whole tensors)."""
    ort_vals, fx_vals = _outputs(ort_out), _outputs(fx_out)
    for i, (a, b) in enumerate(zip(ort_vals, fx_vals)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
        if not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                return f"output {i}: integer values differ"
            continue
        if b.numel() == 0:
            continue
        err = 0.0
        for pa, pb in _pieces(a, b):
            diff = (pa - pb).abs()  # NaN where either is NaN (or both are the same infinity)
            nan = torch.isnan(diff)
            if nan.any():
                if not torch.equal(nan, nan & _same(pa, pb)):
                    return f"output {i}: NaN in one and not the other"
                diff = torch.nan_to_num(diff, nan=0.0)
            err = max(err, diff.max().item())
        scale = _finite_abs_max(b)
        if err > _tolerance_of(tolerance, i) * scale and err > VERIFY_ABS_FLOOR.get(a.dtype, 1e-9):
            return (f"output {i} (shape {tuple(b.shape)}): max |{label} - fx| = {err:.3g}, "
                    f"{err / max(scale, 1e-30):.3g} of max |fx| = {scale:.3g}")
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where two outputs hold the same value: equal (the same infinity included), or both NaN."""
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def op_summary(gm: fx.GraphModule, limit: int = 6) -> str:
    ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
    return ", ".join(ops[:limit]) + (f", ... {len(ops) - limit} more" if len(ops) > limit else "")

def output_mismatch(gm: fx.GraphModule, inputs, got, reference, tolerance: float | Sequence[float],
                    unordered: tuple[UnorderedTopk, ...] = (), label: str = "ort") -> tuple[str | None, str | None]:
    """How a compiled segment's outputs ``got`` (ORT's, inductor's) differ from its fx graph's ``reference`` on
    ``inputs``: ``(mismatch, forgiven)``. ``mismatch`` describes the first output beyond its tolerance
    (:func:`first_difference`), None when they agree; ``forgiven`` describes a difference that is no fault
    because, element by element, it is within float32's rounding of the segment computed in float64
    (:func:`within_rounding_of_float64`), else None. Outputs in the order of an unsorted topk are compared in a
    defined order (the op defines the set)."""
    got, reference = in_defined_order(got, unordered), in_defined_order(reference, unordered)
    diff = first_difference(got, reference, tolerance, label)
    if diff is not None and within_rounding_of_float64(gm, inputs, got, reference, unordered, tolerance):
        return None, diff
    return diff, None


def within_rounding_of_float64(gm: fx.GraphModule, inputs, ort_out, fx_out,
                               unordered: tuple[UnorderedTopk, ...] = (),
                               tolerance: float | Sequence[float] = VERIFY_TOLERANCE) -> bool:
    """Whether each element of ORT's outputs is as close to the segment computed in float64 as float32's rounding
    lets an implementation be.

    A verification mismatch may be the rounding of an ill-conditioned float32 computation (a batch norm of two
    nearly equal values; the analytically zero gradient of a bias before a batch norm, rounding noise of sums of
    terms much larger than itself), where two float32 implementations cannot agree.  The fx graph is run again
    with its float32 inputs in float64 (every float32 its ops name, e.g. a cast of a count, made float64): the
    exact values ``x``.  And once more so, with every op's result rounded at random by one float32 unit in the last
    place (:class:`_Float64`, ``perturb``): how far float32's rounding of *this output's own computation* moves it
    (``noise``, its largest |perturbed - x|; the noise of a cancelling sum is that of its terms).  Element ``j`` of
    output ``i`` passes when

        |ort_j - x_j| <= max(tolerance_i * max|x|, FLOAT64_FACTOR * |fx_j - x_j|, FLOAT64_FACTOR * noise_i)

    (or equals fx's): no norm over the output dilutes one wrong element, and no output lends its scale to
    another.  Only for segments that compute in float32 alone; otherwise, or if a float64 run fails, the mismatch
    stands.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(isinstance(a, torch.dtype) and a not in (torch.float32, torch.int64,
                                                                                          torch.bool)
                                              for a in (*node.args, *node.kwargs.values())):
            return False  # another precision on purpose: not ours to widen
    floats = [isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in inputs]
    ort_vals, fx_vals = _outputs(ort_out), _outputs(fx_out)
    if not any(floats) or any(isinstance(v, torch.Tensor) and v.dtype not in (torch.float32, torch.int64, torch.bool)
                              for v in fx_vals):
        return False
    wide = [t.double() if f else t for t, f in zip(inputs, floats)]
    try:
        with torch.no_grad():
            exact = _outputs(in_defined_order(_Float64(gm).run(*wide), unordered))
            perturbed = _outputs(in_defined_order(_Float64(gm, perturb=True).run(*wide), unordered))
    except Exception:  # noqa: BLE001 - no float64 reference: the mismatch stands
        return False
    for i, (a, b, x, p) in enumerate(zip(ort_vals, fx_vals, exact, perturbed)):
        if not isinstance(b, torch.Tensor) or not b.dtype.is_floating_point:
            continue
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.shape == b.shape for t in (x, p)):
            return False
        if b.numel() == 0:
            continue
        scale = noise = 0.0
        for px, pp in _pieces(x, p):
            scale = max(scale, torch.nan_to_num(px.abs(), nan=0.0, posinf=0.0).max().item())
            noise = max(noise, torch.nan_to_num((pp - px).abs(), nan=0.0, posinf=0.0).max().item())
        floor = max(_tolerance_of(tolerance, i) * scale, FLOAT64_FACTOR * noise, VERIFY_ABS_FLOOR[torch.float32])
        for pa, pb, px in _pieces(a, b, x):
            ort_err, fx_err = (pa.double() - px).abs(), (pb.double() - px).abs()
            ok = (ort_err <= torch.clamp(FLOAT64_FACTOR * fx_err, min=floor)) | _same(pa, pb)
            if not bool(ok.all()):
                return False
    return True


def _outputs(values) -> tuple:
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


class _Float64(RunInterpreter):
    """Runs a graph with every float32 its ops name (a cast's dtype) read as float64; the graph is not changed.

    With ``perturb``, each op's floating result is then moved at random by up to one float32 unit in the last place
    relative to itself (a fixed seed: the same run each time), as float32 would round it: a float64 model of the
    graph's float32 rounding, element by element.  Views and ops whose results alias their inputs are left as they
    are (they round nothing)."""

    def __init__(self, gm: fx.GraphModule, perturb: bool = False):
        super().__init__(gm)
        self.generator = torch.Generator().manual_seed(0) if perturb else None

    def call_function(self, target, args, kwargs):
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        result = super().call_function(target, args, kwargs)
        if self.generator is None or _aliases(target):
            return result
        if isinstance(result, (tuple, list)):
            return type(result)(self._round(r) for r in result)
        return self._round(result)

    def _round(self, value):
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.float64 and value.numel()):
            return value
        u = torch.rand(value.shape, dtype=torch.float64, generator=self.generator) * 2 - 1
        return value * (1 + _FLOAT32_EPS * u)


_FLOAT32_EPS = torch.finfo(torch.float32).eps


def _aliases(target) -> bool:
    """Whether an op's result may be (a view of) one of its inputs, or is no aten op at all (getitem)."""
    return getattr(target, "_schema", None) is None or is_view_op(target, writes=True)


def short_error(exc: BaseException, limit: int = 400) -> str:
    """The error and, when it wraps another (the exporter's ConversionError does), the root cause."""
    def clip(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= limit else text[:limit] + " ..."

    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = clip(str(exc))
    return text if root is exc else f"{text} Cause: {type(root).__name__}: {clip(str(root))}"
