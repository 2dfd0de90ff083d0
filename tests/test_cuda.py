"""The compiled step on CUDA against eager on CUDA: fx, inductor (triton kernels), ORT's CUDA provider where
installed (else the ConfigError a user gets), autocast, and a steady step that never waits for the GPU.

Skipped where no GPU is present (CI has none). ``SPMD_ORT_TEST_DEVICE=cpu`` runs the same tests on the CPU,
which is how they are kept runnable between the rare sessions that have a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import spmd_ort
from helpers import ATOL, RTOL, assert_ran_on_ort, assert_same_state, train_side_by_side, train_step
from models import CNN, GPT, MLP, GPTConfig

DEVICE = torch.device(os.environ.get("SPMD_ORT_TEST_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"

pytestmark = [pytest.mark.gpu, pytest.mark.on_ort, pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs CUDA")]

GPT_CFG = GPTConfig(vocab=256, seq=32, d=64, heads=4, layers=2)


def _mlp():
    return MLP().to(DEVICE)


def _cnn():
    return CNN().to(DEVICE)


def _gpt():
    return GPT(GPT_CFG).to(DEVICE)


def _batches(kind: str, n: int = 3) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        if kind == "mlp":
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        elif kind == "cnn":
            x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
        else:
            x = torch.randint(0, GPT_CFG.vocab, (4, GPT_CFG.seq), generator=g)
            y = torch.randint(0, GPT_CFG.vocab, (4, GPT_CFG.seq), generator=g)
        out.append((x.to(DEVICE), y.to(DEVICE)))
    return out


MODELS = {"mlp": _mlp, "cnn": _cnn, "gpt": _gpt}


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


# what users write on a GPU: torch's defaults there are the foreach implementations, Adam's step counters on the host
OPTIMIZERS = {
    "adamw-fused": _adamw,
    "adamw-default": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
}


def _clipped_step(m, o, x, y):
    return train_step(m, o, x, y, clip=1.0)


@pytest.fixture
def no_fallback(monkeypatch):
    """A segment that cannot compile, load or verify raises instead of running on fx."""
    monkeypatch.setenv("SPMD_ORT_FALLBACK_POLICY", "FALLBACK_DISABLE")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fx_trains_like_eager(name):
    """fx runs eager's own CUDA kernels: the MLP elementwise; the CNN (cuDNN's backward algorithms) and the
    GPT (attention's backward) per tensor, as their kernels may accumulate in another order run to run."""
    torch.manual_seed(0)
    train_side_by_side(MODELS[name], _adamw, _clipped_step, _batches(name), backend="fx", normwise=name != "mlp")


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_fx_trains_like_eager_with_each_optimizer(opt):
    """Every optimizer as eager runs it on the device: the fused kernels where eager's is fused, torch's foreach
    implementation where eager's default keeps Adam's step counters on the host (the fused kernels read them on
    the device); per tensor, as the compiled step's SGD is torch's fused kernel where eager runs foreach."""
    torch.manual_seed(0)
    train_side_by_side(_mlp, OPTIMIZERS[opt], _clipped_step, _batches("mlp"), backend="fx", normwise=True)


@pytest.fixture
def full_float32():
    """No TensorFloat-32 anywhere (cuDNN's convolutions use it by default): float32 parity needs float32 math."""
    saved = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cudnn.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[1])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inductor_trains_like_eager(name, no_fallback, full_float32):
    """The whole step's segments compiled by inductor (triton on CUDA), each verified on its first run; in
    float32 throughout, eager's numbers to float32 rounding."""
    torch.manual_seed(0)
    compiled, _, _ = train_side_by_side(MODELS[name], _adamw, _clipped_step, _batches(name), backend="inductor")
    stats = compiled.compiled.executor.stats
    assert compiled.compiled.executor.name == "inductor" and stats.segments >= 1, stats
    assert not stats.fallbacks and stats.verified == stats.segments, stats


