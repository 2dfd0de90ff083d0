"""Errors raised to users of spmd_ort."""

from __future__ import annotations


class CompileError(RuntimeError):
    """The train step could not be compiled.

    Raised before any state is touched: the module's parameters, buffers and
    gradients and the optimizer's state are exactly as they were.  The message
    names what failed (module FQN, op, rank where known) and how to fix it.
    """

    def __init__(self, message: str, *, fqn: str | None = None, op: str | None = None, rank: int | None = None):
        self.detail = message  # the same on every rank (what ranks compare when all fail)
        if rank is not None and f"rank {rank}" not in message and f"rank is {rank}" not in message:
            message = f"{message} (rank {rank})"
        super().__init__(message)
        self.fqn = fqn
        self.op = op
        self.rank = rank


class ConfigError(CompileError, ValueError):
    """An option or environment variable has a value spmd_ort does not accept.

    Raised when ``spmd_ort.compile`` reads its configuration, before anything is
    traced; the message names the setting, the value and what is allowed.
    """
