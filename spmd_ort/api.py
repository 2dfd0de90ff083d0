"""``spmd_ort.compile``: the decorator users put on their train step.

``@spmd_ort.compile(...)`` reads the configuration once and returns a
:class:`~spmd_ort.step.CompiledStep`; each compiled variant runs the pipeline of
:mod:`spmd_ort.compiler` (trace -> passes -> executor).  ``Override`` /
``OpaqueOverride`` (:mod:`spmd_ort.overrides`) stand in for submodules that cannot
be traced as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from spmd_ort import passes as P
from spmd_ort.options import DebugOptions, Options, configure_logging
from spmd_ort.overrides import OpaqueOverride, Override, as_overrides
from spmd_ort.step import CompiledStep

__all__ = ["CompiledStep", "OpaqueOverride", "Override", "compile", "parallelize"]


def compile(  # noqa: A001 - the reference API's name
    module_override: Override | list[Override] | None = None,
    gm_transformation: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
    parallel_mode: Any = None,
    backend: str | None = None,
    debug: DebugOptions | None = None,
    dynamic: bool | None = None,
    activation_memory_budget: float | str | None = None,
    autotune: bool | None = None,
    cuda_graph: bool | None = None,
) -> Callable[[Callable], CompiledStep]:
    """Compile a whole train step (forward, backward, optimizer step) into one graph.

    The decorated function receives one ``nn.Module``, at most one optimizer and
    the batch.  Parameters, buffers, gradients, optimizer state and each param
    group's ``lr`` become graph inputs; after each call the module and optimizer
    hold what an eager step would have produced.  The wrapper accepts
    ``last_train_step=True`` (the reference API's flag; every call already completes its work).

    Args:
        module_override: an :class:`Override`, or a list of them, for submodules that cannot be traced.
        gm_transformation: ``GraphModule -> GraphModule`` applied once per compiled variant.
        parallel_mode: a :class:`spmd_ort.DataParallel`; ``None`` means DataParallel() when
            torch.distributed is initialized with more than one rank, else a single process.
        backend: ``"auto"`` (the default: ONNX Runtime segments + torch host nodes, each segment on the faster of
            ORT and fx, the whole graph against its segments, inductor's candidate), ``"ort"`` (every segment ORT
            supports on ORT), ``"fx"`` (PyTorch op by op) or ``"inductor"`` (segments compiled by inductor);
            default from ``SPMD_ORT_BACKEND``.
        debug: :class:`DebugOptions`.
        dynamic: ``None`` (automatic, the default): the first trace is static and sizes of tensor
            inputs (and int/float arguments) that change later become symbolic, so one program serves
            them all; ``True``: the
            batch and sequence dims (the first two) of every tensor input are symbolic from the start;
            ``False``: one program per shape.  Default from ``SPMD_ORT_DYNAMIC`` (``auto``/``1``/``0``).
        activation_memory_budget: from 0.0 to 1.0 (torch's name for the knob), the share of the
            recomputable saved-for-backward bytes the backward keeps; the rest it recomputes just before
            use (``recompute_activations_pass``).  1.0 (the default) keeps what eager keeps, 0.0 recomputes
            all that can be.  ``"full"`` / ``"selective"``: every block checkpointed as torchtitan does (its
            input kept; or torchtitan's op policy: every other matmul and attention kept).  Default from
            ``SPMD_ORT_ACTIVATION_MEMORY_BUDGET``.
        autotune: ``True`` (the default): after compile, measurements choose each segment's executor, the
            whole graph against its segments, inductor's candidate and ``bucket_cap_mb='auto'``'s cap
            (:mod:`spmd_ort.tuner`); ``False``: the static choices, the same every run.  Default from
            ``SPMD_ORT_AUTOTUNE``.
        cuda_graph: ``True``: a step whose tensors are on a GPU runs as one CUDA graph from its third call on
            (fx and inductor backends): the batch is copied into the graph's buffers, each param group's
            hyper-parameters are device tensors written before each replay, and the whole step (forward,
            backward, clipping, the optimizer, a GradScaler's skip) replays with one launch.  On fx, host
            nodes (an opaque part, Adam's step counters on the host) split it into one graph per run of nodes
            between them.  A step that cannot be captured (collectives, an output sized by values, host nodes
            on inductor) runs as without it, and ``explain()`` says why.  No effect on the CPU.
            Default from ``SPMD_ORT_CUDA_GRAPH`` (off).  See docs/gpu.md.

    The configuration (these arguments and every ``SPMD_ORT_*`` environment variable,
    :data:`spmd_ort.options.ENV_VARS`) is read here, once; a bad value is a
    :class:`~spmd_ort.errors.ConfigError` naming it.
    """
    overrides = as_overrides(module_override)
    options = Options.resolve(debug=debug, backend=backend, dynamic=dynamic,
                              activation_memory_budget=activation_memory_budget, autotune=autotune,
                              cuda_graph=cuda_graph)
    configure_logging(options.log_level)
    P.check_disabled(options.disabled_passes)

    def decorate(fn: Callable) -> CompiledStep:
        return CompiledStep(fn, module_override=overrides, gm_transformation=gm_transformation,
                            parallel_mode=parallel_mode, options=options)

    return decorate


def _no_step(*args, **kwargs):  # the step parallelize lays a model out for; never called
    raise AssertionError("parallelize's step is never called")


def parallelize(model, parallel_mode):
    """Lay ``model`` out for ``parallel_mode`` now, without a step, as FSDP2's ``fully_shard(model)`` and torch's
    ``parallelize_module`` do; returns ``model``.  Collective: every rank calls it.

    * ``DataParallel(parallel_style="fully_shard")``: every parameter becomes the ``Shard(0)`` DTensor the first
      step would make (each rank its rows), rank 0's weights everywhere first, unless the model is on the meta
      device: then nothing is allocated, and ``model.to_empty(device=...)`` allocates this rank's shards only.
    * ``TensorParallel(plan, ...)``: the plan's DTensors (2-D: with ``data_parallel=`` fully_shard, FSDP2 + TP's).
    * ``DataParallel()`` (replicate): nothing changes (the first step broadcasts rank 0's weights, as DDP does).

    A compiled step with the same ``parallel_mode`` takes the model as it is (no second sharding, no broadcast);
    one with another mode is a :class:`~spmd_ort.errors.ConfigError` naming both.  Then give a meta model values
    (``to_empty`` and your init, or :func:`spmd_ort.load_safetensors`), and build the optimizer after that.
    """
    from spmd_ort.distributed.parallel_dims import as_mode
    from spmd_ort.distributed.parallel import PARALLELIZED_ATTR, layout_difference
    from spmd_ort.distributed.sharding import keep_layout_through_to_empty
    from spmd_ort.errors import ConfigError

    parallel_mode = as_mode(parallel_mode)  # a Parallel: the modes it lowers to on this world
    done = getattr(model, PARALLELIZED_ATTR, None)
    if done is not None:
        difference = layout_difference(done, parallel_mode)
        if difference is None:
            return model
        raise ConfigError(f"{type(model).__name__} was parallelized with {done!r}; it cannot be parallelized again "
                          f"with {parallel_mode!r}, another layout ({difference}). Fix: build a fresh model for "
                          "another layout")
    meta = any(p.is_meta for p in model.parameters())
    compile(parallel_mode=parallel_mode, backend="fx")(_no_step).prepare(model)
    if meta:
        keep_layout_through_to_empty(model)  # its shard specs and tied weights
    model.__dict__[PARALLELIZED_ATTR] = parallel_mode  # (not a submodule, not state: a plain attribute)
    return model
