"""Gradients that exist on some steps only: parameters that only an opaque part uses.

Eager leaves ``p.grad`` None when backward does not reach ``p`` (an MoE expert that got
no tokens), and the optimizer then skips ``p``: value, ``.grad`` and state stay as they
were.  A traced graph has a gradient for every parameter whose use it recorded; when
that gradient comes only from opaque backwards, whether eager would have one is known
only when the opaque part runs.  So:

* each ``opaque_backward`` also returns, per gradient, whether its own autograd produced
  it (:mod:`spmd_ort.runtime.opaque_calls`);
* while the step is traced, :class:`GradPresence` watches every parameter's gradient
  arrive: one whose whole value is opaque outputs (summed, cast), on a parameter that had
  no ``.grad`` yet, and which is still the parameter's ``.grad`` when the optimizer steps,
  exists exactly when one of those outputs does;
* at ``optimizer.step()`` those parameters' flags become one vector
  (``spmd_ort::grads_present``): the optimizer ops skip a parameter whose entry is 0, as the
  GradScaler's ``found_inf`` skips a whole update, and the step's write-back leaves its
  ``.grad`` None and creates no state for it (:meth:`StateLayout.write_back`).

On several ranks ``reduce_grad_presence_pass`` sums the vector over the ranks, so a
parameter some rank's part used is updated everywhere with the averaged gradient, and one
no rank used is skipped everywhere: DDP's ``find_unused_parameters=True``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from spmd_ort.graph import ops
from spmd_ort.options import get_logger

aten = torch.ops.aten
logger = get_logger(__name__)

# The optimizer's dict entry, while a traced step() runs, holding (presence vector, {id(param): position}).
PRESENT_KEY = "__spmd_ort_present__"

# Ops through which a gradient is still "the opaque outputs": autograd's sum of several contributions and
# the casts and aliases between an opaque part's input and the parameter (a MixedPrecisionPolicy's cast).
_THROUGH = {aten.add.Tensor: (0, 1), aten.add_.Tensor: (0, 1), aten._to_copy.default: (0,),
            aten.detach.default: (0,), aten.alias.default: (0,)}


@dataclass
class _Arrival:
    """How one parameter's gradient arrived in this trace."""

    fresh: bool  # the parameter had no .grad when backward reached it
    sources: list[tuple[int, int]] | None  # (opaque output vector, position) making up the whole gradient
    grad: Tensor | None = None  # the .grad right after accumulation
    count: int = 1  # backward passes that reached it


