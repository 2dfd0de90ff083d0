"""Parameter sharding for ``DataParallel(parallel_style="fully_shard")`` (ZeRO stage 3).

Every parameter is split along dim 0 into ``world`` chunks of ``ceil(rows / world)``
rows, as ``torch.chunk`` and DTensor's ``Shard(0)`` (and FSDP2) split it: rank ``r``
holds rows ``[r * c, (r + 1) * c)``.  Inside the compiled step each rank's chunk is
one flat buffer of ``shard_numel = c * prod(shape[1:])`` elements, padded with zeros
past the last row (a trailing rank may hold padding only), so that the rank-major
concatenation of the buffers (what an all-gather returns) begins with the full
tensor, flattened.

Between steps the module's parameters are DTensors, ``Shard(0)`` over the ranks, as
under FSDP2: ``model.state_dict()``, ``p.full_tensor()``, ``torch.save`` and DCP see
the parameter's global shape, and each DTensor's local tensor is a view of the
rank's flat buffer (:func:`flat_of`), which the step reads and writes in place.
``p._spmd_ort_shard`` (a :class:`ShardSpec`) remembers the layout.  Gradients and
optimizer state (every non-scalar entry) are DTensors of the same layout; scalars
(Adam's ``step``) are replicated plain tensors.  A 0-d parameter has no dim to
split: it stays a plain 1-element shard.  To reach the full weights:

* ``p.full_tensor()`` (collective), or :func:`full_state_dict`, which gathers
  every parameter and buffer (on rank 0, or everywhere) under the module's usual
  FQNs, e.g. for export;
* ``model(x)`` outside the compiled step gathers the full parameters before the
  forward and reshards after it, as FSDP2's hooks do;
* :func:`gathered_parameters` puts the full parameters into the module for
  the duration of a ``with`` block (evaluation, inspection), then restores the
  shards (changes made inside are discarded unless ``writeback=True``).

Padding elements are zero in parameters, gradients and optimizer state, and the
supported optimizers keep them zero (a zero gradient on a zero weight moves nothing).

2-D (``TensorParallel(plan, mesh, data_parallel=DataParallel(parallel_style="fully_shard"))``, FSDP2 + TP):
what is split over the ``dp`` dim is each parameter's tensor-parallel local tensor, and the parameter is a
DTensor on the 2-D mesh with FSDP2 + TP's placements (a strided ``Shard(0)`` over dp where the plan shards
dim 0 over tp; a parameter the plan leaves plain is ``Shard(0)`` on the dp mesh).  The step is traced on the
tensor-parallel DTensors (expand mode) and the ZeRO passes work on the dp group; gathering a parameter outside
the step yields the tensor-parallel DTensor the plan made.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spmd_ort.runtime.collectives import data_group, ours
from spmd_ort.distributed.stages import sync_stages

SHARD_ATTR = "_spmd_ort_shard"
TO_EMPTY_ATTR = "_spmd_ort_to_empty"  # on a meta model laid out up front: (shard specs by FQN, tied holders)
FLAT_ATTR = "_spmd_ort_flat"  # on a sharded DTensor: the padded flat buffer its local tensor views


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: full ``shape``, ``world`` shards of ``shard_numel`` elements.

    2-D (``TensorParallel(..., data_parallel=DataParallel(parallel_style="fully_shard"))``): what is split over
    the ``dp`` dim is the tensor-parallel local tensor (``shape`` is its shape); ``tp_spec`` is the DTensorSpec of
    the tensor-parallel parameter (None for a parameter the plan leaves plain), ``mesh`` the mesh the parameter's
    DTensor lives on (the 2-D mesh, or its ``dp`` dim for a plain one) and ``group`` the dp group's name.
    """

    shape: tuple[int, ...]
    numel: int
    world: int
    rank: int
    group: str = ""
    tp_spec: object = field(default=None, compare=False, repr=False)
    mesh: object = field(default=None, compare=False, repr=False)

    @property
    def placements(self) -> tuple:
        """The parameter's DTensor placements: ``Shard(0)`` over the ranks (2-D: over dp, then the plan's over tp;
        a plan's ``Shard(0)`` makes dp's a strided shard of the tp-local rows, as FSDP2 + TP does)."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        if self.tp_spec is None:
            return (Shard(0),)
        tp = tuple(self.tp_spec.placements)
        dp = _StridedShard(0, split_factor=self.tp_spec.mesh.size()) if any(
            pl.is_shard(0) for pl in tp) else Shard(0)
        return (dp, *tp)

    def dtensor_mesh(self, device_type: str):
        if device_type == "meta":  # a meta model's shards: the mesh of the ranks' device
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return self.mesh if self.mesh is not None else mesh_over(device_type, self.world)

    def tp_local(self, local: Tensor) -> Tensor:
        """A tensor-parallel local tensor (gathered over dp) as the parameter the plan made: a DTensor on the tp
        mesh (``local`` itself for a parameter the plan leaves plain)."""
        if self.tp_spec is None:
            return local
        from torch.distributed.tensor import DTensor

        spec = self.tp_spec
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                  stride=spec.stride)

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row (1 for a 0-d tensor)."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def shard_numel(self) -> int:
        if not self.shape:
            return max(1, -(-self.numel // self.world))
        return max(1, -(-self.shape[0] // self.world) * self.row_numel)

    @property
    def as_dtensor(self) -> bool:
        """Whether the shards are handed out as ``Shard(0)`` DTensors (every parameter with a dim 0 and rows)."""
        return bool(self.shape) and self.row_numel > 0

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """The shape of ``rank``'s chunk (DTensor ``Shard(0)``: ``torch.chunk`` rows, possibly none)."""
        return (self.valid(rank) // self.row_numel, *self.shape[1:])

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


# A cache of a pure function: the mesh names the default group by its name and holds nothing else (building one
# takes ~0.5 ms, and every sharded state tensor the user sees is a DTensor on it).
@functools.lru_cache(maxsize=8)
def mesh_over(device_type: str, world: int):
    """The 1-D mesh over every rank (over the default process group: nothing is created)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.arange(world))


def as_shard(flat: Tensor, spec: ShardSpec) -> Tensor:
    """The state tensor users see for a flat shard buffer: a ``Shard(0)`` DTensor of the full shape whose
    local tensor views ``flat`` (no copy), or ``flat`` itself where the spec has no dim 0 to split."""
    if not spec.as_dtensor:
        return flat
    from torch.distributed.tensor import DTensor

    piece = flat[:spec.valid()].view(spec.local_shape())
    if spec.tp_spec is not None:  # 2-D: the tensor-parallel parameter's global shape
        shape, stride = spec.tp_spec.shape, spec.tp_spec.stride
    else:
        shape, stride = torch.Size(spec.shape), torch.empty(spec.shape, device="meta").stride()
    out = DTensor.from_local(piece, spec.dtensor_mesh(flat.device.type), spec.placements, run_check=False,
                             shape=shape, stride=stride)
    out.__dict__[FLAT_ATTR] = flat
    return out


def flat_of(t: Tensor, spec: ShardSpec) -> Tensor:
    """The padded flat buffer behind a sharded state tensor, which the compiled step reads and writes in place.

    A DTensor made elsewhere (``zeros_like`` of a parameter, a clone, a loaded value) is given one: its local
    tensor is copied into a new padded buffer and becomes a view of it, so later writes reach the DTensor.
    A plain tensor is the flat buffer itself.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    piece = t._local_tensor
    flat = t.__dict__.get(FLAT_ATTR)
    if flat is None or flat.untyped_storage().data_ptr() != piece.untyped_storage().data_ptr() \
            or flat.dtype != piece.dtype:
        flat = piece.new_zeros(spec.shard_numel)
        flat[:piece.numel()].copy_(piece.detach().reshape(-1))
        t._local_tensor = flat[:piece.numel()].view(piece.shape)
        t.__dict__[FLAT_ATTR] = flat
    return flat


def state_like(t: Tensor, flat: Tensor, spec: ShardSpec) -> Tensor:
    """New sharded state (a gradient, optimizer state) in the form the parameter ``t`` has: a DTensor over
    ``flat`` when the parameter is one, else ``flat``."""
    from torch.distributed.tensor import DTensor

    return as_shard(flat, spec) if isinstance(t, DTensor) else flat


def is_sharded_state(value) -> bool:
    """Whether an optimizer-state entry of a sharded parameter is sharded: every non-scalar one is."""
    return isinstance(value, Tensor) and value.dim() > 0


def is_sharded(module: nn.Module) -> bool:
    return any(spec_of(p) is not None for p in module.parameters())


class ShardedModule:
    """Shards a module's parameters, gradients and optimizer state in place (undoable until committed)."""

    def __init__(self, module: nn.Module, opt: torch.optim.Optimizer | None, rank: int, world: int, *,
                 offload_param: str | None = None, mesh=None):
        """``rank``/``world``: within the ranks the parameters are sharded over; ``mesh``: 2-D, the ``("dp", "tp")``
        DeviceMesh (shards over ``dp`` of each tensor-parallel local tensor; ``rank``/``world`` are dp's)."""
        self.module, self.opt, self.rank, self.world = module, opt, rank, world
        self.mesh = mesh
        self.home = offload_param  # device the parameter shards live on (None: where the parameter is)
        self._saved: tuple | None = None
        self._buffers: list = []
        self._hooks: list = []

    def shard(self) -> None:
        """Rank 0's parameters and buffers everywhere, then every rank keeps its shard.

        Each parameter is replaced, in every module that holds it (a tied weight stays one parameter),
        by a new ``Shard(0)`` DTensor parameter over this rank's flat shard buffer; the optimizer's
        param groups and state move to the new parameters (state sharded alike).  The original
        parameters are not written, so :meth:`undo` puts them back exactly.
        """
        if any(spec_of(p) is not None for p in self.module.parameters()):
            raise RuntimeError("parameter is already sharded")
        modules = list(self.module.modules())
        self._saved = ([(m, dict(m._parameters)) for m in modules],
                       None if self.opt is None else ([list(g["params"]) for g in self.opt.param_groups],
                                                      self.opt.state))
        swap: dict[int, nn.Parameter] = {}
        group = self.mesh["dp"].get_group() if self.mesh is not None else None
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            for p in self.module.parameters():  # each tied parameter once
                full = _local(p).detach().clone()  # 2-D: the tensor-parallel shard, split over dp
                if not full.is_meta:  # (a meta model has no values to agree on: each rank's shard stays meta)
                    dist.broadcast(full, src=src, group=ours(group))  # (2-D: within the dp group)
                spec = self._spec(p, full)
                shard = spec.shard_of(full)
                new = _shard_param(shard if self.home is None else shard.to(self.home), spec, p.requires_grad)
                if p.grad is not None:
                    new.grad = state_like(new, spec.shard_of(_local(p.grad)), spec)
                swap[id(p)] = new
            for m in modules:
                for name, p in list(m._parameters.items()):
                    if p is not None and id(p) in swap:
                        m._parameters[name] = swap[id(p)]
            if self.opt is not None:
                self._move_optimizer(swap)
            for b in self.module.buffers():
                saved = b.detach().clone()
                if not b.is_meta:
                    dist.broadcast(_local(b.data), src=src, group=ours(group))
                self._buffers.append((b, saved))
        if any(p.is_meta for p in self.module.parameters()):
            keep_layout_through_to_empty(self.module)

    def _spec(self, p: Tensor, local: Tensor) -> ShardSpec:
        from torch.distributed.tensor import DTensor

        if self.mesh is None:
            return ShardSpec(tuple(local.shape), local.numel(), self.world, self.rank)
        tp_spec = p._spec if isinstance(p, DTensor) else None
        return ShardSpec(tuple(local.shape), local.numel(), self.world, self.rank,
                         group=self.mesh["dp"].get_group().group_name, tp_spec=tp_spec,
                         mesh=self.mesh if tp_spec is not None else self.mesh["dp"])

    def _move_optimizer(self, swap: dict[int, nn.Parameter]) -> None:
        from collections import defaultdict

        for group in self.opt.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        state = defaultdict(dict)
        for p, st in self.opt.state.items():
            q = swap.get(id(p), p)
            spec = spec_of(q)
            state[q] = {k: (state_like(q, spec.shard_of(_local(v)), spec) if spec is not None and is_sharded_state(v)
                            else v)
                        for k, v in st.items()}
        self.opt.state = state

    def undo(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._saved is not None:
            modules, opt_saved = self._saved
            for m, params in modules:
                m._parameters.clear()
                m._parameters.update(params)
            if opt_saved is not None:
                groups, state = opt_saved
                for g, params in zip(self.opt.param_groups, groups):
                    g["params"] = params
                self.opt.state = state
            self._saved = None
        with torch.no_grad():
            for b, saved in reversed(self._buffers):
                b.copy_(saved)
        self._buffers.clear()

    def commit(self) -> None:
        self._saved = None
        self._buffers.clear()
        self._hooks.clear()  # the hooks stay with the sharded module

    def gather_outside_steps(self) -> None:
        """``module(x)`` outside the compiled step (evaluation, generation) runs on the full parameters, gathered
        before its forward and resharded after it, as FSDP2's hooks do (collective: every rank calls it); and
        ``module.load_state_dict`` takes full tensors for the sharded parameters (each rank keeps its piece)."""
        m = self.module
        self._hooks += [m.register_forward_pre_hook(_gather_before_forward),
                        m.register_forward_hook(_reshard_after_forward, always_call=True),
                        m._register_load_state_dict_pre_hook(_place_full_tensors, with_module=True)]


def keep_layout_through_to_empty(module: nn.Module) -> None:
    """A meta model laid out up front keeps its layout through ``module.to_empty(device=...)``, which allocates
    each rank's part only: its shard specs and its tied weights.

    ``to_empty`` swaps each DTensor parameter's contents and attributes for new ones (torch.utils.swap_tensors,
    keeping the object), so the shard spec goes: it is put back, and the flat buffer the step reads is made around
    the new local tensor.  A plain parameter (replicated under tensor parallelism) becomes a new Parameter in each
    module that holds it, so a tied weight (a GPT's head and token embedding) would become two: the first
    holder's is put in every other holder.
    """
    if "to_empty" in module.__dict__:
        return  # laid out already (parallelize, then a step's prepare)
    layout = {name: spec_of(p) for name, p in module.named_parameters()}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, name))
    # kept on the module and bound to it, so that a deepcopy of the model allocates (and re-ties) the copy
    module.__dict__[TO_EMPTY_ATTR] = (layout, [h for h in holders.values() if len(h) > 1])
    module.to_empty = types.MethodType(_to_empty_keeping_layout, module)  # this module's to_empty only


