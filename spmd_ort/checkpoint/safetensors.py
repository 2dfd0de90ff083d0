"""Hugging Face safetensors weights: each rank reads only the part it holds; rank 0 writes the full weights.

:func:`load_safetensors` reads a ``.safetensors`` file, or a directory in Hugging Face's layout
(``model.safetensors.index.json`` and its shard files, or one ``model.safetensors``), into
``model.state_dict()``'s tensors.  A DTensor parameter (``fully_shard``'s ``Shard(0)``, tensor
parallel's ``Shard(0)``/``Shard(1)``, FSDP2 + TP's strided dp shard) reads only this rank's part of
each tensor; a plain tensor reads the whole.  The reads are plain file reads (``os.preadv``) of the part's
bytes at the offsets the file's header gives, no memory map: a part whose live tensor is a CPU tensor of the
file's dtype is read straight into it, in place (``fully_shard``'s local tensors are views of the flat
buffers the compiled step reads and writes), so loading costs about what reading those bytes does (measured
by bench/load.py); any other part (a meta or GPU tensor, another dtype, rows to pick) is read into a new
tensor and copied in once every rank has read.  Like :func:`spmd_ort.load_checkpoint` it changes everything
or nothing, on every rank: it checks everything first (keys, shapes, dtypes, every file's header against
its size, every file opened) and the ranks agree before any tensor changes; every rank raises one
:class:`~spmd_ort.errors.CheckpointError` listing every problem if any rank has one.  Only a read that fails
after the checks (an I/O error, a file cut short while it loads) can leave a model partly loaded, and the
error then says so on each rank that had read a tensor in place.

:func:`save_safetensors` writes the consolidated weights as ``save_pretrained`` does: ``model.safetensors``,
or ``model-0000k-of-0000n.safetensors`` shards with ``model.safetensors.index.json``.  Every rank calls
it; each tensor is gathered in turn and rank 0 writes a file as soon as it is full, into a new
directory next to the target that replaces the target once complete.

Tied weights (one tensor under several FQNs, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``)
are one entry: saved under their first FQN in ``state_dict()`` order (the one ``save_pretrained`` keeps),
loaded from whichever of their names the file has.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import shutil
import struct
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from spmd_ort.checkpoint.problems import Problem, agree
from spmd_ort.distributed import parallel
from spmd_ort.distributed.dtensor import is_dtensor
from spmd_ort.distributed.sharding import SHARD_ATTR, ShardSpec, flat_of, gather_full, spec_of
from spmd_ort.distributed.stages import sync_stages
from spmd_ort.runtime.memory import release_free_host_memory

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
NOTHING_LOADED = "Nothing was loaded: the model is unchanged."
PARTLY_LOADED = ("The model is partly loaded: this rank read some of its tensors in place before the read failed "
                 "(they hold the file's values, the others their old ones); load it again once the files read.")

# safetensors' dtype names (the header's "dtype"); torch's optional ones where this torch has them
DTYPES = {name: getattr(torch, attr) for name, attr in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64"}.items()
    if hasattr(torch, attr)}

KeyMap = Callable[[str], "str | None"] | Mapping[str, "str | None"]


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """What one rank read: ``bytes_read`` of tensor data (in the file's dtype) out of ``bytes_total`` (the
    whole entries it read from), ``tensors`` entries, from ``files`` files; with ``strict=False``, the model's
    tensors the file lacks (``missing``, left as they were) and the file's entries the model lacks
    (``unexpected``, not read), as ``nn.Module.load_state_dict`` reports them."""

    bytes_read: int
    bytes_total: int
    tensors: int
    files: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stored:
    """One tensor of the checkpoint, from its file's header: ``offset``, where its data starts in the file."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0


@dataclass
class _Read:
    """One tensor of the model (under all its FQNs) and how this rank reads its part."""

    names: tuple[str, ...]
    live: Tensor
    source: Stored
    box: tuple[slice, ...] | None  # the slice to read (None: the whole tensor)
    take: tuple[tuple[int, Tensor], ...] = ()  # (dim, indices) to keep of a covering slice
    shard: ShardSpec | None = None  # a plain fully_shard shard (0-d parameter): cut from the whole


