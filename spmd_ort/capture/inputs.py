"""The step's arguments, checked before anything is traced, and blamed when they are the root of a failure.

A call that does not match the step function's signature is a ``TypeError``
that says so (not a trace failure).  Every tensor leaf of the arguments has a
name, its path in the call (``x``, ``batch[0]``, ``batch['ids']``), so that an
error can point at it.  When tracing fails at an op whose tensor argument was
computed from the inputs alone (or after an input changed shape or dtype since
the last call that compiled), the error names that input, its shape and dtype,
the op that rejected it and the module it happened in, instead of blaming the
module.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from spmd_ort.capture import amp
from spmd_ort.errors import CompileError

UNCHANGED = "The model and optimizer are unchanged."


def signature_of(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return None


def bind_arguments(fn, args: tuple, kwargs: dict, sig: inspect.Signature | None = None) -> None:
    """Raise a ``TypeError`` naming the signature when ``fn(*args, **kwargs)`` cannot be called."""
    sig = sig or signature_of(fn)
    if sig is None:
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        plain = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                            return_annotation=sig.empty)
        given = f"{len(args)} positional argument{'s' if len(args) != 1 else ''}"
        given += f" and keyword arguments {sorted(kwargs)}" if kwargs else " and no keyword arguments"
        raise TypeError(f"spmd_ort: the call does not match the train step's signature "
                        f"`{getattr(fn, '__name__', 'step')}{plain}`: {exc} (it was called with {given})") from None


@dataclass(frozen=True)
class StepCall:
    """One call of the compiled step: its arguments, the state owners among them, and what it compiles for.

    ``rule``: the optimizer's functional rule (:mod:`spmd_ort.capture.optim`); ``mode``: the resolved
    parallel mode (None: one process, or expand mode); ``rank`` / ``world_size`` of this process.
    """

    args: tuple
    kwargs: dict
    module: nn.Module
    opt: torch.optim.Optimizer | None
    scaler: Any
    rule: Any
    mode: Any
    rank: int
    world_size: int
    tensor_parallel: Any = None  # a spmd_ort.TensorParallel to apply at this call (mode is then None)

    @property
    def leaves(self) -> list:
        return pytree.tree_leaves((self.args, self.kwargs))


def _torch_compiled(obj: Any) -> bool:
    """Whether ``obj`` is ``torch.compile(module)``'s wrapper (dynamo's OptimizedModule; none exists before
    torch._dynamo is imported)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(obj, eval_frame.OptimizedModule)


def unwrap_torch_compiled(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[nn.Module]]:
    """The call with every ``torch.compile``'d module replaced by the module it wraps (``_orig_mod``), and the
    wrappers found.

    nanoGPT's train.py compiles its model by default; dynamo cannot run under make_fx, and the wrapper owns no
    state of its own: the module it wraps holds the parameters the optimizer steps, so compiling that module
    trains the same parameters, and the wrapper sees every update.
    """
    leaves = pytree.tree_leaves((args, kwargs))
    if not any(_torch_compiled(leaf) for leaf in leaves):
        return args, kwargs, []
    wrappers = []

    def unwrap(leaf):
        if not _torch_compiled(leaf):
            return leaf
        wrappers.append(leaf)
        while _torch_compiled(leaf):  # torch.compile(torch.compile(m)) wraps twice
            leaf = leaf._orig_mod
        return leaf

    args, kwargs = pytree.tree_map(unwrap, (args, kwargs))
    return args, kwargs, wrappers


def _on_meta(t: Any) -> bool:
    local = getattr(t, "_local_tensor", None)  # a DTensor: where its local part lives
    return isinstance(t, torch.Tensor) and (t.is_meta or (local is not None and local.is_meta))


def refuse_meta(module: nn.Module, opt: torch.optim.Optimizer | None, args: tuple, kwargs: dict,
                sig: inspect.Signature | None, rank: int | None, *, state: bool = True) -> None:
    """A ``ConfigError`` naming what is on the meta device (the model's parameters and buffers, the optimizer's
    state, the batch), before anything is traced: a model built under ``torch.device("meta")`` has no values.
    ``state=False``: the batch only (the module and optimizer already ran a step: a walk over every parameter and
    state tensor on each call would cost a large model milliseconds a step)."""
    from spmd_ort.errors import ConfigError

    meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if _on_meta(t)] if state else []
    if meta:
        total = sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers())
        shown = ", ".join(f"`{n}`" for n in meta[:4]) + (f" and {len(meta) - 4} more" if len(meta) > 4 else "")
        raise ConfigError(
            f"{type(module).__name__} has {len(meta)} of its {total} parameters and buffers on the meta device "
            f"({shown}): they have no values to train. Fix: allocate them with `model.to_empty(device=\"cpu\")` "
            "and initialise them (`reset_parameters()`, your `init_weights()`), or load weights into them with "
            "`spmd_ort.load_safetensors(model, path)`; build the optimizer after that. Nothing was changed",
            fqn=meta[0].rpartition(".")[0] or None, rank=rank)
    if state and opt is not None and any(_on_meta(v) for st in opt.state.values() for v in st.values()):
        raise ConfigError("the optimizer's state is on the meta device. Fix: build the optimizer after the model's "
                          "parameters have values (after `to_empty` and init, or `load_safetensors`). Nothing was "
                          "changed", rank=rank)
    names = list(sig.parameters) if sig is not None else []
    named = [(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args)]
    for key, value in [*named, *kwargs.items()]:
        for leaf in pytree.tree_leaves(value):
            if _on_meta(leaf):
                raise ConfigError(f"the input `{key}` is on the meta device (shape {tuple(leaf.shape)}): it has no "
                                  "values. Fix: pass the batch on the device the model is on. Nothing was changed",
                                  input=key, rank=rank)


