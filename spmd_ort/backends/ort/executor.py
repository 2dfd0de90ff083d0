"""The "ort" executor: graph segments run in ONNX Runtime, host nodes in torch.

:func:`build_ort_executor` partitions the finished graph (:mod:`spmd_ort.backends.ort.partition`),
exports and opens each segment (:mod:`spmd_ort.backends.ort.session`; dynamic-shape segments:
:mod:`spmd_ort.backends.ort.sizes`) and returns an :class:`OrtExecutor`.  The top-level graph,
with host nodes (the fused optimizer update, collectives, random ops) between segments,
runs as an fx GraphModule.

The first run of each compiled variant is :class:`~spmd_ort.backends.ort.choice.FirstRun`: every
segment also runs its fx graph, is verified against it (``Options.verify``, the default)
and timed, and (``Options.segment_executor`` = ``auto``) the faster executor runs it from
then on.  A segment that fails to export, load, run or verify falls back to its fx graph
(``FALLBACK_TO_FX``, the default, with one WARNING) or raises (``FALLBACK_DISABLE``); a
configuration ORT cannot honour (a missing execution provider) is a
:class:`~spmd_ort.errors.ConfigError`, never a fallback.  The graph it gets is finished:
it partitions, exports and runs, and rewrites nothing.
"""

from __future__ import annotations

import copy
import threading
import time

import torch
import torch.distributed as dist
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from spmd_ort.backends.interface import ExecutorBase
from spmd_ort.backends.timed import TimedInterpreter
from spmd_ort.options import Options, get_logger
from spmd_ort.backends.ort.choice import FirstRun, choose_whole, everywhere
from spmd_ort.backends.ort.coverage import HOST_ONLY
from spmd_ort.backends.ort.partition import partition_for_ort, why_host
from spmd_ort.backends.ort.remembered import Remembered, choices_key, recall
from spmd_ort.backends.ort.session import OrtSegment, is_symbolic, load_segment, providers_for, segment_device
from spmd_ort.backends.ort.sizes import SizedSegments, dynamic_segment
from spmd_ort.backends.ort.stats import OrtStats, WholeChoice
from spmd_ort.errors import CompileError
from spmd_ort.graph.decisions import Decision
from spmd_ort.runtime.devices import now
from spmd_ort.runtime.step_runtime import active

logger = get_logger(__name__)

progress = get_logger("spmd_ort.progress")  # shown at the default level (options.configure_logging)

PROGRESS_AFTER_S = 2.0  # an export still running after this long gets a progress line


