"""A model built on the meta device (``with torch.device("meta"):``, how FSDP2, torchtitan and DeepSpeed's
``zero.Init`` users build big models) has no values: a step that gets one says so, names what is on meta and both
ways to give it values, and changes nothing; after ``to_empty`` + init, or ``load_safetensors``, it trains as
eager does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spmd_ort
from helpers import assert_same_state, train_step


def _net():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def test_a_meta_model_is_a_config_error_naming_its_parameters_and_both_fixes():
    with torch.device("meta"):
        model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_ort.compile(backend="fx")(train_step)
    with pytest.raises(spmd_ort.ConfigError) as info:
        step(model, opt, *_batch())
    msg = str(info.value)
    assert msg.startswith("Sequential has 4 of its 4 parameters and buffers on the meta device (`0.weight`, "
                          "`0.bias`, `2.weight`, `2.bias`)"), msg
    assert "model.to_empty(device=\"cpu\")" in msg and "spmd_ort.load_safetensors(model, path)" in msg
    assert info.value.fqn == "0" and step.compiled is None
    assert all(p.is_meta and p.grad is None for p in model.parameters()) and not opt.state


def test_a_meta_batch_is_a_config_error_naming_the_input():
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _batch()
    step = spmd_ort.compile(backend="fx")(train_step)
    with pytest.raises(spmd_ort.ConfigError, match=r"the input `y` is on the meta device \(shape \(4,\)\)") as info:
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y.to("meta"))
    assert info.value.input == "y"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, opt, x, y)  # a step with values; later calls check the batch only, and still refuse a meta one
    after = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(spmd_ort.ConfigError, match=r"the input `x` is on the meta device"):
        step(model, opt, x.to("meta"), y)
    assert all(torch.equal(v, after[k]) for k, v in model.state_dict().items())


def test_to_empty_and_init_then_trains_as_eager():
    """The FSDP2 recipe on one process: meta, to_empty, reset_parameters under a seed, optimizer, step: the
    initialised weights equal eager's bit for bit, and every step equals eager's (the suite's tolerances)."""
    with torch.device("meta"):
        model = _net()
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    torch.manual_seed(3)
    eager = _net()  # built on CPU: the same draws in the same order after the seed
    torch.manual_seed(3)
    for m in eager.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
    opt, opt_e = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager))
    step = spmd_ort.compile(backend="fx")(train_step)
    for i in range(3):
        x, y = _batch()
        torch.testing.assert_close(step(model, opt, x, y), train_step(eager, opt_e, x, y).detach())
        assert_same_state(eager, model, opt_e, opt, where=f"step {i}")
