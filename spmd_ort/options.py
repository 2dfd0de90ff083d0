"""User-facing options and the environment variables that override them.

Environment variables (all optional):

``SPMD_ORT_LOG_LEVEL``        VERBOSE | INFO | WARNING | ERROR | FATAL (default WARNING)
``SPMD_ORT_BACKEND``          default executor when ``compile(backend=None)``: ``ort`` or ``fx``
``SPMD_ORT_RETAIN_HOST_MEMORY`` 0 keeps glibc's default of returning freed memory to the system
                              (see :func:`spmd_ort.memory.retain_host_memory`; default 1)
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("spmd_ort")


class LogLevel(enum.IntEnum):
    VERBOSE = logging.DEBUG
    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    FATAL = logging.CRITICAL


@dataclass(frozen=True, kw_only=True)
class DebugOptions:
    """What the compiler shows and checks.

    ``log_level`` sets the ``spmd_ort`` logger (``SPMD_ORT_LOG_LEVEL`` wins over it).
    ``save_onnx``/``onnx_prefix`` write exported segments (ORT backend).
    ``verify`` checks every exported segment numerically against the FX graph.
    """

    log_level: LogLevel = LogLevel.WARNING
    save_onnx: bool = False
    onnx_prefix: str = "spmd_ort"
    verify: bool = False


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def env_flag(name: str, default: bool = False) -> bool:
    value = env_str(name)
    if value is None:
        return default
    return value.lower() in ("1", "true", "yes", "on")


def configure_logging(debug: DebugOptions) -> None:
    """Apply the log level: the environment variable takes precedence."""
    name = env_str("SPMD_ORT_LOG_LEVEL")
    if name is not None:
        try:
            level = LogLevel[name.upper()]
        except KeyError:
            raise ValueError(
                f"SPMD_ORT_LOG_LEVEL={name!r} is not one of {', '.join(LogLevel.__members__)}"
            ) from None
    else:
        level = debug.log_level
    logger.setLevel(int(level))
    # Print on our own only where the application has not configured logging.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[spmd_ort %(levelname)s] %(message)s"))
        logger.addHandler(handler)