class OrtExecutor(ExecutorBase):
    name = "ort"
    reuses_buffers = True  # segment outputs live in tensors that the next step overwrites

    def __init__(self, gm: fx.GraphModule, *, verify: bool, policy: str, stats: OrtStats,
                 segment_executor: str = "auto", whole: fx.GraphModule | None = None,
                 source: fx.GraphModule | None = None, options: Options | None = None,
                 choices_key: str | None = None, names: list[str] | None = None):
        self.gm = gm
        # with auto: the entry an earlier run's choices were written to (recalled on the first run), the partition
        self.choices_key, self.names = choices_key, names or []
        self.remembered: Remembered | None = None
        self.whole = whole  # the same graph unpartitioned: with auto, a candidate for every step
        # with auto and Options.auto_inductor: the whole graph for inductor's candidate, which the tuner
        # (spmd_ort.tuner) compiles, times against what runs and hands to adopt() when it wins
        self.candidate_source = source
        self.options = options
        self.inductor = None  # the whole graph compiled by inductor (an InductorExecutor), when it won
        # what runs the steps: "segments" (as chosen), "ort" (every segment on ORT, those that chose fx too), "fx"
        # (whole, unsplit) or "inductor"
        self.runs = "segments"
        # auto: the first run's losing candidates are kept (sessions of segments that chose fx, the unsplit graph)
        # until the tuner has seen the steady steps and settled or revisited the whole choice once
        self.revisit_pending = False
        self.steady: list[float] = []  # while revisit_pending: each step's run, as choose_whole times a candidate
        self.verify = verify
        self.policy = policy
        self.stats = stats
        self.segment_executor = segment_executor
        self.first_run_done = False
        self.steps = 0

    @property
    def segments(self) -> list[OrtSegment | SizedSegments]:
        """The ORT segments (a dynamic-shape segment is one module whatever its sizes: an :class:`OrtSegment`
        with dynamic axes, or a :class:`SizedSegments` exported per set of sizes)."""
        return [m for m in self.gm.modules() if isinstance(m, (OrtSegment, SizedSegments))]

    def running(self) -> fx.GraphModule:
        """What runs the steps now: the segments (as chosen, or every one on ORT), the whole graph on fx, or
        inductor's."""
        return {"segments": self.gm, "ort": self.gm, "fx": self.whole,
                "inductor": self.inductor.gm if self.inductor is not None else None}[self.runs]

    def adopt(self, name: str, runner) -> None:
        """From the next step ``runner`` (``"inductor"``: an executor with ``gm`` and ``describe()``, the tuner's
        candidate that won its timing) runs the steps; what no longer runs is freed."""
        self.candidate_source = None
        self.inductor, self.runs = runner, name
        self.settle()

    def candidates(self) -> dict[str, fx.GraphModule]:
        """The whole-step candidates still held, each runnable as it would run the steps: ``"segments"`` (as
        chosen; none when every segment chose fx: that is ``fx`` with splits), ``"ort"`` (when a segment chose fx,
        its session kept) and ``"fx"`` (unsplit).  The same on every rank (their segment choices agree)."""
        chose_fx = [seg for seg in self.segments if seg.held and self._chose_fx(seg)]
        out: dict[str, fx.GraphModule] = {}
        if any(seg.held and not self._chose_fx(seg) for seg in self.segments):
            out["segments"] = Parked(self.gm, chose_fx, True)
        if chose_fx:
            out["ort"] = Parked(self.gm, chose_fx, False)
        if self.whole is not None:
            out["fx"] = self.whole
        return {name: out[name] for name in ("segments", "ort", "fx") if everywhere(name in out)}

    def _chose_fx(self, seg) -> bool:
        choice = self.stats.choices.get(seg.name)
        return choice is not None and choice.executor == "fx"

    def revisit(self, inputs: list, step: int) -> Decision:
        """Time the candidates still held again, on ``inputs`` (copies), against what runs; switch to one that
        is faster by :data:`~spmd_ort.backends.ort.choice.MARGIN` (every rank alike), then free the rest."""
        before = self.runs
        self.stats.revisit, self.steady = None, []
        self.runs = choose_whole(self.candidates(), inputs, self.stats, field="revisit", keep=before)
        self.stats.revisit_step = step
        self._park_as_chosen()
        if self.remembered is not None and self.remembered.path is not None:
            self.remembered.update(whole={"executor": self.runs,
                                          "times_ms": [list(t) for t in self.stats.revisit.times_ms]})
        self.settle()
        times = "; ".join(f"{k} {ms:.2f} ms" for k, ms in self.stats.revisit.times_ms)
        if self.runs == before:
            return Decision("whole graph", f"revisited at step {step}: kept {before}", times)
        return Decision("whole graph", f"revisited at step {step}: {before} -> {self.runs}", times)

    def settle(self) -> None:
        """The whole choice is final: free the candidates that lost (sessions of parked segments, the unsplit
        graph)."""
        self.revisit_pending, self.steady = False, []
        self._release_losers()

    def _park_as_chosen(self) -> None:
        """Segments that chose fx run on fx, unless every segment runs on ORT (``runs`` = ``"ort"``)."""
        for seg in self.segments:
            if self._chose_fx(seg):
                seg.park(self.runs != "ort")

    def decisions(self) -> list[Decision]:
        """What the first run chose from its timings (and what it was made to run: a forced executor, a
        fallback), with the numbers, for the tuner and ``explain()``."""
        out = [Decision(f"segment {name}", choice.executor,
                        f"ort {choice.ort_ms:.2f} ms vs fx {choice.fx_ms:.2f} ms{choice.since}"
                        if choice.ort_ms is not None
                        else f"static: SPMD_ORT_SEGMENT_EXECUTOR={choice.executor}")
               for name, choice in self.stats.choices.items()]
        out += [Decision(f"segment {name}", "fx", f"fell back: {why}")
                for name, why in self.stats.fallback_reasons.items()]
        whole = self.stats.whole
        if whole is not None:
            out.append(Decision("whole graph", whole.executor,
                                ("; ".join(f"{k} {ms:.2f} ms" for k, ms in whole.times_ms) or "no segment runs on ORT")
                                + (", remembered from an earlier run" if whole.remembered else "")))
        return out

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            self.steps += 1
            if not self.first_run_done:
                return self._first_run(inputs)
            gm = self.running()
            recorder = active().recorder
            if recorder is not None:  # a profiled step: node by node (segment by segment), timed
                return list(TimedInterpreter(gm, recorder).run(*inputs))
            if self.revisit_pending:  # the tuner compares these runs with the candidates' first-run times
                t0 = now()
                out = list(gm(*inputs))
                active().comm.finish()
                self.steady.append(now() - t0)
                return out
            return list(gm(*inputs))

    def _first_run(self, inputs: list) -> list:
        # On copies: host nodes update state in place, and a segment failing after
        # them (FALLBACK_DISABLE) must leave the real state untouched.
        t0 = time.perf_counter()
        if self.segment_executor == "auto" and self.options is not None:
            self.remembered = recall(self.choices_key, self.options, self.names)
        first = FirstRun(self.gm, self.stats, policy=self.policy, verify=self.verify,
                         segment_executor=self.segment_executor, remembered=self.remembered)
        copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        out = first.run(*copies)
        if first.local and not everywhere(first.error is None):  # (every rank has run its graph to the end)
            raise first.error or CompileError("an ORT segment failed on another rank (see its error); every "
                                              "rank stops", rank=dist.get_rank())
        if self.segment_executor == "auto" and self.whole is not None:
            known = self.remembered.whole if self.remembered is not None else None
            candidates = self.candidates()
            if known is not None and known["executor"] in candidates:
                self.runs = known["executor"]
                self.stats.whole = WholeChoice(self.runs, tuple(map(tuple, known["times_ms"])), remembered=True)
            elif set(candidates) == {"fx"}:  # no segment runs on ORT: the same ops, without the splits
                self.runs, self.stats.whole = "fx", WholeChoice("fx")
            else:
                out = [o.clone() if isinstance(o, torch.Tensor) else o for o in out]  # (timing reuses buffers)
                self.runs = choose_whole(candidates, copies, self.stats)
            self._park_as_chosen()
            # the losers stay until the tuner has seen steady steps (a choice that loses then is revisited once)
            self.revisit_pending = len(candidates) > 1
            if not self.revisit_pending:
                self._release_losers()
        if self.remembered is not None:
            self._remember()
        self.first_run_done = True
        self.stats.first_run_seconds = time.perf_counter() - t0
        return list(out)

    def _remember(self) -> None:
        """Write what this first run measured and chose (nothing when it all came from an earlier run)."""
        measured = {name: {"executor": c.executor, "ort_ms": c.ort_ms, "fx_ms": c.fx_ms}
                    for name, c in self.stats.choices.items() if c.ort_ms is not None}
        whole = self.stats.whole
        if whole is None or (self.remembered.recalled and measured == self.remembered.data.get("segments")):
            return
        self.remembered.update(segments=measured, whole={"executor": whole.executor,
                                                         "times_ms": [list(t) for t in whole.times_ms]})

    def remember_candidate(self, outcome: str, detail: str) -> None:
        """The tuner's verdict on inductor's candidate (``kept``, ``dropped``, ``failed``), for the next run."""
        if self.remembered is not None and self.remembered.path is not None:
            self.remembered.update(inductor={"outcome": outcome, "detail": detail})

    def _release_losers(self) -> None:
        if self.revisit_pending:
            return
        for segment in self.segments:
            if self.runs not in ("segments", "ort") or segment.parked:  # no segment runs again, or this one
                segment.release()  # its session and buffers
        if self.runs != "fx":
            self.whole = None  # the losing candidates' graphs and compiled code
        if self.runs != "inductor":
            self.inductor = None

    def describe(self) -> list[str]:
        stats = self.stats
        lines = [f"ORT segments: {stats.segments} (fell back to fx: {', '.join(stats.fallbacks) or 'none'}; "
                 f"export {stats.export_seconds:.2f}s, {stats.cache_hits} from cache; first run "
                 f"{stats.first_run_seconds:.2f}s, {stats.verified} verified in {stats.verify_seconds:.2f}s)"]
        lines += [f"  {name} runs on {choice}" for name, choice in stats.choices.items()]
        if stats.whole is not None:
            lines.append(f"  {stats.whole}")
        if stats.revisit is not None:
            lines.append(f"  revisited at step {stats.revisit_step}: {stats.revisit}")
        if stats.upgrade is not None:
            lines.append(f"  at step {stats.upgrade_step}: {stats.upgrade} (inductor compiled and timed in "
                         f"{stats.upgrade_seconds:.1f}s)")
        if self.inductor is not None:
            lines += [f"  {line}" for line in self.inductor.describe()]
        lines += [f"  {name}: differs from fx no more than fx from float64 (ill-conditioned; accepted)"
                  for name in stats.ill_conditioned]
        lines += [f"  host: {op} ({why})" for op, why in stats.host_ops.items()]
        return lines


