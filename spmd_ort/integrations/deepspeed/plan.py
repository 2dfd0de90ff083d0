"""DeepSpeed configs as they are written: ``spmd_ort.from_deepspeed_config(config, model)`` -> a :class:`DeepSpeedPlan`.

A DeepSpeed script hands its config to ``deepspeed.initialize`` and lets the
engine do the rest.  Here the config becomes the parts of a plain PyTorch step,
each the thing DeepSpeed would have done:

==================================  ==========================================================
DeepSpeed                           the plan
==================================  ==========================================================
``zero_optimization``               ``parallel_mode``: a ``DataParallel`` (:mod:`spmd_ort.distributed.deepspeed_config`)
``optimizer`` Adam / AdamW / SGD    ``optimizer``: torch's (fused), DeepSpeed's defaults; ``Adam``
                                    is AdamW unless ``adam_w_mode: false``, as in DeepSpeed
``scheduler`` WarmupLR, ...         ``scheduler``: a torch LR scheduler (:mod:`.schedules`)
``fp16`` (``loss_scale: 0``)        fp16 parameters for compute over fp32 masters (DeepSpeed casts
                                    the model; here ``MixedPrecisionPolicy(param_dtype=float16)``),
                                    and ``scaler``: :class:`spmd_ort.capture.amp.DynamicLossScaler` from
                                    ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
                                    ``consecutive_hysteresis``, ``min_loss_scale``
``fp16.auto_cast: true``            fp32 parameters, ``autocast_dtype=float16`` (``plan.autocast()``)
``bf16``                            ``MixedPrecisionPolicy(param_dtype=bfloat16)``, no scaler
``communication_data_type``         the policy's ``reduce_dtype`` (default: the parameters' dtype)
``gradient_clipping`` (0: off)      ``gradient_clipping``
``gradient_accumulation_steps``     ``gradient_accumulation_steps``: micro-batches per step
``train_batch_size``, ...           checked: train_batch_size = micro batch x accumulation x world
==================================  ==========================================================

``plan.make_train_step(loss_fn)`` is the step DeepSpeed's engine runs
(``backward`` of each micro-batch's loss / accumulation steps, unscale, clip,
step, update, zero_grad) as a function to compile; ``plan.step_scheduler()``
advances the schedule unless the step was skipped for an overflow (DeepSpeed
does the same).  ``"auto"`` values (the HF Trainer's placeholder) are resolved
from the other batch sizes, the optimizer's lr, the model's ``config.hidden_size``
or the ``auto=`` argument, or named in the error.  Every key either changes
something here, is listed as having no effect (logging, DeepSpeed's own memory
tuning), or is an error: one error that lists them all.  Booleans are read as DeepSpeed
reads them (``"enabled": "false"`` is false: :func:`spmd_ort.distributed.deepspeed_config.config_bool`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spmd_ort.distributed import parallel
from spmd_ort.capture.amp import DynamicLossScaler
from spmd_ort.distributed.precision import MixedPrecisionPolicy
from spmd_ort.distributed.deepspeed_config import (TOP_LEVEL_BOOL_KEYS, DeepSpeedConfigError, auto_paths,
                                                     check_bools, config_bool, load_config, zero_settings)
from spmd_ort.integrations.deepspeed.schedules import SCHEDULES, build_schedule

# top-level keys with no effect on what is computed (logging, profiling, DeepSpeed's own switches)
NO_EFFECT = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
             "dump_state", "comms_logger", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "memory_breakdown",
             "prescale_gradients"}
MAPPED = {"zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping",
          "gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu",
          "communication_data_type"}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"}
BF16_KEYS = {"enabled", "immediate_grad_update"}
ADAM_BOOLS = ("adam_w_mode", "amsgrad", "bias_correction", "torch_adam", "fused")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# DeepSpeed's defaults for its Adam (FusedAdam / DeepSpeedCPUAdam) and what each key means here
ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
ADAM_KEYS = set(ADAM_DEFAULTS) | {"adam_w_mode", "amsgrad", "bias_correction", "torch_adam", "fused"}
SGD_KEYS = {"lr", "momentum", "dampening", "weight_decay", "nesterov"}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass
class DeepSpeedPlan:
    """What a DeepSpeed config asks for, as the parts of a PyTorch train step (see the module docstring)."""

    parallel_mode: parallel.DataParallel | parallel.TensorParallel  # (with a tensor-parallel plan: 2-D)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scaler: DynamicLossScaler | None = None
    autocast_dtype: torch.dtype | None = None
    gradient_clipping: float | None = None
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    world_size: int = 1
    config: dict = field(default_factory=dict)  # with every "auto" resolved

    @property
    def mixed_precision(self) -> MixedPrecisionPolicy | None:
        return self.parallel_mode.mixed_precision

    def device_type(self) -> str:
        """Where the optimizer's parameters live: the device type autocast acts on (``cuda`` for a model on a GPU;
        autocast for another device type than the model's would change nothing, silently)."""
        return next((p.device.type for g in self.optimizer.param_groups for p in g["params"]), "cpu")

    def autocast(self, device_type: str | None = None):
        """``torch.autocast`` for ``fp16.auto_cast`` (on the parameters' device type unless told); a no-op
        otherwise."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type or self.device_type(), dtype=self.autocast_dtype)

    def make_train_step(self, loss_fn: Callable[..., torch.Tensor], device_type: str | None = None) -> Callable:
        """``step(model, opt, scaler, micro_batches) -> mean loss``: DeepSpeed's engine step, to compile.

        ``loss_fn(model, *batch)`` returns one micro-batch's loss; ``micro_batches`` holds
        ``gradient_accumulation_steps`` batches.  Each loss is divided by the accumulation
        steps before its (scaled) backward, the gradients are unscaled before clipping,
        the step is skipped on an overflow, then the gradients are set to None.
        """
        accumulation, clip = self.gradient_accumulation_steps, self.gradient_clipping

        def train_step(model, opt, scaler, micro_batches):
            if len(micro_batches) != accumulation:
                raise ValueError(f"the DeepSpeed config accumulates {accumulation} micro-batches per step "
                                 f"(gradient_accumulation_steps), but `micro_batches` holds {len(micro_batches)}: "
                                 f"pass a list of {accumulation} batches, each a tuple of loss_fn's arguments "
                                 "after the model")
            total = None
            for batch in micro_batches:
                with self.autocast(device_type):
                    loss = loss_fn(model, *batch)
                total = loss.detach() if total is None else total + loss.detach()
                scaled = loss / accumulation
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            if clip:
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            return total / accumulation

        return train_step

    def step_scheduler(self) -> None:
        """Advance the LR schedule after a step, unless it was skipped for an overflow (as DeepSpeed's engine)."""
        if self.scheduler is None:
            return
        if self.scaler is not None and self.scaler.last_step_skipped():
            return
        self.scheduler.step()


def from_deepspeed_config(config: str | Path | dict, model: nn.Module, *,
                          model_parameters: Iterable | None = None, world_size: int | None = None,
                          auto: dict[str, Any] | None = None, tensor_parallel_plan: dict | None = None,
                          mesh=None) -> DeepSpeedPlan:
    """The :class:`DeepSpeedPlan` of a DeepSpeed config (a dict or a JSON path) for ``model``.

    ``model_parameters``: what the optimizer gets (default ``model.parameters()``; param
    groups as for ``deepspeed.initialize``).  ``world_size``: default torch.distributed's.
    ``auto``: values for ``"auto"`` entries by dotted path, e.g. ``{"optimizer.params.lr": 3e-4}``.
    Unsupported settings raise one :class:`DeepSpeedConfigError` listing all of them.

    ``tensor_parallel_plan`` (torch's parallel styles by module FQN) with ``mesh`` (a 2-D ``("dp", "tp")``
    DeviceMesh): tensor parallelism over ``tp`` and the config's ZeRO stage over ``dp`` (as DeepSpeed runs
    ZeRO on the data-parallel group of a tensor-parallel model): ``parallel_mode`` is
    ``TensorParallel(plan, mesh, data_parallel=<the config's DataParallel>)``, and the batch sizes count the dp
    ranks only (the ranks of one tensor-parallel group pass the same batch).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_deepspeed_config(config, model): model must be an nn.Module, not {type(model).__name__}")
    cfg = load_config(config)
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError("a DeepSpeed config is a JSON object")
    problems: list[str] = []
    if tensor_parallel_plan is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not (isinstance(mesh, DeviceMesh) and mesh.ndim == 2 and tuple(mesh.mesh_dim_names or ()) == ("dp", "tp")):
            raise TypeError(f"from_deepspeed_config(..., tensor_parallel_plan=..., mesh={mesh!r}): give a 2-D "
                            "DeviceMesh with mesh_dim_names=('dp', 'tp'), e.g. init_device_mesh('cpu', (dp, tp), "
                            "mesh_dim_names=('dp', 'tp'))")
        world = mesh.size(0)  # the batch sizes count the data-parallel ranks
        if world_size is not None and world_size != world:
            raise TypeError(f"from_deepspeed_config(..., world_size={world_size}, tensor_parallel_plan=..., mesh=...): "
                            f"with a tensor-parallel plan the batch sizes count the mesh's {world} dp ranks; drop "
                            "world_size")
    elif mesh is not None:
        raise TypeError("from_deepspeed_config(..., mesh=...): a mesh goes with tensor_parallel_plan=...")
    else:
        world = world_size if world_size is not None else parallel.world()[1]
    cfg = _resolve_auto(cfg, model, dict(auto or {}), world, problems)
    for key in cfg:
        if key not in MAPPED | NO_EFFECT:
            problems.append(key if key not in ("amp",) else "amp (apex; use fp16 or bf16)")
    check_bools(cfg, TOP_LEVEL_BOOL_KEYS, "", problems)
    if config_bool(cfg, "prescale_gradients", False, "prescale_gradients", problems):
        problems.append(f"prescale_gradients={cfg['prescale_gradients']!r}")
    batch = _batch_sizes(cfg, world, problems)
    policy, autocast_dtype, scaler = _precision(cfg, problems)
    settings = zero_settings(cfg.get("zero_optimization", {}), problems)
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    opt = _optimizer(cfg.get("optimizer"), params, problems)
    scheduler_cfg = cfg.get("scheduler")
    _check_scheduler(scheduler_cfg, problems)
    clip = cfg.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or clip < 0:
        problems.append(f"gradient_clipping={clip!r} (a norm >= 0; 0 is off)")
        clip = 0.0
    if problems:
        raise DeepSpeedConfigError("DeepSpeed config: unsupported settings: " + "; ".join(problems))
    scheduler = _scheduler(scheduler_cfg, opt)
    mode = parallel.DataParallel(**settings, mixed_precision=policy)
    if tensor_parallel_plan is not None:
        try:
            mode = parallel.TensorParallel(tensor_parallel_plan, mesh=mesh, data_parallel=mode)
        except TypeError as exc:  # e.g. offload, which 2-D does not take
            raise DeepSpeedConfigError(f"DeepSpeed config with a tensor-parallel plan: {exc}") from exc
    return DeepSpeedPlan(parallel_mode=mode, optimizer=opt, scheduler=scheduler, scaler=scaler,
                         autocast_dtype=autocast_dtype, gradient_clipping=float(clip) or None,
                         gradient_accumulation_steps=batch[2], train_micro_batch_size_per_gpu=batch[1],
                         train_batch_size=batch[0], world_size=world, config=cfg)


# ---------------------------------------------------------------------- "auto"
def _hidden_size(model: nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "hidden_size", None)
    return int(value) if isinstance(value, int) else None


def _set(cfg: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        cfg = cfg[key]
    cfg[leaf] = value


def _get(cfg: dict, path: str, default=None):
    for key in path.split("."):
        if not isinstance(cfg, dict) or key not in cfg:
            return default
        cfg = cfg[key]
    return cfg


def _resolve_auto(cfg: dict, model: nn.Module, given: dict, world: int, problems: list[str]) -> dict:
    """A copy of ``cfg`` with every ``"auto"`` replaced (``given``, then what the config and model determine).

    Batch sizes are left for :func:`_batch_sizes` (they follow from each other); what stays
    unresolved is named in ``problems``.
    """
    import copy

    out = copy.deepcopy(cfg)
    for path in given:
        if _get(out, path, None) != "auto":
            problems.append(f"auto={{{path!r}: ...}} names no 'auto' entry of the config")
    hidden = _hidden_size(model)
    derived: dict[str, Callable[[], Any]] = {
        # the HF Trainer's rules for what only the model determines
        "zero_optimization.reduce_bucket_size": lambda: hidden * hidden if hidden else None,
        "zero_optimization.stage3_prefetch_bucket_size": lambda: int(0.9 * hidden * hidden) if hidden else None,
        "zero_optimization.stage3_param_persistence_threshold": lambda: 10 * hidden if hidden else None,
        # a warmup ends at the optimizer's lr and starts at 0 unless told otherwise
        "scheduler.params.warmup_max_lr": lambda: _number(_get(out, "optimizer.params.lr")),
        "scheduler.params.warmup_min_lr": lambda: 0.0,
    }
    for path in auto_paths(out):
        if path in given:
            _set(out, path, given[path])
        elif path in BATCH_KEYS:
            continue
        elif path in derived and derived[path]() is not None:
            _set(out, path, derived[path]())
        else:
            why = " (from the model's config.hidden_size, which it has not)" if path.startswith("zero_") else ""
            problems.append(f"{path}='auto' cannot be resolved{why}: pass "
                            f"from_deepspeed_config(..., auto={{{path!r}: value}})")
    return out


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------- batch sizes
def _batch_sizes(cfg: dict, world: int, problems: list[str]) -> tuple[int | None, int | None, int]:
    """(train_batch_size, micro batch per rank, accumulation steps), completed as DeepSpeed completes them."""
    values = {k: cfg.get(k) for k in BATCH_KEYS}
    for k, v in values.items():
        if v is not None and v != "auto" and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            problems.append(f"{k}={v!r} (a positive integer)")
            return None, None, 1
    total, micro, accumulation = (None if v == "auto" else v for v in values.values())
    if total is not None and micro is not None and accumulation is None:
        accumulation, rest = divmod(total, micro * world)
        if rest or not accumulation:
            problems.append(f"train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                            f"world size {world} x a whole number of accumulation steps")
            return total, micro, 1
    elif total is not None and accumulation is not None and micro is None:
        micro, rest = divmod(total, accumulation * world)
        if rest or not micro:
            problems.append(f"train_batch_size={total} is not gradient_accumulation_steps={accumulation} x "
                            f"world size {world} x a whole micro batch")
            return total, None, accumulation
    elif micro is not None and total is None:
        accumulation = accumulation or 1
        total = micro * accumulation * world
    elif total is not None and micro is None and accumulation is None:
        accumulation = 1
        micro, rest = divmod(total, world)
        if rest:
            problems.append(f"train_batch_size={total} does not split over world size {world}")
    accumulation = accumulation or 1
    if total is not None and micro is not None and total != micro * accumulation * world:
        problems.append(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                        f"gradient_accumulation_steps={accumulation} x world size {world} "
                        f"(= {micro * accumulation * world})")
    unresolved = [k for k, v in values.items() if v == "auto"] if (total is None or micro is None) else []
    for k in unresolved:
        problems.append(f"{k}='auto' cannot be resolved from the other batch sizes: pass "
                        f"from_deepspeed_config(..., auto={{{k!r}: value}})")
    return total, micro, accumulation


# ---------------------------------------------------------------------- precision
def _section(cfg: dict, name: str, allowed: set[str], problems: list[str]) -> dict:
    section = cfg.get(name, {})
    if not isinstance(section, dict):
        problems.append(f"{name} (expected an object)")
        return {}
    problems += [f"{name}.{k}" for k in section if k not in allowed]
    return section


def _precision(cfg: dict, problems: list[str]):
    """(MixedPrecisionPolicy or None, autocast dtype or None, scaler or None)."""
    fp16 = _section(cfg, "fp16", FP16_KEYS, problems)
    bf16 = _section(cfg, "bf16", BF16_KEYS, problems)
    comm = cfg.get("communication_data_type")
    if comm is not None and comm not in DTYPES:
        problems.append(f"communication_data_type={comm!r} (fp16, bf16 or fp32)")
        comm = None
    reduce_dtype = DTYPES.get(comm) if comm else None
    on16 = config_bool(fp16, "enabled", False, "fp16.enabled", problems)
    onbf = config_bool(bf16, "enabled", False, "bf16.enabled", problems)
    check_bools(bf16, ("immediate_grad_update",), "bf16.", problems)
    auto_cast = config_bool(fp16, "auto_cast", False, "fp16.auto_cast", problems)
    consecutive = config_bool(fp16, "consecutive_hysteresis", False, "fp16.consecutive_hysteresis", problems)
    if on16 and onbf:
        problems.append(f"fp16.enabled={fp16['enabled']!r} and bf16.enabled={bf16['enabled']!r} both turn their "
                        "precision on (enable one)")
        return None, None, None
    if onbf:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype), None, None
    if not on16:
        if reduce_dtype not in (None, torch.float32):
            return MixedPrecisionPolicy(reduce_dtype=reduce_dtype), None, None
        return None, None, None
    if fp16.get("loss_scale", 0) != 0:
        problems.append(f"fp16.loss_scale={fp16['loss_scale']!r} (a static loss scale: DeepSpeed then never checks "
                        "for overflow; use loss_scale 0, dynamic)")
        return None, None, None
    scaler = DynamicLossScaler(
        init_scale=2.0 ** fp16.get("initial_scale_power", 16), scale_window=int(fp16.get("loss_scale_window", 1000)),
        hysteresis=int(fp16.get("hysteresis", 2)), min_scale=float(fp16.get("min_loss_scale", 1)),
        consecutive_hysteresis=consecutive)
    if auto_cast:
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype not in (None, torch.float32) else None
        return policy, torch.float16, scaler
    return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=reduce_dtype), None, scaler


# ---------------------------------------------------------------------- optimizer and scheduler
def _optimizer(section, params: list, problems: list[str]) -> torch.optim.Optimizer | None:
    if section is None:
        problems.append("optimizer is missing (spmd_ort builds it from the config, as deepspeed.initialize does)")
        return None
    kind = str(section.get("type", "")).lower()
    extra = [k for k in section if k not in ("type", "params")]
    problems += [f"optimizer.{k}" for k in extra]
    given = dict(section.get("params", {}))
    if kind in ("adam", "adamw"):
        problems += [f"optimizer.params.{k}" for k in given if k not in ADAM_KEYS]
        check_bools(given, ADAM_BOOLS, "optimizer.params.", problems)

        def flag(key: str, default: bool) -> bool:  # a bad value was reported by check_bools
            return config_bool(given, key, default, f"optimizer.params.{key}", [])

        if not flag("bias_correction", True):
            problems.append(f"optimizer.params.bias_correction={given['bias_correction']!r}")
        decoupled = flag("adam_w_mode", True) if kind == "adam" else True
        defaults = dict(ADAM_DEFAULTS)
        if flag("torch_adam", False) and decoupled:
            defaults["weight_decay"] = 0.01  # DeepSpeed then builds torch.optim.AdamW, with torch's default
        kw = {k: given.get(k, v) for k, v in defaults.items()}
        kw["betas"] = tuple(kw["betas"])
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return _build(cls, params, problems, amsgrad=flag("amsgrad", False), fused=True, **kw)
    if kind == "sgd":
        problems += [f"optimizer.params.{k}" for k in given if k not in SGD_KEYS]
        if "lr" not in given:
            problems.append("optimizer.params.lr is missing (SGD has no default)")
            return None
        if "nesterov" in given:
            given["nesterov"] = config_bool(given, "nesterov", False, "optimizer.params.nesterov", problems)
        return _build(torch.optim.SGD, params, problems, fused=True, **given)
    problems.append(f"optimizer.type={section.get('type')!r} (Adam, AdamW or SGD)")
    return None


def _build(cls, params, problems: list[str], **kw):
    try:
        return cls(params, **kw)
    except (TypeError, ValueError) as exc:
        problems.append(f"optimizer.params: {exc}")
        return None


def _check_scheduler(section, problems: list[str]) -> None:
    if section is None:
        return
    if not isinstance(section, dict):
        problems.append("scheduler (expected an object)")
        return
    kind = section.get("type")
    problems += [f"scheduler.{k}" for k in section if k not in ("type", "params")]
    if kind not in SCHEDULES:
        problems.append(f"scheduler.type={kind!r} ({', '.join(SCHEDULES)})")
        return
    accepted = set(inspect.signature(SCHEDULES[kind]).parameters) - {"self", "optimizer", "last_epoch"}
    problems += [f"scheduler.params.{k} ({kind} takes {', '.join(sorted(accepted))})"
                 for k in section.get("params", {}) if k not in accepted]


def _scheduler(section, opt: torch.optim.Optimizer):
    """The scheduler of a section :func:`_check_scheduler` accepted."""
    if section is None:
        return None
    kind, params = section["type"], dict(section.get("params", {}))
    try:
        return build_schedule(kind, opt, params)
    except (TypeError, ValueError) as exc:
        raise DeepSpeedConfigError(f"DeepSpeed config: scheduler {kind}: {exc}") from None
