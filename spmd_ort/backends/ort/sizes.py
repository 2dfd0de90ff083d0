"""Segments of a program with symbolic sizes (dynamic shapes).

One ONNX model with dynamic axes serves every size (:func:`dynamic_segment`); its first
:data:`CHECKED_SIZES` sets of sizes are checked against the fx graph (:class:`NewSizes`).
Where no such model can be built (a translation that needs concrete sizes), the segment
is exported per set of sizes instead (:class:`SizedSegments`).
"""

from __future__ import annotations


import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_ort.capture.trace import COMPILE_LOCK, gc_paused
from spmd_ort.errors import CompileError
from spmd_ort.options import Options, get_logger
from spmd_ort.backends.ort import decompose
from spmd_ort.backends.ort.session import DynamicSizes, OrtSegment, StageError, load_segment, open_segment
from spmd_ort.backends.ort.stats import OrtStats
from spmd_ort.backends.ort.verify import checked_first_run, segment_failure
from spmd_ort.graph.checking import op_summary, short_error

logger = get_logger(__name__)

# A dynamic-shape segment (one ONNX model for every size) is checked at its first CHECKED_SIZES sets of sizes.
CHECKED_SIZES = 3


class NewSizes:
    """A dynamic-shape segment's first runs at new sizes: checked against its fx graph like its first run.

    One ONNX model serves every size; its first :data:`CHECKED_SIZES` distinct sets of
    sizes (the first run's included) each run next to the fx graph and are compared (a
    size the translation baked in shows there), and an ORT failure at any size falls
    back to fx per ``Options.fallback_policy``.
    """

    def __init__(self, stats: OrtStats, policy: str, verify: bool):
        self.stats, self.policy, self.verify = stats, policy, verify
        self.checked: set[tuple] = set()

    def forward(self, seg: OrtSegment, args):
        key = seg.sizes.key(args)
        if len(self.checked) < CHECKED_SIZES and key not in self.checked:
            return self._checked(seg, key, args)
        try:
            return seg.used(seg.run_ort(*args))
        except Exception as exc:  # noqa: BLE001 - ORT wrote no state: the fx graph runs the step instead
            what = f"ONNX Runtime failed to run it at new sizes: {short_error(exc)}"
            segment_failure(seg.name, what, self.policy, op_summary(seg.fallback))
            self.stats.fell_back(seg.name, what)
            seg.release()
            return seg.fallback(*args)

    def _checked(self, seg: OrtSegment, key: tuple, args):
        self.checked.add(key)
        seg.checked_runs += 1
        reference = seg.fallback(*args)
        where = f"{seg.name} at sizes {seg.sizes.describe(key)}"
        if checked_first_run(where, seg, args, reference, self.stats, self.policy, self.verify) is None:
            seg.release()
        return reference


class SizedSegments(nn.Module):
    """A segment of a program with symbolic sizes: one ONNX model per distinct set of input sizes.

    The segment's graph is specialised to the sizes of a call (re-traced over
    fake tensors of those shapes: size arithmetic folds to constants), exported
    (through the on-disk cache, keyed by the specialised graph) and loaded; the
    first run at each new set of sizes is verified against the fx graph as
    every segment's first run is.  Later calls with those sizes run the stored
    session.  A set of sizes whose export, load or check fails runs on fx (or
    raises, under ``FALLBACK_DISABLE``).
    """

    def __init__(self, name: str, fallback: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                 providers: list):
        super().__init__()
        self.name = name
        self.fallback = fallback
        self.options = options
        self.stats = stats
        self.threads = threads
        self.providers = providers
        self.sessions: dict[tuple, OrtSegment | None] = {}  # sizes -> session (None: runs on fx)
        self.sizes = DynamicSizes(fallback)  # names a set of sizes in messages
        self.runs = 0  # steps whose outputs came from ONNX Runtime (as OrtSegment.runs)
        self.checked_runs = 0  # first runs at each set of sizes: compared, the fx graph's outputs used
        self.released = False
        self.parked = False  # on fx for now, its sessions kept (OrtSegment.park)

    @staticmethod
    def sizes_of(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args)

    def forward(self, *args):
        if self.released or self.parked:
            return self.fallback(*args)
        key = self.sizes_of(args)
        if key not in self.sessions:
            self.sessions[key] = self._specialise(key, args)
            segment = self.sessions[key]
            if segment is not None:
                reference = self.fallback(*args)
                where = f"{self.name} at sizes {self.sizes.describe(self.sizes.key(args))}"
                if checked_first_run(where, segment, _tensors(args), reference, self.stats,
                                      self.options.fallback_policy, self.options.verify) is None:
                    self.sessions[key] = None
                self.checked_runs += 1
                return reference
        segment = self.sessions[key]
        if segment is None:
            return self.fallback(*args)
        self.runs += 1
        return segment.run_ort(*_tensors(args))

    @property
    def held(self) -> bool:
        return not self.released

    def park(self, parked: bool = True) -> None:
        """Run on fx (``parked``) or on ORT again, keeping the sessions (as :meth:`OrtSegment.park`)."""
        self.parked = parked and not self.released

    def release(self) -> None:
        """Run on fx from now on, at every size, and free the sessions made so far."""
        self.released, self.parked = True, False
        self.sessions.clear()

    def _specialise(self, key: tuple, args) -> OrtSegment | None:
        """The segment for these sizes: its sizes constants, its inputs the tensors (in order)."""
        # a size stays an int, a number computed from sizes (n / (n - 1)) a float
        examples = [torch.empty(a.shape, dtype=a.dtype, device=a.device) if isinstance(a, torch.Tensor) else a
                    for a in args]
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def run(*tensors):
            full = list(examples)
            for i, t in zip(positions, tensors):
                full[i] = t
            return self.fallback(*full)

        with COMPILE_LOCK, gc_paused():  # a trace and an export at run time: one compile in the process at a time
            with torch.no_grad():
                concrete = make_fx(run, tracing_mode="fake")(*[examples[i] for i in positions])
            decompose.annotate(concrete)  # the re-trace ran the ops; ONNX needs their decompositions again
            name = f"{self.name}_{len(self.sessions)}"
            return load_segment(name, concrete, self.options, self.stats, threads=self.threads,
                                providers=self.providers)

def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]

def dynamic_segment(name: str, sub: fx.GraphModule, options: Options, stats: OrtStats, *, threads: int,
                     providers: list) -> OrtSegment | SizedSegments:
    """A segment with symbolic sizes: one ONNX model with dynamic axes for every size.

    Where that model cannot be built (a translation that needs concrete sizes) or loaded,
    the segment is exported per set of sizes instead (:class:`SizedSegments`), with an INFO line.
    """
    try:
        segment = open_segment(name, sub, options, stats, threads=threads, providers=providers)
    except CompileError:
        raise
    except Exception as exc:  # noqa: BLE001 - the per-size export still serves the segment
        cause = exc.__cause__ if isinstance(exc, StageError) and exc.__cause__ is not None else exc
        logger.info("ORT segment %s has no model with dynamic sizes (%s: %s); it is exported per set of sizes",
                    name, getattr(exc, "stage", "export"), short_error(cause, 200))
        return SizedSegments(name, sub, options, stats, threads=threads, providers=providers)
    segment.new_sizes = NewSizes(stats, options.fallback_policy, options.verify)
    return segment
