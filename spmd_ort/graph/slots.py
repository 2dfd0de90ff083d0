"""The graph's inputs and outputs: what each one is (:class:`SlotKind`) and where it belongs (:class:`Slot`).

Every layer names graph inputs and outputs this way: capture lays them out (``spmd_ort.capture.state``), passes
rewrite them, executors and the program gather and write them back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SlotKind(enum.Enum):
    """What a graph input or output is (the state it belongs to, or the call's own values)."""

    PARAM = "param"
    BUFFER = "buffer"
    GRAD = "grad"
    OPT_STATE = "opt_state"
    HPARAM = "hparam"  # a param group's scalar hyper-parameters, one float64 input
    SCALER = "scaler"  # a GradScaler's scale and growth tracker
    EXTRA = "extra"  # state added by an Override transform
    BATCH = "batch"  # a tensor leaf of the user's arguments (or a Python number lifted to an input)
    INPUT_GRAD = "input_grad"  # the .grad of an argument that requires grad
    USER = "user"  # a leaf of the step's return value (output only)
    STATS = "stats"  # the statistics of a tapped activation (output only; index: the tap id)
    # which parameters (StateLayout.present_params) have a gradient this step (output only; spmd_ort.capture.presence)
    PRESENCE = "presence"

    def __str__(self) -> str:
        return self.value

    @property
    def is_state(self) -> bool:
        """State of the module, optimizer or scaler (the ``flat_state`` of Override transforms), not the call's."""
        return self in _STATE

    @property
    def per_parameter(self) -> bool:
        """Indexed by parameter: what ``fully_shard`` splits into shards (optimizer state: its non-scalar part)."""
        return self in _PER_PARAMETER


_STATE = frozenset({SlotKind.PARAM, SlotKind.BUFFER, SlotKind.GRAD, SlotKind.OPT_STATE, SlotKind.HPARAM,
                    SlotKind.SCALER, SlotKind.EXTRA})
_PER_PARAMETER = frozenset({SlotKind.PARAM, SlotKind.GRAD, SlotKind.OPT_STATE})


@dataclass(frozen=True)
class Slot:
    """One graph input or output and the state it belongs to.

    ``kind``: a :class:`SlotKind`.  ``index`` points into the layout's list for that kind; ``key`` is the
    optimizer-state key, hyper-parameter name or scaler tensor (``scale``, ``growth_tracker``).
    """

    kind: SlotKind
    name: str
    index: int
    key: str | None = None
