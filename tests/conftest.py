import os
import sys

# the repository root, for `examples.gpt` (one GPT for the demo, the benchmarks and the tests)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tempfile

# Every exported segment is checked against its fx graph in the test suite, and
# the ONNX cache is private to the run (the cache test makes its own).
os.environ.setdefault("SPMD_ORT_VERIFY", "1")
os.environ.setdefault("SPMD_ORT_CACHE_DIR", tempfile.mkdtemp(prefix="spmd_ort_cache_"))
