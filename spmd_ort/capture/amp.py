"""Mixed precision in the compiled step: GradScaler as lifted state, and FSDP2's MixedPrecisionPolicy.

**torch.autocast** needs nothing here: make_fx records the casts autocast makes
(``_to_copy`` to float16/bfloat16 before each autocast op), so the graph runs the
same ops in the same dtypes as eager.  Autocast entered *outside* the step is part
of what a graph is specialised on (:func:`autocast_state`, in the ``StepKey``).

**torch.amp.GradScaler** is state of the step, like the optimizer: its ``_scale``
and ``_growth_tracker`` become graph inputs and outputs (slots of kind
``scaler``), and while tracing the scaler's own code runs on them
(:func:`bind_scaler`): ``scale`` multiplies, ``unscale_`` is
``_amp_foreach_non_finite_check_and_unscale_``, ``update`` is
``_amp_update_scale_``, all of it in the graph.  The one thing eager does on the
host, ``GradScaler.step`` reading ``found_inf`` with ``.item()`` to decide whether
to call ``optimizer.step()``, is replaced: the optimizer rule receives
``found_inf`` as a tensor (``opt.found_inf``, as torch's fused optimizers receive it
from the scaler) and the fused kernel skips the update where it is 1.  So skipped
steps, the scale schedule and the numbers are eager's, with no host sync.

**MixedPrecisionPolicy** (``DataParallel(mixed_precision=...)``) has FSDP2's
names and semantics: fp32 parameters and optimizer state stay the master copy;
forward and backward compute with parameters cast to ``param_dtype`` (each
module's direct parameters, once per step, when it first runs:
:func:`apply_policy`); gradients flow back to the fp32 parameters and are
reduced in ``reduce_dtype`` (``passes/mixed_precision.py``); under
``fully_shard`` the all-gather moves ``param_dtype``.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.amp import grad_scaler as torch_grad_scaler

from spmd_ort.distributed.precision import MixedPrecisionPolicy
from spmd_ort.errors import CompileError

GradScaler = torch.amp.GradScaler
# The GradScaler methods whose code runs while tracing; a subclass that overrides one
# (e.g. FSDP1's ShardedGradScaler, whose unscale_ all-reduces on the host) is not supported.
TRACED_METHODS = ("scale", "unscale_", "_unscale_grads_", "step", "update", "_check_inf_per_device",
                  "_maybe_opt_step", "_get_scale_async", "_lazy_init_scale_growth_tracker")
SCALER_KEYS = ("scale", "growth_tracker")  # slot keys of a GradScaler's lifted state (attributes _scale, ...)
# attributes that only seed the state before its first scale(): not something a graph depends on
SEED_ATTRIBUTES = ("_init_scale", "_init_growth_tracker")
AUTOCAST_DEVICES = ("cpu", "cuda")


# ---------------------------------------------------------------------- autocast
def autocast_state() -> tuple:
    """The autocast settings in force when the step is called (a graph is specialised on them)."""
    out = []
    for device in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            out.append((device, str(torch.get_autocast_dtype(device))))
    return tuple(out) + (("cache", torch.is_autocast_cache_enabled()),)


@contextlib.contextmanager
def autocast_disabled() -> Iterator[None]:
    """Run a captured graph as it is: its casts are explicit, autocast must not cast its aten ops again."""
    with contextlib.ExitStack() as stack:
        for device in AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


# ---------------------------------------------------------------------- GradScaler
def is_scaler(obj) -> bool:
    return isinstance(obj, GradScaler)


def scaler_keys(scaler: GradScaler) -> tuple[str, ...]:
    """The scaler's lifted state, as slot keys (attribute ``_<key>``): GradScaler's, plus a subclass's
    ``EXTRA_STATE``."""
    return SCALER_KEYS + tuple(getattr(scaler, "EXTRA_STATE", ()))


def check_scaler(scaler: GradScaler) -> None:
    """Refuse scaler classes whose traced methods are not torch.amp.GradScaler's own.

    A subclass that sets ``TRACEABLE = True`` declares that its overrides read no tensor
    value on the host (e.g. :class:`DynamicLossScaler`).
    """
    cls = type(scaler)
    overridden = [m for m in TRACED_METHODS if getattr(cls, m) is not getattr(GradScaler, m)]
    if overridden and not getattr(cls, "TRACEABLE", False):
        raise CompileError(
            f"{cls.__module__}.{cls.__qualname__} overrides GradScaler.{', '.join(overridden)}, which the compiled "
            "step traces as torch.amp.GradScaler's own; use torch.amp.GradScaler (under fully_shard the compiled "
            "step combines found_inf across ranks itself, as FSDP's ShardedGradScaler does)",
            op=f"{cls.__qualname__}.step")
    states = getattr(scaler, "_per_optimizer_states", {})
    busy = [s["stage"].name for s in states.values() if s["stage"] is not torch_grad_scaler.OptState.READY]
    if busy:
        raise CompileError(
            f"the GradScaler was left mid-iteration before this step (stage {busy[0]}: unscale_() or step() was "
            "called without update()); call scaler.update() inside the compiled step, after scaler.step(opt)",
            op="GradScaler.update")


def scaler_enabled(scaler: GradScaler | None) -> bool:
    return scaler is not None and scaler.is_enabled()


def initial_scaler_state(scaler: GradScaler, device: torch.device) -> list[Tensor]:
    """The scaler's state tensors (:func:`scaler_keys`), or the ones its first ``scale()`` would create.

    Eager creates them lazily on the loss's device; here on ``device`` (the
    parameters'), on a copy of the scaler, so the scaler itself is untouched (a
    failed compile leaves it as it was).
    """
    keys = scaler_keys(scaler)
    if scaler._scale is None:
        fresh = copy.copy(scaler)
        fresh._lazy_init_scale_growth_tracker(device)
        return [getattr(fresh, f"_{k}") for k in keys]
    return [getattr(scaler, f"_{k}") for k in keys]


def scaler_key(scaler: GradScaler | None, device: torch.device) -> tuple:
    """What a graph is specialised on: the class, whether it scales, and the constants of its update rule
    (every scalar attribute: growth/backoff factors, growth interval, a subclass's own)."""
    if scaler is None:
        return ()
    if not scaler.is_enabled():
        return (("class", type(scaler).__qualname__), ("enabled", False))
    constants = tuple(sorted((k, v) for k, v in vars(scaler).items()
                             if isinstance(v, (bool, int, float, str)) and k not in SEED_ATTRIBUTES))
    state = tuple((str(t.dtype), str(t.device)) for t in initial_scaler_state(scaler, device))
    return (("class", type(scaler).__qualname__), ("constants", constants), ("state", state))


@contextlib.contextmanager
def bind_scaler(scaler: GradScaler | None, state: list[Tensor], opt: torch.optim.Optimizer | None) -> Iterator[None]:
    """While tracing: the scaler holds the traced ``state`` and its host-side skip decision is the graph's.

    Any other enabled GradScaler the step touches is an error (its state would be
    neither an input nor an output of the graph).
    """
    saved = dict(scaler.__dict__) if scaler is not None else None
    guards = _guard_other_scalers(scaler)
    try:
        if scaler_enabled(scaler):
            for key, value in zip(scaler_keys(scaler), state, strict=True):
                setattr(scaler, f"_{key}", value)
            scaler._per_optimizer_states = defaultdict(torch_grad_scaler._refresh_per_optimizer_state)
            scaler._maybe_opt_step = _traced_maybe_opt_step(opt)
        with guards:
            yield
        if scaler_enabled(scaler):
            left = [s["stage"].name for s in scaler._per_optimizer_states.values()]
            if left:
                raise CompileError(
                    f"the step ends with the GradScaler mid-iteration (stage {left[0]}): call scaler.update() inside "
                    "the compiled step after scaler.step(opt), so that found_inf stays a value of the graph",
                    op="GradScaler.update")
    finally:
        if scaler is not None:
            scaler.__dict__.clear()
            scaler.__dict__.update(saved)


def _traced_maybe_opt_step(lifted: torch.optim.Optimizer | None):
    """``GradScaler._maybe_opt_step`` without ``.item()``: the rule skips through ``opt.found_inf``."""

    def maybe_opt_step(optimizer, optimizer_state, *args, **kwargs):
        if optimizer is not lifted:
            raise CompileError("scaler.step() was given an optimizer that is not an argument of the compiled step; "
                               "pass that optimizer to the step", op="GradScaler.step")
        found = sum(optimizer_state["found_inf_per_device"].values())
        optimizer.found_inf = found
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.found_inf

    return maybe_opt_step


@contextlib.contextmanager
def _guard_other_scalers(lifted: GradScaler | None) -> Iterator[None]:
    originals = {name: getattr(GradScaler, name) for name in ("scale", "unscale_", "step", "update")}

    def guarded(name, fn):
        def method(self, *args, **kwargs):
            if self is not lifted and self.is_enabled():
                raise CompileError(
                    f"the step calls GradScaler.{name}() on a scaler that is not among its arguments; pass the "
                    "scaler to the step (like the optimizer), so that its scale becomes state of the compiled step",
                    op=f"GradScaler.{name}")
            return fn(self, *args, **kwargs)

        return method

    for name, fn in originals.items():
        setattr(GradScaler, name, guarded(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(GradScaler, name, fn)


@contextlib.contextmanager
def apply_policy(module: nn.Module, policy: MixedPrecisionPolicy | None) -> Iterator[None]:
    """While tracing ``module``'s step: each submodule computes with its direct parameters in ``param_dtype``.

    A module's floating parameters are swapped for their cast while its forward
    runs (cast once per parameter and step, when first needed; tied weights
    share one cast), so autograd sends the gradient back through the cast to the
    fp32 parameter; outside forward (clipping, the optimizer) the module holds the
    fp32 parameters, as under FSDP2.  The root's forward casts its floating inputs
    (``cast_forward_inputs``) and outputs (``output_dtype``).
    """
    if policy is None or (policy.param_dtype is None and policy.output_dtype is None):
        yield
        return
    dtype = policy.param_dtype
    members = {id(m) for m in module.modules()}
    casts: dict[int, Tensor] = {}
    swapped: list[tuple[nn.Module, list[tuple[str, Tensor]]]] = []  # per running forward

    def cast_param(p: Tensor) -> Tensor:
        if id(p) not in casts:
            casts[id(p)] = p.to(dtype)
        return casts[id(p)]

    def pre(mod, args):
        if id(mod) not in members:
            return
        frame = []
        if dtype is not None:
            for name, p in list(mod._parameters.items()):
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    mod._parameters[name] = cast_param(p)
                    frame.append((name, p))
        swapped.append((mod, frame))

    def post(mod, args, out):
        if id(mod) not in members:
            return
        owner, frame = swapped.pop()
        for name, p in frame:
            owner._parameters[name] = p

    def cast_inputs(mod, args, kwargs):
        return _cast_floating((args, kwargs), dtype)

    def cast_outputs(mod, args, out):
        return _cast_floating(out, policy.output_dtype)

    handles = [nn.modules.module.register_module_forward_pre_hook(pre),
               nn.modules.module.register_module_forward_hook(post, always_call=True)]
    if dtype is not None and policy.cast_forward_inputs:
        handles.append(module.register_forward_pre_hook(cast_inputs, with_kwargs=True))
    if policy.output_dtype is not None:
        handles.append(module.register_forward_hook(cast_outputs))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _cast_floating(tree, dtype: torch.dtype):
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x, tree)


# ---------------------------------------------------------------------- DeepSpeed's loss scaling
class DynamicLossScaler(GradScaler):
    """DeepSpeed's dynamic fp16 loss scaling (``fp16.loss_scale: 0``) as a ``torch.amp.GradScaler``.

    Used like any GradScaler (``scale``, ``unscale_``, ``step``, ``update``), eagerly or
    in a compiled step, where its state is lifted like GradScaler's.  ``update`` follows
    DeepSpeed's rule instead of ``_amp_update_scale_``, with tensor ops only:

    * an overflowing step is skipped; the scale is divided by 2 (not below
      ``min_scale``) only once ``hysteresis`` overflows have used up the delay, otherwise
      the remaining delay shrinks by one;
    * after an overflow, the scale doubles at the ``scale_window + 1``-th consecutive good
      step and every ``scale_window`` good steps after it, and the delay is restored
      (with ``consecutive_hysteresis``, by every good step).

    Where DeepSpeed raises at ``min_scale`` (its ``raise_error_at_min_scale``), this
    keeps skipping: a compiled step cannot raise on a tensor value.
    ``last_step_skipped()`` reads (on the host) whether the last ``update`` saw an
    overflow, e.g. to leave the LR scheduler alone as DeepSpeed does.
    """

    TRACEABLE = True  # update() reads no tensor value on the host
    EXTRA_STATE = ("hysteresis", "skipped")

    def __init__(self, device: str = "cpu", *, init_scale: float = 2.0**16, scale_window: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0, consecutive_hysteresis: bool = False,
                 enabled: bool = True):
        super().__init__(device, init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=scale_window, enabled=enabled)
        if hysteresis < 1 or scale_window < 1:
            raise ValueError(f"DynamicLossScaler: hysteresis={hysteresis} and scale_window={scale_window} must be >= 1")
        self._delay = int(hysteresis)
        self._min_scale = float(min_scale)
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._hysteresis: Tensor | None = None  # overflows left before the scale shrinks
        self._skipped: Tensor | None = None  # 1.0 where the last update saw an overflow

    def _lazy_init_scale_growth_tracker(self, dev) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis = torch.full((), self._delay, dtype=torch.int32, device=dev)
        self._skipped = torch.zeros((), dtype=torch.float32, device=dev)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found = [f.to(scale.device) for st in self._per_optimizer_states.values()
                 for f in st["found_inf_per_device"].values()]
        if not found:
            raise AssertionError("No inf checks were recorded prior to update.")
        overflow = sum(found[1:], found[0]) > 0
        good = overflow.logical_not()
        # tracker: good steps since the last overflow; growth at 1 + k * scale_window of them (k >= 1)
        streak = torch.where(overflow, torch.zeros_like(tracker), tracker + 1)
        grow = good & (streak > 1) & ((streak - 1) % self._growth_interval == 0)
        shrink = overflow & (self._hysteresis <= 1)
        smaller = torch.clamp_min(scale * self._backoff_factor, self._min_scale)
        new = torch.where(shrink, smaller, scale)
        new = torch.where(grow, new * self._growth_factor, new)
        delay = torch.where(overflow & shrink.logical_not(), self._hysteresis - 1, self._hysteresis)
        restore = good if self._consecutive_hysteresis else grow
        delay = torch.where(restore, torch.full_like(delay, self._delay), delay)
        with torch.no_grad():
            scale.copy_(new)
            tracker.copy_(streak)
            self._hysteresis.copy_(delay)
            self._skipped.copy_(overflow.to(self._skipped.dtype))
        self._per_optimizer_states = defaultdict(torch_grad_scaler._refresh_per_optimizer_state)

    def last_step_skipped(self) -> bool:
        """Whether the last ``update`` saw an overflow (the step was skipped); reads the flag on the host."""
        return bool(self._skipped) if self._skipped is not None else False

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self._enabled:
            out.update(hysteresis=int(self._hysteresis) if self._hysteresis is not None else self._delay,
                       skipped=self.last_step_skipped())
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self._enabled and self._hysteresis is not None:
            self._hysteresis.fill_(state_dict.get("hysteresis", self._delay))
            self._skipped.fill_(float(state_dict.get("skipped", False)))
