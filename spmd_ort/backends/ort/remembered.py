"""The automatic choice's decisions, remembered across runs of the same program on the same machine.

The default backend measures before it chooses: each ORT segment against its fx graph, the whole step as
chosen against the whole graph on fx (:mod:`spmd_ort.backends.ort.choice`), and, once the program has run long
enough to pay for it, the whole graph compiled by inductor (:mod:`spmd_ort.tuner`).  A user who restarts the
same run (preemption, a new learning rate, a sweep) would pay for all of it again, and would wait hundreds of
steps again for an inductor candidate that won last time.  So what was chosen, and the times that chose it,
go to ``<cache_dir>/choices/<key>.json`` (``SPMD_ORT_CACHE_DIR``; ``SPMD_ORT_REMEMBER_CHOICES=0`` turns it
off), where ``key`` (:func:`choices_key`) is made of what decides them:

* the finished graph before partitioning: its ops in order, their arguments, every value's shape, dtype and
  strides, its constants (the exported-model cache's :func:`~spmd_ort.backends.ort.export.segment_key`, which
  also holds torch's, ONNX's, ONNX Runtime's and onnxscript's versions);
* the options that choose (``segment_executor``, ``auto_inductor``), the world size;
* the machine: its processor, core count, torch's thread count, the device.

A later run of the program reads the entry (:func:`recall`).  Its first run still runs and checks every ORT
segment against fx (a remembered choice only picks among executors checked in this run: a stale entry can
cost speed, never numbers), but times nothing; the whole step runs on what was chosen; the tuner compiles
inductor's candidate at the first steady step where it won (torch's FX graph cache makes that compile a
fraction of the first) and never where it lost.  Every rank must hold the same entry, else every rank
measures afresh; an entry that does not parse or names other segments is measured again and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx

from spmd_ort.backends.files import write_atomic
from spmd_ort.options import Options
from spmd_ort.runtime.collectives import same_on_every_rank

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the entry's fields change: older entries are then measured again


@lru_cache(maxsize=1)
def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | None = None) -> str:
    """What the times depend on besides the graph: the processor, its cores, torch's threads, the device."""
    where = f"{_processor()}|{os.cpu_count()} cores|{torch.get_num_threads()} threads"
    if device is not None and device.type == "cuda":
        where += f"|{torch.cuda.get_device_name(device)}"
    return where


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def choices_key(gm: fx.GraphModule, options: Options, device: torch.device | None = None) -> str:
    """The name of ``gm``'s entry (``gm``: the finished graph, before partitioning)."""
    from spmd_ort.backends.ort.export import segment_key

    h = hashlib.sha256(segment_key(gm, options.onnx_opset).encode())
    for part in (FORMAT, options.segment_executor, options.auto_inductor, _world(), machine(device)):
        h.update(f"|{part}".encode())
    return h.hexdigest()[:32]


class Remembered:
    """One program's entry: ``data`` holds ``segments`` (name -> {executor, ort_ms, fx_ms}), ``names`` (the
    partition's segments), ``whole`` ({executor, times_ms}) and, once the tuner decided, ``inductor``
    ({outcome: kept | dropped | failed, detail}).  ``recalled``: whether it came from an earlier run (agreed by
    every rank) rather than being written by this one."""

    def __init__(self, path: Path | None, data: dict | None = None, recalled: bool = False):
        self.path, self.data, self.recalled = path, data or {}, recalled

    def segment(self, name: str) -> dict | None:
        return self.data.get("segments", {}).get(name) if self.recalled else None

    @property
    def whole(self) -> dict | None:
        return self.data.get("whole") if self.recalled else None

    @property
    def inductor(self) -> dict | None:
        return self.data.get("inductor") if self.recalled else None

    def update(self, **fields) -> None:
        """Record ``fields`` and write the entry (atomically: a reader never sees half a file)."""
        self.data.update(fields, format=FORMAT)
        if self.path is None:
            return
        try:
            write_atomic(self.path, json.dumps(self.data, indent=1, sort_keys=True).encode())
        except OSError as exc:
            logger.warning("could not write the remembered choices %s: %s", self.path, exc)


def _read(path: Path, names: list[str]) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.info("remembered choices %s do not read (%s): measuring again", path, exc)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("names") != names \
            or not isinstance(data.get("segments"), dict) or not isinstance(data.get("whole"), dict):
        logger.info("remembered choices %s are for another partition or format: measuring again", path)
        return None
    return data


def _digest(data: dict | None) -> int:
    if data is None:
        return -1
    text = json.dumps({k: data[k] for k in ("names", "segments", "whole", "inductor") if k in data},
                      sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def recall(key: str | None, options: Options, names: list[str]) -> Remembered:
    """The entry for ``key`` when every rank read the same one (``names``: this partition's segments), else an
    empty one that this run's choices fill.  Collective on the control group: call it on every rank alike."""
    if key is None:
        return Remembered(None)
    path = Path(options.cache_dir) / "choices" / f"{key}.json"
    data = _read(path, names)
    if not same_on_every_rank(_digest(data)):  # the same entry on every rank, or none used anywhere
        if data is not None:
            logger.info("remembered choices %s differ between the ranks: measuring again", path)
        data = None
    return Remembered(path, {"names": names}, recalled=False) if data is None else Remembered(path, data, True)
