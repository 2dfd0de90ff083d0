"""The shape of the code: no import cycles, no private names across modules, README lists equal to the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from spmd_ort.options import env_table_markdown
from spmd_ort.passes import STAGES, pipeline_markdown

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"spmd_ort": ROOT / "spmd_ort", "spmd_ort.debug": ROOT / "spmd_ort" / "debug", "spmd_ort.passes": ROOT / "passes"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if MODULES[module].stem == "__init__" else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        package = package.rsplit(".", 1)[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import, at any depth (lazy ones too)."""
    out = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (base, alias.name, node.lineno))
    return out


def test_no_import_cycles():
    """Between modules (package __init__ files only re-export, so they are left out of the graph)."""
    inits = {name for name, path in MODULES.items() if path.stem == "__init__"}
    graph = {m: sorted({target for target, _, _ in _imports(m) if target in MODULES and target not in inits})
             for m in MODULES if m not in inits}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for nxt in graph[m]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


def test_no_module_imports_another_modules_private_names():
    bad = []
    for module in MODULES:
        for target, name, line in _imports(module):
            if target in MODULES and name is not None and name.startswith("_") and target != module:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}.{name}")
        tree = ast.parse(MODULES[module].read_text())
        aliases = {a.asname or a.name.split(".")[-1]: f"{_resolve(module, n)}.{a.name}"
                   for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                   if f"{_resolve(module, n)}.{a.name}" in MODULES}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{node.lineno} reads "
                           f"{aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_passes_folder_is_packaged_as_spmd_ort_passes():
    import spmd_ort.passes

    assert Path(spmd_ort.passes.__file__).resolve().parent == ROOT / "passes"
    text = (ROOT / "pyproject.toml").read_text()
    assert '"spmd_ort.passes" = "passes"' in text


def _readme_block(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", text, re.S)
    assert match, f"README.md has no <!-- {name}:begin/end --> block"
    return match.group(1).strip()


def test_readme_pipeline_is_the_pipeline():
    assert _readme_block("pipeline") == pipeline_markdown()


def test_readme_environment_table_is_the_options_table():
    assert _readme_block("env") == env_table_markdown()


@pytest.mark.parametrize("step", STAGES, ids=lambda s: s.name)
def test_every_pass_is_named_documented_and_declares_its_contracts(step):
    if isinstance(step.graph_pass, str):
        return  # user transforms: made per compile
    fn = step.graph_pass
    assert fn.__name__.endswith("_pass")
    assert fn.__doc__ and fn.__doc__.strip(), fn.__name__
    assert hasattr(fn, "requires") and hasattr(fn, "ensures"), f"{fn.__name__} is not declared with @graph_pass"
