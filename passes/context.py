"""What a graph pass may read and write besides the graph: :class:`PassContext` and its typed results."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_ort.parallel import DataParallel
from spmd_ort.sharding import ShardSpec
from spmd_ort.state import Slot, StateLayout


@dataclass(frozen=True, kw_only=True)
class PassRecord:
    """What one pass did: its name, time and node counts (``skipped``: disabled by name)."""

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    skipped: bool = False

    def __str__(self) -> str:
        if self.skipped:
            return f"{self.name}: disabled"
        return f"{self.name}: {self.nodes_before} -> {self.nodes_after} nodes, {self.seconds * 1e3:.1f} ms"


@dataclass(frozen=True)
class GradientBuckets:
    """``bucket_collectives_pass``: gradient node names and payload bytes per all-reduce bucket."""

    names: tuple[tuple[str, ...], ...]
    nbytes: tuple[int, ...]


@dataclass(frozen=True)
class ShardBuckets:
    """``bucket_shard_collectives_pass``: unsharded bytes per all-gather and per reduce-scatter bucket."""

    all_gather: tuple[int, ...]
    reduce_scatter: tuple[int, ...]


@dataclass(frozen=True)
class MemoryPlan:
    """``plan_memory_pass``: peak bytes of the values the graph creates, freed after their last use."""

    planned_peak_bytes: int


@dataclass(frozen=True)
class OffloadPlan:
    """The offload passes: optimizer ops moved to the host, parameter copies to the compute device."""

    optimizer_ops: int = 0
    param_device: str | None = None
    param_copies: int = 0


@dataclass(frozen=True)
class Lowering:
    """``lower_to_onnx_ops_pass``: how many nodes of each op were replaced by their decomposition."""

    lowered: dict[str, int]


@dataclass
class PassResults:
    """Analysis results the passes record; kept on the compiled program (``CompiledProgram.results``)."""

    gradient_buckets: GradientBuckets | None = None
    shard_buckets: ShardBuckets | None = None
    sharded_params: int = 0
    kept_for_backward: tuple[str, ...] = ()
    offload: OffloadPlan = field(default_factory=OffloadPlan)
    memory: MemoryPlan | None = None
    lowering: Lowering | None = None


@dataclass(kw_only=True)
class PassContext:
    """What passes may read and update besides the graph.

    ``input_slots``/``output_slots`` describe every placeholder/output (see
    :class:`spmd_ort.state.Slot`); a pass that adds or removes graph inputs or
    outputs keeps them in step.  ``layout`` is the lifted state (user transforms
    read and extend it).  ``disabled`` names passes to skip; ``check_contracts``
    makes the runner check each pass's ``requires`` / ``ensures``.
    """

    input_slots: list[Slot]
    output_slots: list[Slot]
    mode: DataParallel | None = None
    world_size: int = 1
    rank: int = 0
    shard_specs: dict[int, ShardSpec] = field(default_factory=dict)  # fully_shard: param index -> spec
    layout: StateLayout | None = None
    disabled: frozenset[str] = frozenset()
    check_contracts: bool = False
    applied: list[PassRecord] = field(default_factory=list)
    results: PassResults = field(default_factory=PassResults)

    @property
    def sharded(self) -> bool:
        return self.mode is not None and self.mode.sharded
