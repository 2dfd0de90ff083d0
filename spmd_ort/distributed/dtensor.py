"""DTensor state in the compiled step: expand mode.

A module whose parameters are DTensors (torch's ``parallelize_module``,
:class:`spmd_ort.TensorParallel`) is compiled as it trains eagerly: the step is
traced with DTensor parameters, so torch's own DTensor dispatch and sharding
propagation expand every op into local ops and the collectives its
redistributions need (``_c10d_functional`` ops), and the graph is one over
local tensors.

The graph's state inputs and outputs are the *local* tensors: :func:`local`
unwraps a DTensor where the layout gathers state, and :func:`wrap` puts the
traced local back into a DTensor of the same spec (mesh, placements, global
shape) where the module, the optimizer and the user's code look for it while
tracing.  After each run the new locals are stored into the DTensors' local
tensors, so ``model.state_dict()``, ``p.full_tensor()`` and DCP see DTensors as
in eager.

The ``spmd_ort::`` ops the trace inserts get their sharding rule here
(:func:`register_sharding_rules`): marks and layout pins keep their input's
placement; the optimizer updates run on local tensors (elementwise, every
per-parameter tensor shares the parameter's placement).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local(t):
    """``t``'s local tensor when it is a DTensor, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def spec_of(t):
    """``t``'s DTensorSpec (mesh, placements, global shape and stride), or None for a plain tensor."""
    return t._spec if isinstance(t, DTensor) else None


def wrap(t: Tensor, spec, *, requires_grad: bool = False) -> DTensor:
    """A DTensor of ``spec`` whose local tensor is ``t`` (no copy, no communication)."""
    return DTensor(t, spec, requires_grad=requires_grad)


@dataclass(frozen=True)
class LocalOf:
    """A leaf of the step's return value that is a DTensor: the graph returns its local tensor, and the
    call returns it wrapped in ``spec`` again."""

    spec: object


def has_dtensor_state(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is a DTensor (the step compiles in expand mode); the
    ``Shard(0)`` DTensors of ``fully_shard`` (:mod:`spmd_ort.distributed.sharding`) do not count: that mode
    computes on their flat shard buffers (2-D ones do: their tensor-parallel placements expand the step)."""
    from spmd_ort.distributed.sharding import spec_of

    def expands(t) -> bool:
        spec = spec_of(t)
        return isinstance(t, DTensor) and (spec is None or spec.tp_spec is not None)

    return any(expands(t) for t in list(module.parameters()) + list(module.buffers()))


def to_spec(t, spec):
    """Traced DTensor ``t`` redistributed to ``spec``'s placements (a collective where they differ)."""
    if not isinstance(t, DTensor) or spec is None or tuple(t.placements) == tuple(spec.placements):
        return t
    return t.redistribute(spec.mesh, spec.placements)


def _identity_sharding(x, *rest, partial: bool = True):
    """Output placed as the input, whatever that is (the op is elementwise and reads no neighbour)."""
    options = [Replicate()] + [Shard(d) for d in range(x.ndim)] + ([Partial()] if partial else [])
    return [([p], [p] + [None] * len(rest)) for p in options]


@contextlib.contextmanager
def mixed_grad_clipping():
    """While tracing: ``clip_grad_norm_`` over DTensor and plain gradients completes the norm across both.

    Eager torch raises there (``_foreach_norm`` got mixed torch.Tensor and DTensor). The plain parameters of a
    tensor-parallel model (norms, embeddings outside the plan) are replicated over the mesh: torch's
    ``implicit_replication`` treats them so inside torch's own norm and scaling functions, which sums each
    sharded gradient's squares over its shards and each replicated one once.
    """
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.utils import clip_grad

    names = ("_get_total_norm", "_clip_grads_with_norm_")
    saved = {n: getattr(clip_grad, n) for n in names if hasattr(clip_grad, n)}

    def replicated(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            # the total norm as a plain tensor (replicated: every rank holds it whole), which scales plain and
            # DTensor gradients alike, whichever loop torch takes
            args = tuple(a.full_tensor() if isinstance(a, DTensor) else a for a in args)
            with implicit_replication():
                return fn(*args, **kwargs)
        return run

    for n, fn in saved.items():
        setattr(clip_grad, n, replicated(fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(clip_grad, n, fn)


@functools.cache  # DTensor's table of sharding rules is torch's, per process: registered once
def register_sharding_rules() -> None:
    """Sharding rules of the ``spmd_ort::`` ops DTensor dispatch may meet while tracing (once per process)."""
    from torch.distributed.tensor.experimental import register_sharding

    from spmd_ort.graph import ops

    # marks (identity): any placement, kept; a partial gradient stays partial until its reduction
    register_sharding([ops.tag_grad, ops.tap])(_identity_sharding)
    # random fills and layout pins read only the shape: a pending sum (Partial) has no values to draw over
    register_sharding([ops.bernoulli_like, ops.with_layout])(
        lambda x, *rest: _identity_sharding(x, *rest, partial=False))
