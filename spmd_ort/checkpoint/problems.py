"""Does a checkpoint fit this model and optimizer?  Decided from its metadata, before anything is loaded.

:func:`read_checkpoint` reads a DCP checkpoint's metadata (every tensor's key,
shape and dtype) and its small non-tensor entries (the optimizer's param
groups) on this rank alone, without collectives.  :func:`check_checkpoint`
compares them with the live model and optimizer and returns every
:class:`Problem` (what is wrong, naming the key and both sides, and the fix);
:mod:`spmd_ort.checkpoint.dcp` loads only when no rank has one.

Shapes are compared on full tensors: a parameter sharded by ``fully_shard``
counts with its full shape, and an entry saved sharded (flat, in several
chunks) fits a parameter of the same number of elements, so a checkpoint moves
between sharded and unsharded training.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from spmd_ort.distributed import parallel
from spmd_ort.distributed.dtensor import is_dtensor
from spmd_ort.distributed.sharding import spec_of
from spmd_ort.errors import CheckpointError

OPTIMIZER_STATE_KEYS = {"SGD": {"momentum_buffer"}, "Adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}}


@dataclass(frozen=True)
class Problem:
    what: str  # the cause, naming the key and both sides
    fix: str
    key: str | None = None


@dataclass
class Found:
    """What a checkpoint holds, from its metadata."""

    tensors: dict[str, Any]  # flat key ("model.fc.weight") -> TensorStorageMetadata
    model: dict[str, Any] = field(default_factory=dict)  # FQN -> TensorStorageMetadata (None: not a tensor)
    optim_state: dict[str, dict[str, Any]] = field(default_factory=dict)  # param FQN -> key -> metadata
    param_groups: list[dict] = field(default_factory=list)  # as saved (values read), "params" as FQNs
    has_optim: bool = False


def _shape(size) -> tuple[int, ...]:
    return tuple(int(s) for s in size)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def dcp_quiet():
    """DCP warns on every call without a process group that it assumes one process: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_checkpoint(path: str) -> tuple[Found | None, list[Problem]]:
    """The checkpoint at ``path`` (metadata and param groups), or why it cannot be read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = Path(path)
    fix = "pass the directory that save_checkpoint wrote"
    if not where.exists():
        return None, [Problem("the directory does not exist", fix)]
    if not where.is_dir():
        return None, [Problem("it is a file, not a checkpoint directory", fix)]
    if not (where / ".metadata").exists():
        data = sorted(f.name for f in where.glob("*.distcp"))
        if data:  # DCP writes .metadata last, once every rank has written its data
            return None, [Problem(f"it holds data files ({_first(data)}) but no .metadata: the save that wrote "
                                  "them did not finish (a rank died, stalled or failed inside save_checkpoint), so "
                                  "the checkpoint is incomplete",
                                  "resume from an earlier checkpoint (the newest one that loads), or save this one "
                                  "again")]
        return None, [Problem("the directory holds no checkpoint (no .metadata file: not written by "
                              "save_checkpoint or dcp.save, or the save did not finish)", fix)]
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same problem to the user
        return None, [Problem(f"its .metadata cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())})",
                              "the checkpoint is damaged; save it again", None)]
    paths = getattr(meta, "planner_data", None) or {}
    found = Found(tensors={k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)})
    groups: dict[int, dict] = {}
    for flat, value in meta.state_dict_metadata.items():
        where_in = paths.get(flat) or tuple(flat.split(".", 1))
        tensor = value if isinstance(value, TensorStorageMetadata) else None
        if where_in[0] == "model" and len(where_in) == 2:
            found.model[where_in[1]] = tensor
        elif where_in[0] == "optim":
            found.has_optim = True
            if len(where_in) == 4 and where_in[1] == "state" and tensor is not None:
                found.optim_state.setdefault(where_in[2], {})[where_in[3]] = tensor
            elif len(where_in) == 4 and where_in[1] == "param_groups":
                groups.setdefault(int(where_in[2]), {})[where_in[3]] = None
    if groups:
        target = {"optim": {"param_groups": [groups.get(i, {}) for i in range(max(groups) + 1)]}}
        try:  # the values are small pickles: read on this rank alone
            with dcp_quiet():
                dcp.load(target, checkpoint_id=path, no_dist=True)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            return None, [Problem(f"its param groups cannot be read ({type(exc).__name__})",
                                  "the checkpoint is damaged; save it again", "optim.param_groups")]
        found.param_groups = target["optim"]["param_groups"]
    return found, []


def _full_shape(t: Tensor) -> tuple[int, ...]:
    """The shape a checkpoint holds ``t`` in: a DTensor's global one (2-D fully_shard included), else the
    parameter's (a plain flat shard of a 0-d one)."""
    spec = spec_of(t)
    if spec is None or is_dtensor(t):
        return tuple(t.shape)
    return spec.shape


