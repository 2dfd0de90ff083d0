"""The ordered pass pipelines.  This is the one place that says what runs when."""

from __future__ import annotations

from .data_parallel import (bucket_collectives_pass, dedup_collectives_pass, expand_data_parallel_pass,
                            schedule_overlap_pass)
from .cleanup import remove_identity_views_pass, remove_redundant_copies_pass
from .fully_shard import (bucket_shard_collectives_pass, keep_tail_gathers_pass, offload_optimizer_pass,
                          offload_params_pass, shard_parameters_pass)
from .reinplace import reinplace_optimizer_pass
from .runner import GraphPass, PassContext


def capture_cleanup_passes(ctx: PassContext) -> list[GraphPass]:
    """Right after capture, before parallel expansion."""
    return [remove_redundant_copies_pass, remove_identity_views_pass]


def parallel_passes(ctx: PassContext) -> list[GraphPass]:
    """Distributed expansion for ``ctx.parallel_mode`` (empty on one rank)."""
    mode = ctx.parallel_mode
    if mode is None:
        return []
    if mode.sharded:
        passes = [shard_parameters_pass, dedup_collectives_pass, keep_tail_gathers_pass,
                  bucket_shard_collectives_pass, schedule_overlap_pass]
        if mode.offload_param:
            passes.append(offload_params_pass)
        if mode.offload_optimizer:
            passes.append(offload_optimizer_pass)
        return passes
    return [expand_data_parallel_pass, bucket_collectives_pass, dedup_collectives_pass, schedule_overlap_pass]


def fx_executor_passes(ctx: PassContext) -> list[GraphPass]:
    """Last passes before the graph runs on the fx executor."""
    return [reinplace_optimizer_pass]
