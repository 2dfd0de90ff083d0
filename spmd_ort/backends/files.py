"""What the backends keep on disk and share between processes: a graph's digest (the name of what is cached for
it), an exclusive lock (one process builds, the others wait and then read what it wrote) and an atomic write (a
reader never sees half a file)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

import torch
from torch import fx


def graph_digest(gm: fx.GraphModule, *parts) -> str:
    """Hash of ``gm`` and ``parts`` (versions, options): its ops in order with their arguments, the shape, dtype
    and strides of every value, nodes named by position, and its constants.  Node names are left out: the same
    layer repeated (a transformer's blocks) has one digest."""
    h = hashlib.sha256()
    for part in parts:
        h.update(f"{part}|".encode())
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def positional(a):
        return fx.node.map_arg(a, lambda n: f"%{index[n]}")

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        what = (f"{tuple(val.shape)}:{val.dtype}:{val.stride()}" if isinstance(val, torch.Tensor)
                else type(val).__name__)
        target = "" if node.op in ("placeholder", "output") else node.target  # a placeholder's is its name
        h.update(f"{index[node]}={node.op}:{target}:{positional(node.args)}:{positional(node.kwargs)}:"
                 f"{what};".encode())
    for name, t in sorted(gm.state_dict(keep_vars=True).items()):
        h.update(name.encode())
        if t.device.type == "meta":  # (no values: a planned graph)
            h.update(f"meta:{tuple(t.shape)}:{t.dtype}".encode())
        else:  # its bytes, whatever the dtype (numpy has no bfloat16)
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """An exclusive lock on ``lock_path`` (POSIX ``flock``), held by one process at a time; without one (no
    fcntl, a read-only directory) no lock."""
    try:
        import fcntl

        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a+")  # noqa: SIM115 - held until the block ends
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it (OSError where it cannot)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(data)
    os.replace(f.name, path)
