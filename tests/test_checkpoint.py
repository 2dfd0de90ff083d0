"""Checkpoints: a load that cannot succeed says why and changes nothing; one that can resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launch
import torch
from torch import nn

import spmd_ort
from helpers import train_step
from models import MLP

ROOT = Path(__file__).resolve().parent.parent
NOTHING = "Nothing was loaded: the model, optimizer and step are unchanged."


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def _trained(opt_cls=torch.optim.AdamW, steps: int = 2, seed: int = 0, hidden: int = 64, **kw):
    torch.manual_seed(seed)
    model = MLP(hidden=hidden)
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    step = spmd_ort.compile(backend="fx")(train_step)
    for i in range(steps):
        step(model, opt, *_batch(i))
    return model, opt, step


def _snapshot(model, opt) -> dict:
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"g:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for i, st in enumerate(opt.state.values()):
        out.update({f"s:{i}:{k}": v.clone() for k, v in st.items()})
    out["groups"] = repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    out["ids"] = [id(p) for p in model.parameters()] + [id(v) for st in opt.state.values() for v in st.values()]
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An AdamW checkpoint after 2 steps, an SGD one, one without optimizer; the uninterrupted trajectory."""
    root = tmp_path_factory.mktemp("ckpt")
    model, opt, step = _trained()
    spmd_ort.save_checkpoint(root / "adamw", step, model, opt)
    for i in (2, 3):
        step(model, opt, *_batch(i))
    sgd_model, sgd_opt, sgd_step = _trained(torch.optim.SGD, 1, momentum=0.9)
    spmd_ort.save_checkpoint(root / "sgd", sgd_step, sgd_model, sgd_opt)
    spmd_ort.save_checkpoint(root / "model_only", sgd_step, sgd_model)
    return root, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_round_trip_resumes_the_exact_trajectory(saved):
    root, after_4_steps = saved
    torch.manual_seed(7)
    model = MLP()  # another initialisation: only the checkpoint carries the state
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # the checkpoint's lr wins, as in Optimizer.load_state_dict
    step = spmd_ort.compile(backend="fx")(train_step)
    spmd_ort.load_checkpoint(root / "adamw", step, model, opt)
    assert opt.param_groups[0]["lr"] == 1e-2
    for i in (2, 3):
        step(model, opt, *_batch(i))
    for n, p in model.named_parameters():
        assert torch.equal(p, after_4_steps[n]), n


class Renamed(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 10)

    def forward(self, x):
        return self.first(x)


