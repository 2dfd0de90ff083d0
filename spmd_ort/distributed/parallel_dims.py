"""``spmd_ort.Parallel``: one layout object for every parallel dimension, as torchtitan's ``ParallelDims``.

A layout names each degree: ``dp_replicate`` (DDP's replicas), ``dp_shard`` (fully_shard / ZeRO-3), ``cp``
(context parallel), ``tp`` (tensor parallel), ``pp`` (pipeline), ``ep`` (expert parallel, whose ranks are borrowed
from ``dp_shard x cp``).  Their product without ``ep`` is the world; the mesh's dimensions, outermost first, are
``pp, dp_replicate, dp_shard, cp, tp`` (only those above 1 are built).  One degree may be ``-1``: the rest of the
world.

The passes consume the mode objects the layout lowers to (:meth:`Parallel.lower`): a
:class:`~spmd_ort.distributed.parallel.DataParallel` for data parallelism alone, a
:class:`~spmd_ort.distributed.parallel.TensorParallel` (2-D: with a data-parallel dim) with tensor parallelism.
``DataParallel(...)`` and ``TensorParallel(...)`` stay as shorthands: :meth:`Parallel.of` gives the layout each
stands for.  A new dimension is a field here, its lowering, one pass family under ``passes/``, its pricing in
the plan, a docs page and its tests (docs/architecture.md, "Adding a parallel dimension").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spmd_ort.distributed.experts import ExpertParallel
from spmd_ort.distributed.parallel import ContextParallel, DataParallel, TensorParallel, world
from spmd_ort.distributed.precision import MixedPrecisionPolicy
from spmd_ort.distributed.stages import Pipeline, PipelineParallel
from spmd_ort.errors import ConfigError

# the mesh's dimensions, outermost first (torchtitan's order); ep borrows ranks from dp_shard x cp
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
NOT_BUILT: dict[str, str] = {}  # degrees this release has not built: {name: what it is}
# the data-parallel settings a layout passes to the DataParallel it lowers to
DP_SETTINGS = ("bucket_cap_mb", "first_bucket_cap_mb", "broadcast_buffers", "reshard_after_forward", "prefetch",
               "offload_optimizer", "offload_param", "mixed_precision")


def _dp_default(name: str):
    """DataParallel's default of setting ``name`` (a layout's data-parallel settings are DataParallel's)."""
    return DataParallel.__dataclass_fields__[name].default


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """Every parallel degree of a training run, and the settings of its data-parallel dimension.

    ``tp_plan``: ``{module FQN or glob: torch ParallelStyle}`` for ``tp > 1`` (torch's Megatron styles, as
    ``parallelize_module`` takes them).  ``experts`` (a glob of expert modules) and ``pipeline`` are for ``ep`` and
    ``pp``.  The data-parallel settings are :class:`~spmd_ort.distributed.parallel.DataParallel`'s (bucket caps,
    resharding, prefetch, offload, ``mixed_precision``: FSDP2's policy).  Degrees that this release has not built
    (``pp`` above 1) and combinations it has not (``dp_replicate`` and ``dp_shard`` both above 1: HSDP; ``cp`` with
    ``tp``; ``ep`` with anything but ``dp_shard``) are a :class:`~spmd_ort.errors.ConfigError` that says so.  ``cp``
    lowers to a :class:`~spmd_ort.distributed.parallel.ContextParallel`: the data parallelism over every rank, the
    sequence split over each cp group (``seq_dim``: the batch's sequence dim).  ``ep`` (with ``experts``, a glob of the
    expert modules) lowers to an :class:`~spmd_ort.distributed.experts.ExpertParallel`: fully_shard over every rank,
    each rank computing E/ep experts of every expert module and the tokens sent to them.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    tp_plan: Mapping[str, Any] | None = None
    seq_dim: int = 1  # cp: the batch tensors' sequence dim
    experts: str | None = None
    pipeline: Any = None
    # the data-parallel dimension's settings, with DataParallel's defaults (one source: _dp_default)
    bucket_cap_mb: float | str = _dp_default("bucket_cap_mb")
    first_bucket_cap_mb: float = _dp_default("first_bucket_cap_mb")
    broadcast_buffers: bool = _dp_default("broadcast_buffers")
    reshard_after_forward: bool = _dp_default("reshard_after_forward")
    prefetch: int = _dp_default("prefetch")
    offload_optimizer: str | None = _dp_default("offload_optimizer")
    offload_param: str | None = _dp_default("offload_param")
    mixed_precision: MixedPrecisionPolicy | None = _dp_default("mixed_precision")

    def __post_init__(self):
        degrees = {name: getattr(self, name) for name in (*MESH_ORDER, "ep")}
        for name, n in degrees.items():
            if isinstance(n, bool) or not isinstance(n, int) or not (n >= 1 or n == -1):
                raise ConfigError(f"Parallel({name}={n!r}): a degree is a positive integer (or -1: the rest of the "
                                  "world)")
        if sum(n == -1 for n in degrees.values()) > 1:
            raise ConfigError(f"Parallel({self.degrees_text()}): at most one degree may be -1 (the rest of the world)")
        if self.ep == -1:
            raise ConfigError("Parallel(ep=-1): ep borrows its ranks from dp_shard x cp; give it as a number")
        for name, what in NOT_BUILT.items():
            if degrees[name] != 1:
                raise ConfigError(f"Parallel({name}={degrees[name]}): {what} is not built in this release yet; use "
                                  f"{name}=1")
        if self.dp_replicate != 1 and self.dp_shard != 1:
            raise ConfigError(f"Parallel(dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}): replicas of "
                              "a sharded group (HSDP) are not built yet; give one of them")
        if self.cp != 1 and self.tp != 1:
            raise ConfigError(f"Parallel({self.degrees_text()}): context parallelism with tensor parallelism is not "
                              "built in this release yet; give cp with dp_shard or dp_replicate")
        if isinstance(self.seq_dim, bool) or not isinstance(self.seq_dim, int) or self.seq_dim < 0:
            raise ConfigError(f"Parallel(seq_dim={self.seq_dim!r}): the batch's sequence dim, a non-negative int")
        if self.tp != 1 and not self.tp_plan:
            raise ConfigError(f"Parallel(tp={self.tp}): give tp_plan, {{module FQN or glob: ParallelStyle}} "
                              "(ColwiseParallel(), RowwiseParallel(), ...)")
        if self.tp == 1 and self.tp_plan:
            raise ConfigError("Parallel(tp_plan=...) needs tp > 1 (or -1: every rank the data-parallel dims leave)")
        self._check_pipeline()
        self._check_experts()
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) is not None and self.dp_shard == 1:
                raise ConfigError(f"Parallel({name}={getattr(self, name)!r}) offloads shards: it needs dp_shard > 1 "
                                  "(fully_shard)")
        # the other data-parallel settings are checked as DataParallel checks them
        self._data_parallel("fully_shard" if self.dp_shard != 1 else "replicate")

    def _check_pipeline(self) -> None:
        if self.pp == 1:
            if self.pipeline is not None:
                raise ConfigError("Parallel(pipeline=...) needs pp > 1 (how many ranks the stages are spread over)")
            return
        if self.pipeline is None:
            object.__setattr__(self, "pipeline", Pipeline())
        elif not isinstance(self.pipeline, Pipeline):
            raise ConfigError(f"Parallel(pipeline={self.pipeline!r}): a spmd_ort.Pipeline(microbatches=..., "
                              "schedule=..., stages_per_rank=..., split=...)")
        others = [name for name in ("dp_shard", "cp", "tp", "ep") if getattr(self, name) != 1]
        if others:
            raise ConfigError(f"Parallel({self.degrees_text()}): pipeline parallelism with "
                              f"{' and '.join(others)} is not built in this release yet; give pp alone or with "
                              "dp_replicate")

    def _check_experts(self) -> None:
        if self.ep == 1:
            if self.experts is not None:
                raise ConfigError(f"Parallel(experts={self.experts!r}) needs ep > 1 (how many ranks the experts are "
                                  "spread over)")
            return
        if not isinstance(self.experts, str) or not self.experts:
            raise ConfigError(f"Parallel(ep={self.ep}): give experts, an FQN glob of the expert modules (whose "
                              "parameters carry a leading expert dim), e.g. 'model.layers.*.mlp.experts'")
        if self.dp_shard == 1:
            raise ConfigError(f"Parallel(ep={self.ep}): ep borrows its ranks from dp_shard; give dp_shard (a "
                              f"multiple of {self.ep}, or -1)")
        others = [name for name in ("dp_replicate", "cp", "tp") if getattr(self, name) != 1]
        if others:
            raise ConfigError(f"Parallel({self.degrees_text()}): expert parallelism with "
                              f"{' and '.join(others)} is not built in this release yet; give ep with dp_shard")
        if self.dp_shard != -1 and self.dp_shard % self.ep:
            raise ConfigError(f"Parallel(dp_shard={self.dp_shard}, ep={self.ep}): ep borrows its ranks from "
                              "dp_shard, so it must divide dp_shard")

    def __repr__(self) -> str:  # the degrees and the settings given, not every default
        given = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return f"Parallel({', '.join(given)})"

    # ------------------------------------------------------------------ degrees
    def degrees_text(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in (*MESH_ORDER, "ep") if getattr(self, name) != 1)

    def sizes(self, world_size: int) -> dict[str, int]:
        """Each mesh degree for ``world_size`` ranks (a ``-1`` resolved); a ConfigError naming each degree where
        their product is not the world."""
        sizes = {name: getattr(self, name) for name in MESH_ORDER}
        rank, real = world()
        rank = rank if real > 1 else None  # (a plan's fake world names no rank)
        known = math.prod(n for n in sizes.values() if n != -1)
        rest = next((name for name, n in sizes.items() if n == -1), None)
        if rest is not None:
            if world_size % known:
                raise ConfigError(f"Parallel({self.degrees_text()}): the other degrees' product, {known}, does not "
                                  f"divide the world of {world_size} ranks, so {rest}=-1 has no size", rank=rank)
            sizes[rest] = world_size // known
        if math.prod(sizes.values()) != world_size:
            named = " x ".join(f"{name} {n}" for name, n in sizes.items())
            raise ConfigError(f"Parallel({self.degrees_text() or 'every degree 1'}): {named} = "
                              f"{math.prod(sizes.values())} ranks, but the world has {world_size}. Fix: degrees "
                              "whose product is the world size (one of them may be -1: the rest)", rank=rank)
        return sizes

    def mesh_shape(self, world_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dimension names, sizes) of the mesh, outermost first, the dimensions above 1 only."""
        sizes = self.sizes(world_size)
        dims = [(name, n) for name, n in sizes.items() if n > 1]
        return tuple(d for d, _ in dims), tuple(n for _, n in dims)

    # ------------------------------------------------------------------ what the passes consume
    def lower(self, world_size: int | None = None) -> DataParallel | TensorParallel:
        """The mode objects the passes consume, for ``world_size`` ranks (default: this process's world)."""
        world_size = world()[1] if world_size is None else world_size
        cached = self.__dict__.get("_lowered")
        if cached is not None and cached[0] == world_size:
            return cached[1]
        sizes = self.sizes(world_size)
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        data = self._data_parallel("fully_shard" if sizes["dp_shard"] > 1 else "replicate")
        if sizes["pp"] > 1:  # the stages over the pp ranks
            mode = PipelineParallel(pp=sizes["pp"], pipeline=self.pipeline, dp=sizes["dp_replicate"])
        elif self.ep > 1:  # fully_shard over every rank, the experts computed by expert over ep ranks
            if sizes["dp_shard"] % self.ep:
                raise ConfigError(f"Parallel({self.degrees_text()}): dp_shard is {sizes['dp_shard']} on "
                                  f"{world_size} ranks, which ep={self.ep} does not divide")
            settings = {k: getattr(self, k) for k in DP_SETTINGS}
            mode = ExpertParallel(ep=self.ep, experts=self.experts, parallel_style="fully_shard", **settings)
        elif sizes["cp"] > 1:  # data parallelism over every rank, the sequence split over each cp group
            settings = {k: getattr(self, k) for k in DP_SETTINGS}
            mode = ContextParallel(cp=sizes["cp"], seq_dim=self.seq_dim, **settings,
                                   parallel_style="fully_shard" if sizes["dp_shard"] > 1 else "replicate")
        elif sizes["tp"] == 1:
            mode = data
        elif dp == 1:
            mode = TensorParallel(dict(self.tp_plan), mesh=(sizes["tp"],))
        else:
            mode = TensorParallel(dict(self.tp_plan), mesh=(dp, sizes["tp"]), data_parallel=data)
        object.__setattr__(self, "_lowered", (world_size, mode))
        return mode

    def _data_parallel(self, style: str) -> DataParallel:
        try:
            return DataParallel(parallel_style=style, **{k: getattr(self, k) for k in DP_SETTINGS})
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc).replace("DataParallel(", "Parallel(", 1)) from exc

    @classmethod
    def of(cls, mode, world_size: int | None = None) -> Parallel | None:
        """The layout a mode stands for (``DataParallel(...)`` and ``TensorParallel(...)`` are shorthands of it)
        on ``world_size`` ranks (default: this process's world); None for None."""
        if mode is None or isinstance(mode, Parallel):
            return mode
        world_size = world()[1] if world_size is None else world_size
        if isinstance(mode, PipelineParallel):
            return cls(pp=mode.pp, pipeline=mode.pipeline, **({"dp_replicate": mode.dp} if mode.dp > 1 else {}))
        if isinstance(mode, ExpertParallel):
            settings = {k: getattr(mode, k) for k in DP_SETTINGS}
            return cls(dp_shard=world_size, ep=mode.ep, experts=mode.experts, **settings)
        if isinstance(mode, ContextParallel):
            settings = {k: getattr(mode, k) for k in DP_SETTINGS}
            dp = world_size // mode.cp
            degree = {} if dp == 1 else {"dp_shard" if mode.sharded else "dp_replicate": dp}
            return cls(cp=mode.cp, seq_dim=mode.seq_dim, **degree, **settings)
        if isinstance(mode, DataParallel):
            settings = {k: getattr(mode, k) for k in DP_SETTINGS}
            degree = {"dp_shard" if mode.sharded else "dp_replicate": world_size}
            return cls(**degree, **settings)
        if isinstance(mode, TensorParallel):
            shape = mode.mesh if isinstance(mode.mesh, tuple) else (
                tuple(mode.mesh.mesh.shape) if mode.mesh is not None else (world_size,))
            tp = shape[-1]
            dp = mode.data_parallel
            degrees = {} if dp is None else {"dp_shard" if dp.sharded else "dp_replicate": shape[0]}
            settings = {k: getattr(dp, k) for k in DP_SETTINGS} if dp is not None else {}
            return cls(tp=tp, tp_plan=dict(mode.plan), **degrees, **settings)
        raise TypeError(f"parallel_mode={mode!r} is not a spmd_ort.Parallel, DataParallel or TensorParallel")

    def describe(self, world_size: int | None = None) -> str:
        """The layout in words: ``Parallel(dp_shard=4, tp=2): mesh dp_shard 4 x tp 2``."""
        world_size = world()[1] if world_size is None else world_size
        names, shape = self.mesh_shape(world_size)
        mesh = " x ".join(f"{n} {s}" for n, s in zip(names, shape)) or "one rank"
        degrees = [f"{n}={s}" for n, s in zip(names, shape)]
        if self.ep > 1:  # borrowed from dp_shard: no mesh dim of its own in the world's
            degrees.append(f"ep={self.ep}")
            mesh += f", experts {self.experts!r} computed by expert over ep {self.ep} (borrowed from dp_shard)"
        return f"Parallel({', '.join(degrees)}): mesh {mesh}"

    def replace(self, **changes) -> Parallel:
        return dataclasses.replace(self, **changes)


def as_mode(mode, world_size: int | None = None):
    """What the passes consume for a user's ``parallel_mode``: a Parallel lowered, anything else as it is."""
    return mode.lower(world_size) if isinstance(mode, Parallel) else mode
