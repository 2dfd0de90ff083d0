"""Tools to see what the compiler did: activation statistics and a divergence finder.

* :class:`GlobalSubscriberManager`, :class:`StatisticsSubscriber`, :func:`inspect_activation`
  (ORTModule's names): per-step statistics of module outputs and marked tensors, on an eager
  model and on one trained by a compiled step.
* ``python -m spmd_ort.debug.merge_activation_summary --pt_dir A --ort_dir B --output_dir C``:
  per-step side-by-side files.
* ``python -m spmd_ort.debug.compare A B [--rtol R]``: the first divergence, in execution order.
"""

from .statistics import GlobalSubscriberManager, StatisticsSubscriber, inspect_activation
from .summary import Divergence, first_divergence, load_run

__all__ = ["Divergence", "GlobalSubscriberManager", "StatisticsSubscriber", "first_divergence", "inspect_activation",
           "load_run"]
