"""Checkpoints of a compiled train step through ``torch.distributed.checkpoint`` (DCP).

Under ``fully_shard`` each rank saves only its shards: every sharded parameter
and optimizer-state tensor goes into the state dict as a DTensor (``Shard(0)``
of the flattened tensor, the layout of :mod:`spmd_ort.sharding`), so DCP writes
each rank's piece once and can load into another world size.  Scalars (Adam's
``step``), buffers and replicated tensors are plain tensors; hyper-parameters
travel in ``param_groups``.  Keys are module FQNs, as in ``model.state_dict()``::

    sd = spmd_ort.state_dict(step, model, opt)      # views of the live shards
    dcp.save(sd, checkpoint_id=path)                # or spmd_ort.save_checkpoint(path, step, model, opt)
    ...
    sd = spmd_ort.state_dict(step, model, opt)      # a fresh model is sharded here
    dcp.load(sd, checkpoint_id=path)                # reads straight into the shards
    spmd_ort.load_state_dict(step, sd, model, opt)  # hyper-parameters, anything not loaded in place

(:func:`save_checkpoint` / :func:`load_checkpoint` do exactly this.)  For export, :func:`spmd_ort.full_state_dict`
gathers unsharded tensors on rank 0.  Every function takes the compiled step, the
model and the optimizer it works on; a model the step would shard but has not
run yet is sharded first, by the step itself (``CompiledStep.prepare``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .optim import initial_step
from .sharding import ShardSpec, is_sharded_state, spec_of


def _mesh(world: int):
    """The 1-D mesh over every rank (it uses the default process group: nothing is created or cached)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(world))


def _dtensor(local: Tensor, spec: ShardSpec, mesh):
    from torch.distributed.tensor import DTensor, Shard

    flat = local.detach().reshape(-1)[:spec.valid()]
    return DTensor.from_local(flat, mesh, [Shard(0)], run_check=False, shape=torch.Size([spec.numel]), stride=(1,))


def _names(model: nn.Module) -> dict[int, str]:
    """id -> FQN (a tied parameter under its first name, as named_parameters() lists it once)."""
    return {id(p): name for name, p in model.named_parameters()}


def state_dict(train_step, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": ..., "optim": ...}`` for DCP: sharded tensors as DTensors over the live shards."""
    train_step.prepare(model, optimizer)
    specs = [spec_of(p) for p in model.parameters() if spec_of(p) is not None]
    mesh = _mesh(specs[0].world) if specs else None
    model_sd = {}
    for name, t in model.state_dict(keep_vars=True).items():
        spec = spec_of(t)
        model_sd[name] = _dtensor(t, spec, mesh) if spec is not None else t.detach()
    out = {"model": model_sd}
    if optimizer is not None:
        names = _names(model)
        state = {}
        for p, st in optimizer.state.items():
            spec = spec_of(p)
            state[names[id(p)]] = {k: (_dtensor(v, spec, mesh) if spec is not None and is_sharded_state(v) else v)
                                   for k, v in st.items()}
        groups = []
        for g in optimizer.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [names[id(p)] for p in g["params"]]
            groups.append(entry)
        out["optim"] = {"state": state, "param_groups": groups}
    return out


def load_state_dict(train_step, sd: dict, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Put ``sd`` (from :func:`state_dict`, after ``dcp.load``) into the model and optimizer.

    Tensors DCP loaded in place are left alone; others are copied (a full,
    unsharded tensor for a sharded parameter is cut to this rank's shard).
    """
    train_step.prepare(model, optimizer)
    with torch.no_grad():
        live = model.state_dict(keep_vars=True)
        for name, value in sd.get("model", {}).items():
            if name not in live:
                raise KeyError(f"checkpoint entry {name!r} is not in {type(model).__name__}'s state dict")
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


def _store(dst: Tensor, value, spec: ShardSpec | None) -> None:
    from torch.distributed.tensor import DTensor

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
        dst.copy_(src)


def _init_missing_optimizer_state(model: nn.Module, optimizer, names_in_checkpoint: list[str]) -> None:
    """Zero state where the checkpoint has some and the optimizer has none yet (a fresh optimizer).

    Entries are created in the checkpoint's order, the same on every rank (the
    order fixes the compiled step's inputs).
    """
    names = _names(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"optim.state.{names[id(p)]}."
            st = optimizer.state[p]
            keys = [n[len(prefix):] for n in names_in_checkpoint if n.startswith(prefix)]
            for key in [k for k in keys if k not in st and "." not in k]:
                if key == "step":
                    st[key] = initial_step(group, p)
                else:
                    st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def save_checkpoint(path: str | Path, train_step, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Sharded checkpoint of the step's model and optimizer (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict(train_step, model, optimizer), checkpoint_id=str(path))


def load_checkpoint(path: str | Path, train_step, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a :func:`save_checkpoint` checkpoint into ``model`` / ``optimizer`` (collective), resharding as needed."""
    import torch.distributed.checkpoint as dcp

    train_step.prepare(model, optimizer)
    if optimizer is not None:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        _init_missing_optimizer_state(model, optimizer, list(meta.state_dict_metadata))
    sd = state_dict(train_step, model, optimizer)
    dcp.load(sd, checkpoint_id=str(path))
    load_state_dict(train_step, sd, model, optimizer)
    if dist.is_initialized():
        dist.barrier()
