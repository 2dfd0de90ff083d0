"""Selective activation recomputation: which forward values the backward keeps, which it recomputes.

The whole step is one graph, so the values autograd saved for backward are plain edges: a forward node read
by a backward node (``phase(node) == "backward"``).  Eager keeps every one of them from the forward until its
backward use; :func:`recompute_activations_pass` keeps some and recomputes the others, just before their first
backward use, from values the backward holds anyway.  ``compile(activation_memory_budget=B)`` (torch's name
for the knob) sets how much: the bytes of the recomputable saved values the backward may keep, as a fraction
(1.0: what eager keeps, the pass does nothing; 0.0: everything that can be recomputed is).

What is kept, whatever the budget:

* the forward's *spine*: a value that is the only forward value live at its point (a residual stream between
  blocks).  Recomputation starts from it, so each recomputed stretch is one segment of the forward, recomputed
  once; without it, the backward of the last block would recompute the whole forward and hold it again;
* what cannot be recomputed: outputs of random ops (the dropout masks: kept, so every budget draws the same
  numbers, in the same order, and results are bitwise equal across budgets on fx; their bits packed, see
  :func:`narrow_masks`), opaque parts, collectives, host and other non-aten nodes, mutating ops;
* a value recomputing which would need more bytes of such outputs kept than it frees.

Among the rest, a 0/1 knapsack (torch's ``greedy_knapsack``, as its min-cut partitioner uses under
``activation_memory_budget``) keeps the values with the most recompute time per byte: a value's recompute time
is the cost of the forward nodes between it and the values kept around it (FLOPs of matmuls and convolutions,
torch's FLOP formulas; bytes read; bytes written, each a fresh allocation that page-faults, several times a read;
and elements converted between bool and float: :func:`recompute_cost`), so matmul outputs are the last to be
recomputed, and a
dropout mask's scaled values, unpacked and widened, come after plain elementwise outputs.  A user's own
``torch.utils.checkpoint`` already recomputes in the backward: its recomputation is backward nodes, which this
pass never touches, and the values it discarded are no saved values here.

Two named settings checkpoint every *block* (a module that is an element of a ``ModuleList``/``Sequential``,
such as ``model.layers.3``: :func:`block_of`) as torchtitan's activation checkpointing does, so a plan can be made
of the configuration a published run used, and a run can use it:

* ``"full"``: each block keeps only its input; everything else it saved is recomputed in the backward (torchtitan's
  ``mode="full"``, ``torch.utils.checkpoint`` around every block);
* ``"selective"``: torchtitan's op-level policy: inside each block the outputs of attention kernels, of every other
  matmul (the 1st, 3rd, ... in forward order, counted per block) and of ``max`` are kept, everything else is
  recomputed from them.

Values outside every block (embeddings, the final norm, the head and the loss) are kept, as there; random outputs
and what cannot be recomputed are kept, as at any budget.  Under both, an activation's all-gather (sequence
parallelism's gathered block input), and under ``"full"`` its reduce-scatter too, is recomputed, run again in the
backward as torchtitan's checkpoint does: every rank runs the same graph, so the copies pair on every rank; a copy
is never merged with the forward's (its own ``dedup_key``), and an all-gather's is not issued early (no
``activation_collective`` mark; a reduce-scatter moves up to just after its inputs, themselves recomputed).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch._functorch._activation_checkpointing.knapsack import greedy_knapsack

from spmd_ort.graph.slots import SlotKind
from spmd_ort.graph import ops
from spmd_ort.graph.aliasing import aliases_input
from spmd_ort.graph.meta import ACTIVATION_COLLECTIVE, DEDUP_KEY
from spmd_ort.graph.flops import ATTENTION_FORWARD, argument, hint as _hint, node_flops
from spmd_ort.graph.liveness import value_bytes

from .context import PassResult
from .contracts import FUNCTIONAL_ATEN, VALUES_KNOWN
from .helpers import fake_mode_of, is_random, phase, set_phase
from .runner import graph_pass
from spmd_ort.options import CHECKPOINT_POLICIES as POLICIES, get_logger

logger = get_logger(__name__)

RECOMPUTED = "recomputed"  # node.meta key of a recomputed copy: the name of the forward node it recomputes
NARROWED_MASK = "narrowed_mask"  # node.meta key of a dropout mask's bool copy (kept): the mask's node name
# Recompute costs in FLOP-equivalents (matmuls here run at ~30-60 GFLOP/s: 1 FLOP-eq. ~ 0.02 ns), measured on a
# 2-core EPYC with freed memory returned to the system, where every recomputed value is fresh memory:
READ_COST = 5.0  # per byte read (~10 GB/s)
WRITE_COST = 25.0  # per byte written: fresh pages faulted in, later unmapped (~0.4 ms/MiB; the arithmetic ~0.04)
CAST_COST = 75.0  # per element an op widens from a 1-byte dtype or narrows to one (bool -> float: ~1.2 ns more)
NAMESPACES = ("aten", "prims")


@dataclass(frozen=True)
class Recomputation(PassResult):
    """``recompute_activations_pass``: the budget, the saved bytes kept and recomputed, and each decision."""

    budget: float | str  # a share from 0 to 1, or a policy name (POLICIES)
    kept_bytes: int  # saved-for-backward bytes still kept (spine, random outputs, what the budget keeps)
    recomputed_bytes: int  # saved-for-backward bytes the backward recomputes instead
    copies: int  # nodes the backward recomputes
    narrowed_masks: int = 0  # dropout masks kept compact (packed bits or bool) instead of their float values
    recomputed: tuple[str, ...] = ()  # `name` (op, size): why
    kept: tuple[str, ...] = ()  # `name` (op, size): why

    def lines(self) -> list[str]:
        if not isinstance(self.budget, str) and self.budget >= 1.0:
            return []
        mib = 2**20
        setting = repr(self.budget) if isinstance(self.budget, str) else f"{self.budget:g}"
        out = [(f"activation memory (activation_memory_budget={setting}): the backward recomputes "
                f"{len(self.recomputed)} saved value(s), {self.recomputed_bytes / mib:.2f} MiB ({self.copies} nodes "
                f"recomputed), and keeps {self.kept_bytes / mib:.2f} MiB"
                + (f"; {self.narrowed_masks} dropout mask(s) kept compact (bits packed, or bool)"
                   if self.narrowed_masks else ""))]
        out += [f"  recomputed {r}" for r in self.recomputed]
        out += [f"  kept {k}" for k in self.kept]
        return out


@graph_pass(requires=[VALUES_KNOWN, FUNCTIONAL_ATEN])
def recompute_activations_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Recompute forward values the backward reads instead of keeping them, under
    ``ctx.activation_memory_budget`` (a :class:`Recomputation`); a no-op at 1.0.

    Each recomputed value is a copy of the forward nodes between it and kept values, placed just before the
    first backward node that reads it and marked a backward node (``meta["recomputed"]`` names the original):
    later passes treat it as the backward's own (under ``fully_shard`` it reads the backward's gathered
    parameters), and the executor frees the forward's original after its last forward use.
    """
    budget = ctx.activation_memory_budget
    if not isinstance(budget, str) and budget >= 1.0:
        return gm
    batch = {n for n, s in zip(gm.graph.find_nodes(op="placeholder"), ctx.input_slots)
             if s.kind in (SlotKind.BATCH, SlotKind.INPUT_GRAD)}
    masks = narrow_masks(gm)
    plan = _plan(gm, budget, batch)
    copies = _rewrite(gm, plan)
    narrowed = _restore_forward_reads(gm.graph, masks)
    ctx.results.record(plan.result(budget, copies, narrowed))
    logger.info("activation memory budget %s: %d saved value(s) recomputed (%.2f MiB), %d kept (%.2f MiB)", budget,
                len(plan.dropped), plan.dropped_bytes / 2**20, len(plan.kept), plan.kept_bytes / 2**20)
    return gm


