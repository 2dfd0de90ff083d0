"""Graph passes of spmd_ort (importable as ``spmd_ort.passes``).

Every transformation of the captured train step is a function
``<verb>_<object>_pass(gm, ctx) -> gm`` declared with its contract
(:func:`graph_pass`: what it requires, provides and invalidates); :mod:`.pipeline`
orders them all (``STAGES``) and :func:`run_passes` checks that order, applies
them and checks the contracts.  Results a pass records are typed
(:class:`PassResult` subclasses, defined next to the pass that records them and imported from that module,
e.g. ``spmd_ort.passes.analysis.MemoryPlan``).

The names here: the runner's API, then the pass functions by stage, in pipeline order.
"""

from .context import PassContext, PassRecord, PassResult, PassResults
from .contracts import Invariant
from .pipeline import (PARALLEL_STAGES, STAGES, build_pipeline, check_disabled, pass_names, pipeline_markdown,
                       write_pipeline_table)
from .runner import Contract, GraphPass, PassError, check_order, contract_of, graph_pass, op_counts, run_passes

from .layout import pin_random_layouts_pass
from .cleanup import remove_identity_views_pass, remove_redundant_copies_pass
from .fusion import fuse_linear_cross_entropy_pass
from .expand import adopt_dtensor_collectives_pass, merge_summed_all_reduces_pass, split_replicated_matmuls_pass
from .activation_stats import insert_activation_stats_pass
from .recompute import recompute_activations_pass
from .data_parallel import (broadcast_buffers_pass, bucket_collectives_pass, dedup_collectives_pass,
                            expand_data_parallel_pass, reduce_grad_presence_pass, schedule_overlap_pass,
                            sum_micro_batch_gradients_pass)
from .fully_shard import (complete_found_inf_pass, complete_grad_norms_pass, gather_parameters_pass,
                          propagate_shards_pass, reduce_scatter_gradients_pass, rematerialize_param_views_pass,
                          shard_placeholders_pass)
from .mixed_precision import cast_gradient_reductions_pass, cast_params_before_gather_pass
from .shard_schedule import (bound_reduce_scatters_pass, bucket_shard_collectives_pass, carry_first_gather_pass,
                             keep_tail_gathers_pass, prefetch_gathers_pass)
from .offload import offload_optimizer_pass, offload_params_pass
from .user import gm_transformation_pass, override_transform_pass
from .analysis import count_collectives_pass, plan_graph_capture_pass, plan_memory_pass
from .index_checks import insert_index_checks_pass
from .lowering import lower_to_onnx_ops_pass
from .reinplace import reinplace_optimizer_pass
from .views import replace_views_with_reshapes_pass

__all__ = [
    # the runner: declare, order, check and apply passes
    "Contract", "GraphPass", "Invariant", "PARALLEL_STAGES", "PassContext", "PassError", "PassRecord", "PassResult",
    "PassResults", "STAGES", "build_pipeline", "check_disabled", "check_order", "contract_of", "graph_pass",
    "op_counts", "pass_names", "pipeline_markdown", "run_passes", "write_pipeline_table",
    # random, cleanup, fusion
    "pin_random_layouts_pass", "remove_redundant_copies_pass", "remove_identity_views_pass",
    "fuse_linear_cross_entropy_pass",
    # expand (DTensor parameters)
    "adopt_dtensor_collectives_pass", "merge_summed_all_reduces_pass", "split_replicated_matmuls_pass",
    # debug, memory
    "insert_activation_stats_pass", "recompute_activations_pass",
    # parallel, replicate
    "sum_micro_batch_gradients_pass", "expand_data_parallel_pass", "broadcast_buffers_pass",
    "bucket_collectives_pass", "reduce_grad_presence_pass", "dedup_collectives_pass", "schedule_overlap_pass",
    # fully_shard, mixed precision, offload
    "shard_placeholders_pass", "reduce_scatter_gradients_pass", "cast_gradient_reductions_pass",
    "rematerialize_param_views_pass", "propagate_shards_pass", "gather_parameters_pass", "complete_grad_norms_pass",
    "complete_found_inf_pass", "keep_tail_gathers_pass", "cast_params_before_gather_pass",
    "bucket_shard_collectives_pass", "prefetch_gathers_pass",
    "bound_reduce_scatters_pass", "offload_params_pass", "offload_optimizer_pass",
    "carry_first_gather_pass",
    # user transforms
    "override_transform_pass", "gm_transformation_pass",
    # analysis, checks, backend
    "plan_memory_pass", "plan_graph_capture_pass", "count_collectives_pass", "insert_index_checks_pass",
    "lower_to_onnx_ops_pass", "reinplace_optimizer_pass", "replace_views_with_reshapes_pass",
]