# ---------------------------------------------------------------------- which part a rank holds
def local_index(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int],
                placements) -> list[Tensor]:
    """For each dim of a tensor of global ``shape``, the global indices (in local order) that the rank at
    ``coordinate`` of a mesh of ``mesh_shape`` holds under ``placements``.

    ``Shard(d)`` cuts as DTensor (and ``torch.chunk``) does: ``ceil(n / k)`` per rank, a trailing rank may
    hold fewer or none.  FSDP2 + TP's strided dp shard (``_StridedShard(d, split_factor=f)`` followed by
    shards of ``d`` whose mesh sizes multiply to ``f``) cuts last: dp's rows of the tensor-parallel piece, as
    FSDP2 and ``fully_shard`` lay them out (torch's own offsets differ for some uneven sizes, e.g. 7 rows on a
    3 x 2 mesh).  Any other strided shard follows torch's definition: chunk ``c`` of each of ``f`` pieces,
    which need not be contiguous.  Other placements (``Partial``) raise ValueError.
    """
    out = []
    for d, n in enumerate(shape):
        idx = torch.arange(n)
        for mesh_dim, strided in _cuts(placements, mesh_shape, len(shape)).get(d, []):
            k, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
            if strided:
                size = -(-len(idx) // strided)
                idx = torch.cat([_chunk(idx[j * size:(j + 1) * size], k, c) for j in range(strided)])
            else:
                idx = _chunk(idx, k, c)
        out.append(idx)
    return out


def _chunk(idx: Tensor, k: int, c: int) -> Tensor:
    size = -(-len(idx) // k)
    return idx[c * size:(c + 1) * size]


def _cuts(placements, mesh_shape: tuple[int, ...], ndim: int) -> dict[int, list[tuple[int, int]]]:
    """{tensor dim: [(mesh dim, split factor of a strided cut, or 0: a chunk)]} in the order they apply."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    per_dim: dict[int, list] = {}
    for mesh_dim, pl in enumerate(placements):
        if isinstance(pl, (_StridedShard, Shard)):
            per_dim.setdefault(pl.dim % max(1, ndim), []).append((mesh_dim, pl))
        elif not isinstance(pl, Replicate):
            raise ValueError(f"placement {pl} holds no part of the full value")
    return {d: _cut_order(shards, mesh_shape) for d, shards in per_dim.items()}


def _cut_order(shards: list, mesh_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    from torch.distributed.tensor.placement_types import _StridedShard

    if not shards:
        return []
    (mesh_dim, pl), rest = shards[0], shards[1:]
    after = _cut_order(rest, mesh_shape)
    if not isinstance(pl, _StridedShard):
        return [(mesh_dim, 0)] + after
    if rest and math.prod(mesh_shape[m] for m, _ in rest) == pl.split_factor:
        return after + [(mesh_dim, 0)]  # FSDP2 + TP: the tensor-parallel piece first, then its dp rows
    return [(mesh_dim, pl.split_factor)] + after


def _fsdp_strided(placements, mesh_shape: tuple[int, ...], ndim: int) -> bool:
    """Whether FSDP2 + TP's strided shard is among ``placements`` (cut otherwise than torch's offsets say)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(placements[m], _StridedShard) and not strided
               for order in _cuts(placements, mesh_shape, ndim).values() for m, strided in order)


