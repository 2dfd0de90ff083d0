"""Host memory retention (spmd_ort.runtime.memory.retain_host_memory), opt-in with SPMD_ORT_RETAIN_HOST_MEMORY=1:
after the first compiled step, large tensors freed by one step are reused by the next instead of being page-faulted
in again.  By default the process's allocator is left as it is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    sys.path.insert(0, {tests!r})
    import spmd_ort
    from models import MLP

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd_ort.compile(backend="fx")
    def step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = torch.randn(8, 32), torch.randn(8, 10)
    step(model, opt, x, y)

    def big_tensors():  # 64 MiB each, written in full, freed at once: a large activation
        for _ in range(4):
            t = torch.empty(16 << 20)
            t.fill_(1.0)
            del t

    big_tensors()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big_tensors()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(step.memory()["host_memory_retained"], faults)
""")


def _run(env_value: str | None) -> tuple[bool, int]:
    tests = os.path.dirname(__file__)
    env = {k: v for k, v in os.environ.items() if k != "SPMD_ORT_RETAIN_HOST_MEMORY"}
    if env_value is not None:
        env["SPMD_ORT_RETAIN_HOST_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    retained, faults = out.stdout.split()[-2:]
    return retained == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_host_memory_is_reused_after_a_compiled_step_when_asked():
    retained, faults = _run("1")
    assert retained
    # four 64 MiB tensors are 65536 pages; reused memory faults on none of them
    assert faults < 2000, faults
    # the default (and "0") keeps glibc's: every large tensor is a fresh mmap, faulted page by page
    for value in (None, "0"):
        retained, faults = _run(value)
        assert not retained, value
        assert faults > 60000, (value, faults)
