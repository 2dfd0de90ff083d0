"""The one ordered pipeline: every transformation between capture and execution, in order.

:func:`build_pipeline` gives the passes a compiled variant runs, for its
parallel mode and backend; :data:`STAGES` is the whole catalogue with the
condition under which each pass runs (the list in docs/architecture.md is
:func:`pipeline_markdown`, and a test keeps the two equal).  Executors receive
the finished graph and run no passes of their own.

Adding a pass: write ``<verb>_<object>_pass(gm, ctx) -> gm`` (decorated with
``graph_pass(requires=..., provides=..., invalidates=...)``) in the file of its family, add one
:class:`Step` below, and one test file ``tests/test_pass_<family>.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from dataclasses import dataclass

from spmd_ort.errors import ConfigError
from spmd_ort.distributed.experts import ExpertParallel
from spmd_ort.distributed.parallel import ContextParallel, DataParallel
from spmd_ort.distributed.stages import PipelineParallel

from .activation_stats import insert_activation_stats_pass
from .analysis import count_collectives_pass, plan_graph_capture_pass, plan_memory_pass
from .cleanup import remove_identity_views_pass, remove_redundant_copies_pass
from .context_parallel import split_sequence_pass
from .pipeline_parallel import split_pipeline_stages_pass
from .expert_parallel import localize_experts_pass
from .fusion import fuse_linear_cross_entropy_pass
from .expand import adopt_dtensor_collectives_pass, merge_summed_all_reduces_pass, split_replicated_matmuls_pass
from .data_parallel import (broadcast_buffers_pass, bucket_collectives_pass, dedup_collectives_pass,
                            expand_data_parallel_pass, reduce_grad_presence_pass, schedule_overlap_pass,
                            sum_micro_batch_gradients_pass)
from .fully_shard import (complete_found_inf_pass, complete_grad_norms_pass, gather_parameters_pass,
                          propagate_shards_pass, reduce_scatter_gradients_pass, rematerialize_param_views_pass,
                          shard_placeholders_pass)
from .index_checks import insert_index_checks_pass
from .layout import pin_random_layouts_pass
from .lowering import lower_to_onnx_ops_pass
from .mixed_precision import cast_gradient_reductions_pass, cast_params_before_gather_pass
from .offload import offload_optimizer_pass, offload_params_pass
from .recompute import recompute_activations_pass
from .reinplace import reinplace_optimizer_pass
from .runner import GraphPass, pass_name
from .shard_schedule import (bound_reduce_scatters_pass, bucket_shard_collectives_pass, carry_first_gather_pass,
                             keep_tail_gathers_pass, prefetch_gathers_pass)
from .user import gm_transformation_pass, override_transform_pass
from .views import replace_views_with_reshapes_pass


@dataclass(frozen=True)
class Setting:
    """What a compiled variant is built for: its parallel mode and backend."""

    mode: DataParallel | ContextParallel | PipelineParallel | None
    backend: str
    expand: bool = False  # the state holds DTensors (expand mode: spmd_ort.distributed.dtensor)


@dataclass(frozen=True)
class When:
    """When a pass runs: the predicate and the words the pipeline table shows, one object (the one source)."""

    text: str
    test: Callable[[Setting], bool]

    def __call__(self, s: Setting) -> bool:
        return self.test(s)

    def __and__(self, other: When) -> When:
        return When(f"{self.text}, {other.text}", lambda s: self(s) and other(s))

    def note(self, text: str) -> When:
        """The same condition, with a remark for the pipeline table."""
        return When(f"{self.text} ({text})", self.test)


ALWAYS = When("always", lambda s: True)
SEVERAL_RANKS = When("several ranks", lambda s: isinstance(s.mode, DataParallel))
REPLICATE = When("replicate", lambda s: isinstance(s.mode, DataParallel) and not s.mode.sharded)
FULLY_SHARD = When("fully_shard", lambda s: isinstance(s.mode, DataParallel) and s.mode.sharded)
EXPERT_PARALLEL = When("ep > 1", lambda s: isinstance(s.mode, ExpertParallel))
CONTEXT_PARALLEL = When("cp > 1", lambda s: isinstance(s.mode, ContextParallel))
PIPELINE_PARALLEL = When("pp > 1", lambda s: isinstance(s.mode, PipelineParallel))
RESHARD = FULLY_SHARD & When("reshard_after_forward", lambda s: s.mode.reshard_after_forward)
REDUCE_DTYPE = SEVERAL_RANKS & When(
    "MixedPrecisionPolicy with a reduce (or param) dtype",
    lambda s: s.mode.mixed_precision is not None and s.mode.mixed_precision.gradient_reduce_dtype() is not None)
OFFLOAD_PARAM = FULLY_SHARD & When("offload_param", lambda s: s.mode.offload_param is not None)
OFFLOAD_OPTIMIZER = FULLY_SHARD & When("offload_optimizer", lambda s: s.mode.offload_optimizer is not None)
ORT_BACKEND = When("ort backend", lambda s: s.backend == "ort")
EXPAND = When("DTensor parameters (expand mode)", lambda s: s.expand)
NOT_EXPAND = When("no DTensor parameters", lambda s: not s.expand)
NOT_SPLIT = When("no cp", lambda s: not isinstance(s.mode, ContextParallel))
COLLECTIVES = When("several ranks or DTensor parameters", lambda s: s.mode is not None or s.expand)


@dataclass(frozen=True)
class Step:
    stage: str
    graph_pass: GraphPass | str  # a pass, or the name of a user transform made per compile
    when: When = ALWAYS

    @property
    def name(self) -> str:
        return self.graph_pass if isinstance(self.graph_pass, str) else pass_name(self.graph_pass)


USER_TRANSFORMS = "user transforms"
STAGES: tuple[Step, ...] = (
    Step("random", pin_random_layouts_pass, ALWAYS.note("a no-op without random ops")),
    Step("cleanup", remove_redundant_copies_pass),
    Step("cleanup", remove_identity_views_pass),
    Step("context_parallel", split_sequence_pass, CONTEXT_PARALLEL.note(
        "first: every later pass sees the rank's share of the sequence")),
    Step("pipeline_parallel", split_pipeline_stages_pass, PIPELINE_PARALLEL.note(
        "early: every later pass sees this rank's stages of every micro-batch, in the schedule's order")),
    Step("fusion", fuse_linear_cross_entropy_pass,
         (NOT_EXPAND & NOT_SPLIT).note("float32 on CPU, a wide classifier over narrow features; a head whose "
                                       "logits are read elsewhere is kept")),
    Step("expand", adopt_dtensor_collectives_pass,
         EXPAND.note("before recompute: recomputed only under 'full'/'selective', as torchtitan's checkpoint does")),
    Step("expand", merge_summed_all_reduces_pass, EXPAND),
    Step("expand", split_replicated_matmuls_pass, EXPAND.note("a no-op without tensor-parallel collectives")),
    Step("debug", insert_activation_stats_pass, ALWAYS.note("a no-op unless a debug subscriber taps activations")),
    Step("memory", recompute_activations_pass,
         ALWAYS.note("a no-op at activation_memory_budget=1.0; before the parallel passes, which then see "
                     "recomputed nodes as the backward's own")),
    Step("parallel", sum_micro_batch_gradients_pass, SEVERAL_RANKS),
    Step("replicate", expand_data_parallel_pass, REPLICATE),
    Step("fully_shard", shard_placeholders_pass, FULLY_SHARD),
    Step("fully_shard", reduce_scatter_gradients_pass, FULLY_SHARD),
    Step("mixed_precision", cast_gradient_reductions_pass, REDUCE_DTYPE),
    Step("fully_shard", rematerialize_param_views_pass, RESHARD),
    Step("fully_shard", propagate_shards_pass, FULLY_SHARD),
    Step("fully_shard", gather_parameters_pass, FULLY_SHARD),
    Step("expert_parallel", localize_experts_pass, EXPERT_PARALLEL),
    Step("fully_shard", complete_grad_norms_pass, FULLY_SHARD),
    Step("fully_shard", complete_found_inf_pass, FULLY_SHARD),
    Step("parallel", broadcast_buffers_pass, SEVERAL_RANKS.note("a no-op without broadcast_buffers")),
    Step("replicate", bucket_collectives_pass, REPLICATE),
    Step("parallel", reduce_grad_presence_pass, SEVERAL_RANKS.note("a no-op unless only opaque parts make a gradient")),
    Step("parallel", dedup_collectives_pass, COLLECTIVES),
    Step("fully_shard", keep_tail_gathers_pass, RESHARD),
    Step("mixed_precision", cast_params_before_gather_pass, FULLY_SHARD),
    Step("fully_shard", bucket_shard_collectives_pass, FULLY_SHARD),
    Step("parallel", schedule_overlap_pass, COLLECTIVES),
    Step("fully_shard", prefetch_gathers_pass, FULLY_SHARD),
    Step("fully_shard", bound_reduce_scatters_pass, FULLY_SHARD),
    Step("offload", offload_params_pass, OFFLOAD_PARAM),
    Step("offload", offload_optimizer_pass, OFFLOAD_OPTIMIZER),
    Step("fully_shard", carry_first_gather_pass, FULLY_SHARD.note("a no-op with prefetch=0")),
    Step(USER_TRANSFORMS, "override_transform_pass[<Override>]", ALWAYS.note("each Override, in order")),
    Step(USER_TRANSFORMS, "gm_transformation_pass", When("compile(gm_transformation=...)", lambda s: True)),
    Step("analysis", count_collectives_pass),
    Step("checks", insert_index_checks_pass,
         ALWAYS.note("eager's index bounds checks of the batch inputs; ORT's Gather would wrap -1")),
    Step("backend", lower_to_onnx_ops_pass, ORT_BACKEND),
    Step("backend", reinplace_optimizer_pass),
    Step("analysis", plan_memory_pass, ALWAYS.note("after the optimizer updates its state in place, as it runs")),
    Step("backend", replace_views_with_reshapes_pass),
    Step("analysis", plan_graph_capture_pass,
         ALWAYS.note("the finished graph: what a CUDA graph capture would hold and what splits it; shown on a GPU")),
)


PARALLEL_STAGES = ("context_parallel", "expand", "replicate", "fully_shard", "expert_parallel", "mixed_precision",
                   "parallel", "offload")


def build_pipeline(mode: DataParallel | None, backend: str, *, overrides: Sequence = (),
                   gm_transformation: Callable | None = None, stages: Sequence[str] | None = None,
                   expand: bool = False) -> list[GraphPass]:
    """The passes a variant with this parallel mode and backend runs, in order.

    ``stages`` keeps only the passes of those stages (e.g. ``("cleanup", *PARALLEL_STAGES)``); ``expand``: the
    state holds DTensors.
    """
    setting = Setting(mode, backend, expand)
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
    """The pipeline as docs/architecture.md lists it: stage, pass, when it runs."""
    rows = ["| # | stage | pass | runs when |", "| --- | --- | --- | --- |"]
    rows += [f"| {i} | {s.stage} | `{s.name}` | {s.when.text} |" for i, s in enumerate(STAGES, 1)]
    return "\n".join(rows)


def write_pipeline_table(path: str | Path = "docs/architecture.md") -> bool:
    """Replace the ``<!-- pipeline:begin/end -->`` block of the page at ``path`` with :func:`pipeline_markdown`;
    True when it changed."""
    path = Path(path)
    text = path.read_text()
    block = re.compile(r"(<!-- pipeline:begin -->\n).*?(\n?<!-- pipeline:end -->)", re.S)
    if not block.search(text):
        raise ValueError(f"{path} has no <!-- pipeline:begin/end --> block")
    new = block.sub(lambda m: m.group(1) + pipeline_markdown() + "\n<!-- pipeline:end -->", text, count=1)
    path.write_text(new)
    return new != text

