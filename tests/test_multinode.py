"""Two "nodes" on this machine: ``torchrun --nnodes=2``, one process each, replicate and fully_shard against DDP.

What a launch over several machines changes: the ranks meet through a rendezvous (c10d, the one
torchrun recommends, or static with ``--node-rank``), every node numbers its processes from
LOCAL_RANK 0, and RANK / GROUP_RANK come from the rendezvous.  Each "node" is its own torchrun
agent, as on a cluster; only the host is 127.0.0.1.  ``tests/dist/dynamic_parity.py`` trains a
DDP, a compiled ``replicate`` and a compiled ``fully_shard`` model on every rank (each rank its
own batch sizes) and compares them with DDP after every step (fx: bit for bit).  The commands
are those of docs/data-parallel.md ("Several machines").
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

import launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "dist" / "dynamic_parity.py"
pytestmark = pytest.mark.multiproc

TIMEOUT_S = 420  # both nodes together; a healthy run takes ~30 s here
JOIN_TIMEOUT_S = 90  # a node whose peer never comes fails after this, instead of torchrun's 600 s
PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")


def free_port() -> int:
    """A port nothing listens on now (the OS picks it); a launch that still finds it taken is retried."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(rendezvous: str, node_rank: int, port: int, out: Path) -> list[str]:
    """The multi-node command of docs/data-parallel.md for one node, with 127.0.0.1 as the host."""
    if rendezvous == "c10d":  # ranks are assigned by the rendezvous, in the order the nodes join
        how = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=spmd-ort-test-{port}",
               f"--rdzv-conf=join_timeout={JOIN_TIMEOUT_S}", "--local-addr=127.0.0.1"]
    else:  # static: the node rank is given, node 0 hosts the store at the master address
        how = [f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}"]
    return launch.command(SCRIPT, "--backend", "fx", "--out", str(out), nproc=1,
                          launcher=("--nnodes=2", "--max-restarts=0", *how))


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def launch_two_nodes(tmp_path: Path, rendezvous: str) -> tuple[list[int], list[Path], str]:
    """Start both nodes, wait for both (killing both at the deadline); (exit codes, log files, where)."""
    port = free_port()
    env = launch.worker_env()  # (one process per core: 2 on this 2-core machine)
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    procs = [launch.start(node_command(rendezvous, node, port, tmp_path / "out"), log, env)
             for node, log in zip((0, 1), logs)]
    deadline = time.monotonic() + TIMEOUT_S
    codes = [launch.wait(p, deadline) for p in procs]  # each node's agent and workers killed at the deadline
    return codes, logs, f"{rendezvous} rendezvous on 127.0.0.1:{port}"


def failure(codes: list, logs: list[Path], where: str) -> str:
    said = ", ".join(f"node {n} {'timed out' if c is None else f'exited {c}'}" for n, c in enumerate(codes))
    parts = [f"two-node launch failed ({where}): {said}"]
    parts += [f"--- node {n}: {log} (last lines) ---\n{tail(log)}" for n, log in enumerate(logs)]
    return "\n".join(parts)


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_nodes_train_replicate_and_fully_shard_like_ddp(tmp_path, rendezvous):
    """Each node's process has LOCAL_RANK 0 and its own node rank, the two form one world of 2, and both
    compiled styles equal DDP at every step (checked inside the script; this test reads the result)."""
    for attempt in range(2):  # once more only if another process took the free port in between
        run_dir = tmp_path / f"attempt{attempt}"
        run_dir.mkdir()
        codes, logs, where = launch_two_nodes(run_dir, rendezvous)
        if codes == [0, 0] or not any(s in log.read_text(errors="replace") for log in logs for s in PORT_TAKEN):
            break
    assert codes == [0, 0], failure(codes, logs, where)
    ranks = [json.loads((run_dir / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    placed = [r["torchrun"] for r in ranks]
    assert sorted(p["GROUP_RANK"] for p in placed) == ["0", "1"], placed  # two nodes ...
    for p in placed:  # ... of one process each, in one world, meeting at the host given
        assert (p["LOCAL_RANK"], p["LOCAL_WORLD_SIZE"], p["WORLD_SIZE"]) == ("0", "1", "2"), placed
        assert p["RANK"] == p["GROUP_RANK"] and p["MASTER_ADDR"] == "127.0.0.1", placed
    for r in ranks:
        assert r["traces"] == {"replicate": 2, "fully_shard": 2}, r["traces"]
        assert len(r["losses"]) == 6, r["losses"]
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own batches
