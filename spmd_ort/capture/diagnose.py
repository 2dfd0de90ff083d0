"""Why a trace failed, told about the right thing.

* :class:`OpWatch` (a torch-function mode active while the step is traced)
  remembers the innermost torch call that raised and, through the graph
  recorded so far, which graph inputs each of its tensor arguments was
  computed from: an argument computed from the batch alone means the batch is
  what the op rejected (:meth:`spmd_ort.capture.inputs.StepInputs.blame`).
* Fake tensors check shapes as eager kernels do, but not every dtype rule:
  ``F.linear`` of an integer or float64 batch with float32 weights traces fine
  and fails only when the graph runs (in ONNX Runtime: a load warning, then an
  error naming a segment).  :data:`DTYPE_RULES` (torch function -> rule) apply
  the rules of eager's CPU kernels while tracing, so these fail where eager
  fails, naming the op.
* :func:`quiet_torch_logs`: torch logs every failed fake-tensor op with a
  traceback at ERROR; while tracing, those records go to the ``spmd_ort``
  logger at DEBUG instead of the user's console (the error we raise says it).
* :func:`raised_by_own_code`: whether a failure is the step's own error (a
  ``raise`` or ``assert`` in code that eager PyTorch runs the same way: the
  user's, a library's, a GradScaler used wrongly) rather than a limit of
  tracing, so that the error says so instead of "make it traceable";
  :func:`tracing_frame` names the torch function where tracing itself failed.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from spmd_ort.options import get_logger, logs_filtered

logger = get_logger(__name__)

# Loggers that report failed ops while make_fx traces over fake tensors.
TRACE_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.proxy_tensor",
                 "torch.fx.experimental.symbolic_shapes", "torch._functorch")


class _ToDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("while tracing, %s: %s", record.name, record.getMessage())
        return False


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torch's records from the fake-tensor machinery go to ``spmd_ort`` at DEBUG while the block runs."""
    with logs_filtered(TRACE_LOGGERS, _ToDebug()):
        yield


# ---------------------------------------------------------------------- whose error it is
_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
_PASSES_DIR = os.path.join(os.path.dirname(_SPMD_DIR.rstrip(os.sep)), "passes") + os.sep
# torch's Python that raises as eager PyTorch raises (a GradScaler or an optimizer used wrongly, a batch that
# BatchNorm or a loss rejects); the rest of torch is, while a step is traced, tracing machinery (fake tensors,
# decompositions, make_fx, functionalization)
EAGER_TORCH = ("amp" + os.sep, "optim" + os.sep, os.path.join("nn", "functional.py"), os.path.join("nn", "modules"),
               os.path.join("nn", "utils", "clip_grad.py"))
# spmd_ort's own code that runs as the user's step would (a DeepSpeed plan's step function)
EAGER_SPMD = ("integrations" + os.sep,)