@dataclass
class GradPresence:
    """Trace-time bookkeeping of which parameters' gradients exist only when an opaque part produces them."""

    vectors: list[Tensor] = field(default_factory=list)  # each opaque_backward's presence output (traced)
    outputs: dict[fx.Node, tuple[int, int]] = field(default_factory=dict)  # gradient node -> (vector, position)
    arrivals: dict[int, _Arrival] = field(default_factory=dict)  # id(traced param) -> arrival
    names: list[str] = field(default_factory=list)  # parameter FQNs, in layout order (for the warning)
    present: Tensor | None = None  # the last step()'s vector
    params: tuple[int, ...] = ()  # layout indices of its entries
    # WARNINGs the step already gave (its compiler's set, kept across variants: each is given once per step)
    warned: set = field(default_factory=set)

    # -------------------------------------------------------------- recording
    def produced(self, grads: list[Tensor], present: Tensor) -> None:
        """An opaque backward's gradients and its vector saying which of them its autograd produced."""
        mode = get_proxy_mode()
        if mode is None:  # not under the step's trace: nothing of it reaches the traced optimizer
            return
        self.vectors.append(present)
        for k, g in enumerate(grads):
            slot = get_proxy_slot(g, mode.tracer, None)
            if slot is not None:
                self.outputs[slot.proxy.node] = (len(self.vectors) - 1, k)

    def watch(self, param: Tensor) -> None:
        """Follow ``param``'s gradient (a traced leaf): where it comes from, and what ``.grad`` holds after."""

        def arrived(grad: Tensor) -> None:
            seen = self.arrivals.get(id(param))
            if seen is not None:  # a second backward: the gradient exists whatever the parts did
                seen.count += 1
                return
            self.arrivals[id(param)] = _Arrival(fresh=param.grad is None, sources=self._sources(grad))

        def accumulated(p: Tensor) -> None:
            self.arrivals[id(param)].grad = p.grad

        param.register_hook(arrived)
        param.register_post_accumulate_grad_hook(accumulated)

    def _sources(self, grad: Tensor) -> list[tuple[int, int]] | None:
        """The opaque outputs whose sum (or cast) is ``grad``; None when anything else contributes to it."""
        mode = get_proxy_mode()
        slot = get_proxy_slot(grad, mode.tracer, None) if mode is not None else None
        if slot is None:
            return None
        found, stack = [], [slot.proxy.node]
        while stack:
            node = stack.pop()
            if node in self.outputs:
                found.append(self.outputs[node])
            elif node.op == "call_function" and node.target in _THROUGH:
                stack += [node.args[i] for i in _THROUGH[node.target]]
            else:
                return None
        return found

    # -------------------------------------------------------------- at optimizer.step()
    def at_step(self, params: list[Tensor]) -> tuple[Tensor, dict[int, int]] | None:
        """The presence vector of the parameters (traced, in layout order) whose gradient may not exist, and
        each one's position in it; None when every gradient the optimizer reads always exists."""
        maybe, lost = [], []
        for i, p in enumerate(params):
            seen = self.arrivals.get(id(p))
            if p.grad is None or seen is None or not seen.fresh or not seen.sources:
                continue  # no gradient, or one that always exists
            if seen.count == 1 and p.grad is seen.grad:
                maybe.append((i, p, seen.sources))
            else:  # a second backward, or a .grad the step replaced: no longer the opaque outputs alone
                lost.append(self.names[i] if i < len(self.names) else f"parameter {i}")
        if lost and ("replaced_grads", tuple(lost)) not in self.warned:
            self.warned.add(("replaced_grads", tuple(lost)))
            logger.warning(
                "%s get gradients only from opaque parts, but the step runs backward again or replaces their .grad "
                "before the optimizer: they are updated on every step, also on one where no part used them (eager "
                "skips them there, their .grad being None)", ", ".join(lost))
        if not maybe:
            return None
        which, element, slot = [], [], []
        for k, (_, _, sources) in enumerate(maybe):
            for v, e in sources:
                which.append(v)
                element.append(e)
                slot.append(k)
        self.present = ops.grads_present(self.vectors, which, element, slot, len(maybe))
        self.params = tuple(i for i, _, _ in maybe)
        return self.present, {id(p): k for k, (_, p, _) in enumerate(maybe)}


_CURRENT: contextvars.ContextVar[GradPresence | None] = contextvars.ContextVar("spmd_ort_grad_presence",
                                                                               default=None)


@contextlib.contextmanager
def tracking(presence: GradPresence) -> Iterator[GradPresence]:
    """Make ``presence`` the one opaque backwards report to while a step is traced."""
    token = _CURRENT.set(presence)
    try:
        yield presence
    finally:
        _CURRENT.reset(token)


def current() -> GradPresence | None:
    return _CURRENT.get()


def positions(opt: torch.optim.Optimizer, params: list[Tensor]) -> tuple[Tensor | None, list[int]]:
    """For a rule: the step's presence vector and each of ``params``' position in it (-1: always present);
    ``(None, [])`` when none of them may lack a gradient, so the graph stays as it always was."""
    present, where = opt.__dict__.get(PRESENT_KEY, (None, {}))
    index = [where.get(id(p), -1) for p in params]
    if present is None or all(k < 0 for k in index):
        return None, []
    return present, index
