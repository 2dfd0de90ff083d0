"""The shape of the code: no import cycles, no private names across modules, README lists equal to the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from spmd_ort import DataParallel, MixedPrecisionPolicy
from spmd_ort.options import env_table_markdown
from spmd_ort.passes import (STAGES, PassContext, PassError, bucket_collectives_pass, build_pipeline, check_order,
                             expand_data_parallel_pass, pipeline_markdown)
from spmd_ort.passes.contracts import traced_facts

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"spmd_ort": ROOT / "spmd_ort", "spmd_ort.passes": ROOT / "passes"}  # each with its subpackages


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
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


# The package order, bottom first: a module imports only from its own unit and the units above it in this list
# (docs/architecture.md says what each holds and why this order).  The op bodies (runtime) sit below the graph's
# vocabulary because an op's definition registers its body; the backends sit below the passes because the
# backend stage's passes ask what a backend can run; a backend never imports a pass.
LAYERS = [
    ("spmd_ort.errors", "the exceptions users catch"),
    ("spmd_ort.compat", "torch-version shims"),
    ("spmd_ort.options", "Options, DebugOptions and every SPMD_ORT_* variable"),
    ("spmd_ort.overrides", "Override / OpaqueOverride: the user's vocabulary for parts that cannot be traced"),
    ("spmd_ort.runtime", "what the graph's ops do when they run: collectives, kernels, checks, the step's context"),
    ("spmd_ort.graph", "the graph's vocabulary: ops, slots, node meta, symbolic sizes, segments, output checks"),
    ("spmd_ort.distributed", "parallel modes, DTensor, shard layouts, tensor-parallel plans"),
    ("spmd_ort.capture", "the step as one stateless graph: inputs, state layout, trace, shapes"),
    ("spmd_ort.backends", "executors: fx, inductor, ONNX Runtime (partition, export, sessions)"),
    ("spmd_ort.passes", "every graph transformation and the pipeline"),
    ("spmd_ort.program", "CompiledProgram: one variant's graph, executor and state IO"),
    ("spmd_ort.buckets", "bucket_cap_mb='auto': the gradient bucket cap from measured steps"),
    ("spmd_ort.tuner", "every decision made from measurements, and the recompiles it causes"),
    ("spmd_ort.compiler", "one variant: trace -> passes -> executor"),
    ("spmd_ort.debug", "explain, statistics, profiles"),
    ("spmd_ort.checkpoint", "DCP checkpoints"),
    ("spmd_ort.integrations", "DeepSpeed configs"),
    ("spmd_ort.plan", "a step planned for N ranks in one process: device specs, roofline, the plan"),
    ("spmd_ort.step", "CompiledStep: one call, top to bottom"),
    ("spmd_ort.api", "compile()"),
    ("spmd_ort", "the public names"),
    ("spmd_ort.integrations.transformers", "the Hugging Face Trainer, compiled; from_pretrained"),
    ("spmd_ort.plan.__main__", "python -m spmd_ort.plan: a model named on the command line, planned"),
]
UNITS = [name for name, _ in LAYERS]


def _unit(module: str) -> str:
    return max((u for u in UNITS if module == u or module.startswith(u + ".")), key=len)


def test_packages_depend_one_way():
    """Every import of ours points down the package order of :data:`LAYERS` (lazy imports too)."""
    assert {_unit(m) for m in MODULES} <= set(UNITS)
    rank = {u: i for i, u in enumerate(UNITS)}
    bad = []
    for module in MODULES:
        for target, _, line in _imports(module):
            if target in MODULES and rank[_unit(target)] > rank[_unit(module)]:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} imports {target}, "
                           f"but {_unit(target)} is above {_unit(module)}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_two_modules_share_a_base_name():
    by_name: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if path.stem != "__init__":
            by_name.setdefault(path.stem, []).append(module)
    assert not {k: v for k, v in by_name.items() if len(v) > 1}


def test_every_module_is_in_the_architecture_table():
    """docs/architecture.md's module table names every module of spmd_ort (by file name, or its path below its
    package where the name is a common one), so that a newcomer finds each one there."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "spmd_ort").rglob("*.py"))
               if path.name != "__init__.py" and f"`{path.name}`" not in doc
               and f"`{path.parent.name}/{path.name}`" not in doc]
    assert not missing, f"modules missing from docs/architecture.md: {missing}"


def test_the_package_table_in_the_docs_is_the_layers():
    assert _doc_block("docs/architecture.md", "packages") == packages_markdown()


def packages_markdown() -> str:
    rows = ["| # | package | what |", "| --- | --- | --- |"]
    rows += [f"| {i} | `{name}` | {what} |" for i, (name, what) in enumerate(LAYERS)]
    return "\n".join(rows)


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