def _to_empty_keeping_layout(self: nn.Module, *, device, recurse: bool = True) -> nn.Module:
    layout, tied = self.__dict__[TO_EMPTY_ATTR]
    out = type(self).to_empty(self, device=device, recurse=recurse)
    for (first, name), *rest in tied:
        for m, n in rest:
            m._parameters[n] = first._parameters[name]
    for name, p in self.named_parameters():
        spec = layout.get(name)
        if spec is not None and spec_of(p) is None and not p.is_meta:
            setattr(p, SHARD_ATTR, spec)
            with torch.no_grad():  # the local tensor becomes a view of a new padded flat buffer
                flat = flat_of(p, spec)
            flat.requires_grad_(p.requires_grad)  # the step takes it as the parameter, as _shard_param's
    return out


def _shard_param(flat: Tensor, spec: ShardSpec, requires_grad: bool) -> nn.Parameter:
    """A sharded parameter over ``flat``: a ``Shard(0)`` DTensor parameter (a plain 1-element one for a 0-d
    parameter), marked with its spec."""
    p = nn.Parameter(as_shard(flat, spec), requires_grad=requires_grad)
    if spec.as_dtensor:
        # the step takes the flat buffer as the parameter (requiring grad as it does); nn.Parameter made a new
        # DTensor over the same local view
        p.__dict__[FLAT_ATTR] = flat.requires_grad_(requires_grad)
    setattr(p, SHARD_ATTR, spec)
    return p


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def gather_full(p: Tensor) -> Tensor:
    """The full value of a sharded parameter (or state tensor of its shape), on every rank (collective); 2-D:
    gathered over dp, the tensor-parallel DTensor the plan made (``full_tensor()`` of it is the whole)."""
    spec = spec_of(p)
    if spec is None:
        return p.detach()
    return spec.tp_local(gather_tensor(flat_of(p, spec).detach(), spec))


