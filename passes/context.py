"""What a graph pass may read and write besides the graph: :class:`PassContext` and its typed results."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from spmd_ort.runtime.taps import TapRegistry
from spmd_ort.distributed.parallel import DataParallel
from spmd_ort.distributed.sharding import ShardSpec
from spmd_ort.graph.slots import Slot
from spmd_ort.capture.state import StateLayout


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


class PassResult:
    """What a pass records besides the graph: subclass it (a frozen dataclass) next to the pass that makes it.

    ``ctx.results.record(result)`` keeps one value per type for the compiled variant
    (``CompiledProgram.results``); :meth:`lines` is how ``describe()`` and ``explain()`` show it
    (both render results through :meth:`PassResults.lines`; no lines: not shown).
    """

    def lines(self) -> list[str]:
        return []


R = TypeVar("R", bound=PassResult)


class PassResults:
    """The results the passes of one compiled variant recorded, by type, in the order they were recorded."""

    def __init__(self):
        self._by_type: dict[type[PassResult], PassResult] = {}

    def record(self, result: PassResult) -> None:
        if not isinstance(result, PassResult):
            raise TypeError(f"ctx.results.record() takes a PassResult, not {type(result).__name__}")
        self._by_type.pop(type(result), None)  # a re-record moves it to the end
        self._by_type[type(result)] = result

    def get(self, kind: type[R]) -> R | None:
        """The recorded result of type ``kind``, or None when no pass recorded one."""
        return self._by_type.get(kind)  # type: ignore[return-value]

    def __contains__(self, kind: type[PassResult]) -> bool:
        return kind in self._by_type

    def __iter__(self) -> Iterator[PassResult]:
        return iter(list(self._by_type.values()))

    def lines(self) -> list[str]:
        """Every result's lines, in the order they were recorded: the one rendering of pass results."""
        return [line for result in self for line in result.lines()]

    def __repr__(self) -> str:
        return f"PassResults({', '.join(repr(r) for r in self)})"


@dataclass(kw_only=True)
class PassContext:
    """What passes may read and update besides the graph.

    ``input_slots``/``output_slots`` describe every placeholder/output (see
    :class:`spmd_ort.capture.state.Slot`); a pass that adds or removes graph inputs or
    outputs keeps them in step.  ``layout`` is the lifted state (user transforms
    read and extend it).  ``disabled`` names passes to skip; ``check_contracts``
    makes the runner check contracts on the graph (:mod:`spmd_ort.passes.contracts`).
    ``facts``: what holds of the graph by the contracts of the passes run so far (None until
    the first :func:`~spmd_ort.passes.runner.run_passes`, which starts from what the trace
    provides); ``taps``: the activation taps of the step being compiled (debug subscribers);
    ``activation_memory_budget``: what ``recompute_activations_pass`` may keep (1.0: all, as eager);
    ``rank_signatures``: what every rank traced (``split_replicated_matmuls_pass`` splits only what is alike).
    """

    input_slots: list[Slot]
    output_slots: list[Slot]
    mode: DataParallel | None = None
    world_size: int = 1  # the ranks the data-parallel passes reduce over (2-D: the dp dim's)
    group: str = ""  # their process group's name ("": the world; 2-D: the dp dim's group)
    rank: int = 0
    shard_specs: dict[int, ShardSpec] = field(default_factory=dict)  # fully_shard: param index -> spec
    layout: StateLayout | None = None
    disabled: frozenset[str] = frozenset()
    check_contracts: bool = False
    applied: list[PassRecord] = field(default_factory=list)
    results: PassResults = field(default_factory=PassResults)
    facts: set | None = None
    taps: TapRegistry | None = None
    activation_memory_budget: float | str = 1.0  # share of the recomputable saved bytes kept, or a policy name
    # expand mode on several ranks, by global rank: what every rank traced, {"nodes": node signatures, "state":
    # checksums of its parameters and buffers} (passes.expand; None: one process, or not every rank traced)
    rank_signatures: list[dict] | None = None
    # WARNINGs the step already gave (its compiler's set, kept across variants: each is given once per step)
    warned: set = field(default_factory=set)
    # the step's opaque calls (spmd_ort.runtime.opaque_calls.OpaqueCall), by index: what each host node runs
    opaque: tuple = ()
    # pipeline parallelism: the rows of one micro-batch, and the batch inputs (their slot indices) cut into them
    micro_rows: int = 0
    micro_batched: frozenset = frozenset()

    @property
    def sharded(self) -> bool:
        return self.mode is not None and self.mode.sharded
