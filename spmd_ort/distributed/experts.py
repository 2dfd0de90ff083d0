"""Expert parallelism: each rank computes E/ep experts of every MoE layer, and tokens travel to them (all-to-all).

``Parallel(dp_shard=N, ep=M, experts="model.layers.*.mlp.experts")`` lowers to :class:`ExpertParallel`, a
``fully_shard`` data parallelism over the N ranks.  An experts module (transformers' fused experts, whose
parameters carry a leading expert dim: ``gate_up_proj`` (E, 2F, D), ``down_proj`` (E, D, F)) is held as every
other parameter is under fully_shard: rank r holds rows ``[r E/N, (r+1) E/N)``, that is experts ``r E/N ..``.
What changes is where they compute:

* the ranks form ``ep`` groups of ``efsdp = N / ep`` (:meth:`ExpertParallel.groups`): group j's ranks hold the
  shards of block j of E/ep experts (next to each other; with fewer experts than ranks, the ranks whose shards are
  its experts and some holding only fully_shard's padding), which they all-gather (instead of all E); the ``ep``
  ranks that share a position in their groups exchange tokens;
* the experts module runs as a host node of the graph (:mod:`spmd_ort.capture.opaque`), with the rank's block of
  experts: :func:`dispatch` sends each (token, chosen expert) pair to the rank that computes the expert
  (``all_to_all_single``, the sizes exchanged first: dropless), runs the module's own ``forward`` there on its
  E/ep experts, sends the results back and sums them with the router's weights.  Its backward is autograd's
  through the same exchanges (``torch.distributed.nn.functional.all_to_all_single``);
* the block's gradient sums what every token of the ep group sent it; it is averaged over the world (DDP's
  arithmetic) and, with ``efsdp > 1``, reduce-scattered over the efsdp group back to the rank's shard
  (:mod:`spmd_ort.passes.expert_parallel`).

Optimizer state, clipping, checkpoints and ``full_state_dict`` are fully_shard's, unchanged: the shards are the
same.  The router, the shared experts and everything else are fully_shard's too.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spmd_ort.distributed.parallel import DataParallel, world
from spmd_ort.errors import CompileError, ConfigError

# what an experts module's forward takes (transformers' fused experts: ``@use_experts_implementation``)
EXPECTED = ("parameters with a leading expert dim and a forward of either form: transformers' "
            "forward(hidden_states (tokens, hidden), top_k_index (tokens, k), top_k_weights (tokens, k)) -> "
            "(tokens, hidden) (MixtralExperts, Qwen3MoeExperts, DeepseekV3Experts), or torchtitan's "
            "GroupedExperts.forward(x (rows sorted by expert, hidden), num_tokens_per_expert (experts,)) -> "
            "(rows, hidden)")
ROUTED, GROUPED = "routed", "grouped"  # the two calls: the router's choices, or rows already sorted by expert


def call_kind(tensors: list) -> str | None:
    """Which experts call ``tensors`` (the call's tensor arguments) make: ROUTED, GROUPED, or None (neither)."""
    if len(tensors) == 3:
        hidden, index, weights = tensors
        if hidden.dim() == 2 and index.dim() == 2 and not index.is_floating_point() \
                and weights.shape == index.shape and index.shape[0] == hidden.shape[0]:
            return ROUTED
    if len(tensors) == 2:
        x, counts = tensors
        if x.dim() == 2 and x.is_floating_point() and counts.dim() == 1:
            return GROUPED
    return None


@dataclass(frozen=True, kw_only=True)
class ExpertParallel(DataParallel):
    """Expert parallelism (what ``Parallel(dp_shard=N, ep=M, experts=...)`` lowers to): fully_shard over every
    rank, and the modules that ``experts`` (an FQN glob) matches computed by expert, E/ep experts per rank."""

    ep: int = 2
    experts: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.parallel_style != "fully_shard":
            raise ValueError("ExpertParallel: expert parallelism borrows its ranks from dp_shard "
                             "(parallel_style='fully_shard')")
        if not self.experts:
            raise ValueError("ExpertParallel: give experts, a glob of the expert modules "
                             "('model.layers.*.mlp.experts')")

    def efsdp(self, world_size: int | None = None) -> int:
        """How many ranks share (shard) one block of E/ep experts."""
        n = world()[1] if world_size is None else world_size
        return n // self.ep

    def groups(self, experts: int, world_size: int | None = None) -> dict[str, list[list[int]]]:
        """The ranks of each group for ``experts`` experts per module: ``efsdp`` (block j's ranks, which shard
        it: first the ranks whose fully_shard rows are its experts, then ranks holding only padding rows when
        there are fewer experts than ranks) and ``ep`` (the ranks at one position of every block's group, which
        exchange tokens; the j-th of them computes block j).  Each group is in increasing rank order."""
        n = world()[1] if world_size is None else world_size
        inner = n // self.ep
        rows = -(-experts // n)  # fully_shard's rows of each rank (the last ranks' padding, with fewer experts)
        holders = experts // self.ep // rows  # ranks whose rows are one block's experts
        holding = experts // rows  # ranks holding experts; the rest hold padding rows only
        efsdp = [list(range(j * holders, (j + 1) * holders))
                 + list(range(holding + j * (inner - holders), holding + (j + 1) * (inner - holders)))
                 for j in range(self.ep)]
        return {"efsdp": efsdp, "ep": [[group[i] for group in efsdp] for i in range(inner)]}

    def group_names(self, experts: int) -> tuple[str, str]:
        """(this rank's ep group's name, its efsdp group's name; "" where a group is the world), made once per world
        and expert count: every rank makes every group together (the first compile, which every rank reaches
        alike), in the same order."""
        if self.efsdp() == 1:
            return "", ""
        built = self.__dict__.setdefault("_built", {})
        key = (id(dist.group.WORLD), experts)
        if key not in built:
            rank = dist.get_rank()
            mine = {}
            for kind, groups in self.groups(experts).items():
                for ranks in groups:
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[kind] = group.group_name
            built[key] = (mine["ep"], mine["efsdp"])
        return built[key]


def expert_modules(module: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The outermost submodules whose FQN matches ``pattern``."""
    out: list[tuple[str, nn.Module]] = []
    for fqn, mod in module.named_modules():
        if fqn and fnmatch.fnmatchcase(fqn, pattern) and not any(fqn.startswith(f"{p}.") for p, _ in out):
            out.append((fqn, mod))
    return out


def is_expert_param(name: str, mode) -> bool:
    """Whether parameter ``name`` belongs to a module that ``mode`` (an ExpertParallel) computes by expert."""
    if not isinstance(mode, ExpertParallel):
        return False
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), mode.experts) for i in range(1, len(parts)))


def num_experts(fqn: str, mod: nn.Module) -> int:
    """The module's expert count (its ``num_experts``; else the leading dim its parameters share)."""
    params = list(mod.named_parameters())
    n = getattr(mod, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool):
        leading = {p.shape[0] for _, p in params if p.dim() >= 1}
        if len(leading) != 1:
            raise ConfigError(f"Parallel(experts=...): module `{fqn}` ({type(mod).__name__}) has no `num_experts` "
                              f"and its parameters share no leading dim; expected {EXPECTED}")
        n = leading.pop()
    return n


def check_experts(module: nn.Module, mode: ExpertParallel, world_size: int) -> list[tuple[str, nn.Module]]:
    """The expert modules ``mode.experts`` names in ``module``; a ConfigError naming the module and the fix for
    a glob that matches nothing, a module that is not an experts module, or an expert count the layout cannot
    split (``ep`` blocks, each held in ``world_size / ep`` shards)."""
    rank = world()[0] if world_size > 1 else None
    found = expert_modules(module, mode.experts)
    if not found:
        some = [f for f, m in module.named_modules() if "expert" in f.rsplit(".", 1)[-1].lower()][:3]
        hint = f" (modules named like experts: {', '.join(some)})" if some else ""
        raise ConfigError(f"Parallel(experts={mode.experts!r}) matches no submodule of {type(module).__name__}"
                          f"{hint}. Fix: an FQN glob of the expert modules, e.g. 'model.layers.*.mlp.experts'",
                          rank=rank)
    if world_size % mode.ep:
        raise ConfigError(f"Parallel(ep={mode.ep}): ep borrows its ranks from dp_shard, so it must divide "
                          f"dp_shard ({world_size})", rank=rank)
    counts = set()
    for fqn, mod in found:
        params = list(mod.named_parameters())
        if not params:
            raise ConfigError(f"Parallel(experts={mode.experts!r}): module `{fqn}` ({type(mod).__name__}) has no "
                              f"parameters; expected {EXPECTED}", fqn=fqn, rank=rank)
        n = num_experts(fqn, mod)
        counts.add(n)
        bad = [(name, tuple(p.shape)) for name, p in params if p.dim() < 2 or p.shape[0] != n]
        if bad:
            name, shape = bad[0]
            raise ConfigError(f"Parallel(experts={mode.experts!r}): `{fqn}.{name}` has shape {shape}, without the "
                              f"leading expert dim of {n} experts; expected {EXPECTED}", fqn=f"{fqn}.{name}",
                              rank=rank)
        try:
            signature = list(inspect.signature(mod.forward).parameters)
        except (TypeError, ValueError):
            signature = []
        if len(signature) < 2:
            raise ConfigError(f"Parallel(experts={mode.experts!r}): module `{fqn}` ({type(mod).__name__}) takes "
                              f"({', '.join(signature)}), which is not an experts module's call; expected {EXPECTED}",
                              fqn=fqn, rank=rank)
        if n % mode.ep:
            raise ConfigError(f"Parallel(ep={mode.ep}): module `{fqn}` has {n} experts, which do not split into "
                              f"{mode.ep} equal blocks. Fix: an ep that divides {n}", fqn=fqn, rank=rank)
        rows = -(-n // world_size)  # fully_shard's rows per rank
        if (n // mode.ep) % rows:
            raise ConfigError(f"Parallel(ep={mode.ep}, dp_shard={world_size}): module `{fqn}` has {n} experts, held "
                              f"{rows} per rank by fully_shard, which do not tile its blocks of {n // mode.ep}. Fix: "
                              f"a dp_shard that divides {n} or that {n} divides", fqn=fqn, rank=rank)
    if len(counts) > 1:
        raise ConfigError(f"Parallel(experts={mode.experts!r}): the modules it matches have {sorted(counts)} experts; "
                          "expert parallelism spreads modules of one expert count", rank=rank)
    return found


# ---------------------------------------------------------------------- run time
def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """``x``'s rows sent in ``in_splits`` chunks, one per rank of ``group``; the chunks received (``out_splits``),
    rank-major.  Differentiable (torch's functional collective): the backward sends the gradients back the same
    way."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


@contextlib.contextmanager
def _num_experts(mod: nn.Module, n: int):
    """``mod.num_experts`` is ``n`` inside (what the module's forward reads for its count of experts)."""
    saved = mod.__dict__.get("num_experts", None)
    mod.num_experts = n
    try:
        yield
    finally:
        if saved is None:
            del mod.num_experts
        else:
            mod.num_experts = saved


def _exchange(compute, mod: nn.Module, experts: int, ep: int, group, out: Tensor, counts: Tensor,
              stats: dict | None) -> Tensor:
    """Rows ``out``, sorted by expert (``counts`` per expert), sent to the ranks of ``group`` that compute their
    experts (the j-th rank: block j of E/ep); ``compute(rows, got)`` run there with ``mod.num_experts`` the
    block's size, on the rows received (rank-major, each rank's by expert; ``got``: (ep, E/ep) rows of each local
    expert from each rank); its results sent back, in ``out``'s order.  ``stats``: filled with the tokens each of
    this rank's experts received and the bytes sent."""
    local = experts // ep
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)  # how many rows of each of my experts each rank sends
    got = got.view(ep, local)
    send = counts.view(ep, local).sum(1).tolist()
    recv = got.sum(1).tolist()
    rows = _all_to_all(out, recv, send, group)
    with _num_experts(mod, local):
        done = compute(rows, got)
    back = _all_to_all(done.to(out.dtype), send, recv, group)
    if stats is not None:
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        stats["tokens"] = got.sum(0).tolist()
        # rows this rank sends to other ranks: its tokens out and the results back, and the backward's same two
        remote = (sum(send) - send[me]) + (sum(recv) - recv[me])
        stats["bytes"] = 2 * remote * out.shape[-1] * out.element_size()
    return back


def _local_ids(got: Tensor) -> Tensor:
    """The local expert of each row received: ``got`` (ep, E/ep) rows of each local expert from each rank."""
    ep, local = got.shape
    return torch.repeat_interleave(torch.arange(local, device=got.device).repeat(ep), got.reshape(-1))


def dispatch(forward, mod: nn.Module, experts: int, ep: int, group, hidden: Tensor, top_k_index: Tensor,
             top_k_weights: Tensor, *, stats: dict | None = None) -> Tensor:
    """The experts module's output for ``hidden`` with its experts spread over ``group`` (``ep`` ranks, this rank
    computing the block of E/ep experts at its position): what ``forward(hidden, top_k_index, top_k_weights)``
    computes with every expert on one rank, token by token.

    ``forward`` runs with the module's parameters bound to this rank's block (the caller binds them) and
    ``num_experts`` set to the block's size, on the rows other ranks sent it, each with its one expert and weight
    1; the results come back and are summed with the router's weights (:func:`_exchange`)."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs by expert: by destination rank
    tokens = order // k

    def compute(rows: Tensor, got: Tensor) -> Tensor:
        ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)
        return forward(rows, _local_ids(got)[:, None], ones)

    back = _exchange(compute, mod, experts, ep, group, hidden[tokens], torch.bincount(flat, minlength=experts),
                     stats)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden).index_add(0, tokens, (back * weights).to(hidden.dtype))


def dispatch_sorted(forward, mod: nn.Module, experts: int, ep: int, group, x: Tensor, counts: Tensor, *,
                    stats: dict | None = None) -> Tensor:
    """torchtitan's call: ``forward(x, num_tokens_per_expert)`` on rows ``x`` already sorted by expert, ``counts``
    rows per expert, with the experts spread over ``group`` as :func:`dispatch` spreads them: the rows of each
    rank's experts sent to it, sorted by its experts there (the ranks' rows interleave), computed by the module's
    own forward on its E/ep experts, unsorted and sent back in ``x``'s order."""

    def compute(rows: Tensor, got: Tensor) -> Tensor:
        order = torch.argsort(_local_ids(got), stable=True)  # by local expert (each source's rows in their order)
        done = forward(rows[order], got.sum(0))
        return torch.empty_like(done).index_copy(0, order, done)

    return _exchange(compute, mod, experts, ep, group, x, counts.to(torch.long), stats)


def experts_runner(fqn: str, mod: nn.Module, forward, mode: ExpertParallel, n_params: int, kind: str = ROUTED):
    """The opaque call's ``run`` for one experts module: its activations (ROUTED: hidden states, top-k index,
    top-k weights; GROUPED: rows sorted by expert, rows per expert) and this rank's block of each parameter, in
    ``mod.named_parameters()`` order."""
    from torch.nn.utils import stateless

    from spmd_ort.runtime.collectives import data_group
    from spmd_ort.runtime.opaque_calls import RERUN
    from spmd_ort.runtime.step_runtime import current

    # each distinct parameter's names (a tied one has several), in first-seen order: the capture's input order
    by_id: dict[int, list[str]] = {}
    for n, p in mod.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    names = list(by_id.values())
    experts = num_experts(fqn, mod)

    def run(tensors: list[Tensor]):
        n_acts = 3 if kind == ROUTED else 2
        acts, params = tensors[:n_acts], tensors[n_acts:n_acts + n_params]
        expected = experts // mode.ep
        for ns, p in zip(names, params):
            if p.shape[0] != expected:
                raise CompileError(f"expert parallel: `{fqn}.{ns[0]}` reached the experts with {p.shape[0]} experts, "
                                   f"expected this rank's block of {expected}", fqn=fqn)
        group = data_group(mode.group_names(experts)[0])
        mapping = {n: t for ns, t in zip(names, params) for n in ns}
        stats: dict = {}
        spread = dispatch if kind == ROUTED else dispatch_sorted
        with stateless._reparametrize_module(mod, mapping):
            out = spread(forward, mod, experts, mode.ep, group, *acts, stats=stats)
        runtime = current()
        if runtime is not None:
            step = runtime.comm.step
            if RERUN.get():  # a backward's recomputation: its three exchanges again, its tokens counted already
                step.all_to_all_calls += 3
                step.all_to_all_bytes += stats["bytes"] // 2
            else:
                step.all_to_all_calls += 5  # sizes, tokens out and back; the backward's two (their gradients)
                step.all_to_all_bytes += stats["bytes"]
                step.expert_tokens.setdefault(fqn, []).append(stats["tokens"])
        return out

    return run
