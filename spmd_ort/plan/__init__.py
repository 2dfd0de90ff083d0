"""Planning a step before renting the ranks: :meth:`spmd_ort.CompiledStep.plan` compiles it for N ranks in one
process (torch's fake process group, a meta copy of the model) and prices what it holds, sends and computes
(:class:`Plan`) on a :class:`DeviceSpec`.  ``python -m spmd_ort.plan`` does it for a model named on the command
line."""

from spmd_ort.plan.device import DEVICES, Achieved, DeviceSpec, device_spec
from spmd_ort.plan.report import Plan

__all__ = ["Achieved", "DEVICES", "DeviceSpec", "Plan", "device_spec"]