def test_failed_loads_name_the_cause_and_change_nothing(saved, tmp_path):
    """Each bad load raises CheckpointError (an Exception: `except Exception` catches it) whose first line
    names the cause and the fix; model, optimizer and step are bit for bit as before and step on as an
    untouched copy does."""
    root, _ = saved
    model, opt, step = _trained()
    twin, twin_opt, twin_step = _trained()
    before, traces = _snapshot(model, opt), step.transitions.traces
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    damaged = tmp_path / "damaged"  # metadata intact, a data file cut short: fails while reading
    damaged.mkdir()
    for f in (root / "adamw").iterdir():
        data = f.read_bytes()
        (damaged / f.name).write_bytes(data[:len(data) // 3] if f.suffix == ".distcp" else data)
    cases = [
        (root / "sgd", model, opt,
         "the checkpoint holds SGD optimizer state (momentum_buffer) but the optimizer is AdamW. Fix: load it into "
         "a torch.optim.SGD, or pass optimizer=None to load the model only."),
        (root / "model_only", model, opt,
         "the checkpoint holds no optimizer state (it was saved with optimizer=None), but an optimizer (AdamW) was "
         "passed. Fix: pass optimizer=None to load the model only."),
        (tmp_path / "nope", model, opt,
         "the directory does not exist. Fix: pass the directory that save_checkpoint wrote."),
        (tmp_path / "afile", model, opt,
         "it is a file, not a checkpoint directory. Fix: pass the directory that save_checkpoint wrote."),
        (tmp_path / "empty", model, opt,
         "the directory holds no checkpoint (no .metadata file: not written by save_checkpoint or dcp.save, or "
         "the save did not finish). Fix: pass the directory that save_checkpoint wrote."),
        (damaged, model, opt, "reading it failed: rank 0: RuntimeError: PytorchStreamReader failed reading zip "
                              "archive: failed finding central directory"),
    ]
    for path, m, o, cause in cases:
        with pytest.raises(Exception) as info:
            spmd_ort.load_checkpoint(path, step, m, o)
        assert isinstance(info.value, spmd_ort.CheckpointError) and info.value.path == str(path)
        first = str(info.value).splitlines()[0]
        if path == damaged:  # torch's own words follow
            assert first.startswith(f"cannot load checkpoint `{path}`: {cause}") and first.endswith(
                "Fix: check that the checkpoint is complete and readable from every rank. " + NOTHING), first
        else:
            assert first == f"cannot load checkpoint `{path}`: {cause} {NOTHING}"
        _assert_same(before, _snapshot(model, opt))
    assert step.transitions.traces == traces
    x, y = _batch(9)
    step(model, opt, x, y)
    twin_step(twin, twin_opt, x, y)
    _assert_same(_snapshot(twin, twin_opt) | {"ids": None}, _snapshot(model, opt) | {"ids": None})
    assert step.transitions.traces == traces


def test_mismatched_models_and_optimizers_are_named(saved):
    root, _ = saved
    path = root / "adamw"
    cases = []
    torch.manual_seed(1)
    m = MLP(hidden=48)
    cases.append((m, torch.optim.AdamW(m.parameters()),
                  "`model.fc1.weight` has shape (64, 32) in the checkpoint but shape (48, 32) in MLP. Fix: build the "
                  "MLP with the configuration the checkpoint was saved from."))
    m = Renamed()
    cases.append((m, None, "the checkpoint has no entry `model.first.weight` for Renamed.first.weight (and 1 more "
                           "missing: `first.bias`): it was saved from another model. Fix: build the Renamed with the "
                           "configuration the checkpoint was saved from."))
    m = MLP().double()
    cases.append((m, None, "`model.fc1.weight` is float32 in the checkpoint but float64 in MLP. Fix: load into a "
                           "float32 model (model.to(torch.float32)), then convert it."))
    m = MLP()
    params = list(m.parameters())
    cases.append((m, torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}]),
                  "the checkpoint has 1 param groups but the AdamW has 2. Fix: build the AdamW with the param groups "
                  "it was saved with, or pass optimizer=None to load the model only."))
    m = MLP()
    cases.append((m, torch.optim.Adam(m.parameters()),
                  "the checkpoint holds AdamW optimizer state (exp_avg, exp_avg_sq, step) but the optimizer is Adam; "
                  "decoupled_weight_decay is True in the checkpoint. Fix: load it into a torch.optim.AdamW, or pass "
                  "optimizer=None to load the model only."))
    step = spmd_ort.compile(backend="fx")(train_step)
    messages = []
    for m, o, cause in cases:
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(spmd_ort.CheckpointError) as info:
            spmd_ort.load_checkpoint(path, step, m, o)
        messages.append(str(info.value))
        assert messages[-1].splitlines()[0] == f"cannot load checkpoint `{path}`: {cause} {NOTHING}"
        assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
        assert o is None or not o.state
    # every problem is listed below the first line
    assert messages[0].splitlines()[1:4] == [
        "14 more problems:", "  `model.fc1.bias` has shape (64,) in the checkpoint but shape (48,) in MLP",
        "  `model.fc2.weight` has shape (64, 64) in the checkpoint but shape (48, 48) in MLP"]


