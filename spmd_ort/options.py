"""User-facing options, and every ``SPMD_ORT_*`` environment variable in one table.

:class:`Options` is what one compiled step runs with.  ``spmd_ort.compile``
builds it once, from its arguments, :class:`DebugOptions` and the environment
(:data:`ENV_VARS`), and hands it down to every stage; nothing else reads the
environment.  A value that is not allowed is a :class:`~spmd_ort.errors.ConfigError`
naming the variable and what it accepts.  The README's table of environment
variables is :func:`env_table_markdown` (a test keeps them equal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmd_ort.errors import ConfigError

logger = logging.getLogger("spmd_ort")

BACKENDS = ("ort", "fx", "inductor")  # what runs a program (Options.backend)
# what a user chooses (compile(backend=...), SPMD_ORT_BACKEND): "auto" is ORT with every measured choice (each
# segment on the faster of ORT and fx, the whole graph against its segments, inductor's candidate); "ort" is ORT
BACKEND_CHOICES = ("auto", *BACKENDS)
FALLBACK_POLICIES = ("FALLBACK_TO_FX", "FALLBACK_DISABLE")
SEGMENT_EXECUTORS = ("auto", "ort", "fx")
DYNAMIC_MODES = ("auto", "1", "0")  # SPMD_ORT_DYNAMIC; compile(dynamic=None/True/False)
BACKGROUND_MODES = ("auto", "1", "0")  # SPMD_ORT_BACKGROUND_COMPILE
# torch.onnx's exporter implements opset 18 and later (below it, it silently stays at 18);
# its version converter and onnxruntime 1.2x-1.3x handle up to 25 (26+ gives invalid models).
OPSET_RANGE = (18, 25)
DEFAULT_OPSET = 20


class LogLevel(enum.IntEnum):
    VERBOSE = logging.DEBUG
    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    FATAL = logging.CRITICAL


@dataclass(frozen=True, kw_only=True)
class DebugOptions:
    """What the compiler shows and checks.

    ``log_level`` sets the ``spmd_ort`` logger.
    ``save_onnx``/``onnx_prefix`` write exported segments (ORT backend).
    ``verify`` checks every exported segment numerically against the FX graph on the first run (on by default).
    ``check_passes`` checks every graph pass's declared contract on the graph (the order is checked always).

    A field left at None is not given: its environment variable (``SPMD_ORT_LOG_LEVEL``, ``SPMD_ORT_VERIFY``,
    ``SPMD_ORT_CHECK_PASSES``) decides, else the default.  One rule for every setting: what the code passes wins
    over the environment, which wins over the default.
    """

    log_level: LogLevel | None = None
    save_onnx: bool = False
    onnx_prefix: str = "spmd_ort"
    verify: bool | None = None
    check_passes: bool | None = None

    def __post_init__(self):
        """Checked here, where they are given: ``log_level`` is a LogLevel or its name (``"INFO"``), the switches are
        booleans, ``onnx_prefix`` a file-name prefix.  A bad value is a ConfigError naming the field."""
        if self.log_level is not None:
            object.__setattr__(self, "log_level", _debug_log_level(self.log_level))
        for name in ("save_onnx", "verify", "check_passes"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name != "save_onnx"):
                raise ConfigError(f"DebugOptions({name}={value!r}) is not valid: expected True or False (or None: "
                                  "not given)")
        prefix = self.onnx_prefix
        if not isinstance(prefix, str) or not prefix or any(sep in prefix for sep in ("/", "\\", os.sep)):
            raise ConfigError(f"DebugOptions(onnx_prefix={prefix!r}) is not valid: expected a non-empty file-name "
                              "prefix without path separators (SPMD_ORT_SAVE_ONNX_PATH sets the directory)")


def _debug_log_level(value: Any) -> LogLevel:
    """A LogLevel from a LogLevel, its name in any case, or its number (``logging.INFO``)."""
    if isinstance(value, LogLevel):
        return value
    if isinstance(value, str) and value.strip().upper() in LogLevel.__members__:
        return LogLevel[value.strip().upper()]
    if isinstance(value, int) and not isinstance(value, bool) and value in LogLevel._value2member_map_:
        return LogLevel(value)
    raise ConfigError(f"DebugOptions(log_level={value!r}) is not valid: expected a spmd_ort.LogLevel or its name "
                      f"({', '.join(LogLevel.__members__)})")


@dataclass(frozen=True, kw_only=True)
class Options:
    """Everything one compiled step is configured with (resolved once, at ``spmd_ort.compile``)."""

    backend: str = BACKENDS[0]
    # whether the user chose the backend (compile(backend=...) or SPMD_ORT_BACKEND): a default one may be
    # swapped on a GPU (default_backend_for)
    backend_given: bool = False
    log_level: LogLevel = LogLevel.WARNING
    disabled_passes: frozenset[str] = frozenset()
    check_passes: bool = False
    onnx_opset: int = DEFAULT_OPSET
    verify: bool = True
    fallback_policy: str = FALLBACK_POLICIES[0]
    segment_executor: str = SEGMENT_EXECUTORS[0]
    auto_inductor: bool = True  # with segment_executor auto: the whole graph compiled by inductor is a candidate
    # the candidate compiled by a forked process while the steps run (CPU; backends/inductor.py BackgroundCompile):
    # "auto" where a core is left idle by the steps' threads, "1" always, "0" never
    background_compile: str = BACKGROUND_MODES[0]
    # choices made from measurements (spmd_ort.tuner): False is the static ones (segments on ORT, no candidate)
    autotune: bool = True
    cache_dir: Path = Path.home() / ".cache" / "spmd_ort"
    # the automatic choice's decisions kept in cache_dir/choices for the next run (backends/ort/remembered.py)
    remember_choices: bool = True
    plan_cache: bool = True  # plan() reads and keeps plans in cache_dir/plans (spmd_ort/plan/cache.py)
    save_onnx: bool = False
    onnx_prefix: str = "spmd_ort"
    save_onnx_path: Path | None = None  # None: the working directory
    native: bool = True
    retain_host_memory: bool = False  # opt-in: glibc's allocator is the whole process's (runtime/memory.py)
    allow_spinning: bool = True
    custom_autograd: bool = True  # autograd.Functions that cannot be traced run opaquely
    opaque_functions: frozenset[str] = frozenset()  # qualified Function names always run opaquely
    auto_opaque: bool = True  # submodules that cannot be traced run opaquely
    dynamic: str = DYNAMIC_MODES[0]  # "auto": sizes that change become symbolic; "1": from the start; "0": never
    # saved-for-backward bytes kept, as a fraction of those that can be recomputed (passes/recompute.py)
    activation_memory_budget: float | str = 1.0
    # on a GPU, after the checked first run and one more, the whole step is captured as a CUDA graph and replayed
    # (spmd_ort.backends.cuda_graph); nothing changes on the CPU
    cuda_graph: bool = False

    @classmethod
    def resolve(cls, *, debug: DebugOptions | None = None, backend: str | None = None,
                dynamic: bool | None = None, activation_memory_budget: float | str | None = None,
                autotune: bool | None = None, cuda_graph: bool | None = None,
                environ: Mapping[str, str] | None = None) -> Options:
        """Options from ``compile``'s arguments, ``DebugOptions`` and the environment.

        One rule: an argument given (a ``compile()`` keyword, a ``DebugOptions`` field not None) wins over its
        ``SPMD_ORT_*`` variable, which wins over the default.  ``backend``: ``"auto"`` (the default) runs ORT with
        every choice measured (``segment_executor`` ``auto``, inductor's candidate); ``"ort"`` runs every segment
        ORT supports on ORT (``segment_executor`` ``ort``); the developer switches ``SPMD_ORT_SEGMENT_EXECUTOR`` and
        ``SPMD_ORT_AUTO_INDUCTOR`` refine either.  ``autotune`` off: ``segment_executor`` ``auto`` is ``ort``.
        """
        if debug is None:
            debug = DebugOptions()
        elif not isinstance(debug, DebugOptions):
            raise ConfigError(f"compile(debug={debug!r}) is not valid: expected a spmd_ort.DebugOptions, e.g. "
                              f"DebugOptions(log_level='INFO', save_onnx=True), not a {type(debug).__name__}")
        env = from_environment(os.environ if environ is None else environ)
        values: dict[str, Any] = {"save_onnx": debug.save_onnx, "onnx_prefix": debug.onnx_prefix}
        values.update(env)
        for name in ("log_level", "verify", "check_passes"):  # given in DebugOptions: over the environment
            if getattr(debug, name) is not None:
                values[name] = getattr(debug, name)
        if not values.get("custom_autograd", True) and values.get("opaque_functions"):
            raise ConfigError("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS lists Functions to run opaquely, but "
                              "SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1 runs none opaquely; set one of them")
        if values.get("opaque_functions"):
            values["opaque_functions"] = frozenset(resolve_function(n) for n in values["opaque_functions"])
        if backend is not None:
            if backend not in BACKEND_CHOICES:
                raise ConfigError(f"backend={backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
            values["backend"] = backend
        choice = values.pop("backend", "auto")
        values["backend"] = "ort" if choice == "auto" else choice
        values["backend_given"] = choice != "auto"  # a default one may be swapped on a GPU (default_backend_for)
        if choice == "ort":  # ORT alone (the developer switches, when set, refine it)
            values.setdefault("segment_executor", "ort")
            values.setdefault("auto_inductor", False)
        if dynamic is not None:
            if not isinstance(dynamic, bool):
                raise ConfigError(f"dynamic={dynamic!r} is not one of None (automatic), True, False")
            values["dynamic"] = "1" if dynamic else "0"
        if activation_memory_budget is not None:
            values["activation_memory_budget"] = check_budget(activation_memory_budget)
        if autotune is not None:
            if not isinstance(autotune, bool):
                raise ConfigError(f"autotune={autotune!r} is not one of None (SPMD_ORT_AUTOTUNE), True, False")
            values["autotune"] = autotune
        if cuda_graph is not None:
            if not isinstance(cuda_graph, bool):
                raise ConfigError(f"cuda_graph={cuda_graph!r} is not one of None (SPMD_ORT_CUDA_GRAPH), True, False")
            values["cuda_graph"] = cuda_graph
        if not values.get("autotune", True) and values.get("segment_executor", "auto") == "auto":
            values["segment_executor"] = "ort"  # the static choice: every segment ORT supports runs on ORT
        return cls(**values)

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)


def default_backend_for(device_type: str, providers: Sequence[str], has_triton: bool) -> tuple[str, str]:
    """The backend a step whose tensors are on ``device_type`` gets when the user chose none, and why.

    On a CPU: ORT.  On a GPU: ORT's CUDA execution provider when this onnxruntime has it (``providers``:
    ``onnxruntime.get_available_providers()``), else inductor when triton is there to compile its kernels, else
    fx: a GPU user's first call never stops at a missing ``onnxruntime-gpu``.
    """
    if device_type != "cuda":
        return "ort", "the default"
    if "CUDAExecutionProvider" in providers:
        return "ort", "the default; this onnxruntime has the CUDA execution provider"
    if has_triton:
        return "inductor", ("the step's tensors are on CUDA and this onnxruntime has no CUDA execution provider "
                            "(install onnxruntime-gpu for ORT); inductor compiles the step instead")
    return "fx", ("the step's tensors are on CUDA, this onnxruntime has no CUDA execution provider and triton is "
                  "not installed (inductor cannot compile GPU kernels): the step runs on fx")


# ---------------------------------------------------------------------- parsers
def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("1/0, true/false, yes/no or on/off")


def _choice(what: str, allowed: tuple[str, ...], upper: bool = False) -> Callable[[str], str]:
    def parse(value: str) -> str:
        v = value.strip().upper() if upper else value.strip()
        if v not in allowed:
            raise ValueError(" or ".join(allowed))
        return v

    return parse


def _log_level(value: str) -> LogLevel:
    try:
        return LogLevel[value.strip().upper()]
    except KeyError:
        raise ValueError(", ".join(LogLevel.__members__)) from None


def _opset(value: str) -> int:
    lo, hi = OPSET_RANGE
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"an integer from {lo} to {hi}") from None
    if not lo <= v <= hi:
        raise ValueError(f"an integer from {lo} to {hi} (the ONNX exporter implements {lo}+, "
                         f"onnxruntime loads up to {hi})")
    return v


# Named settings of activation_memory_budget: activation checkpointing as torchtitan runs it (recompute.POLICIES)
CHECKPOINT_POLICIES = ("full", "selective")


def check_budget(value: Any) -> float | str:
    """``compile(activation_memory_budget=...)``: a number from 0 to 1, or ``"full"`` / ``"selective"``
    (checkpointing every block, torchtitan's two modes), else a ConfigError naming the fix."""
    if isinstance(value, str) and value in CHECKPOINT_POLICIES:
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
    if not ok:
        raise ConfigError(f"compile(activation_memory_budget={value!r}) is not valid: expected a number from 0.0 "
                          "(recompute every activation that can be recomputed) to 1.0 (keep what eager keeps, the "
                          "default), e.g. activation_memory_budget=0.5, or \"full\" / \"selective\" "
                          "(activation checkpointing of every block as torchtitan runs it)")
    return float(value)


def _budget(value: str) -> float | str:
    if value.strip() in CHECKPOINT_POLICIES:
        return value.strip()
    try:
        v = float(value)
    except ValueError:
        raise ValueError("a number from 0.0 (recompute what can be recomputed) to 1.0 (keep what eager keeps), or "
                         "full / selective") from None
    if not 0.0 <= v <= 1.0:  # (nan fails too)
        raise ValueError("a number from 0.0 (recompute what can be recomputed) to 1.0 (keep what eager keeps), or "
                         "full / selective")
    return v


def _directory(value: str) -> Path:
    """A directory to write into: it may not exist yet (it is created), but no part of it may be a file."""
    path = Path(value).expanduser()
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise ValueError(f"a directory, but {str(part)!r} is a file")
            break
    return path


def _names(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def _not(parse: Callable[[str], bool]) -> Callable[[str], bool]:
    return lambda value: not parse(value)


def _qualified_names(value: str) -> frozenset[str]:
    names = _names(value)
    def qualified(name: str) -> bool:  # `<locals>` appears in the names of classes defined in a function
        return "." in name and all(part.isidentifier() or part == "<locals>" for part in name.split("."))

    bad = sorted(n for n in names if not qualified(n))
    if bad:
        raise ValueError(f"comma-separated qualified class names such as `pkg.module.MyFunction` "
                         f"(not {', '.join(bad)})")
    return names


def resolve_function(name: str) -> str:
    """The qualified name (``module.Class``, as the compiled step matches it) of the autograd.Function that
    ``SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS`` names as ``name``; a ConfigError when there is none.

    The longest importable prefix of ``name`` is imported and the rest looked up in it, so a name that no
    Function has fails at compile() instead of running everything traced.  A Function re-exported elsewhere
    (``pkg.Fn`` for ``pkg.mod.Fn``) is found under its own name.  A class defined in a function
    (``<locals>`` in the name) cannot be imported: the compiled step warns after its first trace if it met
    no Function of that name.
    """
    import importlib

    import torch

    if "<locals>" in name:
        return name
    var = f"SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS names `{name}`"
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # not a module: a shorter prefix may be
            raise ConfigError(f"{var}, but importing `{module_name}` failed: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's module failed to import
            raise ConfigError(f"{var}, but importing `{module_name}` failed: {type(exc).__name__}: {exc}") from None
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                raise ConfigError(f"{var}, but `{'.'.join(parts[:i])}` has no attribute `{attr}`. Fix: give the "
                                  "Function's module and class, e.g. `mypkg.layers.MyFunction`")
            obj = getattr(obj, attr)
        if not (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)):
            what = f"the class `{obj.__module__}.{obj.__qualname__}`" if isinstance(obj, type) else \
                f"a {type(obj).__name__}"
            raise ConfigError(f"{var}, which is {what}, not a torch.autograd.Function subclass")
        return f"{obj.__module__}.{obj.__qualname__}"
    raise ConfigError(f"{var}, but no module `{parts[0]}` can be imported. Fix: give the Function's module and "
                      "class, e.g. `mypkg.layers.MyFunction`")


@dataclass(frozen=True)
class EnvVar:
    name: str
    field: str  # the Options field it sets
    parse: Callable[[str], Any]
    default: str  # as the README shows it
    doc: str
    user: bool = False  # a setting users train with (docs/options.md); else a developer or test switch (testing.md)


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("SPMD_ORT_LOG_LEVEL", "log_level", _log_level, "`WARNING`",
           "`VERBOSE`, `INFO`, `WARNING`, `ERROR` or `FATAL`, where `DebugOptions(log_level=...)` is not given",
           user=True),
    EnvVar("SPMD_ORT_BACKEND", "backend", _choice("backend", BACKEND_CHOICES), "`auto`",
           "`auto` (ONNX Runtime, each segment on the faster of ORT and fx, the whole graph against its segments, "
           "inductor's candidate), `ort` (every segment ORT supports on ORT), `fx` or `inductor`: the backend when "
           "`compile(backend=None)`", user=True),
    EnvVar("SPMD_ORT_DISABLE_PASSES", "disabled_passes", _names, "none",
           "comma-separated graph pass names to skip (e.g. `reinplace_optimizer_pass`); an unknown name is an error"),
    EnvVar("SPMD_ORT_CHECK_PASSES", "check_passes", _bool, "`0`",
           "`1`: check every pass's contract (requires / provides) on the graph (always on in the test suite; "
           "the pipeline's order is checked always), where `DebugOptions(check_passes=...)` is not given"),
    EnvVar("SPMD_ORT_ONNX_OPSET_VERSION", "onnx_opset", _opset, f"`{DEFAULT_OPSET}`",
           f"ONNX opset of exported segments, {OPSET_RANGE[0]} to {OPSET_RANGE[1]}"),
    EnvVar("SPMD_ORT_VERIFY", "verify", _bool, "`1`",
           "`0`: skip comparing every exported segment with its fx graph on the first run (which runs both "
           "anyway), where `DebugOptions(verify=...)` is not given", user=True),
    EnvVar("SPMD_ORT_FALLBACK_POLICY", "fallback_policy", _choice("policy", FALLBACK_POLICIES, upper=True),
           "`FALLBACK_TO_FX`", "`FALLBACK_TO_FX` or `FALLBACK_DISABLE` (a segment ORT cannot run is an error)"),
    EnvVar("SPMD_ORT_SEGMENT_EXECUTOR", "segment_executor", _choice("executor", SEGMENT_EXECUTORS), "`auto`",
           "who runs each ORT segment after the first run: `auto` (the faster of ORT and fx, timed on the first "
           "run), `ort` or `fx`"),
    EnvVar("SPMD_ORT_AUTO_INDUCTOR", "auto_inductor", _bool, "`1`",
           "with `SPMD_ORT_SEGMENT_EXECUTOR=auto`, the whole graph compiled by inductor is a candidate of the "
           "automatic choice (where a C++ compiler is found); `0`: only ORT and fx are (`backend='ort'`: `0`)"),
    EnvVar("SPMD_ORT_BACKGROUND_COMPILE", "background_compile", _choice("mode", BACKGROUND_MODES), "`auto`",
           "`1`: inductor's candidate is compiled by a forked process at the lowest priority, one thread, from the "
           "first steady steps on, while the steps run (CPU graphs; it fills inductor's cache, from which the step "
           "then loads it); `0`: compiled in the step once the steady steps have spent its predicted compile; "
           "`auto`: `1` where the machine has a core that no rank's torch threads use, else `0`"),
    EnvVar("SPMD_ORT_AUTOTUNE", "autotune", _bool, "`1`",
           "`0`: the static choices, no measurement decides anything after compile (every segment ORT supports "
           "runs on ORT, no whole-graph choice, no inductor candidate, `bucket_cap_mb='auto'` keeps its starting "
           "cap, no recompiles; `SPMD_ORT_SEGMENT_EXECUTOR=auto` acts as `ort`); `compile(autotune=...)` wins",
           user=True),
    EnvVar("SPMD_ORT_CACHE_DIR", "cache_dir", Path, "`~/.cache/spmd_ort`",
           "exported models, the automatic choice's remembered decisions and kept plans", user=True),
    EnvVar("SPMD_ORT_REMEMBER_CHOICES", "remember_choices", _bool, "`1`",
           "the automatic choice's decisions (each segment's executor, the whole graph's, inductor's candidate "
           "kept or dropped) are kept in `SPMD_ORT_CACHE_DIR/choices`, keyed by the graph, the options, the "
           "world size and the machine, and a later run of the same program starts on them without measuring "
           "again; so is `bucket_cap_mb='auto'`'s cap (keyed by the model's structure, the layout, the world "
           "size and the machine); `0`: every run measures afresh"),
    EnvVar("SPMD_ORT_PLAN_CACHE", "plan_cache", _bool, "`1`",
           "`plan()` keeps each plan in `SPMD_ORT_CACHE_DIR/plans`, keyed by the model, optimizer, call, step, "
           "options and the code (spmd_ort's, the user's, the versions), and the same plan again is read from "
           "there; `0` (or `plan(cache=False)`) plans afresh"),
    EnvVar("SPMD_ORT_SAVE_ONNX_PATH", "save_onnx_path", _directory, "working directory",
           "the directory where `DebugOptions(save_onnx=True)` writes `<onnx_prefix>_<segment>.onnx` (open them in "
           "Netron; created if missing, a file there is a `ConfigError`)"),
    EnvVar("SPMD_ORT_NATIVE", "native", _bool, "`1`",
           "`0`: host optimizer steps use torch's fused kernels instead of building `csrc/`"),
    EnvVar("SPMD_ORT_RETAIN_HOST_MEMORY", "retain_host_memory", _bool, "`0`",
           "`1`: the first compiled call makes the whole process keep freed host memory for reuse (glibc's "
           "`mallopt`; fewer page faults on CPU, resident memory stays at its peak; see `memory()`); `0` leaves "
           "glibc's allocator as it is", user=True),
    EnvVar("SPMD_ORT_ALLOW_SPINNING", "allow_spinning", _bool, "`1`",
           "`0` stops ORT's worker threads from spinning during a run (they stop when a run returns either way)"),
    EnvVar("SPMD_ORT_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", "custom_autograd", _not(_bool), "`0`",
           "`1`: never run an autograd.Function opaquely: it is traced, or the compile fails naming it"),
    EnvVar("SPMD_ORT_OPAQUE_AUTOGRAD_FUNCTIONS", "opaque_functions", _qualified_names, "none",
           "comma-separated autograd.Functions (`pkg.module.Class`) always run opaquely, as host nodes, untraced; "
           "each is imported at `compile()` (a name that is no Function is a `ConfigError`; one defined in a "
           "function, `<locals>`, gets a WARNING after the first trace if the step applied none of that name)",
           user=True),
    EnvVar("SPMD_ORT_DYNAMIC", "dynamic", _choice("dynamic", DYNAMIC_MODES), "`auto`",
           "`auto`: the first trace is static, sizes of tensor inputs and int/float arguments that change become "
           "symbolic (one program for all of them); `1`: batch and sequence dims symbolic from the start; "
           "`0`: one program per shape. `compile(dynamic=True/False)` wins", user=True),
    EnvVar("SPMD_ORT_ACTIVATION_MEMORY_BUDGET", "activation_memory_budget", _budget, "`1.0`",
           "0.0 to 1.0: the share of the recomputable saved-for-backward bytes the backward keeps; the rest is "
           "recomputed just before its use (`0.0`: all that can be; see `recompute_activations_pass`); `full` or "
           "`selective`: every block checkpointed as torchtitan does (docs/memory.md). "
           "`compile(activation_memory_budget=...)` wins", user=True),
    EnvVar("SPMD_ORT_CUDA_GRAPH", "cuda_graph", _bool, "`0`",
           "`1`: a step on a GPU is captured as one CUDA graph after its checked first run and one more, then "
           "replayed (fx and inductor backends; what cannot be captured runs as before and `explain()` says why; "
           "no effect on the CPU). `compile(cuda_graph=...)` wins", user=True),
    EnvVar("SPMD_ORT_AUTO_OPAQUE", "auto_opaque", _bool, "`1`",
           "`0`: a submodule that cannot be traced is a `CompileError` instead of an opaque host node "
           "(`OpaqueOverride` still applies)"),
)
# read by the test suite, not by spmd_ort (no Options field): known, so never warned about
TEST_ENV = (("SPMD_ORT_TEST_DEVICE", "`cuda`", "the device tests/test_cuda.py runs on (`cpu`: its CPU checks)"),)
# read by other programs, not by spmd_ort: documented beside ours
OTHER_ENV = (("TORCH_EXTENSIONS_DIR", "torch's `~/.cache/torch_extensions`",
              "where the native kernel is built and cached"),)


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Options fields set by the environment; a bad value raises ConfigError naming the variable."""
    out: dict[str, Any] = {}
    known = {v.name for v in ENV_VARS} | {name for name, _, _ in TEST_ENV}
    for var in ENV_VARS:
        raw = environ.get(var.name)
        if raw is None or raw == "":
            continue
        try:
            out[var.field] = var.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{var.name}={raw!r} is not valid: expected {exc}") from None
    unknown = sorted(k for k in environ if k.startswith("SPMD_ORT_") and k not in known)
    if unknown:
        logger.warning("ignoring unknown environment variable(s) %s; spmd_ort reads %s", ", ".join(unknown),
                       ", ".join(sorted(known)))
    return out


def environment_value(field: str, environ: Mapping[str, str] | None = None) -> Any:
    """The ``Options`` field ``field`` as the environment sets it (its variable parsed as :meth:`Options.resolve`
    parses it), else the field's default: for what runs outside one step's options (the ORT coverage table's
    cache of op names reads ``cache_dir``)."""
    environ = os.environ if environ is None else environ
    for var in ENV_VARS:
        if var.field == field:
            raw = environ.get(var.name)
            if raw is None or raw == "":
                break
            try:
                return var.parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{var.name}={raw!r} is not valid: expected {exc}") from None
    return getattr(Options, field)


def env_table_markdown(user: bool = True) -> str:
    """The table of environment variables: users' (docs/options.md), or the developer and test switches
    (docs/testing.md)."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.default} | {v.doc} |" for v in ENV_VARS if v.user == user]
    extra = OTHER_ENV if user else TEST_ENV
    rows += [f"| `{name}` | {default} | {doc} |" for name, default, doc in extra]
    return "\n".join(rows)