@pytest.mark.skipif(not ON_CUDA, reason="TensorFloat-32 is a GPU's")
def test_inductor_runs_a_convnet_with_cudnns_default_tf32(no_fallback):
    """With cuDNN's default (TF32 allowed), inductor's channels-last convolutions and eager's differ at TF32's
    precision (an H200: the first batch norm's running mean 0.014% apart): the segment is verified to that
    precision and runs compiled, and the losses stay eager's to it."""
    assert torch.backends.cudnn.allow_tf32
    torch.manual_seed(0)
    model = _cnn()
    twin = __import__("copy").deepcopy(model)
    opt, opt_c = _adamw(model), _adamw(twin)
    step = spmd_ort.compile(backend="inductor")(_clipped_step)
    for x, y in _batches("cnn", 3):
        loss = _clipped_step(model, opt, x, y)
        torch.testing.assert_close(step(twin, opt_c, x, y), loss.detach(), rtol=4 * 2.0**-10, atol=0)
    stats = step.compiled.executor.stats
    assert stats.segments >= 1 and not stats.fallbacks and stats.verified == stats.segments, stats


def test_ort_runs_on_the_cuda_provider_or_says_what_to_install(no_fallback):
    """With onnxruntime-gpu the step's segments run in ORT's CUDA provider, against eager; without it a step that
    asks for ORT gets a ConfigError naming the package on its first call, the model and optimizer as they were,
    and a step with the default backend trains (inductor with triton, else fx), saying why in explain()."""
    import onnxruntime as ort

    if not ON_CUDA or "CUDAExecutionProvider" in ort.get_available_providers():
        torch.manual_seed(0)
        compiled, _, _ = train_side_by_side(_mlp, _adamw, _clipped_step, _batches("mlp"), backend="ort")
        assert_ran_on_ort(compiled)
        return
    torch.manual_seed(0)
    model = _mlp()
    opt = _adamw(model)
    before = [p.detach().clone() for p in model.parameters()]
    step = spmd_ort.compile(backend="ort")(_clipped_step)
    with pytest.raises(spmd_ort.ConfigError, match="onnxruntime-gpu.*backend='fx'"):
        step(model, opt, *_batches("mlp", 1)[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    assert all(p.grad is None for p in model.parameters())
    torch.manual_seed(0)
    compiled, _, _ = train_side_by_side(_mlp, _adamw, _clipped_step, _batches("mlp"), backend=None)
    assert compiled.backend in ("inductor", "fx") and "onnxruntime-gpu" in compiled.backend_reason
    assert f"{compiled.backend} backend (the step's tensors are on CUDA" in compiled.explain()


def _autocast_step(dtype):
    def step(model, opt, scaler, x, y):
        with torch.autocast(DEVICE.type, dtype=dtype):
            loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_autocast_on_fx_is_eagers_step_bit_for_bit(dtype):
    """torch.autocast on the device with a GradScaler (float16's skips its overflowing first steps): fx runs
    eager's kernels in eager's dtypes, so loss, scale, parameters and AdamW's state are eager's, bit for bit."""
    import copy

    dtype_ = getattr(torch, dtype)
    torch.manual_seed(0)
    model = _mlp()
    model_c = copy.deepcopy(model)
    opt, opt_c = _adamw(model), _adamw(model_c)
    init = 2.0**19 if dtype_ == torch.float16 else 2.0**16
    scaler, scaler_c = (torch.amp.GradScaler(DEVICE.type, init_scale=init, growth_interval=2) for _ in range(2))
    step = _autocast_step(dtype_)
    compiled = spmd_ort.compile(backend="fx")(step)
    for i, (x, y) in enumerate(_batches("mlp", 5)):
        loss = step(model, opt, scaler, x, y)
        loss_c = compiled(model_c, opt_c, scaler_c, x, y)
        assert torch.equal(loss_c, loss.detach()), i
        assert float(scaler_c._scale) == float(scaler._scale), i
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_c.parameters())), i
        sa, sb = opt.state_dict()["state"], opt_c.state_dict()["state"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k]), i


