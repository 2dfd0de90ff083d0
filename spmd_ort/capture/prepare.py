"""What a call changes on the module and optimizer before it traces: one transaction, one undo.

In order:

1. submodule replacements asked for by ``Override.replacement`` (once per module);
2. ``TensorParallel``: the plan applied (parameters become DTensors, the optimizer steps them);
   ``fully_shard``: the module's parameters (and the optimizer's state) sharded on first use;
3. a fresh optimizer's state created as its first step would (:func:`prefill_optimizer_state`),
   so the first call traces the steady-state step: one variant and one export, not two.

:class:`Preparation` is a context manager: a block that raises undoes all of it, in
reverse order, and leaves the model and optimizer as the call found them (a failed
compile changes nothing); a block that ends keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from spmd_ort.capture import amp
from spmd_ort.capture.inputs import StepCall
from spmd_ort.distributed.dtensor import has_dtensor_state
from spmd_ort.distributed.sharding import ShardedModule, is_sharded, spec_of
from spmd_ort.distributed.tensor_parallel import AppliedPlan
from spmd_ort.errors import CompileError


class Swaps:
    """Submodule replacements made for Overrides (``Override.replacement``), undone if the call fails."""

    def __init__(self):
        self.done: list[tuple[nn.Module, str, nn.Module]] = []

    def apply(self, root: nn.Module, overrides: Sequence) -> None:
        def visit(prefix: str, module: nn.Module) -> None:
            for name, child in list(module.named_children()):
                fqn = f"{prefix}.{name}" if prefix else name
                new = child
                for override in overrides:
                    new = override.replacement(fqn, new)
                if new is child:
                    visit(fqn, child)
                else:
                    setattr(module, name, new)
                    self.done.append((module, name, child))

        visit("", root)

    def undo(self) -> None:
        for parent, name, orig in reversed(self.done):
            setattr(parent, name, orig)
        self.done.clear()


def shard_if_needed(call: StepCall) -> ShardedModule | None:
    """fully_shard: shard the module (once) before its key is taken; returns the undo handle."""
    module, mode = call.module, call.mode
    sharded = is_sharded(module)
    if mode is None or not mode.sharded:
        if sharded:
            raise CompileError(
                f"{type(module).__name__}'s parameters are sharded (fully_shard), but this step compiles "
                f"for {'one process' if mode is None else mode.parallel_style!r}; keep "
                "parallel_style='fully_shard' on every rank, or load a full state dict into a fresh model",
                rank=call.rank)
        return None
    tp = call.tensor_parallel  # 2-D: shards over the dp dim of each tensor-parallel local tensor
    mesh = tp.device_mesh if tp is not None else None
    rank, world = (mesh.get_local_rank("dp"), mesh.size(0)) if mesh is not None else (call.rank, call.world_size)
    if sharded:
        spec = next(spec_of(p) for p in module.parameters() if spec_of(p) is not None)
        if spec.world != world:
            raise CompileError(f"the module was sharded over {spec.world} ranks but the world is now "
                               f"{world}; save a checkpoint (spmd_ort.state_dict) and load it into a "
                               "model built for the new world", rank=call.rank)
        return None
    sharding = ShardedModule(module, call.opt, rank, world, offload_param=mode.offload_param, mesh=mesh)
    sharding.shard()
    sharding.gather_outside_steps()
    return sharding


def parallelize_if_needed(call: StepCall) -> AppliedPlan | None:
    """TensorParallel: apply the plan (once: a module whose parameters are DTensors has it); the undo handle."""
    if call.tensor_parallel is None or has_dtensor_state(call.module):
        return None
    applied = AppliedPlan(call.module, call.opt, call.tensor_parallel, call.rank)
    applied.apply()
    return applied


def prefill_optimizer_state(call: StepCall) -> list[nn.Parameter]:
    """Create a fresh optimizer's state as its first step would (where the rule says that is exact).

    Only for an optimizer with no state at all, and not with an enabled GradScaler (a first step it
    skips creates no state in eager).  Under fully_shard the module is sharded by now (step 2 above),
    so the state is made like the local shard, as the sharded first step makes it (and as
    ``ShardedModule`` shards existing state): the first call traces the steady-state step there too.
    Returns the parameters given state.
    """
    opt, rule = call.opt, call.rule
    if opt is None or rule is None or rule.initial_state is None or opt.state or amp.scaler_enabled(call.scaler):
        return []
    filled = []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad and p not in opt.state:
                opt.state[p].update(rule.initial_state(group, p))
                filled.append(p)
    return filled


class Preparation:
    """One call's changes to the module and optimizer before tracing (see the module docstring).

    ``overrides``: the Overrides whose replacements to apply (empty when this module had
    them applied by an earlier call); ``prefill``: whether to create a fresh optimizer's state.
    """

    def __init__(self, call: StepCall, *, overrides: Sequence = (), prefill: bool = True):
        self.call = call
        self.overrides = tuple(overrides)
        self.prefill = prefill
        self.swaps = Swaps()
        self.sharding: ShardedModule | None = None
        self.plan: AppliedPlan | None = None
        self.prefilled: list[nn.Parameter] = []

    def __enter__(self) -> Preparation:
        try:
            if self.overrides:
                self.swaps.apply(self.call.module, self.overrides)
            if amp.scaler_enabled(self.call.scaler):
                amp.check_scaler(self.call.scaler)
            self.plan = parallelize_if_needed(self.call)
            self.sharding = shard_if_needed(self.call)
            if self.prefill:
                self.prefilled = prefill_optimizer_state(self.call)
        except BaseException:
            self.undo()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.undo()
        else:
            if self.sharding is not None:
                self.sharding.commit()
            if self.plan is not None:
                self.plan.commit()

    def undo_prefill(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """Drop the prefilled optimizer state (a parameter got no gradient: eager would create none for it);
        of ``params`` only, when given (those the first step skipped, having no gradient on that step)."""
        dropped = self.prefilled if params is None else [p for p in self.prefilled if any(p is q for q in params)]
        for p in dropped:
            self.call.opt.state.pop(p, None)
        self.prefilled = [p for p in self.prefilled if not any(p is q for q in dropped)]

    def undo(self) -> None:
        self.undo_prefill()
        if self.sharding is not None:
            self.sharding.undo()
            self.sharding = None
        if self.plan is not None:
            self.plan.undo()
            self.plan = None
        self.swaps.undo()

    @property
    def swapped(self) -> bool:
        return bool(self.swaps.done)
