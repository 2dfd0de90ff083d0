"""Our own ONNX translations of aten ops: the backward ops torchlib lacks and the ones torch decomposes badly.

Each function is traced by the exporter like a torchlib function: it receives
``onnx_ir`` values for tensor arguments (with dtypes, and shapes whose dims are
ints or, in a dynamic-shape segment, symbolic: :func:`_shape` builds a shape
from both) and Python values for the rest, in the aten schema's order, and builds ONNX nodes
with ``op``.  :data:`~spmd_ort.backends.ort.translation_table.TRANSLATIONS` (in a module of its
own, without onnxscript) maps each op to its :class:`~spmd_ort.backends.ort.translation_table.Translation`:
the function's name here, and ``accepts(node)``, which says when a node's arguments are
outside what the function implements.  Verification (:mod:`spmd_ort.backends.ort.executor`)
checks every translation against torch on the first run; ``tests/test_translations.py``
checks each one against eager on its own.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Optional

import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.tensor_typing import INT64, TFloat, TTensor

aten = torch.ops.aten


def _const(value: float, like) -> ir.Value:
    return op.Constant(value=ir.tensor(value, dtype=like.dtype))


def _ints(values: Sequence[int]) -> ir.Value:
    return op.Constant(value=ir.tensor(list(values), dtype=ir.DataType.INT64))


def _static(dim) -> bool:
    return isinstance(dim, int)


def _shape(parts: Sequence) -> ir.Value:
    """A 1-D INT64 shape from ``parts``: ints, or ``(value, axis)`` for a dim of ``value`` read at run time.

    All ints give one constant; a symbolic dim (dynamic shapes) is read with ``Shape``, so the model
    serves every size.  Static dims of a ``(value, axis)`` part are folded to constants too.
    """
    pieces, ints = [], []
    for part in parts:
        if isinstance(part, tuple):
            value, axis = part
            rank = len(value.shape)
            axis %= rank
            if _static(value.shape[axis]):
                ints.append(value.shape[axis])
                continue
            if ints:
                pieces.append(_ints(ints))
                ints = []
            pieces.append(op.Shape(value, start=axis, end=axis + 1))
        else:
            ints.append(int(part))
    if not pieces:
        return _ints(ints)
    if ints:
        pieces.append(_ints(ints))
    return pieces[0] if len(pieces) == 1 else op.Concat(*pieces, axis=0)


def _fit_end_to(x, like, rank: int, n: int):
    """``x`` cut or padded with zeros at the end of its last ``n`` dims to ``like``'s sizes there (read at run
    time): the gradient of a strided window op, computed without cropping its end padding, fitted to the input."""
    sizes = op.Shape(like, start=-n)
    short = op.Max(op.Sub(sizes, op.Shape(x, start=-n)), _ints([0] * n))
    x = op.Pad(x, op.Concat(_ints([0] * (2 * rank - n)), short, axis=0))
    return op.Slice(x, _ints([0] * n), sizes, _ints(range(rank - n, rank)))


def _count(value, axes: Sequence[int]):
    """The number of elements over ``axes``: an int, or (a symbolic dim among them) a 0-d INT64 value."""
    dims = [value.shape[a] for a in axes]
    if all(_static(d) for d in dims):
        return math.prod(dims)
    return op.ReduceProd(_shape([(value, a) for a in axes]), keepdims=0)


def _unused(like) -> ir.Value:
    """Stands for an output the node does not compute (``output_mask`` False): never read."""
    return op.Constant(value=ir.tensor([0.0], dtype=like.dtype))


# ---------------------------------------------------------------- activations
def elu(self: TFloat, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> TFloat:
    """x > 0: scale x; else scale alpha expm1(input_scale x), with expm1(z) = tanh(z/2) (exp(z) + 1).

    ONNX's Elu (and exp(z) - 1) cancels for small |z|: ORT's is 1.6% off at z = -1.8e-6, found by
    the differential fuzzer; the tanh identity has no cancellation.
    """
    z = self * _const(input_scale, self) if input_scale != 1.0 else self
    expm1 = op.Tanh(z * _const(0.5, self)) * (op.Exp(z) + _const(1.0, self))
    negative = expm1 * _const(alpha * scale, self)
    positive = self * _const(scale, self) if scale != 1.0 else self
    return op.Where(op.Greater(self, _const(0.0, self)), positive, negative)


def sort_stable(self: TTensor, stable: Optional[bool] = None, dim: int = -1, descending: bool = False):
    """``sort`` with equal values in their input order: ONNX's ``TopK`` over the whole dim, which puts the lower
    index first among equal values (the ONNX spec; ONNX Runtime's CPU kernel does, ascending and descending)."""
    if len(self.shape) == 0:
        return op.Identity(self), op.Constant(value=ir.tensor(0, dtype=ir.DataType.INT64))
    return op.TopK(self, _shape([(self, dim)]), axis=dim, largest=int(descending), sorted=1)


def grouped_mm(mat_a: TFloat, mat_b: TFloat, offs=None, bias=None, out_dtype=None) -> TFloat:
    """``spmd_ort::grouped_mm`` (``torch._grouped_mm``, an MoE's experts): one ``MatMul`` per group.

    ``offs`` holds the groups' cumulative ends (int32), read at run time: ``Slice`` cuts each group's rows of
    ``mat_a`` (2-D @ 3-D: the experts' forward and input gradient; rows past the last group, none when the
    groups cover every row, are zeros where torch's kernel leaves them unwritten) or each group's stretch of
    the contraction dim of both (2-D @ 2-D: the experts' weight gradients, one (K, N) block per group).  3-D @
    3-D is a batched ``MatMul``.  The number of groups is static (the experts' weights, ``offs``' length).
    """
    if offs is None:
        return op.MatMul(mat_a, mat_b)
    ends = op.Cast(offs, to=ir.DataType.INT64)
    starts = op.Concat(_ints([0]), op.Slice(ends, _ints([0]), _ints([-1])), axis=0)

    def bounds(e: int):
        return op.Slice(starts, _ints([e]), _ints([e + 1])), op.Slice(ends, _ints([e]), _ints([e + 1]))

    if len(mat_b.shape) == 3:
        parts = []
        for e in range(mat_b.shape[0]):
            start, end = bounds(e)
            rows = op.Slice(mat_a, start, end, _ints([0]))
            parts.append(op.MatMul(rows, op.Gather(mat_b, op.Constant(value=ir.tensor(e, dtype=ir.DataType.INT64)),
                                                   axis=0)))
        out = op.Concat(*parts, axis=0) if len(parts) > 1 else parts[0]
        missing = op.Sub(op.Shape(mat_a, start=0, end=1), op.Slice(ends, _ints([-1]), _ints([2**62])))
        return op.Pad(out, op.Concat(_ints([0, 0]), missing, _ints([0]), axis=0))
    parts = []
    for e in range(offs.shape[0]):
        start, end = bounds(e)
        block = op.MatMul(op.Slice(mat_a, start, end, _ints([1])), op.Slice(mat_b, start, end, _ints([0])))
        parts.append(op.Unsqueeze(block, _ints([0])))
    return op.Concat(*parts, axis=0) if len(parts) > 1 else parts[0]


def silu_backward(grad_output: TFloat, self: TFloat) -> TFloat:
    """d silu = sigmoid(x) (1 + x (1 - sigmoid(x)))."""
    sig = op.Sigmoid(self)
    one = _const(1.0, self)
    return grad_output * (sig * (one + self * (one - sig)))


def gelu_backward(grad_output: TFloat, self: TFloat, approximate: str = "none") -> TFloat:
    """torch's GELU derivative (erf or tanh form) in one pass of elementwise ops."""
    x = self
    if approximate == "tanh":
        beta = math.sqrt(2.0 / math.pi)
        kappa = 0.044715
        x_sq = x * x
        inner = _const(beta, x) * (x + _const(kappa, x) * x_sq * x)
        t = op.Tanh(inner)
        one = _const(1.0, x)
        left = _const(0.5, x) * x
        d_inner = _const(beta, x) * (one + _const(3.0 * kappa, x) * x_sq)
        return grad_output * (_const(0.5, x) * (one + t) + left * (one - t * t) * d_inner)
    cdf = _const(0.5, x) * (_const(1.0, x) + op.Erf(x * _const(math.sqrt(0.5), x)))
    pdf = op.Exp(_const(-0.5, x) * x * x) * _const(1.0 / math.sqrt(2.0 * math.pi), x)
    return grad_output * (cdf + x * pdf)


def _softmax_backward_data(grad_output: TFloat, output: TFloat, dim: int, input_dtype: int) -> TFloat:
    """y (g - sum(g y))."""
    gy = grad_output * output
    return gy - output * op.ReduceSum(gy, _ints([dim]), keepdims=1)


def _log_softmax_backward_data(grad_output: TFloat, output: TFloat, dim: int, input_dtype: int) -> TFloat:
    """g - exp(y) sum(g)."""
    return grad_output - op.Exp(output) * op.ReduceSum(grad_output, _ints([dim]), keepdims=1)


# ---------------------------------------------------------------- elementwise
def pow_tensor_scalar(self: TTensor, exponent: float) -> TTensor:
    """``x ** c`` as torch's CPU kernel computes the exponents it special-cases (1, 2, 3, 0.5, -0.5, -1, -2:
    products, Sqrt, Reciprocal) in float32/float64, and torchlib's ONNX ``Pow`` otherwise.

    ORT's CPU ``Pow`` is several times slower than a ``Mul``: an RMSNorm's square and its gradient's
    ``x ** 1`` cost 0.2 ms each on (8, 128, 128) in mixtral-tiny's segments.
    """
    if self.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) and not isinstance(exponent, bool):
        c = float(exponent)
        if c == 1.0:
            return op.Identity(self)
        if c == 2.0:
            return self * self
        if c == 3.0:
            return self * self * self
        if c == 0.5:
            return op.Sqrt(self)
        if c == -0.5:
            return op.Reciprocal(op.Sqrt(self))
        if c == -1.0:
            return op.Reciprocal(self)
        if c == -2.0:
            return op.Reciprocal(self * self)
    from onnxscript.function_libs.torch_lib.ops.core import aten_pow_tensor_scalar

    return aten_pow_tensor_scalar(self, exponent)


