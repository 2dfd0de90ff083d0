"""The one launcher of every multi-rank test: a script of ``tests/dist`` run under torchrun, as users launch.

    run = torchrun("dp_parity.py", "--model", "mlp", nproc=2, out=tmp_path / "out")   # rank<r>.json read back
    ranks = run.ranks

Each launch is its own session (``start_new_session``): at the deadline the agent and every worker are killed
together, none left behind; output goes to a file, never a pipe that could block a worker.  Workers get
``OMP_NUM_THREADS=1`` (one core each, as torchrun gives them) and none of an outer launch's ``RANK``/
``WORLD_SIZE``/... variables.  ``expect_rc`` (0 by default) is asserted with the output's tail; None returns
whatever happened (a test of a rank that dies).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "tests" / "dist"
# torchrun sets these for its workers; inherited from an outer launch they would mislead ours
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Run:
    """A finished launch: its exit code, output (stdout and stderr together), seconds and, where asked, each rank's
    result file read back."""

    returncode: int | None  # None: killed at the deadline
    output: str
    seconds: float
    ranks: list = field(default_factory=list)

    @property
    def stderr(self) -> str:  # (one stream: what a test searched stderr for is in it)
        return self.output


def command(script: str | Path, *args: str, nproc: int = 2, launcher: tuple[str, ...] = ("--standalone",)) -> list:
    """torchrun's command line for ``script`` (a name in tests/dist, or a path) on ``nproc`` processes; ``nproc=0``:
    the script alone, under plain python."""
    path = Path(script) if Path(script).is_absolute() else DIST / script
    launch = [sys.executable, "-m", "torch.distributed.run", *launcher, f"--nproc_per_node={nproc}"] if nproc else \
        [sys.executable]
    return [*launch, str(path), *map(str, args)]


def worker_env(env: dict | None = None) -> dict:
    """The environment a launch gets: this one without an outer launch's variables, one thread a worker, ``env``."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith("TORCHELASTIC_")}
    return {**base, "OMP_NUM_THREADS": "1", **(env or {})}


def start(cmd: list, log: Path, env: dict) -> subprocess.Popen:
    """``cmd`` in a session of its own, its output into ``log``."""
    with log.open("w") as f:  # the child keeps its own handle
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def wait(proc: subprocess.Popen, deadline: float) -> int | None:
    """``proc``'s exit code, or None after killing its session at ``deadline`` (time.monotonic())."""
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and its workers
        proc.wait()
        return None


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300, env: dict | None = None,
             out: Path | None = None, results: str | None = "rank{r}.json", expect_rc: int | None = 0,
             launcher: tuple[str, ...] = ("--standalone",), log: Path | None = None) -> Run:
    """Run ``script`` under torchrun on ``nproc`` ranks (see the module).  ``out``: passed as ``--out`` and where
    ``results`` (a name with ``{r}``, one file per rank; None: none) are read back after a clean exit."""
    if out is not None:
        args = (*args, "--out", str(out))
    log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"spmd_ort_launch_{os.getpid()}_{time.monotonic_ns()}.log"
    t0 = time.perf_counter()
    proc = start(command(script, *args, nproc=nproc, launcher=launcher), log, worker_env(env))
    code = wait(proc, time.monotonic() + timeout)
    output = log.read_text(errors="replace")
    run = Run(code, output, time.perf_counter() - t0)
    if expect_rc is not None:
        what = "killed at its deadline" if code is None else f"exit code {code}"
        assert code == expect_rc, f"{Path(script).name} on {nproc} rank(s): {what}\n{output[-8000:]}"
    if out is not None and results is not None and code == 0:
        run.ranks = [json.loads((Path(out) / results.format(r=r)).read_text()) for r in range(max(nproc, 1))]
    return run