def _dtensor_box(live, name: str) -> tuple[tuple[slice, ...], tuple, Problem | None]:
    """The slice of the file this rank reads for a DTensor, the indices to keep of it (where its rows are not
    contiguous), or why its part cannot be worked out."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements, shape = live.device_mesh, tuple(live.placements), tuple(live.shape)
    coordinate = mesh.get_coordinate()
    local_shape = tuple(live._local_tensor.shape)
    if coordinate is None:  # not on this DTensor's mesh: it holds nothing
        return tuple(slice(0, 0) for _ in shape), (), None
    problem = Problem(f"`{name}` is a DTensor with placements {placements} on a mesh of shape {tuple(mesh.shape)}, "
                      "and which part of it this rank holds cannot be worked out",
                      "load it into a model with Shard/Replicate placements, or save its full weights with "
                      "save_safetensors and load them before distributing", name)
    if all(type(pl) in (Shard, Replicate) for pl in placements):  # torch's chunks: one block, as local_index says
        try:
            torch_shape, torch_offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        except (ValueError, AssertionError, NotImplementedError) as exc:
            return (), (), Problem(f"{problem.what} ({exc})", problem.fix, name)
        if tuple(torch_shape) != local_shape:
            return (), (), Problem(f"{problem.what} (its local tensor has shape {local_shape}, the placements say "
                                   f"{tuple(torch_shape)})", problem.fix, name)
        return tuple(slice(o, o + n) if n else slice(0, 0) for o, n in zip(torch_offset, torch_shape)), (), None
    try:
        index = local_index(shape, tuple(mesh.shape), coordinate, placements)
        mine = tuple(len(i) for i in index)
        if not _fsdp_strided(placements, tuple(mesh.shape), len(shape)):  # torch agrees on shape and offsets
            torch_shape, torch_offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            if mine != tuple(torch_shape) or any(len(i) and int(i[0]) != off for i, off in zip(index, torch_offset)):
                raise ValueError(f"computed {mine}, torch's {tuple(torch_shape)} at {tuple(torch_offset)}")
    except (ValueError, AssertionError, NotImplementedError) as exc:
        return (), (), Problem(f"{problem.what} ({exc})", problem.fix, name)
    if mine != local_shape:  # the live local tensor is the authority on its shape
        return (), (), Problem(f"{problem.what} (its local tensor has shape {local_shape}, the placements say "
                               f"{mine})", problem.fix, name)
    box, take = [], []
    for d, i in enumerate(index):
        if not len(i):
            box.append(slice(0, 0))
            continue
        lo, hi = int(i.min()), int(i.max()) + 1
        box.append(slice(lo, hi))
        if hi - lo != len(i) or not torch.equal(i, torch.arange(lo, hi)):
            take.append((d, i - lo))  # not one contiguous run: read the covering slice, keep these
    return tuple(box), tuple(take), None


# ---------------------------------------------------------------------- what the checkpoint holds
def _files(path: Path) -> tuple[dict[str, Path] | None, list[Problem]]:
    """{checkpoint key: file} from an index; ``{"": file}`` for a single file (all its keys)."""
    fix = "pass a .safetensors file or a directory that save_pretrained or save_safetensors wrote"
    if not path.exists():
        return None, [Problem("it does not exist", fix)]
    if path.is_file():
        return {"": path}, []
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if (path / INDEX).exists() or len(indexes) == 1:
        index = path / INDEX if (path / INDEX).exists() else indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return None, [Problem(f"its index {index.name} cannot be read ({type(exc).__name__}: {exc})", fix)]
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            return None, [Problem(f"its index {index.name} names files that are not there: "
                                  + ", ".join(missing), "copy the missing shard files into the directory", None)]
        return {k: path / f for k, f in weight_map.items()}, []
    singles = [path / WEIGHTS] if (path / WEIGHTS).exists() else sorted(path.glob("*.safetensors"))
    if len(singles) != 1:
        found = ", ".join(f.name for f in singles) or "no .safetensors file"
        return None, [Problem(f"it holds no {INDEX} and not one {WEIGHTS} ({found})", fix)]
    return {"": singles[0]}, []


def read_headers(path: str | Path) -> tuple[dict[str, Stored], list[Problem]]:
    """Every tensor of the checkpoint at ``path`` (key, file, shape, dtype), from the files' headers alone."""
    from safetensors import safe_open

    path = Path(path)
    keys, problems = _files(path)
    if problems:
        return {}, problems
    by_file: dict[Path, list[str]] = {}
    for key, file in keys.items():
        by_file.setdefault(file, []).append(key)
    stored: dict[str, Stored] = {}
    for file, wanted in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:  # safetensors checks the header against the file
                have = set(f.keys())
                starts = _data_offsets(file)
                for key in (sorted(have) if wanted == [""] else wanted):
                    if key not in have:
                        problems.append(Problem(f"the index maps `{key}` to {file.name}, which has no such tensor",
                                                "write the checkpoint again (its index and files disagree)", key))
                        continue
                    piece = f.get_slice(key)
                    stored[key] = Stored(key, file, tuple(piece.get_shape()), piece.get_dtype(), starts[key])
        except Exception as exc:  # a damaged or foreign file: safetensors' own error names it
            problems.append(Problem(f"{file.name} cannot be read ({type(exc).__name__}: {exc})",
                                    "check that the file is a complete .safetensors file", None))
    return stored, problems


def _data_offsets(file: Path) -> dict[str, int]:
    """{key: where its data starts in ``file``}: the header is 8 bytes of its length (little-endian), then JSON
    whose entries' ``data_offsets`` count from the header's end."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {key: 8 + n + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"}


# ---------------------------------------------------------------------- load
def _renamer(key_map: KeyMap | None) -> Callable[[str], str | None]:
    if key_map is None:
        return lambda key: key
    if callable(key_map):
        return key_map
    prefixes = sorted(key_map.items(), key=lambda kv: -len(kv[0]))  # the longest matching prefix wins

    def rename(key: str) -> str | None:
        for old, new in prefixes:
            if key.startswith(old):
                return None if new is None else new + key[len(old):]
        return key

    return rename


def _converts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a value of ``src`` loads into a ``dst`` tensor: the same dtype, float to float (any precision),
    or an integer type into one that holds all its values."""
    if src == dst or (src.is_floating_point and dst.is_floating_point) or (src.is_complex and dst.is_complex):
        return True
    if torch.bool in (src, dst) or src.is_floating_point or dst.is_floating_point or src.is_complex \
            or dst.is_complex:
        return False
    a, b = torch.iinfo(src), torch.iinfo(dst)
    return b.min <= a.min and a.max <= b.max


