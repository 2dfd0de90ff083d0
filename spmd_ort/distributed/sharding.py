"""Parameter sharding for ``DataParallel(parallel_style="fully_shard")`` (ZeRO stage 3).

Every parameter is flattened and split into ``world`` equal shards, the last
ones padded with zeros (``shard_numel = ceil(numel / world)``): rank ``r`` holds
elements ``[r * shard_numel, (r + 1) * shard_numel)``.  This is the layout of
``torch.chunk`` and of DTensor's ``Shard(0)``, which the checkpoints use.

Between steps the module's parameters *are* the local shards: ``p.data`` is a
1-D tensor of ``shard_numel`` elements and ``p._spmd_ort_shard`` (a
:class:`ShardSpec`) remembers the full shape.  Gradients and optimizer state
(every non-scalar entry) are sharded the same way; scalars (Adam's ``step``)
are replicated.  To reach the full weights:

* :func:`full_state_dict` gathers every parameter and buffer (on rank 0, or
  everywhere) under the module's usual FQNs, e.g. for export;
* :func:`gathered_parameters` puts the full parameters into the module for
  the duration of a ``with`` block (evaluation, inspection), then restores the
  shards (changes made inside are discarded unless ``writeback=True``).

Padding elements are zero in parameters, gradients and optimizer state, and the
supported optimizers keep them zero (a zero gradient on a zero weight moves nothing).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

SHARD_ATTR = "_spmd_ort_shard"


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: full ``shape``, ``world`` shards of ``shard_numel`` elements."""

    shape: tuple[int, ...]
    numel: int
    world: int
    rank: int

    @property
    def shard_numel(self) -> int:
        return max(1, -(-self.numel // self.world))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def pad(self) -> int:
        return self.padded_numel - self.numel

    def valid(self, rank: int | None = None) -> int:
        """Real (unpadded) elements in ``rank``'s shard."""
        r = self.rank if rank is None else rank
        return max(0, min(self.shard_numel, self.numel - r * self.shard_numel))

    def shard_of(self, full: Tensor) -> Tensor:
        """This rank's shard of ``full`` (a new tensor, padded with zeros)."""
        flat = full.detach().reshape(-1)
        out = flat.new_zeros(self.shard_numel)
        start = self.rank * self.shard_numel
        n = self.valid()
        if n:
            out[:n].copy_(flat[start:start + n])
        return out

    def unshard(self, gathered: Tensor) -> Tensor:
        """The full tensor from the rank-major concatenation of all shards."""
        return gathered[:self.numel].view(self.shape)


def spec_of(p: Tensor) -> ShardSpec | None:
    return getattr(p, SHARD_ATTR, None)


def is_sharded_state(value) -> bool:
    """Whether an optimizer-state entry of a sharded parameter is sharded: every non-scalar one is."""
    return isinstance(value, Tensor) and value.dim() > 0


def is_sharded(module: nn.Module) -> bool:
    return any(spec_of(p) is not None for p in module.parameters())


class ShardedModule:
    """Shards a module's parameters, gradients and optimizer state in place (undoable until committed)."""

    def __init__(self, module: nn.Module, opt: torch.optim.Optimizer | None, rank: int, world: int, *,
                 offload_param: str | None = None):
        self.module, self.opt, self.rank, self.world = module, opt, rank, world
        self.home = offload_param  # device the parameter shards live on (None: where the parameter is)
        self._undo: list = []
        self._hooks: list = []

    def shard(self) -> None:
        """Rank 0's parameters and buffers everywhere, then every rank keeps its shard.

        The module's own tensors are not written: each parameter gets new data
        (``p.data = shard``), so :meth:`undo` can restore the originals exactly.
        """
        with torch.no_grad():
            for p in self.module.parameters():  # each tied parameter once
                if spec_of(p) is not None:
                    raise RuntimeError("parameter is already sharded")
                full = p.detach().clone()
                dist.broadcast(full, src=0)
                spec = ShardSpec(tuple(p.shape), p.numel(), self.world, self.rank)
                old_data, old_grad = p.data, p.grad
                shard = spec.shard_of(full)
                p.data = shard if self.home is None else shard.to(self.home)
                if old_grad is not None:
                    p.grad = spec.shard_of(old_grad)
                setattr(p, SHARD_ATTR, spec)
                self._undo.append(("param", p, old_data, old_grad))
                if self.opt is not None and p in self.opt.state:
                    st = self.opt.state[p]
                    saved = dict(st)
                    for k, v in st.items():
                        if is_sharded_state(v):
                            st[k] = spec.shard_of(v)
                    self._undo.append(("opt", p, saved, None))
            for b in self.module.buffers():
                saved = b.detach().clone()
                dist.broadcast(b.data, src=0)
                self._undo.append(("buffer", b, saved, None))

    def undo(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        with torch.no_grad():
            for kind, t, a, b in reversed(self._undo):
                if kind == "param":
                    t.data = a
                    t.grad = b
                    delattr(t, SHARD_ATTR)
                elif kind == "opt":
                    self.opt.state[t].clear()
                    self.opt.state[t].update(a)
                else:
                    t.copy_(a)
        self._undo.clear()

    def commit(self) -> None:
        self._undo.clear()
        self._hooks.clear()  # the hooks stay with the sharded module

    def gather_outside_steps(self) -> None:
        """``module(x)`` outside the compiled step (evaluation, generation) runs on the full parameters, gathered
        before its forward and resharded after it, as FSDP2's hooks do (collective: every rank calls it)."""
        m = self.module
        self._hooks += [m.register_forward_pre_hook(_gather_before_forward),
                        m.register_forward_hook(_reshard_after_forward, always_call=True)]


def gather_full(p: Tensor) -> Tensor:
    """The full value of a sharded parameter (or state tensor of its shape), on every rank (collective)."""
    spec = spec_of(p)
    if spec is None:
        return p.detach()
    return gather_tensor(p.detach(), spec)


def gather_tensor(shard: Tensor, spec: ShardSpec) -> Tensor:
    out = shard.new_empty(spec.padded_numel)
    dist.all_gather_single(out, shard.contiguous())
    return spec.unshard(out)


def full_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    rank0_only: bool = True) -> dict:
    """Unsharded ``{"model": state_dict, "optim": state_dict}`` (collective: every rank must call it).

    With ``rank0_only`` (the default) the other ranks get ``{}``; the tensors are
    new (CPU-resident where the model is), so they outlive further training.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = not rank0_only or rank == 0
    full = {id(p): gather_full(p) for p in module.parameters()}
    model_sd = {}
    for name, t in module.state_dict(keep_vars=True).items():
        model_sd[name] = full.get(id(t), t.detach()).clone() if keep else None
    out = {"model": model_sd}
    if optimizer is not None:
        sd = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {}
        for i, p in enumerate(params):
            spec = spec_of(p)
            st = {}
            for k, v in optimizer.state.get(p, {}).items():
                if spec is not None and is_sharded_state(v):
                    v = gather_tensor(v.detach(), spec)
                st[k] = v.clone() if isinstance(v, Tensor) else v
            if st:
                state[i] = st
        out["optim"] = {"state": state, "param_groups": sd["param_groups"]}
    return out if keep else {}


@contextlib.contextmanager
def gathered_parameters(module: nn.Module, *, writeback: bool = False):
    """Full parameters in ``module`` inside the block (collective on entry and exit).

    With ``writeback=True`` each rank keeps its shard of whatever the block
    left in the full parameters (every rank must make the same change).
    """
    params = [p for p in module.parameters() if spec_of(p) is not None]
    shards = {}
    with torch.no_grad():
        for p in params:
            shards[id(p)] = p.data
            p.data = gather_full(p).clone()
    try:
        yield module
    finally:
        with torch.no_grad():
            for p in params:
                full = p.data
                p.data = shards[id(p)]
                if writeback:
                    p.data.copy_(spec_of(p).shard_of(full))


_GATHERED = "_spmd_ort_gathered_for_forward"


def _gather_before_forward(module: nn.Module, args) -> None:
    # a trace puts full-shape traced tensors in the module (it is not sharded then); inside a run of a compiled
    # step (an opaque part) the step's own gathers serve it
    from spmd_ort.runtime.context import in_step

    if not is_sharded(module) or module.__dict__.get(_GATHERED) is not None or in_step() or not _holds_shards(module):
        return  # (inside gathered_parameters the module holds its full parameters already)
    block = gathered_parameters(module)
    block.__enter__()
    module.__dict__[_GATHERED] = block


def _holds_shards(module: nn.Module) -> bool:
    """Whether every sharded parameter of ``module`` holds its shard now (not its full value)."""
    return all(p.dim() == 1 and p.numel() == spec_of(p).shard_numel
               for p in module.parameters() if spec_of(p) is not None)


def _reshard_after_forward(module: nn.Module, args, output) -> None:
    block = module.__dict__.pop(_GATHERED, None)
    if block is not None:
        block.__exit__(None, None, None)


def persistent_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds between steps: parameters, gradients, optimizer state (and buffers); of a DTensor,
    its local tensor."""
    from spmd_ort.distributed.dtensor import local

    def size(t: Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    out = {"params": 0, "grads": 0, "opt_state": 0, "buffers": 0}
    for p in module.parameters():
        out["params"] += size(p)
        if p.grad is not None:
            out["grads"] += size(p.grad)
        if optimizer is not None:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, Tensor):
                    out["opt_state"] += size(v)
    for b in module.buffers():
        out["buffers"] += size(b)
    out["total"] = out["params"] + out["grads"] + out["opt_state"]
    return out
