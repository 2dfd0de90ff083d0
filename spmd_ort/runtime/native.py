"""The native host optimizer kernels of ``csrc/fused_optim.cpp``, built on first use.

:func:`adam_` and :func:`sgd_` update fp32 or bf16 parameters and fp32 state in
place, over a whole param group at once.  The extension is compiled with
``torch.utils.cpp_extension`` (OpenMP, ``-O3 -march=native``) the first time
it is needed and cached in ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), so later processes load it in well under a
second.  Without a working C++ compiler the same updates run with torch's own
fused CPU kernels (the results are the same for fp32), after one warning.
``use_native=False`` (a compiled step passes its ``Options.native``, set by
``SPMD_ORT_NATIVE``) forces that fallback.

Whether the library is loaded is a fact about the process (a shared library
loads once), so it is remembered here, once.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor
from spmd_ort.options import get_logger

logger = get_logger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "fused_optim.cpp"
_lock = threading.Lock()
_loaded: dict = {}  # "ok": whether this process has the extension (built or loaded once)


def load() -> bool:
    """Build or load the extension once per process; False (after one warning) if it cannot be built."""
    with _lock:
        if "ok" in _loaded:
            return _loaded["ok"]
        try:
            from torch.utils.cpp_extension import load as build

            if not SOURCE.exists():
                raise FileNotFoundError(f"{SOURCE} is missing (install spmd_ort from a source checkout)")
            build(name="spmd_ort_native", sources=[str(SOURCE)], is_python_module=False, verbose=False,
                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"],
                  extra_ldflags=["-fopenmp"])
            _loaded["ok"] = True
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
            warnings.warn(f"spmd_ort: the native optimizer kernel (csrc/fused_optim.cpp) could not be built "
                          f"({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
                          "host optimizer steps use torch's fused CPU kernels instead", RuntimeWarning, stacklevel=2)
            _loaded["ok"] = False
        return _loaded["ok"]


def adam_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
          max_exp_avg_sqs: list[Tensor], steps: list[Tensor], *, lr: float, beta1: float, beta2: float,
          weight_decay: float, eps: float, amsgrad: bool, maximize: bool, decoupled: bool,
          use_native: bool = True) -> None:
    """One Adam/AdamW update in place (``steps`` already incremented), on CPU tensors."""
    if use_native and params and _native_ok(params, grads):
        torch.ops.spmd_ort_native.adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [],
                                        steps, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled)
        return
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps, lr=lr, beta1=beta1,
           beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize)


def sgd_(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], *, lr: float, momentum: float,
         dampening: float, weight_decay: float, nesterov: bool, maximize: bool, is_first_step: bool,
         use_native: bool = True) -> None:
    """One SGD update in place, on CPU tensors."""
    if use_native and params and _native_ok(params, grads):
        torch.ops.spmd_ort_native.sgd_(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay,
                                       nesterov, maximize, is_first_step)
        return
    torch._fused_sgd_(params, grads, momentum_buffers, weight_decay=weight_decay, momentum=momentum, lr=lr,
                      dampening=dampening, nesterov=nesterov, maximize=maximize, is_first_step=is_first_step)


def _native_ok(params: list[Tensor], grads: list[Tensor]) -> bool:
    if not load():
        return False
    return all(t.device.type == "cpu" and t.is_contiguous() for t in (*params, *grads))