def build_ort_executor(gm: fx.GraphModule, options: Options) -> OrtExecutor:
    """Partition the finished graph ``gm``, export and load each segment into an :class:`OrtExecutor`."""
    policy = options.fallback_policy
    stats = OrtStats()
    for node in gm.graph.nodes:
        reason = why_host(node) if node.op == "call_function" else None
        if reason is not None:
            # a node a pass keeps on the host (HOST_ONLY) is listed apart from the same op elsewhere in the graph
            where = " (kept on the host by a pass)" if node.meta.get(HOST_ONLY) else ""
            stats.host_ops[f"{node.target}{where}"] = reason
    # the graph before partitioning (which edits it), for the automatic choice's whole-graph candidate
    whole = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if options.segment_executor == "auto" else None
    fused, names = partition_for_ort(gm)
    stats.segments = len(names)
    threads = torch.get_num_threads()
    device = None  # the first segment's: part of the remembered choices' key
    with _Progress(len(names)) as shown:
        for i, name in enumerate(names):
            sub = fused.get_submodule(name)
            where = segment_device(sub)
            device = device or where
            providers = providers_for(where)  # a ConfigError, never a fallback
            shown.start(i, name, sum(1 for n in sub.graph.nodes if n.op == "call_function"))
            if is_symbolic(sub):
                segment = dynamic_segment(name, sub, options, stats, threads=threads, providers=providers)
            else:
                segment = load_segment(name, sub, options, stats, threads=threads, providers=providers)
            if segment is not None:
                setattr(fused, name, segment)
    # inductor's candidate (with auto): the whole graph, static shapes only (inductor's executor leaves symbolic
    # ops on the host), compiled by the tuner if the program lives long enough to pay for it (spmd_ort.tuner)
    source = None
    if whole is not None and options.auto_inductor and not is_symbolic(whole):
        source = _LazyGraphModule(whole, copy.deepcopy(whole.graph))  # code generated only if inductor needs it
    key = None
    if whole is not None and options.remember_choices:
        key = choices_key(whole, options, device)
    return OrtExecutor(fused, verify=options.verify, policy=policy, stats=stats,
                       segment_executor=options.segment_executor, whole=whole, source=source, options=options,
                       choices_key=key, names=list(names))