# ---------------------------------------------------------------- shapes
def squeeze_dims(self: TTensor, dim: Sequence[int]) -> TTensor:
    """Drops the listed dims of size 1 (others stay, as in torch); torch's decomposition produces prims ops."""
    rank = len(self.shape)
    dims = sorted({d % rank for d in dim if self.shape[d % rank] == 1}) if rank else []
    return op.Squeeze(self, _ints(dims)) if dims else op.Identity(self)


# ---------------------------------------------------------------- embedding
def embedding_dense_backward(grad_output: TFloat, indices: INT64, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> TFloat:
    """Rows of the gradient summed into the rows their indices name (ScatterElements, reduction add).

    Not ScatterND: ONNX Runtime's CPU ScatterND with reduction add splits the updates over its threads, and two
    updates of one row (a token seen twice) then race: with 2 threads, 6 runs in 200 summed a 1024-token batch
    wrongly (onnxruntime 1.32; tests/test_translations.py repeats the run). Its ScatterElements sums alike on
    every run.
    """
    dim = grad_output.shape[-1]
    grad = op.Reshape(grad_output, _ints([-1, dim]))  # (n, D)
    idx = op.Reshape(indices, _ints([-1, 1]))  # (n, 1)
    if padding_idx >= 0:
        keep = op.Not(op.Equal(idx, op.Constant(value=ir.tensor([padding_idx], dtype=indices.dtype))))
        grad = op.Where(keep, grad, _const(0.0, grad_output))
    if scale_grad_by_freq:
        flat = op.Reshape(idx, _ints([-1]))  # (n,)
        ones = op.Expand(_const(1.0, grad_output), op.Shape(flat))
        counts = op.ScatterElements(op.Expand(_const(0.0, grad_output), _ints([num_weights])), flat, ones,
                                    axis=0, reduction="add")
        grad = grad / op.Unsqueeze(op.Gather(counts, flat, axis=0), _ints([1]))
    zeros = op.Expand(_const(0.0, grad_output), _ints([num_weights, dim]))
    rows = op.Expand(idx, op.Shape(grad))  # (n, D): row idx[i] for every element of update row i
    return op.ScatterElements(zeros, rows, grad, axis=0, reduction="add")


# ---------------------------------------------------------------- normalization
def var_mean(self: TFloat, dim: Optional[Sequence[int]] = None, correction: Optional[float] = None,
             keepdim: bool = False) -> tuple[TFloat, TFloat]:
    """(variance, mean) over ``dim`` (all dims when None) with Bessel's ``correction`` (default 1).

    torch decomposes it into prims ops, which have no ONNX translation.
    """
    rank = len(self.shape)
    dims = list(range(rank)) if dim is None else [d % rank for d in dim]
    count = _count(self, dims)
    correction = 1.0 if correction is None else float(correction)
    mean = op.ReduceMean(self, _ints(dims), keepdims=1)
    centred = self - mean
    if isinstance(count, int):
        scale = _const(1.0 / (count - correction) if count > correction else float("nan"), self)  # as torch
    else:  # dynamic shapes: 1 / (n - correction), nan where n <= correction (as torch)
        n = op.Cast(count, to=self.dtype) - _const(correction, self)
        scale = op.Where(op.Greater(n, _const(0.0, self)), op.Reciprocal(n), _const(float("nan"), self))
    var = op.ReduceSum(centred * centred, _ints(dims), keepdims=int(keepdim)) * scale
    if not keepdim:
        mean = op.Squeeze(mean, _ints(dims))
    return var, mean


def native_layer_norm_backward(grad_out: TFloat, input: TFloat, normalized_shape: Sequence[int], mean: TFloat,
                               rstd: TFloat, weight: Optional[TFloat], bias: Optional[TFloat],
                               output_mask: Sequence[bool]) -> tuple[TFloat, TFloat, TFloat]:
    """dx = rstd (g w - mean(g w) - x_hat mean(g w x_hat)), dw = sum(g x_hat), db = sum(g) over the outer dims."""
    rank = len(input.shape)
    axis = rank - len(normalized_shape)
    inner, outer = _ints(range(axis, rank)), list(range(axis))
    n = float(math.prod(normalized_shape))
    x_hat = (input - mean) * rstd
    g = grad_out * weight if weight is not None else grad_out
    grad_input = _unused(input)
    if output_mask[0]:
        a = op.ReduceSum(g, inner, keepdims=1)
        b = op.ReduceSum(g * x_hat, inner, keepdims=1)
        grad_input = (g - (a + x_hat * b) * _const(1.0 / n, input)) * rstd
    grad_weight = _unused(input)
    if output_mask[1] and weight is not None:
        grad_weight = _sum_over(grad_out * x_hat, outer)
    grad_bias = _unused(input)
    if output_mask[2] and bias is not None:
        grad_bias = _sum_over(grad_out, outer)
    return grad_input, grad_weight, grad_bias


def _sum_over(x, axes: list[int]):
    return op.ReduceSum(x, _ints(axes), keepdims=0) if axes else x


def native_batch_norm_backward(grad_out: TFloat, input: TFloat, weight: Optional[TFloat],
                               running_mean: Optional[TFloat], running_var: Optional[TFloat],
                               save_mean: Optional[TFloat], save_invstd: Optional[TFloat], train: bool, eps: float,
                               output_mask: Sequence[bool]) -> tuple[TFloat, TFloat, TFloat]:
    """Per-channel statistics over every dim but 1; training mode also differentiates through them."""
    rank = len(input.shape)
    channels = input.shape[1]
    axes = [0, *range(2, rank)]
    per_channel = _ints([1, channels] + [1] * (rank - 2))
    n = _count(input, axes)
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean = running_mean
        invstd = op.Reciprocal(op.Sqrt(running_var + _const(eps, input)))
    mean_b, invstd_b = op.Reshape(mean, per_channel), op.Reshape(invstd, per_channel)
    x_hat = (input - mean_b) * invstd_b
    grad_bias = op.ReduceSum(grad_out, _ints(axes), keepdims=0)
    grad_weight = op.ReduceSum(grad_out * x_hat, _ints(axes), keepdims=0)
    scale = invstd_b if weight is None else invstd_b * op.Reshape(weight, per_channel)
    grad_input = _unused(input)
    if output_mask[0]:
        if train:
            inv_n = _const(1.0 / n, input) if isinstance(n, int) else op.Reciprocal(op.Cast(n, to=input.dtype))
            centred = grad_out - op.Reshape(grad_bias * inv_n, per_channel) \
                - x_hat * op.Reshape(grad_weight * inv_n, per_channel)
            grad_input = centred * scale
        else:
            grad_input = grad_out * scale
    return (grad_input, grad_weight if output_mask[1] else _unused(input),
            grad_bias if output_mask[2] else _unused(input))


# ---------------------------------------------------------------- pooling
def max_pool2d_with_indices(self: TFloat, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,),
                            ceil_mode: bool = False) -> tuple[TFloat, INT64]:
    """MaxPool, its indices made torch's: ONNX's flat position in the whole tensor less its (N, C) plane's offset.

    torchlib reads each plane's offset from a second MaxPool over the whole input (kernel 1, with indices):
    a full pass as slow as the pooling itself (8 of the 75 ms of bench/step.py's CNN on ORT).  The offset
    is ``(n * C + c) * H * W``, computed here from the shape.
    """
    kernel = _expand(kernel_size, 2)
    strides = _expand(stride, 2) if stride else kernel
    pads, dilations = _expand(padding, 2), _expand(dilation, 2)
    batched = len(self.shape) == 4
    x = self if batched else op.Unsqueeze(self, _ints([0]))
    out, flat = op.MaxPool(x, ceil_mode=int(ceil_mode), dilations=dilations, kernel_shape=kernel, pads=pads + pads,
                           strides=strides)
    planes = _shape([(self, 0), (self, 1)] if batched else [1, (self, 0)])
    one = op.Constant(value=ir.tensor(1, dtype=ir.DataType.INT64))
    first = op.Range(op.Constant(value=ir.tensor(0, dtype=ir.DataType.INT64)), op.ReduceProd(planes, keepdims=0), one)
    first = first * op.ReduceProd(op.Shape(self, start=-2), keepdims=1)  # each plane's first flat position
    indices = flat - op.Reshape(first, op.Concat(planes, _ints([1, 1]), axis=0))
    if not batched:
        out, indices = op.Squeeze(out, _ints([0])), op.Squeeze(indices, _ints([0]))
    return out, indices


