"""Configuration: every SPMD_ORT_* variable is read once, at compile(), and a bad value is a clear error."""

from __future__ import annotations

import logging

import pytest
import torch

import spmd_ort
from spmd_ort.options import ENV_VARS, Options
from helpers import train_step
from models import MLP

BAD = [
    ("SPMD_ORT_VERIFY", "maybe", "1/0, true/false"),
    ("SPMD_ORT_NATIVE", "banana", "1/0, true/false"),
    ("SPMD_ORT_RETAIN_HOST_MEMORY", "2", "1/0, true/false"),
    ("SPMD_ORT_ALLOW_SPINNING", "sometimes", "1/0, true/false"),
    ("SPMD_ORT_CHECK_PASSES", "x", "1/0, true/false"),
    ("SPMD_ORT_ONNX_OPSET_VERSION", "7", "from 18 to 25"),
    ("SPMD_ORT_ONNX_OPSET_VERSION", "99", "from 18 to 25"),
    ("SPMD_ORT_ONNX_OPSET_VERSION", "eighteen", "from 18 to 25"),
    ("SPMD_ORT_FALLBACK_POLICY", "SOMETIMES", "FALLBACK_TO_FX or FALLBACK_DISABLE"),
    ("SPMD_ORT_BACKEND", "tvm", "ort or fx"),
    ("SPMD_ORT_LOG_LEVEL", "LOUD", "VERBOSE, INFO, WARNING"),
    ("SPMD_ORT_AUTO_OPAQUE", "maybe", "1/0, true/false"),
    ("SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", "x", "1/0, true/false"),
    ("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS", "my.Func tion,Plain", "qualified class names such as `pkg.module.MyFunction` "
                                                                "(not Plain, my.Func tion)"),
    ("SPMD_ORT_ACTIVATION_MEMORY_BUDGET", "1.5", "a number from 0.0 (recompute what can be recomputed) to 1.0"),
    ("SPMD_ORT_ACTIVATION_MEMORY_BUDGET", "half", "a number from 0.0"),
    ("SPMD_ORT_ACTIVATION_MEMORY_BUDGET", "nan", "a number from 0.0"),
    ("SPMD_ORT_ACTIVATION_MEMORY_BUDGET", "Full", "or full / selective"),
    ("SPMD_ORT_SAVE_ONNX_PATH", __file__, "a directory, but"),
    ("SPMD_ORT_SAVE_ONNX_PATH", f"{__file__}/onnx", "a directory, but"),
]


