"""A rank that dies inside save_checkpoint: the others do not hang, the partial checkpoint is refused, the run resumes
exactly from the newest checkpoint that loads (tests/dist/dead_rank.py, 2 ranks, torchrun launched twice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launch as launcher
import torch

import spmd_ort
from helpers import train_step
from models import MLP

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "dist" / "dead_rank.py"
# the process group's timeout: long where a rank dies (its death is seen at once; a short one could fire while the
# ranks compile on this 2-core machine), short where one is stuck (it is waited for), as tests/dist/dp_timeout.py
TIMEOUT_S, STUCK_TIMEOUT_S = 30, 5
NOTHING = "Nothing was loaded: the model, optimizer and step are unchanged."

pytestmark = pytest.mark.multiproc


def launch(tmp_path: Path, phase: str, mode: str, how: str = "dies", timeout_s: float = TIMEOUT_S,
           deadline_s: float = 180):
    """One torchrun of the script: (exit code, its output, seconds).  Killed with its workers at the deadline."""
    log = tmp_path / f"{phase}.log"
    run = launcher.torchrun(SCRIPT, "--phase", phase, "--mode", mode, "--how", how, "--timeout", str(timeout_s),
                          "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), timeout=deadline_s,
                          expect_rc=None, log=log)  # the agent and its workers killed together at the deadline
    if run.returncode is None:
        pytest.fail(f"{phase} launch still running after {deadline_s} s:\n{run.output[-4000:]}")
    return run.returncode, run.output, run.seconds


def read(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "out" / name).read_text())


def assert_partial(step12: Path, complete: Path, died: dict) -> None:
    """No .metadata (DCP writes it last), rank 1's data file cut short where it stopped."""
    assert not (step12 / ".metadata").exists()
    assert died["file"] == str(step12 / "__1_0.distcp")
    assert (step12 / "__1_0.distcp").stat().st_size == died["bytes"]
    assert 0 < died["bytes"] < (complete / "__1_0.distcp").stat().st_size


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_rank_dead_inside_a_save_resumes_exactly_from_the_newest_checkpoint_that_loads(tmp_path, mode):
    """Launch 1: 12 steps, checkpoints after steps 4, 8, 12; rank 1 dies (os._exit) inside the last save, after
    3 items of its data file.  Rank 0 (ignoring torchrun's SIGTERM) raises CheckpointError at once (its
    connection to rank 1 closed), not after the timeout; torchrun exits 1 and lists rank 1's exit code.
    Launch 2: step12 is refused (CheckpointError naming it; nothing changed), step8 loads, steps 9-12 equal
    launch 1's bit for bit: losses, parameters and optimizer state (this rank's shards)."""
    code, log, kill_s = launch(tmp_path, "kill", mode)
    assert code == 1, log[-4000:]
    # torchrun's summary lists both ranks; its root cause is whichever failure it saw first: the dead rank or
    # rank 0, which raised within its monitor interval here
    summary = log.split("ChildFailedError")[-1]
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid" in summary, log[-3000:]
    survivor, died = read(tmp_path, "kill-rank0.json"), read(tmp_path, "kill-rank1.json")
    ckpt = tmp_path / "ckpt"
    step12 = ckpt / "step12"
    assert survivor["error_type"] == "CheckpointError", survivor
    first = survivor["error"].splitlines()[0]
    assert first.startswith(f"cannot save a checkpoint to `{step12}`: another rank stopped during the save (its "
                            "connection closed: the process died or was killed), so the checkpoint may be incomplete "
                            "(load_checkpoint refuses it if it is) (RuntimeError: "), first
    assert first.endswith("Fix: relaunch every rank and resume from the newest checkpoint that loads "
                          "(docs/checkpoints.md, \"Resuming after a rank dies\")."), first
    assert survivor["error_path"] == str(step12) and survivor["error_rank"] == 0
    seen_after = survivor["error_at"] - died["stopped_at"]
    assert 0 <= seen_after < 5, seen_after  # the closed connection, not the 30 s timeout
    assert_partial(step12, ckpt / "step8", died)

    code, log, resume_s = launch(tmp_path, "resume", mode)
    assert code == 0, log[-6000:]
    for r in range(2):
        res = read(tmp_path, f"resume-rank{r}.json")
        assert res["resumed_from"] == 8, res
        [refused] = res["refused"]
        assert refused["path"] == str(step12) and refused["unchanged"], refused
        assert refused["error"] == (
            f"cannot load checkpoint `{step12}`: it holds data files (`__0_0.distcp`, `__1_0.distcp`) but no "
            ".metadata: the save that wrote them did not finish (a rank died, stalled or failed inside "
            "save_checkpoint), so the checkpoint is incomplete. Fix: resume from an earlier checkpoint (the newest one "
            f"that loads), or save this one again. {NOTHING}")
        assert len(res["losses"]) == 4 and res["losses_equal"], res
        assert res["state_equal"] and res["tensors"] == 6 + 6 * 3, res  # 6 parameters, AdamW's 3 states each
    assert (step12 / ".metadata").exists()  # the resumed run saved over the partial directory
    print(f"{mode}: survivor raised {seen_after:.2f} s after rank 1 died; kill launch {kill_s:.1f} s, "
          f"resume launch {resume_s:.1f} s")