# ---------------------------------------------------------------------- the graph's forward and backward
def _is_backward(node: fx.Node) -> bool:
    return phase(node) == "backward"


def _is_tensor_value(node: fx.Node) -> bool:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and bool(v) and all(isinstance(x, torch.Tensor) for x in v)


def _is_view(node: fx.Node) -> bool:
    """Whether ``node``'s output shares its first input's storage (views, ``_unsafe_view``; getitem of a list of
    views): recomputing it costs nothing and frees nothing."""
    return aliases_input(node)


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose output holds ``node``'s storage (itself, unless it is a view)."""
    while _is_view(node):
        node = node.args[0]
    return node


def recomputable(node: fx.Node, extra_ops: tuple = ()) -> bool:
    """Whether a forward node may run again in the backward and give the same values: a functional aten/prims op
    that draws no random numbers (or a getitem of one); never a host node, opaque part or tap; a collective (and the
    ``wait_`` of one) or an attention kernel without dropout only if its op is among ``extra_ops`` (the named
    policies' :data:`RECOMPUTED_UNDER`: run again in the backward as torchtitan's checkpoint does, every rank at
    the same point of the same graph)."""
    if node.op != "call_function" or _is_backward(node) or NARROWED_MASK in node.meta:
        return False
    if node.target is operator.getitem:
        return _is_tensor_value(node) and isinstance(node.args[0], fx.Node) and recomputable(node.args[0], extra_ops)
    if getattr(node.target, "overloadpacket", None) in extra_ops:  # an attention kernel (its results may hold
        return not argument(node, "dropout_p", 0.0)  # sizes and seeds besides tensors, as CUDA's flash's do)
    if not _is_tensor_value(node):
        return False
    if node.target in extra_ops or (node.target is ops.wait_ and isinstance(node.args[0], fx.Node)
                                    and node.args[0].target in extra_ops):
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in NAMESPACES:
        return False
    if target._schema.is_mutable or is_random(node) or ops.RANDOM in target.tags:
        return False
    return torch.Tag.nondeterministic_bitwise not in target.tags