@pytest.mark.skipif(not ON_CUDA, reason="host synchronisation is a CUDA matter")
@pytest.mark.parametrize("name,backend,opt", [("mlp", "fx", "adamw-fused"), ("gpt", "fx", "adamw-fused"),
                                              ("gpt", "inductor", "adamw-fused"), ("mlp", "fx", "adamw-default"),
                                              ("mlp", "fx", "sgd-nesterov")])
def test_a_steady_step_never_waits_for_the_gpu(name, backend, opt):
    """Eager's step (forward, backward, clipping, the optimizer) queues its kernels without waiting for the
    GPU; so does the compiled step once compiled: no host read of a device value, no blocking copy to the
    device, either of which would stall every step."""
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = OPTIMIZERS[opt](model)
    step = spmd_ort.compile(backend=backend)(_clipped_step)
    batches = _batches(name, 4)
    for x, y in batches[:3]:  # compile (before and after AdamW's state exists), then a first steady step
        step(model, opt, x, y)
    _step_without_sync(step, model, opt, batches[3])



def _step_without_sync(step, model, opt, batch) -> None:
    """One call of ``step`` in which any host synchronisation with the GPU raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(model, opt, *batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


BAD_ID_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
import spmd_ort
from tests.helpers import train_step
from tests.models import GPT, GPTConfig
cfg = GPTConfig(vocab=64, seq=8, d=32, heads=4, layers=1)
model = GPT(cfg).to({device!r})
opt = torch.optim.AdamW(model.parameters(), fused=True)
step = spmd_ort.compile(backend="fx")(train_step)
x = torch.randint(0, 64, (2, 8), device={device!r})
step(model, opt, x, x)
x[1, 3] = 64
step(model, opt, x, x)
torch.{sync}
print("TRAINED ON A BAD ID")
"""


