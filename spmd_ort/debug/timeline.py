"""The step timeline behind ``train_step.profile(steps=N, path=...)``.

While a profiled step runs, its executor runs the graph through
:class:`TimedInterpreter` (node by node, timed) and the step's communicator
notes each collective from issue to completion; a :class:`Recorder` keeps the
spans on three lanes per rank: ``compute`` (ORT segments, or runs of fx ops),
``host`` (host nodes: the optimizer update, opaque parts, waits) and ``comm``
(collectives in flight).  After the last profiled step every rank's spans go
to rank 0, which writes ``<path>.json`` (Chrome / Perfetto trace: one process
per rank) and ``<path>.png`` (one step, compute and communication lanes per
rank, communication hidden behind compute shaded).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


from spmd_ort.runtime.recorder import Recorder, Span  # noqa: F401 - the timeline's spans, drawn here

LANES = ("compute", "host", "comm")


def chrome_trace(ranks: list[list[dict]]) -> dict:
    """Chrome / Perfetto trace events: one process per rank, one thread per lane."""
    events = []
    for rank, spans in enumerate(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, lane in enumerate(LANES):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
        for s in spans:
            events.append({"name": s["name"], "ph": "X", "pid": rank, "tid": LANES.index(s["lane"]),
                           "ts": s["start"] * 1e6, "dur": max(s["end"] - s["start"], 0.0) * 1e6,
                           "args": {"step": s["step"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _overlap(comm: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(comm[1], b[1]) - max(comm[0], b[0])) for b in busy)


def draw(ranks: list[list[dict]], bounds: list[list[tuple[float, float]]], path: Path, step: int) -> None:
    """A PNG of one step: per rank, compute / host / comm lanes; communication under compute shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"compute": "#4878a8", "host": "#e49444", "comm": "#6aa84f"}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(ranks)))
    yticks, ylabels = [], []
    t_min = min(b[step][0] for b in bounds)
    t_max = max(b[step][1] for b in bounds)
    hidden_total = comm_total = 0.0
    for rank, spans in enumerate(ranks):
        spans = [s for s in spans if s["step"] == step]
        busy = [(s["start"], s["end"]) for s in spans if s["lane"] == "compute"]
        for k, lane in enumerate(LANES):
            y = (len(ranks) - 1 - rank) * 4 + (2 - k)
            yticks.append(y + 0.4)
            ylabels.append(f"rank {rank} {lane}")
            lane_spans = [s for s in spans if s["lane"] == lane]
            ax.broken_barh([((s["start"] - t_min) * 1e3, (s["end"] - s["start"]) * 1e3) for s in lane_spans],
                           (y, 0.8), facecolors=colors[lane], edgecolors="white", linewidth=0.3)
            if lane == "comm":
                for s in lane_spans:
                    hidden = _overlap((s["start"], s["end"]), busy)
                    hidden_total += hidden
                    comm_total += s["end"] - s["start"]
                    for b in busy:
                        lo, hi = max(s["start"], b[0]), min(s["end"], b[1])
                        if hi > lo:
                            ax.broken_barh([((lo - t_min) * 1e3, (hi - lo) * 1e3)], (y, 0.8), facecolors="none",
                                           edgecolors="black", hatch="////", linewidth=0)
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_xlabel("ms since the step started")
    ax.set_xlim(0, (t_max - t_min) * 1e3 * 1.01)
    share = f"{hidden_total / comm_total:.0%} of communication time under compute" if comm_total else "no communication"
    ax.set_title(f"spmd_ort step timeline (step {step}: {(t_max - t_min) * 1e3:.1f} ms; {share})", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=lane) for lane, c in colors.items()]
              + [Patch(facecolor="none", hatch="////", label="communication overlapped by compute")],
              loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(recorders: list[Recorder], path: str | Path) -> tuple[Path, Path]:
    """``<path>.json`` and ``<path>.png`` from every rank's recorder (rank order)."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    ranks = [[asdict(s) for s in r.spans] for r in recorders]
    trace_path, png_path = base.with_suffix(".json"), base.with_suffix(".png")
    trace_path.write_text(json.dumps(chrome_trace(ranks)))
    bounds = [r.step_bounds for r in recorders]
    draw(ranks, bounds, png_path, step=max(0, min(len(b) for b in bounds) - 1))
    return trace_path, png_path
