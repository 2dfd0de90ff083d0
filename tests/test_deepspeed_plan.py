"""spmd_ort.from_deepspeed_config: DeepSpeed's schedules and loss scaling, the plan against a hand-built setup,
the errors a config gets."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import spmd_ort
from spmd_ort.capture.amp import DynamicLossScaler
from spmd_ort.distributed.deepspeed_config import DeepSpeedConfigError
from spmd_ort.integrations.deepspeed.schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from models import MLP

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# (lr, beta1) after construction and after each of 12 steps, from DeepSpeed 0.19.8's own schedulers
# (deepspeed.runtime.lr_schedules, optimizer lr 0.01, betas (0.9, 0.999)).
DEEPSPEED_SCHEDULES = {
    (WarmupLR, (("warmup_min_lr", 1e-4), ("warmup_max_lr", 1e-2), ("warmup_num_steps", 5))): [
        0.0001, 0.0001, 0.004363697924926592, 0.006857801325411256, 0.008627395849853182] + [0.01] * 8,
    (WarmupLR, (("warmup_min_lr", 0.0), ("warmup_max_lr", 1e-2), ("warmup_num_steps", 4),
                ("warmup_type", "linear"))): [0.0, 0.0, 0.0025, 0.005, 0.0075] + [0.01] * 8,
    (WarmupDecayLR, (("total_num_steps", 10), ("warmup_min_lr", 0.0), ("warmup_max_lr", 1e-2),
                     ("warmup_num_steps", 3), ("warmup_type", "linear"))): [
        0.0, 0.0, 0.003333333333333333, 0.006666666666666666, 0.01, 0.008571428571428572, 0.0071428571428571435,
        0.005714285714285714, 0.004285714285714286, 0.002857142857142857, 0.0014285714285714286, 0.0, 0.0],
    (WarmupCosineLR, (("total_num_steps", 10), ("warmup_min_ratio", 0.1), ("warmup_num_steps", 3),
                      ("cos_min_ratio", 0.01))): [
        0.0, 0.001, 0.006678367782143115, 0.01, 0.009509795896116974, 0.008136274519200732, 0.006151478623083756,
        0.003948521376916244, 0.0019637254807992693, 0.0005902041038830258, 0.0001, 0.0001, 0.0001],
}
ONE_CYCLE = dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=3, cycle_second_step_size=4,
                 decay_lr_rate=0.5, decay_step_size=2, cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.1)
ONE_CYCLE_DEEPSPEED = [
    (0.0001, 0.85), (0.003399999999999999, 0.9166666666666666), (0.0066999999999999985, 0.8833333333333333),
    (0.01, 0.85), (0.007525000000000002, 0.875), (0.005049999999999998, 0.9), (0.0025749999999999987, 0.9249999999999999),
    (0.0001, 0.95), (8e-05, 0.9974999999999999), (6.666666666666667e-05, 1.045), (5.714285714285715e-05, 1.0924999999999998),
    (5e-05, 1.14), (4.4444444444444447e-05, 1.1875)]
# DeepSpeed 0.19.8's DynamicLossScaler (init 2^14) on this overflow pattern: (scale, hysteresis) after each update
PATTERN = "OOGGGGOGGOOOGGGGGGGOGG"
DEEPSPEED_SCALES = {
    (("scale_window", 3), ("hysteresis", 2), ("consecutive_hysteresis", False), ("min_scale", 4096.0)): [
        (16384, 1), (8192, 1), (8192, 1), (8192, 1), (8192, 1), (16384, 2), (16384, 1), (16384, 1), (16384, 1),
        (8192, 1), (4096, 1), (4096, 1), (4096, 1), (4096, 1), (4096, 1), (8192, 2), (8192, 2), (8192, 2),
        (16384, 2), (16384, 1), (16384, 1), (16384, 1)],
    (("scale_window", 2), ("hysteresis", 3), ("consecutive_hysteresis", True), ("min_scale", 1.0)): [
        (16384, 2), (16384, 1), (16384, 3), (16384, 3), (32768, 3), (32768, 3), (32768, 2), (32768, 3), (32768, 3),
        (32768, 2), (32768, 1), (16384, 1), (16384, 3), (16384, 3), (32768, 3), (32768, 3), (65536, 3), (65536, 3),
        (131072, 3), (131072, 2), (131072, 3), (131072, 3)],
}


def _lr_trajectory(make, steps: int = 12):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.999))
    sched = make(opt)
    out = [(opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0])]
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]))
    return out


def test_schedules_and_loss_scaling_are_deepspeeds():
    """Every schedule gives DeepSpeed's lr (and OneCycle's beta1) at every step, to the last bit (1e-15);
    DynamicLossScaler gives DeepSpeed's scale and hysteresis after every update of an overflow pattern."""
    for (cls, kw), want in DEEPSPEED_SCHEDULES.items():
        got = [lr for lr, _ in _lr_trajectory(lambda opt: cls(opt, **dict(kw)))]
        assert got == pytest.approx(want, rel=0, abs=1e-15), cls.__name__
    got = _lr_trajectory(lambda opt: OneCycle(opt, **ONE_CYCLE))
    assert [x for pair in got for x in pair] == pytest.approx([x for p in ONE_CYCLE_DEEPSPEED for x in p], abs=1e-15)
    for kw, want in DEEPSPEED_SCALES.items():
        scaler = DynamicLossScaler("cpu", init_scale=2.0**14, **dict(kw))
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        got = []
        for c in PATTERN:
            scaler._per_optimizer_states[0]["found_inf_per_device"] = {torch.device("cpu"): torch.tensor(float(c == "O"))}
            scaler.update()
            got.append((int(scaler._scale), int(scaler._hysteresis)))
            assert scaler.last_step_skipped() == (c == "O")
        assert got == want, kw


