"""Where should the optimizer update run?  AdamW over one flat fp32 buffer, measured side by side.

Run:  .venv/bin/python bench/optim.py [--numel 5300000] [--reps 20]

Rows: the native kernel of ``csrc/fused_optim.cpp`` (``spmd_ort.runtime.native``, what
``offload_optimizer="cpu"`` runs), torch fused AdamW in place (what the compiled
step runs as a device node, ``spmd_ort::adam_``), torch foreach AdamW, DeepSpeed's
``DeepSpeedCPUAdam`` (when deepspeed is installed: ``pip install deepspeed``;
``DS_ACCELERATOR=cpu`` is set here; its op compiles on first use, minutes), the
same update exported as elementwise ONNX and run by ONNX Runtime with IO
binding, and the memory floor:
AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
exp_avg_sq (28 bytes per element) at this machine's measured bandwidth (best of a copy and a parallel add).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch


def timed(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


class AdamWStep(torch.nn.Module):
    """The AdamW update written out elementwise (what an exporter would emit per parameter)."""

    def forward(self, p, g, m, v, lr, bc1, bc2_sqrt):
        beta1, beta2, wd, eps = 0.9, 0.999, 0.1, 1e-8
        p = p * (1 - lr * wd)
        m = m * beta1 + g * (1 - beta1)
        v = v * beta2 + g * g * (1 - beta2)
        p = p - (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)
        return p, m, v


def onnx_runner(n: int, threads: int):
    tensors = [torch.randn(n) for _ in range(4)] + [torch.tensor(1e-3), torch.tensor(0.1), torch.tensor(0.03)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(AdamWStep(), tuple(tensors), dynamo=True, verbose=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(program.model_proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    outputs = [torch.empty(n) for _ in range(3)]
    for i, t in zip(session.get_inputs(), tensors):
        binding.bind_input(i.name, "cpu", 0, np.float32, tuple(t.shape), t.data_ptr())
    for o, t in zip(session.get_outputs(), outputs):
        binding.bind_output(o.name, "cpu", 0, np.float32, tuple(t.shape), t.data_ptr())
    ops = len(program.model_proto.graph.node)

    def run():  # the bound tensors must outlive the binding: the closure keeps them
        session.run_with_iobinding(binding)
        return tensors, outputs

    return run, ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=5_300_000, help="parameters (gpt-mini has 5.29 M)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    n = args.numel
    # Bandwidth on buffers of the optimizer's own size (best of a copy and a parallel add,
    # bytes read + written per second): with a 260 MB L3 here, gpt-mini's whole optimizer
    # state is cache-resident in a real step too, so DRAM bandwidth would be the wrong floor.
    a, b, c = (torch.randn(n) for _ in range(3))
    copy_ms = timed(lambda: c.copy_(a), args.reps)
    add_ms = timed(lambda: torch.add(a, b, out=c), args.reps)
    bandwidth = max(2 * a.numel() * 4 / (copy_ms / 1e3), 3 * a.numel() * 4 / (add_ms / 1e3))

    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    step = torch.tensor(10.0)
    fused = timed(lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                                               weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False), args.reps)
    params = [torch.nn.Parameter(torch.randn(n))]
    params[0].grad = torch.randn(n)
    foreach_opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)  # every row's hyper-parameters
    foreach = timed(foreach_opt.step, args.reps)
    run_onnx, ops = onnx_runner(n, threads)
    onnx_ms = timed(run_onnx, args.reps)
    floor = 28 * n / bandwidth * 1e3

    from spmd_ort.runtime import native

    rows = []
    if native.load():
        p2, g2, m2, v2 = (t.clone() for t in (p, g, m, v))
        native_ms = timed(lambda: native.adam_([p2], [g2], [m2], [v2], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                                               weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
                                               decoupled=True), args.reps)
        rows.append(("spmd_ort native kernel (csrc/, offload_optimizer host step)", native_ms))
        # the same update over many tensors (gpt-mini has 50): one parallel region for all of them
        chunks = [t.split(n // 50) for t in (p2, g2, m2, v2)]
        steps = [torch.tensor(10.0) for _ in chunks[0]]
        native_many = timed(lambda: native.adam_(list(chunks[0]), list(chunks[1]), list(chunks[2]), list(chunks[3]),
                                                 [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1,
                                                 eps=1e-8, amsgrad=False, maximize=False, decoupled=True), args.reps)
        fused_many = timed(lambda: torch._fused_adamw_(list(chunks[0]), list(chunks[1]), list(chunks[2]),
                                                       list(chunks[3]), [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                                                       weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False),
                           args.reps)
    rows.append(("torch fused AdamW, in place (spmd_ort device node)", fused))
    rows.append(("torch foreach AdamW", foreach))
    ds = deepspeed_cpu_adam(n, args.reps)
    if ds is not None:
        rows.append(("DeepSpeedCPUAdam (AdamW mode)", ds))
    rows += [(f"ONNX elementwise in ORT ({ops} ops)", onnx_ms), ("memory floor (28 B/element)", floor)]

    print(f"# bench/optim.py — AdamW over {n / 1e6:.2f} M fp32 parameters, {threads} threads, "
          f"median of {args.reps}; memory bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    print("| update | ms | x floor |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {ms / floor:.2f} |")
    if native.load():
        print(f"\nthe same {n / 1e6:.2f} M elements as 50 tensors: native {native_many:.2f} ms, "
              f"torch fused {fused_many:.2f} ms")


def deepspeed_cpu_adam(n: int, reps: int) -> float | None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - deepspeed not installed, or its op cannot build here
        return None
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.1, adamw_mode=True)
    return timed(opt.step, reps)


if __name__ == "__main__":
    main()
