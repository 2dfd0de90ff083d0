"""Errors raised to users of spmd_ort."""

from __future__ import annotations


class CompileError(RuntimeError):
    """The train step could not be compiled.

    Raised before any state is touched: the module's parameters, buffers and
    gradients and the optimizer's state are exactly as they were.  The message
    names what failed (module FQN, op, rank where known) and how to fix it.
    """

    def __init__(self, message: str, *, fqn: str | None = None, op: str | None = None, rank: int | None = None,
                 input: str | None = None):  # noqa: A002 - the input's name in the call
        self.detail = message  # the same on every rank (what ranks compare when all fail)
        if rank is not None and f"rank {rank}" not in message and f"rank is {rank}" not in message:
            message = f"{message} (rank {rank})"
        super().__init__(message)
        self.fqn = fqn
        self.op = op
        self.rank = rank
        self.input = input


class ConfigError(CompileError, ValueError):
    """An option or environment variable has a value spmd_ort does not accept.

    Raised when ``spmd_ort.compile`` reads its configuration, before anything is
    traced; the message names the setting, the value and what is allowed.
    """


class InputIndexError(IndexError, RuntimeError):
    """An index that the step's inputs feed to an op lies outside the range the op accepts.

    Raised by the compiled step, before anything runs, where eager PyTorch raises too: an
    ``nn.Embedding`` id, an ``index_select`` / ``gather`` / ``scatter`` / indexing index, a
    ``cross_entropy`` target (other than its ``ignore_index``) out of range.  ONNX Runtime's
    gathers would silently read another row for a negative index, so the compiled step checks
    these indices itself (``insert_index_checks_pass``).  Nothing has run: the model and
    optimizer are unchanged.  Eager raises ``IndexError`` for some of these ops and
    ``RuntimeError`` for others (gather, scatter, index_add); this is both.

    ``input``: the input's name in the call (``ids``, ``batch['labels']``); ``op``: the aten op;
    ``fqn``: the module it runs in (None: the step function); ``value`` and ``position``: the first
    bad index and where it is; ``low``/``high``: the valid range ``[low, high)``; ``ignore``: the
    value the op skips (``ignore_index``), if any.
    """

    def __init__(self, message: str, *, input: str, op: str, fqn: str | None, value: int,  # noqa: A002
                 position: tuple[int, ...], low: int, high: int, ignore: int | None = None,
                 rank: int | None = None):
        if rank is not None:
            message = f"{message} (rank {rank})"
        super().__init__(message)
        self.input, self.op, self.fqn, self.rank = input, op, fqn, rank
        self.value, self.position, self.low, self.high, self.ignore = value, position, low, high, ignore


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded.

    A failed load changed nothing: the checkpoint is checked against the model
    and optimizer (keys, shapes, dtypes, optimizer kind, param groups) before
    anything is read into them, and what is read goes into new tensors first,
    so model, optimizer and compiled step are exactly as they were, on every
    rank (every rank raises when any rank fails).  The first line names the
    cause and the fix; ``path`` is the checkpoint, ``key`` the entry at fault
    (where one is).
    """

    def __init__(self, message: str, *, path: str, key: str | None = None, rank: int | None = None):
        super().__init__(message)
        self.path = path
        self.key = key
        self.rank = rank


class CollectiveTimeout(RuntimeError):
    """A collective of the compiled step did not complete within the process group's timeout.

    Another rank stopped stepping (it crashed, stalled or left its loop early);
    every rank must call the compiled step the same number of times.
    """

    def __init__(self, what: str, *, rank: int, cause: BaseException):
        super().__init__(
            f"rank {rank}: {what} did not complete within the process group's timeout: another rank stopped "
            "stepping (it crashed, stalled, or left its training loop early); every rank must call the compiled "
            f"step the same number of times ({type(cause).__name__}: {str(cause).strip()[:300]})")
        self.rank = rank


def is_timeout(exc: BaseException) -> bool:
    """Whether a torch.distributed error is a timeout (gloo and NCCL word it differently)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)
