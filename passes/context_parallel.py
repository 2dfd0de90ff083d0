"""Context parallelism: the traced whole-sequence step split along the sequence over the cp ranks.

The step is traced on the whole batch with its sequence dim symbolic (``s``), so every dim of every value that
counts tokens says so in its size (``s``, or ``B*s`` once batch and sequence are flattened).
:func:`split_sequence_pass` rewrites that graph into each rank's share of it, torchtitan's layout: the sequence
is cut into ``2 * cp`` chunks of ``c = s // (2 * cp)`` tokens and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (the causal work balanced), ``2 * c`` tokens in all.

* **The data side stays whole.** What the batch, buffers and constants compute alone (positions from
  ``arange``, rotary tables, a causal mask, the labels shifted) is computed over the whole sequence, as traced,
  on every rank (it is small); where such a value meets the model's parameters, its token dims are cut to the
  rank's tokens (``index_select``).  So positions, masks and shifts follow from the graph without annotation.
* **The activation side is the rank's tokens.** Every op that computes from the parameters runs on the rank's
  rows; size arguments are rebuilt with ``s`` read as the local length.  An op that sums over tokens (a weight's
  gradient ``mm``, a bias's ``sum``, an embedding's or a norm's weight gradient) gives a partial sum, completed
  by an all-reduce over the cp group, so every value without a token dim is exactly the one-process value: the
  optimizer, clipping and the returned loss are unchanged.  A mean loss (``nll_loss``, ``-100`` labels
  included) is summed locally and divided by the all-reduced count of its tokens.
* **Attention** (``F.scaled_dot_product_attention``: the CPU flash kernel) gathers K and V over the group and
  computes the rank's queries against them, exactly: causal attention block by block (the chunk's diagonal block
  causal, the keys before it whole; merged by their log-sum-exp, and the backward of each block reads the merged
  output, as ring attention's does), so each rank does ``1/cp`` of the causal work; with an explicit mask, the
  mask's rows of the rank's queries over every key.  The keys' and values' gradients are reduce-scattered back.

What cannot be split is refused with a :class:`~spmd_ort.errors.CompileError` naming the op: an op that mixes
tokens outside attention (a softmax or cumulative sum over the sequence: attention written by hand; a slice or a
concatenation along it), dropout inside attention, a reduction over tokens that is not a sum.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from spmd_ort.errors import CompileError
from spmd_ort.graph.meta import COMPUTED_INDEX
from spmd_ort.graph.ops import all_gather, all_reduce_, reduce_scatter, wait_
from spmd_ort.graph.symbolic import SizeEmitter
from spmd_ort.graph.slots import SlotKind

from .context import PassResult
from .helpers import ACTIVATION_COLLECTIVE, TAG, aten, placeholders
from .runner import graph_pass

SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
NLL_FORWARD = aten.nll_loss_forward.default
MEAN, SUM = 1, 2  # nll_loss's reduction codes

# ops whose result without the token dims is a sum over the tokens (linear in each token's contribution): the
# rank's partial sum, completed by an all-reduce; ``mean``s are the same with 1/cp (every rank holds 2c tokens)
PARTIAL_SUMS = {aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default, aten.sum.dim_IntList,
                aten.sum.default, aten.embedding_dense_backward.default, aten.native_layer_norm_backward.default,
                *([aten._fused_rms_norm_backward.default] if hasattr(aten, "_fused_rms_norm_backward") else [])}
CARRIED_META = ("custom", "stack_trace", "nn_module_stack")
PARTIAL_MEANS = {aten.mean.dim, aten.mean.default}
# ops that mix positions along their ``dim`` argument (index 1 unless noted): refused along a token dim
# ops whose output, from parts of sums (and scalars), is the part of the same op of the wholes
LINEAR = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
          aten.permute.default, aten.detach.default, aten.clone.default, aten.alias.default, aten.add.Tensor,
          aten.sub.Tensor, aten.neg.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
          aten.expand.default, aten.sum.dim_IntList,
          # a cast of the parts (a MixedPrecisionPolicy's reduce dtype): the parts of the cast, rounded each
          aten._to_copy.default}
# the ops of grouped-query attention's repeat of K and V (repeat_kv, repeat_interleave) and the views around it
REPEAT_CHAIN = {aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten.view.default,
               aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.permute.default,
               aten.slice.Tensor, aten.alias.default}
MIXING = {aten._softmax.default: "a softmax", aten._log_softmax.default: "a log-softmax",
          aten.cumsum.default: "a cumulative sum", aten.cat.default: "a concatenation",
          aten.amax.default: "a maximum", aten.flip.default: "a flip", aten.roll.default: "a roll",
          aten.select.int: "a selection of one position", aten.index_select.default: "an index_select",
          aten.gather.default: "a gather", aten.split.Tensor: "a split", aten.narrow.default: "a narrowing",
          aten.slice.Tensor: "a slice", aten.sort.default: "a sort", aten.topk.default: "a top-k",
          aten.cummax.default: "a cumulative maximum", aten.logcumsumexp.default: "a cumulative log-sum-exp",
          aten._softmax_backward_data.default: "a softmax's backward", aten.scatter.src: "a scatter",
          aten.scatter_add.default: "a scatter"}
# attention kernels other than the CPU one the pass splits: refused (computed on the rank's keys alone they would
# be wrong)
OTHER_ATTENTION = {getattr(aten, n).default for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward") if hasattr(aten, n)}
CONVOLUTIONS = {aten.convolution.default, aten.convolution_backward.default}
MIXING_DIM_ARG = {aten.split.Tensor: 2, aten.roll.default: 2, aten.topk.default: 2,
                  aten._softmax_backward_data.default: 2}


@dataclass(frozen=True)
class ContextParallelSplit(PassResult):
    """What :func:`split_sequence_pass` did: the layout of the sequence and how attention crosses it."""

    size: int
    rank: int
    seq_dim: int
    rank_specific = True  # each rank's graph holds its own chunks: the ranks agree on the collectives
    attentions: int
    causal_blockwise: int
    masked: int
    partial_sums: int
    localized: tuple[str, ...]

    def lines(self) -> list[str]:
        c = 2 * self.size
        return [f"context parallel: the sequence (dim {self.seq_dim} of the batch) in {c} chunks, this rank "
                f"(cp rank {self.rank}) holding chunks {self.rank} and {c - 1 - self.rank}; attention gathers K "
                f"and V over {self.size} ranks ({self.attentions} attention op(s): {self.causal_blockwise} causal "
                f"block by block, {self.masked} with their mask's rows), gradients' key and value parts "
                f"reduce-scattered; {self.partial_sums} sums over tokens completed by an all-reduce; cut to the "
                f"rank's tokens where they meet the parameters: {', '.join(self.localized) or 'nothing'}"]


class _Splitter:
    def __init__(self, gm: fx.GraphModule, ctx, cp):
        self.gm, self.graph, self.ctx = gm, gm.graph, ctx
        self.n, self.r, self.group, self.seq_dim = cp.cp, cp.rank_in_group(ctx.rank), cp.group_name(), cp.seq_dim
        self.chunks = 2 * self.n
        phs = placeholders(gm)
        self.shape_env = None
        self.aliases: dict = {}  # other batch tensors' sequence symbols -> the one (their lengths are checked equal)
        symbols = set()
        for node, slot in zip(phs, ctx.input_slots):
            v = node.meta.get("val")
            if slot.kind is not SlotKind.BATCH or not isinstance(v, torch.Tensor) or v.dim() <= self.seq_dim:
                continue
            size = v.shape[self.seq_dim]
            if isinstance(size, torch.SymInt):
                self.shape_env = size.node.shape_env
                symbols.add(self._expr(size))
        symbols = sorted((s for s in symbols if isinstance(s, sympy.Symbol)), key=str)
        if not symbols:
            raise CompileError(
                f"context parallel splits dim {self.seq_dim} of the batch, but the traced step has no symbolic length "
                "there: the model fixes the sequence length (a size it reads as a number). Fix: a model that reads "
                "the length from the batch (seq_dim= names the dim)")
        # every batch tensor's sequence is one length (checked on every call before the step runs): one symbol
        self.s = symbols[0]
        self.aliases.update({a: self.s for a in symbols[1:]})
        self.derived = self._param_derived(phs)
        self.glob = SizeEmitter.of(gm)
        self.c_expr = _floordiv(self.s, self.chunks)
        tloc = self.glob(2 * self.c_expr)
        if tloc is None:
            raise CompileError(f"context parallel: the sequence length {self.s} is not read from the batch's sizes")
        local_sources = dict(self.glob.sources)
        local_sources[self.s] = (tloc, None, tloc.meta["val"])
        self.loc = SizeEmitter(self.graph, tloc, local_sources)
        self.local: set[fx.Node] = set()
        self.memo: dict = {}
        self.replaced: dict[fx.Node, list] = {}  # a multi-output node rewritten: what its getitems read now
        self.stats = dict(attentions=0, causal=0, masked=0, partial=0)
        self.localized: list[str] = []
        self.partial: dict[fx.Node, float] = {}  # a part of a sum over the ranks' tokens -> its all-reduce's scale
        self.wholes: dict[fx.Node, fx.Node] = {}  # a part -> its whole (all-reduced)
        self.kv_shapes: dict = {}  # a gathered key or value -> the traced (whole-sequence) shape
        self.traced_args: dict = {}  # a REPEAT_CHAIN op -> its (args, kwargs) as traced (whole-sequence sizes)
        self.backward_anchor: fx.Node | None = None  # the last attention backward's end: where the next gathers go
        self.current: fx.Node | None = None  # the node being rewritten: new nodes carry its phase and module

    # ------------------------------------------------------------------ sizes and token dims
    def _expr(self, size):
        expr = size.node.expr
        expr = self.shape_env.replace(expr) if self.shape_env is not None else expr
        return expr.subs(self.aliases) if self.aliases else expr

    def token_dims(self, value) -> list[tuple[int, object]]:
        """(dim, factor) of each token dim of a tensor value: its size is ``factor * s``."""
        if not isinstance(value, torch.Tensor):
            return []
        out = []
        for d, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = self._expr(size)
            if self.s not in expr.free_symbols:
                continue
            factor = sympy.simplify(expr / self.s)
            out.append((d, None if self.s in factor.free_symbols else factor))  # None: not whole sequences
        return out

    def _whole(self, node: fx.Node, dims) -> None:
        odd = [d for d, f in dims if f is None]
        if odd:
            size = node.meta["val"].shape[odd[0]]
            raise CompileError(
                f"context parallel: `{node.name}` ({node.target}){_at(node)} meets the model's parameters with dim "
                f"{odd[0]} of "
                f"size {size}, which is not a whole number of sequences: it cannot be cut to the rank's tokens. "
                "Fix: shift or pad along the sequence on the batch (labels), not on activations",
                op=str(node.target))

    def size_arg(self, value, local: bool):
        """A size as a node argument, ``s`` read as the local length where ``local``; None where the inputs'
        sizes cannot rebuild it."""
        if not isinstance(value, torch.SymInt):
            return value
        try:
            return self._local_size(value) if local else self.glob.size(value)
        except ValueError:
            return None

    def _local_size(self, value):
        expr = self._expr(value)
        if not expr.free_symbols:
            return int(expr)
        made = self.loc(expr)
        if made is None:
            raise ValueError(expr)
        return made

    def _param_derived(self, phs) -> set[fx.Node]:
        kinds = (SlotKind.PARAM, SlotKind.OPT_STATE, SlotKind.GRAD, SlotKind.EXTRA)
        derived = {n for n, slot in zip(phs, self.ctx.input_slots) if slot.kind in kinds}
        for node in self.graph.nodes:
            if node.op == "call_function" and any(a in derived for a in node.all_input_nodes):
                derived.add(node)
        return derived

    # ------------------------------------------------------------------ index tensors (built once, where first needed)
    def _node(self, target, args, kwargs=None):
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        if self.current is not None:
            node.meta.update({k: self.current.meta[k] for k in CARRIED_META if k in self.current.meta})
        return node

    def _arange(self, start_expr, length_expr, device):
        start, end = self.glob(start_expr), self.glob(start_expr + length_expr)
        return self._index(self._node(aten.arange.start, (start, end), {"dtype": torch.int64, "device": device}))

    @staticmethod
    def _index(node: fx.Node) -> fx.Node:
        node.meta[COMPUTED_INDEX] = True  # positions from sizes: in range by construction (no bounds check)
        return node

    def _chunks(self, order, device):
        c = self.c_expr
        return self._node(aten.cat.default, ([self._arange(q * c, c, device) for q in order], 0))

    def positions(self, device):
        """The rank's tokens' positions in the sequence: chunks r and 2cp-1-r."""
        key = ("positions", device)
        if key not in self.memo:
            self.memo[key] = self._index(self._chunks([self.r, self.chunks - 1 - self.r], device))
        return self.memo[key]

    def gathered_order(self, device):
        """The positions of an all-gather's rows (rank-major: each rank's two chunks)."""
        key = ("gathered", device)
        if key not in self.memo:
            order = [q for k in range(self.n) for q in (k, self.chunks - 1 - k)]
            self.memo[key] = self._index(self._chunks(order, device))
        return self.memo[key]

    def natural_order(self, device):
        """For each position, its row in the all-gather (chunk q sits at rank min(q, 2cp-1-q)'s slot)."""
        key = ("natural", device)
        if key not in self.memo:
            c = self.c_expr
            parts = []
            for q in range(self.chunks):
                k, slot = (q, 0) if q < self.n else (self.chunks - 1 - q, 1)
                parts.append(self._arange((2 * k + slot) * c, c, device))
            self.memo[key] = self._index(self._node(aten.cat.default, (parts, 0)))
        return self.memo[key]

    def flat_positions(self, factor, device):
        """Rows of a dim of ``factor * s`` (``factor`` sequences flattened, sequence fastest): the rank's tokens
        of each."""
        key = ("flat", factor, device)
        if key not in self.memo:
            pos = self.positions(device)
            if factor == 1:
                self.memo[key] = pos
            else:
                count = self.glob(factor)
                starts = self._index(self._node(aten.mul.Tensor, (self._index(
                    self._node(aten.arange.default, (count,), {"dtype": torch.int64, "device": device})),
                    self.glob(self.s))))
                grid = self._index(self._node(aten.add.Tensor, (
                    self._index(self._node(aten.unsqueeze.default, (starts, 1))),
                    self._index(self._node(aten.unsqueeze.default, (pos, 0))))))
                self.memo[key] = self._index(self._node(aten.reshape.default, (grid, [-1])))
        return self.memo[key]

    def localize(self, node: fx.Node, dims=None) -> fx.Node:
        """A whole-sequence value cut to the rank's tokens along its token dims (``dims``: only these)."""
        value = node.meta["val"]
        todo = [(d, f) for d, f in self.token_dims(value) if dims is None or d in dims]
        self._whole(node, todo)
        key = ("local", node, tuple(d for d, _ in todo))
        if key in self.memo:
            return self.memo[key]
        out = node
        for d, factor in todo:
            out = self._node(aten.index_select.default, (out, d, self.flat_positions(factor, value.device)))
        if todo:
            self.localized.append(node.name)
        self.memo[key] = out
        return out

    # ------------------------------------------------------------------ the walk
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "output":
                self._parts(node)
            if node.op != "call_function":
                continue
            self.current = node
            if self._parts(node):
                continue
            if node.target is operator.getitem and node.args[0] in self.replaced:
                node.replace_all_uses_with(self.replaced[node.args[0]][node.args[1]])
                self.graph.erase_node(node)
                continue
            value = node.meta.get("val")
            if not isinstance(value, (torch.Tensor, tuple, list)):
                continue  # sizes: rebuilt where read
            if node.target is operator.getitem:
                self._getitem(node)
                continue
            inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            any_local = any(a in self.local for a in inputs)
            outs = list(value) if isinstance(value, (tuple, list)) else [value]
            out_tokens = any(self.token_dims(v) for v in outs if isinstance(v, torch.Tensor))
            if not (any_local or (node in self.derived and out_tokens)):
                self._sizes(node, local=False)
                continue
            with self.graph.inserting_before(node):
                if node.target is SDPA:
                    self._attention(node)
                    continue
                if node.target is SDPA_BACKWARD:
                    self._attention_backward(node)
                    continue
                if node.target is NLL_FORWARD and node.args[3] in (MEAN, SUM):
                    self._nll(node)
                    continue
                self._refuse_mixing(node)
                if node.target in REPEAT_CHAIN:  # (what a gather before GQA's repeat replays, with these sizes)
                    self.traced_args[node] = (node.args, node.kwargs)
                self._localize_inputs(node)
                self._sizes(node, local=True)
            if isinstance(value, torch.Tensor):
                if self.token_dims(value):
                    self._whole(node, self.token_dims(value))
                    self.local.add(node)
                elif any_local:
                    self._complete(node, node)
            else:
                self.local.add(node)  # its getitems decide

    def _getitem(self, node: fx.Node) -> None:
        parent = node.args[0]
        if parent not in self.local:
            return
        if self.token_dims(node.meta["val"]):
            self.local.add(node)
        elif isinstance(node.meta["val"], torch.Tensor):
            self._complete(node, parent)

    def _localize_inputs(self, node: fx.Node) -> None:
        def swap(a):
            if a in self.local or not isinstance(a.meta.get("val"), torch.Tensor) or not self.token_dims(a.meta["val"]):
                return a
            return self.localize(a)
        node.args = fx.map_arg(node.args, swap)
        node.kwargs = fx.map_arg(node.kwargs, swap)

    def _sizes(self, node: fx.Node, local: bool) -> None:
        def swap(a):
            v = a.meta.get("val")
            if not isinstance(v, torch.SymInt):
                return a
            made = self.size_arg(v, local)
            if made is None and local and self.s in self._expr(v).free_symbols:
                raise CompileError(f"context parallel: `{node.name}` ({node.target}) takes the size {v}, which "
                                   "is not computed from the batch's sizes", op=str(node.target))
            return a if made is None else made
        with self.graph.inserting_before(node):
            node.args = fx.map_arg(node.args, swap)
            node.kwargs = fx.map_arg(node.kwargs, swap)

    def _refuse_mixing(self, node: fx.Node) -> None:
        name = getattr(node.target, "__name__", str(node.target))
        if node.target in OTHER_ATTENTION or "attention" in name:
            raise CompileError(
                f"context parallel: `{node.name}` ({node.target}){_at(node)} is an attention kernel that this "
                "release does not split (supported: the CPU kernel of F.scaled_dot_product_attention, which the "
                "fx and ORT backends trace on CPU). Fix: train with cp on CPU ranks, or without cp on this device",
                op=str(node.target), fqn=_module(node))
        if node.target in CONVOLUTIONS:
            value = node.args[0].meta["val"]
            if any(d >= 2 for d, _ in self.token_dims(value)):
                raise CompileError(
                    f"context parallel: `{node.name}` ({node.target}){_at(node)} convolves along the sequence, which "
                    "mixes the tokens that the ranks hold apart. Fix: train this model without cp",
                    op=str(node.target), fqn=_module(node))
            return
        what = MIXING.get(node.target)
        if what is None:
            return
        source = node.args[0][0] if node.target is aten.cat.default else node.args[0]
        if not isinstance(source, fx.Node) or not isinstance(source.meta.get("val"), torch.Tensor):
            return
        pos = MIXING_DIM_ARG.get(node.target, 1)
        dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)
        value = source.meta["val"]
        dims = [dim] if isinstance(dim, int) else list(dim or [])
        dims = [d % value.dim() for d in dims if isinstance(d, int)]
        tokens = {d for d, _ in self.token_dims(value)}
        if not tokens & set(dims):
            return
        if node.target is aten.slice.Tensor and self._whole_slice(node, value):
            return
        raise CompileError(
            f"context parallel: `{node.name}` ({node.target}){_at(node)} is {what} along the sequence, which mixes the "
            f"tokens that the ranks hold apart. Supported: attention through F.scaled_dot_product_attention "
            "(causal or with a mask); ops along the sequence on the batch alone (positions, masks, shifted "
            "labels) before it meets the parameters. Fix: write attention with F.scaled_dot_product_attention, or "
            "train this model without cp", op=str(node.target), fqn=_module(node))

    def _whole_slice(self, node, value) -> bool:
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        size = value.shape[node.args[1]]
        ends = end is None or (isinstance(end, int) and end >= 2**62)
        if isinstance(end, fx.Node):
            ends = isinstance(end.meta.get("val"), torch.SymInt) and self._expr(end.meta["val"]) == self._expr(size)
        return start in (0, None) and step == 1 and ends

    def _complete(self, node: fx.Node, op_node: fx.Node) -> None:
        """``node`` lost its token dims: a sum (or mean) over the rank's tokens, a part of the whole value.  It stays
        a part through linear ops (views, transposes, sums of parts); a gradient's part reaches ``tag_grad``,
        whose all-reduce (the data-parallel passes: bucketed, overlapped with the backward) sums the ranks'
        parts; anything else that reads it gets the whole, all-reduced once (:meth:`_whole_of`)."""
        target = op_node.target
        if target in PARTIAL_SUMS:
            scale = 1.0
        elif target in PARTIAL_MEANS:
            scale = 1.0 / self.n
        else:
            raise CompileError(
                f"context parallel: `{node.name}` ({target}){_at(node)} reduces over the sequence in a way that is "
                "not a sum "
                "of each token's part, so the ranks' parts cannot be combined. Supported reductions over tokens: "
                "sums, means, matmuls, embedding and norm weight gradients, nll_loss / cross_entropy",
                op=str(target), fqn=_module(node))
        self.partial[node] = scale

    def _whole_of(self, node: fx.Node) -> fx.Node:
        """The whole value of a part: its all-reduce over the cp group (one per part, right after it)."""
        if node in self.wholes:
            return self.wholes[node]
        current, self.current = self.current, node
        with self.graph.inserting_after(node):
            copy = self._node(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
        with self.graph.inserting_after(copy):
            started = self._node(all_reduce_, (copy, self.partial[node], self.group))
        with self.graph.inserting_after(started):
            done = self._node(wait_, (started,))
        self.current = current
        self.wholes[node] = done
        self.stats["partial"] += 1
        return done

    def _parts(self, node: fx.Node) -> bool:
        """Before ``node`` runs: the parts it reads.  True where ``node`` itself is a part now (a linear op of
        parts) or takes them as they are (``tag_grad``); else each part it reads is replaced by the whole."""
        parts = [a for a in node.all_input_nodes if a in self.partial]
        if node.op == "call_function" and node.target is TAG:
            # the data-parallel passes average the tagged gradients over every rank: a part times cp, so that the
            # average is over dp of the sums over cp (a whole gradient, the same on each rank of a cp group, as is)
            grad = node.args[0]
            if grad in self.partial:
                with self.graph.inserting_before(node):
                    if self.partial[grad] == 1.0:
                        node.replace_input_with(grad, self._node(aten.mul.Tensor, (grad, float(self.n))))
                    else:
                        node.replace_input_with(grad, self._whole_of(grad))
            return True
        if not parts:
            return False
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        scales = {self.partial[a] for a in parts}
        operands = node.args[:2] if node.target in (aten.add.Tensor, aten.sub.Tensor) else node.args[:1]
        if (node.op == "call_function" and node.target in LINEAR and len(scales) == 1 and len(parts) == len(tensors)
                and all(isinstance(a, fx.Node) for a in operands)):  # (a part plus a number is no part)
            self.partial[node] = scales.pop()
            return True
        for a in parts:
            node.replace_input_with(a, self._whole_of(a))
        return False

    # ------------------------------------------------------------------ the loss
    def _nll(self, node: fx.Node) -> None:
        logp, target, weight, reduction, ignore = node.args
        logp = logp if logp in self.local else self.localize(logp)
        target = target if target in self.local else self.localize(target)
        summed = self._node(NLL_FORWARD, (logp, target, weight, SUM, ignore))
        parts = []
        for i in range(2):
            part = self._node(operator.getitem, (summed, i))
            started = self._node(all_reduce_, (self._node(aten.clone.default, (part,)), 1.0, self.group))
            parts.append(self._node(wait_, (started,)))
        total, count = parts
        out = self._node(aten.div.Tensor, (total, count)) if reduction == MEAN else total
        self.replaced[node] = [out, count]
        self.stats["partial"] += 2

    # ------------------------------------------------------------------ attention
    def _gathered(self, node: fx.Node, phase: str) -> fx.Node:
        """K or V (B, H, 2c, D) of every rank, in the sequence's order (B, H, s, D): gathered in the forward, and
        again in the backward (the other ranks' keys and values are not kept between them: 1/cp of the memory).
        Grouped-query attention's repeat of K and V (``repeat_kv``: unsqueeze, expand, reshape) is gathered before
        the repeat and replayed on the whole sequence: the gather moves the KV heads only."""
        key = ("kv", node, phase)
        if key in self.memo:
            return self.memo[key]
        source, chain = self._before_repeat(node)
        value = source.meta["val"]
        dim = self.token_dims(value)[0][0]
        local = [self.size_arg(x, True) for x in value.shape]
        # the backward's gather is issued one layer ahead, after the previous attention's backward (prefetch)
        anchor = self.backward_anchor if phase == "backward" else None
        with self.graph.inserting_after(anchor) if anchor is not None else contextlib.nullcontext():
            flat = self._node(aten.clone.default, (source,), {"memory_format": torch.contiguous_format})
        with self.graph.inserting_after(flat) if anchor is not None else contextlib.nullcontext():
            started = self._node(all_gather, (flat, self.n, -1, self.group))
        started.meta[ACTIVATION_COLLECTIVE] = True  # issued before the compute that does not need it
        if anchor is not None:
            self.backward_anchor = started
        rows = self._node(aten.view.default, (self._node(wait_, (started,)), [self.n, *local]))
        order = list(range(1, len(local) + 1))
        order.insert(dim, 0)  # the ranks' rows next to the sequence dim, rank-major
        whole = [self.size_arg(x, False) for x in value.shape]
        seq = self._node(aten.reshape.default, (self._node(aten.permute.default, (rows, order)), whole))
        out = self._node(aten.index_select.default, (seq, dim, self.natural_order(value.device)))
        for step in chain:  # the repeat, on the whole sequence (its sizes read as traced)
            args = fx.map_arg(self.traced_args[step][0], self._whole_size)
            out = self._node(step.target, (out, *args[1:]), fx.map_arg(self.traced_args[step][1], self._whole_size))
        self.memo[key] = out
        self.kv_shapes[out] = node.meta["val"].shape
        return out

    def _whole_size(self, a: fx.Node):
        v = a.meta.get("val")
        made = self.size_arg(v, False) if isinstance(v, torch.SymInt) else None
        return a if made is None else made

    def _before_repeat(self, node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
        """The smallest value on the chain of :data:`REPEAT_CHAIN` ops that makes ``node`` (one token dim, whole
        sequences), and the chain's ops from it to ``node``; ``node`` and no ops where nothing on it is smaller."""
        import math

        def per_token(n):
            return math.prod(int(x) if not isinstance(x, torch.SymInt) else 1 for x in n.meta["val"].shape)

        best, chain, cur, seen = node, [], node, []
        while cur.op == "call_function" and cur.target in REPEAT_CHAIN and cur in self.traced_args:
            src = cur.args[0]
            seen.insert(0, cur)
            if not isinstance(src, fx.Node) or src not in self.local:
                break
            dims = self.token_dims(src.meta["val"])
            if len(dims) == 1 and dims[0][1] == 1 and per_token(src) < per_token(best):
                best, chain = src, list(seen)
            cur = src
        return best, chain

    def _tloc(self):
        return self.loc(self.s)

    def _attention_args(self, node: fx.Node, first: int):
        dropout = node.args[first] if len(node.args) > first else node.kwargs.get("dropout_p", 0.0)
        causal = node.args[first + 1] if len(node.args) > first + 1 else node.kwargs.get("is_causal", False)
        mask, scale = node.kwargs.get("attn_mask"), node.kwargs.get("scale")
        if dropout:
            raise CompileError(f"context parallel: attention `{node.name}`{_at(node)} has dropout_p={dropout}; dropout "
                               "inside "
                               "attention cannot be split over the ranks' keys. Fix: attention dropout 0 (as "
                               "pretraining runs use)", op=str(node.target), fqn=_module(node))
        return causal, mask, scale

    def _block(self, tensor, start_expr, length_expr, dim=2):
        return self._node(aten.slice.Tensor, (tensor, dim, self.glob(start_expr), self.glob(start_expr + length_expr)))

    def _mask_rows(self, mask: fx.Node, chunk: int):
        """The mask's rows of chunk ``chunk``'s queries (natural order), every key."""
        c = self.c_expr
        return self._block(mask, chunk * c, c, dim=mask.meta["val"].dim() - 2)

    def _chunks_of_rank(self):
        return [(0, self.r), (1, self.chunks - 1 - self.r)]

    def _attention(self, node: fx.Node) -> None:
        q, k, v = node.args[:3]
        causal, mask, scale = self._attention_args(node, 3)
        q = q if q in self.local else self.localize(q)
        kf, vf = (self._gathered(t if t in self.local else self.localize(t), "forward") for t in (k, v))
        c = self.c_expr
        outs, lses = [], []
        for slot, chunk in self._chunks_of_rank():
            qj = self._block(q, slot * c, c)
            if mask is not None or not causal:  # every key
                extra = {"attn_mask": self._mask_rows(mask, chunk)} if mask is not None else {}
                res = self._node(SDPA, (qj, kf, vf, 0.0, False), {"scale": scale, **extra})
                o, lse = (self._node(operator.getitem, (res, i)) for i in range(2))
            else:
                diag = self._node(SDPA, (qj, self._block(kf, chunk * c, c), self._block(vf, chunk * c, c), 0.0, True),
                                  {"scale": scale})
                o, lse = (self._node(operator.getitem, (diag, i)) for i in range(2))
                if chunk > 0:
                    prev = self._node(SDPA, (qj, self._block(kf, 0, chunk * c), self._block(vf, 0, chunk * c), 0.0,
                                             False), {"scale": scale})
                    o, lse = self._merge(o, lse, *(self._node(operator.getitem, (prev, i)) for i in range(2)))
            outs.append(o)
            lses.append(lse)
        out = self._kernel_layout(self._node(aten.cat.default, (outs, 2)))
        lse = self._node(aten.cat.default, (lses, 2))
        self.local.update({out, lse})
        self.replaced[node] = [out, lse]
        self.stats["attentions"] += 1
        self.stats["causal" if causal and mask is None else "masked"] += 1

    def _zeros(self, like: fx.Node, full: fx.Node, length_expr) -> fx.Node:
        """Zeros shaped as ``full`` (B, H, s, D) but ``length_expr`` long in dim 2, of ``like``'s dtype."""
        b, h, _, d = (self.size_arg(x, True) for x in self.kv_shapes[full])
        return self._node(aten.new_zeros.default, (like, [b, h, self.glob(length_expr), d]))

    def _add(self, a: fx.Node, b: fx.Node) -> fx.Node:
        return self._node(aten.add.Tensor, (a, b))

    def _kernel_layout(self, t: fx.Node) -> fx.Node:
        """(B, H, L, D) laid out as the attention kernels lay theirs out, (B, L, H, D) in memory: the views the
        model takes of them (the heads merged back) need it."""
        swapped = self._node(aten.clone.default, (self._node(aten.transpose.int, (t, 1, 2)),),
                             {"memory_format": torch.contiguous_format})
        return self._node(aten.transpose.int, (swapped, 1, 2))

    def _merge(self, o1, l1, o2, l2):
        """Two attentions of the same queries over disjoint keys, as one (by their log-sum-exp)."""
        lse = self._node(aten.logaddexp.default, (l1, l2))
        w1, w2 = (self._node(aten.unsqueeze.default, (
            self._node(aten.exp.default, (self._node(aten.sub.Tensor, (part, lse)),)), -1)) for part in (l1, l2))
        dtype = self.current.args[0].meta["val"].dtype  # the queries'
        a = self._node(aten.mul.Tensor, (o1, w1))
        b = self._node(aten.mul.Tensor, (o2, w2))
        out = self._node(aten.add.Tensor, (a, b))
        if dtype is not None and dtype != torch.float32:
            out = self._node(aten._to_copy.default, (out,), {"dtype": dtype})
        return out, lse

    def _attention_backward(self, node: fx.Node) -> None:
        grad, q, k, v, out, lse = node.args[:6]
        causal, mask, scale = self._attention_args(node, 6)
        grad, q, out, lse = (a if a in self.local else self.localize(a) for a in (grad, q, out, lse))
        kf, vf = (self._gathered(t if t in self.local else self.localize(t), "backward") for t in (k, v))
        c, s = self.c_expr, self.s
        dqs, dks, dvs = [], [], []

        def backward(gj, qj, oj, lj, kb, vb, is_causal, extra):
            res = self._node(SDPA_BACKWARD, (gj, qj, kb, vb, oj, lj, 0.0, is_causal), {"scale": scale, **extra})
            return [self._node(operator.getitem, (res, i)) for i in range(3)]

        for slot, chunk in self._chunks_of_rank():
            gj, qj, oj = (self._block(t, slot * c, c) for t in (grad, q, out))
            lj = self._block(lse, slot * c, c)
            if mask is not None or not causal:  # every key
                extra = {"attn_mask": self._mask_rows(mask, chunk)} if mask is not None else {}
                dq, dk, dv = backward(gj, qj, oj, lj, kf, vf, False, extra)
            else:  # keys [0, (chunk + 1) c): the diagonal block causal, those before it whole
                dq, dk, dv = backward(gj, qj, oj, lj, self._block(kf, chunk * c, c), self._block(vf, chunk * c, c),
                                      True, {})
                if chunk > 0:
                    dq_p, dk_p, dv_p = backward(gj, qj, oj, lj, self._block(kf, 0, chunk * c),
                                                self._block(vf, 0, chunk * c), False, {})
                    dq = self._node(aten.add.Tensor, (dq, dq_p))
                    dk, dv = (self._node(aten.cat.default, ([p, d], 2)) for p, d in ((dk_p, dk), (dv_p, dv)))
                rest = s - (chunk + 1) * c
                dk, dv = (self._node(aten.cat.default, ([g, self._zeros(g, kf, rest)], 2)) for g in (dk, dv))
            dqs.append(dq)
            dks.append(dk)
            dvs.append(dv)
        dq = self._kernel_layout(self._node(aten.cat.default, (dqs, 2)))
        dk, dv = (self._kernel_layout(self._scatter(functools.reduce(self._add, grads), k)) for grads in (dks, dvs))
        self.backward_anchor = dv
        self.local.update({dq, dk, dv})
        self.replaced[node] = [dq, dk, dv]

    def _scatter(self, full: fx.Node, like: fx.Node) -> fx.Node:
        """A gradient over every key (B, H, s, D), summed over the ranks, each rank keeping its tokens' rows."""
        value = like.meta["val"]
        b, h, _, d = (self.size_arg(x, True) for x in value.shape)
        rows = self._node(aten.index_select.default, (full, 2, self.gathered_order(value.device)))
        split = self._node(aten.view.default, (rows, [b, h, self.n, self._tloc(), d]))
        ranked = self._node(aten.clone.default, (self._node(aten.permute.default, (split, [2, 0, 1, 3, 4])),),
                            {"memory_format": torch.contiguous_format})
        started = self._node(reduce_scatter, (ranked, self.n, self.group, False))
        return self._node(aten.view.default, (self._node(wait_, (started,)), [b, h, self._tloc(), d]))


def _module(node: fx.Node) -> str | None:
    """The FQN of the module whose forward (or backward) ran the op, where the trace tagged it."""
    return node.meta.get("custom", {}).get("module")


def _at(node: fx.Node) -> str:
    fqn = _module(node)
    return f" in module `{fqn}`" if fqn else ""


def _floordiv(expr, n: int):
    from torch.utils._sympy.functions import FloorDiv

    return FloorDiv(expr, sympy.Integer(n))


@graph_pass()
def split_sequence_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The whole-sequence step as this rank's share of the sequence (see the module)."""
    cp = ctx.mode
    splitter = _Splitter(gm, ctx, cp)
    splitter.run()
    for node in reversed(list(gm.graph.nodes)):  # what the rewrite left unread: replaced ops, the old sizes
        if node.op == "call_function" and not node.users and (
                node in splitter.replaced or not isinstance(node.meta.get("val"), torch.Tensor)
                and (node.target is aten.sym_size.int or getattr(node.target, "__module__", None) == "_operator")):
            gm.graph.erase_node(node)
    _refresh_values(gm)
    gm.recompile()
    ctx.results.record(ContextParallelSplit(
        size=splitter.n, rank=splitter.r, seq_dim=splitter.seq_dim, attentions=splitter.stats["attentions"],
        causal_blockwise=splitter.stats["causal"], masked=splitter.stats["masked"],
        partial_sums=splitter.stats["partial"], localized=tuple(splitter.localized)))
    return gm


def _refresh_values(gm: fx.GraphModule) -> None:
    """Every node's ``meta["val"]`` again from the inputs' (the rank's shapes), under the trace's fake mode."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from .helpers import fake_mode_of

    mode = fake_mode_of(gm)
    inputs = [n.meta["val"] for n in placeholders(gm)]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
