"""A plan's answer (:class:`Plan`): what one rank holds, sends and computes in one step, and whether it fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spmd_ort.plan.device import DeviceSpec

MiB, GiB = 2**20, 2**30


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


@dataclass
class Plan:
    """One rank's step, planned without running it (:meth:`spmd_ort.CompiledStep.plan`).

    ``per_rank_bytes``: ``params``, ``grads`` (held between steps), ``optimizer``, ``buffers``, ``activations``
    (the planned peak of the values the step creates: ``train_step.memory()``'s ``planned_activation_peak``),
    ``comm_buffers`` (reduction inputs a collective library holds while in flight: gloo's copies) and ``peak``
    (the most live at once: the state, plus the values and held buffers at the step's worst node), ``reserved``
    (``peak`` with the caching allocator's fragmentation: what ``torch.cuda.max_memory_reserved()`` would read) and
    ``outside_allocator`` (the CUDA context and NCCL's buffers: the device's ``achieved.outside_allocator``).
    ``comm_bytes`` / ``comm_calls``: per collective kind, counted as ``train_step.comm`` counts them (an
    all-gather's gathered bytes; the others' full input).  ``flops``: of the whole step (forward, backward,
    optimizer), by torch's formulas (attention's by torch's sdpa counts, a causal one as half:
    :mod:`spmd_ort.graph.flops`), ``recompute_flops`` the part of them the backward spends recomputing forward
    values (activation checkpointing); ``unpriced``: ops that compute but that no formula prices, by node count (their
    FLOPs are not in ``flops`` nor in the predicted time: the table says so).  ``predicted_step_s``: a roofline on
    ``device`` walked in the schedule's
    order (:mod:`spmd_ort.plan.cost`) on the device's achieved rates (``device.figures()`` lists them against the data
sheet's).  ``fits``: ``reserved`` and ``outside_allocator`` within the device's memory.
    """

    world_size: int
    rank: int
    device: DeviceSpec
    parallel: str
    backend: str
    per_rank_bytes: dict
    comm_bytes: dict
    comm_calls: dict
    flops: int
    predicted_step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    graph_nodes: int
    exported: bool
    planning_s: float = 0.0
    main_dtype: object = None  # the dtype with the most FLOPs (MFU is against its peak)
    export: dict = field(default_factory=dict)  # ORT: segments exported, export seconds, fallbacks {segment: why}
    memory_over_step: tuple = field(default=(), repr=False)  # bytes live at each node of the step, state included
    unpriced: dict = field(default_factory=dict)  # ops that compute but no formula prices -> nodes (0 FLOPs each)
    recompute_flops: int = 0  # of ``flops``, the backward's recomputation (activation checkpointing)
    compute_s_by_kind: dict = field(default_factory=dict)  # compute time: matmul, attention, memory-bound, dispatch
    layout_notes: tuple = ()  # what the layout's passes did to the graph (context parallel: the sequence's split)
    repricer: Callable | None = field(default=None, repr=False, compare=False)  # DeviceSpec -> Plan, same graph
    cached_from: str | None = field(default=None, compare=False)  # the cache entry it was read from (plan/cache.py)
    first_planning_s: float | None = field(default=None, compare=False)  # from the cache: the planning it saved

    def on(self, device) -> Plan:
        """The same planned step priced on another device (a name of ``DEVICES`` or a :class:`DeviceSpec`), in
        about a second: the graph is walked again, nothing is traced."""
        from spmd_ort.plan.device import device_spec

        if self.repricer is None:
            raise ValueError("this Plan keeps no graph to price again: plan the step with CompiledStep.plan()")
        return self.repricer(device_spec(device))

    @property
    def device_bytes(self) -> int:
        """What the rank needs of the device: the allocator's reserved peak and what lives outside it."""
        return self.per_rank_bytes["reserved"] + self.per_rank_bytes["outside_allocator"]

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.device.memory_bytes

    @property
    def model_flops(self) -> int:
        """The step's FLOPs less the backward's recomputation: what MFU counts."""
        return self.flops - self.recompute_flops

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation; causal attention as half) over the step's predicted time and the device's
        data-sheet peak of the step's main dtype."""
        peak = self.device.flops_for(self.main_dtype)
        return self.model_flops / self.predicted_step_s / peak if self.predicted_step_s > 0 else 0.0

    def table(self) -> str:
        b = self.per_rank_bytes
        rows = [("parameters", _size(b["params"])), ("gradients (between steps)", _size(b["grads"])),
                ("optimizer state", _size(b["optimizer"])), ("buffers", _size(b["buffers"])),
                ("activations (planned peak)", _size(b["activations"])),
                ("collective buffers (peak)", _size(b["comm_buffers"])), ("peak (allocated)", _size(b["peak"])),
                (f"reserved (+{100 * self.device.achieved.fragmentation:.0f}% allocator fragmentation)",
                 _size(b["reserved"])),
                ("outside the allocator (CUDA context, NCCL buffers)", _size(b["outside_allocator"])),
                ("needed of the device", f"{_size(self.device_bytes)} of {_size(self.device.memory_bytes)}: "
                                         f"{'fits' if self.fits else 'does NOT fit'}")]
        lines = [f"plan: rank {self.rank} of {self.world_size}, {self.parallel}, backend {self.backend}, on "
                 f"{self.device.name} ({self.graph_nodes:,} graph nodes; planned in {self.planning_s:.1f} s"
                 f"{', exported' if self.exported else ''}{self._cached()})", *self.layout_notes, "",
                 "| per rank | bytes |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in rows]
        lines += ["", "| collective | calls | bytes per step |", "|---|---|---|"]
        lines += [f"| {k} | {self.comm_calls[k]} | {_size(v)} |" for k, v in self.comm_bytes.items()] or [
            "| none | 0 | 0 |"]
        dtype = str(self.main_dtype).replace("torch.", "")
        recomputed = (f" ({self.recompute_flops / 1e12:.2f} of them recomputation)" if self.recompute_flops else "")
        lines += ["", f"step: {self.flops / 1e12:.2f} TFLOP{recomputed}; "
                      f"predicted {self.predicted_step_s * 1e3:.1f} ms "
                      f"(compute {self.compute_s * 1e3:.1f} ms, collectives {self.comm_s * 1e3:.1f} ms of which "
                      f"{self.exposed_comm_s * 1e3:.1f} ms not hidden); MFU {100 * self.mfu:.1f}% (model FLOPs, "
                      f"recomputation not counted, of {self.device.name}'s data-sheet {dtype} peak, "
                      f"{self.device.flops_for(self.main_dtype) / 1e12:.0f} TFLOP/s)"]
        if self.compute_s_by_kind:
            lines.append("compute by kind: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                                         sorted(self.compute_s_by_kind.items(), key=lambda kv: -kv[1])))
        lines += ["", "| device figure | data sheet | used |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in self.device.figures()]
        if self.unpriced:
            lines.append("not priced (no FLOP formula: counted by their bytes alone, so the step's FLOPs and time are "
                         "understated): " + ", ".join(f"{op} x{n}" for op, n in self.unpriced.items()))
        if self.export:
            fell = self.export["fallbacks"]
            first = next(iter(fell.items()), None)
            lines.append(f"ORT export: {self.export['segments']} segment(s) in {self.export['export_s']:.1f} s"
                         + (f"; {len(fell)} fall back to fx, the first ({first[0]}) because: {first[1][:300]}"
                            if fell else ", none falls back to fx"))
        return "\n".join(lines)

    def explain(self, picture: str | Path | None = None) -> str:
        """The plan as a table; with ``picture``, also a PNG of the memory live over the step written there."""
        if picture is not None:
            self.draw_memory(picture)
        return self.table()

    def draw_memory(self, path: str | Path) -> Path:
        """A PNG of the bytes live at each node of the step (state, values, held collective buffers), with the
        device's memory as a line."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        fig, ax = plt.subplots(figsize=(10, 3.5))
        ax.plot([v / GiB for v in self.memory_over_step], lw=1)
        ax.axhline(self.device.memory_bytes / GiB, color="red", ls="--", lw=1, label=self.device.name)
        ax.set_xlabel("node of the scheduled step")
        ax.set_ylabel("GiB live (rank %d)" % self.rank)
        ax.set_title(f"{self.parallel} over {self.world_size} ranks: peak {_size(self.per_rank_bytes['peak'])}")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def _cached(self) -> str:
        if self.cached_from is None:
            return ""
        return f"; from the cache, planned in {self.first_planning_s:.1f} s at first: {self.cached_from}"

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "device": self.device.name,
                "parallel": self.parallel, "backend": self.backend, "per_rank_bytes": dict(self.per_rank_bytes),
                "comm_bytes": dict(self.comm_bytes), "comm_calls": dict(self.comm_calls), "flops": self.flops,
                "predicted_step_s": self.predicted_step_s, "fits": self.fits, "graph_nodes": self.graph_nodes,
                "recompute_flops": self.recompute_flops, "mfu": self.mfu, "device_bytes": self.device_bytes,
                "compute_s_by_kind": dict(self.compute_s_by_kind), "compute_s": self.compute_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s,
                "planning_s": self.planning_s, "export": self.export, "unpriced": dict(self.unpriced),
                "cached_from": self.cached_from, "first_planning_s": self.first_planning_s}
