"""Lifted training state: what the compiled graph takes as inputs and returns.

A :class:`StateLayout` fixes, for one compiled variant, the order of the state
placeholders of the graph:

    params | buffers | grads (params that have one) | optimizer state | hyper-parameters
    | GradScaler state (scale, growth tracker) | extra (Override transforms)

followed by the tensor leaves of the user's arguments.  It binds traced
tensors into the module and optimizer while tracing (:meth:`StateLayout.bind`),
gathers the real tensors before each run (:meth:`gather`) and writes the new
state back after it (:meth:`write_back`), so that ``model.state_dict()`` and
``opt.state_dict()`` hold what an eager step would have produced.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.utils import stateless

from spmd_ort.capture import amp
from spmd_ort.graph.ops import tag_grad
from spmd_ort.capture.optim import HPARAMS_KEY, OptimizerRule
from spmd_ort.capture.presence import PRESENT_KEY, GradPresence
from spmd_ort.distributed import dtensor
from spmd_ort.distributed.sharding import ShardSpec, flat_of, is_sharded_state, spec_of, state_like
from spmd_ort.graph.slots import Slot, SlotKind
from spmd_ort.runtime.step_runtime import current


@dataclass
class StateLayout:
    module: nn.Module
    opt: torch.optim.Optimizer | None
    rule: OptimizerRule | None
    params: list[nn.Parameter]
    param_names: list[list[str]]  # every FQN of each unique parameter (tied weights share one)
    buffers: list[Tensor]
    buffer_names: list[list[str]]
    grad_params: list[int]  # params whose .grad is lifted
    opt_entries: list[tuple[int, str]]  # (param index, state key) of tensor-valued optimizer state
    hparam_groups: list[int]  # param groups whose scalar hyper-parameters are one float64 input each
    hparam_tensors: list[Tensor] = field(default_factory=list)
    extra_state: list[Tensor] = field(default_factory=list)
    shard_specs: dict[int, ShardSpec] = field(default_factory=dict)  # fully_shard: param index -> spec
    scaler: amp.GradScaler | None = None  # an enabled GradScaler whose state is lifted
    scaler_initial: list[Tensor] = field(default_factory=list)  # its state before its first scale()
    # parameters whose gradient only opaque parts make, in the order of the step's PRESENCE output (set by the trace)
    present_params: tuple[int, ...] = ()
    # expand mode (spmd_ort.distributed.dtensor): (DTensorSpec, requires_grad) of each state input (None: a plain
    # tensor), as :meth:`gather` last found them, and the DTensorSpec of each state output the trace made (by slot)
    in_specs: list = field(default_factory=list)
    out_specs: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ capture
    @classmethod
    def capture(cls, module: nn.Module, opt: torch.optim.Optimizer | None,
                rule: OptimizerRule | None, scaler: amp.GradScaler | None = None, *,
                device_hparams: bool = False) -> StateLayout:
        """The layout of ``module``'s, ``opt``'s and ``scaler``'s state; ``device_hparams``: each param group's
        hyper-parameters live on the parameters' GPU (a CUDA-graphed step), else on the host."""
        params, param_names, index = unique_named(module.named_parameters(remove_duplicate=False))
        buffers, buffer_names, _ = unique_named(module.named_buffers(remove_duplicate=False))
        grad_params = [i for i, p in enumerate(params) if p.grad is not None]
        opt_entries = []
        if opt is not None:
            from spmd_ort.errors import CompileError, ConfigError

            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in index:
                        raise CompileError(
                            f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not "
                            f"a parameter of {type(module).__name__}; give the optimizer module.parameters()")
                    why = rule.refuse(group, p) if rule is not None else None
                    if why is not None:
                        fqn, kind = param_names[index[id(p)]][0], type(opt).__name__
                        raise ConfigError(f"{kind} param group {gi}, parameter `{fqn}` ({p.dtype}, on "
                                          f"{p.device.type}): {why}", fqn=fqn, op=f"{kind}.step")
                    for key, value in opt.state.get(p, {}).items():
                        if isinstance(value, Tensor):
                            opt_entries.append((index[id(p)], key))
        hparam_groups = list(range(len(opt.param_groups))) if opt is not None else []
        layout = cls(module, opt, rule, params, param_names, buffers, buffer_names, grad_params,
                     opt_entries, hparam_groups)
        # on the device where the step is CUDA-graphed: a replay reads them there, written before it
        where = state_device(module) if device_hparams and state_device(module).type == "cuda" else "cpu"
        layout.hparam_tensors = [torch.tensor(rule.hparams(opt.param_groups[g]), dtype=torch.float64, device=where)
                                 for g in hparam_groups]
        layout.shard_specs = {i: spec_of(p) for i, p in enumerate(params) if spec_of(p) is not None}
        if amp.scaler_enabled(scaler):
            layout.scaler = scaler
            layout.scaler_initial = amp.initial_scaler_state(scaler, state_device(module))
        return layout

    def is_sharded(self, slot: Slot, value: Tensor) -> bool:
        """Whether a state input holds a shard (of a parameter, its gradient or non-scalar optimizer state)."""
        return (slot.kind.per_parameter and slot.index in self.shard_specs
                and (slot.kind is not SlotKind.OPT_STATE or is_sharded_state(value)))

    # ------------------------------------------------------------------ slots
    def input_slots(self) -> list[Slot]:
        slots = [Slot(SlotKind.PARAM, n[0], i) for i, n in enumerate(self.param_names)]
        slots += [Slot(SlotKind.BUFFER, n[0], i) for i, n in enumerate(self.buffer_names)]
        slots += [Slot(SlotKind.GRAD, self.param_names[i][0] + ".grad", i) for i in self.grad_params]
        slots += [Slot(SlotKind.OPT_STATE, f"{self.param_names[i][0]}.{k}", i, k) for i, k in self.opt_entries]
        slots += [Slot(SlotKind.HPARAM, f"param_groups[{g}].hparams", g) for g in self.hparam_groups]
        if self.scaler is not None:
            slots += [Slot(SlotKind.SCALER, f"scaler._{k}", i, k) for i, k in enumerate(amp.scaler_keys(self.scaler))]
        slots += [Slot(SlotKind.EXTRA, f"extra[{i}]", i) for i in range(len(self.extra_state))]
        return slots

    def gather(self) -> list[Tensor]:
        """The real state tensors, in placeholder order, for this step (a DTensor's local tensor; under
        ``fully_shard``, the flat shard buffer behind a sharded parameter, gradient or optimizer state)."""
        held = self.held
        flat: list[Tensor] = [self._held_param(i, p) for i, p in enumerate(self.params)] + list(self.buffers)
        flat += [held(i, self.params[i].grad) for i in self.grad_params]
        if self.opt is not None:
            flat += [held(i, self.opt.state[self.params[i]][k]) for i, k in self.opt_entries]
            groups = self.opt.param_groups
            for t, g in zip(self.hparam_tensors, self.hparam_groups):
                flat.append(write_hparams(t, self.rule.hparams(groups[g])))
        flat += self.scaler_state() + self.extra_state
        if self.expands:
            self.in_specs = [self._in_spec(slot, t) for slot, t in zip(self.input_slots(), flat)]
            return [dtensor.local(t) for t in flat]
        return flat

    def _in_spec(self, slot: Slot, t: Tensor):
        """Expand mode: the (DTensorSpec, requires_grad) the trace wraps state input ``t`` in (None: plain).  A 2-D
        fully_shard shard (a flat buffer) stands for the tensor-parallel local tensor: its plan's spec."""
        if slot.kind.per_parameter and self.is_sharded(slot, t):
            tp = self.shard_specs[slot.index].tp_spec
            return None if tp is None else (tp, t.requires_grad)
        return (dtensor.spec_of(t), t.requires_grad) if dtensor.is_dtensor(t) else None

    def held(self, index: int, t: Tensor) -> Tensor:
        """What the step computes on for state ``t`` of parameter ``index``: the flat shard buffer of a
        sharded tensor (not a scalar), else ``t``."""
        spec = self.shard_specs.get(index)
        return flat_of(t, spec) if spec is not None and is_sharded_state(t) else t

    def _held_param(self, index: int, p: Tensor) -> Tensor:
        """:meth:`held` of parameter ``index``, requiring grad as the parameter does now: the flat shard buffer the
        step takes for a sharded parameter is its own tensor, and a parameter frozen (or unfrozen) after it was
        sharded would otherwise train on (the step's key sees the parameter's flag and traces anew)."""
        h = self.held(index, p)
        if h is not p and h.requires_grad != p.requires_grad:
            h.requires_grad_(p.requires_grad)
        return h

    @functools.cached_property
    def expands(self) -> bool:
        """Whether the state holds DTensors: the step is traced through DTensor dispatch (expand mode)."""
        return dtensor.has_dtensor_state(self.module)

    def scaler_state(self) -> list[Tensor]:
        """The lifted GradScaler's state tensors (``[scale, growth_tracker, ...]``; empty without one)."""
        if self.scaler is None:
            return []
        if self.scaler._scale is None:
            return list(self.scaler_initial)
        return [getattr(self.scaler, f"_{k}") for k in amp.scaler_keys(self.scaler)]

    # ------------------------------------------------------------------ tracing
    @contextlib.contextmanager
    def bind(self, state: list[Tensor], *, tag_grads: bool = False,
             mixed_precision: amp.MixedPrecisionPolicy | None = None,
             presence: GradPresence | None = None) -> Iterator[BoundState]:
        """Put traced tensors where the module, optimizer and GradScaler look for state.

        ``tag_grads`` marks each parameter's new gradient with ``spmd_ort::tag_grad``
        (a hook on the leaf, so a tied weight is tagged once, after summation).
        ``mixed_precision``: forward runs on parameters cast as the policy says
        (:func:`spmd_ort.capture.amp.apply_policy`).  ``presence`` follows which gradients
        only opaque parts make (its hooks see each gradient before the tag).
        """
        presence = presence if presence is not None else GradPresence()
        presence.names = [n[0] for n in self.param_names]
        if self.expands:  # the traced locals, wrapped as the DTensors they stand for
            state = [v if spec is None else dtensor.wrap(v, spec[0], requires_grad=spec[1])
                     for v, spec in zip(state, self.in_specs + [None] * (len(state) - len(self.in_specs)))]
        it = iter(state)
        params = [next(it) for _ in self.params]
        for p in params:
            if p.requires_grad and p.is_leaf:
                presence.watch(p)
        if tag_grads:
            for i, p in enumerate(params):
                if p.requires_grad:
                    shard = self.shard_specs.get(i)
                    if shard is not None and shard.tp_spec is not None:
                        # 2-D fully_shard: the gradient in the parameter's placements (DTensor's reduction of
                        # a Partial one over tp first), so that the tag's reduce-scatter splits the local
                        # tensor the shard is a piece of
                        p.register_hook(functools.partial(_tag_placed, spec=shard.tp_spec, index=i))
                    else:
                        p.register_hook(functools.partial(tag_grad, index=i))
        buffers = [next(it) for _ in self.buffers]
        for i in self.grad_params:
            params[i].grad = next(it)
        opt_vals = [next(it) for _ in self.opt_entries]
        hparams = [next(it) for _ in self.hparam_groups]
        scaler_vals = [next(it) for _ in self.scaler_initial] if self.scaler is not None else []
        mapping = {n: t for names, t in zip(self.param_names, params) for n in names}
        mapping.update({n: t for names, t in zip(self.buffer_names, buffers) for n in names})
        with stateless._reparametrize_module(self.module, mapping), \
                self._bind_optimizer(params, opt_vals, hparams, presence) as opt_state, \
                amp.bind_scaler(self.scaler, scaler_vals, self.opt), \
                amp.apply_policy(self.module, mixed_precision):
            yield BoundState(self, params, opt_state, presence)

    @contextlib.contextmanager
    def _bind_optimizer(self, params: list[Tensor], opt_vals: list[Tensor], hparams: list[Tensor],
                        presence: GradPresence):
        opt = self.opt
        if opt is None:
            yield {}
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        saved_groups = [dict(g) for g in opt.param_groups]
        saved_state, saved_attrs = opt.state, {k: opt.__dict__[k] for k in ("step", "zero_grad") if k in opt.__dict__}
        traced_state: defaultdict = defaultdict(dict)
        for p, st in saved_state.items():
            if id(p) in index:  # non-tensor state (if any) is carried as is
                traced_state[params[index[id(p)]]] = {k: v for k, v in st.items() if not isinstance(v, Tensor)}
        for (i, k), v in zip(self.opt_entries, opt_vals):
            traced_state[params[i]][k] = v
        for g in opt.param_groups:
            g["params"] = [params[index[id(p)]] for p in g["params"]]
        for g, v in zip(self.hparam_groups, hparams):
            opt.param_groups[g][HPARAMS_KEY] = v
        rule = self.rule

        def traced_step(closure=None):
            if closure is not None:
                raise TypeError("optimizer.step(closure) is not supported inside a compiled train step")
            with torch.no_grad():
                # which gradients may not exist this step: the rules skip those parameters where they do not
                found = presence.at_step(params)
                if found is not None:
                    opt.__dict__[PRESENT_KEY] = found
                try:
                    rule.step(opt)
                finally:
                    opt.__dict__.pop(PRESENT_KEY, None)

        def traced_zero_grad(set_to_none: bool = True):
            for g in opt.param_groups:
                for p in g["params"]:
                    _zero_grad(p, set_to_none)

        try:
            opt.state = traced_state
            opt.step = traced_step
            opt.zero_grad = traced_zero_grad
            yield traced_state
        finally:
            opt.state = saved_state
            for g, saved in zip(opt.param_groups, saved_groups):
                g.clear()
                g.update(saved)
            for k in ("step", "zero_grad"):
                opt.__dict__.pop(k, None)
            opt.__dict__.update(saved_attrs)

    def localize(self, final: list[tuple[Slot, Tensor]]) -> list[tuple[Slot, Tensor]]:
        """Expand mode: each traced DTensor of the step's final state as its local tensor (the graph's output),
        its spec kept in :attr:`out_specs`.  A gradient is first placed as its parameter is: a pending sum
        (``Partial``, a replicated norm under sequence parallel) is reduced, so ``.grad`` holds the whole
        gradient (eager leaves it ``Partial``; its ``full_tensor()`` is the same)."""
        if not self.expands:
            return final
        out = []
        for slot, t in final:
            if dtensor.is_dtensor(t):
                if slot.kind is SlotKind.GRAD and self.in_specs[slot.index] is not None:
                    t = dtensor.to_spec(t, self.in_specs[slot.index][0])
                self.out_specs[slot] = dtensor.spec_of(t)
                t = dtensor.local(t)
            out.append((slot, t))
        return out

    # ------------------------------------------------------------------ write back
    def write_back(self, slots: list[Slot], values: list[Tensor], *, owned: bool = True) -> list[nn.Parameter]:
        """Store a step's new state into the module and optimizer.

        A value that *is* the state tensor (updated in place by the graph) is
        left alone; others are copied into the existing tensor, so that
        references users hold (``model.parameters()``, optimizer state) stay valid.
        State that did not exist before (a first ``.grad``, new optimizer state)
        takes the value itself, or a copy of it when the executor does not
        ``own`` it (it will reuse the buffer next step).  A parameter without a gradient this
        step (:meth:`absent`) keeps ``.grad`` None and gets no new state, as in eager; the
        parameters skipped so are returned.
        """
        def take(v: Tensor, slot: Slot) -> Tensor:
            v = v if owned else v.clone()
            shard = self.shard_specs.get(slot.index) if slot.kind.per_parameter and is_sharded_state(v) else None
            if shard is not None:  # fully_shard: new sharded state takes the parameter's form (a DTensor)
                return state_like(self.params[slot.index], v, shard)
            spec = self.out_specs.get(slot)  # expand mode: new state is a DTensor, as eager's would be
            return v if spec is None else dtensor.wrap(v, spec)

        held = self.held

        new_grads: dict[int, Tensor] = {}
        absent = self.absent(slots, values)
        if self.scaler is not None and self.scaler._scale is None:
            # what the scaler's first scale() does in eager: from now on it holds its state
            for key, t in zip(amp.scaler_keys(self.scaler), self.scaler_initial):
                setattr(self.scaler, f"_{key}", t.clone())
        with torch.no_grad():
            for slot, v in zip(slots, values):
                kind = slot.kind
                if kind is SlotKind.PARAM:
                    _store(held(slot.index, self.params[slot.index]), v)
                elif kind is SlotKind.BUFFER:
                    _store(self.buffers[slot.index], v)
                elif kind is SlotKind.GRAD:
                    if slot.index not in absent:  # eager leaves the .grad of a parameter backward missed None
                        new_grads[slot.index] = (slot, v)
                elif kind is SlotKind.OPT_STATE:
                    p = self.params[slot.index]
                    st = self.opt.state.get(p, {})  # (opt.state is a defaultdict: a lookup would add an entry)
                    if slot.key in st:
                        _store(held(slot.index, st[slot.key]), v)
                    elif slot.index not in absent:  # the optimizer skipped it: eager creates no state either
                        self.opt.state[p][slot.key] = take(v, slot)
                elif kind is SlotKind.PRESENCE:
                    pass  # read first: ``absent``
                elif kind is SlotKind.SCALER:
                    _store(self.scaler_state()[slot.index], v)
                else:
                    raise AssertionError(f"no write-back for {slot}")
            for i, p in enumerate(self.params):
                slot, g = new_grads.get(i, (None, None))
                old = dtensor.local(held(i, p.grad)) if p.grad is not None else None
                if g is None:
                    p.grad = None
                elif old is not None and old.shape == g.shape and old.dtype == g.dtype:
                    _store(old, g)
                else:
                    p.grad = take(g, slot)
        if self.opt is not None:
            # torch's LR schedulers check that optimizer.step() ran before them.
            self.opt._opt_called = True
        return [self.params[i] for i in sorted(absent)]

    def absent(self, slots: list[Slot], values: list[Tensor]) -> set[int]:
        """Parameters (indices) without a gradient this step: no rank's opaque part reached them."""
        for slot, v in zip(slots, values):
            if slot.kind is SlotKind.PRESENCE:
                return {i for i, flag in zip(self.present_params, v.tolist(), strict=True) if flag <= 0}
        return set()


