"""Which nodes share storage with their input: the one view predicate every liveness walk, cost model, pass and
partition reads.

An op's schema says whether its result aliases its first input (``Tensor(a)``: a view; ``Tensor(a!)``: an in-place
result, which writes it).  Two refinements a caller chooses:

* ``writes``: count in-place results too (liveness: the result is the input's storage; the partition: no compute
  to place);
* ``runtime_views``: count ops that alias at run time although their schema does not say so
  (:data:`RUNTIME_VIEWS`: ``_unsafe_view``).

An element taken out of a multi-output op's results (``getitem``) aliases what its source aliases; an element of
a non-op (an input list) aliases it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

# ops whose output shares its input's storage at run time although their schema does not say so
RUNTIME_VIEWS = (torch.ops.aten._unsafe_view.default,)


def is_view_op(target, *, writes: bool = False) -> bool:
    """Whether an op's result aliases its first input by its schema: a view (a non-writing alias), or with
    ``writes`` an in-place result too.  A target without a schema (a Python callable) is none."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and (writes or not alias.is_write)


def aliases_input(node: fx.Node, *, writes: bool = False, runtime_views: bool = True) -> bool:
    """Whether ``node``'s output shares its first input's storage (see the module)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return src.op != "call_function" or aliases_input(src, writes=writes, runtime_views=runtime_views)
    return (runtime_views and node.target in RUNTIME_VIEWS) or is_view_op(node.target, writes=writes)
