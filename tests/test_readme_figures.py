"""The README quotes measured figures only from bench/RESULTS.md (ratios, percentages, durations)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a number with a unit of measure: 0.73x / 0.73×, 24%, 27 s, 6.3 ms, 9 min / minutes
FIGURE = re.compile(r"(?<![\w.\-/=])(\d+(?:\.\d+)?)(?:\s?(?:×|x\b|%)| (?:s|ms|min|minutes)\b)")


def figures(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold settings, not measurements
    return [m.group(0) for m in FIGURE.finditer(text)]


def test_every_figure_in_the_readme_is_in_results():
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    missing = []
    for fig in figures(readme):
        number = re.match(r"\d+(?:\.\d+)?", fig).group(0)
        if not re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", results):
            missing.append(fig)
    assert not missing, f"README figures not in bench/RESULTS.md: {missing}"


def test_the_check_finds_figures():
    assert figures("ort is 1.28× eager, 24% overlap, 27 s cold; `x=5 s`") == ["1.28×", "24%", "27 s"]
