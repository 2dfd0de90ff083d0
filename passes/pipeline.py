"""The one ordered pipeline: every transformation between capture and execution, in order.

:func:`build_pipeline` gives the passes a compiled variant runs, for its
parallel mode and backend; :data:`STAGES` is the whole catalogue with the
condition under which each pass runs (the README's list is
:func:`pipeline_markdown`, and a test keeps the two equal).  Executors receive
the finished graph and run no passes of their own.

Adding a pass: write ``<verb>_<object>_pass(gm, ctx) -> gm`` (decorated with
``graph_pass(requires=..., ensures=...)``) in the file of its family, add one
:class:`Step` below, and one test file ``tests/test_pass_<family>.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spmd_ort.errors import ConfigError
from spmd_ort.parallel import DataParallel

from .activation_stats import insert_activation_stats_pass
from .analysis import plan_memory_pass
from .cleanup import remove_identity_views_pass, remove_redundant_copies_pass
from .data_parallel import (broadcast_buffers_pass, bucket_collectives_pass, dedup_collectives_pass,
                            expand_data_parallel_pass, schedule_overlap_pass)
from .fully_shard import (complete_found_inf_pass, complete_grad_norms_pass, gather_parameters_pass,
                          propagate_shards_pass, reduce_scatter_gradients_pass, rematerialize_param_views_pass,
                          shard_placeholders_pass)
from .lowering import lower_to_onnx_ops_pass
from .mixed_precision import cast_gradient_reductions_pass, cast_params_before_gather_pass
from .offload import offload_optimizer_pass, offload_params_pass
from .reinplace import reinplace_optimizer_pass
from .runner import GraphPass, pass_name
from .shard_schedule import bucket_shard_collectives_pass, keep_tail_gathers_pass, prefetch_gathers_pass
from .user import gm_transformation_pass, override_transform_pass


@dataclass(frozen=True)
class Setting:
    """What a compiled variant is built for: its parallel mode and backend."""

    mode: DataParallel | None
    backend: str


Condition = Callable[[Setting], bool]


def _always(s: Setting) -> bool:
    return True


def _replicate(s: Setting) -> bool:
    return s.mode is not None and not s.mode.sharded


def _parallel(s: Setting) -> bool:
    return s.mode is not None


def _sharded(s: Setting) -> bool:
    return s.mode is not None and s.mode.sharded


def _reduce_dtype(s: Setting) -> bool:
    policy = s.mode.mixed_precision if s.mode is not None else None
    return policy is not None and policy.gradient_reduce_dtype() is not None


def _resharding(s: Setting) -> bool:
    return _sharded(s) and s.mode.reshard_after_forward


def _ort(s: Setting) -> bool:
    return s.backend == "ort"


def _offload_param(s: Setting) -> bool:
    return _sharded(s) and s.mode.offload_param is not None


def _offload_optimizer(s: Setting) -> bool:
    return _sharded(s) and s.mode.offload_optimizer is not None


@dataclass(frozen=True)
class Step:
    stage: str
    graph_pass: GraphPass | str  # a pass, or the name of a user transform made per compile
    when: Condition = _always
    condition: str = "always"

    @property
    def name(self) -> str:
        return self.graph_pass if isinstance(self.graph_pass, str) else pass_name(self.graph_pass)


USER_TRANSFORMS = "user transforms"
STAGES: tuple[Step, ...] = (
    Step("cleanup", remove_redundant_copies_pass),
    Step("cleanup", remove_identity_views_pass),
    Step("debug", insert_activation_stats_pass, _always, "always (a no-op unless a debug subscriber taps activations)"),
    Step("replicate", expand_data_parallel_pass, _replicate, "replicate"),
    Step("fully_shard", shard_placeholders_pass, _sharded, "fully_shard"),
    Step("fully_shard", reduce_scatter_gradients_pass, _sharded, "fully_shard"),
    Step("mixed_precision", cast_gradient_reductions_pass, _reduce_dtype,
         "several ranks, MixedPrecisionPolicy with a reduce (or param) dtype"),
    Step("fully_shard", rematerialize_param_views_pass, _resharding, "fully_shard, reshard_after_forward"),
    Step("fully_shard", propagate_shards_pass, _sharded, "fully_shard"),
    Step("fully_shard", gather_parameters_pass, _sharded, "fully_shard"),
    Step("fully_shard", complete_grad_norms_pass, _sharded, "fully_shard"),
    Step("fully_shard", complete_found_inf_pass, _sharded, "fully_shard"),
    Step("parallel", broadcast_buffers_pass, _parallel, "several ranks (broadcast_buffers)"),
    Step("replicate", bucket_collectives_pass, _replicate, "replicate"),
    Step("parallel", dedup_collectives_pass, _parallel, "several ranks"),
    Step("fully_shard", keep_tail_gathers_pass, _resharding, "fully_shard, reshard_after_forward"),
    Step("mixed_precision", cast_params_before_gather_pass, _sharded, "fully_shard"),
    Step("fully_shard", bucket_shard_collectives_pass, _sharded, "fully_shard"),
    Step("parallel", schedule_overlap_pass, _parallel, "several ranks"),
    Step("fully_shard", prefetch_gathers_pass, _sharded, "fully_shard"),
    Step("offload", offload_params_pass, _offload_param, "offload_param"),
    Step("offload", offload_optimizer_pass, _offload_optimizer, "offload_optimizer"),
    Step(USER_TRANSFORMS, "override_transform_pass[<Override>]", _always, "each Override, in order"),
    Step(USER_TRANSFORMS, "gm_transformation_pass", _always, "compile(gm_transformation=...)"),
    Step("analysis", plan_memory_pass),
    Step("backend", lower_to_onnx_ops_pass, _ort, "ort backend"),
    Step("backend", reinplace_optimizer_pass),
)


PARALLEL_STAGES = ("replicate", "fully_shard", "mixed_precision", "parallel", "offload")


def build_pipeline(mode: DataParallel | None, backend: str, *, overrides: Sequence = (),
                   gm_transformation: Callable | None = None, stages: Sequence[str] | None = None) -> list[GraphPass]:
    """The passes a variant with this parallel mode and backend runs, in order.

    ``stages`` keeps only the passes of those stages (e.g. ``("cleanup", *PARALLEL_STAGES)``).
    """
    setting = Setting(mode, backend)
    out: list[GraphPass] = []
    for step in STAGES:
        if not step.when(setting) or (stages is not None and step.stage not in stages):
            continue
        if step.stage != USER_TRANSFORMS:
            out.append(step.graph_pass)
        elif step.name.startswith("override_transform_pass"):
            out += [override_transform_pass(o) for o in overrides]
        elif gm_transformation is not None:
            out.append(gm_transformation_pass(gm_transformation))
    return out


def pass_names() -> list[str]:
    """Every built-in pass name (what ``SPMD_ORT_DISABLE_PASSES`` may list)."""
    return [s.name for s in STAGES if s.stage != USER_TRANSFORMS]


def check_disabled(names: frozenset[str]) -> None:
    """Unknown names in ``SPMD_ORT_DISABLE_PASSES`` are an error (a typo would silently disable nothing)."""
    known = set(pass_names())
    unknown = sorted(n for n in names if n not in known and not n.startswith("override_transform_pass[")
                     and n != "gm_transformation_pass")
    if unknown:
        raise ConfigError(f"SPMD_ORT_DISABLE_PASSES names unknown pass(es) {', '.join(unknown)}; the passes are: "
                          f"{', '.join(pass_names())}")


def pipeline_markdown() -> str:
    """The pipeline as the README lists it: stage, pass, when it runs."""
    rows = ["| # | stage | pass | runs when |", "| --- | --- | --- | --- |"]
    rows += [f"| {i} | {s.stage} | `{s.name}` | {s.condition} |" for i, s in enumerate(STAGES, 1)]
    return "\n".join(rows)