@pytest.mark.parametrize("name,value,allowed", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_bad_value_is_a_config_error_naming_variable_and_allowed_values(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(spmd_ort.ConfigError) as err:
        spmd_ort.compile()
    msg = str(err.value)
    assert f"{name}={value!r}" in msg and allowed in msg, msg
    assert isinstance(err.value, ValueError) and isinstance(err.value, spmd_ort.CompileError)


def test_opaque_functions_and_disabled_custom_autograd_support_conflict(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", "1")
    monkeypatch.setenv("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS", "models.ScaleByMax")
    with pytest.raises(spmd_ort.ConfigError, match="set one of them"):
        spmd_ort.compile()
    monkeypatch.delenv("SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT")
    options = spmd_ort.compile()(train_step).options
    assert options.opaque_functions == frozenset({"models.ScaleByMax"}) and options.custom_autograd
    assert options.auto_opaque


@pytest.mark.parametrize("name,error", [
    ("models.NotThere", "names `models.NotThere`, but `models` has no attribute `NotThere`"),
    ("no_such_package.layers.Fn", "names `no_such_package.layers.Fn`, but no module `no_such_package` can be imported"),
    ("models.MLP", "names `models.MLP`, which is the class `models.MLP`, not a torch.autograd.Function subclass"),
    ("models.gpt_batch", "names `models.gpt_batch`, which is a function, not a torch.autograd.Function"),
])
def test_opaque_functions_that_do_not_exist_are_config_errors(monkeypatch, name, error):
    """A name no Function has was accepted silently (the Function then traced as if unlisted)."""
    monkeypatch.setenv("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS", f"models.ScaleByMax,{name}")
    with pytest.raises(spmd_ort.ConfigError, match=f"SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS {error}".replace(".", r"\.")):
        spmd_ort.compile()


def test_opaque_functions_are_found_under_their_own_name(monkeypatch):
    """A re-exported name is resolved to the Function's module and qualname, which is what tracing matches."""
    monkeypatch.setenv("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS", "torch.autograd.Function, models.ScaleByMax, "
                                                              "tests.fn.<locals>.Local")
    assert spmd_ort.compile()(train_step).options.opaque_functions == frozenset(
        {"torch.autograd.function.Function", "models.ScaleByMax", "tests.fn.<locals>.Local"})


def test_a_typo_in_disabled_passes_is_an_error_listing_the_passes(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_DISABLE_PASSES", "reinplace_optimiser_pass")
    with pytest.raises(spmd_ort.ConfigError, match="unknown pass.*reinplace_optimiser_pass.*reinplace_optimizer_pass"):
        spmd_ort.compile()


def test_disabling_a_pass_by_name_skips_it_and_shows_it(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_DISABLE_PASSES", "reinplace_optimizer_pass")
    model = MLP()
    step = spmd_ort.compile(backend="fx")(train_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        step(model, opt, torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert "reinplace_optimizer_pass: disabled" in step.compiled.describe()
    assert "spmd_ort.adam.default" in step.compiled.describe()  # the functional op stayed


def test_environment_is_read_once_at_compile(monkeypatch):
    monkeypatch.setenv("SPMD_ORT_BACKEND", "fx")
    step = spmd_ort.compile()(train_step)
    monkeypatch.setenv("SPMD_ORT_BACKEND", "ort")  # too late for this step
    monkeypatch.setenv("SPMD_ORT_VERIFY", "maybe")  # ... and so is a bad value
    model = MLP()
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert step.compiled.backend == "fx" and step.options.backend == "fx"


def test_precedence_arguments_environment_defaults():
    """One rule (issue 56): what the code passes (a compile() keyword, a DebugOptions field) wins over its variable,
    which wins over the default; a DebugOptions field left at None is not given."""
    env = {"SPMD_ORT_BACKEND": "fx", "SPMD_ORT_LOG_LEVEL": "INFO", "SPMD_ORT_ONNX_OPSET_VERSION": "18",
           "SPMD_ORT_VERIFY": "1", "SPMD_ORT_CHECK_PASSES": "1"}
    opts = Options.resolve(debug=spmd_ort.DebugOptions(log_level=spmd_ort.LogLevel.ERROR, verify=False,
                                                       check_passes=False), backend="ort", environ=env)
    assert opts.backend == "ort"  # the argument wins over SPMD_ORT_BACKEND
    assert opts.log_level == spmd_ort.LogLevel.ERROR and not opts.verify and not opts.check_passes  # DebugOptions'
    assert opts.onnx_opset == 18  # the environment over the default
    unset = Options.resolve(debug=spmd_ort.DebugOptions(), environ=env)
    assert unset.log_level == spmd_ort.LogLevel.INFO and unset.verify and unset.check_passes
    assert Options.resolve(environ={}) == Options()


def test_backend_auto_is_the_default_and_ort_pins_onnx_runtime():
    """``backend``: "auto" (the default) is ORT with every measured choice; "ort" runs every segment ORT supports on
    ORT, no candidate; the developer switches refine either; a GPU may swap only a backend nobody chose."""
    auto = Options.resolve(environ={})
    assert (auto.backend, auto.segment_executor, auto.auto_inductor, auto.backend_given) == ("ort", "auto", True,
                                                                                              False)
    assert Options.resolve(backend="auto", environ={}) == auto == Options.resolve(environ={"SPMD_ORT_BACKEND": "auto"})
    ort = Options.resolve(backend="ort", environ={})
    assert (ort.backend, ort.segment_executor, ort.auto_inductor, ort.backend_given) == ("ort", "ort", False, True)
    assert Options.resolve(environ={"SPMD_ORT_BACKEND": "ort"}) == ort
    refined = Options.resolve(backend="ort", environ={"SPMD_ORT_SEGMENT_EXECUTOR": "auto"})
    assert refined.segment_executor == "auto" and refined.backend_given
    with pytest.raises(spmd_ort.ConfigError, match="backend='onnx' is not one of auto, ort, fx, inductor"):
        Options.resolve(backend="onnx", environ={})


def test_unknown_variable_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="spmd_ort"):
        Options.resolve(environ={"SPMD_ORT_VERFY": "1"})
    assert "SPMD_ORT_VERFY" in caplog.text and "SPMD_ORT_VERIFY" in caplog.text


def test_every_variable_sets_an_options_field():
    fields = set(Options.__dataclass_fields__)
    assert all(v.field in fields for v in ENV_VARS)
    assert len({v.name for v in ENV_VARS}) == len(ENV_VARS)


def test_debug_options_are_checked_where_given():
    """DebugOptions accepted any value (verify='maybe' turned verification on; log_level='LOUD' failed later with a
    raw ValueError; a dict as debug= an AttributeError): a bad one is a ConfigError naming the field and the value."""
    for kwargs, text in ((dict(verify="maybe"), "DebugOptions(verify='maybe') is not valid: expected True or False"),
                         (dict(save_onnx=1), "DebugOptions(save_onnx=1)"),
                         (dict(check_passes="yes"), "DebugOptions(check_passes='yes')"),
                         (dict(save_onnx=None), "DebugOptions(save_onnx=None)"),
                         (dict(log_level="LOUD"), "DebugOptions(log_level='LOUD') is not valid: expected a "
                                                  "spmd_ort.LogLevel or its name (VERBOSE, INFO, WARNING"),
                         (dict(log_level=True), "DebugOptions(log_level=True)"),
                         (dict(onnx_prefix="runs/a"), "DebugOptions(onnx_prefix='runs/a')"),
                         (dict(onnx_prefix=""), "DebugOptions(onnx_prefix='')")):
        with pytest.raises(spmd_ort.ConfigError) as err:
            spmd_ort.DebugOptions(**kwargs)
        assert text in str(err.value), (kwargs, str(err.value))
    assert spmd_ort.DebugOptions(log_level="info").log_level is spmd_ort.LogLevel.INFO
    assert spmd_ort.DebugOptions(log_level=logging.ERROR).log_level is spmd_ort.LogLevel.ERROR
    assert spmd_ort.compile(debug=spmd_ort.DebugOptions(log_level="verbose"))(train_step).options.log_level \
        is spmd_ort.LogLevel.VERBOSE
    spmd_ort.compile()  # the level back to the default for the tests after this one
    with pytest.raises(spmd_ort.ConfigError, match=r"compile\(debug=\{'log_level': 'INFO'\}\) is not valid: "
                                                   r"expected a spmd_ort.DebugOptions.*not a dict"):
        spmd_ort.compile(debug={"log_level": "INFO"})


def test_a_default_backend_on_a_gpu_never_stops_at_a_missing_onnxruntime_gpu(monkeypatch):
    """Unset, the backend is ORT; on CUDA tensors it stays ORT where onnxruntime has the CUDA provider, else
    inductor (triton there), else fx, each with the reason explain() shows.  A backend the user chose (argument or
    SPMD_ORT_BACKEND) is theirs: ORT on a GPU without the provider is still the clear ConfigError."""
    from spmd_ort.options import default_backend_for

    cpu_only = ["CPUExecutionProvider"]
    assert default_backend_for("cpu", cpu_only, True) == ("ort", "the default")
    assert default_backend_for("cuda", ["CUDAExecutionProvider", *cpu_only], False)[0] == "ort"
    backend, why = default_backend_for("cuda", cpu_only, True)
    assert backend == "inductor" and "onnxruntime-gpu" in why
    backend, why = default_backend_for("cuda", cpu_only, False)
    assert backend == "fx" and "triton" in why
    monkeypatch.delenv("SPMD_ORT_BACKEND", raising=False)
    assert not Options.resolve().backend_given and Options.resolve(backend="ort").backend_given
    monkeypatch.setenv("SPMD_ORT_BACKEND", "fx")
    assert Options.resolve().backend_given and Options.resolve().backend == "fx"
    monkeypatch.delenv("SPMD_ORT_BACKEND")
    step = spmd_ort.compile()(train_step)  # a CPU model: the default stays ORT, said so by explain()
    model = MLP()
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert step.backend == "ort" and step.backend_reason == "the default" and "ort backend (the default)" in \
        step.explain()


def test_checkpointing_policies_are_named_settings_of_the_budget():
    """``"full"`` and ``"selective"`` (torchtitan's activation checkpointing) are accepted by compile() and the
    environment; any other word is a ConfigError naming them."""
    assert Options.resolve(activation_memory_budget="selective", environ={}).activation_memory_budget == "selective"
    env = {"SPMD_ORT_ACTIVATION_MEMORY_BUDGET": "full"}
    assert Options.resolve(environ=env).activation_memory_budget == "full"
    assert Options.resolve(activation_memory_budget=0.25, environ=env).activation_memory_budget == 0.25
    with pytest.raises(spmd_ort.ConfigError, match='"full" / "selective"'):
        spmd_ort.compile(activation_memory_budget="half")
