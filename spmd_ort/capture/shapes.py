"""The shape policy of a compiled step: when dims become symbolic, and which program serves a call.

``compile(dynamic=...)`` / ``SPMD_ORT_DYNAMIC``:

* ``auto`` (default): the first trace is static; when a call misses only because sizes of
  tensor inputs (or int/float arguments) changed since the last call, those dims become
  symbolic (:meth:`ShapePolicy.widen`) and one program serves them all from then on;
* ``1``: the first two dims of every tensor input are symbolic from the start;
* ``0``: one program per shape.

Under a parallel mode, ranks whose keys differ only in input sizes make the differing
dims symbolic on every rank (the decision is taken from the gathered keys, the same
everywhere), as DDP lets each rank pass its own batch; where a rank's size there is 1
(the last, short batch of an epoch), the program is traced size-obliviously so that it
serves 1 as well (:attr:`~spmd_ort.graph.symbolic.DynamicDims.ones`): one program for
every rank, so the collectives are the same.  Ranks of one tensor-parallel group share a
batch: there a difference is an error (``parallel.check_same_batch``).  A trace that
fails with dims this very call made symbolic is retried with those dims static
(:meth:`ShapePolicy.narrow`), and they stay static.  A symbolic program whose guards
reject a call's sizes sends it to a static program for exactly them.
"""

from __future__ import annotations


import torch

from spmd_ort.capture import amp
from spmd_ort.graph.symbolic import (DynamicDims, changed_dims, dims_differing_across, leading_dims,
                                     size_oblivious_supported)
from spmd_ort.capture.inputs import StepCall, StepInputs
from spmd_ort.capture.state import state_device
from spmd_ort.capture.transition import StepKey, TransitionManager
from spmd_ort.distributed import parallel
from spmd_ort.distributed.dtensor import has_dtensor_state
from spmd_ort.errors import CompileError
from spmd_ort.options import get_logger

logger = get_logger(__name__)

AGREEMENT = "this step's inputs, module and optimizer"


def _sizes_differ(gathered: list) -> tuple[dict[int, set[int]], bool] | None:
    """Ranks' ``(key without sizes, leaf descriptions, shapes)``: the dims to make symbolic when only sizes differ,
    and whether some rank's size in one of them is 1 (then the program must serve 1 too: size-oblivious)."""
    if any(g is None for g in gathered) or len({g[0] for g in gathered}) != 1:
        return None
    dims = dims_differing_across([g[1] for g in gathered])
    if not dims:
        return None
    shapes = [g[2] for g in gathered]
    ones = any(s[pos] is not None and 0 <= d < len(s[pos]) and s[pos][d] == 1
               for s in shapes for pos, ds in dims.items() for d in ds)
    return dims, ones


def _passed(gathered_one) -> list[str]:
    """What a rank passed, per leaf, from its ``(key without sizes, leaf descriptions, shapes)``: a tensor's shape,
    a Python value, or the leaf's description."""
    _, descs, shapes = gathered_one
    return [f"shape {shape}" if shape is not None else repr(desc[2]) if desc[:1] == ("value",) and len(desc) == 3
            else repr(desc) for desc, shape in zip(descs, shapes)]


def check_sequence_splits(call: StepCall, split, names: list[str]) -> None:
    """Context parallel cuts the sequence into ``2 * cp`` equal chunks: a length that does not divide is refused
    (the same on every rank: they passed one batch), before anything is traced or run."""
    chunks = 2 * split.cp
    lengths = {name: x.shape[split.seq_dim] for name, x in zip(names, call.leaves)
               if isinstance(x, torch.Tensor) and x.dim() > split.seq_dim}
    if not lengths:
        return
    if len(set(lengths.values())) > 1:
        raise CompileError(
            f"Parallel(cp={split.cp}) splits dim {split.seq_dim} of every batch tensor as one sequence, but they "
            f"differ there ({', '.join(f'`{n}` {t}' for n, t in lengths.items())}). Fix: one length for every batch "
            "tensor with that dim, or seq_dim= naming the sequence dim. The model and optimizer are unchanged",
            input=next(iter(lengths)), rank=call.rank)
    name, length = next(iter(lengths.items()))  # (one length: every batch tensor's)
    if length % chunks:
        raise CompileError(
            f"Parallel(cp={split.cp}) splits dim {split.seq_dim} of `{name}` into {chunks} equal chunks (each rank "
            f"holds 2, balancing causal attention), but its length {length} does not divide by {chunks}. Fix: pad "
            f"the sequence to a multiple of {chunks} (labels -100 where padded), or give seq_dim= if the sequence "
            "is another dim. The model and optimizer are unchanged", input=name, rank=call.rank)