def _shape_of(live: Tensor) -> tuple[int, ...]:
    """The global shape (a fully_shard 0-d parameter's flat shard: its spec's)."""
    spec = spec_of(live)
    return tuple(spec.shape) if spec is not None and not is_dtensor(live) else tuple(live.shape)


def _tensors(model: nn.Module) -> list[tuple[tuple[str, ...], Tensor]]:
    """The state dict's tensors, each once, with all its FQNs in state_dict order (tied weights: several)."""
    names: dict[int, list[str]] = {}
    live: dict[int, Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, Tensor):
            names.setdefault(id(t), []).append(name)
            live[id(t)] = t
    return [(tuple(n), live[i]) for i, n in names.items()]


def _plan(model: nn.Module, stored: dict[str, Stored], key_map: KeyMap | None,
          strict: bool) -> tuple[list[_Read], list[Problem], dict[str, tuple[str, ...]]]:
    """How this rank reads each tensor of the model, or every problem: the model's tensors' (state_dict order),
    then the file's entries it does not have."""
    kind = type(model).__name__
    targets = _tensors(model)
    by_name, unmatched, problems = _match(stored, _renamer(key_map), {n for names, _ in targets for n in names})
    plan, missing = [], []
    for names, live in targets:
        found = [by_name[n] for n in names if n in by_name]
        if not found:
            if strict:
                problems.append(_missing(names, kind, unmatched))
            else:
                missing.append(names[0])
            continue
        entry = found[0]
        shown = f"`{names[0]}`" + (f" (`{entry.key}` in {entry.file.name})" if entry.key != names[0]
                                   else f" (in {entry.file.name})")
        located = _fits(entry, live, shown, kind, names[0]) or _locate(entry, live, names)
        if isinstance(located, Problem):
            problems.append(located)
        else:
            plan.append(located)
    if strict:
        problems += [Problem(f"`{entry.key}` in {entry.file.name} is not in {kind}'s state dict"
                             + (f" (as `{name}`)" if name != entry.key else ""),
                             "pass strict=False to skip the entries the model does not have, or map the file's keys "
                             "onto the model's with key_map", entry.key) for name, entry in unmatched]
    return plan, problems, {"missing": tuple(missing), "unexpected": tuple(entry.key for _, entry in unmatched)}


def _match(stored: dict[str, Stored], rename: Callable[[str], str | None],
           model_names: set[str]) -> tuple[dict[str, Stored], list[tuple[str, Stored]], list[Problem]]:
    """{model key: entry}, the (renamed key, entry) pairs the model does not have, and key_map's problems."""
    by_name: dict[str, Stored] = {}
    unmatched, problems = [], []
    for key, entry in stored.items():
        try:
            name = rename(key)
        except Exception as exc:
            problems.append(Problem(f"key_map raised {type(exc).__name__}: {exc} for `{key}`",
                                    "make key_map return a model key, or None to skip the entry", key))
            continue
        if name is None:
            continue
        if name in by_name:
            problems.append(Problem(f"`{key}` and `{by_name[name].key}` both map to `{name}`",
                                    "make key_map send each entry to its own model key", name))
        elif name in model_names:
            by_name[name] = entry
        else:
            unmatched.append((name, entry))
    return by_name, unmatched, problems


def _missing(names: tuple[str, ...], kind: str, unmatched: list[tuple[str, Stored]]) -> Problem:
    """A tensor the checkpoint lacks; the fix names a prefix map where an entry it does not match ends alike."""
    also = (f" (nor under its tied name{'s' if len(names) > 2 else ''} "
            + ", ".join(f"`{n}`" for n in names[1:]) + ")") if len(names) > 1 else ""
    fix = "load a checkpoint of this model's configuration, or map the file's keys onto the model's with key_map"
    for name in names:
        for key, _ in unmatched:
            if key.endswith("." + name):
                fix += f'={{"{key[:-len(name)]}": ""}} (the file has `{key}`)'
                break
            if name.endswith("." + key):
                fix += f'={{"": "{name[:-len(key)]}"}} (the file has `{key}`)'
                break
        else:
            continue
        break
    return Problem(f"`{names[0]}` of {kind} is not in the checkpoint{also}", fix, names[0])


