"""DeepSpeed JSON configs -> DataParallel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import spmd_ort
from spmd_ort.distributed.deepspeed_config import DeepSpeedConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_shipped_zero3_config():
    mode = spmd_ort.DataParallel.from_deepspeed_config(CONFIGS / "zero3.json")
    assert mode.parallel_style == "fully_shard" and mode.reshard_after_forward
    assert mode.offload_optimizer is None and mode.offload_param is None
    assert mode.bucket_cap_mb == pytest.approx(2e6 * 4 / 2**20)
    assert mode.prefetch == 1


def test_shipped_zero3_offload_config():
    mode = spmd_ort.DataParallel.from_deepspeed_config(str(CONFIGS / "zero3_offload.json"))
    assert mode.sharded and mode.offload_optimizer == "cpu" and mode.offload_param == "cpu"


@pytest.mark.parametrize("stage,style,reshard", [(0, "replicate", True), (1, "fully_shard", False),
                                                 (2, "fully_shard", False), (3, "fully_shard", True)])
def test_stages(stage, style, reshard):
    mode = spmd_ort.DataParallel.from_deepspeed_config({"zero_optimization": {"stage": stage}})
    assert mode.parallel_style == style and mode.reshard_after_forward == reshard


def test_prefetch_and_overlap():
    zero = {"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 3500}
    assert spmd_ort.DataParallel.from_deepspeed_config({"zero_optimization": zero}).prefetch == 3
    zero["overlap_comm"] = False
    assert spmd_ort.DataParallel.from_deepspeed_config({"zero_optimization": zero}).prefetch == 0


def test_bad_config_lists_every_unsupported_key(tmp_path):
    bad = {"train_batch_size": 16, "fp16": {"enabled": True}, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam"},
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "offload_param": {"device": "nvme"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(DeepSpeedConfigError) as err:
        spmd_ort.DataParallel.from_deepspeed_config(path)
    msg = str(err.value)
    for key in ("fp16.enabled=true", "gradient_clipping", "optimizer", "zero_optimization.zero_hpz_partition_size",
                "offload_param.device='nvme'"):
        assert key in msg, (key, msg)
    assert "train_batch_size" not in msg


def test_invalid_inputs(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        spmd_ort.DataParallel.from_deepspeed_config(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(DeepSpeedConfigError, match="not valid JSON"):
        spmd_ort.DataParallel.from_deepspeed_config(tmp_path / "x.json")
    with pytest.raises(DeepSpeedConfigError, match="stage=5"):
        spmd_ort.DataParallel.from_deepspeed_config({"zero_optimization": {"stage": 5}})
    with pytest.raises(DeepSpeedConfigError, match="offload_param needs stage 3"):
        spmd_ort.DataParallel.from_deepspeed_config({"zero_optimization": {"stage": 2,
                                                                           "offload_param": {"device": "cpu"}}})


def test_mode_validation():
    with pytest.raises(ValueError, match="needs parallel_style='fully_shard'"):
        spmd_ort.DataParallel(offload_optimizer="cpu")
    with pytest.raises(ValueError, match="prefetch"):
        spmd_ort.DataParallel(parallel_style="fully_shard", prefetch=-1)
