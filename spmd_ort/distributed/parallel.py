"""Parallel modes and what every rank must agree on.

``DataParallel(parallel_style="replicate")`` is DDP as graph passes: each rank
passes its own local batch, every parameter's gradient is tagged while tracing
(``spmd_ort::tag_grad``, :mod:`spmd_ort.graph.ops`), and the passes of ``passes/data_parallel.py`` turn the
tags into bucketed, overlapped all-reduces that average gradients over ranks.
It is the default when ``torch.distributed`` is initialized with more than one
rank.  Launch with ``torchrun --nproc_per_node=N train.py`` (multi-node:
torchrun's ``--nnodes``/``--rdzv-endpoint``; nothing here is node-specific).

``DataParallel(parallel_style="fully_shard")`` is ZeRO stage 3 as graph passes
(``passes/fully_shard.py``): every parameter is split into N equal padded
shards (:mod:`spmd_ort.distributed.sharding`), and the compiled step all-gathers parameters
before use, reduce-scatters gradients and runs the optimizer on shards.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from spmd_ort.distributed.precision import MixedPrecisionPolicy
from spmd_ort.distributed.stages import PipelineParallel
from spmd_ort.distributed import dtensor
from spmd_ort.distributed.deepspeed_config import data_parallel_settings
from spmd_ort.errors import CollectiveTimeout, CompileError, is_timeout
from spmd_ort.runtime.collectives import control_group, ours

STYLES = ("replicate", "fully_shard")
AUTO_START_MB = 25.0  # bucket_cap_mb="auto": the cap of the timed first steps (DDP's default)
OFFLOAD_DEVICES = (None, "cpu")


PARALLELIZED_ATTR = "_spmd_ort_parallel_mode"  # on a module spmd_ort.parallelize laid out: the mode it used


@dataclass(frozen=True, kw_only=True)
class DataParallel:
    """Data parallelism: replicated (DDP semantics) or fully sharded (ZeRO-3 / FSDP semantics).

    Each rank passes its own local batch, as with DDP (nothing is split or
    gathered along a batch dimension).  ``bucket_cap_mb``: gradients
    are all-reduced in buckets of at most this size, in the order backward
    produces them; the first bucket is at most ``first_bucket_cap_mb`` so that
    communication starts early.  ``"auto"`` (the default): the first steps run
    with ``AUTO_START_MB`` buckets and are timed, and the cap is then chosen from
    the measured costs (:mod:`spmd_ort.buckets`: the schedule is
    recompiled once, logged; ``describe()`` shows the choice); a number is used
    as given.  ``broadcast_buffers``: buffers are broadcast
    from rank 0 at the start of every step (DDP's default).

    ``fully_shard`` only (see :mod:`spmd_ort.distributed.sharding`):

    * ``reshard_after_forward``: free gathered parameters after their last
      forward use and gather them again for backward (ZeRO-3); ``False`` keeps
      them from the forward gather until their last backward use (ZeRO-2
      memory, one all-gather fewer per step).
    * ``prefetch``: how many all-gather buckets are issued ahead of the one
      being waited for (0: gather just before use).
    * ``bucket_cap_mb``: also caps the (unsharded) size of all-gather and
      reduce-scatter buckets.
    * ``offload_optimizer="cpu"``: optimizer state lives in host memory and the
      update runs there with the native fused kernel (``csrc/``).
    * ``offload_param="cpu"``: parameter shards live in host memory and are
      copied to the device before each all-gather.

    ``mixed_precision``: a :class:`spmd_ort.MixedPrecisionPolicy` (FSDP2's):
    compute in ``param_dtype`` on fp32 master parameters and optimizer state,
    reduce gradients in ``reduce_dtype``; under ``fully_shard`` the all-gather
    moves ``param_dtype``.  It applies on one process too (nothing to reduce).
    """

    parallel_style: str = "replicate"
    bucket_cap_mb: float | str = "auto"
    first_bucket_cap_mb: float = 1.0
    broadcast_buffers: bool = True
    reshard_after_forward: bool = True
    prefetch: int = 1
    offload_optimizer: str | None = None
    offload_param: str | None = None
    mixed_precision: MixedPrecisionPolicy | None = None

    def __post_init__(self):
        if self.parallel_style not in STYLES:
            raise ValueError(f"DataParallel(parallel_style={self.parallel_style!r}): supported styles are "
                             f"{', '.join(STYLES)}")
        cap = self.bucket_cap_mb
        if cap != "auto" and (isinstance(cap, (str, bool)) or not isinstance(cap, (int, float)) or cap <= 0):
            raise ValueError(f"DataParallel(bucket_cap_mb={cap!r}): give a positive number of MiB, or 'auto'")
        if self.first_bucket_cap_mb <= 0:
            raise ValueError("DataParallel: bucket caps must be positive")
        if self.prefetch < 0:
            raise ValueError(f"DataParallel: prefetch={self.prefetch} must be >= 0")
        for name in ("offload_optimizer", "offload_param"):
            value = getattr(self, name)
            if value not in OFFLOAD_DEVICES:
                raise ValueError(f"DataParallel({name}={value!r}): choose None or 'cpu'")
            if value is not None and self.parallel_style != "fully_shard":
                raise ValueError(f"DataParallel({name}={value!r}) needs parallel_style='fully_shard'")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecisionPolicy):
            raise TypeError(f"DataParallel(mixed_precision={self.mixed_precision!r}): expected a "
                            "spmd_ort.MixedPrecisionPolicy")

    @property
    def sharded(self) -> bool:
        return self.parallel_style == "fully_shard"

    @property
    def auto_buckets(self) -> bool:
        """The bucket cap is chosen from measured costs (``bucket_cap_mb="auto"``)."""
        return self.bucket_cap_mb == "auto"

    @property
    def cap_bytes(self) -> float:
        """The bucket cap the passes use, in bytes (``AUTO_START_MB`` while ``"auto"`` has not chosen)."""
        return (AUTO_START_MB if self.auto_buckets else float(self.bucket_cap_mb)) * 2**20

    @classmethod
    def from_deepspeed_config(cls, config) -> DataParallel:
        """The mode a DeepSpeed JSON config (path or dict) asks for; see
        :mod:`spmd_ort.distributed.deepspeed_config`."""
        return cls(**data_parallel_settings(config))


@dataclass(frozen=True)
class TensorParallel:
    """Tensor parallelism from a plan of torch's parallel styles.

    ``plan``: ``{fqn or glob: ParallelStyle}`` as ``torch.distributed.tensor.parallel.parallelize_module`` takes
    it (``"blocks.*.mlp.fc"``); every key must name at least one submodule.  ``mesh``: a 1-D
    ``DeviceMesh`` (default: every rank, on the parameters' device type), or its shape as a tuple (``(8,)``;
    2-D ``(dp, tp)``, dims named ``("dp", "tp")``), built with ``init_device_mesh`` on the world the step runs in
    when first needed: the real one, or the fake one of :meth:`spmd_ort.CompiledStep.plan`.  The ranks of a
    tensor-parallel group compute one model and pass the same batch, as in eager tensor parallelism.

    2-D: ``mesh=init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`` and
    ``data_parallel=DataParallel(parallel_style="replicate" | "fully_shard", ...)``: the plan shards over ``tp``,
    and gradients are averaged over ``dp`` (each dp replica passes its own batch) by the data-parallel passes, on
    the dp group; ``fully_shard`` also splits each tensor-parallel local tensor over ``dp`` (FSDP2 + TP: the
    parameters are DTensors on the 2-D mesh).  ``bucket_cap_mb="auto"`` keeps its 25 MiB starting cap there.
    """

    plan: Mapping[str, Any]
    mesh: Any = None
    data_parallel: Any = None

    def __post_init__(self):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import ParallelStyle


        if not isinstance(self.plan, Mapping) or not self.plan:
            raise TypeError(f"TensorParallel(plan={self.plan!r}): give a non-empty dict of module FQN (or glob) -> "
                            "torch.distributed.tensor.parallel style")
        for fqn, style in self.plan.items():
            if not isinstance(fqn, str) or not isinstance(style, ParallelStyle):
                raise TypeError(f"TensorParallel plan entry {fqn!r}: {style!r} is not a torch.distributed.tensor."
                                "parallel.ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...)")
        if isinstance(self.mesh, (tuple, list)):
            shape = tuple(self.mesh)
            wanted = 2 if self.data_parallel is not None else 1
            if len(shape) != wanted or not all(isinstance(n, int) and n > 0 for n in shape):
                raise TypeError(f"TensorParallel(mesh={self.mesh!r}): a shape tuple is "
                                + ("(dp, tp), two positive ints, with data_parallel=..." if wanted == 2 else
                                   "(tp,), one positive int (2-D: (dp, tp) with data_parallel=DataParallel(...))"))
            object.__setattr__(self, "mesh", shape)
        if self.data_parallel is None:
            if self.mesh is not None and not isinstance(self.mesh, tuple) and (
                    not isinstance(self.mesh, DeviceMesh) or self.mesh.ndim != 1):
                raise TypeError(f"TensorParallel(mesh={self.mesh!r}): give a 1-D DeviceMesh (or None: every rank), "
                                "or a 2-D one named ('dp', 'tp') with data_parallel=DataParallel(...)")
            return
        if not isinstance(self.data_parallel, DataParallel):
            raise TypeError(f"TensorParallel(data_parallel={self.data_parallel!r}): give a spmd_ort.DataParallel")
        offload = [n for n in ("offload_optimizer", "offload_param") if getattr(self.data_parallel, n) is not None]
        if offload:
            raise TypeError(f"TensorParallel(data_parallel=DataParallel({offload[0]}=...)): offload is not supported "
                            "in 2-D; drop it (fully_shard on the dp dim already divides the state by dp)")
        if not isinstance(self.mesh, tuple) and not (isinstance(self.mesh, DeviceMesh) and self.mesh.ndim == 2
                                                     and tuple(self.mesh.mesh_dim_names or ()) == ("dp", "tp")):
            raise TypeError(f"TensorParallel(mesh={self.mesh!r}, data_parallel=...): give a 2-D DeviceMesh with "
                            "mesh_dim_names=('dp', 'tp'), e.g. init_device_mesh('cpu', (dp, tp), "
                            "mesh_dim_names=('dp', 'tp')), or its shape (dp, tp)")

    @property
    def device_mesh(self):
        """``mesh`` as a DeviceMesh: a shape tuple is built on the current world (once per world: the fake one of a
        plan and a real one later get a mesh each); None where none was given (1-D: every rank)."""
        if not isinstance(self.mesh, tuple):
            return self.mesh
        from torch.distributed.device_mesh import init_device_mesh

        if not (dist.is_available() and dist.is_initialized()):
            raise CompileError(f"TensorParallel(mesh={self.mesh}) needs torch.distributed initialized (launch with "
                               "torchrun and call torch.distributed.init_process_group)")
        world = dist.group.WORLD
        built = self.__dict__.get("_built")
        if built is None or built[0] is not world:
            size = math.prod(self.mesh)
            if size != dist.get_world_size():
                raise CompileError(f"TensorParallel(mesh={self.mesh}) covers {size} ranks, but the world has "
                                   f"{dist.get_world_size()}; give a shape whose product is the world size",
                                   rank=dist.get_rank())
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            names = ("dp", "tp") if len(self.mesh) == 2 else ("tp",)
            built = (world, init_device_mesh(device, self.mesh, mesh_dim_names=names))
            object.__setattr__(self, "_built", built)
        return built[1]

    @property
    def mixed_precision(self):
        """2-D: the data-parallel mode's MixedPrecisionPolicy (forward on parameters cast to ``param_dtype``, DTensor
        ones included; gradients averaged over dp in ``reduce_dtype``); None on a 1-D mesh."""
        return self.data_parallel.mixed_precision if self.data_parallel is not None else None

    @property
    def tp_mesh(self):
        """The mesh the plan shards over: ``mesh`` (1-D), or its ``tp`` dim (2-D)."""
        mesh = self.device_mesh
        return mesh["tp"] if self.data_parallel is not None else mesh

    def dp_group(self):
        """2-D: the process group of this rank's data-parallel replicas (the ``dp`` dim); None on a 1-D mesh."""
        return self.device_mesh["dp"].get_group() if self.data_parallel is not None else None

    def data_parallel_mode(self):
        """2-D: the data-parallel mode on the ``dp`` dim, with a fixed bucket cap in place of ``"auto"`` (its
        measurements time collectives over every rank, not over one dp group); None on a 1-D mesh."""
        dp = self.data_parallel
        if dp is None or not dp.auto_buckets:
            return dp
        return dataclasses.replace(dp, bucket_cap_mb=AUTO_START_MB)

    def mesh_for(self, module: nn.Module):
        """The mesh to apply the plan on: the given one, else 1-D over the world on the module's device type."""
        if self.mesh is not None:
            return self.tp_mesh
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        device = next((p.device.type for p in module.parameters()), "cpu")
        if device == "meta":  # a meta model parallelized up front: the mesh of the device the ranks compute on
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device, (dist.get_world_size(),))

    def resolve_plan(self, module: nn.Module, rank: int) -> dict[str, Any]:
        """The plan with each key checked against the module: a key that names no submodule is an error."""
        names = [n for n, _ in module.named_modules() if n]
        for key in self.plan:
            if not any(fnmatch.fnmatchcase(n, key) for n in names):
                close = [n for n in names if n.split(".")[-1] == key.split(".")[-1]][:3]
                hint = f" (submodules with that name: {', '.join(close)})" if close else ""
                raise CompileError(f"TensorParallel plan key `{key}` names no submodule of "
                                   f"{type(module).__name__}{hint}; keys are module FQNs, `*` matching one "
                                   "level", fqn=key, rank=rank)
        return dict(self.plan)


