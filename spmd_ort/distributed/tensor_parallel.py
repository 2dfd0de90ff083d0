"""``TensorParallel``: torch's tensor-parallel plans, applied by the compiled step.

``spmd_ort.compile(parallel_mode=spmd_ort.TensorParallel(plan))`` applies ``plan`` (module FQNs, globs allowed,
mapped to torch's ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``, ...)
with torch's own ``parallelize_module`` at the first call, as ``fully_shard`` shards at the first call: the
parameters become DTensors on ``mesh`` (default: 1-D over the world), the optimizer is given them in place of
the parameters it held, and the step compiles in expand mode (:mod:`spmd_ort.distributed.dtensor`).  A first
call whose compile fails undoes all of it: the module and optimizer are as they were.

A model parallelized by the user (``parallelize_module`` before the first call) needs no mode at all:
``parallel_mode=None`` compiles a module with DTensor parameters in expand mode.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmd_ort.errors import CompileError

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


@dataclass(frozen=True)
class TensorParallel:
    """Tensor parallelism from a plan of torch's parallel styles.

    ``plan``: ``{fqn or glob: ParallelStyle}`` as ``torch.distributed.tensor.parallel.parallelize_module`` takes
    it (``"blocks.*.mlp.fc"``); every key must name at least one submodule.  ``mesh``: a 1-D
    ``DeviceMesh`` (default: every rank, on the parameters' device type).  The ranks of a tensor-parallel group
    compute one model and pass the same batch, as in eager tensor parallelism.

    2-D: ``mesh=init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`` and
    ``data_parallel=DataParallel(parallel_style="replicate", ...)``: the plan shards over ``tp``, and gradients
    are averaged over ``dp`` (each dp replica passes its own batch) by the data-parallel passes, on the dp
    group.  ``bucket_cap_mb="auto"`` keeps its 25 MiB starting cap there.
    """

    plan: Mapping[str, Any]
    mesh: Any = None
    data_parallel: Any = None

    def __post_init__(self):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import ParallelStyle

        from spmd_ort.distributed.parallel import DataParallel

        if not isinstance(self.plan, Mapping) or not self.plan:
            raise TypeError(f"TensorParallel(plan={self.plan!r}): give a non-empty dict of module FQN (or glob) -> "
                            "torch.distributed.tensor.parallel style")
        for fqn, style in self.plan.items():
            if not isinstance(fqn, str) or not isinstance(style, ParallelStyle):
                raise TypeError(f"TensorParallel plan entry {fqn!r}: {style!r} is not a torch.distributed.tensor."
                                "parallel.ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...)")
        if self.data_parallel is None:
            if self.mesh is not None and (not isinstance(self.mesh, DeviceMesh) or self.mesh.ndim != 1):
                raise TypeError(f"TensorParallel(mesh={self.mesh!r}): give a 1-D DeviceMesh (or None: every rank), "
                                "or a 2-D one named ('dp', 'tp') with data_parallel=DataParallel(...)")
            return
        if not isinstance(self.data_parallel, DataParallel):
            raise TypeError(f"TensorParallel(data_parallel={self.data_parallel!r}): give a spmd_ort.DataParallel")
        if self.data_parallel.sharded:
            raise TypeError("TensorParallel(data_parallel=DataParallel(parallel_style='fully_shard')): 2-D with "
                            "fully_shard is not supported; use parallel_style='replicate' on the dp dim")
        if self.data_parallel.mixed_precision is not None:
            raise TypeError("TensorParallel(data_parallel=DataParallel(mixed_precision=...)): mixed precision is not "
                            "supported with tensor parallelism")
        if not (isinstance(self.mesh, DeviceMesh) and self.mesh.ndim == 2
                and tuple(self.mesh.mesh_dim_names or ()) == ("dp", "tp")):
            raise TypeError(f"TensorParallel(mesh={self.mesh!r}, data_parallel=...): give a 2-D DeviceMesh with "
                            "mesh_dim_names=('dp', 'tp'), e.g. init_device_mesh('cpu', (dp, tp), "
                            "mesh_dim_names=('dp', 'tp'))")

    @property
    def tp_mesh(self):
        """The mesh the plan shards over: ``mesh`` (1-D), or its ``tp`` dim (2-D)."""
        return self.mesh["tp"] if self.data_parallel is not None else self.mesh

    def dp_group(self):
        """2-D: the process group of this rank's data-parallel replicas (the ``dp`` dim); None on a 1-D mesh."""
        return self.mesh["dp"].get_group() if self.data_parallel is not None else None

    def data_parallel_mode(self):
        """2-D: the data-parallel mode on the ``dp`` dim, with a fixed bucket cap in place of ``"auto"`` (its
        measurements time collectives over every rank, not over one dp group); None on a 1-D mesh."""
        import dataclasses

        from spmd_ort.distributed.parallel import AUTO_START_MB

        dp = self.data_parallel
        if dp is None or not dp.auto_buckets:
            return dp
        return dataclasses.replace(dp, bucket_cap_mb=AUTO_START_MB)

    def mesh_for(self, module: nn.Module):
        """The mesh to apply the plan on: the given one, else 1-D over the world on the module's device type."""
        if self.mesh is not None:
            return self.tp_mesh
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        device = next((p.device.type for p in module.parameters()), "cpu")
        return init_device_mesh(device, (dist.get_world_size(),))

    def resolve_plan(self, module: nn.Module, rank: int) -> dict[str, Any]:
        """The plan with each key checked against the module: a key that names no submodule is an error."""
        names = [n for n, _ in module.named_modules() if n]
        for key in self.plan:
            if not any(fnmatch.fnmatchcase(n, key) for n in names):
                close = [n for n in names if n.split(".")[-1] == key.split(".")[-1]][:3]
                hint = f" (submodules with that name: {', '.join(close)})" if close else ""
                raise CompileError(f"TensorParallel plan key `{key}` names no submodule of "
                                   f"{type(module).__name__}{hint}; keys are module FQNs, `*` matching one "
                                   "level", fqn=key, rank=rank)
        return dict(self.plan)


class AppliedPlan:
    """A plan applied to a module (and its optimizer) in place, undoable until committed."""

    def __init__(self, module: nn.Module, opt: torch.optim.Optimizer | None, mode: TensorParallel, rank: int):
        self.module, self.opt, self.mode, self.rank = module, opt, mode, rank
        self._saved: list | None = None

    def apply(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = self.mode.resolve_plan(self.module, self.rank)
        modules = list(self.module.modules())
        self._saved = [(m, dict(m._parameters), {k: dict(getattr(m, k)) for k in _HOOK_DICTS if hasattr(m, k)},
                        set(m.__dict__)) for m in modules]
        old = dict(self.module.named_parameters(remove_duplicate=False))
        opt_saved = None
        if self.opt is not None:
            opt_saved = ([list(g["params"]) for g in self.opt.param_groups], self.opt.state)
        self._opt_saved = opt_saved
        try:
            parallelize_module(self.module, self.mode.mesh_for(self.module), plan)
            new = dict(self.module.named_parameters(remove_duplicate=False))
            if self.opt is not None:
                self._move_optimizer(old, new)
        except Exception:
            self.undo()
            raise

    def _move_optimizer(self, old: dict, new: dict) -> None:
        """The optimizer steps the new (DTensor) parameters; existing state is distributed like its parameter."""
        from collections import defaultdict

        from torch.distributed.tensor import DTensor, distribute_tensor

        swap = {id(p): new[name] for name, p in old.items()}
        for group in self.opt.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        state = defaultdict(dict)
        for p, st in self.opt.state.items():
            q = swap.get(id(p), p)
            moved = {}
            for k, v in st.items():
                if isinstance(q, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                    v = distribute_tensor(v.detach(), q.device_mesh, q.placements)
                moved[k] = v
            state[q] = moved
        self.opt.state = state

    def undo(self) -> None:
        if self._saved is None:
            return
        for m, params, hooks, attrs in self._saved:
            m._parameters.clear()
            m._parameters.update(params)
            for k, d in hooks.items():
                getattr(m, k).clear()
                getattr(m, k).update(d)
            for k in set(m.__dict__) - attrs:  # marks parallelize_module leaves (`_distribute_module_applied`)
                delattr(m, k)
        if self._opt_saved is not None:
            groups, state = self._opt_saved
            for g, params in zip(self.opt.param_groups, groups):
                g["params"] = params
            self.opt.state = state
        self._saved = None

    def commit(self) -> None:
        self._saved = None
