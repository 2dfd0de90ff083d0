"""DeepSpeed JSON configs -> the settings of a :class:`spmd_ort.DataParallel`.

:func:`zero_settings` reads ``zero_optimization`` and maps what has a meaning
here (the whole config - optimizer, scheduler, fp16/bf16, clipping, accumulation
- is :func:`spmd_ort.from_deepspeed_config`, in :mod:`spmd_ort.integrations.deepspeed.plan`):

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

``DataParallel.from_deepspeed_config(path_or_dict)`` (:func:`data_parallel_settings`)
returns the mode alone: anything else that changes what training computes
(``fp16``/``bf16`` enabled, ``gradient_clipping``, ``optimizer``, ``scheduler``,
``gradient_accumulation_steps`` above 1, unknown keys) is rejected with one
error listing every such key and pointing to ``spmd_ort.from_deepspeed_config``,
which maps them.  Batch-size keys are accepted (they describe the batch the data
loader makes).

Booleans are read as DeepSpeed's own config models read them (:func:`config_bool`):
DeepSpeed validates its config with pydantic models in lax mode, so ``"false"``,
``"no"``, ``"off"`` and ``"0"`` (as JSON templates write them) are false there and here;
a string it would reject (``"maybe"``) is an error naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spmd_ort.errors import ConfigError

ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "allgather_bucket_size",
             "stage3_prefetch_bucket_size", "overlap_comm", "reduce_scatter", "contiguous_gradients",
             "allgather_partitions"}
# accepted because they tune DeepSpeed's own memory management, which has no counterpart here
ACCEPTED_NO_EFFECT = {"stage3_max_live_parameters", "stage3_param_persistence_threshold", "stage3_max_reuse_distance",
                      "round_robin_gradients",
                      "sub_group_size", "stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear",
                      "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters"}
OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "fast_init", "ratio", "nvme_path", "buffer_size",
                "max_in_cpu"}
TOP_LEVEL_OK = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "steps_per_print", "wall_clock_breakdown",
                "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer", "dump_state", "comms_logger", "flops_profiler"}
PRECISION_KEYS = ("fp16", "bf16", "amp")
BYTES_PER_ELEMENT = 4  # DeepSpeed counts bucket sizes in elements; fp32 here
# the boolean fields of DeepSpeed's models for the sections read here (checked even where they have no effect,
# since DeepSpeed rejects a value that is no boolean)
ZERO_BOOL_KEYS = ("overlap_comm", "reduce_scatter", "contiguous_gradients", "allgather_partitions",
                  "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear",
                  "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters")
OFFLOAD_BOOL_KEYS = ("pin_memory", "fast_init")
TOP_LEVEL_BOOL_KEYS = ("wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                       "dump_state", "memory_breakdown")
# pydantic's lax parsing of a ``bool`` field (pydantic_core's bool validator), which DeepSpeed's config models use:
# any case, no surrounding blanks; the numbers 0 and 1 too
TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


class DeepSpeedConfigError(ConfigError):
    """A DeepSpeed config (or a value in it) that spmd_ort does not accept; the message names every such key."""


def parse_bool(value: Any) -> bool | None:
    """``value`` as a DeepSpeed config model reads a boolean field, or None where it would reject it.

    ``true``/``false``, the numbers 0 and 1, and the strings of :data:`TRUE_STRINGS` / :data:`FALSE_STRINGS`
    in any case: ``"false"`` is false (``bool("false")`` would be true).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.lower() in TRUE_STRINGS:
            return True
        if value.lower() in FALSE_STRINGS:
            return False
    return None


def config_bool(section: dict, key: str, default: bool, path: str, problems: list[str]) -> bool:
    """``section[key]`` read as DeepSpeed reads a boolean (:func:`parse_bool`); ``default`` where it is absent.

    A value DeepSpeed would reject is appended to ``problems`` under its dotted ``path``; ``"auto"`` (the HF
    Trainer's placeholder) is left to the callers, which resolve it or name it.
    """
    value = section.get(key, default)
    if value == "auto":
        return default
    parsed = parse_bool(value)
    if parsed is None:
        problems.append(f"{path}={value!r} (a boolean: true or false; DeepSpeed also reads the strings "
                        f"{', '.join(repr(s) for s in sorted(TRUE_STRINGS | FALSE_STRINGS))} and the numbers 0 and 1)")
        return default
    return parsed


def check_bools(section: dict, keys: tuple[str, ...], prefix: str, problems: list[str]) -> None:
    """Every boolean of ``keys`` present in ``section`` is one DeepSpeed reads (whether or not it has an effect)."""
    for key in keys:
        if key in section:
            config_bool(section, key, False, f"{prefix}{key}", problems)


