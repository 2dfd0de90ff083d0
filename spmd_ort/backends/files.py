"""What the backends keep on disk and share between processes: a graph's digest (the name of what is cached for
it), a module's and a function's digests (what a cache keyed before the trace is named by), an exclusive lock (one
process builds, the others wait and then read what it wrote) and an atomic write (a reader never sees half a
file)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import types
from pathlib import Path

import torch
from torch import fx, nn


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


_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


def stable_repr(value, depth: int = 0):
    """``value`` as a stable string where it has one (numbers, strings, dtypes, their tuples, lists and dicts),
    else its ``repr`` (an address in it makes a key that never matches again)."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}:{value.requires_grad}"
    if depth < 4 and isinstance(value, (tuple, list)):
        return "(" + ",".join(stable_repr(v, depth + 1) for v in value) + ")"
    if depth < 4 and isinstance(value, dict):
        return "{" + ",".join(f"{stable_repr(k, depth + 1)}:{stable_repr(v, depth + 1)}" for k, v in sorted(
            value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return code_digest(value)
    return repr(value)


def code_digest(fn) -> str:
    """A function's code: its bytecode, constants (code objects within it, recursively), names, defaults and
    closure values."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return repr(fn)
    h = hashlib.sha256()

    def walk(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)
            else:
                h.update(repr(const).encode())

    walk(code)
    h.update(stable_repr(fn.__defaults__).encode())
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        h.update((value.__qualname__ if isinstance(value, type) else stable_repr(value)).encode())
    return f"{fn.__module__}.{fn.__qualname__}:{h.hexdigest()[:16]}"


def module_digest(module: nn.Module) -> str:
    """A module's structure: every submodule's class and public attributes, every parameter's and buffer's name,
    shape, dtype and ``requires_grad``, and a Hugging Face model's config (no values)."""
    h = hashlib.sha256()
    for name, m in module.named_modules(remove_duplicate=False):
        # every public attribute (an object printed with its address makes the key miss, never match wrongly)
        plain = sorted((k, stable_repr(v)) for k, v in vars(m).items() if not k.startswith("_"))
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__}:{plain};".encode())
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad};".encode())
    config = getattr(module, "config", None)
    if hasattr(config, "to_json_string"):
        h.update(config.to_json_string().encode())
    return h.hexdigest()
