"""Checkpoints of a compiled train step through ``torch.distributed.checkpoint`` (DCP).

Under ``fully_shard`` each rank saves only its shards: every sharded parameter
and optimizer-state tensor is a DTensor (``Shard(0)`` of the full shape, as FSDP2
saves it; :mod:`spmd_ort.distributed.sharding`), so DCP writes each rank's piece once
and can load into another world size, or into an FSDP2 model.  Checkpoints saved
before parameters were DTensors hold the flattened tensor (``Shard(0)`` of its
``numel``): they still load.  Scalars (Adam's
``step``), buffers and replicated tensors are plain tensors; hyper-parameters
travel in ``param_groups``.  Keys are module FQNs, as in ``model.state_dict()``.

:func:`load_checkpoint` changes all or nothing, on every rank:

1. check: the checkpoint's metadata (and its small non-tensor entries, the
   param groups) against the model and optimizer: every key, shape and dtype,
   the optimizer's kind and its param groups (:mod:`spmd_ort.checkpoint.problems`);
2. read into new tensors (DTensors over new shards where the model is sharded;
   a checkpoint saved sharded loads into an unsharded model and back);
3. commit: copy into the live parameters, buffers and optimizer state (the
   optimizer's state becomes the checkpoint's, as ``Optimizer.load_state_dict`` does).

Between the steps the ranks agree (:func:`spmd_ort.distributed.parallel.gather_failures`):
if any rank fails, every rank raises :class:`~spmd_ort.errors.CheckpointError`
and nothing changed anywhere.  The manual route for DCP users::

    sd = spmd_ort.state_dict(step, model, opt)      # views of the live shards
    dcp.save(sd, checkpoint_id=path)
    dcp.load(sd, checkpoint_id=path)                # reads straight into the live shards (not atomic)
    spmd_ort.load_state_dict(step, sd, model, opt)  # hyper-parameters, anything not loaded in place

For export, :func:`spmd_ort.full_state_dict` gathers unsharded tensors on rank 0.
Every function takes the compiled step, the model and the optimizer it works on;
a model the step would shard but has not run yet is sharded first, by the step
itself (``CompiledStep.prepare``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spmd_ort.distributed import parallel
from spmd_ort.checkpoint.problems import (Problem, agree, check_checkpoint, check_state_dict, checkpoint_error,
                                          dcp_quiet, read_checkpoint)
from spmd_ort.errors import CheckpointError, is_timeout
from spmd_ort.capture.optim import initial_step
from spmd_ort.distributed.dtensor import is_dtensor
from spmd_ort.distributed.sharding import ShardSpec, is_sharded_state, place_full, spec_of
from spmd_ort.distributed.stages import sync_stages

NOTHING_CHANGED = "Nothing was loaded: the model, optimizer and step are unchanged."


def _dtensor(local: Tensor, spec: ShardSpec):
    """A flat shard as a flat ``Shard(0)`` DTensor over the ranks it is split over (2-D: the dp group)."""
    from torch.distributed.tensor import DTensor, Shard

    flat = local.detach().reshape(-1)[:spec.valid()]
    return DTensor.from_local(flat, spec.dtensor_mesh(flat.device.type), [Shard(0)], run_check=False,
                              shape=torch.Size([spec.numel]), stride=(1,))


def _names(model: nn.Module) -> dict[int, str]:
    """id -> FQN (a tied parameter under its first name, as named_parameters() lists it once)."""
    return {id(p): name for name, p in model.named_parameters()}


def state_dict(train_step, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": ..., "optim": ...}`` for DCP: sharded tensors as DTensors over the live shards (a pipeline's:
    each stage's parameters and state as the rank stepping them holds them, on every rank)."""
    train_step.prepare(model, optimizer)
    sync_stages(model, optimizer)
    model_sd = {}
    for name, t in model.state_dict(keep_vars=True).items():
        spec = spec_of(t)  # (a sharded parameter is a DTensor already, but a 0-d one: its flat shard)
        model_sd[name] = _dtensor(t, spec) if spec is not None and not is_dtensor(t) else t.detach()
    out = {"model": model_sd}
    if optimizer is not None:
        names = _names(model)
        state = {}
        for p, st in optimizer.state.items():
            spec = spec_of(p)
            state[names[id(p)]] = {k: (_dtensor(v, spec) if spec is not None and is_sharded_state(v)
                                       and not is_dtensor(v) else v) for k, v in st.items()}
        groups = []
        for g in optimizer.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [names[id(p)] for p in g["params"]]
            groups.append(entry)
        out["optim"] = {"state": state, "param_groups": groups}
    return out


