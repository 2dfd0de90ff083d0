"""spmd_ort: compile a whole PyTorch train step into one graph, distribute it, run it on ONNX Runtime.

The public names are here; the packages below them depend one way (docs/architecture.md, enforced by
tests/test_architecture.py): ``runtime`` (what the graph's ops do when they run) -> ``graph`` (the graph's
vocabulary: ops, slots, node meta, segments) -> ``distributed`` -> ``capture`` (trace) -> ``backends`` (fx,
inductor, ONNX Runtime) -> ``passes`` (``spmd_ort.passes``) -> ``program`` / ``tuner`` / ``compiler`` ->
``debug`` / ``checkpoint`` / ``integrations`` -> ``step`` -> ``api``.
"""

from spmd_ort.api import compile, parallelize
from spmd_ort.overrides import OpaqueOverride, Override
from spmd_ort.capture.amp import DynamicLossScaler
from spmd_ort.distributed.precision import MixedPrecisionPolicy
from spmd_ort.checkpoint.dcp import load_checkpoint, load_state_dict, save_checkpoint, state_dict
from spmd_ort.checkpoint.safetensors import load_safetensors, save_safetensors
from spmd_ort.distributed.parallel_dims import Parallel
from spmd_ort.distributed.stages import Pipeline
from spmd_ort.distributed.parallel import DataParallel, TensorParallel
from spmd_ort.distributed.sharding import full_state_dict, gathered_parameters
from spmd_ort.errors import CheckpointError, CollectiveTimeout, CompileError, ConfigError, InputIndexError
from spmd_ort.integrations.deepspeed.plan import DeepSpeedPlan, from_deepspeed_config
from spmd_ort.options import DebugOptions, LogLevel, Options
from spmd_ort.program import CompiledProgram
from spmd_ort.step import CompiledStep

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CollectiveTimeout", "CompileError", "CompiledProgram", "CompiledStep", "ConfigError",
           "DataParallel", "DebugOptions", "DeepSpeedPlan", "DynamicLossScaler", "InputIndexError", "LogLevel",
           "MixedPrecisionPolicy", "OpaqueOverride", "Options", "Override", "Parallel", "Pipeline", "TensorParallel",
           "compile",
           "from_deepspeed_config", "full_state_dict", "gathered_parameters", "load_checkpoint", "load_safetensors",
           "load_state_dict", "parallelize", "save_checkpoint", "save_safetensors", "state_dict"]