def load_config(config: str | Path | dict) -> dict:
    """A DeepSpeed config from a dict or a JSON file path; anything else is a ``TypeError``."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, Path)):
        raise TypeError(f"a DeepSpeed config is a dict or the path of a JSON file, not {type(config).__name__}")
    path = Path(config)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DeepSpeedConfigError(f"DeepSpeed config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from None
    except IsADirectoryError:
        raise DeepSpeedConfigError(f"DeepSpeed config {path} is a directory, not a JSON file") from None


def _offload(section: Any, name: str, unsupported: list[str]) -> str | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        unsupported.append(f"zero_optimization.{name} (expected an object)")
        return None
    unsupported += [f"zero_optimization.{name}.{k}" for k in section if k not in OFFLOAD_KEYS]
    check_bools(section, OFFLOAD_BOOL_KEYS, f"zero_optimization.{name}.", unsupported)
    device = str(section.get("device", "none")).lower()
    if device == "none":
        return None
    if device != "cpu":
        unsupported.append(f"zero_optimization.{name}.device={device!r} (only 'cpu' or 'none')")
        return None
    return "cpu"


def data_parallel_settings(config: str | Path | dict) -> dict[str, Any]:
    """Keyword arguments of ``DataParallel`` for a DeepSpeed config (path or dict); anything else that changes
    the computation raises (``spmd_ort.from_deepspeed_config`` maps it)."""
    cfg = load_config(config)
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError("a DeepSpeed config is a JSON object")
    unsupported: list[str] = [f"{path}='auto' (give it a value, or use spmd_ort.from_deepspeed_config(config, "
                              "model), which resolves 'auto')" for path in auto_paths(cfg)]
    check_bools(cfg, TOP_LEVEL_BOOL_KEYS, "", unsupported)
    for key, value in cfg.items():
        if key in PRECISION_KEYS:
            if isinstance(value, dict) and config_bool(value, "enabled", False, f"{key}.enabled", unsupported):
                unsupported.append(f"{key}.enabled={json.dumps(value['enabled'])}")
        elif key == "gradient_accumulation_steps":
            if value != 1:
                unsupported.append(f"gradient_accumulation_steps={value!r} (it changes how many batches make a step)")
        elif key not in TOP_LEVEL_OK:
            unsupported.append(key)
    zero = cfg.get("zero_optimization", {})
    settings = zero_settings(zero, unsupported)
    if unsupported:
        raise DeepSpeedConfigError(
            "DeepSpeed config: DataParallel.from_deepspeed_config maps zero_optimization only; unsupported here: "
            + "; ".join(unsupported) + ". spmd_ort.from_deepspeed_config(config, model) maps optimizer, scheduler, "
            "fp16/bf16, gradient_clipping and gradient_accumulation_steps too")
    return settings


def auto_paths(cfg: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value (the HF Trainer's placeholder) in a config."""
    if isinstance(cfg, dict):
        return [p for k, v in cfg.items() for p in auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if cfg == "auto" else []


def zero_settings(zero: Any, unsupported: list[str]) -> dict[str, Any]:
    """``DataParallel`` keyword arguments for a ``zero_optimization`` section; what cannot be mapped is
    appended to ``unsupported``."""
    if not isinstance(zero, dict):
        raise DeepSpeedConfigError("zero_optimization must be a JSON object")
    for key in zero:
        if key not in ZERO_KEYS | ACCEPTED_NO_EFFECT:
            unsupported.append(f"zero_optimization.{key}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        unsupported.append(f"zero_optimization.stage={stage!r} (0-3)")
    check_bools(zero, ZERO_BOOL_KEYS, "zero_optimization.", unsupported)
    if not config_bool(zero, "reduce_scatter", True, "zero_optimization.reduce_scatter", []):
        unsupported.append("zero_optimization.reduce_scatter=false (gradients are always reduce-scattered)")
    offload_optimizer = _offload(zero.get("offload_optimizer"), "offload_optimizer", unsupported)
    offload_param = _offload(zero.get("offload_param"), "offload_param", unsupported)
    if stage != 3 and offload_param:
        unsupported.append("zero_optimization.offload_param needs stage 3")
    if stage == 0 and offload_optimizer:
        unsupported.append("zero_optimization.offload_optimizer needs stage 1-3")
    kwargs: dict[str, Any] = {}
    bucket = zero.get("reduce_bucket_size", zero.get("allgather_bucket_size"))
    if isinstance(bucket, str):
        bucket = None  # "auto": reported by the caller
    if bucket is not None:
        kwargs["bucket_cap_mb"] = float(bucket) * BYTES_PER_ELEMENT / 2**20
    if stage == 0:
        return {"parallel_style": "replicate", **kwargs}
    prefetch = 1
    if not isinstance(zero.get("stage3_prefetch_bucket_size", 0), str) and "stage3_prefetch_bucket_size" in zero \
            and bucket:
        prefetch = max(1, int(float(zero["stage3_prefetch_bucket_size"]) // float(bucket)))
    if not config_bool(zero, "overlap_comm", True, "zero_optimization.overlap_comm", []):
        prefetch = 0  # (a value that is no boolean was reported by check_bools above)
    return {"parallel_style": "fully_shard", "reshard_after_forward": stage == 3, "prefetch": prefetch,
            "offload_optimizer": offload_optimizer, "offload_param": offload_param, **kwargs}
