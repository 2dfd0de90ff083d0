"""The demo's ``--big`` variant (examples/train_char_gpt.py, ``make demo-big``): a GPT built on the meta device,
parallelized, initialised on each rank's part, trained, its memory per rank printed, saved, loaded back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import launch

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "train_char_gpt.py"
SMALL = ["--big", "--width", "64", "--layers", "2", "--batch", "4", "--backend", "fx"]

pytestmark = pytest.mark.multiproc


def run(*args: str, nproc: int = 0) -> str:
    """The demo script on ``nproc`` ranks (0: plain python): what it printed."""
    return launch.torchrun(DEMO, *args, nproc=nproc, timeout=300).output


def row(out: str, name: str) -> list[float]:
    """A memory row's per-rank multiples of the full weights."""
    line = next(line for line in out.splitlines() if line.strip().startswith(name))
    return [float(x) for x in re.findall(r"([\d.]+)x", line)]


def test_demo_big_builds_on_meta_reports_memory_saves_and_loads_back(tmp_path):
    """2 ranks, fully_shard: built on meta and initialised on each rank's part, the loss falls, each rank holds
    half the parameters and the optimizer state of half (1.5x the weights of the full 4x), the weights are saved
    (model.safetensors and char_gpt.json); one process then loads them (reading all of the file) and starts
    from the trained loss."""
    save = tmp_path / "big"
    out = run(*SMALL, "--steps", "20", "--save", str(save), nproc=2)
    assert "built on meta, parallelize (fully_shard), to_empty" in out, out
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", out, re.M)]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.3, losses
    assert row(out, "parameters (step.memory())") == [0.5, 0.5], out
    assert row(out, "parameters + optimizer state") == [1.5, 1.5], out
    assert all(0 < x < 50 for x in row(out, "resident after loading")), out
    assert (save / "model.safetensors").is_file() and json.loads((save / "char_gpt.json").read_text())["d"] == 64
    again = run(*SMALL, "--steps", "3", "--init-from", str(save), "--save", str(tmp_path / "again"))
    assert f"loaded from {save}" in again and row(again, "read from the file") == [1.0], again
    first = float(re.search(r"^step +1 +loss ([\d.]+)", again, re.M).group(1))
    assert first < losses[0] - 0.3, (first, losses)
