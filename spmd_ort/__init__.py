"""spmd_ort: compile a whole PyTorch train step into one graph, distribute it, run it on ONNX Runtime."""

from .amp import DynamicLossScaler, MixedPrecisionPolicy
from .api import CompiledStep, OpaqueOverride, Override, compile
from .ds_plan import DeepSpeedPlan, from_deepspeed_config
from .checkpoint import load_checkpoint, load_state_dict, save_checkpoint, state_dict
from .errors import CheckpointError, CollectiveTimeout, CompileError, ConfigError
from .options import DebugOptions, LogLevel, Options
from .parallel import DataParallel
from .program import CompiledProgram
from .sharding import full_state_dict, gathered_parameters

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CollectiveTimeout", "DataParallel", "DeepSpeedPlan", "DynamicLossScaler", "CompileError", "CompiledProgram", "CompiledStep", "ConfigError", "DebugOptions", "LogLevel",
           "MixedPrecisionPolicy", "OpaqueOverride", "Options", "Override",
           "compile", "from_deepspeed_config", "full_state_dict", "gathered_parameters", "load_checkpoint", "load_state_dict", "save_checkpoint",
           "state_dict"]