def gather_tensor(shard: Tensor, spec: ShardSpec) -> Tensor:
    """The full tensor from every rank's shard (a sharded DTensor, or its flat buffer) of layout ``spec`` (2-D: the
    tensor-parallel local tensor, gathered over dp)."""
    shard = flat_of(shard, spec).detach()
    out = shard.new_empty(spec.padded_numel)
    dist.all_gather_single(out, shard.contiguous(), group=data_group(spec.group))
    return spec.unshard(out)


def _whole(t: Tensor) -> Tensor:
    """A tensor-parallel DTensor's full value (collective); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    rank0_only: bool = True) -> dict:
    """Unsharded ``{"model": state_dict, "optim": state_dict}`` (collective: every rank must call it).

    With ``rank0_only`` (the default) the other ranks get ``{}``; the tensors are
    new (CPU-resident where the model is), so they outlive further training.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = not rank0_only or rank == 0
    sync_stages(module, optimizer)  # (a pipeline: each stage's values from the rank stepping them)
    full = {id(p): _whole(gather_full(p)) for p in module.parameters()}
    model_sd = {}
    for name, t in module.state_dict(keep_vars=True).items():
        value = full[id(t)] if id(t) in full else _whole(t.detach())  # (collective for a DTensor: every rank)
        model_sd[name] = value.clone() if keep else None
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
                    v = _whole(spec.tp_local(gather_tensor(flat_of(v, spec).detach(), spec)))
                elif isinstance(v, Tensor):
                    v = _whole(v)  # (tensor parallel: a DTensor's full value)
                st[k] = v.clone() if isinstance(v, Tensor) else v
            if st:
                state[i] = st
        out["optim"] = {"state": state, "param_groups": sd["param_groups"]}
    return out if keep else {}


