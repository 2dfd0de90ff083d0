"""Run under torchrun: the ranks of one machine compile each distinct graph with inductor once.

    torchrun --standalone --nproc_per_node=4 tests/dist/inductor_once.py --out DIR

Every rank compiles the same replicated step with ``backend="inductor"`` (an MLP, AdamW) and trains 3 steps
against DDP on its own batch (loss, every parameter and optimizer state, per tensor).  The ranks share
inductor's FX graph cache (``TORCHINDUCTOR_CACHE_DIR``, set by the test to a directory of its own) and the
cache directory.  Each rank writes its inductor segments and inductor's FX graph cache misses and hits: one
rank compiled (misses), the others waited on its lock and found every segment in the cache (hits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish, mlp_against_ddp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch._dynamo.utils import counters

    step = mlp_against_ddp(rank, backend="inductor")
    stats = step.compiled.executor.stats
    finish(args.out, {"segments": stats.segments, "fallbacks": list(stats.fallbacks),
                      "misses": counters["inductor"]["fxgraph_cache_miss"],
                      "hits": counters["inductor"]["fxgraph_cache_hit"]})


if __name__ == "__main__":
    main()
