"""Every figure in the documentation (a number with its unit) says what its source says, in that context.

The documentation is README.md and every page of docs/ (``DOCS``). Each figure in it is claimed in
``CLAIMS`` by the text around it, with ``{}`` around the figure itself, and its source: a table cell of
bench/RESULTS.md or of a file of bench/history/ (``Cell``), a sentence of one (``Prose``), a constant in the
code (``Code``) or a fact that is no measurement (``Fact``).  The other figures in a claim's text match any
number, so an edit to one figure fails its own claim only, with the value its source gives.  A figure no
claim covers, and a claim whose text no page has any more, fail too: a new figure needs its source named here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "bench/RESULTS.md"
NUMBER = r"\d+(?:\.\d+)?"
UNIT = r"×|x\b|%|(?<= )(?:s|ms|min|minutes|MiB|GiB)\b"
# a number with its unit of measure: 0.73x / 0.73×, 24%, 27 s, 6.3 ms, 9 min, 60 MiB (not a version, path or name)
FIGURE = re.compile(rf"(?<![\w.\-/=])({NUMBER})(\s?)({UNIT})")


def docs() -> dict[str, str]:
    """The documentation whose figures are checked: README.md and docs/*.md, by path from the repository root."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def read_source(path: str) -> str:
    return (ROOT / path).read_text()


@dataclass(frozen=True)
class Cell:
    """The cell in row ``row`` (first column) and column ``column`` (header) of the first table after the
    one place the results file ``path`` (bench/RESULTS.md unless a file of bench/history/) says ``after``."""

    after: str
    row: str
    column: str
    path: str = RESULTS


@dataclass(frozen=True)
class Prose:
    """The results file ``path`` says ``text`` (whitespace aside), which holds the figure with its unit."""

    text: str
    path: str = RESULTS


@dataclass(frozen=True)
class Code:
    """The regex ``pattern`` matches once in the file ``path``, or in all the files a glob ``path`` names together
    (``spmd_ort/**/*.py``: a constant found wherever its module is); ``convert`` of its group 1 is the figure's
    number."""

    path: str
    pattern: str
    convert: Callable[[float], float] = float


@dataclass(frozen=True)
class Fact:
    """Not a measurement: a setting of glibc, a design constant, arithmetic.  ``why`` says which."""

    why: str


Source = Cell | Prose | Code | Fact
MIXTRAL_TABLE = "## bench/step.py — mixtral-tiny: a model with opaque parts"
STEP_TABLE = "### Latest run (2026-11-27, AMD EPYC: the CPU path after the GPU session's changes)"
DYNAMIC_TABLE = "## bench/dynamic.py — dynamic shapes"
DYNAMIC_TP_TABLE = "### Tensor parallelism: 10 lengths on 2 ranks"
TP_SPLIT_TABLE = "### Latest run (2026-11-25, Intel Xeon with AMX: tensor parallel after the ORT export changes)"
TP_2D_TABLE = "### 2-D on 4 ranks: dp 2 × tp 2"
MIXTRAL_OPAQUE = "opaque parts run eagerly in {}'s step"
DP_TABLE = "### Latest run (2026-11-25, Intel Xeon with AMX: after the ORT export changes)"
ZERO3_TABLE = "### Latest run (2026-11-25, Intel Xeon with AMX: ZeRO-3 after the ORT export changes)"
MEMORY_TABLE = "Second run, as printed:"
CUDA_TABLE = "## bench/step.py --device cuda — one NVIDIA H200 (2026-11-27, the first GPU session)"
STEP_HISTORY = "bench/history/step.md"
DP_HISTORY = "bench/history/dp.md"
ZERO3_HISTORY = "bench/history/zero3.md"
PACKAGE, PASSES = "spmd_ort/**/*.py", "passes/**/*.py"  # constants found wherever their module is

EP_TABLE = "## bench/ep.py — expert parallelism on 2 ranks against fully_shard and DDP (issue 59)"
EP_PLAN_TABLE = "Qwen3-30B-A3B (128 experts of 768 per layer, top-8) on 16 H100s:"
HF_TRAINER_TABLE = "## bench/hf_trainer.py — the Hugging Face Trainer, compiled (issue 60)"
CP_TABLE = "## bench/cp.py — context parallelism on 2 ranks against one rank on the whole sequence (issue 58)"

PLAN_CACHE = "## A plan again, from the cache (`spmd_ort/plan/cache.py`, issue 57)"

CLAIMS: list[tuple[str, Source]] = [
    # warm starts and the background compile (issue 57)
    ("`backend=\"inductor\"` first call: {21.5 s} cold", Prose("gpt-mini 21.5 s → 3.4 s")),
    ("first call: 21.5 s cold, {3.4 s} warm", Prose("gpt-mini 21.5 s → 3.4 s")),
    ("the CNN of `bench/early.py` ran at {1.65x} eager", Prose("slowed the CNN to 1.65x eager")),
    ("eager while one compiled, {0.98x} without", Prose("(the default: 0.98x)")),
    ("The Llama-3-8B plan above took {32.7 s} in a fresh cache", Cell(PLAN_CACHE, "first (empty cache)", "planned in (s)")),
    ("in a fresh cache and {1.0 s} the second time", Cell(PLAN_CACHE, "second (the same command)", "planned in (s)")),
    ("another candidate's first-run median by more than {5%}",
     Code("spmd_ort/backends/ort/choice.py", r"^MARGIN = (0\.\d+)$", lambda v: 100 * float(v))),
    ("and one that is {5%} faster than what runs replaces it",
     Code("spmd_ort/backends/ort/choice.py", r"^MARGIN = (0\.\d+)$", lambda v: 100 * float(v))),
    # expert parallelism (issue 59)
    ("Each rank's peak is {0.38x} `fully_shard`'s", Cell(EP_TABLE, "16", "ep/fully_shard memory")),
    ("The step takes {0.50x} `fully_shard`'s time", Cell(EP_TABLE, "16", "ep/fully_shard time")),
    ("and {0.61x} DDP's", Cell(EP_TABLE, "16", "ep/ddp time")),
    ("even split was within {3.2%} of the all-to-all bytes", Prose("The plan's even split is within 3.2% of")),
    ("the plan's even split is within {10%} of the bytes measured", Fact("issue 59's target")),
    ("`fully_shard` all-gathers {112.6 GiB} per rank and step", Cell(EP_PLAN_TABLE, "dp_shard=16", "all-gather GiB")),
    ("the all-gathers fall to {4.6 GiB}", Cell(EP_PLAN_TABLE, "dp_shard=16, ep=16", "all-gather GiB")),
    ("the all-to-alls add {28.1 GiB}", Cell(EP_PLAN_TABLE, "dp_shard=16, ep=16", "all-to-all GiB")),
    # context parallelism (issue 58)
    ("each rank's peak memory is {0.53×} one rank's", Cell(CP_TABLE, "16384", "cp2/eager memory")),
    ("one rank's and its step time {0.53×}", Cell(CP_TABLE, "16384", "cp2/eager time")),
    ("at 4,096 tokens the step time is {0.58×}", Cell(CP_TABLE, "4096", "cp2/eager time")),
    ("too little work for the split to pay: {0.97×}", Cell(CP_TABLE, "1024", "cp2/eager time")),
    ("`Parallel(dp_shard=8, cp=8)` plans {0.128×} the", Prose("cp=8: 0.128× dp_shard=64's")),
    ("It reserves {46.8 GiB} per rank", Prose("with cp=8 each rank reserves 46.8 GiB")),
    # the plan's device model and its published runs (issue 62)
    ("| allocator | - | reserved {21.7%} over allocated |",
     Code("spmd_ort/plan/device.py", r"^FRAGMENTATION = (\d+\.\d+)$", lambda v: 100 * float(v))),
    ("| outside the allocator | - | {1 GiB} |",
     Code("spmd_ort/plan/device.py", r"outside_allocator=2\*\*(\d+),", lambda v: 2**int(v) / 2**30)),
    ("the targets are time within {30%} and reserved memory within 25%", Fact("issue 62's targets")),
    ("the targets are time within 30% and reserved memory within {25%}", Fact("issue 62's targets")),
    ("the planned activations per rank are {29 GiB} with `\"full\"`",
     Prose("planned activations per rank are 29 GiB with \"full\"")),
    ("with `\"full\"`, {52 GiB} with `\"selective\"`", Prose("52 GiB with \"selective\"")),
    ("and {129 GiB} without checkpointing", Prose("129 GiB without checkpointing")),
    # README: headline numbers
    ("against the Trainer's own DDP (one process: {0.87×})", Cell(HF_TRAINER_TABLE, "1", "default/eager")),
    ("against the Trainer's own DDP (one process: 0.87×) | {0.79×} |", Cell(HF_TRAINER_TABLE, "2", "default/eager")),
    ("timings drift by ±10–{20%} between runs", Prose("Timings drift by ±10–20% between runs")),
    ("gpt-mini: default backend against eager (`torch.compile`: {0.98×})", Cell(STEP_TABLE, "gpt-mini", "inductor/eager")),
    ("gpt-mini: default backend against eager (`torch.compile`: 0.98×) | {0.99×} |",
     Cell(STEP_TABLE, "gpt-mini", "ort/eager")),
    ("experts traced): default backend against eager (`torch.compile`: {0.87×})",
     Cell(STEP_TABLE, "mixtral-tiny", "inductor/eager")),
    ("experts traced): default backend against eager (`torch.compile`: 0.87×) | {0.82×} |",
     Cell(STEP_TABLE, "mixtral-tiny", "ort/eager")),
    ("step time against DDP (fx; ORT {1.02×})", Cell(DP_TABLE, "spmd-ort", "x DDP")),
    ("step time against DDP (fx; ORT 1.02×) | {1.02×} |", Cell(DP_TABLE, "spmd-fx", "x DDP")),
    ("against DeepSpeed ZeRO-3 (fx; FSDP2 {0.99×})", Cell(ZERO3_TABLE, "fsdp2", "x DeepSpeed")),
    ("against DeepSpeed ZeRO-3 (fx; FSDP2 0.99×) | {0.94×} |", Cell(ZERO3_TABLE, "spmd-fx", "x DeepSpeed")),
    ("persistent memory per rank (DeepSpeed: {40.3 MiB})", Cell(ZERO3_TABLE, "deepspeed", "persistent MiB/rank")),
    ("persistent memory per rank (DeepSpeed: 40.3 MiB) | {30.2 MiB} |",
     Cell(ZERO3_TABLE, "spmd-fx", "persistent MiB/rank")),
    ("against eager DTensor TP (fx; ORT {0.81×})", Cell(TP_SPLIT_TABLE, "spmd-ort", "x eager")),
    ("against eager DTensor TP (fx; ORT 0.81×) | {0.79×} |", Cell(TP_SPLIT_TABLE, "spmd-fx", "x eager")),
    ("(one program per length: {11.8 s})", Cell(DYNAMIC_TABLE, "fx-false", "first pass (s)")),
    ("(one program per length: 11.8 s) | {2.0 s} |", Cell(DYNAMIC_TABLE, "fx-auto", "first pass (s)")),
    ("peak against budget 1.0 ({0.95×} the memory", Cell(MEMORY_TABLE, "fx@0.0", "x eager+checkpoint")),
    ("the memory and {0.99×} the time of eager with a checkpoint per block",
     Prose("time 1.01× / 0.99× eager+checkpoint's")),
    ("the time of eager with a checkpoint per block) | {0.20×} |", Cell(MEMORY_TABLE, "fx@0.0", "x fx@1.0")),
    ("`spmd-inductor` against eager (`torch.compile`: {1.04×})", Cell(CUDA_TABLE, "mixtral-tiny", "inductor/eager")),
    ("`spmd-inductor` against eager (`torch.compile`: 1.04×) | {0.66×} |",
     Cell(CUDA_TABLE, "mixtral-tiny", "spmd-inductor/eager")),
    # on a GPU
    ("from C++: gpt-mini\nat {1.26×} eager", Cell(CUDA_TABLE, "gpt-mini", "fx/eager")),
    ("`spmd-inductor` ran mixtral-tiny at {0.66×} eager", Cell(CUDA_TABLE, "mixtral-tiny", "spmd-inductor/eager")),
    ("where `torch.compile(model)` ran\n{1.04×}", Cell(CUDA_TABLE, "mixtral-tiny", "inductor/eager")),
    ("but gpt-mini at {1.09×} against", Cell(CUDA_TABLE, "gpt-mini", "spmd-inductor/eager")),
    ("against `torch.compile`'s {0.92×}", Cell(CUDA_TABLE, "gpt-mini", "inductor/eager")),
    # make fuzz
    ("a compiled value passes if it is no further from float64 than {10×} eager's own distance",
     Code("tests/fuzz_cases.py", r"^EAGER_NOISE_FACTOR = (\d+)$")),
    # data parallel
    ("(a 16th of the parameter bytes, at most {25 MiB})",
     Code(PACKAGE, r"^AUTO_START_MB = (\d+\.\d+)  #")),
    ("chose {1 MiB} buckets and a step 1.23× DDP's", Prose("it chose 1 MiB buckets, 93% overlap", DP_HISTORY)),
    ("chose 1 MiB buckets and a step {1.23×} DDP's", Prose("1 MiB buckets, 93% overlap and **1.23× DDP**", DP_HISTORY)),
    ("the default now runs at {1.02×} DDP on fx", Cell(DP_TABLE, "spmd-fx", "x DDP")),
    ("DDP on fx and {1.02×} on ORT", Cell(DP_TABLE, "spmd-ort", "x DDP")),
    ("`\"auto\"` keeps {25 MiB} there and says so",
     Code(PACKAGE, r"^AUTO_START_MB = (\d+\.\d+)  #")),
    ("(`\"auto\"` keeps its {25 MiB} start: its probe times collectives over every rank)",
     Code(PACKAGE, r"^AUTO_START_MB = (\d+\.\d+)  #")),
    ("with `replicate` on dp (unsharded: not FSDP2's layout) at {0.68×} on fx and 0.68× on ORT",
     Cell(TP_2D_TABLE, "spmd-fx", "x eager")),
    ("with `replicate` on dp (unsharded: not FSDP2's layout) at 0.68× on fx and {0.68×} on ORT",
     Cell(TP_2D_TABLE, "spmd-ort", "x eager")),
    ("it runs at {0.74×} FSDP2 + TP's step time on fx and 0.76× on ORT", Cell(TP_2D_TABLE, "spmd-fx+fsdp", "x eager")),
    ("it runs at 0.74× FSDP2 + TP's step time on fx and {0.76×} on ORT", Cell(TP_2D_TABLE, "spmd-ort+fsdp", "x eager")),
    # tensor parallel: the replicated head split
    ("the step runs at {0.79×} eager DTensor TP on fx and 0.81× on ORT",
     Cell(TP_SPLIT_TABLE, "spmd-fx", "x eager")),
    ("the step runs at 0.79× eager DTensor TP on fx and {0.81×} on ORT",
     Cell(TP_SPLIT_TABLE, "spmd-ort", "x eager")),
    ("against {0.83×} and 0.85× without the split in the same run", Cell(TP_SPLIT_TABLE, "spmd-fx-nosplit", "x eager")),
    ("against 0.83× and {0.85×} without the split in the same run", Cell(TP_SPLIT_TABLE, "spmd-ort-nosplit", "x eager")),
    ("for {9 MiB} more a step (two gathers)", Prose("(2 all-gathers, 9 MiB a step)")),
    ("than the {16 MiB} of all-reduces", Prose("the 16 MiB of Megatron's all-reduces")),
    ("Tested on 4 ranks ({2 x} 2, sequence parallel, ORT)", Fact("the 2-D test's mesh: dp 2 x tp 2 (CASES)")),
    # ZeRO-3
    ("one reduce-scatter of every gradient: {3x} the parameter bytes",
     Fact("two all-gathers of every parameter and one reduce-scatter of every gradient, each its size")),
    ("Built with `torch.utils.cpp_extension` on first use ({~10 s}", Prose("one\n  other single-test process running): ~10 s.")),
    # host memory
    ("glibc's mmap threshold raised to {1 GiB}",
     Code(PACKAGE, r"^_RETAIN_MMAP_THRESHOLD = 1 << (\d+)  #",
          lambda shift: 2**int(shift) / 2**30)),  # bytes to GiB
    ("glibc's default gives every allocation above {32 MiB} a fresh `mmap`",
     Fact("glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, malloc(3))")),
    ("On gpt-mini's ZeRO-3 step that was {~15%} of the step",
     Prose("the setting saves 94 ms, 15% of the step", ZERO3_HISTORY)),
    ("the resident set stays at its peak ({+70 MiB} per rank there)",
     Prose("+70 MiB per rank (722 vs 653 MiB)", ZERO3_HISTORY)),
    # ORT sessions without their own arena; torchlib's op names in the export cache
    ("(gpt-mini's first-call peak RSS 1146 → {856 MiB}, step time",
     Prose("peak RSS\n  1146 → 856 MiB, step time", STEP_HISTORY)),
    ("partitions and lowers without building torchlib's registry ({~1 s} of a warm compile)",
     Prose("building torchlib's registry (~1 s) is skipped", STEP_HISTORY)),
    # opaque parts: mixtral-tiny
    ("the two opaque expert modules took {44%} of the fx step",
     Prose(MIXTRAL_OPAQUE.format("fx") + ": 23.4 ms of 52.8 ms, 44%")),
    ("{44%} of the ORT step", Prose(MIXTRAL_OPAQUE.format("ort") + ": 23.1 ms of 51.9 ms, 44%")),
    ("the compiled step was {1.06×} (fx)", Cell(MIXTRAL_TABLE, "mixtral-tiny", "fx/eager")),
    ("(fx) and {1.04×} (ORT) of eager", Cell(MIXTRAL_TABLE, "mixtral-tiny", "ort/eager")),
    ("the same model runs at {0.82×} eager on the default backend", Cell(STEP_TABLE, "mixtral-tiny", "ort/eager")),
    # the LM head fused
    ("wider than its input (classes ≥ {4 ×} features)", Code(PASSES, r"^MIN_WIDENING = (\d+)$")),
    ("falls from {162.1 MiB} to 78.1 MiB", Prose("162.1 MiB → 78.1 MiB")),
    ("falls from 162.1 MiB to {78.1 MiB}", Prose("162.1 MiB → 78.1 MiB")),
    ("kept for the backward from {98.1 MiB} to 68.1 MiB", Prose("98.1 MiB → 68.1 MiB")),
    ("kept for the backward from 98.1 MiB to {68.1 MiB}", Prose("98.1 MiB → 68.1 MiB")),
    ("takes {0.97×} the time it takes without the pass",
     Prose("gpt-mini's fx step with the pass over the same step without it: 0.97×")),
    # the ORT backend
    ("the fused optimizer update (in place; about {8×} faster than the same update as elementwise ONNX",
     Prose("The update exported as 16 elementwise ONNX ops takes ~8× as long")),
    ("An export still running after {2 s} gets a progress line",
     Code(PACKAGE, r"^PROGRESS_AFTER_S = (\d+(?:\.\d+)?)  #")),
    ("(ORT's `Exp` is {8×} slower on `-inf`",
     Prose("ONNX Runtime's `Exp` is 8× slower on the causal mask's `-inf`", STEP_HISTORY)),
    ("an element passes when ORT is no further from float64 than {10×} the fx graph's own distance",
     Code(PACKAGE, r"^FLOAT64_FACTOR = (\d+)$")),
    ("or than {10×} the float32 rounding noise of that output", Code(PACKAGE, r"^FLOAT64_FACTOR = (\d+)$")),
    ("each output mutated (one element {0.5%} off", Fact("a mutation of tests/test_verify_mutations.py")),
    ("one row {1%} off", Fact("a mutation of tests/test_verify_mutations.py")),
    # dynamic shapes
    ("the first pass over the 20 lengths took {2.0 s} on fx", Cell(DYNAMIC_TABLE, "fx-auto", "first pass (s)")),
    ("on fx against {11.8 s} with a program per length", Cell(DYNAMIC_TABLE, "fx-false", "first pass (s)")),
    ("with a program per length, and {3.3 s} on ORT", Cell(DYNAMIC_TABLE, "ort-auto", "first pass (s)")),
    ("on ORT against {17.9 s} (one export per segment", Cell(DYNAMIC_TABLE, "ort-false", "first pass (s)")),
    ("the symbolic program's step is {1.03×} the static one's at the same length on fx",
     Cell(DYNAMIC_TABLE, "fx-auto", "auto / static at the same length")),
    ("at the same length on fx and {1.01×} on ORT",
     Cell(DYNAMIC_TABLE, "ort-auto", "auto / static at the same length")),
    ("the first pass over the 10 lengths took {5.4 s} (fx)", Cell(DYNAMIC_TP_TABLE, "fx-auto", "first pass (s)")),
    ("where one program per length took {12.1 s}", Cell(DYNAMIC_TP_TABLE, "fx-false", "first pass (s)")),
    ("(ORT: {6.6 s} where it took 23.9 s)", Cell(DYNAMIC_TP_TABLE, "ort-auto", "first pass (s)")),
    ("(ORT: 6.6 s where it took {23.9 s})", Cell(DYNAMIC_TP_TABLE, "ort-false", "first pass (s)")),
]


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def doc_prose(text: str) -> str:
    """A page without code blocks (they hold commands and settings, not measurements), one line."""
    return normalise(re.sub(r"```.*?```", "", text, flags=re.S))


def unit_of(written: str) -> str:
    m = FIGURE.fullmatch(written.lstrip("~+"))
    assert m, f"not a figure with a unit: {written!r}"
    return {"x": "×", "minutes": "min"}.get(m.group(3), m.group(3))


def claim_regex(text: str) -> re.Pattern:
    """The claim's text as a regex: the braced figure captured, every other figure any number in its unit."""
    before, braced, after = re.fullmatch(r"(.*?)\{(.+?)\}(.*)", text, flags=re.S).groups()

    def loose(part: str) -> str:
        out, last = [], 0
        for m in FIGURE.finditer(part):
            out += [re.escape(part[last:m.start()]), NUMBER + re.escape(m.group(2) + m.group(3))]
            last = m.end()
        return "".join(out) + re.escape(part[last:])

    prefix = re.escape(braced[:len(braced) - len(braced.lstrip("~+"))])
    figure = rf"(?P<figure>{NUMBER}\s?(?:{UNIT}))"
    return re.compile(loose(re.sub(r"\s+", " ", before)) + prefix + figure + loose(re.sub(r"\s+", " ", after)))


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: dict[str, list[str]]