def _doc_block(path: str, name: str) -> str:
    """The generated ``<!-- name:begin/end -->`` block of the documentation page ``path`` (from the repository root)."""
    text = (ROOT / path).read_text()
    match = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", text, re.S)
    assert match, f"{path} has no <!-- {name}:begin/end --> block"
    return match.group(1).strip()


def test_readme_pipeline_is_the_pipeline():
    assert _doc_block("docs/architecture.md", "pipeline") == pipeline_markdown()


def test_readme_environment_table_is_the_options_table():
    """Users' variables in docs/options.md (at most 10: issue 56), the developer and test switches in testing.md."""
    assert _doc_block("docs/options.md", "env") == env_table_markdown(user=True)
    assert _doc_block("docs/testing.md", "dev-env") == env_table_markdown(user=False)
    assert env_table_markdown(user=True).count("| `SPMD_ORT_") <= 10


@pytest.mark.parametrize("step", STAGES, ids=lambda s: s.name)
def test_every_pass_is_named_documented_and_declares_its_contracts(step):
    if isinstance(step.graph_pass, str):
        return  # user transforms: made per compile
    fn = step.graph_pass
    assert fn.__name__.endswith("_pass")
    assert fn.__doc__ and fn.__doc__.strip(), fn.__name__
    assert hasattr(fn, "contract"), f"{fn.__name__} is not declared with @graph_pass"


# ---------------------------------------------------------------------- contracts and executors
SETTINGS = {
    "one process": None,
    "replicate": DataParallel(),
    "replicate, bf16 reductions": DataParallel(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    "fully_shard": DataParallel(parallel_style="fully_shard"),
    "fully_shard, no reshard": DataParallel(parallel_style="fully_shard", reshard_after_forward=False),
    "fully_shard, offload": DataParallel(parallel_style="fully_shard", offload_param="cpu", offload_optimizer="cpu"),
}


@pytest.mark.parametrize("backend", ["fx", "ort"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_pipeline_meets_its_own_contracts(setting, backend):
    """For every parallel mode and backend, each pass's requirements are provided before it runs (checked
    before any pass runs, from the declarations alone)."""
    mode = SETTINGS[setting]
    ctx = PassContext(input_slots=[], output_slots=[], mode=mode, world_size=2 if mode else 1)
    ctx.facts = traced_facts(ctx)
    check_order(build_pipeline(mode, backend), ctx)


def test_a_disabled_pass_that_others_need_is_an_error_naming_both():
    mode = SETTINGS["fully_shard"]
    ctx = PassContext(input_slots=[], output_slots=[], mode=mode, world_size=2,
                      disabled=frozenset({"propagate_shards_pass"}))
    ctx.facts = traced_facts(ctx)
    with pytest.raises(PassError, match=r"`gather_parameters_pass` requires `shards_propagated`.*which "
                                        r"`propagate_shards_pass` provides, but `propagate_shards_pass` is disabled"):
        check_order(build_pipeline(mode, "fx"), ctx)


def test_a_pass_ordered_before_what_it_needs_is_an_error_naming_both():
    mode = SETTINGS["replicate"]
    ctx = PassContext(input_slots=[], output_slots=[], mode=mode, world_size=2)
    ctx.facts = traced_facts(ctx)
    with pytest.raises(PassError, match=r"`bucket_collectives_pass` requires `per_gradient_reductions`.*"
                                        r"`expand_data_parallel_pass` runs after `bucket_collectives_pass`"):
        check_order([bucket_collectives_pass, expand_data_parallel_pass], ctx)


# modules that run compiled graphs: they partition and run, and never rewrite a graph (that is a pass's job)
EXECUTOR_MODULES = ["spmd_ort.backends.registry", "spmd_ort.backends.fx", "spmd_ort.program",
                    "spmd_ort.backends.ort.executor", "spmd_ort.backends.ort.session", "spmd_ort.backends.ort.sizes", "spmd_ort.backends.ort.choice",
                    "spmd_ort.backends.ort.verify"]
GRAPH_EDITS = {"erase_node", "inserting_before", "inserting_after", "replace_all_uses_with", "replace_input_with",
               "call_function", "create_node", "eliminate_dead_code", "prepend", "append"}
NODE_FIELDS = {"target", "args", "kwargs"}


@pytest.mark.parametrize("module", EXECUTOR_MODULES)
def test_executors_run_the_graph_they_are_given(module):
    """No executor edits a graph: no node field is assigned and no graph-editing method is called."""
    tree = ast.parse(MODULES[module].read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bad += [f"line {node.lineno}: assigns .{t.attr}" for t in targets
                    if isinstance(t, ast.Attribute) and t.attr in NODE_FIELDS]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GRAPH_EDITS:
            receiver = ast.unparse(node.func.value)
            if "graph" in receiver or "node" in receiver:
                bad.append(f"line {node.lineno}: {receiver}.{node.func.attr}(...)")
    assert not bad, f"{module} rewrites a graph: " + "; ".join(bad)