@pytest.mark.skipif(not ON_CUDA, reason="a device-side assert is a CUDA matter")
def test_a_bad_id_fails_the_step_as_eagers_does():
    """An embedding id out of range: the compiled step's bounds check is a device-side assert, as eager's own
    check on CUDA is (it ends the process: a CUDA context with a failed assert is unusable), not a silent
    read of another row.  Run in a child process for that reason."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    script = BAD_ID_SCRIPT.format(root=root, device=str(DEVICE), sync="cuda.synchronize()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "TRAINED ON A BAD ID" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert "assert" in done.stderr.lower(), done.stderr[-2000:]


# ---------------------------------------------------------------------- compile(cuda_graph=True)
def _graphed_side_by_side(make_model, make_opt, step_fn, batches, *, backend="fx", sched=True, exact=True,
                          **compile_kwargs):
    """Eager and a CUDA-graphed compiled copy on the same batches, checked every step (``exact``: bit for bit;
    else to float32 rounding, per tensor); learning rates exact in binary, halved every 2 steps (a schedule: a
    device tensor the host writes before each replay).  Returns the compiled step."""
    import copy

    torch.manual_seed(0)
    model_e = make_model()
    model_c = copy.deepcopy(model_e)
    opt_e, opt_c = make_opt(model_e), make_opt(model_c)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt_e, opt_c)] if sched else []
    step = spmd_ort.compile(backend=backend, cuda_graph=True, **compile_kwargs)(step_fn)
    for i, batch in enumerate(batches):
        torch.manual_seed(100 + i)  # dropout: both draw from the same generator state
        loss_e = step_fn(model_e, opt_e, *batch)
        torch.manual_seed(100 + i)
        loss_c = step(model_c, opt_c, *batch)
        if exact:
            assert torch.equal(loss_c, loss_e.detach()), (i, float(loss_c), float(loss_e))
            for (name, a), b in zip(model_e.named_parameters(), model_c.parameters()):
                assert torch.equal(a, b), f"step {i}: {name} off by {float((a - b).abs().max())}"
            sa, sb = opt_e.state_dict()["state"], opt_c.state_dict()["state"]
            assert all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k]), i
        else:  # attention's backward (and inductor's kernels) may sum in another order: per tensor
            torch.testing.assert_close(loss_c, loss_e.detach(), rtol=RTOL, atol=ATOL)
            assert_same_state(model_e, model_c, opt_e, opt_c, where=f"step {i}", normwise=True)
        for s in scheds:
            s.step()
    return step


def _graph_stats(step):
    runner = step.compiled.executor
    return runner.captures, runner.replays, runner.disabled


def _adamw_exact(m):
    return torch.optim.AdamW(m.parameters(), lr=2.0**-7, weight_decay=0.1, fused=True)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs are a GPU's")
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_cuda_graph_trains_like_eager_bit_for_bit(name):
    """fx's step captured once, after its checked first run and one more, then replayed: every step is eager's,
    bit for bit (fused AdamW with a schedule, clipping), and the graph was captured once and replayed."""
    batches = _batches(name, 7)
    step = _graphed_side_by_side(MODELS[name], _adamw_exact, _clipped_step, batches, exact=name == "mlp")
    captures, replays, disabled = _graph_stats(step)
    assert disabled is None and captures == 1 and replays >= 3, step.explain()
    assert "CUDA graphs: the whole step, 1 kept" in step.explain()


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs are a GPU's")
def test_a_cuda_graph_on_inductor_trains_like_eager(no_fallback, full_float32):
    step = _graphed_side_by_side(_gpt, _adamw_exact, _clipped_step, _batches("gpt", 6), backend="inductor",
                                 exact=False)
    captures, replays, disabled = _graph_stats(step)
    assert disabled is None and captures == 1 and replays >= 2, step.explain()


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs are a GPU's")
def test_a_cuda_graph_keeps_the_grad_scalers_skip_and_growth_in_the_graph():
    """float16 autocast with a GradScaler whose first steps overflow: the found-inf skip, the scale's backoff and
    growth run in the replays, as eager's: loss, scale, parameters and AdamW's state bit for bit."""
    import copy

    torch.manual_seed(0)
    model = _mlp()
    model_c = copy.deepcopy(model)
    opt, opt_c = _adamw_exact(model), _adamw_exact(model_c)
    scaler, scaler_c = (torch.amp.GradScaler("cuda", init_scale=2.0**19, growth_interval=2) for _ in range(2))
    step = _autocast_step(torch.float16)
    compiled = spmd_ort.compile(backend="fx", cuda_graph=True)(step)
    scales = []
    for i, (x, y) in enumerate(_batches("mlp", 8)):
        loss = step(model, opt, scaler, x, y)
        loss_c = compiled(model_c, opt_c, scaler_c, x, y)
        assert torch.equal(loss_c, loss.detach()), i
        assert float(scaler_c._scale) == float(scaler._scale), i
        scales.append(float(scaler._scale))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_c.parameters())), i
    assert len(set(scales)) > 1, scales  # it backed off and grew within the replays
    captures, replays, disabled = _graph_stats(compiled)
    assert disabled is None and captures == 1 and replays >= 4, compiled.explain()


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs are a GPU's")
def test_dropout_in_a_cuda_graph_draws_what_the_uncaptured_step_draws():
    """Dropout in the replays: torch registers its generator with the graph, so each replay draws the numbers
    the uncaptured step draws from the same generator state (compared to the compiled step without graphs, whose
    random ops draw as eager's do)."""
    import copy

    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                  torch.nn.Linear(64, 10)).to(DEVICE)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = _adamw_exact(model_a), _adamw_exact(model_b)
    plain = spmd_ort.compile(backend="fx")(_clipped_step)
    graphed = spmd_ort.compile(backend="fx", cuda_graph=True)(_clipped_step)
    for i, (x, y) in enumerate(_batches("mlp", 6)):
        torch.manual_seed(7 + i)
        la = plain(model_a, opt_a, x, y)
        torch.manual_seed(7 + i)
        lb = graphed(model_b, opt_b, x, y)
        assert torch.equal(la, lb), (i, float(la), float(lb))
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))
    assert _graph_stats(graphed)[:2] == (1, 4), graphed.explain()


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs are a GPU's")
def test_a_cuda_graph_per_batch_size():
    """Dynamic shapes: one program, one graph per batch size, captured on the size's second run (its first does
    the size's lazy work), each replayed when its size comes back."""
    g = torch.Generator().manual_seed(0)
    sizes = (8, 8, 8, 4, 8, 4, 8, 4)
    batches = [(torch.randn(b, 32, generator=g).to(DEVICE), torch.randint(0, 10, (b,), generator=g).to(DEVICE))
               for b in sizes]
    step = _graphed_side_by_side(_mlp, _adamw_exact, _clipped_step, batches, dynamic=True)
    assert len(step.variants) == 1
    captures, replays, disabled = _graph_stats(step)
    assert disabled is None and captures == 2 and replays == len(sizes) - 3, step.explain()