def table_after(results: str, anchor: str, path: str = RESULTS) -> Table:
    assert results.count(anchor) == 1, f"{path} says {anchor!r} {results.count(anchor)} times, not once"
    lines = results[results.index(anchor):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        block.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, body = block[0], block[2:]  # block[1] is the |---| separator
    return Table(header, {row[0]: row for row in body})


def source_value(source: Source, read: Callable[[str], str]) -> tuple[float | None, str]:
    """(the number the source gives, where that is, in words); Fact gives no number."""
    if isinstance(source, Cell):
        table = table_after(read(source.path), source.after, source.path)
        assert source.column in table.header, f"no column {source.column!r} after {source.after!r}: {table.header}"
        assert source.row in table.rows, f"no row {source.row!r} after {source.after!r}: {list(table.rows)}"
        cell = table.rows[source.row][table.header.index(source.column)]
        where = f"{source.path}, table after {source.after!r}, row {source.row}, column {source.column!r}: {cell!r}"
        m = re.match(NUMBER, cell)
        assert m, where + " holds no number"
        return float(m.group(0)), where
    if isinstance(source, Code):
        paths = ([str(p.relative_to(ROOT)) for p in sorted(ROOT.glob(source.path))] if "*" in source.path
                 else [source.path])
        found = [(path, g) for path in paths for g in re.findall(source.pattern, read(path), flags=re.M)]
        assert len(found) == 1, f"{source.path}: {source.pattern!r} matches {len(found)} times, not once: {found}"
        path, group = found[0]
        value = float(source.convert(group))
        return value, f"{path}: {source.pattern!r} gives {group} ({value:g} in the docs' unit)"
    return None, ""


def unit_fits(source: Source, unit: str) -> bool:
    """A cell's unit is its own (24%) or its column's: "(s)" seconds, "ms", "MiB", "GiB", ratios ("x ...", "a/b",
    "vs")."""
    if not isinstance(source, Cell):
        return True
    if unit == "%":
        return True  # checked on the cell's text by the caller
    column = source.column
    return {"s": "(s)" in column, "ms": "ms" in column, "MiB": "MiB" in column, "GiB": "GiB" in column,
            "×": "/" in column or column.startswith("x ") or "vs" in column}.get(unit, False)


def check(pages: Mapping[str, str], read: Callable[[str], str] = read_source, claims=CLAIMS) -> list[str]:
    """Every problem, in words: figures no claim covers, claims not found, figures that differ from their source.

    ``pages`` maps a page's path to its text; ``read(path)`` gives a source file's text."""
    texts = {name: doc_prose(text) for name, text in pages.items()}
    problems, claimed = [], {name: set() for name in texts}
    for claim, source in claims:
        written = re.search(r"\{(.+?)\}", claim).group(1)
        matches = [(name, m) for name, text in texts.items() for m in claim_regex(claim).finditer(text)]
        if not matches:
            problems.append(f"no page of the docs says {claim!r} any more (figures aside): update or remove this claim")
            continue
        for name, m in matches:
            text = texts[name]
            claimed[name].add(m.start("figure"))
            figure = m.group("figure")
            where = f"{name}: '...{text[max(0, m.start() - 20):m.end() + 20]}...'"
            got = FIGURE.fullmatch(figure)
            number, unit = float(got.group(1)), unit_of(figure)
            if unit != unit_of(written):
                problems.append(f"figure {figure} in {where} has unit {unit}, its claim {written}")
                continue
            if isinstance(source, Prose):
                if normalise(source.text) not in normalise(read(source.path)):
                    problems.append(f"{source.path} no longer says {source.text!r} (claimed for {figure})")
                elif not any(m.group(1) == got.group(1) and unit_of(m.group(0)) == unit
                             for m in FIGURE.finditer(normalise(source.text))):
                    problems.append(f"{figure} in {where} where {source.path} says {source.text!r}")
                continue
            value, from_where = source_value(source, read)
            if value is None:
                continue
            decimals = len(got.group(1).partition(".")[2])
            if unit == "%" and isinstance(source, Cell) and not from_where.endswith("%'"):
                problems.append(f"figure {figure} in {name} is a percentage, {from_where} is not")
            elif not unit_fits(source, unit):
                problems.append(f"figure {figure} ({unit}) in {name} does not fit the unit of {from_where}")
            elif round(value, decimals) != number:
                problems.append(f"{figure} in {where} where {from_where}")
    for name, text in texts.items():
        for m in FIGURE.finditer(text):
            if m.start() not in claimed[name]:
                where = text[max(0, m.start() - 60):m.end() + 30]
                problems.append(f"figure {m.group(0)} in {name}: '...{where}...' is claimed by nothing: add it to "
                                f"CLAIMS with its source")
    return problems


def test_the_docs_are_the_readme_and_every_page_of_docs():
    names = list(docs())
    assert names[0] == "README.md" and len(names) > 1 and all(n.startswith("docs/") for n in names[1:]), names


def test_every_figure_of_the_docs_says_what_its_source_says():
    problems = check(docs())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("old,new", [("1.04× (ORT)", "0.67× (ORT)"), ("1.02× on ORT", "0.90× on ORT"),
                                     ("took 2.0 s on fx", "took 1.5 s on fx"),
                                     ("~15% of the step", "~15 s of the step")])
def test_an_edited_figure_fails(old, new):
    """Figures that occur elsewhere in the results (0.67× and 1.5 occur in bench/RESULTS.md, 90 in its history),
    edited into a page, fail: a figure is compared with its own source, not searched for anywhere."""
    pages = docs()
    holding = [name for name, text in pages.items() if old in text]
    assert len(holding) == 1 and pages[holding[0]].count(old) == 1, holding
    figure = FIGURE.search(new).group(0)
    problems = check({**pages, holding[0]: pages[holding[0]].replace(old, new)})
    assert len(problems) == 1 and figure in problems[0] and holding[0] in problems[0], problems


@pytest.mark.parametrize("page", ["README.md", "docs/memory.md"])
def test_a_figure_without_a_claim_fails(page):
    pages = docs()
    problems = check({**pages, page: pages[page] + "\nThe step takes 12.5 ms.\n"})
    assert len(problems) == 1 and "12.5 ms" in problems[0] and "claimed by nothing" in problems[0], problems
    assert page in problems[0], problems


def test_a_cited_result_is_read_from_its_own_file():
    """A Prose or Cell naming a history file is checked against that file, not bench/RESULTS.md."""
    claim = ("On gpt-mini's ZeRO-3 step that was {~15%} of the step",
             Prose("the setting saves 94 ms, 15% of the step", ZERO3_HISTORY))
    pages = {"docs/memory.md": "On gpt-mini's ZeRO-3 step that was ~15% of the step."}
    assert check(pages, claims=[claim]) == []

    def without_history(path: str) -> str:
        return "" if path.startswith("bench/history/") else read_source(path)

    problems = check(pages, read=without_history, claims=[claim])
    assert len(problems) == 1 and ZERO3_HISTORY in problems[0], problems


def test_the_check_finds_figures():
    found = [m.group(0) for m in FIGURE.finditer(doc_prose("ort is 1.28× eager, 24% overlap, 27 s cold, "
                                                           "+60 MiB; `x=5 s`; v1.2 x 3\n```\n9 s\n```"))]
    assert found == ["1.28×", "24%", "27 s", "60 MiB"]
