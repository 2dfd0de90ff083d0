"""Hugging Face: the ``transformers.Trainer`` users already run, with each optimizer step compiled.

``spmd_ort.integrations.transformers.Trainer`` takes the Trainer's arguments plus ``parallel_mode`` and
``compile_options``. The Trainer's own loop runs unchanged (data loading and sharding, the scheduler, logging,
evaluation, callbacks, checkpoints, resume); what it does between two optimizer steps -- the forward and backward
of every micro-batch of ``gradient_accumulation_steps``, clipping at ``max_grad_norm``, ``optimizer.step()`` and
``zero_grad`` -- runs as one compiled step (:func:`spmd_ort.compile`) that calls the Trainer's ``compute_loss``.
How the Trainer's loop is met (``docs/huggingface.md``):

- ``get_batch_samples`` keeps the window of micro-batches the loop fetched for one optimizer step;
- the window's first ``training_step`` runs the compiled step over all of them; each ``training_step`` returns
  its micro-batch's loss (scaled as the Trainer scales it);
- ``_clip_grad_norm`` / ``_get_grad_norm`` return the norm the step measured before clipping, and the Trainer's
  ``optimizer.step()`` finds the step taken (:class:`StepTaken`);
- the model is not wrapped in DDP: the compiled step averages (or reduce-scatters) the gradients;
- ``save_model`` writes Hugging Face's layout with :func:`spmd_ort.save_safetensors` (no rank holds a
  ``fully_shard`` model whole); under a sharded layout the optimizer is checkpointed with DCP per rank.

Whatever the compiled step cannot do as the Trainer does it is a :class:`~spmd_ort.errors.ConfigError` at
``__init__``: DeepSpeed or FSDP arguments, ``torch_compile``, fp16 with a loss scaler (a GPU's), an optimizer
other than SGD / Adam / AdamW, a callback that sees gradients (``on_pre_optimizer_step``, ``on_substep_end``).

:func:`from_pretrained` builds a model from a hub directory (or a config) on the meta device, lays it out
(:func:`spmd_ort.parallelize`) and loads its safetensors shard by shard, each rank reading its own part.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import transformers
    from transformers.trainer_callback import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("spmd_ort.integrations.transformers needs transformers and accelerate: "
                      "pip install 'spmd-ort[hf]'") from e

import spmd_ort
from spmd_ort.errors import ConfigError

# the Trainer's loop this module meets (transformers 5): each is overridden or called here
TRAINER_HOOKS = ("get_batch_samples", "training_step", "_clip_grad_norm", "_get_grad_norm", "_prepare_for_training",
                 "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "create_scheduler")
_missing = [name for name in TRAINER_HOOKS if not hasattr(transformers.Trainer, name)]
if _missing:  # pragma: no cover - another transformers
    raise ImportError(f"spmd_ort.integrations.transformers needs a transformers.Trainer with {_missing} "
                      f"(transformers {transformers.__version__} has not): pip install 'transformers>=5'")

__all__ = ["StepTaken", "Trainer", "from_pretrained"]

SUPPORTED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
GRADIENT_HOOKS = ("on_pre_optimizer_step", "on_substep_end")  # callback events at which eager holds gradients
SHARDED_OPTIMIZER_DIR = "spmd_ort_optimizer"  # a checkpoint's per-rank optimizer state (DCP) under sharded layouts


def _parallel_mode(parallel_mode):
    """``None``: the compiled step's own default (``DataParallel()`` under torchrun); a style's name: that
    ``DataParallel``; a layout object as given."""
    if parallel_mode is None or not isinstance(parallel_mode, str):
        return parallel_mode
    if parallel_mode in ("replicate", "fully_shard"):
        return spmd_ort.DataParallel(parallel_style=parallel_mode)
    raise ConfigError(f"Trainer(parallel_mode={parallel_mode!r}): expected None, 'replicate', 'fully_shard' or a "
                      "spmd_ort.Parallel / DataParallel / TensorParallel")


def _check_own_batches(mode) -> None:
    """The Trainer's dataloader gives each rank its own batches: a layout whose ranks share one (tensor and
    context parallelism) would train on different data on each rank of its group."""
    if isinstance(mode, spmd_ort.TensorParallel) or getattr(mode, "tp", 1) != 1 or getattr(mode, "cp", 1) != 1:
        raise ConfigError(f"Trainer(parallel_mode={mode!r}): tensor and context parallelism need the same batch on "
                          "every rank of their group, and the Trainer's dataloader gives each rank its own; use "
                          "'replicate', 'fully_shard' or spmd_ort.Parallel(dp_shard=..., ep=...), or write the loop "
                          "with spmd_ort.compile (docs/tensor-parallel.md)")


def _check_arguments(args) -> None:
    """The TrainingArguments the compiled step cannot honour, refused before the Trainer sets anything up."""
    fix = "; remove it, or train with transformers.Trainer"
    if args.deepspeed:
        raise ConfigError("Trainer: TrainingArguments(deepspeed=...) with spmd_ort's Trainer; give the config to "
                          f"parallel_mode=spmd_ort.from_deepspeed_config(...) instead{fix}")
    if args.fsdp:
        raise ConfigError("Trainer: TrainingArguments(fsdp=...) with spmd_ort's Trainer; use "
                          f"parallel_mode='fully_shard' instead{fix}")
    if args.torch_compile:
        raise ConfigError("Trainer: TrainingArguments(torch_compile=True) with spmd_ort's Trainer: the step is "
                          f"already compiled (compile_options={{'backend': 'inductor'}} runs it through inductor){fix}")


class StepTaken(torch.optim.Optimizer):
    """The optimizer the Trainer's loop holds: the compiled step has already stepped the wrapped optimizer, so
    ``step()`` only checks that it did; ``state_dict``, ``load_state_dict``, ``param_groups`` and ``state`` are the
    wrapped optimizer's (the scheduler and checkpoints see the real one)."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer):  # noqa: D107 - no super().__init__
        self.optimizer = optimizer
        self._trainer = trainer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure=None):
        if closure is not None or not self._trainer._stepped:
            raise RuntimeError("spmd_ort Trainer: optimizer.step() outside the Trainer's loop; the compiled step "
                               "steps the optimizer (call trainer.train())")
        self._trainer._stepped = False

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self):
        return f"StepTaken({self.optimizer!r})"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose optimizer steps run compiled (see the module's docstring).

    Args:
        parallel_mode: ``None`` (one process, or ``DataParallel()`` under torchrun), ``"replicate"``,
            ``"fully_shard"``, or a ``spmd_ort.Parallel`` / ``DataParallel`` / ``TensorParallel``.
        compile_options: keywords of :func:`spmd_ort.compile` (``backend``, ``activation_memory_budget``,
            ``debug``, ...).
        *args, **kwargs: ``transformers.Trainer``'s.
    """

    def __init__(self, *args, parallel_mode: Any = None, compile_options: dict | None = None, **kwargs):
        self.parallel_mode = _parallel_mode(parallel_mode)
        _check_own_batches(self.parallel_mode)
        self.compile_options = dict(compile_options or {})
        if "parallel_mode" in self.compile_options:
            raise ConfigError("Trainer(compile_options={'parallel_mode': ...}): pass parallel_mode= to the Trainer")
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None:
            _check_arguments(targs)
        super().__init__(*args, **kwargs)
        self._check_supported()
        self.train_step = spmd_ort.compile(parallel_mode=self.parallel_mode, **self.compile_options)(self._window)
        self._batches: list | None = None  # the window get_batch_samples fetched
        self._num_items = None
        self._losses: list[torch.Tensor] = []  # one per micro-batch of the window the compiled step ran
        self._grad_norm = None
        self._stepped = False

    # ---- what the compiled step cannot do as the Trainer does: refused up front ----
    def _check_supported(self):
        args = self.args
        if self.accelerator.scaler is not None:
            raise ConfigError("Trainer: TrainingArguments(fp16=True) on a GPU trains with accelerate's loss scaler, "
                              "whose skipped steps spmd_ort's Trainer does not mirror yet; use bf16=True (fp16 "
                              "without a scaler, as on a CPU, is supported)")
        if self.optimizer is not None:
            opt_cls = type(self.optimizer)
        elif self.optimizer_cls_and_kwargs is not None:
            opt_cls = self.optimizer_cls_and_kwargs[0]
        else:
            opt_cls, _ = self.get_optimizer_cls_and_kwargs(args, self.model)
        if not (isinstance(opt_cls, type) and issubclass(opt_cls, SUPPORTED_OPTIMIZERS)):
            raise ConfigError(f"Trainer: the optimizer {getattr(opt_cls, '__name__', opt_cls)} (optim="
                              f"{args.optim!r}) is not one the compiled step traces; use optim='adamw_torch', "
                              "'adamw_torch_fused' or 'sgd', or pass a torch.optim.AdamW / Adam / SGD")
        for cb in self.callback_handler.callbacks:
            for event in GRADIENT_HOOKS:
                if getattr(type(cb), event) is not getattr(TrainerCallback, event):
                    raise ConfigError(f"Trainer: the callback {type(cb).__name__} defines {event}, where eager "
                                      "training holds gradients; the compiled step keeps none between its calls "
                                      "(clipping, the optimizer and zero_grad run inside it). Move what it does into "
                                      "compute_loss, or train with transformers.Trainer")

    # ---- the step: one window of micro-batches ----

    def _loss_is_scaled(self, num_items_in_batch) -> bool:
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def _window(self, model, optimizer, batches, num_items_in_batch):
        """What the Trainer does from a window's first micro-batch to ``zero_grad``, traced as one step: each
        micro-batch's ``compute_loss`` under accelerate's autocast (``bf16``; ``fp16`` without a loss scaler, as on
        a CPU), its backward, the gradients clipped, the optimizer's step, ``zero_grad``."""
        scaled = self._loss_is_scaled(num_items_in_batch)
        losses = []
        for inputs in batches:
            with self.accelerator.autocast():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            if not scaled:
                loss = loss / len(batches)
            loss.backward()
            losses.append(loss.detach())
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses), norm

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._batches, self._num_items, self._losses = batches, num_items, []
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        i = next((k for k, b in enumerate(self._batches or ()) if b is inputs), None)
        if i is None:
            raise RuntimeError("spmd_ort Trainer: training_step runs inside trainer.train()'s loop only (it runs the "
                               "compiled step over the window of micro-batches get_batch_samples fetched)")
        if not self._losses:
            model.train()
            batches = [self._prepare_inputs(b) for b in self._batches]
            losses, self._grad_norm = self.train_step(self.model, self._optimizer, batches, self._num_items)
            self._losses = list(losses.unbind(0))
            self._stepped = True
        return self._losses[i]

    def _clip_grad_norm(self, model):
        return self._grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        return self._grad_norm

    # ---- the model is not wrapped (the compiled step reduces gradients); the optimizer is the real one ----
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        opt = self.optimizer.optimizer if isinstance(self.optimizer, StepTaken) else self.optimizer
        if opt is None:
            opt = self.create_optimizer()
        self._optimizer = opt
        self.create_scheduler(num_training_steps=max_steps, optimizer=opt)
        self.optimizer = StepTaken(opt, self)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def create_optimizer(self, model=None):
        opt = super().create_optimizer(model)
        return opt.optimizer if isinstance(opt, StepTaken) else opt

    # ---- checkpoints ----
    def _sharded(self) -> bool:
        """Whether this rank's optimizer state is a part of the whole (DTensor parameters), not all of it."""
        from torch.distributed.tensor import DTensor
        return any(isinstance(p, DTensor) for p in self.model.parameters())

    def _save_optimizer_and_scheduler(self, output_dir):
        if not self._sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        spmd_ort.save_checkpoint(Path(output_dir) / SHARDED_OPTIMIZER_DIR, self.train_step, self.model,
                                 self._optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        sharded = Path(checkpoint) / SHARDED_OPTIMIZER_DIR
        if not sharded.exists():
            return super()._load_optimizer_and_scheduler(checkpoint)
        spmd_ort.load_checkpoint(sharded, self.train_step, self.model, self._optimizer)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME),
                                                     weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Hugging Face's layout (``from_pretrained`` loads it): the weights through
        :func:`spmd_ort.save_safetensors` (every rank calls it; under ``fully_shard`` the tensors are gathered one at
        a time and rank 0 writes), then the config, the generation config, the tokenizer and the training
        arguments, as the Trainer writes them."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        spmd_ort.save_safetensors(self.model, output_dir)
        if self.args.should_save:
            config = getattr(self.model, "config", None)
            if config is not None:
                config.save_pretrained(output_dir)
            generation = getattr(self.model, "generation_config", None)
            if generation is not None and getattr(self.model, "can_generate", lambda: False)():
                generation.save_pretrained(output_dir)
            tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def from_pretrained(directory_or_config, parallel_mode=None, *, model_class=None, dtype=None,
                    device: str | torch.device = "cpu", **config_kwargs) -> nn.Module:
    """A Hugging Face model from its directory (``config.json`` and safetensors) or a config, laid out for
    ``parallel_mode`` without any rank holding it whole.

    The model is built from the config on the meta device (nothing allocated), laid out by
    :func:`spmd_ort.parallelize` (``None``: as it is, one process or replicated), given storage for this rank's
    part (``to_empty``), and, from a directory, its weights are read by :func:`spmd_ort.load_safetensors` (each
    rank its own rows; Hugging Face's key names as they are). From a config alone the weights are the model's
    own initialisation (``init_weights``) run on this rank's storage, so every rank of a sharded layout must be
    seeded alike. ``model_class``: default ``AutoModelForCausalLM``. ``dtype``: the parameters' dtype (default:
    float32). Collective when ``parallel_mode`` is distributed: every rank calls it.
    """
    if model_class is None:
        model_class = transformers.AutoModelForCausalLM
    directory = None
    if isinstance(directory_or_config, (str, os.PathLike)):
        directory = Path(directory_or_config)
        if not (directory / "config.json").exists():
            raise ConfigError(f"from_pretrained({str(directory)!r}): no config.json there (a hub model is read from "
                              "a local directory: download it first, e.g. huggingface-cli download)")
        config = transformers.AutoConfig.from_pretrained(directory, **config_kwargs)
    else:
        config = directory_or_config
    with torch.device("meta"):
        model = (model_class.from_config(config, dtype=dtype or torch.float32)
                 if hasattr(model_class, "from_config") else model_class(config))
    mode = _parallel_mode(parallel_mode)
    if mode is not None:
        spmd_ort.parallelize(model, mode)
    model.to_empty(device=device)
    if directory is not None:
        spmd_ort.load_safetensors(model, directory)
    else:
        with torch.no_grad():
            model.init_weights() if hasattr(model, "init_weights") else None
    _restore_non_persistent_buffers(model)
    return model


def _restore_non_persistent_buffers(model: nn.Module) -> None:
    """``to_empty`` leaves non-persistent buffers (the rotary ``inv_freq``) uninitialised and no checkpoint holds
    them: the model's own ``_init_weights`` computes them again on each module that owns one and no parameter
    (docs/big-models.md). A module whose buffers it does not know is a ``ConfigError`` naming it."""
    init = getattr(model, "_init_weights", None)
    for fqn, module in model.named_modules():
        if not module._non_persistent_buffers_set or any(True for _ in module.parameters(recurse=False)):
            continue
        if init is None:
            raise ConfigError(f"from_pretrained: {fqn} holds non-persistent buffers "
                              f"{sorted(module._non_persistent_buffers_set)} that no checkpoint stores and the model "
                              "has no _init_weights to compute them; set them after loading")
        with torch.no_grad():
            init(module)
