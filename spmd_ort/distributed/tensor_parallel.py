"""Applying a ``TensorParallel`` plan (:class:`spmd_ort.distributed.parallel.TensorParallel`) to a module.

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

import torch
from torch import nn

from spmd_ort.distributed.parallel import TensorParallel

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


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


def replicate_with_grad_all_reduce():
    """transformers' ``"replicated_with_grad_allreduce"`` as a torch ``ParallelStyle``: the module's parameters are
    replicated over the mesh, and each forward reads them as local tensors whose gradient is this rank's part of
    the whole, summed over the group. For a module applied to one rank's slice of a split activation as plain
    local tensors (Qwen 3's per-head ``q_norm`` after a column-wise ``q_proj``): a plain parameter's gradient
    there would be this rank's heads' alone."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicateWithGradAllReduce(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Replicate()]),
                                                             requires_grad=p.requires_grad))

            def local_params(mod, args):
                held = {name: p for name, p in mod._parameters.items() if isinstance(p, DTensor)}
                for name, p in held.items():
                    mod._parameters[name] = p.to_local(grad_placements=[Partial()])
                mod.__dict__["_spmd_ort_held_params"] = held

            def restore(mod, args, out):
                mod._parameters.update(mod.__dict__.pop("_spmd_ort_held_params", {}))

            module.register_forward_pre_hook(local_params)
            module.register_forward_hook(restore)
            return module

        def __repr__(self):
            return "ReplicateWithGradAllReduce()"

    return ReplicateWithGradAllReduce()