def _tag_placed(grad: Tensor, *, spec, index: int) -> Tensor:
    return tag_grad(dtensor.to_spec(grad, spec), index=index)


@dataclass
class BoundState:
    """The traced state while the user's step runs; read at the end of it."""

    layout: StateLayout
    params: list[Tensor]
    opt_state: dict
    presence: GradPresence

    def final(self) -> list[tuple[Slot, Tensor]]:
        """Every piece of state as it stands now, as (slot, traced tensor)."""
        layout = self.layout
        out = [(Slot(SlotKind.PARAM, n[0], i), p) for i, (n, p) in enumerate(zip(layout.param_names, self.params))]
        for i, names in enumerate(layout.buffer_names):
            # Read through the module: a step may re-assign a buffer attribute.
            out.append((Slot(SlotKind.BUFFER, names[0], i), layout.module.get_buffer(names[0])))
        for i, p in enumerate(self.params):
            if p.grad is not None:
                out.append((Slot(SlotKind.GRAD, layout.param_names[i][0] + ".grad", i), p.grad))
        for i, p in enumerate(self.params):
            for k, v in self.opt_state.get(p, {}).items():
                if isinstance(v, Tensor):
                    out.append((Slot(SlotKind.OPT_STATE, f"{layout.param_names[i][0]}.{k}", i, k), v))
        if layout.scaler is not None:
            for i, k in enumerate(amp.scaler_keys(layout.scaler)):
                out.append((Slot(SlotKind.SCALER, f"scaler._{k}", i, k), getattr(layout.scaler, f"_{k}")))
        layout.present_params = self.presence.params
        if self.presence.present is not None:
            out.append((Slot(SlotKind.PRESENCE, "gradients present", 0), self.presence.present))
        return out


