"""Is a compiled segment's output the fx graph's? The comparison every backend's checked first run makes.

:func:`output_mismatch` compares a backend's outputs with the fx graph's (:func:`first_difference`): per output,
relative to its largest value, with floors for rounding noise, and for an ill-conditioned float32 computation
against the segment run in float64 (:func:`within_rounding_of_float64`).  The ORT backend's first run
(``spmd_ort.backends.ort.verify``) and the inductor backend's use it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.runtime.interpreter import RunInterpreter

VERIFY_TOLERANCE = 1e-4  # max |ort - fx| relative to max |fx|, per output (fp32 segments)

# A segment that computes in a lower precision (autocast, MixedPrecisionPolicy) is verified to that
# precision: ORT's float16 kernels accumulate and round differently from torch's, one unit in the last
# place (2^-10 relative) apart, and outputs cast back to float32 carry that difference.
VERIFY_ULPS = 4

# Below this, differences are rounding noise of sums that cancel (e.g. the
# analytically zero gradient of an attention key bias, ~1e-13): not a fault.
VERIFY_ABS_FLOOR = {torch.float32: 1e-9, torch.float64: 1e-12, torch.float16: 1e-4, torch.bfloat16: 1e-3}

# An output that is analytically zero (a bias before a batch norm: the norm removes it) is rounding noise of
# sums of terms as large as the segment's other values, and its own max is no scale for that noise.  So a
# difference below NOISE_ULPS units in the last place of the segment's largest output (same dtype) is noise too.
NOISE_ULPS = 8

# A verification mismatch is no fault when ORT is no further than this many times fx's own distance from the
# segment computed in float64 (within_rounding_of_float64).
FLOAT64_FACTOR = 10


def verify_tolerance(gm: fx.GraphModule) -> float:
    """The relative tolerance for a segment: 1e-4, or 4 ulps of the lowest float precision it computes in (with
    TensorFloat-32 where torch's settings let a GPU use it: :func:`may_use_tf32`)."""
    eps = [torch.finfo(v.dtype).eps for n in gm.graph.nodes
           for v in (n.meta.get("val") if isinstance(n.meta.get("val"), (list, tuple)) else [n.meta.get("val")])
           if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    if any(may_use_tf32(n) for n in gm.graph.nodes):
        eps.append(TF32_EPS)
    return max([VERIFY_TOLERANCE] + [VERIFY_ULPS * e for e in eps])


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


def first_difference(ort_out, fx_out, tolerance: float = VERIFY_TOLERANCE, label: str = "ort") -> str | None:
    """Describe the first output that differs beyond ``tolerance`` (relative to the output's max) and beyond
    rounding noise (:data:`VERIFY_ABS_FLOOR`, :data:`NOISE_ULPS` of the segment's largest output), or None.
    ``label`` names the executor compared with fx in the description.

    Compared :data:`VERIFY_CHUNK` elements at a time (maxima: the same result as whole tensors)."""
    ort_vals = ort_out if isinstance(ort_out, tuple) else (ort_out,)
    fx_vals = fx_out if isinstance(fx_out, (tuple, list)) else (fx_out,)
    largest = _largest(fx_vals)
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
                same = (torch.isnan(pa) & torch.isnan(pb)) | (pa == pb)
                if not torch.equal(nan, nan & same):
                    return f"output {i}: NaN in one and not the other"
                diff = torch.nan_to_num(diff, nan=0.0)
            err = max(err, diff.max().item())
        scale = _finite_abs_max(b)
        if err > tolerance * scale and err > _noise_floor(a.dtype, largest):
            return (f"output {i} (shape {tuple(b.shape)}): max |{label} - fx| = {err:.3g}, "
                    f"{err / max(scale, 1e-30):.3g} of max |fx| = {scale:.3g}")
    return None

def _largest(values) -> dict[torch.dtype, float]:
    """Per floating dtype: the largest finite |value| among a segment's outputs."""
    largest: dict[torch.dtype, float] = {}
    for b in values:
        if isinstance(b, torch.Tensor) and b.dtype.is_floating_point and b.numel():
            largest[b.dtype] = max(largest.get(b.dtype, 0.0), _finite_abs_max(b))
    return largest


def _noise_floor(dtype: torch.dtype, largest: dict[torch.dtype, float]) -> float:
    """A difference no larger than this is rounding noise: :data:`VERIFY_ABS_FLOOR`, or :data:`NOISE_ULPS` of
    the segment's largest output of that dtype."""
    return max(VERIFY_ABS_FLOOR.get(dtype, 1e-9), NOISE_ULPS * torch.finfo(dtype).eps * largest.get(dtype, 0.0))


def op_summary(gm: fx.GraphModule, limit: int = 6) -> str:
    ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
    return ", ".join(ops[:limit]) + (f", ... {len(ops) - limit} more" if len(ops) > limit else "")

def output_mismatch(gm: fx.GraphModule, inputs, got, reference, tolerance: float,
                    unordered: tuple[UnorderedTopk, ...] = (), label: str = "ort") -> tuple[str | None, str | None]:
    """How a compiled segment's outputs ``got`` (ORT's, inductor's) differ from its fx graph's ``reference`` on
    ``inputs``: ``(mismatch, forgiven)``. ``mismatch`` describes the first output beyond the tolerance
    (:func:`first_difference`), None when they agree; ``forgiven`` describes a difference that is no fault
    because fx is as far from float64 (:func:`within_rounding_of_float64`), else None. Outputs in the order
    of an unsorted topk are compared in a defined order (the op defines the set)."""
    got, reference = in_defined_order(got, unordered), in_defined_order(reference, unordered)
    diff = first_difference(got, reference, tolerance, label)
    if diff is not None and within_rounding_of_float64(gm, inputs, got, reference, unordered):
        return None, diff
    return diff, None


def within_rounding_of_float64(gm: fx.GraphModule, inputs, ort_out, fx_out,
                               unordered: tuple[UnorderedTopk, ...] = ()) -> bool:
    """Whether ORT's outputs are as close to the segment computed in float64 as the fx graph's are.

    A verification mismatch may be the rounding of an ill-conditioned float32 computation (a batch
    norm of two nearly equal values: gradients that are analytically zero come out 1e-4 in eager
    float32), where two float32 implementations cannot agree.  The fx graph is run again with its
    float32 inputs in float64 (and every float32 its ops name, e.g. a cast of a count, made
    float64); the mismatch is no fault when every ORT output is within :data:`FLOAT64_FACTOR`
    times fx's own distance from the float64 output (or within the tolerance of it, or, elementwise, within
    the segment's noise floor of it: an analytically zero output fx happened to compute exactly).  Only for
    segments that compute in float32 alone; otherwise, or if the float64 run fails, the mismatch
    stands.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(isinstance(a, torch.dtype) and a not in (torch.float32, torch.int64,
                                                                                          torch.bool)
                                              for a in (*node.args, *node.kwargs.values())):
            return False  # another precision on purpose: not ours to widen
    floats = [isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in inputs]
    ort_vals = ort_out if isinstance(ort_out, tuple) else (ort_out,)
    fx_vals = fx_out if isinstance(fx_out, (tuple, list)) else (fx_out,)
    if not any(floats) or any(isinstance(v, torch.Tensor) and v.dtype not in (torch.float32, torch.int64, torch.bool)
                              for v in fx_vals):
        return False
    try:
        with torch.no_grad():
            exact = _Float64(gm).run(*[t.double() if f else t for t, f in zip(inputs, floats)])
        exact = in_defined_order(exact, unordered)
    except Exception:  # noqa: BLE001 - no float64 reference: the mismatch stands
        return False
    exact_vals = exact if isinstance(exact, (tuple, list)) else (exact,)
    largest = _largest(fx_vals)
    for a, b, x in zip(ort_vals, fx_vals, exact_vals):
        if not isinstance(b, torch.Tensor) or not b.dtype.is_floating_point:
            continue
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float64 or x.shape != b.shape:
            return False
        if b.numel() == 0:
            continue
        diff = a.double() - x
        ort_err, fx_err = diff.norm().item(), (b.double() - x).norm().item()
        if ort_err <= max(VERIFY_TOLERANCE * x.norm().item(), FLOAT64_FACTOR * fx_err):
            continue
        # an analytically zero output that fx happened to compute exactly: ORT's rounding noise there is no
        # fault when it is below the noise floor that first_difference grants against fx
        if not diff.abs().max().item() <= _noise_floor(b.dtype, largest):
            return False
    return True


class _Float64(RunInterpreter):
    """Runs a graph with every float32 its ops name (a cast's dtype) read as float64; the graph is not changed."""

    def call_function(self, target, args, kwargs):
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return super().call_function(target, args, kwargs)


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