def test_model_only_load_and_bad_save_path(saved, tmp_path):
    root, _ = saved
    model, opt, step = _trained(torch.optim.SGD, 1, seed=3, momentum=0.9)
    state = {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}
    spmd_ort.load_checkpoint(root / "sgd", step, model)  # the model only: the optimizer keeps its state
    reference, _, _ = _trained(torch.optim.SGD, 1, momentum=0.9)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert all(torch.equal(state[k], v["momentum_buffer"])
               for k, v in opt.state_dict()["state"].items())
    (tmp_path / "afile").write_text("x")
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.save_checkpoint(tmp_path / "afile", step, model, opt)
    assert str(info.value) == (f"cannot save a checkpoint to `{tmp_path / 'afile'}`: it is a file, and a checkpoint "
                               "is a directory. Fix: choose a directory path (it is created if missing).")


def test_load_state_dict_checks_before_writing():
    model, opt, step = _trained(steps=1)
    sd = spmd_ort.state_dict(step, model, opt)
    sd = {"model": {k: v.clone() + 1 for k, v in sd["model"].items()}, "optim": sd["optim"]}
    sd["model"]["extra.weight"] = torch.zeros(3)
    before = _snapshot(model, opt)
    with pytest.raises(spmd_ort.CheckpointError) as info:
        spmd_ort.load_state_dict(step, sd, model, opt)
    assert str(info.value).splitlines()[0] == (
        "cannot load checkpoint from the state dict: `model.extra.weight` is not in MLP's state dict. Fix: build the "
        f"MLP with the configuration the state dict was saved from. {NOTHING}")
    _assert_same(before, _snapshot(model, opt))


@pytest.mark.multiproc
def test_failed_loads_on_two_ranks_fail_together_and_change_nothing(tmp_path):
    """fully_shard, 2 ranks (tests/dist/checkpoint_errors.py): wrong optimizer, wrong size (on both ranks, on
    rank 1 only), missing directory on rank 1 only, a damaged file, saving into a file - every rank raises,
    no rank changes; a fresh model stays unsharded; the sharded checkpoint loads into an unsharded model.
    Sharing the launch: input gradients under fully_shard are each rank's own, as in DDP."""
    launch.torchrun("checkpoint_errors.py", "--dir", str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(ranks):
        first = {k: (v or "").splitlines()[0] if isinstance(v, str) else v for k, v in res.items()}
        assert first["sgd_into_adamw"] == (
            f"cannot load checkpoint `{tmp_path / 'sgd'}`: the checkpoint holds SGD optimizer state (momentum_buffer) "
            "but the optimizer is AdamW. Fix: load it into a torch.optim.SGD, or pass optimizer=None to load the "
            f"model only. {NOTHING}")
        assert first["other_size"].startswith(
            f"cannot load checkpoint `{tmp_path / 'small'}`: `model.fc1.weight` has shape (48, 32) in the checkpoint "
            "but shape (64, 32) in MLP.")
        assert first["other_size_rank1"].endswith(f"{NOTHING} (failed on rank 1; this is rank {r})")
        assert "`model.fc1.weight` has shape (48, 32)" in first["other_size_rank1"]
        assert first["missing_rank1"] == (
            f"cannot load checkpoint `{tmp_path / 'nope'}`: the directory does not exist. Fix: pass the directory "
            f"that save_checkpoint wrote. {NOTHING} (failed on rank 1; this is rank {r})")
        assert first["damaged"].startswith(f"cannot load checkpoint `{tmp_path / 'damaged'}`: reading it failed: "
                                           "rank ")
        assert first["save_into_file"].startswith(f"cannot save a checkpoint to `{tmp_path / 'afile0'}`: it is a "
                                                  "file, and a checkpoint is a directory")
        assert first["fresh"].startswith(f"cannot load checkpoint `{tmp_path / 'small'}`")
        for case in ("sgd_into_adamw", "other_size", "other_size_rank1", "missing_rank1", "damaged", "fresh"):
            assert res[f"{case}_unchanged"], (r, case)
        assert res["next_step_equal"] and not res["retraced"], res
        assert res["cross_layout_params"] and res["cross_layout_state"], res
        assert res["input_grad_close"], res