def check_empty_inputs(gathered: list, names: list[str], rank: int) -> None:
    """Raise, on every rank alike, when some rank passes an empty input (a zero-size dim) that another passes
    with data: each rank's step would be another graph, and no size can be symbolic at 0.

    ``gathered``: every rank's ``(key without sizes, leaf descriptions, shape of each leaf or None)``.
    """
    shapes = [g[2] for g in gathered]
    if len({len(s) for s in shapes}) != 1:
        return  # another structure: the key's own difference says so
    for i, name in enumerate(names[:len(shapes[0])]):
        empty = [r for r, s in enumerate(shapes) if s[i] is not None and 0 in s[i]]
        full = [r for r, s in enumerate(shapes) if s[i] is not None and 0 not in s[i]]
        if empty and full:
            who = f"ranks {empty} pass" if len(empty) > 1 else f"rank {empty[0]} passes"
            raise CompileError(
                f"{who} an empty input `{name}` (shape {shapes[empty[0]][i]}) where rank {full[0]} passes shape "
                f"{shapes[full[0]][i]}: every rank runs the same step (one graph, the same collectives), so a step "
                "cannot run with data on some ranks only. Fix: give every rank at least one sample per step (e.g. "
                "DistributedSampler(..., drop_last=True) and DataLoader(..., drop_last=True)), or skip the step on "
                f"every rank. The model and optimizer are unchanged; this rank is {rank}", rank=rank, input=name)