class _RankFilter(logging.Filter):
    """Gives every spmd_ort log record ``rank`` (" rank <r>" under torch.distributed with several ranks, else "").

    A logger's filters see only the records made by that logger, not those its children
    propagate, so every ``spmd_ort`` logger carries one (each module's ``get_logger(__name__)``), and so
    does the handler :func:`configure_logging` adds.  Only our loggers and our handler carry it: no record
    factory, nothing on the root logger.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = ""
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                record.rank = f" rank {dist.get_rank()}"
        except (ImportError, RuntimeError):
            pass
        return True


_RANK_FILTER = _RankFilter()


def get_logger(name: str = "spmd_ort") -> logging.Logger:
    """The logger ``name`` (``spmd_ort`` or a child of it), whose records carry ``%(rank)s`` for every handler."""
    if name != "spmd_ort" and not name.startswith("spmd_ort."):
        raise ValueError(f"get_logger({name!r}): spmd_ort's loggers are `spmd_ort` and its children")
    named = logging.getLogger(name)
    if _RANK_FILTER not in named.filters:
        named.addFilter(_RANK_FILTER)
    return named


get_logger("spmd_ort")  # records made before any compile() (e.g. while a DeepSpeed config is read) carry it too


def configure_logging(level: LogLevel) -> None:
    """The ``spmd_ort`` logger at ``level``; its records carry ``%(rank)s`` for any handler's format.

    Progress lines of long compiles (``spmd_ort.progress``, INFO) show at the default level too, and only
    ERROR or FATAL hide them.
    """
    logger.setLevel(int(level))
    get_logger("spmd_ort")
    get_logger("spmd_ort.progress").setLevel(min(int(level), logging.INFO) if level <= LogLevel.WARNING
                                                     else int(level))
    # Print on our own only where the application has not configured logging.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[spmd_ort%(rank)s %(levelname)s] %(message)s"))
        handler.addFilter(_RANK_FILTER)  # also for a child logger made with logging.getLogger, not get_logger
        logger.addHandler(handler)


@contextlib.contextmanager
def logs_filtered(names: tuple[str, ...], flt: logging.Filter) -> Iterator[None]:
    """While the block runs, ``flt`` filters the loggers ``names`` (torch's, whose records we reword or drop);
    afterwards they are as they were: nothing of ours stays on another library's logger."""
    loggers = [logging.getLogger(name) for name in names]
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)