def _fits(saved_meta, live_shape: tuple[int, ...]) -> bool:
    """Same shape, or the flat form of a tensor saved sharded (several chunks) with as many elements."""
    saved = _shape(saved_meta.size)
    if saved == live_shape:
        return True
    numel = _numel(live_shape)
    return saved == (numel,) and (len(saved_meta.chunks) > 1 or numel <= 1)


def _saved(meta, live: tuple[int, ...]) -> str:
    """A checkpoint entry's shape as the user knows it (a flat entry of a tensor that is not 1-D was saved
    sharded before fully_shard parameters were DTensors: say so)."""
    size = _shape(meta.size)
    if len(size) == 1 and len(meta.chunks) > 1 and len(live) != 1:
        return f"{size[0]} elements (saved sharded, flattened)"
    return f"shape {size}"


def _live(shape: tuple[int, ...], meta) -> str:
    """A live shape, with its element count where the checkpoint's entry is flat."""
    flat = len(meta.size) == 1 and len(meta.chunks) > 1 and len(shape) != 1
    return f"shape {shape} ({_numel(shape)} elements)" if flat else f"shape {shape}"


def _first(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def optimizer_kind(groups: list[dict]) -> str | None:
    """SGD, Adam or AdamW, from a checkpoint's (or an optimizer's) param groups; None when neither."""
    keys = set().union(*(g.keys() for g in groups)) if groups else set()
    if {"momentum", "dampening", "nesterov"} <= keys:
        return "SGD"
    if {"betas", "amsgrad"} <= keys:
        return "AdamW" if all(g.get("decoupled_weight_decay") for g in groups) else "Adam"
    return None


def _family(kind: str | None) -> str | None:
    return "Adam" if kind in ("Adam", "AdamW") else kind


def check_checkpoint(found: Found, model: nn.Module, optimizer) -> list[Problem]:
    """Every way ``found`` does not fit ``model`` and ``optimizer`` (empty: it fits)."""
    problems = _check_model(found, model)
    if optimizer is not None:
        problems += _check_optimizer(found, model, optimizer)
    return problems


def _check_model(found: Found, model: nn.Module) -> list[Problem]:
    mtype = type(model).__name__
    rebuild = f"build the {mtype} with the configuration the checkpoint was saved from"
    live = model.state_dict(keep_vars=True)
    out = []
    missing = [n for n, t in live.items() if n not in found.model]
    if missing:
        out.append(Problem(f"the checkpoint has no entry `model.{missing[0]}` for {mtype}.{missing[0]}"
                           f"{f' (and {len(missing) - 1} more missing: {_first(missing[1:])})' if missing[1:] else ''}"
                           ": it was saved from another model", rebuild, f"model.{missing[0]}"))
    unexpected = [n for n in found.model if n not in live]
    if unexpected:
        out.append(Problem(f"the checkpoint's `model.{unexpected[0]}` is not in {mtype}'s state dict"
                           f"{f' (nor are {_first(unexpected[1:])})' if unexpected[1:] else ''}",
                           rebuild, f"model.{unexpected[0]}"))
    for name, t in live.items():
        meta = found.model.get(name, False)
        if meta is False or not isinstance(t, Tensor):
            continue
        key = f"model.{name}"
        if meta is None:
            out.append(Problem(f"`{key}` is not a tensor in the checkpoint", rebuild, key))
            continue
        shape = _full_shape(t)
        if not _fits(meta, shape):
            out.append(Problem(f"`{key}` has {_saved(meta, shape)} in the checkpoint but {_live(shape, meta)} "
                               f"in {mtype}",
                               rebuild, key))
        elif meta.properties.dtype != t.dtype:
            out.append(Problem(
                f"`{key}` is {_dtype(meta.properties.dtype)} in the checkpoint but {_dtype(t.dtype)} in {mtype}",
                f"load into a {_dtype(meta.properties.dtype)} model (model.to({meta.properties.dtype})), "
                "then convert it", key))
    return out


def _check_optimizer(found: Found, model: nn.Module, optimizer) -> list[Problem]:
    live_kind = type(optimizer).__name__
    model_only = "or pass optimizer=None to load the model only"
    if not found.has_optim:
        return [Problem(f"the checkpoint holds no optimizer state (it was saved with optimizer=None), but an "
                        f"optimizer ({live_kind}) was passed", "pass optimizer=None to load the model only", "optim")]
    saved_kind = optimizer_kind(found.param_groups)
    here_kind = optimizer_kind(optimizer.param_groups) if live_kind in ("SGD", "Adam", "AdamW") else live_kind
    if saved_kind is not None and saved_kind != here_kind:
        keys = sorted({k for st in found.optim_state.values() for k in st})
        holds = f" ({', '.join(keys)})" if keys else ""
        mode = ""
        if _family(saved_kind) == _family(here_kind):  # Adam vs AdamW: decoupled weight decay or not
            mode = f"; decoupled_weight_decay is {saved_kind == 'AdamW'} in the checkpoint"
        return [Problem(f"the checkpoint holds {saved_kind} optimizer state{holds} but the optimizer is "
                        f"{live_kind}{mode}", f"load it into a torch.optim.{saved_kind}, {model_only}", "optim")]
    rebuild = f"build the {live_kind} with the param groups it was saved with, {model_only}"
    names = {id(p): n for n, p in model.named_parameters()}
    if len(found.param_groups) != len(optimizer.param_groups):
        return [Problem(f"the checkpoint has {len(found.param_groups)} param groups but the {live_kind} has "
                        f"{len(optimizer.param_groups)}", rebuild, "optim.param_groups")]
    out = []
    for i, (saved, group) in enumerate(zip(found.param_groups, optimizer.param_groups)):
        here = [names.get(id(p), "<not a parameter of the model>") for p in group["params"]]
        if list(saved.get("params") or []) != here:
            out.append(Problem(f"param group {i} holds {_first(list(saved.get('params') or []))} in the checkpoint "
                               f"but {_first(here)} in the {live_kind}", rebuild, f"optim.param_groups.{i}.params"))
    params = dict(model.named_parameters())
    allowed = OPTIMIZER_STATE_KEYS.get(_family(here_kind) or "")
    for pname, entries in found.optim_state.items():
        p = params.get(pname)
        if p is None:
            out.append(Problem(f"the checkpoint has optimizer state for `{pname}`, which is not a parameter of "
                               f"{type(model).__name__}", rebuild, f"optim.state.{pname}"))
            continue
        for key, meta in entries.items():
            flat = f"optim.state.{pname}.{key}"
            if allowed is not None and key not in allowed:
                out.append(Problem(f"`{flat}` is not {live_kind} state", rebuild, flat))
            elif _shape(meta.size) and not _fits(meta, _full_shape(p)):
                out.append(Problem(f"`{flat}` has {_saved(meta, _full_shape(p))} in the checkpoint but the "
                                   "parameter has "
                                   f"{_live(_full_shape(p), meta)}", rebuild, flat))
            elif _shape(meta.size) and meta.properties.dtype != p.dtype:
                out.append(Problem(f"`{flat}` is {_dtype(meta.properties.dtype)} in the checkpoint but the parameter "
                                   f"is {_dtype(p.dtype)}", rebuild, flat))
    return out


def check_state_dict(sd: dict, model: nn.Module, optimizer) -> list[Problem]:
    """The same questions for an in-memory ``{"model": ..., "optim": ...}`` (keys, shapes, parameter names)."""
    mtype = type(model).__name__
    rebuild = f"build the {mtype} with the configuration the state dict was saved from"
    live = model.state_dict(keep_vars=True)
    out = []
    for name, value in sd.get("model", {}).items():
        if name not in live:
            out.append(Problem(f"`model.{name}` is not in {mtype}'s state dict", rebuild, f"model.{name}"))
        elif isinstance(value, Tensor) and isinstance(live[name], Tensor) \
                and value.numel() != _numel(_full_shape(live[name])) and spec_of(live[name]) is None:
            out.append(Problem(f"`model.{name}` has shape {tuple(value.shape)} in the state dict but "
                               f"{_full_shape(live[name])} in {mtype}", rebuild, f"model.{name}"))
    if optimizer is not None and "optim" in sd:
        params = dict(model.named_parameters())
        for pname in sd["optim"].get("state", {}):
            if pname not in params:
                out.append(Problem(f"the state dict has optimizer state for `{pname}`, which is not a parameter of "
                                   f"{mtype}", rebuild, f"optim.state.{pname}"))
        if len(sd["optim"].get("param_groups", [])) != len(optimizer.param_groups):
            out.append(Problem(f"the state dict has {len(sd['optim'].get('param_groups', []))} param groups but the "
                               f"{type(optimizer).__name__} has {len(optimizer.param_groups)}", rebuild,
                               "optim.param_groups"))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------- the ranks agree (DCP and safetensors alike)
def checkpoint_error(head: str, problems: Sequence[Problem], *, path: str, rank: int | None,
                     failed_ranks: list[int] | None = None, after: str = "", shown: int | None = None,
                     fixes: bool = False) -> CheckpointError:
    """One :class:`CheckpointError` for ``problems``: ``head`` (``cannot load `path```), the first problem and its
    fix, ``after`` (what was or was not changed), the ranks that failed where not all failed alike, then the others
    (``shown`` of them at most; ``fixes``: each with its fix where not given already)."""
    first, more = problems[0], list(problems[1:])
    line = f"{head}: {first.what}. Fix: {first.fix}." + (f" {after}" if after else "")
    if failed_ranks is not None:
        line += (f" (failed on rank{'s' if len(failed_ranks) > 1 else ''} {', '.join(map(str, failed_ranks))}"
                 f"; this is rank {rank})")
    lines, seen = [line], {first.fix}
    if more:
        lines.append(f"{len(more)} more problem{'s' if len(more) > 1 else ''}:")
    for p in more if shown is None else more[:shown]:
        lines.append(f"  {p.what}" + ("" if not fixes or p.fix in seen else f". Fix: {p.fix}."))
        seen.add(p.fix)
    if shown is not None and len(more) > shown:
        lines.append("  ...")
    return CheckpointError("\n".join(lines), path=str(path), key=first.key, rank=rank)


def agree(what: str, path: str, problems: Sequence[Problem], head: Callable[[str], str], *,
          same_first_only: bool = False, **style) -> None:
    """Every rank raises one :func:`checkpoint_error` if any rank has a problem: the lowest failing rank's, its
    path as that rank was given it (``head(path)``), and which ranks failed where not every rank failed alike
    (``same_first_only``: alike is the same first problem).  ``style``: :func:`checkpoint_error`'s."""
    rank, world = parallel.world()
    failures = parallel.gather_failures(f"{what} `{path}`", (path, tuple(problems)) if problems else None)
    if not failures:
        return
    failed_path, listed = failures[min(failures)]
    key = (lambda f: (f[0], f[1][:1])) if same_first_only else (lambda f: f)
    same = len(failures) == world and len({key(f) for f in failures.values()}) == 1
    raise checkpoint_error(head(failed_path), listed, path=failed_path, rank=rank,
                           failed_ranks=None if same else sorted(failures), **style)

