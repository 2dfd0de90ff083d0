"""The step's adaptive decisions in one place: what is chosen from measurements after compile, and the
recompiles those choices cause.

One :class:`Tuner` per :class:`~spmd_ort.step.CompiledStep`.  It owns

* **each segment's executor and the whole graph against its segments**: measured by the ORT backend on a
  program's checked first run (:mod:`spmd_ort.backends.ort.choice`, which stays where it measures) and
  reported upward as :class:`~spmd_ort.graph.decisions.Decision` records (``OrtExecutor.decisions()``),
  which the tuner collects; the whole choice is **revisited once**: the executor times the program's first
  ``MEASURED_STEPS`` steady runs, and where they are slower than another candidate measured on the first run
  the tuner has the candidates timed again before the next step (then the losers are freed);
* **inductor's candidate**: the whole graph compiled by inductor, timed against what runs and swapped in
  when faster.  Its compile costs seconds to minutes, so it is bought as in ski rental: the tuner times
  the program's first ``MEASURED_STEPS`` steady steps, predicts the compile's seconds
  (:class:`CompileCost`: seconds per graph node, calibrated by this process's last inductor compile) and
  compiles it only once the steady steps have spent as much (the candidate can at most double the
  time spent, and a short run never pays for it);
* **bucket_cap_mb='auto'**'s cap (:class:`~spmd_ort.buckets.BucketTuner` measures and predicts);
* **the recompiles** these cause: at most one per variant (:data:`RECOMPILES_PER_VARIANT`), each logged
  at INFO with its reason and listed by ``explain()``.

``Options.autotune`` off (``SPMD_ORT_AUTOTUNE=0``): the static choices (every segment ORT supports on ORT,
no whole-graph choice, no candidate, the starting bucket cap) and no recompiles: the same every run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx

from spmd_ort.backends.inductor import BackgroundCompile
from spmd_ort.buckets import BucketChoice, BucketTuner
from spmd_ort.distributed.parallel import AUTO_START_MB, DataParallel
from spmd_ort.graph.checking import short_error
from spmd_ort.graph.decisions import Decision
from spmd_ort.options import Options
from spmd_ort.program import CompiledProgram
from spmd_ort.runtime.collectives import control_group
from spmd_ort.runtime.devices import now

logger = logging.getLogger(__name__)

# Seconds inductor takes per call_function node of the whole graph, until this process has compiled a candidate:
# gpt-mini's candidate (bench/step.py's gpt_mini: 4 layers, d=256, seq 128, fused AdamW, the default ORT backend;
# measured 2026-11-27 on the 2-core CPU dev host, under other work, an empty inductor cache) compiled in 97.6 s
# for 455 nodes (its steady step: 1.7 s).  (backend="inductor" on the same model, a quieter moment: 64.7 s for
# 452 segment nodes.)
INDUCTOR_SECONDS_PER_NODE = 97.6 / 455
MEASURED_STEPS = 3  # steady steps (after the checked first run) timed before the candidate's step is set
RECOMPILES_PER_VARIANT = 1


class CompileCost:
    """The predicted seconds of an inductor compile of ``nodes`` graph nodes: :data:`INDUCTOR_SECONDS_PER_NODE`
    until this process compiles a candidate, then that compile's seconds per node (the machine's speed, its
    load and inductor's caches as they are now)."""

    seconds_per_node: float | None = None  # None: the constant
    source = "measured on gpt-mini"

    @classmethod
    def predict(cls, nodes: int) -> tuple[float, str]:
        per = INDUCTOR_SECONDS_PER_NODE if cls.seconds_per_node is None else cls.seconds_per_node
        return per * nodes, f"{nodes} nodes x {per * 1e3:.1f} ms/node, {cls.source}"

    @classmethod
    def calibrate(cls, seconds: float, nodes: int) -> None:
        if nodes:
            cls.seconds_per_node = seconds / nodes
            cls.source = f"as this process's last inductor compile ({seconds:.1f} s for {nodes} nodes)"


def graph_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


@dataclass
class _Watch:
    """The inductor candidate of one program: its steady steps' seconds, then the step at which it is bought."""

    steady: list[float] = field(default_factory=list)
    due: int | None = None  # compiled before the run that follows this many runs of the program
    fork: bool = False  # compiled by a forked process (BackgroundCompile), every rank alike
    background: BackgroundCompile | None = None  # that process, compiling since run ``due``


