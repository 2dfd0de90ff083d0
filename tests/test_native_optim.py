"""The native host optimizer kernels (csrc/fused_optim.cpp) against torch's fused kernels."""

from __future__ import annotations

import warnings

import pytest
import torch

from spmd_ort.runtime import native

SHAPES = [(1000,), (333, 77), (256, 1024), (5,), (1,)]


def _tensors(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _state(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).abs() * scale for s in SHAPES]


@pytest.fixture
def two_threads():
    """torch's fused kernel splits a tensor over threads and handles each chunk's tail scalarly: the
    bit-for-bit claims below hold for a fixed thread count; 2 is this machine's and CI's."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_native_kernel_builds():
    assert native.load(), "the C++ extension should build on this machine (g++ and ninja are present)"


@pytest.mark.parametrize("decoupled,amsgrad,maximize,wd", [(True, False, False, 0.1), (False, False, False, 0.01),
                                                           (True, True, False, 0.0), (False, False, True, 0.0)])
def test_adam_matches_torch_fused(two_threads, decoupled, amsgrad, maximize, wd):
    params, grads = _tensors(0), _tensors(1)
    m, v, vmax = _state(2, 0.1), _state(3, 0.01), _state(4, 0.02)
    ref = [[t.clone() for t in ts] for ts in (params, m, v, vmax)]
    for step in (1.0, 2.0, 10.0):
        steps = [torch.tensor(step) for _ in SHAPES]
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=wd, eps=1e-8, amsgrad=amsgrad, maximize=maximize)
        native.adam_(params, grads, m, v, vmax, steps, decoupled=decoupled, **kw)
        (torch._fused_adamw_ if decoupled else torch._fused_adam_)(ref[0], grads, ref[1], ref[2],
                                                                    ref[3] if amsgrad else [], steps, **kw)
    for a, b in zip(params + m + v, ref[0] + ref[1] + ref[2]):
        # equal except torch's scalar tail loop, which differs by at most an ulp
        torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-9)
    # 256 x 1024 on 2 threads: no tail in torch's split, so every element is the same, bit for bit
    for got, want in zip((params[2], m[2], v[2]), (ref[0][2], ref[1][2], ref[2][2])):
        assert torch.equal(got, want)


def test_adam_bf16_params_with_fp32_state():
    """bf16 parameters and gradients, fp32 state: the update is computed in fp32 and rounded to bf16 once,
    so it equals the kernel's own fp32 update of the same (upcast) values, rounded, bit for bit."""
    params32, grads32 = _tensors(0), _tensors(1)
    params, grads = [p.to(torch.bfloat16) for p in params32], [g.to(torch.bfloat16) for g in grads32]
    m, v = _state(2, 0.1), _state(3, 0.01)
    ref_p, ref_m, ref_v = [p.float() for p in params], [t.clone() for t in m], [t.clone() for t in v]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
              decoupled=True)
    for step in (1.0, 2.0):
        steps = [torch.tensor(step) for _ in SHAPES]
        native.adam_(params, grads, m, v, [], steps, **kw)
        native.adam_(ref_p, [g.float() for g in grads], ref_m, ref_v, [], steps, **kw)
        for a, b in zip(params, ref_p):
            assert a.dtype == torch.bfloat16
            assert torch.equal(a, b.to(torch.bfloat16))  # the fp32 update, rounded once
            b.copy_(a.float())  # the fp32 reference continues from the same bf16 parameter
        for a, b in zip(m + v, ref_m + ref_v):
            assert torch.equal(a, b)  # state stays fp32 and identical


@pytest.mark.parametrize("momentum,nesterov,dampening,wd,first", [(0.9, False, 0.0, 0.0, True),
                                                                   (0.9, True, 0.0, 1e-4, False),
                                                                   (0.5, False, 0.1, 0.01, False),
                                                                   (0.0, False, 0.0, 0.01, False)])