def find_state_owners(args: tuple, kwargs: dict) -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    """The module, the optimizer (if any) and the GradScaler (if any) among the step's arguments."""
    modules, optimizers, scalers = [], [], []
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, nn.Module) and not any(leaf is m for m in modules):
            modules.append(leaf)
        elif isinstance(leaf, torch.optim.Optimizer) and not any(leaf is o for o in optimizers):
            optimizers.append(leaf)
        elif amp.is_scaler(leaf) and not any(leaf is s for s in scalers):
            scalers.append(leaf)
    if len(modules) != 1:
        what = ("no nn.Module" if not modules
                else f"{len(modules)} nn.Modules ({', '.join(type(m).__name__ for m in modules)})")
        raise TypeError(f"spmd_ort.compile: the train step must receive exactly one nn.Module among its "
                        f"arguments; got {what}")
    if len(optimizers) > 1:
        raise TypeError(f"spmd_ort.compile: the train step may receive at most one optimizer; got "
                        f"{len(optimizers)} ({', '.join(type(o).__name__ for o in optimizers)})")
    if len(scalers) > 1:
        raise TypeError(f"spmd_ort.compile: the train step may receive at most one GradScaler; got {len(scalers)}")
    return modules[0], optimizers[0] if optimizers else None, scalers[0] if scalers else None


def leaf_names(fn, args: tuple, kwargs: dict) -> list[str]:
    """A name for every leaf of ``pytree.tree_flatten((args, kwargs))``: its path in the call."""
    sig = signature_of(fn)
    positional: list[str] = []
    var_positional = "args"
    if sig is not None:
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positional.append(p.name)
            elif p.kind == p.VAR_POSITIONAL:
                var_positional = p.name
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        top, key, rest = path[0], path[1], path[2:]
        if top.idx == 0:
            i = key.idx
            head = positional[i] if i < len(positional) else f"{var_positional}[{i - len(positional)}]"
        else:
            head = str(key.key)
        names.append(head + pytree.keystr(rest))
    return names