class Tuner:
    """Every choice one compiled step makes from measurements, and the recompiles they cause (see the module)."""

    def __init__(self, options: Options, name: str, transitions, runtime):
        self.options = options
        self.autotune = options.autotune
        self.name = name
        self.transitions = transitions  # the step's variants: a recompile drops them
        self.runtime = runtime  # the step's runtime: its communicator's carried gathers go with a recompile
        self.buckets = BucketTuner(options)  # bucket_cap_mb="auto": measures the first steps, then chooses the cap
        self.decisions: list[Decision] = []  # the tuner's own (candidate, bucket cap, recompiles), in order
        self.recompiles: dict = {}  # variant key -> tuner recompiles it caused
        self.inductor_lost: str | None = None  # why later variants get no candidate (it lost, or failed)
        self._watches: dict[int, tuple[CompiledProgram, _Watch]] = {}
        self._revisits: dict[int, CompiledProgram] = {}  # whole choices timed again before the program's next run
        self._t0: float | None = None

    # ------------------------------------------------------------------ compile side
    def bucket_mode(self, mode, module, recall: bool = True):
        """``mode`` with a number in place of ``bucket_cap_mb="auto"``: the tuned cap (an earlier run's where it is
        remembered and ``recall``; or its starting one), or with autotune off the static default
        (``AUTO_START_MB``, DDP's)."""
        if not self.autotune and isinstance(mode, DataParallel) and mode.auto_buckets:
            return dataclasses.replace(mode, bucket_cap_mb=AUTO_START_MB)
        return self.buckets.mode(mode, module, recall=recall)

    def compiled(self, program: CompiledProgram) -> None:
        """A new variant: it records the cap its buckets were built with; it gets no inductor candidate once one
        has lost (its compile costs seconds for every new variant)."""
        if self.buckets.choice is not None:
            program.results.record(self.buckets.choice)
        executor = program.executor  # (None: a plan that built none)
        if executor is not None and executor.candidate_source is not None and self.inductor_lost is not None:
            executor.candidate_source = None
            self._decide(Decision("inductor candidate", "not compiled for this variant", self.inductor_lost))

    # ------------------------------------------------------------------ around each run
    def before_run(self, program: CompiledProgram, args: tuple, kwargs: dict) -> None:
        """Inside the step's runtime, before ``program`` runs on the call: revisit the whole choice, or buy
        inductor's candidate, when due."""
        if self._revisits.get(id(program)) is program:
            del self._revisits[id(program)]
            self._revisit(program, args, kwargs)
        entry = self._watches.get(id(program))
        if entry is None and program.steps_run >= 1:
            entry = self._recalled(program)
        due = entry[1].due if entry is not None and entry[0] is program else None
        if due is not None and program.steps_run >= due \
                and program.executor.candidate_source is not None:
            self._candidate_due(program, entry[1], args, kwargs)
        # timed only while the candidate's step is undecided: on a GPU, now() waits for the queued kernels
        self._t0 = now() if self._timing(program) else None

    def after_run(self, program: CompiledProgram, mode, comm) -> None:
        """After ``program`` ran a call: time the step for the candidate, and let ``bucket_cap_mb="auto"``
        observe it (``mode``: the call's parallel mode as given, None on one process; ``comm``: the step's
        collectives); a cap that changes the buckets recompiles (within the budget)."""
        if self._t0 is not None:
            seconds, self._t0 = now() - self._t0, None
            self._watch(program, seconds)
        if self.autotune and _choice_pending(program):
            self._watch_choice(program)
        if not self.autotune:
            return
        if mode is not None and self.buckets.observe(mode, program, comm):
            self.recompile(program, f"bucket_cap_mb='auto' chose {self.buckets.choice.cap_mb:g} MiB buckets "
                                    "from the measured steps")

    def _timing(self, program: CompiledProgram) -> bool:
        """Whether ``program``'s steps are timed: it has a candidate whose step is not set yet."""
        if not self.autotune or program.executor.candidate_source is None:
            return False
        entry = self._watches.get(id(program))
        return entry is None or entry[0] is not program or entry[1].due is None

    def settled_for(self, program: CompiledProgram, runs: int) -> bool:
        """Whether the next ``runs`` runs of ``program`` are steady: no bucket cap still being measured, and no
        inductor candidate undecided or due within them (its compile, checked run and timing would land there).
        A benchmark warms a step up until this holds before it times ``runs`` steps."""
        if not self.autotune:
            return True
        if self.buckets.start_mb is not None and self.buckets.choice is None:
            return False  # bucket_cap_mb="auto" is measuring its steps (its recompile follows)
        if _choice_pending(program):
            return False  # the whole choice is watched (a revisit times the candidates again)
        if program.executor.candidate_source is None:
            return True
        entry = self._watches.get(id(program))
        if entry is None or entry[0] is not program or entry[1].due is None:
            return False  # its steady steps are still being timed
        if entry[1].background is not None:
            return False  # compiling in the background: its adoption (check, timing) lands within any runs
        return entry[1].due > program.steps_run + runs

    # ------------------------------------------------------------------ recompiles
    def recompile(self, program: CompiledProgram, reason: str) -> bool:
        """Drop the variants so that the next call compiles anew, for ``reason``, unless ``program``'s variant has
        had its :data:`RECOMPILES_PER_VARIANT` (then nothing changes; said once at INFO)."""
        done = self.recompiles.get(program.key, 0)
        if not self.autotune or done >= RECOMPILES_PER_VARIANT:
            why = "SPMD_ORT_AUTOTUNE=0" if not self.autotune else \
                f"this variant's budget of {RECOMPILES_PER_VARIANT} tuner recompile is spent"
            self._decide(Decision("recompile", "refused", f"{reason}; {why}"))
            return False
        self.recompiles[program.key] = done + 1
        self._decide(Decision("recompile", "every variant compiles anew", reason))
        self.runtime.comm.drop_carried()  # the next call compiles the chosen schedule
        self.transitions.invalidate(reason)
        return True

    # ------------------------------------------------------------------ the whole choice, revisited once
    def _watch_choice(self, program: CompiledProgram) -> None:
        """After ``program``'s first :data:`MEASURED_STEPS` steady steps (their graph runs, timed by the executor as
        its first run timed the candidates) the whole choice its first run made is final, unless those runs are
        slower than another candidate measured then by :data:`~spmd_ort.backends.ort.choice.MARGIN`: then the
        candidates are timed again before the next step (once; every rank alike)."""
        from spmd_ort.backends.ort.choice import MARGIN

        executor = program.executor
        steady = executor.steady
        if len(steady) < MEASURED_STEPS or self._revisits.get(id(program)) is program:
            return
        step_ms = sorted(steady)[len(steady) // 2] * 1e3
        whole = executor.stats.whole
        others = {name: ms for name, ms in whole.times_ms if name != executor.runs}
        best = min(others, key=others.get) if others else None
        why = f"steady steps {step_ms:.2f} ms" + (f" against {best}'s {others[best]:.2f} ms on the first run"
                                                   if best is not None else "")
        if _agreed_max(int(best is not None and step_ms > others[best] * (1 + MARGIN))):
            kept = {id(p) for p in self.transitions.variants.values()}  # (dropped variants' entries go)
            self._revisits = {k: p for k, p in self._revisits.items() if k in kept}
            self._revisits[id(program)] = program
            self._decide(Decision("whole graph", f"{executor.runs} lost to {best} in the steady steps: timed again "
                                                 f"at step {program.steps_run + 1}", why))
            return
        executor.settle()
        self._decide(Decision("whole graph", f"{executor.runs} final after {len(steady)} steady steps", why))

    def _revisit(self, program: CompiledProgram, args: tuple, kwargs: dict) -> None:
        """Time the whole-step candidates again on copies of this call's inputs; keep or switch (every rank)."""
        copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in program.graph_inputs(args, kwargs)]
        with program.frame():
            self._decide(program.executor.revisit(copies, program.steps_run + 1))

    # ------------------------------------------------------------------ inductor's candidate
    def _watch(self, program: CompiledProgram, seconds: float) -> None:
        if program.steps_run < 2:
            return  # the first run is the checked one (both executors, comparisons): no steady step
        entry = self._watches.get(id(program))
        if entry is None or entry[0] is not program:
            kept = {id(p) for p in self.transitions.variants.values()}  # the watches of dropped variants go
            self._watches = {k: v for k, v in self._watches.items() if k in kept and v[0] is not program}
            entry = self._watches[id(program)] = (program, _Watch())
        watch = entry[1]
        if watch.due is not None:
            return
        watch.steady.append(seconds)
        if len(watch.steady) < MEASURED_STEPS:
            return
        step_s = sorted(watch.steady)[len(watch.steady) // 2]
        nodes = graph_nodes(program.executor.candidate_source)
        predicted, how = CompileCost.predict(nodes)
        watch.fork = self._in_background(program)
        if watch.fork:  # it costs the steps little: started at once
            watch.due = _agreed_max(program.steps_run)
            self._decide(Decision("inductor candidate", f"compiling in the background from step {watch.due + 1}",
                                  f"a forked process at the lowest priority, one thread, while the steps run at "
                                  f"{step_s * 1e3:.1f} ms/step; predicted compile {predicted:.1f} s: {how}"))
            return
        steps = max(math.ceil(predicted / max(step_s, 1e-9)), MEASURED_STEPS)
        watch.due = _agreed_max(1 + steps)  # every rank compiles it before the same run
        self._decide(Decision("inductor candidate", f"deferred until step {watch.due}",
                              f"until {(watch.due - 1) * step_s:.1f} s of steady steps at {step_s * 1e3:.1f} "
                              f"ms/step; predicted compile {predicted:.1f} s: {how}"))

    def _in_background(self, program: CompiledProgram) -> bool:
        """Whether ``program``'s candidate is compiled by a forked process (every rank alike)."""
        return _agreed_min(int(BackgroundCompile.available(program.executor.candidate_source,
                                                           self.options.background_compile))) == 1

    def _candidate_due(self, program: CompiledProgram, watch: _Watch, args: tuple, kwargs: dict) -> None:
        """The candidate's run has come: compiled here and now, or (in the background) its compile started, or
        polled; once every rank's child has exited, built from the cache it filled, checked and timed."""
        from spmd_ort.backends.ort.choice import everywhere

        if not watch.fork:
            self._try_candidate(program, watch, args, kwargs)
            return
        if watch.background is None:
            watch.background = BackgroundCompile(program.executor.candidate_source, self.options)
            return
        exited = watch.background.poll() is not None
        if not everywhere(exited):
            return  # still compiling somewhere: the steps go on as they are
        child, watch.background = watch.background, None
        if not everywhere(bool(child.ok)):
            program.executor.candidate_source = None
            self._failed_to_compile(program.executor, f"in the background, after {child.seconds:.1f} s")
            return
        self._try_candidate(program, watch, args, kwargs, background_s=child.seconds)

    def _failed_to_compile(self, executor, when: str) -> None:
        """Inductor's candidate did not compile (on some rank): no later variant gets one, nor the next run."""
        self.inductor_lost = "inductor's candidate failed to compile"
        self._decide(Decision("inductor candidate", "failed to compile", when))
        executor.remember_candidate("failed", "it failed to compile")

    def _recalled(self, program: CompiledProgram):
        """After the first run: what an earlier run of this program decided about inductor's candidate
        (:mod:`spmd_ort.backends.ort.remembered`, the same on every rank): compiled now where it was kept, never
        where it lost; None where no run decided it."""
        executor = program.executor
        if not self.autotune or executor.candidate_source is None:
            return None
        remembered = executor.remembered  # (a candidate_source: the ORT executor's automatic choice)
        known = remembered.inductor if remembered is not None else None
        if known is None:
            return None
        if known["outcome"] != "kept":
            executor.candidate_source = None
            self.inductor_lost = f"it {known['outcome']} in an earlier run of this program ({known['detail']})"
            self._decide(Decision("inductor candidate", "not compiled", self.inductor_lost + ", remembered"))
            return None
        entry = self._watches[id(program)] = (program, _Watch(due=program.steps_run, fork=self._in_background(program)))
        self._decide(Decision("inductor candidate", f"due at step {program.steps_run + 1}",
                              f"it was kept in an earlier run of this program ({known['detail']}), remembered"))
        return entry

    def _try_candidate(self, program: CompiledProgram, watch: _Watch, args: tuple, kwargs: dict,
                       background_s: float | None = None) -> None:
        """Compile the whole graph with inductor (after a background compile, ``background_s`` seconds: from the
        cache it filled), check its first run and time it against what runs now, on copies of the step's
        inputs; keep the faster (every rank alike)."""
        from spmd_ort.backends.ort.choice import choose_whole, everywhere, untouched
        from spmd_ort.runtime.step_runtime import active

        executor = program.executor
        source, executor.candidate_source = executor.candidate_source, None
        step = program.steps_run + 1
        t0 = now()
        source = fx.GraphModule(source, source.graph)  # a plain module (kept lazy until now: its code made here)
        nodes = graph_nodes(source)
        candidate = _compile_candidate(source, self.options)
        compile_s = now() - t0
        if candidate is None:
            self._failed_to_compile(executor, f"at step {step}")
            return
        if background_s is None:  # (a load from the cache says nothing of a compile's cost)
            CompileCost.calibrate(compile_s, nodes)
        inputs = program.graph_inputs(args, kwargs)
        copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        ok = False
        with program.frame():  # opaque parts' frame, as in a run
            try:
                with untouched():  # torch's RNG and the step's collective counts as they were
                    candidate.run(copies, copies=True)  # its checked first run updates these copies in place
                    active().comm.finish()
                ok = True
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is no candidate
                logger.info("%s: inductor's candidate failed its first run (%s); it is not considered", self.name,
                            short_error(exc))
            if not everywhere(ok):
                self.inductor_lost = "inductor's candidate failed its checked run on an earlier variant"
                self._decide(Decision("inductor candidate", "failed its checked run", f"at step {step}"))
                executor.remember_candidate("failed", "it failed its checked run")
                return
            stats = executor.stats
            stats.upgrade = None
            winner = choose_whole({executor.runs: executor.running(), "inductor": candidate.gm}, copies, stats,
                                  field="upgrade")
        stats.upgrade_seconds, stats.upgrade_step = now() - t0, step
        times = ", ".join(f"{k} {ms:.2f} ms" for k, ms in stats.upgrade.times_ms)
        kept = "kept" if winner == "inductor" else "dropped"
        where = f"compiled in the background in {background_s:.1f} s, loaded at step {step} in {compile_s:.1f} s" \
            if background_s is not None else f"compile {compile_s:.1f} s"
        self._decide(Decision("inductor candidate", f"compiled at step {step} and {kept}",
                              f"{where} for {nodes} nodes; {times}"))
        executor.remember_candidate("kept" if winner == "inductor" else "dropped", times)
        if winner == "inductor":
            executor.adopt("inductor", candidate)
        else:
            self.inductor_lost = f"it lost on an earlier variant ({times})"

    # ------------------------------------------------------------------ what it decided
    def _decide(self, decision: Decision) -> None:
        self.decisions.append(decision)
        logger.info("%s: %s", self.name, decision)

    def lines(self, program: CompiledProgram | None) -> list[str]:
        """Every decision behind ``program`` (the backend's, the bucket cap) and the tuner's own, in words."""
        out: list[Decision] = []
        if not self.autotune:
            out.append(Decision("autotune", "off", "SPMD_ORT_AUTOTUNE=0: the static choices, no recompiles"))
        if program is not None:
            out += program.executor.decisions()
            choice = program.results.get(BucketChoice)
            if choice is not None:
                out.append(Decision("bucket cap", f"{choice.cap_mb:g} MiB", choice.reason + (
                    "; predicted per cap: " + ", ".join(f"{c:g} MiB {ms:.1f} ms" for c, ms in choice.predicted_ms)
                    if choice.predicted_ms else "")))
        out += self.decisions
        return [str(d) for d in out]


def _compile_candidate(whole: fx.GraphModule, options: Options):
    """``whole`` compiled by inductor (an InductorExecutor), or None: no C++ compiler (one INFO line), or a
    compile failure on any rank (every rank then drops it)."""
    from spmd_ort.backends.inductor import build_inductor_executor, cxx_compiler
    from spmd_ort.backends.ort.choice import everywhere

    candidate = None
    if cxx_compiler() is None:
        logger.info("no C++ compiler found: the automatic choice runs without its inductor candidate "
                    "(SPMD_ORT_AUTO_INDUCTOR=0 says so once and for all)")
    else:
        try:
            # FALLBACK_TO_FX: a segment inductor cannot compile or run stays on fx inside the candidate
            candidate = build_inductor_executor(whole, dataclasses.replace(options, fallback_policy="FALLBACK_TO_FX"))
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is no candidate
            logger.info("the inductor candidate of the automatic choice failed to compile (%s); it is not "
                        "considered", short_error(exc))
    return candidate if everywhere(candidate is not None) else None


def _choice_pending(program: CompiledProgram) -> bool:
    """Whether ``program``'s executor holds a whole choice that is not final (the ORT executor's, with auto)."""
    return bool(getattr(program.executor, "revisit_pending", False))


def _agreed_max(value: int) -> int:
    """``value``'s maximum over the ranks (the same on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return int(t)


def _agreed_min(value: int) -> int:
    """``value``'s minimum over the ranks (the same on every rank)."""
    return -_agreed_max(-value)