def test_a_rank_stuck_inside_a_save_fails_the_others_after_the_process_group_timeout(tmp_path):
    """Rank 1 stops inside the last save and sleeps: rank 0's save raises CheckpointError after the process group's
    timeout (5 s here), then exits; torchrun stops rank 1 and names rank 0, the first to exit, as the root cause.
    The checkpoint is partial (refused by the resume of the test above)."""
    code, log, _ = launch(tmp_path, "kill", "replicate", how="hangs", timeout_s=STUCK_TIMEOUT_S)
    assert code == 1, log[-4000:]
    assert "rank      : 0 (local_rank: 0)" in log.split("Root Cause")[-1], log[-3000:]
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : -15" in log, log[-3000:]  # stopped by torchrun (SIGTERM)
    survivor, stuck = read(tmp_path, "kill-rank0.json"), read(tmp_path, "kill-rank1.json")
    step12 = tmp_path / "ckpt" / "step12"
    first = survivor["error"].splitlines()[0]
    assert first.startswith(f"cannot save a checkpoint to `{step12}`: another rank did not finish its part of the "
                            "save within the process group's timeout (init_process_group(timeout=...)): it is stuck "
                            "or died, so the checkpoint may be incomplete"), first
    seen_after = survivor["error_at"] - stuck["stopped_at"]
    assert STUCK_TIMEOUT_S - 0.5 < seen_after < STUCK_TIMEOUT_S + 5, seen_after
    assert_partial(step12, tmp_path / "ckpt" / "step8", stuck)
    print(f"stuck rank: survivor raised {seen_after:.2f} s after rank 1 stopped (timeout {STUCK_TIMEOUT_S} s)")


def test_an_interrupted_save_over_a_checkpoint_leaves_it_refused_not_half_new(tmp_path, monkeypatch):
    """DCP writes .metadata last; saving over an existing checkpoint, the old one would describe the rewritten data
    files.  save_checkpoint removes it before any rank writes, so a save that stops midway leaves a directory that
    load_checkpoint refuses as incomplete.  (Before: on 2 ranks with rank 1 dead before its write, the stale
    .metadata loaded 7 tensors of the old step and 17 of the new without an error; in one process, as here, the
    load said "its param groups cannot be read ... the checkpoint is damaged".)"""
    import torch.distributed.checkpoint.filesystem as fs

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = spmd_ort.compile(backend="fx")(train_step)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    step(model, opt, x, y)
    spmd_ort.save_checkpoint(tmp_path / "latest", step, model, opt)
    step(model, opt, x, y)
    real, written = fs._write_item, []

    def write_item(*args, **kwargs):
        if len(written) == 3:
            raise OSError("disk full")
        written.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", write_item)
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.save_checkpoint(tmp_path / "latest", step, model, opt)
    monkeypatch.undo()
    assert str(info.value).startswith(
        f"cannot save a checkpoint to `{tmp_path / 'latest'}`: rank 0: OSError: disk full")
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.load_checkpoint(tmp_path / "latest", step, model, opt)
    assert "it holds data files (`__0_0.distcp`) but no .metadata: the save that wrote them did not finish" \
        in str(info.value)
    spmd_ort.save_checkpoint(tmp_path / "latest", step, model, opt)  # saving again makes it whole
    spmd_ort.load_checkpoint(tmp_path / "latest", step, model, opt)
