"""spmd_ort: compile a whole PyTorch train step into one graph, distribute it, run it on ONNX Runtime."""

from . import optim as _optim  # noqa: F401 - registers the spmd_ort:: ops
from .api import CompiledStep, Override, compile
from .checkpoint import load_checkpoint, load_state_dict, save_checkpoint, state_dict
from .errors import CompileError
from .options import DebugOptions, LogLevel
from .parallel import DataParallel
from .program import CompiledProgram
from .sharding import full_state_dict, gathered_parameters

__version__ = "0.1.0"

__all__ = ["DataParallel", "CompileError", "CompiledProgram", "CompiledStep", "DebugOptions", "LogLevel", "Override",
           "compile", "full_state_dict", "gathered_parameters", "load_checkpoint", "load_state_dict", "save_checkpoint",
           "state_dict"]