def recompute_cost(node: fx.Node) -> float:
    """What running ``node`` again costs, in FLOP-equivalents: its matmul/convolution FLOPs (torch's formulas),
    the bytes it reads, the bytes it writes (fresh memory: several times a read) and, for an op converting
    between a 1-byte dtype and a wider one (scaling a bool dropout mask), each element converted (views cost
    nothing).  Measured in the bench's GPT step (bench/memory.py): recomputed ``gelu`` and layer norms take
    ~0.33 ms per MiB, nearly all of it fresh memory, ``bool_mask / (1 - p)`` 0.63, and a dropout mask's scaled
    values recomputed from its packed bits 0.92 per MiB saved."""
    if node.op != "call_function" or _is_view(node) or node.target is operator.getitem:
        return 0.0
    flops = node_flops(node)
    out = node.meta.get("val")
    read = sum(value_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return float(flops) + READ_COST * read + WRITE_COST * value_bytes(out) + CAST_COST * _converted(node, out)


def _converted(node: fx.Node, out) -> int:
    """Elements ``node`` converts between a 1-byte dtype (bool, uint8, int8) and a wider one, or 0: such loops run
    element by element (a uint8 -> bool compare or a float op does not)."""
    if not isinstance(out, torch.Tensor):
        return 0
    sizes = {out.dtype.itemsize} | {a.meta["val"].dtype.itemsize for a in node.all_input_nodes
                                    if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].numel() > 1}
    return _hint(out.numel()) if 1 in sizes and len(sizes) > 1 else 0


aten = torch.ops.aten
SCALINGS = (aten.div.Scalar, aten.mul.Scalar)  # dropout's scaling of its mask