class Parked(torch.nn.Module):
    """The partitioned graph run with ``segments`` (those that chose fx) parked on fx (``parked``) or on ORT, and
    left as they were: a whole-step candidate of the automatic choice (``choose_whole``)."""

    def __init__(self, gm: fx.GraphModule, segments: list, parked: bool):
        super().__init__()
        self.gm, self.parked, self._segments = gm, parked, segments

    def forward(self, *inputs):
        before = [seg.parked for seg in self._segments]
        for seg in self._segments:
            seg.park(self.parked)
        try:
            return self.gm(*inputs)
        finally:
            for seg, was in zip(self._segments, before):
                seg.park(was)


class _Progress:
    """One line when an export takes longer than :data:`PROGRESS_AFTER_S` (big models), and one when all are done."""

    def __init__(self, total: int):
        self.total = total
        self.t0 = time.perf_counter()
        self.timer: threading.Timer | None = None
        self.shown = False

    def __enter__(self) -> _Progress:
        return self

    def start(self, index: int, name: str, ops: int) -> None:
        self._cancel()

        def show() -> None:
            self.shown = True
            progress.info("exporting ORT segment %s (%d of %d, %d ops) ...", name, index + 1, self.total, ops)

        self.timer = threading.Timer(PROGRESS_AFTER_S, show)
        self.timer.daemon = True
        self.timer.start()

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def __exit__(self, *exc) -> None:
        self._cancel()
        if self.shown:
            progress.info("exported %d ORT segment(s) in %.1fs (cached for the next run)", self.total,
                          time.perf_counter() - self.t0)