def load_state_dict(train_step, sd: dict, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Put ``sd`` (from :func:`state_dict`, after ``dcp.load``) into the model and optimizer.

    ``sd`` is checked first (keys, shapes, parameter names): a mismatch raises
    :class:`~spmd_ort.errors.CheckpointError` before anything is written.
    Tensors DCP loaded in place are left alone; others are copied (a full,
    unsharded tensor for a sharded parameter is cut to this rank's shard).
    """
    problems = check_state_dict(sd, model, optimizer)
    if problems:
        raise _error("the state dict", problems)
    train_step.prepare(model, optimizer)
    with torch.no_grad():
        live = model.state_dict(keep_vars=True)
        for name, value in sd.get("model", {}).items():
            _store(live[name], value, spec_of(live[name]))
        if optimizer is None or "optim" not in sd:
            return
        by_name = {n: p for n, p in model.named_parameters()}
        for name, st in sd["optim"]["state"].items():
            p = by_name[name]
            mine = optimizer.state[p]
            for k, v in st.items():
                if not isinstance(v, Tensor):
                    mine[k] = v
                elif k in mine:
                    _store(mine[k], v, spec_of(p) if is_sharded_state(mine[k]) else None)
                elif is_dtensor(p) and isinstance(v, Tensor) and v.dim() > 0:
                    mine[k] = _placed_like(v, p).clone()
                else:
                    mine[k] = _local(v, spec_of(p) if is_sharded_state(v) else None).clone()
        for group, saved in zip(optimizer.param_groups, sd["optim"]["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v


def _local(value, spec: ShardSpec | None) -> Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor() if spec is None else value.to_local()
        if spec is not None:
            out = value.new_zeros(spec.shard_numel)
            out[:value.numel()].copy_(value.reshape(-1))
            return out
        return value
    if spec is not None and value.numel() == spec.numel and value.shape != (spec.shard_numel,):
        return spec.shard_of(value)  # a full tensor
    return value


def _placed_like(value: Tensor, like, *, allocate: bool = False):
    """``value`` (a full tensor, or a DTensor) as a DTensor placed like ``like``: no communication for a full
    tensor (each rank keeps its piece) or one already placed so.  ``allocate``: a new, empty DTensor of
    ``value``'s dtype (a target for DCP to read into)."""
    from torch.distributed.tensor import DTensor

    if allocate:
        piece = torch.empty(like.to_local().shape, dtype=value.dtype, device=like.to_local().device)
        return DTensor.from_local(piece, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    if isinstance(value, DTensor):
        if tuple(value.placements) != tuple(like.placements):
            value = value.redistribute(like.device_mesh, like.placements)
        return value
    return place_full(value, like)


def _store(dst: Tensor, value, spec: ShardSpec | None) -> None:
    from torch.distributed.tensor import DTensor

    if is_dtensor(dst):  # DTensor state (tensor parallel): local piece to local piece
        src, mine = _placed_like(value, dst).to_local(), dst.to_local()
        if src.data_ptr() != mine.data_ptr():
            mine.copy_(src.reshape(mine.shape))
        return
    if isinstance(value, DTensor) and spec is not None:
        local = value.to_local()
        if local.numel() and local.data_ptr() == dst.data_ptr():
            return  # DCP loaded into the shard itself
    elif isinstance(value, Tensor) and value.data_ptr() == dst.data_ptr():
        return
    src = _local(value, spec)
    if spec is not None:
        dst.detach().reshape(-1)[:src.numel()].copy_(src.reshape(-1))
    else:
        dst.copy_(src.reshape(dst.shape))


# ---------------------------------------------------------------------- save / load
def _head(path: str, loading: bool = True) -> str:
    where = f"`{path}`" if path != "the state dict" else "from the state dict"
    return f"cannot load checkpoint {where}" if loading else f"cannot save a checkpoint to `{path}`"


def _error(path: str, problems: list[Problem], *, rank: int | None = None, loading: bool = True) -> CheckpointError:
    return checkpoint_error(_head(path, loading), problems, path=path, rank=rank,
                            after=NOTHING_CHANGED if loading else "", shown=8)


def _agree(path: str, what: str, problems: list[Problem], *, loading: bool = True) -> None:
    """Every rank raises if any rank has a problem (the first failing rank's, with its rank named)."""
    agree(what, path, problems, lambda p: _head(p, loading), same_first_only=True,
          after=NOTHING_CHANGED if loading else "", shown=8)


def _cause(exc: BaseException) -> str:
    """One line for what really failed inside DCP (its CheckpointException embeds tracebacks per rank)."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, (inner, _) = min(failures.items(), key=lambda kv: kv[0])
        return f"rank {rank}: {_one_line(inner)}"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _dcp_errors():
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)  # CheckpointException is a BaseException


def save_checkpoint(path: str | Path, train_step, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Sharded checkpoint of the step's model and optimizer (collective: every rank calls it).

    ``path`` is a directory (created if missing); a path that is a file is a
    :class:`~spmd_ort.errors.CheckpointError`, as is any failure to write.  A rank that dies during the
    save makes the others raise at once (a stuck one: after the process group's timeout), saying so; the
    directory it leaves has no ``.metadata`` and :func:`load_checkpoint` refuses it.
    """
    import torch.distributed.checkpoint as dcp

    path = str(path)
    target = Path(path)
    problems = []
    if target.exists() and not target.is_dir():
        problems.append(Problem("it is a file, and a checkpoint is a directory",
                                "choose a directory path (it is created if missing)", None))
    _agree(path, "saving the checkpoint", problems, loading=False)
    sd = state_dict(train_step, model, optimizer)
    try:
        with dcp_quiet():
            dcp.save(sd, checkpoint_id=path, storage_writer=_writer(path), no_dist=not dist.is_initialized())
    except _dcp_errors() as exc:
        lost = _lost_rank(exc)
        if lost is None:
            problem = Problem(_cause(exc), "make sure every rank can write to the directory", None)
        else:
            problem = Problem(f"{lost}, so the checkpoint may be incomplete (load_checkpoint refuses it if it is) "
                              f"({_one_line(exc)[:300]})",
                              "relaunch every rank and resume from the newest checkpoint that loads "
                              "(docs/checkpoints.md, \"Resuming after a rank dies\")", None)
        raise _error(path, [problem], rank=parallel.world()[0], loading=False) from exc


def _writer(path: str):
    """DCP's file writer, except that an existing checkpoint's ``.metadata`` goes before any rank writes.

    DCP writes ``.metadata`` last, once every rank has written its data, so a save that stops midway
    leaves a directory without one, which :func:`load_checkpoint` refuses.  Over an existing checkpoint
    the old ``.metadata`` would stay while the data files are rewritten, and describe a mix of old and
    new data (measured: 2 ranks, one dead before its write, loaded 7 tensors of the old step and 17 of
    the new, without an error).  The coordinator removes it while planning, before the plans reach the
    ranks that write.
    """
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def prepare_global_plan(self, plans):
            stale = self.fs.concat_path(self.path, ".metadata")
            if self.fs.exists(stale):
                self.fs.rm_file(stale)
            return super().prepare_global_plan(plans)

    return Writer(path)


def _lost_rank(exc: BaseException) -> str | None:
    """What happened to another rank when a collective of the save failed (None: it was not a collective).

    DCP turns a rank's own failure into a CheckpointException on every rank; the collectives that carry
    it fail when a rank is gone: at once when its process died (gloo: its connection closed), after the
    process group's timeout when it is stuck.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        return None
    if is_timeout(exc):
        return ("another rank did not finish its part of the save within the process group's timeout "
                "(init_process_group(timeout=...)): it is stuck or died")
    text = str(exc).lower()
    if isinstance(exc, dist.DistError) or any(m in text for m in ("connection closed", "connection reset",
                                                                  "broken pipe", "gloo/transport")):
        return "another rank stopped during the save (its connection closed: the process died or was killed)"
    return None


def load_checkpoint(path: str | Path, train_step, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a :func:`save_checkpoint` checkpoint into ``model`` / ``optimizer`` (collective), resharding as needed.

    All or nothing, on every rank: a checkpoint that does not fit (a missing
    key, another shape or dtype, another optimizer, other param groups) or
    cannot be read raises :class:`~spmd_ort.errors.CheckpointError` on every
    rank, and the model, optimizer and step are exactly as before.
    """
    import torch.distributed.checkpoint as dcp

    path = str(path)
    found, problems = read_checkpoint(path)
    if found is not None:
        problems = check_checkpoint(found, model, optimizer)
    _agree(path, "loading the checkpoint", problems)
    with train_step.preparing(model, optimizer):  # a fresh model is sharded here, and unsharded if we fail
        staged, commit = _staging(found, model, optimizer)
        failed = []
        try:
            with dcp_quiet():
                dcp.load(staged, checkpoint_id=path, no_dist=not dist.is_initialized())
        except _dcp_errors() as exc:
            failed.append(Problem(f"reading it failed: {_cause(exc)}",
                                  "check that the checkpoint is complete and readable from every rank", None))
        _agree(path, "loading the checkpoint", failed)
        commit()
    if dist.is_initialized():
        dist.barrier()


def _staging(found, model: nn.Module, optimizer) -> tuple[dict, Callable[[], None]]:
    """The DCP target (new tensors in the layout the checkpoint was saved in) and the commit that copies it in."""
    def target(like: Tensor, spec: ShardSpec | None, saved: tuple[int, ...], dtype: torch.dtype):
        """A new tensor DCP reads ``saved``-shaped data into, and a function giving it in the live layout
        (``like``'s full shape; this rank's shard of it where ``spec`` says the live tensor is sharded)."""
        if is_dtensor(like) and saved == tuple(like.shape):
            # DTensor state (fully_shard, tensor parallel): DCP reads this rank's piece, resharding as needed
            target_dt = _placed_like(torch.empty(saved, dtype=dtype, device="meta"), like, allocate=True)
            return target_dt, lambda: target_dt
        if is_dtensor(like):  # a flat entry (fully_shard before its parameters were DTensors): read whole, cut
            buf = torch.empty(saved, dtype=dtype, device=like.to_local().device)
            return buf, lambda: _placed_like(buf.reshape(like.shape), like)
        if spec is not None and saved == (spec.numel,):  # sharded here and in the checkpoint
            local = torch.zeros(spec.shard_numel, dtype=dtype, device=like.device)
            return _dtensor(local, spec), lambda: local
        buf = torch.empty(saved, dtype=dtype, device=like.device)
        if spec is not None:  # a full tensor in the checkpoint: this rank's shard of it
            return buf, lambda: spec.shard_of(buf)
        shape = tuple(like.shape)  # a flat (sharded) checkpoint entry loads into an unsharded tensor too
        return buf, lambda: buf.reshape(shape)

    model_sd, moves = {}, []
    for name, live in model.state_dict(keep_vars=True).items():
        if isinstance(live, Tensor):
            meta = found.tensors[f"model.{name}"]
            model_sd[name], get = target(live, spec_of(live), tuple(meta.size), meta.properties.dtype)
            moves.append((get, live))
    staged = {"model": model_sd}

    loaded: dict[int, list] = {}  # id(param) -> [(key, get)] in the checkpoint's order
    if optimizer is not None:
        by_name = {n: p for n, p in model.named_parameters()}
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        state_sd: dict[str, dict] = {}
        for pname, entries in found.optim_state.items():
            p = by_name[pname]
            for key, meta in entries.items():
                size, dtype = tuple(meta.size), meta.properties.dtype
                if size:
                    value, get = target(p, spec_of(p), size, dtype)
                else:  # a scalar (Adam's step): where torch keeps it
                    current = optimizer.state.get(p, {}).get(key)
                    device = current.device if isinstance(current, Tensor) else \
                        initial_step(group_of[id(p)], p).device
                    value = torch.empty((), dtype=dtype, device=device)
                    get = (lambda v=value: v)
                state_sd.setdefault(pname, {})[key] = value
                loaded.setdefault(id(p), []).append((key, get))
        staged["optim"] = {"state": state_sd}

    def commit() -> None:
        with torch.no_grad():
            for get, live in moves:
                live.copy_(get())
            if optimizer is None:
                return
            for group in optimizer.param_groups:
                for p in group["params"]:
                    _replace_state(optimizer, p, loaded.get(id(p), []))
            for group, saved in zip(optimizer.param_groups, found.param_groups):
                for k, v in saved.items():
                    if k != "params":
                        group[k] = v

    return staged, commit


def _replace_state(optimizer, p: Tensor, per_key: list) -> None:
    """The parameter's optimizer state becomes the checkpoint's: existing tensors of the same layout are
    written in place (references stay valid), others are new, keys the checkpoint lacks go."""
    old = optimizer.state.get(p, {})
    new = {}
    for key, get in per_key:
        value = get()
        current = old.get(key)
        if isinstance(current, Tensor) and current.shape == value.shape and current.dtype == value.dtype:
            current.copy_(value)
            new[key] = current
        else:
            new[key] = value.clone()
    if new:
        optimizer.state[p] = new
    elif p in optimizer.state:
        del optimizer.state[p]
