"""What ONNX gets for the fused torch operators the passes put in the graph (each one's reference math in aten
ops), and for aten ops whose torch decomposition ONNX Runtime runs badly (``slice_backward``).

``fuse_linear_cross_entropy_pass`` replaces an LM head's matmul and cross-entropy by torch's chunked operator,
which runs in torch (the fx side of a segment, inductor as an extern kernel).  ONNX Runtime has no such
operator, so :func:`spmd_ort.backends.ort.decompose.annotate` marks it with the decomposition below, traced for
the node's
shapes, and the segment exports that: the unfused matmuls, the log-softmax and the cross-entropy backward in the
form ORT runs best (``fuse_loss_backward``'s), so an ORT segment computes what it computed before the fusion.
"""

from __future__ import annotations

import torch

from spmd_ort.graph import ops


def linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                         label_smoothing, batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
                         compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad):
    """``(loss, grad_input, grad_linear_weight, grad_linear_bias)`` of ``cross_entropy(input @ W.T + b, target,
    weight)`` for an upstream gradient of 1, as torch's operator computes them: a row's weight is its class's
    (1 without class weights), 0 where its target is ``ignore_index``; ``mean`` divides by the weights' sum."""
    if label_smoothing != 0.0 or reduction not in ("mean", "sum"):
        raise NotImplementedError("linear_cross_entropy is lowered without label smoothing, with reduction "
                                  "'mean' or 'sum'")
    logits = input @ linear_weight.t()
    if linear_bias is not None:
        logits = logits + linear_bias
    logp = torch.log_softmax(logits, 1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype))
    zero = torch.zeros((), dtype=logp.dtype)
    w = valid.to(logp.dtype) if weight is None else torch.where(valid, weight.to(logp.dtype)[safe], zero)
    if reduction == "mean":
        w = w / w.sum()  # no row counting: 0 / 0, NaN, as torch's operator gives
    safe = safe.unsqueeze(1)
    loss = -(torch.gather(logp, 1, safe).squeeze(1) * w).sum()
    w = w.unsqueeze(1)
    # the gradient of the logits: softmax * w, with -w added at the target (one value per row)
    grad = torch.scatter_add(torch.exp(logp) * w, 1, safe, -w)
    empty = input.new_zeros((0, 0))
    grad_input = grad @ linear_weight if compute_input_grad else empty
    grad_weight = grad.t() @ input if compute_linear_weight_grad else empty
    grad_bias = grad.sum(0) if compute_linear_bias_grad else input.new_zeros((0,))
    return loss, grad_input, grad_weight, grad_bias


def slice_backward(grad_output, input_sizes, dim, start, end, step):
    """The gradient of a slice of step 1, padded with zeros to the input's size (one ``Pad``).

    torch's decomposition writes the gradient into ``new_zeros(input_sizes)`` with ``slice_scatter``: in ONNX a
    zero tensor from constant inputs, which ONNX Runtime folds into an initializer of the input's size in each
    session (Llama-3-8B: 64 MiB for each of rotary embedding's four slices a layer), and a ``ScatterND`` with
    transposes around it. Other steps, and a negative start on a symbolic size, keep torch's decomposition."""
    from torch._decomp import decompositions

    rank = len(input_sizes)
    dim = dim % rank
    size = input_sizes[dim]
    if step != 1 or not isinstance(start, int) or (start < 0 and not isinstance(size, int)):
        return decompositions.slice_backward(grad_output, input_sizes, dim, start, end, step)
    if start < 0:
        start = max(start + size, 0)
    if isinstance(size, int):
        start = min(start, size)  # a slice starting past the end: an empty gradient, all zeros
    n = grad_output.shape[dim]
    pads = [0, 0] * (rank - 1 - dim) + [start, size - start - n]  # last dim first, (before, after) each
    return torch.ops.aten.constant_pad_nd.default(grad_output, pads, 0.0)


# op -> its decomposition for ONNX (coverage.decomposition_for consults it with torch's own table, before it):
# the fused ops the passes put in the graph, and aten ops whose torch decomposition ONNX Runtime runs badly
OWN_DECOMPOSITIONS = {torch.ops.aten.slice_backward.default: slice_backward}
if ops.LINEAR_CROSS_ENTROPY is not None:
    OWN_DECOMPOSITIONS[ops.LINEAR_CROSS_ENTROPY] = linear_cross_entropy
