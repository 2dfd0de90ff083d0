"""Tensor parallelism (expand mode): compiled against eager DTensor tensor parallelism, on 2 gloo ranks.

The script (tests/dist/tp_parity.py) checks loss, parameters and optimizer state (local shards) against eager
``parallelize_module`` with the same plan after every step, and the loss against one-process eager; these tests
check what it reports: the collectives (the same as eager DTensor's, Megatron's count), the bytes each rank holds,
the parameters' placements, and that a failed first call leaves the model as it was.
"""

from __future__ import annotations

import pytest

from test_data_parallel import ROOT, torchrun

SCRIPT = ROOT / "tests" / "dist" / "tp_parity.py"
pytestmark = pytest.mark.multiproc


def _run(tmp_path, *args):
    results, _ = torchrun(tmp_path, *args, "--steps", "3", script=SCRIPT)
    return results


@pytest.mark.parametrize("backend,apply", [("fx", "mode"), ("ort", "user")])
def test_matches_eager_tensor_parallel(tmp_path, backend, apply):
    """``TensorParallel(plan)`` (applied at the first call, after a failed first call was undone) on fx, and a
    module parallelized by the user compiled with ``parallel_mode=None`` on ORT."""
    results = _run(tmp_path, "--backend", backend, "--apply", apply)
    for r in results:
        assert r["losses"] == results[0]["losses"]  # the ranks of a TP group compute one model
        # Megatron: one all-reduce per row-wise layer forward and per column-wise layer backward, as eager DTensor
        assert r["all_reduce_calls"] == r["rowwise"] + r["colwise"]
        assert r["eager_collectives"] == {"c10d_functional.all_reduce": r["all_reduce_calls"]}
        assert r["all_gather_calls"] == r["reduce_scatter_calls"] == 0
        # each rank holds its shard of the sharded parameters and all of the replicated ones
        replicated = r["full_param_bytes"] - r["sharded_param_bytes"]
        assert r["local_param_bytes"] == r["sharded_param_bytes"] // r["world"] + replicated
        assert r["optimizer_params_are_dtensors"] == 24
        assert r["placements"]["blocks.0.attn.q.weight"] == ["S(0)"]
        assert r["placements"]["blocks.1.out.weight"] == ["S(1)"]
        assert r["placements"]["blocks.1.out.bias"] == ["R"]
    assert "adopt_dtensor_collectives_pass" in results[0]["describe"]