def narrow_masks(gm: fx.GraphModule) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Keep dropout masks for the backward in few bytes: each ``bernoulli_like`` mask (exactly 0.0 or 1.0) that
    the backward reads, directly or through one op, gets a compact copy that stays (``meta["narrowed_mask"]``):
    its bits packed eight to a byte (1/32 of a float32 mask) when its size is static, a multiple of 8 and it is
    contiguous, else a bool copy (1/4).  The backward recomputes the bool mask from it; dropout's scaling
    (``mask / (1 - p)``) reads the bool mask itself (bool / scalar computes in the mask's dtype: the same values
    bit for bit), any other reader a cast back.

    Returns ``(mask, nodes made for it)`` per mask, for :func:`_restore_forward_reads` after the rewrite.
    """
    graph, fake_mode, out = gm.graph, fake_mode_of(gm), []
    for mask in list(graph.find_nodes(op="call_function", target=ops.bernoulli_like)):
        v = mask.meta.get("val")
        if not (is_random(mask) and isinstance(v, torch.Tensor) and v.dtype.is_floating_point) or _is_backward(mask):
            continue
        if not any(_is_backward(u) or any(_is_backward(w) for w in u.users) for u in mask.users):
            continue  # the backward reads nothing made from it: nothing kept, nothing to narrow
        users = list(mask.users)
        made: list[fx.Node] = []

        def call(target, *args, made=made, mask=mask, **kwargs):
            node = graph.call_function(target, args, kwargs)
            node.meta["custom"] = dict(mask.meta.get("custom", {}))
            node.meta["val"] = _value(target, args, kwargs, fake_mode)
            made.append(node)
            return node

        with graph.inserting_before(mask.next):  # in the order they are made, right after the mask
            bool_mask = _packed_bool_mask(mask, call) if _packable(v) else None
            if bool_mask is None:
                bool_mask = call(aten._to_copy.default, mask, dtype=torch.bool)
                bool_mask.meta[NARROWED_MASK] = mask.name
            wide = None
            for user in users:
                if user.target in SCALINGS and user.args[0] is mask and not isinstance(user.args[1], fx.Node) \
                        and torch.result_type(bool_mask.meta["val"], user.args[1]) == user.meta["val"].dtype:
                    user.replace_input_with(mask, bool_mask)
                    continue
                if wide is None:
                    wide = call(aten._to_copy.default, bool_mask, dtype=v.dtype)
                user.replace_input_with(mask, wide)
        out.append((mask, made))
    return out


def _packable(v: torch.Tensor) -> bool:
    return v.dtype == torch.float32 and all(isinstance(n, int) for n in v.shape) and v.numel() % 8 == 0 \
        and v.numel() > 0 and v.is_contiguous()


def _packed_bool_mask(mask: fx.Node, call) -> fx.Node:
    """``mask``'s bits packed into bytes (the kept node), and the bool mask unpacked from them (recomputable).

    Packing is a matmul of each run of 8 mask values (0.0 or 1.0) with the powers of two, exact in float32 in any
    summation order, cast to uint8; unpacking ANDs each byte with the powers of two.  Every op has an ONNX
    translation (a ReduceSum or BitShift over uint8 would not).
    """
    v = mask.meta["val"]
    n = v.numel()
    powers = call(aten.pow.Scalar, 2.0, call(aten.arange.start, 0, 8, dtype=torch.float32, device=v.device))
    runs = call(aten.view.default, mask, [n // 8, 8])
    sums = call(aten.mm.default, runs, call(aten.view.default, powers, [8, 1]))  # (n/8, 1): exact small integers
    packed = call(aten._to_copy.default, call(aten.view.default, sums, [n // 8]), dtype=torch.uint8)
    packed.meta[NARROWED_MASK] = mask.name
    bits = call(aten.bitwise_and.Tensor, call(aten.unsqueeze.default, packed, 1),
                call(aten._to_copy.default, powers, dtype=torch.uint8))
    return call(aten.view.default, call(aten.ne.Scalar, bits, 0), list(v.shape))


def _value(target, args, kwargs, fake_mode):
    args, kwargs = fx.map_arg((args, kwargs), lambda n: n.meta["val"])
    if fake_mode is None:  # a graph built by hand: plain tensors as values
        return target(*args, **kwargs)
    with fake_mode:
        return target(*args, **kwargs)


def _restore_forward_reads(graph: fx.Graph, masks: list[tuple[fx.Node, list[fx.Node]]]) -> int:
    """The forward reads each mask itself again where it read it unpacked or cast (only the backward's copies need
    those); nodes nothing reads any more are removed.  Returns how many masks stay compact for the backward."""
    kept = 0
    for mask, made in masks:
        for node in made:
            if node.meta["val"].shape == mask.meta["val"].shape:
                for user in [u for u in node.users if not _is_backward(u) and u not in made]:
                    user.replace_input_with(node, mask)  # the float mask (the scaling of its 0/1 values: the same)
        left = []
        for node in reversed(made):
            if node.users:
                left.append(node)
            else:
                graph.erase_node(node)
        kept += any(NARROWED_MASK in n.meta for n in left)
    return kept


def spine(forward: list[fx.Node], position: dict[fx.Node, int], batch: set[fx.Node]) -> set[fx.Node]:
    """Forward values that are the only forward value live at their point (counted by forward uses; values made
    without the ``batch`` placeholders' values, from the step's state and sizes alone, such as a weight's transpose,
    a causal mask or the positions of a rank's tokens (context parallel), are left out)."""
    state_only: dict[fx.Node, bool] = {}
    for node in forward:
        state_only[node] = all(not _is_tensor_value(a) or (a.op in ("placeholder", "get_attr") and a not in batch)
                               or state_only.get(a, False) for a in node.all_input_nodes)
    last: dict[fx.Node, int] = {}
    for node in forward:
        if state_only[node] or not _is_tensor_value(node):
            continue
        uses = [position[u] for u in node.users if u in state_only]  # forward users
        if uses and max(uses) > position[node]:
            last[node] = max(uses)
    ends: dict[int, int] = {}
    for i in last.values():
        ends[i] = ends.get(i, 0) + 1
    out, live = set(), 0
    for node in forward:
        i = position[node]
        live += node in last
        live -= ends.get(i, 0)
        if live == 1 and node in last:
            out.add(node)
    return out


# ---------------------------------------------------------------------- the plan
@dataclass
class _Plan:
    dropped: dict[fx.Node, str]  # storage roots recomputed -> why
    kept: dict[fx.Node, str]  # storage roots kept -> why
    forward: set[fx.Node]
    dropped_bytes: int = 0
    kept_bytes: int = 0
    extra_ops: tuple = ()  # what the named policies recompute beyond any budget (RECOMPUTED_UNDER)

    def available(self, node: fx.Node) -> bool:
        """Whether the backward may read ``node`` itself (not a recomputed copy)."""
        if node not in self.forward or not recomputable(node, self.extra_ops):
            return True  # the backward's own, not a tensor, or kept because it cannot be recomputed
        if not _is_tensor_value(node):  # an attention kernel's results (tensors, sizes, seeds): where one of its
            return not any(u in self.dropped for u in node.users)  # tensors is recomputed, the kernel runs again
        root = storage_root(node)
        if root in self.dropped:
            return False
        return root in self.kept or root not in self.forward  # a kept value or a view of one; of a graph input

    def result(self, budget: float, copies: int, narrowed: int) -> Recomputation:
        return Recomputation(budget=budget, kept_bytes=self.kept_bytes, recomputed_bytes=self.dropped_bytes,
                             copies=copies, narrowed_masks=narrowed,
                             recomputed=tuple(f"{_label(n)}: {why}" for n, why in self.dropped.items()),
                             kept=tuple(f"{_label(n)}: {why}" for n, why in self.kept.items()))


def _why_not(node: fx.Node) -> str:
    if NARROWED_MASK in node.meta:
        how = "as bool" if node.meta["val"].dtype == torch.bool else "with its bits packed eight to a byte"
        return f"the dropout mask `{node.meta[NARROWED_MASK]}` {how}: kept so that masks replay exactly"
    if is_random(node) or (node.target is operator.getitem and is_random(node.args[0])):
        return "a random op's output: kept so that masks replay exactly"
    return str(node.target)


def _label(node: fx.Node) -> str:
    v = node.meta.get("val")
    shape = tuple(_hint(s) for s in v.shape) if isinstance(v, torch.Tensor) else ()
    return f"`{node.name}` ({getattr(node.target, '__name__', node.target)}, {shape}, " \
           f"{value_bytes(v) / 2**20:.2f} MiB)"


def _plan(gm: fx.GraphModule, budget: float | str, batch: set[fx.Node]) -> _Plan:
    """Which storage roots of the saved values are kept and which recomputed, and why."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    backward = [n for n in nodes if n.op == "call_function" and _is_backward(n)]
    if not backward:
        return _Plan({}, {}, set())
    last_backward = position[backward[-1]]
    forward = [n for n in nodes if n.op == "call_function" and not _is_backward(n) and position[n] < last_backward]
    in_forward = set(forward)
    saved = [n for n in forward if _is_tensor_value(n) and any(_is_backward(u) for u in n.users)]
    roots = [r for r in dict.fromkeys(storage_root(n) for n in saved) if r in in_forward]
    # a value also read after the backward (an output, the optimizer) stays alive anyway: nothing to gain
    read_after = {storage_root(n) for n in forward
                  if any(not _is_backward(u) and position[u] > last_backward for u in n.users)}
    on_spine = spine(forward, position, batch)
    policy = budget if isinstance(budget, str) else None
    blocks = {n: block_of(n) for n in forward} if policy else {}
    if policy:  # a checkpointed block keeps its input alone: a spine value only its own block reads is recomputed
        on_spine = {r for r in on_spine if blocks.get(r) is None
                    or any(blocks.get(u) != blocks[r] for u in r.users if u in in_forward)}
    starts = set(on_spine)
    if policy:  # what a block reads from outside it, as a checkpoint of the block saves its inputs (a mask or
        starts |= {a for n in forward if blocks.get(n) is not None  # positions made from the batch included)
                   for a in n.all_input_nodes if a in in_forward and blocks.get(a) != blocks[n] and _is_tensor_value(a)}
    extra_ops = RECOMPUTED_UNDER.get(policy, ())
    kept: dict[fx.Node, str] = {}
    for r in starts:  # recomputation starts from these, saved or not: a bf16 block input the backward never reads
        root = storage_root(r)  # itself (only its float32 copy) would otherwise be recomputed from the embedding
        if root in in_forward and value_bytes(root.meta.get("val")):
            kept[root] = ("a block's input: kept, recomputation of the block starts from it" if policy else
                          "the spine: the only forward value live here (recomputation starts from it)")
    candidates = []
    for r in roots:
        if r in kept:
            continue
        if value_bytes(r.meta.get("val")) == 0:
            kept[r] = "empty"
        elif not recomputable(r, extra_ops):
            kept[r] = f"not recomputable ({_why_not(r)})"
        elif r in read_after:
            kept[r] = "read after the backward anyway"
        else:
            candidates.append(r)
    stop = set(roots) | starts
    if policy:
        dropped = _by_policy(policy, forward, blocks, candidates, stop, in_forward, kept)
    else:
        dropped = _choose(candidates, stop, in_forward, budget, kept)
    plan = _Plan(dropped, kept, in_forward, extra_ops=extra_ops)
    plan.dropped_bytes = sum(value_bytes(r.meta.get("val")) for r in dropped)
    saved_roots = set(roots)  # kept_bytes: saved-for-backward bytes still kept (not the starts nothing else reads)
    plan.kept_bytes = sum(value_bytes(r.meta.get("val")) for r in kept if r in saved_roots)
    return plan


MATMULS = (aten.mm.default, aten.addmm.default)
# what each policy runs again in the backward beyond what any budget may: activations' collectives (torchtitan's
# checkpoint recomputes a whole block under "full"; under "selective" it saves reduce-scatter outputs, its save list,
# but gathers again) and, under "full", attention kernels without dropout (torch tags them nondeterministic_seeded
# for their dropout, which a numeric budget never replays)
RECOMPUTED_UNDER = {"full": (ops.all_gather, ops.reduce_scatter, *ATTENTION_FORWARD), "selective": (ops.all_gather,)}


def _saved_by_selective(node: fx.Node) -> bool:
    """torchtitan's save list, less ``mm`` (every other one) and ``reduce_scatter`` (a collective: never recomputed
    here): attention kernels and ``max``."""
    return node.target is aten.max.default or getattr(node.target, "overloadpacket", None) in ATTENTION_FORWARD


def block_of(node: fx.Node) -> str | None:
    """The block ``node`` was recorded in: its module's FQN up to the first element of a container (``model.layers.3``
    of ``model.layers.3.mlp.up_proj``), or None (outside every block, or no module recorded)."""
    fqn = node.meta.get("custom", {}).get("module")
    if not fqn:
        return None
    parts = fqn.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


def _by_policy(policy: str, forward: list[fx.Node], blocks: dict, candidates: list[fx.Node], stop: set[fx.Node],
               in_forward: set[fx.Node], kept: dict[fx.Node, str]) -> dict[fx.Node, str]:
    """``"full"`` / ``"selective"``: the candidates to recompute (-> why); values outside every block and, under
    ``"selective"``, the outputs of the ops torchtitan's policy saves are added to ``kept`` (they may be read by no
    backward node themselves: recomputation then starts from them)."""
    if policy == "selective":
        count: dict[str, int] = {}
        for node in forward:
            block = blocks.get(node)
            if block is None or not recomputable(node, RECOMPUTED_UNDER[policy]):
                continue
            if node.target in MATMULS:
                count[block] = count.get(block, 0) + 1
                if count[block] % 2:
                    kept.setdefault(node, f"'selective': matmul {count[block]} of block `{block}` (odd ones are kept)")
            elif _saved_by_selective(node):
                for out in [node, *(u for u in node.users if u.target is operator.getitem)]:
                    kept.setdefault(out, f"'selective': the output of {node.target} in block `{block}`")
    dropped: dict[fx.Node, str] = {}
    for r in candidates:
        if r in kept:
            continue
        block = blocks.get(r)
        if block is None:
            kept[r] = f"{policy!r}: outside every checkpointed block (kept, as a per-block checkpoint keeps it)"
            continue
        _, extra = _chain(r, stop - {r}, in_forward, RECOMPUTED_UNDER[policy])
        dropped[r] = f"{policy!r}: recomputed with block `{block}`"
        for x in extra:  # what recomputing it starts from
            kept.setdefault(x, f"not recomputable ({_why_not(x)}); `{r.name}` is recomputed from it")
    return dropped


def _choose(candidates: list[fx.Node], stop: set[fx.Node], forward: set[fx.Node], budget: float,
            kept: dict[fx.Node, str]) -> dict[fx.Node, str]:
    """The candidates to recompute (-> why), by torch's greedy knapsack over bytes saved and recompute time, each
    costed as if the other saved values stayed; the rest are added to ``kept``."""
    items, memory, runtime, extras = [], [], [], []
    for r in candidates:
        chain, extra = _chain(r, stop - {r}, forward)
        saving = value_bytes(r.meta.get("val")) - sum(value_bytes(x.meta.get("val")) for x in extra)
        if saving <= 0:
            kept[r] = (f"recomputing it needs {', '.join(f'`{x.name}` ({_why_not(x)})' for x in extra)}, "
                       "which would be kept instead")
            continue
        items.append(r)
        extras.append(extra)
        memory.append(float(saving))
        runtime.append(sum(recompute_cost(n) for n in chain))
    dropped: dict[fx.Node, str] = {}
    if not items:
        return dropped
    total = sum(memory)
    _, save, recompute = greedy_knapsack([m / total for m in memory], runtime, budget)
    for i in save:
        kept[items[i]] = f"kept within the budget: {runtime[i] / memory[i]:.1f} FLOP-eq. per byte to recompute"
    for i in recompute:
        dropped[items[i]] = f"{runtime[i] / memory[i]:.1f} FLOP-eq. per byte to recompute"
        for x in extras[i]:  # what recomputing it starts from
            kept.setdefault(x, f"not recomputable ({_why_not(x)}); `{items[i].name}` is recomputed from it")
    return dropped


def _chain(root: fx.Node, stop: set[fx.Node], forward: set[fx.Node],
           extra_ops: tuple = ()) -> tuple[list[fx.Node], list[fx.Node]]:
    """The forward nodes recomputing ``root`` runs (it included), from ``stop`` values, placeholders and values
    that are no tensors; and the nodes on the way that cannot be recomputed (they would have to be kept)."""
    chain, extra, seen, todo = [], [], set(), [root]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in forward or not _is_tensor_value(node) or (node is not root and storage_root(node) in stop):
            continue
        if not recomputable(node, extra_ops):
            extra.append(node)
            continue
        chain.append(node)
        todo += node.all_input_nodes
    return chain, extra


# ---------------------------------------------------------------------- the rewrite
def _rewrite(gm: fx.GraphModule, plan: _Plan) -> int:
    """Give every backward read of a dropped value a copy, made just before the backward node that first reads it
    and reused by later readers; returns how many nodes were copied."""
    graph = gm.graph
    copies: dict[fx.Node, fx.Node] = {}

    def materialize(node: fx.Node, before: fx.Node) -> fx.Node:
        if node in copies:
            return copies[node]
        env = {a: a if plan.available(a) else materialize(a, before) for a in node.all_input_nodes}
        # a getitem of a recomputed multi-output op goes right after it, as a trace places it, even when a later
        # reader asks for it: the ORT partition splits segments at collectives in graph order, and a tuple
        # crossing segments has no ONNX type
        source = node.args[0] if node.target is operator.getitem else None
        where = graph.inserting_after(env[source]) if source is not None and env[source] is not source \
            else graph.inserting_before(before)
        with where:
            copy = graph.node_copy(node, lambda a: env[a])
        copy.meta = {k: v for k, v in node.meta.items() if k not in ("custom", ACTIVATION_COLLECTIVE)}
        copy.meta["custom"] = dict(node.meta.get("custom", {}))
        set_phase(copy, "backward")
        copy.meta[RECOMPUTED] = node.name
        if node.target in (ops.all_gather, ops.reduce_scatter):  # run again where the backward needs it: never
            copy.meta[DEDUP_KEY] = ("recomputed", node.meta.get(DEDUP_KEY))  # merged with the forward's or issued early
        copies[node] = copy
        return copy

    for node in list(graph.nodes):
        if node.op != "call_function" or not _is_backward(node) or RECOMPUTED in node.meta:
            continue
        for arg in node.all_input_nodes:
            if not plan.available(arg):
                node.replace_input_with(arg, materialize(arg, node))
    for node in reversed(list(graph.nodes)):  # forward nodes only the backward read are gone with their reads
        if node in plan.forward and not node.users and recomputable(node, plan.extra_ops):
            graph.erase_node(node)
    return len(copies)


__all__ = [
    "POLICIES",
    "RECOMPUTED",
    "Recomputation",
    "block_of",
    "recomputable",
    "recompute_activations_pass",
    "recompute_cost",
    "spine",
    "storage_root",
]
