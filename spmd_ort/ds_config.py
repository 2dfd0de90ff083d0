"""DeepSpeed JSON configs -> the settings of a :class:`spmd_ort.DataParallel`.

``DataParallel.from_deepspeed_config(path_or_dict)`` builds its mode from
:func:`data_parallel_settings`, which reads ``zero_optimization`` and maps what
has a meaning here:

==========================================  ==============================================
DeepSpeed                                   spmd_ort
==========================================  ==============================================
``stage`` 0                                 ``parallel_style="replicate"`` (DDP)
``stage`` 1, 2                              ``fully_shard`` with ``reshard_after_forward=False``
                                            (parameters stay gathered from forward to
                                            backward; gradients and optimizer state are
                                            sharded - at least the saving ZeRO-1/2 give)
``stage`` 3                                 ``fully_shard``, ``reshard_after_forward=True``
``offload_optimizer.device`` cpu / none     ``offload_optimizer="cpu"`` / ``None``
``offload_param.device`` cpu / none         ``offload_param="cpu"`` / ``None``
``reduce_bucket_size`` (elements)           ``bucket_cap_mb`` (x 4 bytes)
``allgather_bucket_size`` (elements)        ``bucket_cap_mb`` if no ``reduce_bucket_size``
``stage3_prefetch_bucket_size`` (elements)  ``prefetch`` = buckets that fit in it (>= 1)
``overlap_comm`` false                      ``prefetch=0``
``stage3_max_reuse_distance`` and others    accepted: no effect, listed in ACCEPTED_NO_EFFECT
==========================================  ==============================================

Anything else - in ``zero_optimization`` or at the top level (``fp16``/``bf16``
enabled, ``gradient_clipping``, ``optimizer``, ``scheduler``, ...) - is
rejected with an error that lists every unsupported key: those settings change
what training computes, and here the train step itself says how to clip, which
optimizer to use and in which precision.  Batch-size keys are accepted (the
data loader decides the batch; they describe it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "allgather_bucket_size",
             "stage3_prefetch_bucket_size", "overlap_comm", "reduce_scatter", "contiguous_gradients",
             "allgather_partitions"}
# accepted because they tune DeepSpeed's own memory management, which has no counterpart here
ACCEPTED_NO_EFFECT = {"stage3_max_live_parameters", "stage3_param_persistence_threshold", "stage3_max_reuse_distance", "round_robin_gradients",
                      "sub_group_size", "stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear",
                      "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters"}
OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "fast_init", "ratio", "nvme_path", "buffer_size",
                "max_in_cpu"}
TOP_LEVEL_OK = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer", "dump_state", "comms_logger", "flops_profiler"}
PRECISION_KEYS = ("fp16", "bf16", "amp")
BYTES_PER_ELEMENT = 4  # DeepSpeed counts bucket sizes in elements; fp32 here


class DeepSpeedConfigError(ValueError):
    pass


def _load(config: str | Path | dict) -> dict:
    if isinstance(config, dict):
        return config
    path = Path(config)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DeepSpeedConfigError(f"DeepSpeed config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from None


def _offload(section: Any, name: str, unsupported: list[str]) -> str | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        unsupported.append(f"zero_optimization.{name} (expected an object)")
        return None
    unsupported += [f"zero_optimization.{name}.{k}" for k in section if k not in OFFLOAD_KEYS]
    device = str(section.get("device", "none")).lower()
    if device == "none":
        return None
    if device != "cpu":
        unsupported.append(f"zero_optimization.{name}.device={device!r} (only 'cpu' or 'none')")
        return None
    return "cpu"


def data_parallel_settings(config: str | Path | dict) -> dict[str, Any]:
    """Keyword arguments of ``DataParallel`` for a DeepSpeed config (path or dict); unsupported keys raise."""
    cfg = _load(config)
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError("a DeepSpeed config is a JSON object")
    unsupported: list[str] = []
    for key, value in cfg.items():
        if key in PRECISION_KEYS:
            if isinstance(value, dict) and value.get("enabled", False):
                unsupported.append(f"{key}.enabled=true (the step runs in the precision its model has; "
                                   "use torch.autocast or cast the model)")
        elif key not in TOP_LEVEL_OK:
            unsupported.append(key)
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise DeepSpeedConfigError("zero_optimization must be a JSON object")
    for key in zero:
        if key not in ZERO_KEYS | ACCEPTED_NO_EFFECT:
            unsupported.append(f"zero_optimization.{key}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        unsupported.append(f"zero_optimization.stage={stage!r} (0-3)")
    if zero.get("reduce_scatter", True) is False:
        unsupported.append("zero_optimization.reduce_scatter=false (gradients are always reduce-scattered)")
    offload_optimizer = _offload(zero.get("offload_optimizer"), "offload_optimizer", unsupported)
    offload_param = _offload(zero.get("offload_param"), "offload_param", unsupported)
    if stage != 3 and offload_param:
        unsupported.append("zero_optimization.offload_param needs stage 3")
    if stage == 0 and offload_optimizer:
        unsupported.append("zero_optimization.offload_optimizer needs stage 1-3")
    if unsupported:
        raise DeepSpeedConfigError(
            "DeepSpeed config: unsupported settings: " + "; ".join(unsupported)
            + ". Remove them (spmd_ort maps zero_optimization: " + ", ".join(sorted(ZERO_KEYS)) + ")")
    kwargs: dict[str, Any] = {}
    bucket = zero.get("reduce_bucket_size", zero.get("allgather_bucket_size"))
    if bucket is not None:
        kwargs["bucket_cap_mb"] = float(bucket) * BYTES_PER_ELEMENT / 2**20
    if stage == 0:
        return {"parallel_style": "replicate", **kwargs}
    prefetch = 1
    if "stage3_prefetch_bucket_size" in zero and bucket:
        prefetch = max(1, int(float(zero["stage3_prefetch_bucket_size"]) // float(bucket)))
    if zero.get("overlap_comm", True) is False:
        prefetch = 0
    return {"parallel_style": "fully_shard", "reshard_after_forward": stage == 3, "prefetch": prefetch,
            "offload_optimizer": offload_optimizer, "offload_param": offload_param, **kwargs}