class ShapePolicy:
    """Which dims of the step's inputs are symbolic (``dynamic``), and the key of a call under them."""

    def __init__(self, mode: str, fn, transitions: TransitionManager):
        self.mode = mode  # "auto" | "1" | "0" (Options.dynamic)
        self.fn = fn
        self.transitions = transitions
        self.dynamic = DynamicDims()  # grows as sizes change (spmd_ort.graph.symbolic)
        self._widened_from: DynamicDims | None = None  # the dims before this call widened them
        self._refused: dict[int, set[int]] = {}  # dims whose symbolic trace failed once: never widened again
        self._ones_refused = False  # a size-oblivious trace failed once: size 1 stays static from then on

    @property
    def name(self) -> str:
        return self.transitions.name

    def key(self, call: StepCall) -> StepKey:
        """The re-trace key of ``call`` under the current symbolic dims (a static one where guards reject it)."""
        amp_key = (("autocast", amp.autocast_state()),
                   ("scaler", amp.scaler_key(call.scaler, state_device(call.module))))
        common = dict(rule=call.rule, world=(call.world_size, repr(call.mode)), amp=amp_key)
        key = StepKey.of(call.module, call.opt, call.args, call.kwargs, dynamic=self.dynamic, **common)
        program = self.transitions.variants.get(key)
        if program is None or program.symbolic is None:
            return key
        batch_shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else x
                        for x in program.batch_inputs(call.args, call.kwargs)]
        if program.symbolic.accepts(batch_shapes):
            return key
        static = StepKey.of(call.module, call.opt, call.args, call.kwargs, **common)
        if static in self.transitions.variants:  # traced for exactly these sizes before they became symbolic
            return static
        logger.info("%s: sizes %s fail the guards of the symbolic program; tracing them statically",
                    self.name, batch_shapes)
        return StepKey.of(call.module, call.opt, call.args, call.kwargs, shapes=(("static", tuple(batch_shapes)),),
                          **common)

    def agreed_key(self, call: StepCall) -> StepKey:
        """The key of ``call``, dims widened where sizes changed (or differ between ranks), agreed by every rank.

        Expand mode (DTensor state) too: DTensor's sharding propagation runs on the symbolic sizes, and the
        guards it records (a size that must divide by the mesh, say) are the program's, checked on every call.
        """
        self._widened_from = None
        expands = has_dtensor_state(call.module)
        # context and pipeline parallelism: the ranks of a group pass one batch
        split = call.mode if isinstance(call.mode, (parallel.ContextParallel, parallel.PipelineParallel)) else None
        if self.mode == "1" and not self.dynamic:
            self.dynamic = leading_dims(call.leaves)
        if isinstance(split, parallel.ContextParallel):  # the sequence is symbolic from the first trace: the split
            # pass reads it there
            self.dynamic = self.dynamic.union({pos: {split.seq_dim} for pos, x in enumerate(call.leaves)
                                               if isinstance(x, torch.Tensor) and x.dim() > split.seq_dim})
        key = self.key(call)
        last = self.transitions.last_key
        if (self.mode == "auto" and key not in self.transitions.variants and last is not None
                and key.portable(sizes=False) == last.portable(sizes=False)):
            changed = changed_dims(last.leaf_descs(), key.leaf_descs())
            if changed:
                self.widen(changed, call, "changed since the last call")
                key = self.key(call)
        if call.mode is not None or (expands and call.world_size > 1):
            # every step: ranks that would run different graphs stop here, all of them
            shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in call.leaves]
            sizes = (key.portable(sizes=False), key.leaf_descs(), shapes)

            def reconcile(gathered: list) -> tuple[dict[int, set[int]], bool] | None:  # only when the ranks disagree
                names = StepInputs.of(self.fn, call.args, call.kwargs).names
                check_empty_inputs(gathered, names, call.rank)
                if expands or split is not None:  # ranks of one tensor- (context-) parallel group share a batch
                    groups = split.groups(call.world_size) if split is not None else \
                        parallel.tensor_parallel_groups(call.module, call.tensor_parallel)
                    kind = "pipeline" if isinstance(split, parallel.PipelineParallel) else \
                        "context-parallel" if split is not None else "tensor-parallel"
                    parallel.check_same_batch([_passed(g) for g in gathered], groups, names, rank=call.rank,
                                              kind=kind)
                return _sizes_differ(gathered) if self.mode != "0" else None

            differing = parallel.check_agreement(AGREEMENT, key.portable(), sizes=sizes, reconcile=reconcile)
            if differing:
                dims, ones = differing
                self.widen(dims, call, "differ between ranks", ones=ones)
                key = self.key(call)
                parallel.check_agreement(AGREEMENT, key.portable())
        if isinstance(split, parallel.ContextParallel):
            check_sequence_splits(call, split, StepInputs.of(self.fn, call.args, call.kwargs).names)
        return key

    def widen(self, dims: dict[int, set[int]], call: StepCall, why: str, *, ones: bool = False) -> None:
        """Make ``dims`` symbolic from now on; ``ones``: sizes of 1 too (a rank passes 1 where another passes more:
        one program must serve both, traced size-obliviously)."""
        before = self.dynamic
        ones = ones and not self._ones_refused and size_oblivious_supported()
        self.dynamic = self.dynamic.union({pos: set(d) - self._refused.get(pos, set()) for pos, d in dims.items()},
                                          ones=ones)
        if self.dynamic != before:
            if self._widened_from is None:
                self._widened_from = before
            names = dict(enumerate(StepInputs.of(self.fn, call.args, call.kwargs).names))
            logger.info("%s: %s %s: symbolic from now on, one program serves them all (dynamic shapes; "
                        "SPMD_ORT_DYNAMIC=0 traces every shape and value instead)", self.name,
                        self.dynamic.describe(names), why)

    def narrow(self, call: StepCall, exc: BaseException) -> StepKey | None:
        """After a failed trace: the dims this call made symbolic go back to static, for good.

        Returns the key to trace statically (agreed by every rank), or None when this call made
        no dim symbolic (the failure is not about shapes: re-raise it).  A wrong input size then
        fails as it would without dynamic shapes, naming its concrete sizes.
        """
        if self._widened_from is None or isinstance(exc, parallel.DifferentBatchError):
            return None
        for pos, dims in self.dynamic.as_dict().items():
            self._refused.setdefault(pos, set()).update(dims - self._widened_from.as_dict().get(pos, set()))
        self._ones_refused |= self.dynamic.ones and not self._widened_from.ones
        self.dynamic, self._widened_from = self._widened_from, None
        key = self.key(call)
        if call.mode is not None:
            parallel.check_agreement(AGREEMENT, key.portable())
        reason = " ".join(str(exc).split())
        logger.info("%s: the trace with the new symbolic dims failed (%s: %s); tracing these sizes statically "
                    "(and those dims stay static from now on)",
                    self.name, type(exc).__name__, reason[:300] + (" ..." if len(reason) > 300 else ""))
        return key