def test_sgd_matches_torch_fused(two_threads, momentum, nesterov, dampening, wd, first):
    params, grads, bufs = _tensors(0), _tensors(1), _state(2, 0.1)
    ref_p, ref_b = [p.clone() for p in params], [b.clone() for b in bufs]
    kw = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov, maximize=False,
              is_first_step=first)
    native.sgd_(params, grads, bufs if momentum else [], **kw)
    torch._fused_sgd_(ref_p, grads, ref_b if momentum else [], **kw)
    for a, b in zip(params + (bufs if momentum else []), ref_p + (ref_b if momentum else [])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_first_step_never_reads_the_fresh_buffer(nesterov):
    """The first momentum step gets buffers from ``torch.empty_like``: whatever they hold (NaN, inf)
    must not reach the result (buf * 0 is NaN when buf is NaN)."""
    params, grads = _tensors(0), _tensors(1)
    bufs = [torch.full(s, float("nan")) for s in SHAPES]
    bufs[1].fill_(float("inf"))
    ref_p, ref_b = [p.clone() for p in params], [torch.zeros(s) for s in SHAPES]
    kw = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=nesterov, maximize=False,
              is_first_step=True)
    native.sgd_(params, grads, bufs, **kw)
    torch._fused_sgd_(ref_p, grads, ref_b, **kw)
    for a, b in zip(params + bufs, ref_p + ref_b):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_without_a_compiler_the_torch_kernel_runs_after_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "SOURCE", tmp_path / "missing.cpp")
    monkeypatch.setattr(native, "_loaded", {})
    params, grads = _tensors(0), _tensors(1)
    m, v = _state(2, 0.1), _state(3, 0.01)
    ref = [[t.clone() for t in ts] for ts in (params, m, v)]
    steps = [torch.tensor(1.0) for _ in SHAPES]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        native.adam_(params, grads, m, v, [], steps, decoupled=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only one warning per process
        native.adam_([t.clone() for t in params], grads, [t.clone() for t in m], [t.clone() for t in v], [], steps,
                     decoupled=True, **kw)
    torch._fused_adamw_(ref[0], grads, ref[1], ref[2], [], steps, **kw)
    assert all(torch.equal(a, b) for a, b in zip(params, ref[0]))


@pytest.mark.parametrize("opt_class,amsgrad,maximize", [(torch.optim.AdamW, False, False),
                                                        (torch.optim.Adam, True, False),
                                                        (torch.optim.AdamW, False, True)])
def test_adam_with_host_step_counters_is_eagers_foreach_step(opt_class, amsgrad, maximize):
    """Eager's default Adam on a GPU keeps its step counters on the host, which the fused kernels cannot read:
    the compiled step's Adam runs eager's own foreach implementation then (spmd_ort.runtime.kernels).  Its
    argument mapping, checked here on the CPU against eager's optimizer with foreach=True: bit for bit over
    three steps, the counters included."""
    from spmd_ort.runtime.kernels import _adam_with_host_steps

    params = [p.requires_grad_() for p in _tensors(0)]
    mine = [p.detach().clone() for p in params]
    opt = opt_class(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize, foreach=True)
    group = opt.param_groups[0]
    m, v, vmax = ([torch.zeros_like(p) for p in mine] for _ in range(3))
    steps = [torch.tensor(0.0) for _ in mine]
    for i in range(3):
        grads = _tensors(10 + i)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        _adam_with_host_steps(mine, grads, m, v, vmax, steps, lr=group["lr"], beta1=group["betas"][0],
                              beta2=group["betas"][1], weight_decay=group["weight_decay"], eps=group["eps"],
                              amsgrad=amsgrad, maximize=maximize, decoupled=opt_class is torch.optim.AdamW,
                              found_inf=None)
        assert all(torch.equal(a, b) for a, b in zip(params, mine)), i
        assert all(torch.equal(opt.state[p]["exp_avg_sq"], b) for p, b in zip(params, v)), i
        assert [float(opt.state[p]["step"]) for p in params] == [float(s) for s in steps] == [i + 1.0] * len(steps)
    _adam_with_host_steps(mine, grads, m, v, vmax, steps, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1,
                          eps=1e-8, amsgrad=amsgrad, maximize=maximize, decoupled=True, found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(params, mine)) and float(steps[0]) == 3.0  # found_inf: skipped


@pytest.mark.parametrize("kernel", ["adam_device", "adam_host", "sgd_device", "sgd_host"])
def test_a_gradient_in_another_layout_updates_as_its_contiguous_copy(kernel):
    """A compiled step can hand the optimizer a gradient whose strides differ from its parameter's (``t(x)`` of an
    ORT segment's contiguous output, where the traced graph's ``x`` was transposed); torch's fused kernels (and
    the native one) walk memory in order and read it transposed, silently (issue 55).  Each kernel updates as
    with the same gradient in the parameter's layout, bit for bit; the first SGD momentum buffer takes the
    parameter's layout, as eager's does."""
    from spmd_ort.options import Options
    from spmd_ort.runtime import kernels
    from spmd_ort.runtime.step_runtime import StepRuntime

    shapes = [(48, 32), (7, 5)]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s[::-1], generator=g).t() for s in shapes]  # transposed: strides (1, rows)
    assert not any(x.is_contiguous() for x in grads)
    runs = {}
    for name, gs in (("transposed", grads), ("contiguous", [x.contiguous() for x in grads])):
        ps = [p.clone() for p in params]
        with StepRuntime(Options()).active():
            if kernel.startswith("adam"):
                hp = torch.tensor([1e-2, 0.9, 0.999, 0.1, 1e-8], dtype=torch.float64)
                state = [[torch.zeros_like(p) for p in ps] for _ in range(2)]
                steps = [torch.tensor(0.0) for _ in ps]
                for _ in range(2):
                    getattr(kernels, kernel)(ps, gs, *state, [], steps, hp, False, False, True)
                runs[name] = ps + state[0] + state[1]
            else:
                hp = torch.tensor([1e-2, 0.9, 0.0, 0.1], dtype=torch.float64)
                out = kernels.functional_sgd(getattr(kernels, kernel), ps, gs, [], hp, True, False, False)
                assert all(b.stride() == p.stride() for b, p in zip(out[len(ps):], ps))
                out = kernels.functional_sgd(getattr(kernels, kernel), out[:len(ps)], gs, out[len(ps):], hp, True,
                                             False, False)
                runs[name] = out
    assert all(torch.equal(a, b) for a, b in zip(runs["transposed"], runs["contiguous"], strict=True))
