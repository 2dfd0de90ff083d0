"""Every figure in the README (a number with its unit) says what its source says, in that context.

Each figure is claimed in ``CLAIMS`` by the README text around it, with ``{}`` around the figure
itself, and its source: a table cell of bench/RESULTS.md (``Cell``), a sentence of it (``Prose``),
a constant in the code (``Code``) or a fact that is no measurement (``Fact``).  The other figures
in a claim's text match any number, so an edit to one figure fails its own claim only, with the
value its source gives.  A figure no claim covers, and a claim whose text the README no longer
has, fail too: a new figure needs its source named here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d+(?:\.\d+)?"
UNIT = r"×|x\b|%|(?<= )(?:s|ms|min|minutes|MiB|GiB)\b"
# a number with its unit of measure: 0.73x / 0.73×, 24%, 27 s, 6.3 ms, 9 min, 60 MiB (not a version, path or name)
FIGURE = re.compile(rf"(?<![\w.\-/=])({NUMBER})(\s?)({UNIT})")


@dataclass(frozen=True)
class Cell:
    """The cell in row ``row`` (first column) and column ``column`` (header) of the first table after the
    one place bench/RESULTS.md says ``after``."""

    after: str
    row: str
    column: str


@dataclass(frozen=True)
class Prose:
    """bench/RESULTS.md says ``text`` (whitespace aside), which holds the figure with its unit."""

    text: str


@dataclass(frozen=True)
class Code:
    """The regex ``pattern`` matches once in the file ``path``; ``convert`` of its group 1 is the figure's number."""

    path: str
    pattern: str
    convert: Callable[[float], float] = float


@dataclass(frozen=True)
class Fact:
    """Not a measurement: a setting of glibc, a design constant, arithmetic.  ``why`` says which."""

    why: str


Source = Cell | Prose | Code | Fact
MIXTRAL_TABLE = "## bench/step.py — mixtral-tiny: a model with opaque parts"
STEP_TABLE = "### Run of 2026-11-25 (Intel Xeon with AMX: the LM head fused; the README quotes this table)"
DYNAMIC_TABLE = "## bench/dynamic.py — dynamic shapes"
DYNAMIC_TP_TABLE = "### Tensor parallelism: 10 lengths on 2 ranks"
TP_SPLIT_TABLE = "### Latest run (2026-11-25, Intel Xeon with AMX: tensor parallel after the ORT export changes)"
MIXTRAL_OPAQUE = "opaque parts run eagerly in {}'s step"
DP_TABLE = "### Latest run (2026-11-25, Intel Xeon with AMX: after the ORT export changes)"

CUDA_TABLE = "## bench/step.py --device cuda — one NVIDIA H200 (2026-11-27, the first GPU session)"