def _fits(entry: Stored, live: Tensor, shown: str, kind: str, name: str) -> Problem | None:
    shape, dtype = _shape_of(live), DTYPES.get(entry.dtype)
    if entry.shape != shape:
        return Problem(f"{shown} has shape {entry.shape} in the checkpoint but {shape} in {kind}",
                       f"build the {kind} with the configuration the checkpoint was saved from", name)
    if dtype is None or not _converts(dtype, live.dtype):
        return Problem(f"{shown} is {entry.dtype} in the checkpoint and does not convert to {kind}'s "
                       f"{str(live.dtype).removeprefix('torch.')}",
                       "load it into a tensor of a dtype that holds its values (floating point to floating "
                       "point; integers to a wider integer type)", name)
    return None


def _locate(entry: Stored, live: Tensor, names: tuple[str, ...]) -> _Read | Problem:
    """How this rank reads its part of ``entry`` into ``live``."""
    spec = spec_of(live)
    if is_dtensor(live):
        box, take, problem = _dtensor_box(live, names[0])
        return problem or _Read(names, live, entry, box, take)
    return _Read(names, live, entry, None, shard=spec)


def _read(plan: list[_Read]) -> tuple[list[Tensor | None], LoadReport | None, list[Problem], bool]:
    """Every planned part, with plain reads (``os.preadv``) of its bytes: straight into the live tensor where that is
    a CPU tensor of the file's dtype (the read is the only copy), else into a new tensor, converted to the live
    dtype, that :func:`_commit` puts in place.  Every file is opened first, then read one at a time, its parts in
    the order they lie in it.  Returns the new tensors (None: read in place), the report, the problems, and
    whether a live tensor was written (a failure after that leaves the model partly loaded)."""
    staged: list[Tensor | None] = [None] * len(plan)
    read = total = 0
    wrote = False
    by_file: dict[Path, list[int]] = {}
    for i, r in enumerate(plan):
        by_file.setdefault(r.source.file, []).append(i)
    fds: dict[Path, int] = {}
    file = None
    try:
        for file in by_file:  # a file this rank cannot open fails the load before any tensor changes
            fds[file] = os.open(file, os.O_RDONLY)
        for file, items in by_file.items():
            for i in sorted(items, key=lambda i: plan[i].source.offset):
                r = plan[i]
                dtype = DTYPES[r.source.dtype]
                total += math.prod(r.source.shape) * dtype.itemsize
                box = r.box if r.box is not None else tuple(slice(0, n) for n in r.source.shape)
                shape = tuple(s.stop - s.start for s in box)
                runs = _runs(r.source.shape, box, dtype.itemsize)
                local = _in_place(r, dtype, shape)
                if local is not None:
                    wrote = True
                    _pread(fds[file], local, runs, r.source.offset)
                    torch.autograd.graph.increment_version(local)  # as an in-place op would
                    read += local.numel() * dtype.itemsize
                    continue
                value = torch.empty(shape, dtype=dtype)
                _pread(fds[file], value, runs, r.source.offset)
                read += value.numel() * dtype.itemsize
                for dim, keep in r.take:
                    value = value.index_select(dim, keep)
                value = value.to(r.live.dtype)
                staged[i] = r.shard.shard_of(value) if r.shard is not None else value
    except Exception as exc:
        return [], None, [Problem(f"reading {file.name} failed ({type(exc).__name__}: {exc})",
                                  "check that the file is complete and readable from every rank", None)], wrote
    finally:
        for fd in fds.values():
            os.close(fd)
    report = LoadReport(bytes_read=read, bytes_total=total, tensors=len(plan), files=len(by_file))
    return staged, report, [], wrote