def _innermost(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _eager_code(filename: str) -> bool:
    """Whether code in ``filename`` runs under tracing as it runs eagerly (not torch's or spmd_ort's machinery)."""
    path = os.path.realpath(filename)
    if path.startswith(_TORCH_DIR):
        return path[len(_TORCH_DIR):].startswith(EAGER_TORCH)
    if path.startswith(_SPMD_DIR):
        return path[len(_SPMD_DIR):].startswith(EAGER_SPMD)
    return not path.startswith(_PASSES_DIR)


def raised_by_own_code(exc: BaseException) -> tuple[str, int] | None:
    """(file, line) of the ``raise`` or ``assert`` statement that raised ``exc``, when that is code eager PyTorch
    runs the same way (the user's step or model, a library, torch's amp / optim / nn Python); else None.

    Such an error is raised by eager PyTorch too: it is no limit of tracing.  An exception raised inside a call
    into compiled code (a C extension reading a fake tensor's data) has a call, not a raise, on its line; one
    raised while handling an error of the tracing machinery (``raise X from exc``) is that machinery's.
    """
    tb = _innermost(exc.__traceback__)
    if tb is None:
        return None
    filename, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
    source = linecache.getline(filename, line).strip()
    if not source.startswith(("raise", "assert")) or not _eager_code(filename):
        return None
    cause = exc.__cause__ or exc.__context__
    if cause is not None and raised_by_own_code(cause) is None:
        return None
    return filename, line


def tracing_frame(exc: BaseException) -> str | None:
    """The innermost torch function of ``exc``'s traceback that is a decomposition or reference of an op
    (``mse_loss_backward``): where tracing itself failed; None when there is none."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        path = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if path.startswith(_TORCH_DIR) and path[len(_TORCH_DIR):].startswith(("_decomp", "_refs", "_prims")):
            found = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return found


# ---------------------------------------------------------------------- dtype rules
def _name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _same_dtype(op: str, tensors: list[torch.Tensor]) -> str | None:
    """Matrix products and convolutions: every operand has one dtype (eager: "mat1 and mat2 must have the
    same dtype")."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        return (f"{op} needs operands of one dtype, got {' and '.join(dict.fromkeys(_name(t) for t in tensors))} "
                "(eager PyTorch rejects this too)")
    return None


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _norm_dtypes(op: str, tensors: list[torch.Tensor]) -> str | None:
    """Normalizations: a floating input; weights and statistics of its dtype (or float32 for a 16-bit input)."""
    x, others = tensors[0], tensors[1:]
    if not x.dtype.is_floating_point:
        return f"{op} needs a floating-point input, got {_name(x)} (eager PyTorch rejects this too)"
    for t in others:
        if t.dtype != x.dtype and not (x.dtype in _LOW_PRECISION and t.dtype == torch.float32):
            return (f"{op} got a {_name(x)} input with {_name(t)} weights or statistics: mixed dtypes "
                    "(eager PyTorch rejects this too)")
    return None


@dataclass(frozen=True)
class DtypeRule:
    """Which arguments (positions, then keyword names) the ``check`` sees, in that order."""

    check: Callable[[str, list[torch.Tensor]], str | None]
    positions: tuple[int, ...]
    keywords: tuple[str, ...] = ()

    def __call__(self, op: str, args: tuple, kwargs: dict) -> str | None:
        picked = [args[i] for i in self.positions if i < len(args)]
        picked += [kwargs[k] for k in self.keywords if k in kwargs]
        tensors = [t for t in picked if isinstance(t, torch.Tensor)]
        return self.check(op, tensors) if tensors else None


_MATMUL = DtypeRule(_same_dtype, (0, 1, 2), ("input", "weight", "bias", "other", "mat1", "mat2"))
DTYPE_RULES: dict[Callable, DtypeRule] = {
    F.linear: _MATMUL,
    torch.matmul: _MATMUL, torch.Tensor.matmul: _MATMUL, torch.Tensor.__matmul__: _MATMUL,
    torch.Tensor.__rmatmul__: _MATMUL,
    torch.mm: _MATMUL, torch.Tensor.mm: _MATMUL, torch.bmm: _MATMUL, torch.Tensor.bmm: _MATMUL,
    torch.mv: _MATMUL, torch.Tensor.mv: _MATMUL,
    torch.addmm: _MATMUL, torch.Tensor.addmm: _MATMUL, torch.baddbmm: _MATMUL, torch.Tensor.baddbmm: _MATMUL,
    F.conv1d: _MATMUL, F.conv2d: _MATMUL, F.conv3d: _MATMUL,
    F.conv_transpose1d: _MATMUL, F.conv_transpose2d: _MATMUL, F.conv_transpose3d: _MATMUL,
    F.layer_norm: DtypeRule(_norm_dtypes, (0, 2, 3), ("input", "weight", "bias")),
    F.group_norm: DtypeRule(_norm_dtypes, (0, 2, 3), ("input", "weight", "bias")),
    F.batch_norm: DtypeRule(_norm_dtypes, (0, 1, 2, 3, 4), ("input", "running_mean", "running_var", "weight",
                                                             "bias")),
    F.instance_norm: DtypeRule(_norm_dtypes, (0, 1, 2, 3, 4), ("input", "running_mean", "running_var", "weight",
                                                                "bias")),
}


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


@functools.cache  # a cache of a pure function: the names torch's, Tensor's and F's attributes have
def _public_names() -> dict[int, str]:
    """id -> how users write it: ``F.linear``, ``torch.matmul``, ``Tensor.view``."""
    names: dict[int, str] = {}
    for prefix, namespace in (("Tensor.", torch.Tensor), ("torch.", torch), ("F.", F)):
        for attr in dir(namespace):
            obj = getattr(namespace, attr, None)
            if callable(obj):
                names[id(obj)] = prefix + attr  # later namespaces win: F.linear over torch._C._nn.linear
    return names


def op_name(func) -> str:
    found = _public_names().get(id(func))
    if found is not None:
        return found
    name = getattr(func, "__name__", None) or str(func)
    owner = getattr(func, "__objclass__", None)
    return f"Tensor.{name}" if isinstance(owner, type) and issubclass(owner, torch.Tensor) else name


# ---------------------------------------------------------------------- the watch
@dataclass
class FailedCall:
    """The innermost torch call that raised while tracing: its name and the graph inputs of each tensor argument."""

    op: str
    roots: list[frozenset[int]]  # per tensor argument: indices of the placeholders it was computed from
    eager_fails: bool = True  # the call also raises on real tensors of its arguments' shapes and dtypes


class OpWatch(torch.overrides.TorchFunctionMode):
    """Applies :data:`DTYPE_RULES` and records the innermost torch call that raised (:class:`FailedCall`)."""

    def __init__(self):
        super().__init__()
        self.failed: FailedCall | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        broken_rule = False
        try:
            rule = DTYPE_RULES.get(func)
            if rule is not None and not _autocast_on():
                problem = rule(op_name(func), args, kwargs)
                if problem is not None:
                    broken_rule = True
                    raise RuntimeError(problem)
            return func(*args, **kwargs)
        except Exception:
            if self.failed is None:  # the innermost call raises first
                try:
                    roots = _roots_of(list(args) + list(kwargs.values()))
                except Exception:  # noqa: BLE001 - a diagnosis must never hide the error it explains
                    roots = []
                eager_fails = broken_rule or _fails_on_real_tensors(func, args, kwargs)
                self.failed = FailedCall(op_name(func), roots, eager_fails)
            raise


def _fails_on_real_tensors(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` also raises on real zero tensors of its tensor arguments' shapes and dtypes.

    Fake tensors check shapes and dtypes as eager kernels do, so an op that
    rejects its fake arguments usually rejects real ones too: a model bug or a
    wrong input.  Some calls fail only because the tensors are fake (``.numpy()``,
    a data pointer): those parts can still run eagerly, as opaque host nodes.
    Unknown (symbolic sizes, a failure to build the stand-ins) counts as failing.
    """
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    def real(x):
        if not isinstance(x, torch.Tensor):
            return x
        if not all(isinstance(s, int) for s in x.shape):
            raise TypeError("symbolic size")
        out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        return out.requires_grad_(x.requires_grad and x.is_floating_point())

    try:
        with disable_proxy_modes_tracing(), unset_fake_temporarily():
            real_args, real_kwargs = pytree.tree_map(real, (tuple(args), dict(kwargs)))
    except Exception:  # noqa: BLE001
        return True
    try:
        with disable_proxy_modes_tracing(), unset_fake_temporarily():
            func(*real_args, **real_kwargs)
    except Exception:  # noqa: BLE001 - eager rejects it too
        return True
    return False


def _roots_of(values: list) -> list[frozenset[int]]:
    """For each tensor among ``values`` (lists looked into), the placeholders of the graph it was computed from."""
    mode = get_proxy_mode()
    if mode is None:
        return []
    tracer = mode.tracer
    index = {n: i for i, n in enumerate(n for n in tracer.graph.nodes if n.op == "placeholder")}
    tensors = []
    for v in values:
        if isinstance(v, (list, tuple)):
            tensors += [t for t in v if isinstance(t, torch.Tensor)]
        elif isinstance(v, torch.Tensor):
            tensors.append(v)
    out = []
    for t in tensors:
        slot = get_proxy_slot(t, tracer, None)
        if slot is None:
            out.append(frozenset())  # a constant made in the step: no graph input
            continue
        seen, stack, found = set(), [slot.proxy.node], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in index:
                found.add(index[node])
            stack.extend(node.all_input_nodes)
        out.append(frozenset(found))
    return out
