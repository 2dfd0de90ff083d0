"""spmd_ort changes nothing of its host process that the user did not ask for: no import hooks, no filters on other
libraries' loggers, no environment variables, no allocator setting; its loggers are named after their modules, and
only spmd_ort/options.py reads SPMD_ORT_* variables."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spmd_ort
from helpers import train_step
from models import MLP

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "spmd_ort").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])
OPTIONS = ROOT / "spmd_ort" / "options.py"
CHANNELS = {"spmd_ort.progress"}  # loggers named for what they carry (long compiles' progress), not a module

IMPORT_SCRIPT = """
import json, logging, os, sys, warnings
sys.path.insert(0, {root!r})
import torch  # torch's own import is not ours to judge

def loggers():
    return {{name: [type(f).__module__ + "." + type(f).__qualname__ for f in lg.filters]
            for name, lg in logging.Logger.manager.loggerDict.items()
            if isinstance(lg, logging.Logger) and not name.startswith("spmd_ort")}}

before = {{"meta_path": [repr(f) for f in sys.meta_path], "environ": dict(os.environ), "loggers": loggers(),
          "root_handlers": len(logging.getLogger().handlers), "factory": repr(logging.getLogRecordFactory())}}
import spmd_ort
from spmd_ort.backends.ort import coverage, executor, export  # the exporter's loggers are filtered while exporting
import spmd_ort.passes
after = {{"meta_path": [repr(f) for f in sys.meta_path], "environ": dict(os.environ), "loggers": loggers(),
         "root_handlers": len(logging.getLogger().handlers), "factory": repr(logging.getLogRecordFactory())}}
print(json.dumps({{"before": before, "after": after}}))
"""


def test_importing_spmd_ort_changes_nothing_of_the_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMD_ORT_")}
    proc = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = seen["before"], seen["after"]
    assert after["meta_path"] == before["meta_path"]
    assert after["environ"] == before["environ"]
    assert after["root_handlers"] == before["root_handlers"] and after["factory"] == before["factory"]
    # no logger outside spmd_ort carries a filter of ours (torch's exporter loggers are filtered only while exporting)
    ours = {name: [f for f in filters if f.startswith(("spmd_ort.", "passes."))]
            for name, filters in after["loggers"].items()}
    assert not {name: f for name, f in ours.items() if f}, ours
    for name, filters in before["loggers"].items():
        assert after["loggers"].get(name) == filters, name


def test_exporter_log_filters_are_removed_after_the_export(fresh_cache):
    import logging

    from spmd_ort.backends.ort import coverage

    def ours():
        return [f for name in coverage.EXPORTER_LOGGERS for f in logging.getLogger(name).filters
                if isinstance(f, coverage._DropIrrelevant)]

    with coverage.exporter_logs_filtered():
        assert len(ours()) == len(coverage.EXPORTER_LOGGERS)
    assert not ours()
    model = MLP()
    step = spmd_ort.compile(backend="ort")(train_step)
    step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert step.compiled.executor.segments and not ours()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_ORT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("asked", [None, "0", "1"])
def test_the_host_allocator_is_set_only_when_asked(monkeypatch, asked):
    """glibc's mallopt acts on the whole process: a compiled step calls it only under SPMD_ORT_RETAIN_HOST_MEMORY=1."""
    from spmd_ort import step as step_module

    calls = []
    monkeypatch.setattr(step_module, "retain_host_memory", lambda: calls.append(1) or True)
    if asked is None:
        monkeypatch.delenv("SPMD_ORT_RETAIN_HOST_MEMORY", raising=False)
    else:
        monkeypatch.setenv("SPMD_ORT_RETAIN_HOST_MEMORY", asked)
    model = MLP()
    step = spmd_ort.compile(backend="fx")(train_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert step.options.retain_host_memory == (asked == "1")
    assert calls == ([1] if asked == "1" else [])


def _module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "passes"):
        parts = ("spmd_ort", "passes", *path.relative_to(ROOT / "passes").with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _logger_call(node: ast.AST) -> bool:
    """``logging.getLogger(...)`` or ``get_logger(...)``."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "getLogger" and isinstance(func.value, ast.Name)
            and func.value.id == "logging") or (isinstance(func, ast.Name) and func.id in ("get_logger", "getLogger"))


def test_every_module_logs_to_a_logger_named_after_it():
    """``logging.getLogger("spmd_ort")`` appears only where the parent is configured (options.py); each module logs
    to ``get_logger(__name__)`` (a child of ``spmd_ort``: ``spmd_ort.passes.*`` for the passes), and named channels
    (``spmd_ort.progress``) are children of ``spmd_ort`` too."""
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT)
        assert _module_name(path).startswith("spmd_ort")
        for node in ast.walk(tree):
            if not _logger_call(node) or not node.args:
                continue
            arg = node.args[0]
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                continue  # __name__, or other libraries' loggers named by a variable (checked at run time above)
            name = arg.value
            if not name.startswith("spmd_ort"):
                continue  # another library's logger (torch's, quieted for a block)
            if path == OPTIONS or name in CHANNELS:
                continue  # the parent, configured in options.py; a named channel
            bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        for node in tree.body:  # a module-level `logger = ...` is its module's logger
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "logger" for t in node.targets)
                    and path != OPTIONS):
                value = node.value
                if not (_logger_call(value) and value.args and isinstance(value.args[0], ast.Name)
                        and value.args[0].id == "__name__"):
                    bad.append(f"{rel}:{node.lineno}: logger = {ast.unparse(value)}")
    assert not bad, "loggers not named after their module:\n" + "\n".join(bad)


def _environ_reads(tree: ast.AST):
    """(line, string constants) of each ``os.environ[...]``, ``os.environ.get/pop/setdefault(...)``,
    ``os.getenv(...)`` and ``"..." in os.environ``."""
    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os")

    for node in ast.walk(tree):
        keys = None
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (is_environ(f.value) and f.attr in ("get", "pop", "setdefault")) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                keys = node.args[:1]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys = [node.left]
        if keys is not None:
            yield node.lineno, [k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def test_only_options_reads_spmd_ort_variables():
    bad = []
    for path in SOURCES:
        if path == OPTIONS:
            continue
        for line, keys in _environ_reads(ast.parse(path.read_text())):
            if any(k.startswith("SPMD_ORT_") for k in keys):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {keys}")
    assert not bad, "SPMD_ORT_* read outside spmd_ort/options.py (make it an Options field):\n" + "\n".join(bad)
