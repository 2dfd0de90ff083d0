"""Import paths of the flat layout that earlier READMEs documented, kept importable.

The modules now live in the stage subpackages (``capture``, ``runtime``, ``ort``,
``distributed``, ``integrations``, ``debug``); ``import spmd_ort.memory`` and
``from spmd_ort.memory import retain_host_memory`` still work and give the very
module object of the new path, imported only when asked for (so ``import spmd_ort``
does not import onnxruntime).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "spmd_ort.amp": "spmd_ort.capture.amp",
    "spmd_ort.coverage": "spmd_ort.ort.coverage",
    "spmd_ort.data": "spmd_ort.distributed.data",
    "spmd_ort.ds_schedules": "spmd_ort.integrations.deepspeed.schedules",
    "spmd_ort.executor": "spmd_ort.runtime.executor",
    "spmd_ort.export": "spmd_ort.ort.export",
    "spmd_ort.memory": "spmd_ort.runtime.memory",
    "spmd_ort.native": "spmd_ort.runtime.native",
    "spmd_ort.optim": "spmd_ort.capture.optim",
    "spmd_ort.partition": "spmd_ort.ort.partition",
    "spmd_ort.sharding": "spmd_ort.distributed.sharding",
    "spmd_ort.transition": "spmd_ort.capture.transition",
    "spmd_ort.translations": "spmd_ort.ort.translations",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as the module of its new path."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        # imported already, under its new name; the import system gave it the old path's spec: give it back its own
        module.__spec__ = importlib.util.find_spec(module.__name__)


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
