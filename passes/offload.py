"""CPU offload under ``fully_shard``: the optimizer update and the parameter shards in host memory."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from spmd_ort.graph.ops import HOST_TWINS, all_gather

from .context import PassResult
from .contracts import GATHERS_ON_COMPUTE_DEVICE, NO_DEVICE_OPTIMIZER_OPS, PARAMS_GATHERED_BEFORE_USE
from .helpers import aten, call, calls, compute_device, fake_mode_of, refake, val
from .runner import graph_pass


@dataclass(frozen=True)
class OptimizerOffload(PassResult):
    """``offload_optimizer_pass``: optimizer ops moved to the host (their host twins)."""

    ops: int

    def lines(self) -> list[str]:
        return [f"optimizer offloaded to the host: {self.ops} op(s) run as host twins (native kernel)"]


@dataclass(frozen=True)
class ParamOffload(PassResult):
    """``offload_params_pass``: where the step computes, and how many shard copies to it were inserted."""

    device: str
    copies: int

    def lines(self) -> list[str]:
        return [f"parameter shards in host memory: {self.copies} copie(s) to {self.device} before their gathers"]


@graph_pass(provides=[NO_DEVICE_OPTIMIZER_OPS])
def offload_optimizer_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``offload_optimizer="cpu"``: every optimizer op becomes its host twin.

    The host twin (``spmd_ort::host_adam`` / ``host_sgd``) runs the native fused
    kernel of ``csrc/`` on host tensors, copying device gradients in and new
    parameters out; optimizer state stays in host memory.
    """
    count = 0
    for node in calls(gm, *HOST_TWINS):
        node.target = HOST_TWINS[node.target]
        count += 1
    ctx.results.record(OptimizerOffload(ops=count))
    return gm


@graph_pass(requires=[PARAMS_GATHERED_BEFORE_USE], provides=[GATHERS_ON_COMPUTE_DEVICE])
def offload_params_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """``offload_param="cpu"``: parameter shards live in host memory; each is copied to the device before its gather.

    The compute device is the device of the batch inputs.  When it is the
    host (a CPU-only run) the shards already are where the gathers read them
    and nothing is inserted.
    """
    device = compute_device(gm, ctx.input_slots)
    moved = 0
    for node in calls(gm, all_gather):
        src = node.args[0]
        if val(src).device == device:
            continue
        with gm.graph.inserting_before(node):
            copy = call(gm.graph, aten._to_copy.default, (src,), val(src).to("meta"))
            copy.kwargs = {"device": device, "non_blocking": True}
            refake(copy, fake_mode_of(gm))
        node.replace_input_with(src, copy)
        moved += 1
    ctx.results.record(ParamOffload(device=str(device), copies=moved))
    return gm