CLAIMS: list[tuple[str, Source]] = [
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
     Code("spmd_ort/distributed/parallel.py", r"^AUTO_START_MB = (\d+\.\d+)  #")),
    ("chose {1 MiB} buckets and a step 1.23× DDP's", Prose("it chose 1 MiB buckets, 93% overlap")),
    ("chose 1 MiB buckets and a step {1.23×} DDP's", Prose("1 MiB buckets, 93% overlap and **1.23× DDP**")),
    ("the default now runs at {1.02×} DDP on fx", Cell(DP_TABLE, "spmd-fx", "x DDP")),
    ("DDP on fx and {1.02×} on ORT", Cell(DP_TABLE, "spmd-ort", "x DDP")),
    ("`\"auto\"` keeps {25 MiB} there and says so",
     Code("spmd_ort/distributed/parallel.py", r"^AUTO_START_MB = (\d+\.\d+)  #")),
    ("(`\"auto\"` keeps its {25 MiB} start: its probe times collectives over every rank)",
     Code("spmd_ort/distributed/parallel.py", r"^AUTO_START_MB = (\d+\.\d+)  #")),
    ("times it against FSDP2 + TP (bench/RESULTS.md: {0.68×} on fx, 0.68× on ORT)",
     Cell("### 2-D on 4 ranks: dp 2 × tp 2", "spmd-fx", "x eager")),
    ("times it against FSDP2 + TP (bench/RESULTS.md: 0.68× on fx, {0.68×} on ORT)",
     Cell("### 2-D on 4 ranks: dp 2 × tp 2", "spmd-ort", "x eager")),
    ("Under `fully_shard` it runs at {0.74×} on fx and 0.76× on ORT",
     Cell("### 2-D on 4 ranks: dp 2 × tp 2", "spmd-fx+fsdp", "x eager")),
    ("Under `fully_shard` it runs at 0.74× on fx and {0.76×} on ORT",
     Cell("### 2-D on 4 ranks: dp 2 × tp 2", "spmd-ort+fsdp", "x eager")),
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
     Code("spmd_ort/runtime/memory.py", r"^_RETAIN_MMAP_THRESHOLD = 1 << (\d+)  #",
          lambda shift: 2**int(shift) / 2**30)),  # bytes to GiB
    ("By default glibc gives every allocation above {32 MiB} a fresh `mmap`",
     Fact("glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, malloc(3))")),
    ("On gpt-mini's ZeRO-3 step that was {~15%} of the step", Prose("the setting saves 94 ms, 15% of the step")),
    ("The resident set then stays at its peak ({+70 MiB} per rank there)", Prose("+70 MiB per rank (722 vs 653 MiB)")),
    # ORT sessions without their own arena; torchlib's op names in the export cache
    ("(gpt-mini's first-call peak RSS 1146 → {856 MiB}, step time", Prose("peak RSS\n  1146 → 856 MiB, step time")),
    ("partitions and lowers without building torchlib's registry ({~1 s} of a warm compile)",
     Prose("building torchlib's registry (~1 s) is skipped")),
    # opaque parts: mixtral-tiny
    ("the two opaque expert modules took {44%} of the fx step",
     Prose(MIXTRAL_OPAQUE.format("fx") + ": 23.4 ms of 52.8 ms, 44%")),
    ("{44%} of the ORT step", Prose(MIXTRAL_OPAQUE.format("ort") + ": 23.1 ms of 51.9 ms, 44%")),
    ("the compiled step was {1.06×} (fx)", Cell(MIXTRAL_TABLE, "mixtral-tiny", "fx/eager")),
    ("(fx) and {1.04×} (ORT) of eager", Cell(MIXTRAL_TABLE, "mixtral-tiny", "ort/eager")),
    ("the same model runs at {0.79×} eager on the default backend", Cell(STEP_TABLE, "mixtral-tiny", "ort/eager")),
    # the LM head fused
    ("wider than its input (classes ≥ {4 ×} features)", Code("passes/fusion.py", r"^MIN_WIDENING = (\d+)$")),
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
     Code("spmd_ort/ort/executor.py", r"^PROGRESS_AFTER_S = (\d+(?:\.\d+)?)  #")),
    ("(ORT's `Exp` is {8×} slower on `-inf`", Prose("ONNX Runtime's `Exp` is 8× slower on the causal mask's `-inf`")),
    ("when ORT is no further from it than {10×} the fx graph's own distance",
     Code("spmd_ort/ort/verify.py", r"^FLOAT64_FACTOR = (\d+)$")),
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


def readme_prose(text: str) -> str:
    """The README without code blocks (they hold commands and settings, not measurements), one line."""
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


