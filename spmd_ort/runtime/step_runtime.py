"""What a running compiled step provides to the host ops of its graph.

Host ops (collectives, the offloaded optimizer update) run inside the graph and
cannot take Python objects as arguments, so the step that runs them activates
its :class:`StepRuntime` for the duration of the run: its own
:class:`~spmd_ort.runtime.collectives.Communicator` (two compiled steps in one process
never mix their collectives' figures) and its :class:`~spmd_ort.options.Options`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

from spmd_ort.runtime.taps import TapRegistry
from spmd_ort.runtime.collectives import Communicator
from spmd_ort.runtime.opaque_calls import OpaqueCall, OpaqueFrame
from spmd_ort.options import Options

_ACTIVE: contextvars.ContextVar[StepRuntime | None] = contextvars.ContextVar("spmd_ort_step_runtime", default=None)


@dataclass
class StepRuntime:
    options: Options = field(default_factory=Options)
    comm: Communicator = field(default_factory=Communicator)
    opaque: OpaqueFrame | None = None
    recorder: object | None = None  # a recorder.Recorder while profiled steps run (CompiledStep.profile)
    taps: TapRegistry = field(default_factory=TapRegistry)  # debug subscribers' taps in this step's graphs
    # hyper-parameters kept on the device (a CUDA-graphed step): the address of each group's tensor -> its values
    # as the host wrote them this step, which the optimizer kernels take as numbers without reading the device
    hparam_values: dict[int, tuple[float, ...]] = field(default_factory=dict)
    # a pipeline's graph (each rank its own checks): the index checks that failed this run, agreed on by every rank
    # at one point all reach (spmd_ort::agree_checks, after the micro-batches); None: each check agrees itself
    deferred_checks: list | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[StepRuntime]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def running(self, calls: tuple[OpaqueCall, ...]) -> Iterator[OpaqueFrame]:
        """One run of a program whose opaque parts are ``calls``: a fresh frame, dropped afterwards."""
        outer, self.opaque = self.opaque, OpaqueFrame(calls)
        try:
            yield self.opaque
        finally:
            self.opaque = outer

    def opaque_frame(self) -> OpaqueFrame:
        if self.opaque is None:
            raise RuntimeError("an opaque host op ran outside the run of its compiled program")
        return self.opaque


def in_step() -> bool:
    """Whether a compiled step's graph is running in this context (its opaque parts call modules from it)."""
    return _ACTIVE.get() is not None


def current() -> StepRuntime | None:
    """The runtime of the step running in this context, or None outside one."""
    return _ACTIVE.get()


def active() -> StepRuntime:
    """The runtime of the step whose graph is running; host ops call this."""
    rt = _ACTIVE.get()
    if rt is None:
        raise RuntimeError("spmd_ort host ops (collectives, offloaded optimizer steps) run inside a compiled "
                           "step; to run a graph by hand, wrap the call in `with StepRuntime().active():`")
    return rt