@contextlib.contextmanager
def gathered_parameters(module: nn.Module, *, writeback: bool = False):
    """Full parameters in ``module`` inside the block (collective on entry and exit).

    Each sharded parameter is stood in for, in every module that holds it, by a plain parameter with its
    full value (tied weights stay tied).  With ``writeback=True`` each rank keeps its shard of whatever
    the block left in the full parameters (every rank must make the same change).
    """
    sharded = [p for p in module.parameters() if spec_of(p) is not None]
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for p in sharded:
            full[id(p)] = nn.Parameter(gather_full(p).clone(), requires_grad=p.requires_grad)
    swapped = []
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) in full:
                swapped.append((m, name, p))
                m._parameters[name] = full[id(p)]
    try:
        yield module
    finally:
        for m, name, p in reversed(swapped):
            m._parameters[name] = p
        if writeback:
            with torch.no_grad():
                for p in sharded:
                    spec = spec_of(p)
                    flat_of(p, spec).copy_(spec.shard_of(_local(full[id(p)])))


_GATHERED = "_spmd_ort_gathered_for_forward"


def _gather_before_forward(module: nn.Module, args) -> None:
    # a trace puts full-shape traced tensors in the module (it is not sharded then); inside a run of a compiled
    # step (an opaque part) the step's own gathers serve it
    from spmd_ort.runtime.step_runtime import in_step

    # (inside gathered_parameters the module holds full parameters, not sharded ones, already)
    if not is_sharded(module) or module.__dict__.get(_GATHERED) is not None or in_step():
        return
    block = gathered_parameters(module)
    block.__enter__()
    module.__dict__[_GATHERED] = block


