"""Run under torchrun: inductor's candidate compiled in the background on every rank.

    torchrun --standalone --nproc_per_node=2 tests/dist/background_compile.py --out DIR

The default backend (``SPMD_ORT_BACKGROUND_COMPILE=1`` set by the test), the candidate's compile predicted dear
(it would never be bought in the step), an MLP trained against DDP on each rank's batches, every step; the loop
stops two steps after the candidate's adoption (a decision every rank takes at the same step).  Each rank
writes the tuner's decisions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish, mlp_against_ddp  # noqa: E402
from spmd_ort import tuner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    tuner.CompileCost.predict = classmethod(lambda cls, nodes: (1e6, f"{nodes} nodes"))
    adopted_at = None

    def until_adopted(step, i):
        nonlocal adopted_at
        decided = [str(d) for d in step.tuner.decisions if d.subject == "inductor candidate"]
        if adopted_at is None and len(decided) > 1 and "compiled at step" in decided[-1]:
            adopted_at = i
        time.sleep(0.1)  # (few steps while the child compiles: a long run drifts from DDP by rounding)
        return adopted_at is not None and i >= adopted_at + 2

    step = mlp_against_ddp(dist.get_rank(), steps=1500, until=until_adopted)
    finish(args.out, {"decided": [str(d) for d in step.tuner.decisions]})


if __name__ == "__main__":
    main()
