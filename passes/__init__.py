"""Graph passes of spmd_ort (importable as ``spmd_ort.passes``).

Every transformation of the captured train step is a function
``<verb>_<object>_pass(gm, ctx) -> gm``; :mod:`.pipeline` orders them and
:func:`run_passes` applies them.
"""

from .data_parallel import (bucket_collectives_pass, dedup_collectives_pass, expand_data_parallel_pass,
                            schedule_overlap_pass)
from .fully_shard import (bucket_shard_collectives_pass, keep_tail_gathers_pass, offload_optimizer_pass,
                          offload_params_pass, shard_parameters_pass)
from .cleanup import remove_identity_views_pass, remove_redundant_copies_pass
from .pipeline import capture_cleanup_passes, fx_executor_passes, parallel_passes
from .reinplace import reinplace_optimizer_pass
from .runner import GraphPass, PassContext, PassError, PassRecord, disabled_from_env, op_counts, run_passes

__all__ = [
    "bucket_shard_collectives_pass", "keep_tail_gathers_pass", "offload_optimizer_pass", "offload_params_pass", "shard_parameters_pass",
    "bucket_collectives_pass", "dedup_collectives_pass", "expand_data_parallel_pass", "schedule_overlap_pass",
    "GraphPass", "PassContext", "PassError", "PassRecord", "capture_cleanup_passes", "disabled_from_env",
    "fx_executor_passes", "op_counts", "parallel_passes", "reinplace_optimizer_pass", "remove_identity_views_pass",
    "remove_redundant_copies_pass", "run_passes",
]