CONFIG = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4,
                                                 "warmup_type": "linear"}},
    # auto_cast: fp32 parameters under torch.autocast.  2^21 overflows fp16 in this MLP: the first steps skip.
    "fp16": {"enabled": True, "auto_cast": True, "loss_scale": 0, "initial_scale_power": 21,
             "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1},
    "zero_optimization": {"stage": 0},
}


def test_plan_trains_like_a_hand_built_setup():
    """The plan's compiled step (from the config alone) and a hand-built eager setup (torch AdamW, a linear
    warmup, torch.amp.GradScaler, autocast, 2 accumulated micro-batches, clipping after unscale_) follow the
    same trajectory: losses, parameters and optimizer state bit for bit, the same skipped steps and scales."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    plan = spmd_ort.from_deepspeed_config(CONFIG, model, world_size=1)
    assert plan.train_micro_batch_size_per_gpu == 8 and plan.gradient_accumulation_steps == 2
    assert plan.autocast_dtype == torch.float16 and plan.mixed_precision is None
    assert plan.parallel_mode.parallel_style == "replicate"

    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: max(e - 1, 0) / 4 if e <= 4 else 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**21, growth_interval=1000)

    def hand_built(micro_batches):
        for x, y in micro_batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(reference(x), y)
            scaler.scale(loss / 2).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if scaler.get_scale() >= before:  # DeepSpeed leaves the schedule alone on a skipped step
            sched.step()

    step = spmd_ort.compile(parallel_mode=plan.parallel_mode, backend="fx")(
        plan.make_train_step(lambda m, x, y: F.cross_entropy(m(x), y)))
    g = torch.Generator().manual_seed(1)
    scales = []
    for i in range(6):
        micro = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(2)]
        step(model, plan.optimizer, plan.scaler, micro)
        plan.step_scheduler()
        hand_built(micro)
        assert float(plan.scaler._scale) == scaler.get_scale(), i
        assert plan.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"], i
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())), i
        scales.append(scaler.get_scale())
    sa, sb = plan.optimizer.state_dict()["state"], opt.state_dict()["state"]
    assert all(torch.equal(sa[k][n], sb[k][n]) for k in sb for n in sb[k])
    skipped = sum(b < a for a, b in zip([2.0**21, *scales], scales))
    assert skipped >= 2 and scales[-1] == scales[-2]  # overflows (the first steps and one later), then steady
    assert 0 < plan.optimizer.param_groups[0]["lr"] < 3e-3  # the warmup moved on the good steps only


def test_shipped_configs():
    fp16 = spmd_ort.from_deepspeed_config(CONFIGS / "fp16.json", MLP(), world_size=2)
    assert fp16.parallel_mode.parallel_style == "fully_shard" and not fp16.parallel_mode.reshard_after_forward
    assert fp16.mixed_precision == spmd_ort.MixedPrecisionPolicy(param_dtype=torch.float16)
    assert isinstance(fp16.scaler, DynamicLossScaler) and fp16.scaler._init_scale == 2.0**16
    assert fp16.scaler._delay == 2 and fp16.scaler._growth_interval == 1000
    assert fp16.gradient_accumulation_steps == 2 and fp16.gradient_clipping == 1.0
    assert isinstance(fp16.scheduler, WarmupDecayLR) and isinstance(fp16.optimizer, torch.optim.AdamW)
    bf16 = spmd_ort.from_deepspeed_config(str(CONFIGS / "bf16.json"), MLP(), world_size=2)
    assert bf16.parallel_mode.reshard_after_forward and bf16.scaler is None
    assert bf16.mixed_precision.param_dtype == torch.bfloat16 and bf16.mixed_precision.reduce_dtype == torch.float32
    assert isinstance(bf16.scheduler, WarmupCosineLR)
    assert bf16.optimizer.defaults["weight_decay"] == 0.1


def test_config_errors_name_every_key():
    model = MLP()
    bad = {**CONFIG, "activation_checkpointing": {"partition_activations": True}, "amp": {"enabled": True},
           "fp16": {"enabled": True, "loss_scale": 128, "fp16_master_weights_and_grads": True},
           "optimizer": {"type": "Lamb", "params": {}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}},
           "gradient_clipping": -1, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}
    with pytest.raises(DeepSpeedConfigError) as err:
        spmd_ort.from_deepspeed_config(bad, model, world_size=1)
    msg = str(err.value)
    for key in ("activation_checkpointing", "amp (apex", "fp16.fp16_master_weights_and_grads", "fp16.loss_scale=128",
                "optimizer.type='Lamb'", "scheduler.params.warmup_steps", "gradient_clipping=-1",
                "zero_optimization.zero_hpz_partition_size"):
        assert key in msg, (key, msg)
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size=16 != train_micro_batch_size_per_gpu=4 x "
                                                   r"gradient_accumulation_steps=2 x world size 1"):
        spmd_ort.from_deepspeed_config({**CONFIG, "train_micro_batch_size_per_gpu": 4}, model, world_size=1)
    with pytest.raises(TypeError, match="dict or the path of a JSON file, not int"):
        spmd_ort.from_deepspeed_config(3, model)
    # gradient_clipping 0 is off, as in DeepSpeed
    assert spmd_ort.from_deepspeed_config({**CONFIG, "gradient_clipping": 0.0}, model, world_size=1).gradient_clipping is None
    # the mode-only API never ignores accumulation, and says where it is mapped
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps=4.*spmd_ort.from_deepspeed_config"):
        spmd_ort.DataParallel.from_deepspeed_config({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}})
    # a tensor-parallel plan needs its 2-D (dp, tp) mesh, and a mesh needs a plan (4 ranks: tests/dist/tp_parity.py)
    with pytest.raises(TypeError, match="mesh_dim_names=\\('dp', 'tp'\\)"):
        spmd_ort.from_deepspeed_config(CONFIG, model, tensor_parallel_plan={"fc1": object()})
    with pytest.raises(TypeError, match="a mesh goes with tensor_parallel_plan"):
        spmd_ort.from_deepspeed_config(CONFIG, model, mesh=object())


def test_auto_values_are_resolved_or_named():
    """The HF Trainer's "auto": batch sizes from each other, warmup bounds from the optimizer, bucket sizes
    from the model's hidden size, the rest from ``auto=`` - or named in the error."""
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    model = MLP()
    with pytest.raises(DeepSpeedConfigError) as err:
        spmd_ort.from_deepspeed_config(hf, model, world_size=2)
    msg = str(err.value)
    for path in ("gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
                 "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps", "bf16.enabled",
                 "zero_optimization.reduce_bucket_size"):
        assert f"{path}='auto' cannot be resolved" in msg, (path, msg)
    assert "could not convert" not in msg

    class WithConfig(MLP):
        class config:  # noqa: N801 - what an HF model carries
            hidden_size = 64

    plan = spmd_ort.from_deepspeed_config(hf, WithConfig(), world_size=2, auto={
        "gradient_clipping": 1.0, "optimizer.params.lr": 1e-3, "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_num_steps": 10, "scheduler.params.total_num_steps": 100, "bf16.enabled": True})
    assert plan.train_batch_size == 8 and plan.gradient_accumulation_steps == 1
    assert plan.parallel_mode.bucket_cap_mb == pytest.approx(64 * 64 * 4 / 2**20)
    assert plan.scheduler.max_lrs == [1e-3] and plan.scheduler.min_lrs == [0.0]
    assert plan.mixed_precision.param_dtype == torch.bfloat16
    with pytest.raises(DeepSpeedConfigError, match="names no 'auto' entry"):
        spmd_ort.from_deepspeed_config(CONFIG, model, world_size=1, auto={"optimizer.params.lr": 1.0})