def _named_values(fn, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Every value of the call, containers and their items too, with its path in the call (``x``, ``batch[0]``)."""
    out: list[tuple[str, Any]] = []

    def walk(name: str, value: Any) -> None:
        out.append((name, value))
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{name}[{k!r}]", v)
        elif isinstance(value, (list, tuple)) and not _numbers(value):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v)

    sig = signature_of(fn)
    positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] \
        if sig is not None else []
    for i, value in enumerate(args):
        walk(positional[i] if i < len(positional) else f"args[{i - len(positional)}]", value)
    for key, value in kwargs.items():
        walk(key, value)
    return out


def _numbers(value: Any) -> bool:
    """A non-empty list or tuple of Python numbers (or of such lists): what ``torch.tensor`` makes a tensor of."""
    if not isinstance(value, (list, tuple)) or not value:
        return False
    return all(_numbers(v) if isinstance(v, (list, tuple)) else
               isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def _array_kind(value: Any) -> str | None:
    """``numpy.ndarray``, ``list`` or ``tuple`` for a value that stands for a tensor but is none; else None."""
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        return "numpy.ndarray"
    if _numbers(value):
        return type(value).__name__
    return None


def describe(t: torch.Tensor) -> str:
    return _shape_dtype(tuple(t.shape), str(t.dtype))


def _shape_dtype(shape: tuple, dtype: str) -> str:
    return f"shape {shape}, {dtype.removeprefix('torch.')}"


@dataclass
class StepInputs:
    """The call being traced: a name per leaf, and what the last call that compiled passed (same structure)."""

    names: list[str]
    leaves: list[Any]
    previous: dict[int, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    values: list[tuple[str, Any]] = field(default_factory=list)  # every value of the call, by path

    @classmethod
    def of(cls, fn, args: tuple, kwargs: dict, previous_key=None) -> StepInputs:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        previous = {}
        if previous_key is not None and dict(previous_key.inputs).get("structure") == str(spec):
            for label, desc in previous_key.inputs:
                if label.startswith("leaf[") and isinstance(desc, tuple) and desc and desc[0] == "tensor":
                    previous[int(label[5:-1])] = (desc[1], desc[2])
        return cls(leaf_names(fn, args, kwargs), leaves, previous, _named_values(fn, args, kwargs))

    def changed(self, i: int) -> str | None:
        """How leaf ``i`` differs from the last call that compiled, or None."""
        t, before = self.leaves[i], self.previous.get(i)
        if before is None or not isinstance(t, torch.Tensor):
            return None
        shape, dtype = before
        if (tuple(t.shape), str(t.dtype)) == (shape, dtype):
            return None
        return _shape_dtype(shape, dtype)

    def check(self, batch_positions: list[int]) -> None:
        """Inputs that cannot be compiled as they are: non-leaf tensors that require grad."""
        for i in batch_positions:
            t = self.leaves[i]
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                raise CompileError(
                    f"the input `{self.names[i]}` ({describe(t)}) requires grad but is not a leaf (it was "
                    f"computed by {type(t.grad_fn).__name__} outside the step): the compiled step cannot "
                    "backpropagate into the graph that produced it. Fix: pass `.detach().requires_grad_()` and "
                    f"apply its .grad yourself, or compute it inside the step. {UNCHANGED}", input=self.names[i])

    def not_a_tensor(self, exc: BaseException, op: str | None, fqn: str | None) -> CompileError | None:
        """The error for an op that rejected an input passed as a numpy array or a list of numbers instead of a
        tensor (``must be Tensor, not numpy.ndarray``): it names the input, not the module it reached."""
        if not isinstance(exc, (TypeError, AttributeError)):
            return None
        text = str(exc)
        for name, value in self.values:
            kind = _array_kind(value)
            if kind is None or not any(p in text for p in (f"not {kind}", f"'{kind}' object", f"'{kind}'>")):
                continue
            if kind == "numpy.ndarray":
                what, fix = f"a numpy.ndarray (shape {tuple(value.shape)}, {value.dtype})", f"torch.from_numpy({name})"
            else:
                dims, item = [], value
                while isinstance(item, (list, tuple)):
                    dims.append(str(len(item)))
                    item = item[0]
                what, fix = f"a {kind} of numbers ({' x '.join(dims)})", f"torch.tensor({name})"
            where = f"module `{fqn}`" if fqn and fqn != "<root>" else "the model" if fqn else "the step"
            called = re.match(r"(\w+)\(\): argument", text)
            op = op or (f"{called.group(1)}()" if called else "an op")
            return CompileError(
                f"the input `{name}` is {what}, not a torch.Tensor: {op} in {where} rejected it "
                f"({type(exc).__name__}: {text}). Fix: pass a torch.Tensor, e.g. {fix}. {UNCHANGED}",
                fqn=fqn, op=op, input=name)
        return None

    def blame(self, leaf_indices: list[int], op: str | None, fqn: str | None, what: str,
              module_type: str | None = None, *, running: bool = False) -> CompileError | None:
        """The error for a failure rooted in the inputs ``leaf_indices`` (computed from them alone), or in an
        input that changed since the last call that compiled; None when no input is to blame.

        ``running``: the compiled graph failed when it ran (not while tracing).
        """
        kind = f" ({module_type})" if module_type else ""
        where = (f"module `{fqn}`{kind}" if fqn and fqn != "<root>" else f"the model{kind}" if fqn
                 else "the step function")
        op_text = op or "an op"
        for i in leaf_indices:
            before = self.changed(i)
            since = f"; the last call that compiled passed {before}" if before else ""
            return CompileError(
                f"the input `{self.names[i]}` ({describe(self.leaves[i])}{since}) does not fit {where}: "
                f"{op_text} rejected it: {what}. Fix: pass `{self.names[i]}` with the shape and dtype the model "
                f"expects. {UNCHANGED}", fqn=fqn, op=op, input=self.names[i])
        changed = [i for i in sorted(self.previous) if self.changed(i)]
        if changed:
            i = changed[0]
            fails = "the compiled step fails when it runs" if running else f"{op_text} in {where} fails"
            return CompileError(
                f"the input `{self.names[i]}` changed from {self.changed(i)} to {describe(self.leaves[i])} since the "
                f"last call that compiled, and with it {fails}: {what}. Fix: pass `{self.names[i]}` with the shape "
                f"and dtype the model expects.{'' if running else ' ' + UNCHANGED}",
                fqn=fqn, op=op, input=self.names[i])
        return None