def max_pool2d_with_indices_backward(grad_output: TFloat, self: TFloat, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: INT64) -> TFloat:
    """Each output gradient added to the input element its window's maximum came from.

    ``indices`` are torch's: flat positions within each (H, W) plane.
    """
    shape = list(self.shape)
    planes = [(self, a) for a in range(len(shape) - 2)]  # (N, C) or (C): the batch may be symbolic
    grad = op.Reshape(grad_output, _shape([*planes, -1]))
    idx = op.Reshape(indices, _shape([*planes, -1]))
    if _static(shape[-2]) and _static(shape[-1]):
        zeros = op.Expand(_const(0.0, self), _shape([*planes, shape[-2] * shape[-1]]))
    else:  # symbolic sizes: the planes' zeros from the input's own shape
        zeros = op.Reshape(op.Expand(_const(0.0, self), op.Shape(self)), _shape([*planes, -1]))
    out = op.ScatterElements(zeros, idx, grad, axis=len(planes), reduction="add")
    return op.Reshape(out, _shape([*planes, (self, -2), (self, -1)]))


def avg_pool2d_backward(grad_output: TFloat, self: TFloat, kernel_size: Sequence[int], stride: Sequence[int],
                        padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: Optional[int] = None) -> TFloat:
    """The transposed convolution with a ones kernel, of the output gradient divided by each window's count."""
    kernel, strides, pads = _pool_args(kernel_size, stride, padding)
    shape = list(self.shape)
    batched = len(shape) == 4
    grad = grad_output if batched else op.Unsqueeze(grad_output, _ints([0]))
    channels = shape[-3]
    if count_include_pad or not any(pads):
        grad = grad * _const(1.0 / (kernel[0] * kernel[1]), self)
    else:  # divide by the number of real (unpadded) elements under each window
        ones_in = op.Expand(_const(1.0, self), _shape([1, 1, (self, -2), (self, -1)]))
        ones_k = op.Expand(_const(1.0, self), _ints([1, 1, *kernel]))
        counts = op.Conv(ones_in, ones_k, strides=strides, pads=pads + pads)
        grad = grad / counts
    out_hw = list(grad_output.shape[-2:])
    weight = op.Expand(_const(1.0, self), _ints([channels, 1, *kernel]))
    if all(_static(v) for v in shape[-2:] + out_hw):
        extra = [shape[-2 + i] - ((out_hw[i] - 1) * strides[i] - 2 * pads[i] + kernel[i]) for i in range(2)]
        out = op.ConvTranspose(grad, weight, strides=strides, pads=pads + pads, group=channels, output_padding=extra)
    else:  # symbolic sizes: the end padding is not cropped, the result fitted at run time
        out = _fit_end_to(op.ConvTranspose(grad, weight, strides=strides, pads=pads + [0, 0], group=channels),
                          self, 4, 2)
    return out if batched else op.Squeeze(out, _ints([0]))