def write_hparams(t: Tensor, values: list[float]) -> Tensor:
    """Write a group's hyper-parameters into its tensor ``t`` (returned).  On a GPU the copy is queued, not waited
    for (from a fresh pinned host tensor, which torch's host allocator keeps until the copy has run), and the
    values are given to the running step (:attr:`StepRuntime.hparam_values`): the optimizer kernels take them as
    numbers from there, without reading the device."""
    host = torch.tensor(values, dtype=torch.float64)
    if t.device.type == "cpu":
        t.copy_(host)
        return t
    if is_fake(t):  # traced on fake GPU tensors (a CPU machine): no value to write
        return t
    t.copy_(host.pin_memory(), non_blocking=True)
    runtime = current()
    if runtime is not None:
        runtime.hparam_values[t.data_ptr()] = tuple(values)
    return t


def state_device(module: nn.Module) -> torch.device:
    """Where new step state goes (a GradScaler's scale, as its first ``scale()`` would put it): the parameters'
    device."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def unique_named(named) -> tuple[list[Tensor], list[list[str]], dict[int, int]]:
    """Distinct tensors, all the names of each, and id -> position (tied weights are one entry)."""
    tensors, names, index = [], [], {}
    for name, t in named:
        if id(t) in index:
            names[index[id(t)]].append(name)
        else:
            index[id(t)] = len(tensors)
            tensors.append(t)
            names.append([name])
    return tensors, names, index


def _zero_grad(p: Tensor, set_to_none: bool) -> None:
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        p.grad.zero_()


def _store(dst: Tensor, src: Tensor) -> None:
    dst = dtensor.local(dst)  # expand mode: the graph computes a DTensor's local tensor
    if src is not dst:
        dst.copy_(src)
