"""Graph passes of spmd_ort (importable as ``spmd_ort.passes``).

Every transformation of the captured train step is a function
``<verb>_<object>_pass(gm, ctx) -> gm`` declared with its contract
(:func:`graph_pass`: what it requires, provides and invalidates); :mod:`.pipeline`
orders them all (``STAGES``) and :func:`run_passes` checks that order, applies
them and checks the contracts.  Results a pass records are typed
(:class:`PassResult` subclasses, defined next to the pass that records them).
"""

from .activation_stats import insert_activation_stats_pass
from .analysis import CollectiveCounts, MemoryPlan, count_collectives_pass, plan_memory_pass
from .cleanup import remove_identity_views_pass, remove_redundant_copies_pass
from .context import PassContext, PassRecord, PassResult, PassResults
from .contracts import Invariant
from .expand import (adopt_dtensor_collectives_pass, merge_summed_all_reduces_pass, node_signatures,
                     split_replicated_matmuls_pass, state_checksums)
from .data_parallel import (GradientBuckets, SummedMicroBatches, broadcast_buffers_pass, bucket_collectives_pass,
                            dedup_collectives_pass, expand_data_parallel_pass, reduce_grad_presence_pass,
                            schedule_overlap_pass, sum_micro_batch_gradients_pass)
from .fully_shard import (ShardedParams, complete_found_inf_pass, complete_grad_norms_pass, gather_parameters_pass,
                          propagate_shards_pass, reduce_scatter_gradients_pass, rematerialize_param_views_pass,
                          shard_placeholders_pass)
from .fusion import FusedLosses, fuse_linear_cross_entropy_pass
from .index_checks import INDEX_RULES, IndexChecks, insert_index_checks_pass
from .layout import RandomLayouts, pin_random_layouts_pass
from .lowering import Lowering, lower_to_onnx_ops_pass
from .mixed_precision import cast_gradient_reductions_pass, cast_params_before_gather_pass
from .offload import OptimizerOffload, ParamOffload, offload_optimizer_pass, offload_params_pass
from .pipeline import (PARALLEL_STAGES, STAGES, build_pipeline, check_disabled, pass_names, pipeline_markdown,
                       write_readme_table)
from .recompute import Recomputation, recompute_activations_pass
from .reinplace import reinplace_optimizer_pass
from .runner import Contract, GraphPass, PassError, check_order, contract_of, graph_pass, op_counts, run_passes
from .shard_schedule import (CarriedGather, KeptForBackward, ShardBuckets, bucket_shard_collectives_pass,
                             carry_first_gather_pass, keep_tail_gathers_pass, prefetch_gathers_pass)
from .user import gm_transformation_pass, override_transform_pass
from .views import replace_views_with_reshapes_pass

__all__ = [
    "CarriedGather", "CollectiveCounts", "Contract", "GradientBuckets", "GraphPass", "INDEX_RULES", "IndexChecks",
    "Invariant", "KeptForBackward", "Lowering", "MemoryPlan", "OptimizerOffload", "PARALLEL_STAGES", "ParamOffload",
    "PassContext", "PassError", "PassRecord", "PassResult", "PassResults", "RandomLayouts", "Recomputation",
    "STAGES", "ShardBuckets", "ShardedParams", "SummedMicroBatches", "adopt_dtensor_collectives_pass",
    "broadcast_buffers_pass", "bucket_collectives_pass", "bucket_shard_collectives_pass", "build_pipeline",
    "carry_first_gather_pass", "cast_gradient_reductions_pass", "cast_params_before_gather_pass", "check_disabled",
    "check_order", "complete_found_inf_pass", "complete_grad_norms_pass", "contract_of", "count_collectives_pass",
    "dedup_collectives_pass", "expand_data_parallel_pass", "fuse_linear_cross_entropy_pass", "FusedLosses",
    "gather_parameters_pass", "gm_transformation_pass",
    "graph_pass", "insert_activation_stats_pass", "insert_index_checks_pass", "keep_tail_gathers_pass",
    "lower_to_onnx_ops_pass", "merge_summed_all_reduces_pass", "node_signatures", "state_checksums", "split_replicated_matmuls_pass", "offload_optimizer_pass", "offload_params_pass", "op_counts",
    "override_transform_pass", "pass_names", "pin_random_layouts_pass", "pipeline_markdown", "plan_memory_pass",
    "prefetch_gathers_pass", "propagate_shards_pass", "recompute_activations_pass", "reduce_grad_presence_pass",
    "reduce_scatter_gradients_pass", "reinplace_optimizer_pass", "rematerialize_param_views_pass",
    "remove_identity_views_pass", "remove_redundant_copies_pass", "replace_views_with_reshapes_pass", "run_passes",
    "schedule_overlap_pass", "shard_placeholders_pass", "sum_micro_batch_gradients_pass", "write_readme_table",
]