@dataclass(frozen=True, kw_only=True)
class ContextParallel(DataParallel):
    """Context parallelism (what ``Parallel(cp=N, ...)`` lowers to): data parallelism over every rank whose ranks'
    gradients are parts of sums, and the sequence split over each cp group.

    The world is a ``(dp, cp)`` mesh (``dp`` = ``dp_replicate`` or ``dp_shard``, 1 for cp alone; cp the inner
    dim, as torchtitan orders them).  The ranks of one cp group pass the same whole batch and each computes its
    share of the sequence (``seq_dim`` of every batch tensor; :mod:`spmd_ort.passes.context_parallel`); the data-
    parallel settings (``parallel_style``, buckets, prefetch, ...) are those of the data parallelism over every
    rank that reduces the gradients, as torchtitan's FSDP over ``dp_shard x cp``: each rank's part of a gradient is
    scaled by ``cp`` before it, so the average over every rank is the average over dp of the sums over cp.
    """

    cp: int = 2
    seq_dim: int = 1

    @property
    def dp(self) -> int:
        """How many cp groups (data-parallel replicas or shards of batches) the world holds."""
        return world()[1] // self.cp

    def rank_in_group(self, rank: int) -> int:
        """``rank``'s position in its cp group (the mesh's inner dim)."""
        return rank % self.cp

    def groups(self, world_size: int | None = None) -> list[list[int]]:
        """The global ranks of each cp group: ranks that pass one batch."""
        n = world()[1] if world_size is None else world_size
        return [list(range(d * self.cp, (d + 1) * self.cp)) for d in range(n // self.cp)]

    def group_name(self) -> str:
        """The cp group's process group name ("": the world, cp alone), built once per world: every rank makes
        every group of the mesh's cp dim together (the first compile, which every rank reaches alike)."""
        if self.dp == 1:
            return ""
        built = self.__dict__.get("_built")
        if built is None or built[0] is not dist.group.WORLD:
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = init_device_mesh(device, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            built = (dist.group.WORLD, mesh["cp"].get_group().group_name)
            object.__setattr__(self, "_built", built)
        return built[1]


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve(mode, module: nn.Module | None = None):
    """The parallel mode a compile uses: the user's, else DataParallel() on several ranks.

    A ``module`` whose parameters are DTensors (expand mode) takes none: its placements say where every
    tensor lives, and DTensor's sharding propagation adds the collectives.
    """
    rank, size = world()
    if isinstance(mode, TensorParallel):
        if not (dist.is_available() and dist.is_initialized()):
            raise CompileError("TensorParallel needs torch.distributed initialized (launch with torchrun and call "
                               "torch.distributed.init_process_group)", rank=rank)
        # the plan makes the parameters DTensors (expand mode); 2-D: data parallel on the dp dim as well
        return mode.data_parallel_mode()
    if module is not None and dtensor.has_dtensor_state(module):
        if mode is None:
            return None
        raise CompileError(
            f"{type(module).__name__}'s parameters are DTensors (a tensor-parallel plan was applied), so the step "
            f"compiles in expand mode, where their placements decide the parallelism; parallel_mode={mode!r} "
            "cannot be combined with it. Fix: compile with parallel_mode=None", rank=rank)
    if mode is None:
        return DataParallel() if size > 1 else None
    if isinstance(mode, DataParallel) and size == 1:
        return None  # one rank: nothing to reduce
    if isinstance(mode, ContextParallel):
        if size % mode.cp:
            raise CompileError(f"Parallel(cp={mode.cp}) needs a world of a multiple of {mode.cp} ranks, but it has "
                               f"{size}", rank=rank)
        return mode
    if isinstance(mode, PipelineParallel):
        if size != mode.pp * mode.dp:
            raise CompileError(f"Parallel(pp={mode.pp}{f', dp_replicate={mode.dp}' if mode.dp > 1 else ''}) needs "
                               f"a world of {mode.pp * mode.dp} ranks, but it has {size}", rank=rank)
        return mode
    if not isinstance(mode, DataParallel):
        raise TypeError(f"parallel_mode={mode!r} is not a spmd_ort.DataParallel or spmd_ort.TensorParallel")
    return mode


def check_agreement_by_place(what: str, place: int, description: str) -> None:
    """The ranks at one ``place`` (a pipeline rank: the ranks holding the same stages in every pipeline) must hold
    the same ``description``; otherwise every rank raises, naming the ranks that differ.  One all-gather."""
    rank, size = world()
    if size == 1:
        return
    everyone: list = [None] * size
    dist.all_gather_object(everyone, (place, digest(description), description), group=control_group())
    seen: dict = {}
    for r, (p, d, desc) in enumerate(everyone):
        seen.setdefault(p, {}).setdefault(d, (desc, []))[1].append(r)
    for p, by_digest in sorted(seen.items()):
        if len(by_digest) > 1:
            (first, ranks_a), (second, ranks_b) = list(by_digest.values())[:2]
            raise CompileError(
                f"ranks disagree on {what}: ranks {ranks_a} vs ranks {ranks_b} (place {p} of their pipelines): "
                f"{_first_diff(first, second)}. Every rank must compile the same step (same shapes, code path "
                f"and world); this rank is {rank}", rank=rank)


def digest(text: str) -> int:
    """A 62-bit hash that is the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def check_agreement(what: str, description: str, *, sizes: Any = None,
                    reconcile: Callable[[list], Any] | None = None) -> Any:
    """All ranks must hold the same ``description``; otherwise every rank raises.

    One small all-reduce (max of the digest and of its negation) when all agree;
    on disagreement an all-gather of the descriptions names the ranks and the
    first difference.  Every rank takes the same path, so nobody hangs.
    On disagreement, ``reconcile`` (if given) sees every rank's ``sizes`` (the
    same list on every rank): a true result is returned instead of raising (so
    every rank decides alike, e.g. to make differing input sizes symbolic).
    Returns None when the ranks agree.
    """
    rank, size = world()
    if size == 1:
        return None
    d = digest(description)
    t = torch.tensor([d, -d], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    except RuntimeError as exc:
        if is_timeout(exc):
            raise CollectiveTimeout(f"the ranks' agreement on {what}", rank=rank, cause=exc) from exc
        raise
    if int(t[0]) == -int(t[1]):
        return None
    descriptions: list = [None] * size
    dist.all_gather_object(descriptions, (description, sizes), group=control_group())
    if reconcile is not None:
        settled = reconcile([s for _, s in descriptions])
        if settled:
            return settled
    descriptions = [d for d, _ in descriptions]
    groups: dict = {}
    for r, desc in enumerate(descriptions):
        groups.setdefault(desc, []).append(r)
    (first, ranks_a), (second, ranks_b) = list(groups.items())[:2]
    raise CompileError(
        f"ranks disagree on {what}: ranks {ranks_a} vs ranks {ranks_b}: {_first_diff(first, second)}. "
        "Every rank must compile the same step (same shapes, code path and world); "
        f"this rank is {rank}", rank=rank)


def gather_failures(what: str, failure: tuple | None) -> dict[int, tuple]:
    """Every rank's ``failure`` (None where it succeeded), on every rank: ``{rank: failure}`` of those that failed.

    For operations that must succeed everywhere or nowhere (a checkpoint load): each rank learns
    whether any rank failed and why, so all of them raise, or none.  One small all-gather.
    """
    everyone = _everyones(failure, f"the ranks' agreement on {what}")
    return {r: f for r, f in enumerate(everyone) if f is not None}


def _everyones(obj: Any, what: str) -> list:
    """Every rank's ``obj``, in rank order, on every rank (one all-gather; a timeout names ``what``)."""
    rank, size = world()
    if size == 1:
        return [obj]
    everyone: list = [None] * size
    try:
        dist.all_gather_object(everyone, obj, group=control_group())
    except RuntimeError as exc:
        if is_timeout(exc):
            raise CollectiveTimeout(what, rank=rank, cause=exc) from exc
        raise
    return everyone


def exchange_traced(what: str, payload: Any) -> list | None:
    """Every rank's ``payload`` (what its traced graph holds, for a pass that must know what the ranks trace
    alike), on every rank, or None where any rank has none: its trace failed, and it takes part here anyway so
    that no rank waits for it (the agreement after the compile then fails on every rank).  One all-gather."""
    everyone = _everyones(payload, f"the ranks' exchange of {what}")
    return None if any(p is None for p in everyone) else everyone


class DifferentBatchError(CompileError):
    """Ranks of one tensor-parallel group passed different batches (a data loader that shards over them).

    The same on every rank (each raises it from what every rank passed), and nothing has changed: no shape
    policy retries it with other dims."""


def tensor_parallel_groups(module: nn.Module, mode: TensorParallel | None) -> list[list[int]]:
    """The global ranks of each tensor-parallel group: the ranks that compute one model on one batch, so must pass
    the same one.  From ``mode``'s mesh (1-D: every rank of it; 2-D: each ``tp`` row), else from the mesh of the
    module's DTensors (1-D, or its dim named ``tp``); empty where no dim says which ranks share a batch."""
    mesh = mode.device_mesh if mode is not None else next(
        (dtensor.spec_of(t).mesh for t in list(module.parameters()) + list(module.buffers())
         if dtensor.is_dtensor(t)), None)
    if mesh is None:
        return [list(range(world()[1]))] if mode is not None else []  # TensorParallel's default: every rank
    ranks, names = mesh.mesh, tuple(mesh.mesh_dim_names or ())
    if ranks.ndim == 1:
        return [ranks.tolist()]
    if "tp" not in names:
        return []
    tp = names.index("tp")
    return ranks.movedim(tp, -1).reshape(-1, ranks.shape[tp]).tolist()


def check_same_batch(everyone: list[list], groups: list[list[int]], names: list[str], *, rank: int,
                     shown: bool = True, kind: str = "tensor-parallel") -> None:
    """Raise :class:`DifferentBatchError` on every rank alike where the ranks of a tensor-parallel group (``groups``)
    passed different values for one input.

    ``everyone``: every rank's description of each leaf of its call, in rank order: shapes and values at the
    ranks' agreement (``shown`` in the error), checksums of the values at a program's first call (not shown); None
    where there is nothing to compare.  Eager tensor parallelism trains silently on such a mix.
    """
    for group in groups:
        if not all(r < len(everyone) for r in group) or len({len(everyone[r]) for r in group}) != 1:
            continue
        for i, name in enumerate(names[:len(everyone[group[0]])]):
            seen: dict = {}
            for r in group:
                seen.setdefault(everyone[r][i], []).append(r)
            if len(seen) < 2:
                continue
            (a, ranks_a), (b, ranks_b) = list(seen.items())[:2]
            what = f"`{name}` ({a} vs {b})" if shown else f"values for `{name}`"
            who = " and ".join(f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}" for rs in (ranks_a, ranks_b))
            raise DifferentBatchError(
                f"{who} of one {kind} group pass different {what}: every "
                f"rank of a {kind} group must pass the same batch (the group computes one model on one "
                "batch; eager tensor parallelism would train on the mix silently). Fix: "
                f"shard the data over the data-parallel ranks only, never over a {kind} group (2-D: "
                "DistributedSampler(num_replicas=mesh['dp'].size(), rank=mesh['dp'].get_local_rank()); 1-D: the "
                "same batch on every rank). The model and optimizer are unchanged", rank=rank, input=name)


def layout_of(mode) -> dict:
    """What of a parallel mode lays the parameters out (what :func:`spmd_ort.parallelize` does, and a step then takes
    as it is), by name: the data-parallel style and where parameter shards live; a tensor-parallel plan by each
    entry's style and settings (a plan rebuilt with equal styles is the same layout), its mesh's shape, dim names
    and ranks, and its data-parallel layout.  Not the settings a step may change after the layout is made, as
    FSDP2 lets them change after ``fully_shard``: bucket caps, prefetch, resharding, offloaded optimizer state,
    mixed precision."""
    if mode is None:
        return {"parallel": None}
    if isinstance(mode, ContextParallel):
        return {"parallel_style": mode.parallel_style, "offload_param": mode.offload_param, "cp": mode.cp}
    if isinstance(mode, DataParallel):
        return {"parallel_style": mode.parallel_style, "offload_param": mode.offload_param}
    if isinstance(mode, TensorParallel):
        plan = {fqn: (type(style).__name__, tuple(sorted((k, repr(v)) for k, v in vars(style).items()
                                                         if k not in _SET_WHEN_APPLIED)))
                for fqn, style in mode.plan.items()}
        return {"tensor_parallel_plan": plan, "mesh": _mesh_layout(mode.mesh),
                "data_parallel": layout_of(mode.data_parallel) if mode.data_parallel is not None else None}
    return {"mode": mode}


# what torch's parallelize_module writes on a style as it applies it (where initial values come from; a row-wise
# style's input layout for the module it meets), not the user's settings
_SET_WHEN_APPLIED = ("src_data_rank", "desired_input_layouts")


def _mesh_layout(mesh):
    if mesh is None or isinstance(mesh, tuple):
        return mesh
    return (tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.flatten().tolist()))


def layout_difference(a, b) -> str | None:
    """Where the layouts of modes ``a`` and ``b`` differ, in words (None: the same layout)."""
    la, lb = layout_of(a), layout_of(b)
    if la == lb:
        return None
    diffs = []
    for key in sorted(set(la) | set(lb), key=str):
        if la.get(key) != lb.get(key):
            va, vb = la.get(key), lb.get(key)
            if isinstance(va, dict) and isinstance(vb, dict):  # a plan: the entries that differ
                keys = sorted(k for k in set(va) | set(vb) if va.get(k) != vb.get(k))
                diffs.append(f"{key} entries {', '.join(map(repr, keys))}")
            else:
                diffs.append(f"{key} {va!r} vs {vb!r}")
    return "; ".join(diffs)


def _first_diff(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for x, y in zip(la, lb):
        if x != y:
            return f"`{x.strip()[:200]}` vs `{y.strip()[:200]}`"
    return f"{len(la)} vs {len(lb)} lines"


def broadcast_state(module: nn.Module, group=None) -> None:
    """Rank 0's parameters and buffers on every rank (as DDP does at construction); with ``group`` (2-D: the
    data-parallel replicas of this rank's shards), its first rank's, within it."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        seen: set[int] = set()
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                dist.broadcast(dtensor.local(t.data), src=src, group=ours(group))