def place_full(value: Tensor, like: Tensor) -> Tensor:
    """Full plain tensor ``value`` as a DTensor placed like the DTensor ``like``: each rank keeps its piece (no
    communication).  FSDP2 + TP's strided dp shard (which ``distribute_tensor`` does not take) is cut as it is
    made: the plan's piece over tp first, then this rank's rows of it over dp."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    value = value.detach().to(like.to_local().device)
    placements, mesh = tuple(like.placements), like.device_mesh
    if not any(isinstance(pl, _StridedShard) for pl in placements):
        return distribute_tensor(value, mesh, placements, src_data_rank=None)
    if not (mesh.ndim == 2 and isinstance(placements[0], _StridedShard) and mesh.mesh_dim_names):
        raise ValueError(f"cannot place a full tensor as {placements} on {mesh}: only (dp, tp) meshes with a strided "
                         "dp shard (FSDP2 + TP) are supported")
    local = distribute_tensor(value, mesh[mesh.mesh_dim_names[1]], placements[1:], src_data_rank=None).to_local()
    dim, rank = placements[0].dim, mesh.get_local_rank(0)
    chunks = torch.chunk(local, mesh.size(0), dim=dim)
    piece = chunks[rank] if rank < len(chunks) else local.narrow(dim, 0, 0)
    return DTensor.from_local(piece.contiguous(), mesh, placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _place_full_tensors(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``module.load_state_dict`` with full (plain) tensors for sharded parameters, e.g. a ``full_state_dict`` or
    an unsharded model's state dict: each rank keeps its piece (no communication), as ``Shard(0)`` DTensors."""
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(p, DTensor) and spec_of(p) is not None and isinstance(value, Tensor) \
                and not isinstance(value, DTensor) and tuple(value.shape) == tuple(p.shape):
            state_dict[key] = place_full(value, p)


def _reshard_after_forward(module: nn.Module, args, output) -> None:
    block = module.__dict__.pop(_GATHERED, None)
    if block is not None:
        block.__exit__(None, None, None)


def persistent_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds between steps: parameters, gradients, optimizer state (and buffers); of a DTensor,
    its local tensor (of a sharded one, the padded flat buffer behind it)."""
    from torch.distributed.tensor import DTensor

    def size(t: Tensor) -> int:
        t = t.__dict__.get(FLAT_ATTR, t._local_tensor if isinstance(t, DTensor) else t)
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
