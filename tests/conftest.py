import os
import sys

# the repository root, for `examples.gpt` (one GPT for the demo, the benchmarks and the tests)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tempfile

# Every exported segment is checked against its fx graph (the default) and every graph
# pass's contracts are checked in the test suite; every ORT segment runs in ONNX Runtime
# (not the faster of ORT and fx, which would let a timing decide what a test checks), and
# the ONNX cache is private to the run (the cache test makes its own).
os.environ.setdefault("SPMD_ORT_VERIFY", "1")
os.environ.setdefault("SPMD_ORT_CHECK_PASSES", "1")
os.environ.setdefault("SPMD_ORT_SEGMENT_EXECUTOR", "ort")
os.environ.setdefault("SPMD_ORT_CACHE_DIR", tempfile.mkdtemp(prefix="spmd_ort_cache_"))
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


@pytest.fixture(scope="module")
def one_rank():
    """A real one-rank gloo group: collectives run, and an all-reduce over one rank is the identity."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
