import os
import sys

# the repository root, for `examples.gpt` (one GPT for the demo, the benchmarks and the tests)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