def _pool_args(kernel_size, stride, padding) -> tuple[list[int], list[int], list[int]]:
    kernel = list(kernel_size) * 2 if len(kernel_size) == 1 else list(kernel_size)
    strides = kernel if not stride else (list(stride) * 2 if len(stride) == 1 else list(stride))
    pads = list(padding) * 2 if len(padding) == 1 else list(padding)
    return kernel, strides, pads


# ---------------------------------------------------------------- convolution
def convolution_backward(grad_output: TFloat, input: TFloat, weight: TFloat, bias_sizes: Optional[Sequence[int]],
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int,
                         output_mask: Sequence[bool]) -> tuple[TFloat, TFloat, TFloat]:
    """Gradients of a (non-transposed) N-d convolution as ONNX convolutions.

    input: ConvTranspose of the output gradient with the same weight.  weight:
    a convolution of the input (channels and batch swapped) with the output
    gradient as kernel, stride and dilation swapped, cropped to the kernel
    size; grouped by moving the groups into the channel dim.  bias: a sum.
    """
    spatial = len(input.shape) - 2
    k = list(weight.shape[2:])
    s, p, d = (_expand(v, spatial) for v in (stride, padding, dilation))
    c_in = input.shape[1]  # the batch and the spatial sizes may be symbolic, the channels not
    c_out = grad_output.shape[1]
    out_sp, in_sp = list(grad_output.shape[2:]), list(input.shape[2:])
    grad_input = _unused(input)
    if output_mask[0] and all(_static(v) for v in in_sp + out_sp):
        extra = [in_sp[i] - ((out_sp[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + 1) for i in range(spatial)]
        grad_input = op.ConvTranspose(grad_output, weight, strides=s, pads=p + p, dilations=d, group=groups,
                                      output_padding=extra)
    elif output_mask[0]:  # symbolic sizes: the end padding is not cropped, the result fitted at run time
        grad_input = _fit_end_to(op.ConvTranspose(grad_output, weight, strides=s, pads=p + [0] * spatial,
                                                  dilations=d, group=groups), input, 2 + spatial, spatial)
    grad_weight = _unused(input)
    if output_mask[1] and groups == 1 and all(_static(v) for v in in_sp + out_sp):
        grad_weight = _conv_weight_grad_gemm(grad_output, input, k, s, p, d, out_sp)
    elif output_mask[1]:
        g, cg, cog = groups, c_in // groups, c_out // groups
        tail = list(range(3, 3 + spatial))
        # x: (N, G*Cg, *S) -> (Cg, G*N, *S): a batch of Cg images with G*N channels
        in_dims = [(input, 2 + i) for i in range(spatial)]
        out_dims = [(grad_output, 2 + i) for i in range(spatial)]
        x = op.Reshape(input, _shape([-1, g, cg, *in_dims]))
        x = op.Reshape(op.Transpose(x, perm=[2, 1, 0, *tail]), _shape([cg, -1, *in_dims]))
        # dy: (N, G*Cog, *So) -> (G*Cog, N, *So): G*Cog kernels over N channels
        dy = op.Reshape(grad_output, _shape([-1, g, cog, *out_dims]))
        dy = op.Reshape(op.Transpose(dy, perm=[1, 2, 0, *tail]), _shape([g * cog, -1, *out_dims]))
        gw = op.Conv(x, dy, strides=d, dilations=s, pads=p + p, group=g)  # (Cg, G*Cog, *K')
        gw = op.Transpose(gw, perm=[1, 0, *range(2, 2 + spatial)])
        grad_weight = op.Slice(gw, _ints([0] * spatial), _ints(k), _ints(range(2, 2 + spatial)))
    grad_bias = _unused(input)
    if output_mask[2]:
        grad_bias = op.ReduceSum(grad_output, _ints([0, *range(2, 2 + spatial)]), keepdims=0)
    return grad_input, grad_weight, grad_bias


def _conv_weight_grad_gemm(grad_output, input, k: list[int], s: list[int], p: list[int], d: list[int],
                           out_sp: list[int]):
    """The weight gradient of an ungrouped convolution as one GEMM per kernel offset (im2col, an offset at a time).

    For each kernel offset ``o``, ``dW[:, :, o] = dY (Cout, N*So) @ X_o (Cin, N*So)^T``, where ``X_o`` is
    the input window the offset reads (a strided slice of the padded input, channels first).  The
    convolution form (the input as a batch of Cin images, ``dY`` as the kernel) is a GEMM only 9 columns
    wide for a 3x3 kernel, which ORT's CPU convolution runs at a tenth of its GEMM rate: bench/step.py's
    CNN spent 25 ms per step in its two weight gradients that way, ~14 ms as GEMMs (and slices).  One
    offset at a time, the extra memory is one input-sized slice.
    """
    spatial = len(k)
    c_in, c_out = input.shape[1], grad_output.shape[1]
    axes = list(range(2, 2 + spatial))
    x = op.Pad(input, _ints([0, 0, *p, 0, 0, *p])) if any(p) else input
    xt = op.Transpose(x, perm=[1, 0, *axes])  # (Cin, N, *padded sizes)
    dy = op.Reshape(op.Transpose(grad_output, perm=[1, 0, *axes]), _ints([c_out, -1]))  # (Cout, N*So)
    pieces = []
    for offsets in itertools.product(*(range(n) for n in k)):
        starts = [o * di for o, di in zip(offsets, d)]
        ends = [st + (n - 1) * si + 1 for st, n, si in zip(starts, out_sp, s)]
        window = op.Reshape(op.Slice(xt, _ints(starts), _ints(ends), _ints(axes), _ints(s)), _ints([c_in, -1]))
        pieces.append(op.Gemm(dy, window, transB=1))  # (Cout, Cin)
    gw = op.Concat(*pieces, axis=1)  # (Cout, prod(k) * Cin): offset-major
    gw = op.Transpose(op.Reshape(gw, _ints([c_out, math.prod(k), c_in])), perm=[0, 2, 1])
    return op.Reshape(gw, _ints([c_out, c_in, *k]))


def _expand(values: Sequence[int], n: int) -> list[int]:
    return list(values) * n if len(values) == 1 else list(values)


# ---------------------------------------------------------------- attention
def _attention_scores(query, key, kv, is_causal: bool, attn_mask, scale: float | None):
    """(B, H, L, S) scores with the causal and explicit masks applied (``key`` may be a repeated, shapeless
    value; ``kv`` is the key as given, whose shape tells S).

    The causal mask is added (0 or -inf, built over (L, S) only), not selected over (B, H, L, S): ORT's CPU
    ``Where`` is ten times slower than a broadcast ``Add`` (0.87 against 0.09 ms on (8, 8, 128, 128)).  The
    two differ only where a masked score is itself +inf or NaN (a key that overflowed), which torch's
    kernel masks and the sum does not.
    """
    e = query.shape[-1]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    rank = len(query.shape)
    perm = [*range(rank - 2), rank - 1, rank - 2]
    scores = op.MatMul(query, op.Transpose(key, perm=perm)) * _const(scale, query)
    neg_inf = _const(float("-inf"), query)
    if is_causal:
        keep = op.Cast(op.Trilu(op.Expand(op.Constant(value=ir.tensor(1, dtype=ir.DataType.INT64)),
                                          _shape([(query, -2), (kv, -2)])), upper=0), to=ir.DataType.BOOL)
        scores = scores + op.Where(keep, _const(0.0, query), neg_inf)
    if attn_mask is not None:  # additive: the fused kernel takes masks of the query's dtype only
        scores = scores + attn_mask
    return scores, scale


# Masked scores are -inf, and ONNX Runtime's CPU Exp takes a slow path for float32 inputs below log(FLT_MIN)
# (about -87.3, where exp(x) is subnormal): on (8, 8, 128, 128) causal scores 1.26 ms against 0.16 ms unmasked.
# So a float32 softmax exponentiates max(x, EXP_FLOOR) and subtracts a hair more than exp(EXP_FLOOR) (clipped
# at 0): 0.64 ms for the four ops (mixtral-tiny's ORT-only step: 66.7 / 67.9 -> 65.3 / 61.7 ms, A/B), and a
# masked probability stays exactly 0 whichever way the kernel rounds exp(EXP_FLOOR). Without the subtraction
# it was 1.6e-38, whose products in the backward are subnormal, and the attention backward's GEMMs slowed
# tenfold (mixtral-tiny: 9.6 ms each). Probabilities above exp(-69) are unchanged (what is subtracted is below
# half their ulp); NaN stays NaN (Max propagates it). Other dtypes exponentiate as they are (float64's
# subnormals start near -708; float16's Exp rounds such values to 0).
EXP_FLOOR = -87.0
_EXP_FLOOR_VALUE = math.exp(EXP_FLOOR) * (1 + 2.0 ** -16)  # float32's exp(EXP_FLOOR), rounded either way, or less


def _exp_of_scores(x):
    """exp(x) for x <= 0 holding -inf where scores are masked (see :data:`EXP_FLOOR`)."""
    if x.dtype != ir.DataType.FLOAT:
        return op.Exp(x)
    return op.Relu(op.Exp(op.Max(x, _const(EXP_FLOOR, x))) - _const(_EXP_FLOOR_VALUE, x))


def _repeat_heads(x, heads: int):
    """(..., Hk, S, E) -> (..., H, S, E): query head h reads key/value head h // (H / Hk), as torch's GQA does."""
    rank = len(x.shape)
    hk = x.shape[-3]
    if hk == heads:
        return x
    lead = [(x, a) for a in range(rank - 3)]
    x2 = op.Expand(op.Unsqueeze(x, _ints([rank - 2])), _shape([*lead, hk, heads // hk, (x, -2), (x, -1)]))
    return op.Reshape(x2, _shape([*lead, heads, (x, -2), (x, -1)]))


def _sum_heads(grad, heads: int, kv):
    """The gradient of :func:`_repeat_heads`: (..., H, S, E) -> the shape of ``kv`` (..., Hk, S, E)."""
    rank, kv_heads = len(kv.shape), kv.shape[-3]
    if heads == kv_heads:
        return grad
    lead = [(kv, a) for a in range(rank - 3)]
    grad = op.Reshape(grad, _shape([*lead, kv_heads, heads // kv_heads, (kv, -2), (kv, -1)]))
    return op.ReduceSum(grad, _ints([rank - 2]), keepdims=0)


def _scaled_dot_product_flash_attention_for_cpu(query: TFloat, key: TFloat, value: TFloat, dropout_p: float = 0.0,
                                                is_causal: bool = False, attn_mask: Optional[TFloat] = None,
                                                scale: Optional[float] = None) -> tuple[TFloat, TFloat]:
    """softmax(q k^T scale + mask) v, and the row log-sum-exp the backward reuses (key/value heads repeated
    for grouped-query attention)."""
    heads = query.shape[-3]
    kv = key
    key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
    scores, _ = _attention_scores(query, key, kv, is_causal, attn_mask, scale)
    lse = _logsumexp(scores)
    out = op.MatMul(_exp_of_scores(scores - lse), value)
    return out, op.Squeeze(lse, _ints([-1]))


def _logsumexp(scores):
    top = op.ReduceMax(scores, _ints([-1]), keepdims=1)
    return top + op.Log(op.ReduceSum(_exp_of_scores(scores - top), _ints([-1]), keepdims=1))


def _scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out: TFloat, query: TFloat, key: TFloat, value: TFloat, out: TFloat, logsumexp: TFloat,
        dropout_p: float, is_causal: bool, attn_mask: Optional[TFloat] = None,
        scale: Optional[float] = None) -> tuple[TFloat, TFloat, TFloat]:
    """Recompute p = exp(scores - lse); dV = p^T dO, dS = p (dO V^T - rowsum(dO O)), dQ = dS K s, dK = dS^T Q s."""
    heads, kv, value_in = query.shape[-3], key, value
    key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
    scores, scale = _attention_scores(query, key, kv, is_causal, attn_mask, scale)
    p = _exp_of_scores(scores - op.Unsqueeze(logsumexp, _ints([-1])))
    rank = len(query.shape)
    perm = [*range(rank - 2), rank - 1, rank - 2]
    grad_value = op.MatMul(op.Transpose(p, perm=perm), grad_out)
    dp = op.MatMul(grad_out, op.Transpose(value, perm=perm))
    ds = p * (dp - op.ReduceSum(grad_out * out, _ints([-1]), keepdims=1))
    s = _const(scale, query)
    grad_query = op.MatMul(ds, key) * s
    grad_key = op.MatMul(op.Transpose(ds, perm=perm), query) * s
    return grad_query, _sum_heads(grad_key, heads, kv), _sum_heads(grad_value, heads, value_in)


from spmd_ort.backends.ort.translation_table import TRANSLATIONS, Translation  # noqa: E402,F401 - the table of these functions