def table_after(results: str, anchor: str) -> Table:
    assert results.count(anchor) == 1, f"bench/RESULTS.md says {anchor!r} {results.count(anchor)} times, not once"
    lines = results[results.index(anchor):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        block.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, body = block[0], block[2:]  # block[1] is the |---| separator
    return Table(header, {row[0]: row for row in body})


def source_value(source: Source, results: str) -> tuple[float | None, str]:
    """(the number the source gives, where that is, in words); Fact gives no number."""
    if isinstance(source, Cell):
        table = table_after(results, source.after)
        assert source.column in table.header, f"no column {source.column!r} after {source.after!r}: {table.header}"
        assert source.row in table.rows, f"no row {source.row!r} after {source.after!r}: {list(table.rows)}"
        cell = table.rows[source.row][table.header.index(source.column)]
        where = f"bench/RESULTS.md, table after {source.after!r}, row {source.row}, column {source.column!r}: {cell!r}"
        m = re.match(NUMBER, cell)
        assert m, where + " holds no number"
        return float(m.group(0)), where
    if isinstance(source, Code):
        text = (ROOT / source.path).read_text()
        found = re.findall(source.pattern, text, flags=re.M)
        assert len(found) == 1, f"{source.path}: {source.pattern!r} matches {len(found)} times, not once"
        value = float(source.convert(found[0]))
        return value, f"{source.path}: {source.pattern!r} gives {found[0]} ({value:g} in the README's unit)"
    return None, ""


def unit_fits(source: Source, unit: str) -> bool:
    """A cell's unit is its own (24%) or its column's: "(s)" seconds, "ms", ratios ("x ...", "a/b", "vs")."""
    if not isinstance(source, Cell):
        return True
    if unit == "%":
        return True  # checked on the cell's text by the caller
    column = source.column
    return {"s": "(s)" in column, "ms": "ms" in column,
            "×": "/" in column or column.startswith("x ") or "vs" in column}.get(unit, False)


def check(readme: str, results: str, claims=CLAIMS) -> list[str]:
    """Every problem, in words: figures no claim covers, claims not found, figures that differ from their source."""
    text, results_text = readme_prose(readme), normalise(results)
    problems, claimed = [], set()
    for claim, source in claims:
        written = re.search(r"\{(.+?)\}", claim).group(1)
        matches = list(claim_regex(claim).finditer(text))
        if not matches:
            problems.append(f"the README no longer says {claim!r} (figures aside): update or remove this claim")
            continue
        for m in matches:
            claimed.add(m.start("figure"))
            figure = m.group("figure")
            where = text[max(0, m.start() - 20):m.end() + 20]
            got = FIGURE.fullmatch(figure)
            number, unit = float(got.group(1)), unit_of(figure)
            if unit != unit_of(written):
                problems.append(f"README figure {figure} in '...{where}...' has unit {unit}, its claim {written}")
                continue
            if isinstance(source, Prose):
                if normalise(source.text) not in results_text:
                    problems.append(f"bench/RESULTS.md no longer says {source.text!r} (claimed for {figure})")
                elif not any(m.group(1) == got.group(1) and unit_of(m.group(0)) == unit
                             for m in FIGURE.finditer(normalise(source.text))):
                    problems.append(f"README says {figure} in '...{where}...' where bench/RESULTS.md says "
                                    f"{source.text!r}")
                continue
            value, from_where = source_value(source, results)
            if value is None:
                continue
            decimals = len(got.group(1).partition(".")[2])
            if unit == "%" and isinstance(source, Cell) and not from_where.endswith("%'"):
                problems.append(f"README figure {figure} is a percentage, {from_where} is not")
            elif not unit_fits(source, unit):
                problems.append(f"README figure {figure} ({unit}) does not fit the unit of {from_where}")
            elif round(value, decimals) != number:
                problems.append(f"README says {figure} in '...{where}...' where {from_where}")
    for m in FIGURE.finditer(text):
        if m.start() not in claimed:
            where = text[max(0, m.start() - 60):m.end() + 30]
            problems.append(f"README figure {m.group(0)} in '...{where}...' is claimed by nothing: add it to "
                            f"CLAIMS with its source")
    return problems


def test_every_readme_figure_says_what_its_source_says():
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    problems = check(readme, results)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("old,new", [("1.04× (ORT)", "0.67× (ORT)"), ("1.02× on ORT", "0.90× on ORT"),
                                     ("took 2.0 s on fx", "took 1.5 s on fx"),
                                     ("~15% of the step", "~15 s of the step")])
def test_an_edited_figure_fails(old, new):
    """Figures that occur elsewhere in bench/RESULTS.md (0.67× is a target there, 90 and 1.5 occur too), edited
    into the README, fail: a figure is compared with its own source, not searched for anywhere."""
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    assert readme.count(old) == 1
    figure = FIGURE.search(new).group(0)
    problems = check(readme.replace(old, new), results)
    assert len(problems) == 1 and figure in problems[0], problems


def test_a_figure_without_a_claim_fails():
    readme = (ROOT / "README.md").read_text() + "\nThe step takes 12.5 ms.\n"
    problems = check(readme, (ROOT / "bench" / "RESULTS.md").read_text())
    assert len(problems) == 1 and "12.5 ms" in problems[0] and "claimed by nothing" in problems[0], problems


def test_the_check_finds_figures():
    found = [m.group(0) for m in FIGURE.finditer(readme_prose("ort is 1.28× eager, 24% overlap, 27 s cold, "
                                                              "+60 MiB; `x=5 s`; v1.2 x 3\n```\n9 s\n```"))]
    assert found == ["1.28×", "24%", "27 s", "60 MiB"]
