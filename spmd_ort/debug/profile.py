"""``train_step.profile(steps=N, path=...)``: record the timeline of the next N steps, then write it.

A :class:`Profiler` belongs to one compiled step.  Armed by ``profile()``, it starts
recording at the next run of a variant that has run before (a variant's first run is a
checked one), hands its :class:`~spmd_ort.runtime.recorder.Recorder` to the step's runtime
(the executors and the communicator record spans into it), and after N steps merges the
ranks' recorders on rank 0, which writes ``<path>.json`` (Chrome/Perfetto) and
``<path>.png`` (:mod:`spmd_ort.debug.timeline`).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from spmd_ort.debug import timeline
from spmd_ort.runtime.collectives import control_group
from spmd_ort.runtime.recorder import Recorder
from spmd_ort.distributed import parallel
from spmd_ort.runtime.step_runtime import StepRuntime
from spmd_ort.options import get_logger

logger = get_logger(__name__)


class Profiler:
    def __init__(self, runtime: StepRuntime):
        self.runtime = runtime
        self.armed: tuple[int, Path] | None = None  # (steps, path)
        self.paths: tuple[Path, Path] | None = None  # (trace, picture) written by the last profile

    def arm(self, steps: int, path: str | Path) -> None:
        if steps < 1:
            raise ValueError(f"profile(steps={steps}): profile at least one step")
        self.armed = (steps, Path(path))
        self.paths = None

    def before_run(self, steps_run: int) -> None:
        """Start recording if armed and the variant about to run has run before (``steps_run``)."""
        if self.armed is None or self.runtime.recorder is not None or steps_run == 0:
            return
        if parallel.world()[1] > 1:
            dist.barrier(group=control_group())  # one origin for every rank's clock
        recorder = Recorder(self.armed[0])
        self.runtime.recorder = recorder
        self.runtime.comm.recorder = recorder

    def after_run(self, t0: float, t1: float) -> None:
        """Count the step that ran from ``t0`` to ``t1``; write the profile once the last one is done."""
        recorder = self.runtime.recorder
        if recorder is None:
            return
        recorder.step_done(t0, t1)
        if recorder.done:
            self._finish(recorder)

    def _finish(self, recorder: Recorder) -> None:
        _, path = self.armed
        self.runtime.recorder = self.runtime.comm.recorder = None
        self.armed = None
        rank, world = parallel.world()
        recorders = [recorder]
        if world > 1:
            recorders = [None] * world if rank == 0 else None
            dist.gather_object(recorder, recorders, dst=0, group=control_group())
        if rank == 0:
            self.paths = timeline.write(recorders, path)
            logger.info("profile of %d step(s) written to %s and %s", recorder.steps, *self.paths)