def _in_place(r: _Read, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor | None:
    """The live tensor to read ``r``'s part straight into, or None: it is read into a new tensor (a meta, non-CPU
    or non-contiguous tensor, another dtype, rows to pick or a shard to cut)."""
    if r.take or r.shard is not None or sys.byteorder != "little":  # safetensors' data is little-endian
        return None
    local = r.live._local_tensor if is_dtensor(r.live) else r.live
    if local.is_meta or local.device.type != "cpu" or local.dtype != dtype or tuple(local.shape) != shape \
            or not local.is_contiguous():
        return None
    return local.detach()


def _runs(shape: tuple[int, ...], box: tuple[slice, ...], itemsize: int) -> list[tuple[int, int]]:
    """(byte offset in the tensor's data, bytes) of each contiguous run of ``box`` in a row-major tensor of
    ``shape``, in the box's row-major order: one run per index of the dims before the last dim it cuts."""
    lengths = [s.stop - s.start for s in box]
    if math.prod(lengths) == 0:
        return []
    if not shape:
        return [(0, itemsize)]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    cut = max((d for d in range(len(shape)) if lengths[d] != shape[d]), default=0)
    run = lengths[cut] * strides[cut] * itemsize
    first = box[cut].start * strides[cut]
    if cut == 1:  # a column block of a matrix (row-wise tensor parallelism): one run per row
        return [((first + i * strides[0]) * itemsize, run) for i in range(box[0].start, box[0].stop)]
    outer = itertools.product(*(range(box[d].start, box[d].stop) for d in range(cut)))
    return [((first + sum(i * st for i, st in zip(index, strides))) * itemsize, run) for index in outer]


def _pread(fd: int, into: Tensor, runs: list[tuple[int, int]], start: int) -> None:
    """Read ``runs`` (offsets from ``start``, the tensor's data in the file) one after the other into ``into``'s
    memory (contiguous)."""
    if not runs:
        return
    dest = memoryview(into.view(-1).view(torch.uint8).numpy())
    pos = 0
    for offset, n in runs:
        got = os.preadv(fd, [dest[pos:pos + n]], start + offset)
        while got < n:  # a short read (e.g. over 2 GiB at once): the rest
            more = os.preadv(fd, [dest[pos + got:pos + n]], start + offset + got)
            if not more:
                raise OSError(f"the file ends at byte {start + offset + got}, before the data its header places there")
            got += more
        pos += n


def _holders(model: nn.Module, live: Tensor) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, "_parameters"/"_buffers") for every place that holds ``live``."""
    out = []
    for m in model.modules():
        for where in ("_parameters", "_buffers"):
            out += [(m, name, where) for name, t in getattr(m, where).items() if t is live]
    return out


def _materialize(model: nn.Module, live: Tensor, value: Tensor) -> None:
    """A meta tensor becomes a real one holding ``value`` in every module that holds it (tied: the same).  A
    parameter ``parallelize`` sharded for ``fully_shard`` keeps its layout, as ``to_empty`` keeps it: its shard
    spec, and the padded flat buffer the step reads, made around the loaded rows."""
    spec = spec_of(live)
    if is_dtensor(live):
        from torch.distributed.tensor import DTensor

        mesh = live.device_mesh
        if mesh.device_type != "cpu":
            value = value.to(torch.device(mesh.device_type, torch.get_device_module(mesh.device_type)
                                          .current_device()))
        value = DTensor.from_local(value, mesh, live.placements, run_check=False, shape=live.shape,
                                   stride=live.stride())
    new = nn.Parameter(value, requires_grad=live.requires_grad) if isinstance(live, nn.Parameter) else value
    if spec is not None:
        setattr(new, SHARD_ATTR, spec)
        flat_of(new, spec).requires_grad_(live.requires_grad)  # (the local tensor becomes a view of it)
    for m, name, where in _holders(model, live):
        getattr(m, where)[name] = new


def _commit(model: nn.Module, plan: list[_Read], staged: list[Tensor | None]) -> None:
    with torch.no_grad():
        for r, value in zip(plan, staged):
            if value is None:  # read in place
                continue
            local = r.live._local_tensor if is_dtensor(r.live) else r.live
            if local.is_meta:
                _materialize(model, r.live, value)
            else:
                local.copy_(value.reshape(local.shape))


def load_safetensors(model: nn.Module, path: str | Path, *, key_map: KeyMap | None = None,
                     strict: bool = True) -> LoadReport:
    """Load Hugging Face safetensors weights into ``model`` (collective where the model is distributed).

    ``path``: a ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` and its shards,
    or with one ``model.safetensors``.  Every entry of ``model.state_dict()`` (parameters and persistent
    buffers, by FQN; a tied weight under any of its names) is read, converted to the live dtype (a bf16
    file into fp32 parameters) and copied into the live tensor in place (a CPU tensor of the file's dtype:
    read into it directly, with no copy but the read).

    What each rank reads: a DTensor's own part (``fully_shard``'s rows, a tensor-parallel shard, FSDP2 + TP's
    dp rows of the tp piece), sliced from the file; where that part is not one contiguous block (a strided
    shard whose rows interleave) the smallest slice covering it, then its rows; a plain tensor (replicated,
    or a ``fully_shard`` model before its first step or ``step.prepare``) in whole.  A meta tensor becomes a
    real one on CPU (a meta DTensor: over the loaded part, on its mesh), replaced in every module that holds it.

    ``key_map`` renames the file's keys: a callable (file key -> model key, or None to skip the entry), or a
    dict of prefix replacements (``{"model.": ""}``; the longest matching prefix wins, a None value skips).
    Entries the model has and the file lacks (missing) or the file has and the model lacks (unexpected): with
    ``strict`` (the default) problems, with ``strict=False`` skipped and listed in the report, as
    ``load_state_dict`` does (a missing tensor of a meta model stays on meta; the step then names it).  Missing
    and unexpected entries under ``strict``, shapes other than the global shape, dtypes that do not convert,
    unreadable files: one :class:`~spmd_ort.errors.CheckpointError` on every rank
    listing every problem, and nothing changed (all are found before anything is read; only a read that fails
    midway, an I/O error, can leave the model partly loaded, and its error says so).  Returns this rank's
    :class:`LoadReport`.
    """
    where = str(path)
    stored, problems = read_headers(path)
    plan: list[_Read] = []
    skipped: dict[str, tuple[str, ...]] = {}
    if not problems:
        plan, problems, skipped = _plan(model, stored, key_map, strict)
    _agree(where, model, problems)
    staged, report, problems, wrote = _read(plan)
    _agree(where, model, problems, partly=wrote)
    _commit(model, plan, staged)
    del staged
    release_free_host_memory()  # the staging copies' memory back to the system: resident memory is the share
    return dataclasses.replace(report, **skipped)


# ---------------------------------------------------------------------- the ranks agree
def _agree(path: str, model: nn.Module | None, problems: list[Problem], *, loading: bool = True,
           partly: bool = False) -> None:
    """Every rank raises one CheckpointError if any rank has a problem (the lowest failing rank's list);
    ``partly``: this rank has already read some tensors in place (its error says so)."""
    into = f" into {type(model).__name__}" if model is not None else ""
    head = (lambda p: f"cannot load `{p}`{into}") if loading else (lambda p: f"cannot save safetensors to `{p}`")
    agree("loading safetensors" if loading else "saving safetensors", path, problems, head, fixes=True,
          after=(PARTLY_LOADED if partly else NOTHING_LOADED) if loading else "")


# ---------------------------------------------------------------------- save
def _full(t: Tensor) -> Tensor:
    """The full value of a state dict tensor (collective for a sharded or DTensor one: every rank calls it)."""
    if spec_of(t) is not None:
        t = gather_full(t)  # fully_shard (2-D: the tensor-parallel DTensor)
    if is_dtensor(t):
        t = t.full_tensor()
    return t.detach()


class _ShardWriter:
    """Rank 0's writer: tensors in state_dict order, a file as soon as the next tensor would not fit."""

    def __init__(self, root: Path, limit: int):
        self.root, self.limit = root, limit
        self.bucket: dict[str, Tensor] = {}
        self.size = self.total = 0
        self.files: list[list[str]] = []

    def add(self, key: str, value: Tensor) -> None:
        n = value.numel() * value.element_size()
        if self.bucket and self.size + n > self.limit:
            self._flush()
        self.bucket[key] = value
        self.size += n
        self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        part = self.root / f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self.bucket, str(part), metadata={"format": "pt"})
        _fsync(part)
        self.files.append(list(self.bucket))
        self.bucket, self.size = {}, 0

    def finish(self) -> None:
        """The last file, the final names (``-of-`` the count, known only now) and the index."""
        if self.bucket or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.root / "part-00001.safetensors", self.root / WEIGHTS)
        else:
            weight_map = {}
            for k, keys in enumerate(self.files, 1):
                name = f"model-{k:05d}-of-{n:05d}.safetensors"
                os.replace(self.root / f"part-{k:05d}.safetensors", self.root / name)
                weight_map.update(dict.fromkeys(keys, name))
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.root / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            _fsync(self.root / INDEX)
        _fsync(self.root)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _start(target: Path) -> tuple[Path | None, list[Problem]]:
    """Rank 0's new directory next to ``target`` (same parent, so that the final rename is atomic)."""
    fix = "choose a directory path in a writable location (it is created if missing)"
    if target.exists() and not target.is_dir():
        return None, [Problem("it is a file, and the weights are a directory", fix)]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        new = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        new.mkdir()  # (not mkdtemp: its mode 0o700 would become the weights' directory's)
        return new, []
    except OSError as exc:
        return None, [Problem(f"cannot create a directory in {target.parent} ({type(exc).__name__}: {exc})", fix)]


_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _is_weight_file(name: str) -> bool:
    """A file of a saved model's weights (ours, or Hugging Face's names): what a new save replaces."""
    return name in (WEIGHTS, INDEX) or _SHARD_NAME.fullmatch(name) is not None


def _swap(new: Path, target: Path) -> None:
    """The weights written in ``new`` go to ``target``.  A new ``target`` is ``new`` renamed (atomic).  In an
    existing one, as Hugging Face's ``save_pretrained`` does, only the weight files are replaced and the rest is
    kept (``config.json``, a tokenizer, notes, other checkpoints in subdirectories): each new file is renamed in
    (the index last), then the old weight files the new set does not name are deleted."""
    if not target.exists():
        os.replace(new, target)
        return
    written = sorted(p.name for p in new.iterdir())
    for name in sorted(written, key=lambda n: n == INDEX):  # the index last: it names files already in place
        os.replace(new / name, target / name)
    for old in target.iterdir():
        if old.is_file() and _is_weight_file(old.name) and old.name not in written:
            old.unlink()
    _fsync(target)
    shutil.rmtree(new, ignore_errors=True)


def save_safetensors(model: nn.Module, directory: str | Path, *, max_shard_bytes: int = 5 * 2**30,
                     dtype: torch.dtype | None = None) -> None:
    """Write ``model``'s full weights to ``directory`` in Hugging Face's layout (collective: every rank calls it).

    ``model.safetensors`` when they fit in one file of ``max_shard_bytes``, else ``model-0000k-of-0000n``
    shards and ``model.safetensors.index.json``; keys are ``model.state_dict()``'s, a tied weight under its
    first name; ``dtype`` casts floating-point tensors (e.g. ``torch.bfloat16``); metadata ``{"format": "pt"}``.
    Each tensor is gathered in turn (sharded and DTensor ones: every rank takes part) and rank 0 writes each
    file as soon as it is full, so no rank holds more than ``max_shard_bytes`` plus one full tensor.

    Rank 0 writes into a new directory next to ``directory`` and renames it into place when complete; into an
    existing ``directory`` it moves the new weight files (the index last) and deletes the old weight files they
    replace (``model.safetensors``, ``model-*-of-*.safetensors``, the index), keeping everything else in it, as
    Hugging Face's ``save_pretrained`` does (``config.json``, a tokenizer, notes, subdirectories).  The path is
    rank 0's (a shared file system, or the weights stay on its node).
    A failure on rank 0 raises :class:`~spmd_ort.errors.CheckpointError` on every rank.
    """
    target = Path(directory)
    rank, _ = parallel.world()
    sync_stages(model)  # (a pipeline: each stage's weights from the rank stepping them)
    tensors = _tensors(model)
    meta = [names[0] for names, t in tensors if (t._local_tensor if is_dtensor(t) else t).is_meta]
    problems = [Problem(f"`{meta[0]}`" + (f" and {len(meta) - 1} more tensors are" if len(meta) > 1 else " is")
                        + " on the meta device", "load or initialise the weights before saving them", meta[0])] \
        if meta else []
    new = None
    if rank == 0 and not problems:
        new, problems = _start(target)
    _agree(str(directory), None, problems, loading=False)
    writer = _ShardWriter(new, max_shard_bytes) if rank == 0 else None
    failed: list[Problem] = []
    for names, t in tensors:
        full = _full(t)
        if writer is None or failed:
            continue
        try:
            value = full.to("cpu")
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            own = t._local_tensor if is_dtensor(t) else t
            if value.untyped_storage().data_ptr() == own.untyped_storage().data_ptr() or not value.is_contiguous():
                value = value.contiguous().clone()  # the live tensor itself: a copy of its own to write
            writer.add(names[0], value)
        except (OSError, RuntimeError, ValueError) as exc:
            failed.append(Problem(f"writing `{names[0]}` failed ({type(exc).__name__}: {exc})",
                                  "make sure the directory's file system is writable and has room", names[0]))
    if writer is not None and not failed:
        try:
            writer.finish()
            _swap(new, target)
        except (OSError, RuntimeError, ValueError) as exc:
            failed.append(Problem(f"writing the files failed ({type(exc).__name__}: {exc})",
                                  "make sure the directory's file system is writable and has room", None))
    if failed and new is not None:
        shutil.rmtree(new, ignore_errors=True)
    _agree(str(directory), None, failed, loading=False)
