"""Plans kept on disk: the same ``plan()`` again answers from the entry its first call wrote.

Planning an 8 B model traces the step, runs every pass and exports hundreds of ONNX segments: half a minute on a
CPU.  Users plan the same configuration again (a notebook re-run, a launcher that plans before it rents, a sweep
that comes back to one point), so :func:`plan_key` names what decides a plan, before anything is traced, and the
plan goes to ``<cache_dir>/plans/<key>.pkl`` (``SPMD_ORT_CACHE_DIR``; ``plan(cache=False)`` or the CLI's
``--no-cache`` plans afresh and writes nothing).  The key is made of:

* the model: every module's class and its public attributes (numbers, strings, flags, dtypes, configs), every
  parameter's and buffer's name, shape, dtype and ``requires_grad``, and a Hugging Face model's config;
* the optimizer: its class, its hyperparameters per group, and the shapes of its state;
* the call: every tensor's shape, dtype and ``requires_grad``, every other argument's value;
* the step: its function's code (and of the code objects within it), defaults and closure values, the step's
  options, layout and overrides;
* the plan's arguments: world size, rank, device, ``export``;
* the code: the versions of torch, ONNX Runtime and transformers, a digest of spmd_ort's own sources, and a
  digest of every module loaded from outside the Python installation (the user's code: the model's classes, the
  helpers the step calls), so that an edit to any of them plans afresh.

A value that has no stable form (an object printed with its address) makes a key that never matches: a miss,
never a stale plan.  An entry that does not load is planned again and rewritten.  A plan from the cache keeps no
graph: its :meth:`~spmd_ort.plan.report.Plan.on` plans again for the other device.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from spmd_ort.backends.files import code_digest as _code
from spmd_ort.backends.files import module_digest as _model
from spmd_ort.backends.files import stable_repr as _plain
from spmd_ort.backends.files import write_atomic

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the Plan's fields change: older entries are then planned again
def _optimizer(opt: torch.optim.Optimizer | None, module: nn.Module | None) -> str:
    if opt is None:
        return "none"
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    groups = [(names.get(id(p), "?") for p in g["params"]) for g in opt.param_groups]
    h = hashlib.sha256(f"{type(opt).__module__}.{type(opt).__qualname__}".encode())
    for group, params in zip(opt.param_groups, groups):
        h.update(_plain({k: v for k, v in group.items() if k != "params"}).encode())
        h.update(",".join(params).encode())
    for p, state in opt.state.items():
        h.update(f"{names.get(id(p), '?')}:{_plain(dict(state))};".encode())
    return h.hexdigest()


@lru_cache(maxsize=1)
def _our_sources() -> str:
    """spmd_ort's own code, as it is on disk (an edit plans afresh)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _installed(path: str) -> bool:
    """Whether ``path`` is part of the Python installation or its packages (versioned: not hashed)."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    resolved = str(Path(path).resolve())
    return any(resolved.startswith(str(Path(r).resolve())) for r in roots if r)


def _user_sources() -> str:
    """Every module loaded from outside the installation (and outside spmd_ort): the user's code."""
    ours = str(Path(__file__).resolve().parents[1])
    h = hashlib.sha256()
    for name, mod in sorted(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not path or not path.endswith(".py") or str(Path(path).resolve()).startswith(ours) or _installed(path):
            continue
        try:
            h.update(f"{name}:".encode() + Path(path).read_bytes())
        except OSError:
            h.update(f"{name}:unreadable".encode())
    return h.hexdigest()


def _versions() -> str:
    import onnxruntime

    transformers = sys.modules.get("transformers")
    return (f"torch {torch.__version__}|onnxruntime {onnxruntime.__version__}|"
            f"transformers {getattr(transformers, '__version__', None)}|spmd_ort {_our_sources()}")


def plan_key(step, args: tuple, kwargs: dict, module: nn.Module | None, opt, *, world_size: int, device,
             rank: int, export: bool) -> str:
    """The name of the plan of ``step`` called on ``(args, kwargs)`` (``module`` and ``opt``: the state owners
    among them) for ``world_size`` ranks on ``device`` (a DeviceSpec)."""

    def leaf(v):
        if v is module:
            return f"model:{_model(module)}"
        if v is opt:
            return f"optimizer:{_optimizer(opt, module)}"
        return _plain(v)

    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts = [FORMAT, _versions(), _user_sources(), _code(step.fn), repr(step.options), _plain(step.layout),
             [repr(o) for o in step.module_override], _plain(step.gm_transformation), str(spec),
             [leaf(v) for v in leaves], world_size, rank, repr(device), export]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def path_for(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "plans" / f"{key}.pkl"


def load(path: Path):
    """The plan kept at ``path``, or None (no entry; one that does not load is planned again, and said so)."""
    if not path.exists():
        return None
    try:
        data = pickle.loads(path.read_bytes())
        if data.get("format") != FORMAT:
            return None
        return data["plan"]
    except Exception as exc:  # noqa: BLE001 - a damaged entry is planned again and rewritten
        logger.warning("the plan kept in %s does not load (%s: %s); planning again", path, type(exc).__name__, exc)
        return None


def store(path: Path, plan) -> None:
    """Keep ``plan`` at ``path`` (without its graph: a plan from the cache plans again for another device)."""
    import dataclasses

    kept = dataclasses.replace(plan, repricer=None)
    try:
        write_atomic(path, pickle.dumps({"format": FORMAT, "plan": kept}))
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
        logger.info("the plan is not kept (%s)", exc)