def test_booleans_are_read_as_deepspeed_reads_them():
    """DeepSpeed validates its config with pydantic models (lax mode): "false", "no", "off", "0" are false there, as
    JSON templates write them.  Each boolean key read here follows that, and a string DeepSpeed rejects is a
    ConfigError naming the key."""
    from spmd_ort.distributed.deepspeed_config import parse_bool

    pydantic = pytest.importorskip("pydantic")  # what DeepSpeed's config models run on
    adapter = pydantic.TypeAdapter(bool)
    for value in ("true", "True", "FALSE", "yes", "No", "on", "off", "t", "f", "y", "n", "1", "0", 1, 0, 1.0, 0.0,
                  True, False, "maybe", "", " true", "2", 2, 0.5, None, [], "auto"):
        try:
            expected = adapter.validate_python(value)
        except pydantic.ValidationError:
            expected = None
        assert parse_bool(value) == expected, value

    model = MLP()
    base = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    off = spmd_ort.from_deepspeed_config({**base, "fp16": {"enabled": "false"}, "bf16": {"enabled": "false"},
                                          "prescale_gradients": "false", "wall_clock_breakdown": "no"},
                                         model, world_size=1)
    assert off.mixed_precision is None and off.scaler is None and off.autocast_dtype is None
    bf16 = spmd_ort.from_deepspeed_config({**base, "fp16": {"enabled": "false"}, "bf16": {"enabled": "True"}},
                                          model, world_size=1)
    assert bf16.mixed_precision.param_dtype == torch.bfloat16 and bf16.scaler is None
    fp16 = spmd_ort.from_deepspeed_config({**base, "fp16": {"enabled": "yes", "auto_cast": "off",
                                                            "consecutive_hysteresis": "on"}}, model, world_size=1)
    assert fp16.mixed_precision.param_dtype == torch.float16 and fp16.autocast_dtype is None
    assert fp16.scaler._consecutive_hysteresis is True
    adam = spmd_ort.from_deepspeed_config(
        {**base, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": "false", "amsgrad": "false",
                                                          "bias_correction": "true"}}}, model, world_size=1)
    assert type(adam.optimizer) is torch.optim.Adam and adam.optimizer.defaults["amsgrad"] is False
    sgd = spmd_ort.from_deepspeed_config(
        {**base, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": "false"}}},
        model, world_size=1)
    assert sgd.optimizer.defaults["nesterov"] is False
    zero = {"stage": 3, "overlap_comm": "false", "contiguous_gradients": "true", "reduce_scatter": "true",
            "offload_optimizer": {"device": "cpu", "pin_memory": "true"}}
    assert spmd_ort.from_deepspeed_config({**base, "zero_optimization": zero}, model, world_size=1) \
        .parallel_mode.prefetch == 0
    mode = spmd_ort.DataParallel.from_deepspeed_config({"fp16": {"enabled": "false"}, "zero_optimization": zero})
    assert mode.prefetch == 0 and mode.offload_optimizer == "cpu"
    with pytest.raises(DeepSpeedConfigError, match="reduce_scatter=false"):
        spmd_ort.DataParallel.from_deepspeed_config({"zero_optimization": {"stage": 3, "reduce_scatter": "False"}})

    with pytest.raises(spmd_ort.ConfigError) as err:  # DeepSpeedConfigError is a spmd_ort.ConfigError
        spmd_ort.from_deepspeed_config(
            {**base, "fp16": {"enabled": "maybe"}, "bf16": {"immediate_grad_update": "sometimes"},
             "zero_optimization": {"stage": 3, "overlap_comm": "perhaps"},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": "nope"}}}, model, world_size=1)
    msg = str(err.value)
    for key in ("fp16.enabled='maybe'", "bf16.immediate_grad_update='sometimes'",
                "zero_optimization.overlap_comm='perhaps'", "optimizer.params.amsgrad='nope'"):
        assert f"{key} (a boolean: true or false" in msg, (key, msg)
    with pytest.raises(DeepSpeedConfigError, match=r"fp16.enabled='yes' and bf16.enabled='1' both turn"):
        spmd_ort.from_deepspeed_config({**base, "fp16": {"enabled": "yes"}, "bf16": {"enabled": "1"}},
                                       model, world_size=1)
    with pytest.raises(DeepSpeedConfigError, match=r"bf16.enabled=\"on\""):
        spmd_ort.DataParallel.from_deepspeed_config({"bf16": {"enabled": "on"}, "zero_optimization": {"stage": 3}})


def test_autocast_acts_on_the_device_the_parameters_are_on():
    """fp16.auto_cast autocasts on the device type of the model's parameters (a plan for a model on a GPU
    autocasts on CUDA: autocast on "cpu" there would change nothing, silently); an explicit one wins."""
    model = MLP()
    plan = spmd_ort.from_deepspeed_config(CONFIG, model, world_size=1)
    assert plan.device_type() == "cpu"
    with plan.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    on_meta = spmd_ort.from_deepspeed_config(CONFIG, MLP().to("meta"), world_size=1)  # (no GPU here: another device)
    assert on_meta.device_type() == "meta"
    with on_meta.autocast("cpu"):
        assert torch.is_autocast_enabled("cpu")
