import os
import sys

# the repository root, for `examples.gpt` (one GPT for the demo, the benchmarks and the tests)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tempfile

# Every exported segment is checked against its fx graph (the default) and every graph
# pass's contracts are checked in the test suite, and the ONNX cache is private to the run (the cache test makes
# its own).  Who runs each segment is the default, automatic choice (the faster of ORT and fx, the whole graph
# against its segments, inductor's candidate): the suite trains on the path users get.  A test that asserts
# steps trained on ORT's outputs says so with ``@pytest.mark.on_ort`` (every ORT segment on ORT), or compiles
# with ``autotune=False`` (the static choice).
os.environ.setdefault("SPMD_ORT_VERIFY", "1")
os.environ.setdefault("SPMD_ORT_CHECK_PASSES", "1")
os.environ.setdefault("SPMD_ORT_CACHE_DIR", tempfile.mkdtemp(prefix="spmd_ort_cache_"))
# Each test measures its own automatic choices: remembered ones (the default for users) would make a test's
# decisions depend on which tests ran before it on the same worker.  tests/test_remembered_choices.py turns
# them on, with a cache of its own.
os.environ.setdefault("SPMD_ORT_REMEMBER_CHOICES", "0")
# Each plan() plans: a kept plan would answer a test that changed something the key does not see (a monkeypatched
# cost model).  tests/test_plan_cache.py turns it on.
os.environ.setdefault("SPMD_ORT_PLAN_CACHE", "0")
# Inductor's candidate is compiled in the step, at the step its ski rental sets (the tests assert that step), not
# by a forked process whose finishing time depends on the machine's load; tests/test_background_compile.py
# turns the background on.
os.environ.setdefault("SPMD_ORT_BACKGROUND_COMPILE", "0")
# The suite's process keeps freed host memory for reuse (glibc's mallopt: opt-in, since it acts on the whole
# process): it compiles hundreds of steps, and until the setting was opt-in every test process had it from its
# first compiled step on. tests/test_host_memory.py and test_process_effects.py check the default (off).
os.environ.setdefault("SPMD_ORT_RETAIN_HOST_MEMORY", "1")

# Under `make test`'s two pytest workers (pytest-xdist) on two cores: one intra-op thread per worker, as each
# torchrun rank has, so that the workers' thread pools do not contend for the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _on_ort(request, monkeypatch):
    """``@pytest.mark.on_ort``: every ORT segment of the test's steps (and of the ranks it launches, which
    inherit the environment) runs on ORT, not the faster of ORT and fx: the test asserts it trained on ORT."""
    if request.node.get_closest_marker("on_ort") is not None:
        monkeypatch.setenv("SPMD_ORT_SEGMENT_EXECUTOR", "ort")
    yield


@pytest.fixture(scope="module")
def one_rank():
    """A real one-rank gloo group: collectives run, and an all-reduce over one rank is the identity."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