@pytest.mark.skipif(not ON_CUDA, reason="host synchronisation is a CUDA matter")
@pytest.mark.parametrize("backend", ["fx", "inductor"])
def test_a_replayed_step_never_waits_and_launches_a_handful_of_kernels(backend):
    """A replayed step issues no host synchronisation (``set_sync_debug_mode("error")``) and launches O(1)
    kernels from Python: one graph launch, where the uncaptured step launches one per op."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = _gpt()
    opt = _adamw_exact(model)
    step = spmd_ort.compile(backend=backend, cuda_graph=True)(_clipped_step)
    batches = _batches("gpt", 6)
    for x, y in batches[:4]:
        step(model, opt, x, y)
    assert _graph_stats(step)[0] == 1, step.explain()
    _step_without_sync(step, model, opt, batches[4])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(model, opt, *batches[5])
        torch.cuda.synchronize()
    calls = {e.key: e.count for e in prof.key_averages()}
    launches = calls.get("cudaLaunchKernel", 0) + calls.get("cuLaunchKernel", 0) + calls.get("cuLaunchKernelEx", 0)
    assert calls.get("cudaGraphLaunch", 0) == 1, sorted(calls.items())
    assert launches <= 8, (launches, sorted(calls.items()))


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs are a GPU's")
def test_eagers_default_adamw_splits_the_step_into_graphs_around_its_host_update():
    """AdamW as most scripts build it keeps its step counters on the host (eager's default on a GPU): that
    update runs on the host between graphs, forward, backward and clipping before it in one, like eager's
    foreach update (per tensor)."""
    def default_adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=2.0**-7, weight_decay=0.1)

    step = _graphed_side_by_side(_mlp, default_adamw, _clipped_step, _batches("mlp", 6), exact=False)
    runner = step.compiled.executor
    assert runner.disabled is None and runner.whole is None and runner.segments, step.explain()
    assert all(seg.runs.captures == 1 and seg.runs.disabled is None for seg in runner.segments), step.explain()
    assert "one per run of nodes between host nodes" in step.explain()


@pytest.mark.skipif(not ON_CUDA, reason="NCCL is a GPU's")
def test_data_parallel_on_one_gpu_with_nccl_is_graphed(tmp_path):
    """DataParallel over NCCL with one rank (what a multi-GPU script runs on one GPU): its step has no
    collective to make, is captured whole and trains like eager (which DDP with one rank is)."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        step = _graphed_side_by_side(_mlp, _adamw_exact, _clipped_step, _batches("mlp", 6),
                                     parallel_mode=spmd_ort.DataParallel())
        captures, replays, disabled = _graph_stats(step)
        assert disabled is None and captures == 1 and replays >= 3, step.explain()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs are a GPU's")
def test_an_opaque_part_splits_the_step_into_graphs_around_it():
    """A module run opaquely (the user's Python, host nodes) splits the step: the runs of nodes before, between
    and after its forward and backward are graphs, each captured once; the update, which skips what no opaque
    part gave a gradient by reading which on the host, runs between them."""
    step = _graphed_side_by_side(_mlp, _adamw_exact, _clipped_step, _batches("mlp", 6), exact=False,
                                 module_override=spmd_ort.OpaqueOverride("fc2"))
    runner = step.compiled.executor
    assert runner.whole is None and len(runner.segments) >= 2, step.explain()
    assert all(seg.runs.captures == 1 and seg.runs.disabled is None for seg in runner.segments), step.explain()
