"""Run under torchrun: rank 1 stops stepping; rank 0 must raise within the process-group timeout.

    torchrun --standalone --nproc_per_node=2 tests/dist/dp_timeout.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import spmd_ort  # noqa: E402
from helpers import train_step  # noqa: E402
from models import MLP  # noqa: E402

TIMEOUT_S = 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_ort.compile(backend="fx")(train_step)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    result: dict = {"rank": rank}
    for _ in range(3):
        step(model, opt, x, y)
    if rank == 1:
        time.sleep(TIMEOUT_S + 3)  # stops stepping (past rank 0's timeout), as a crashed or stuck rank would
        result["stalled"] = True
    else:
        t0 = time.perf_counter()
        try:
            step(model, opt, x, y)
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 - what the user would see
            result["error"] = f"{type(exc).__name__}: {exc}"[:800]
            result["error_type"] = type(exc).__name__
        result["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # what the test checks is written; the process group whose collective timed out is left as a crashed rank
    # leaves it: its destructors at the interpreter's exit aborted now and then ("terminate called without an
    # active exception", SIGABRT, under the suite's load), which is teardown, not what a user's step does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
