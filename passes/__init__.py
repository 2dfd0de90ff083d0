"""Graph passes of spmd_ort (importable as ``spmd_ort.passes``).

Every transformation of the captured train step is a function
``<verb>_<object>_pass(gm, ctx) -> gm``; :mod:`.pipeline` orders them all and
:func:`run_passes` applies them, checking the contracts each declares.
"""

from .activation_stats import insert_activation_stats_pass
from .analysis import plan_memory_pass
from .cleanup import remove_identity_views_pass, remove_redundant_copies_pass
from .context import (GradientBuckets, Lowering, MemoryPlan, OffloadPlan, PassContext, PassRecord, PassResults,
                      ShardBuckets)
from .contracts import Invariant
from .data_parallel import (broadcast_buffers_pass, bucket_collectives_pass, dedup_collectives_pass,
                            expand_data_parallel_pass, schedule_overlap_pass)
from .fully_shard import (complete_found_inf_pass, complete_grad_norms_pass, gather_parameters_pass,
                          propagate_shards_pass, reduce_scatter_gradients_pass, rematerialize_param_views_pass,
                          shard_placeholders_pass)
from .lowering import lower_to_onnx_ops_pass
from .mixed_precision import cast_gradient_reductions_pass, cast_params_before_gather_pass
from .offload import offload_optimizer_pass, offload_params_pass
from .pipeline import PARALLEL_STAGES, STAGES, build_pipeline, check_disabled, pass_names, pipeline_markdown
from .reinplace import reinplace_optimizer_pass
from .runner import GraphPass, PassError, graph_pass, op_counts, run_passes
from .shard_schedule import bucket_shard_collectives_pass, keep_tail_gathers_pass, prefetch_gathers_pass
from .user import gm_transformation_pass, override_transform_pass

__all__ = [
    "PARALLEL_STAGES", "STAGES", "GradientBuckets", "GraphPass", "Invariant", "Lowering", "MemoryPlan", "OffloadPlan", "PassContext", "PassError",
    "PassRecord", "PassResults", "ShardBuckets", "broadcast_buffers_pass", "bucket_collectives_pass",
    "bucket_shard_collectives_pass", "build_pipeline", "cast_gradient_reductions_pass",
    "cast_params_before_gather_pass", "check_disabled", "complete_found_inf_pass", "complete_grad_norms_pass",
    "dedup_collectives_pass", "expand_data_parallel_pass", "gather_parameters_pass", "gm_transformation_pass",
    "graph_pass", "insert_activation_stats_pass", "keep_tail_gathers_pass", "lower_to_onnx_ops_pass", "offload_optimizer_pass", "offload_params_pass", "op_counts",
    "override_transform_pass", "pass_names", "pipeline_markdown", "plan_memory_pass", "prefetch_gathers_pass",
    "propagate_shards_pass", "reduce_scatter_gradients_pass", "reinplace_optimizer_pass",
    "rematerialize_param_views_pass", "remove_identity_views_pass", "remove_redundant_copies_pass", "run_passes",
    "schedule_overlap_pass", "shard_placeholders_pass",
]
