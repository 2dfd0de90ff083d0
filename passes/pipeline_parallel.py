"""Pipeline parallelism: the traced step cut into stages and unrolled into this rank's schedule.

The step is traced on one micro-batch (the batch's dim 0 cut ``microbatches`` ways: ``spmd_ort.compiler``).  This
pass reads that graph as the whole model's forward, backward, gradient clipping and optimizer, and writes the graph
one rank runs: its stages' forward and backward of every micro-batch, in the order the schedule gives
(:func:`spmd_ort.distributed.stages.simulate`), then its stages' optimizer.

* **Stages.** A forward node belongs to the stage its place in the forward says: the stages begin at the first
  op of each module ``split`` names (graph order: the loss after the last block is the last stage's).  A
  backward node runs on the stage of the forward values it reads (the latest, where several), and where it
  reads only gradients, on the earliest stage they come from (gradients flow to earlier stages).  Values that
  only the batch or constants make (positions, masks, the labels' views) are computed on every stage that
  reads them.
* **Transfers.** A value one stage makes and another reads is sent point to point (``p2p_send``/``p2p_recv``):
  a micro-batch's activations and their gradients in its F and B, a parameter another stage also reads (a tied
  head) once per step from the stage that steps it.  Every rank walks one global order (the schedule's time
  line), so a receive never waits on a send that waits on it.
* **Gradients.** Each micro-batch's gradient of a parameter is summed into the step's on the stage that made it
  (a tied weight's parts on each of its stages, sent to the stage that steps it once, after the last
  micro-batch), then divided by the number of micro-batches: the gradient of the mean of the micro-batches'
  losses, which is the batch's loss where that loss is a mean over examples (the returned loss is that mean).
* **Clipping and the optimizer.** Each rank computes its stages' updates; the total gradient norm is its ranks'
  squared norms summed (one all-reduce), so every rank clips with the whole model's norm.
* **Zero bubble.** A stage's backward of a micro-batch is split into the nodes that the gradients it sends need
  (B) and the rest (W: the weights' gradients), which the schedule runs later, in what would be bubbles.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from spmd_ort.distributed.stages import PipelineParallel, Schedule, simulate
from spmd_ort.errors import CompileError, ConfigError
from spmd_ort.graph import ops
from spmd_ort.graph.flops import node_flops
from spmd_ort.graph.slots import SlotKind
from spmd_ort.runtime.collectives import data_group

from .context import PassResult
from .contracts import GRADS_TAGGED, NO_GRAD_TAGS
from .helpers import (GRADIENT_OF, PP_ACTION, PP_SCHEDULE, TAG, aten, call, fake_mode_of, nbytes, phase,
                      placeholders)
from .runner import graph_pass

# what a node of the traced graph is to the pipeline
FREE = "free"  # reads nothing of the step's inputs (constants): made on each stage that reads it
ANY = "any"  # reads the batch (and constants) alone: made on each stage that reads it, per micro-batch
PRE = "pre"  # reads parameters (and constants) alone: once per step, on its stage
MB = "mb"  # a micro-batch's forward or backward
TAGGED = "tag"  # a parameter's gradient (tag_grad)
POST = "post"  # after the gradients: clipping, the optimizer, the step's outputs
EVERY = -1  # stage of a value every rank computes alike (the whole model's gradient norm and what follows it)
NORM_OPS = (aten.linalg_vector_norm.default,)


@dataclass(frozen=True)
class PipelineStages(PassResult):
    """What :func:`split_pipeline_stages_pass` made of the step on this rank."""

    pp: int
    rank: int
    stages: tuple[str, ...]  # the first module of each stage ("" for the first)
    mine: tuple[int, ...]
    microbatches: int
    micro_batch: int  # rows of dim 0 in one micro-batch
    schedule: Schedule
    sends_per_step: int
    send_bytes_per_step: int
    stepped: tuple[str, ...]  # the parameters this rank steps (FQNs)
    rank_specific = True  # each rank's graph holds its own stages: the ranks agree on the transfers

    def lines(self) -> list[str]:
        starts = ", ".join(f"stage {k} from {s or 'the start'}" for k, s in enumerate(self.stages))
        return [f"pipeline parallel: {len(self.stages)} stages over {self.pp} ranks ({starts}); this rank (pp rank "
                f"{self.rank}) runs stage(s) {', '.join(map(str, self.mine))} and steps {len(self.stepped)} "
                f"parameters; {self.microbatches} micro-batches of {self.micro_batch}; schedule "
                f"{self.schedule.name}: bubble {self.schedule.bubble:.1%} of the step on unit costs; sends "
                f"{self.sends_per_step} tensors ({self.send_bytes_per_step / 2**20:.2f} MiB) per step",
                *(f"  {row}" for row in self.schedule.table())]


def _module(node: fx.Node) -> str | None:
    return node.meta.get("custom", {}).get("module")


def _in(fqn: str | None, root: str) -> bool:
    return fqn is not None and (fqn == root or fqn.startswith(root + "."))


class _Cut:
    """The traced graph read as stages (every node's kind and stage), before this rank's graph is written."""

    def __init__(self, gm: fx.GraphModule, ctx, mode: PipelineParallel):
        self.gm, self.graph, self.ctx, self.mode = gm, gm.graph, ctx, mode
        self.pp, self.n_stages = mode.pp, mode.stages
        self.micro = mode.pipeline.microbatches
        self.phs = placeholders(gm)
        self.slot = dict(zip(self.phs, ctx.input_slots))
        self.kind: dict[fx.Node, str] = {}
        self.stage: dict[fx.Node, int] = {}
        self.owner: dict[int, int] = {}  # parameter index -> the stage that steps it
        self._kinds()
        self.split = self._split()
        self._forward_stages()
        self._backward_stages()

    # ------------------------------------------------------------------ kinds
    def _kinds(self) -> None:
        for ph in self.phs:
            self.kind[ph] = "batch" if self.slot[ph].kind is SlotKind.BATCH else "state"
        for n in self.graph.nodes:
            if n.op == "get_attr":  # a constant the trace lifted
                self.kind[n] = FREE
            if n.op != "call_function":
                continue
            ins = [self.kind[a] for a in n.all_input_nodes]
            if n.target is TAG:
                if self.kind[n.args[0]] not in (MB, ANY):
                    raise CompileError(f"pipeline parallelism: the gradient of parameter {n.args[1]} (`{n.name}`) is "
                                       "read before the backward ends (several backward passes in one step, or "
                                       "gradients used inside it); a pipelined step runs one backward. Fix: one "
                                       "loss.backward() per step", op=str(n.target))
                self.kind[n] = TAGGED
            elif TAGGED in ins or POST in ins:
                self.kind[n] = POST
            elif MB in ins:
                self.kind[n] = MB
            elif "state" in ins or PRE in ins:
                self.kind[n] = MB if "batch" in ins or ANY in ins else PRE
            elif "batch" in ins or ANY in ins:
                self.kind[n] = ANY
            else:
                self.kind[n] = FREE
        # a forward value nothing of a micro-batch reads, made from the optimizer's state: part of the step's end
        for n in reversed(list(self.graph.nodes)):
            if self.kind.get(n) == PRE and n.users and all(self.kind.get(u) == POST for u in n.users) \
                    and not any(self.kind[a] == "state" and self.slot[a].kind is SlotKind.PARAM
                                for a in n.all_input_nodes):
                self.kind[n] = POST

    # ------------------------------------------------------------------ the split
    def _split(self) -> tuple[str, ...]:
        split = self.mode.pipeline.split
        modules = dict(self.ctx.layout.module.named_modules()) if self.ctx.layout is not None else {}
        if split is None:
            split = self._balanced(modules)
        if len(split) != self.n_stages - 1:
            raise ConfigError(f"Pipeline(split={list(split)!r}) begins {len(split) + 1} stages, but pp="
                              f"{self.pp} x stages_per_rank={self.mode.pipeline.stages_per_rank} is "
                              f"{self.n_stages}: give {self.n_stages - 1} module FQNs")
        for fqn in split:
            if modules and fqn not in modules:
                near = [m for m in modules if m and m.split(".")[-1] == fqn.split(".")[-1]][:3]
                raise ConfigError(f"Pipeline(split=[..., {fqn!r}, ...]) names no module of "
                                  f"{type(self.ctx.layout.module).__name__}" +
                                  (f" (modules named so: {', '.join(near)})" if near else ""), fqn=fqn)
        forward = [n for n in self.graph.nodes if self.kind.get(n) in (MB, PRE) and phase(n) == "forward"]
        firsts = []
        for k, fqn in enumerate(split):
            runs, inside = 0, False
            first = None
            for i, n in enumerate(forward):
                here = _in(_module(n), fqn)
                if here and not inside:
                    runs += 1
                    first = i if first is None else first
                inside = here
            if first is None:
                raise ConfigError(f"Pipeline(split=[..., {fqn!r}, ...]): module `{fqn}` computes nothing of the "
                                  "step's forward, so no stage can begin there. Fix: a module on the model's main "
                                  "path (a block of its layers)", fqn=fqn)
            if runs > 1:
                raise ConfigError(f"Pipeline(split=[..., {fqn!r}, ...]): module `{fqn}` runs {runs} times in one "
                                  "forward (a loop the trace unrolls, or a shared module), so a stage cannot begin "
                                  "at it. Fix: split at a module that runs once", fqn=fqn)
            firsts.append(first)
        if firsts != sorted(firsts) or len(set(firsts)) != len(firsts):
            raise ConfigError(f"Pipeline(split={list(split)!r}): stages must begin in the order the forward runs "
                              "their modules, each at a different one")
        self._firsts = firsts
        return tuple(split)

    def _balanced(self, modules: dict) -> tuple[str, ...]:
        """The model's longest run of sibling blocks (a ModuleList's children), cut where their FLOPs (and what
        runs before and after them) are most even."""
        lists = [(fqn, m) for fqn, m in modules.items() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
        lists = [(fqn, [f"{fqn}.{k}" if fqn else str(k) for k in range(len(m))]) for fqn, m in lists]
        lists = [(fqn, kids) for fqn, kids in lists if len(kids) >= self.n_stages]
        if not lists:
            raise ConfigError(f"Pipeline(split=None): {type(self.ctx.layout.module).__name__} has no list of "
                              f"{self.n_stages} or more blocks to balance {self.n_stages} stages over. Fix: give "
                              "split=[module FQNs where stages begin]")
        _, blocks = max(lists, key=lambda x: len(x[1]))
        cost = [0] * (len(blocks) + 2)  # before the blocks, each block, after them
        seen_block = False
        for n in self.graph.nodes:
            if n.op != "call_function" or self.kind.get(n) not in (MB, ANY) or phase(n) != "forward":
                continue  # (the forward's FLOPs: the backward's are about twice them, stage by stage)
            fqn = _module(n)
            k = next((i for i, b in enumerate(blocks) if _in(fqn, b)), None)
            flops = node_flops(n) + 1  # (+1: every op costs something)
            if k is not None:
                seen_block = True
                cost[k + 1] += flops
            else:
                cost[0 if not seen_block else -1] += flops
        total = sum(cost)
        cuts, acc = [], cost[0]
        for k in range(len(blocks)):
            # begin the next stage at block k where the stages so far hold their share
            want = total * (len(cuts) + 1) / self.n_stages
            if k > 0 and len(cuts) < self.n_stages - 1 and acc + cost[k + 1] / 2 > want \
                    and len(blocks) - k >= self.n_stages - 1 - len(cuts):
                cuts.append(blocks[k])
            acc += cost[k + 1]
        while len(cuts) < self.n_stages - 1:  # too few cut: the last blocks each begin one
            rest = [b for b in blocks if b not in cuts]
            cuts.append(rest[-(self.n_stages - 1 - len(cuts))])
            cuts.sort(key=blocks.index)
        return tuple(cuts)

    # ------------------------------------------------------------------ stages
    def _forward_stages(self) -> None:
        cur, k = 0, 0
        forward = [n for n in self.graph.nodes if self.kind.get(n) in (MB, PRE) and phase(n) == "forward"]
        for i, n in enumerate(forward):
            while k < len(self._firsts) and i >= self._firsts[k]:
                k += 1
                cur = k
            self.stage[n] = cur
        for ph in self.phs:  # a parameter is stepped by the first stage that reads it
            users = [self.stage[u] for u in ph.users if u in self.stage]
            if self.slot[ph].kind in (SlotKind.PARAM, SlotKind.BUFFER):
                self.stage[ph] = min(users) if users else 0
                if self.slot[ph].kind is SlotKind.PARAM:
                    self.owner[self.slot[ph].index] = self.stage[ph]
        for ph in self.phs:
            slot = self.slot[ph]
            if slot.kind is SlotKind.OPT_STATE or slot.kind is SlotKind.GRAD:
                self.stage[ph] = self.owner.get(slot.index, 0)

    def forward_input_stage(self, a: fx.Node) -> int | None:
        k = self.kind.get(a)
        if k in ("batch", FREE, ANY):
            return None
        return self.stage.get(a)

    def _backward_stages(self) -> None:
        for n in self.graph.nodes:
            if n.op != "call_function" or self.kind.get(n) not in (MB, PRE) or phase(n) != "backward":
                continue
            fwd = [self.forward_input_stage(a) for a in n.all_input_nodes
                   if a.op == "placeholder" or phase(a) == "forward" or self.kind.get(a) == PRE]
            fwd = [s for s in fwd if s is not None]
            bwd = [self.stage[a] for a in n.all_input_nodes
                   if a.op != "placeholder" and phase(a) == "backward" and self.kind.get(a) == MB]
            if fwd and self.kind[n] == PRE:
                self.stage[n] = max(fwd)
            elif fwd and any(phase(a) == "forward" and self.kind.get(a) == MB for a in n.all_input_nodes):
                self.stage[n] = max(s for a in n.all_input_nodes
                                    if phase(a) == "forward" and self.kind.get(a) == MB
                                    for s in [self.stage[a]])
            elif bwd:
                self.stage[n] = min(bwd)
            elif fwd:
                self.stage[n] = max(fwd)
            else:
                self.stage[n] = self.n_stages - 1
        for n in self.graph.nodes:  # a gradient flows to earlier stages, never back
            if self.kind.get(n) != MB or phase(n) != "backward":
                continue
            for a in n.all_input_nodes:
                if self.kind.get(a) == MB and phase(a) == "backward" and self.stage[a] < self.stage[n]:
                    raise CompileError(
                        f"pipeline parallelism: `{n.name}` ({n.target}) in the backward of stage {self.stage[n]} "
                        f"reads `{a.name}`, a gradient stage {self.stage[a]} makes: the split "
                        f"{list(self.split)!r} does not cut the model's main path. Fix: stages that begin at "
                        "blocks the forward runs one after another", op=str(n.target), fqn=_module(n))


NLL_FORWARD = aten.nll_loss_forward.default
PASS_THROUGH = (aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
                aten.view.default, aten.reshape.default, aten.squeeze.default)
SCALED = (aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar)


def _weighting(cut: _Cut) -> tuple[str, fx.Node | None]:
    """How the micro-batches' losses make the batch's: ``"mean"`` (a mean over examples or elements: each
    micro-batch 1/M), ``"sum"``, or ``"tokens"`` (a cross-entropy's mean over the targets it counts, ``-100``
    ignored: each micro-batch its counted targets over the batch's), read off the op the backward starts from;
    anything else is refused, naming it."""
    seeds = [n for n in cut.graph.nodes if n.op == "call_function" and phase(n) == "backward"
             and n.target in (aten.ones_like.default, aten.full_like.default)
             and n.args and cut.kind.get(n.args[0]) == MB and phase(n.args[0]) == "forward"]
    if len(seeds) != 1:
        return "mean", None
    n = seeds[0].args[0]
    while True:
        if n.target is operator.getitem and n.args[0].target is NLL_FORWARD and n.args[1] == 0:
            nll = n.args[0]
            reduction = nll.args[3]
            if reduction == 2:
                return "sum", None
            if nll.args[2] is not None:
                raise CompileError("pipeline parallelism: the loss is a cross-entropy with class weights, whose "
                                   "mean over micro-batches is not the batch's. Fix: reduction='sum' divided by "
                                   "the batch's weight, computed outside the step", op=str(nll.target))
            if cut.kind.get(nll.args[1]) not in (ANY, "batch"):
                raise CompileError("pipeline parallelism: the cross-entropy's targets are computed from the "
                                   "model's activations; the batch's counted targets must come from the batch",
                                   op=str(nll.target))
            return "tokens", nll
        if n.target in (aten.sum.default, aten.sum.dim_IntList):
            return "sum", None
        if n.target in (aten.mean.default, aten.mean.dim):
            return "mean", None
        if n.target in PASS_THROUGH or (n.target in SCALED and not (
                isinstance(n.args[1], fx.Node) and cut.kind.get(n.args[1]) == MB)):
            n = n.args[0]
            continue
        raise CompileError(
            f"pipeline parallelism: the loss is made by `{n.name}` ({n.target}), and the batch's loss must be "
            "built from the micro-batches': a mean (torch.mean, F.cross_entropy / nll_loss with "
            "reduction='mean', its ignored targets counted as eager counts them) or a sum (reduction='sum', "
            ".sum(), or a sum divided by a number). Fix: return such a loss", op=str(n.target))


class _Writer:
    """This rank's graph: its stages' nodes for every micro-batch in the schedule's order, the transfers, its
    optimizer."""

    def __init__(self, cut: _Cut, rank: int, schedule: Schedule, global_rank: int):
        self.cut, self.rank, self.schedule = cut, rank, schedule
        self.global_rank = global_rank
        self.mode = cut.mode
        self.mine = set(self.mode.stages_of(rank))
        self.g = fx.Graph()
        self.step_env: dict[fx.Node, fx.Node] = {}  # step-level values (placeholders, constants, PRE, POST)
        self.ph_new: dict[fx.Node, fx.Node] = {}  # the traced graph's placeholders -> this graph's
        self.mb_env: list[dict[fx.Node, fx.Node]] = [{} for _ in range(cut.micro)]
        self.token: fx.Node | None = None  # the rank's last transfer (each reads it: their order is fixed)
        self.sends, self.send_bytes = 0, 0
        self.fake = fake_mode_of(cut.gm)
        self.acc: dict[tuple[int, int], fx.Node] = {}  # (param index, stage) -> its gradient summed so far
        self.tags = {n.args[1]: n for n in cut.graph.nodes if n.op == "call_function" and n.target is TAG}
        self._parts()
        self._consumers()
        self.weighting, self.nll = _weighting(cut)
        self.weights: dict[int, fx.Node] = {}  # micro-batch -> its share of the step's loss ("tokens")
        self.opt_nodes: dict = {}  # the traced optimizer node -> (this rank's, its outputs' new positions), or None
        self.completed: set[fx.Node] = set()  # the whole model's gradient norm (completed across the ranks)

    # ------------------------------------------------------------------ what reads what
    def _parts(self) -> None:
        """Each parameter's gradient as its parts by stage (a tied weight's sum of two stages' parts)."""
        cut = self.cut
        self.parts: dict[int, list[fx.Node]] = {}
        self.part_of: dict[fx.Node, list[int]] = {}
        self.skipped: set[fx.Node] = set()
        for index, tag in self.tags.items():
            leaves, todo = [], [tag.args[0]]
            while todo:
                n = todo.pop()
                if (n.op == "call_function" and n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs
                        and all(isinstance(a, fx.Node) for a in n.args) and len(n.users) == 1
                        and cut.kind.get(n) == MB and len({cut.stage.get(a) for a in n.args}) > 1
                        and all(a.meta["val"].shape == n.meta["val"].shape for a in n.args)):
                    self.skipped.add(n)
                    todo += list(n.args)
                else:
                    leaves.append(n)
            self.parts[index] = leaves
            for leaf in leaves:
                self.part_of.setdefault(leaf, []).append(index)

    def stage_of(self, n: fx.Node) -> int | None:
        """The stage computing ``n`` (None: made wherever it is read)."""
        if self.cut.kind.get(n) in (FREE, ANY, "batch"):
            return None
        return self.cut.stage.get(n)

    def _consumers(self) -> None:
        """For every value, the stages (other than its own) that read it; users that are made wherever they are
        read pass their readers on."""
        cut = self.cut
        readers: dict[fx.Node, set[int]] = {}
        nodes = list(cut.graph.nodes)
        for n in reversed(nodes):
            if n.op == "output":
                for a in n.all_input_nodes:  # the step's outputs: user outputs on every rank
                    readers.setdefault(a, set())
                continue
            if n in self.skipped or cut.kind.get(n) == TAGGED:
                continue
            s = self.stage_of(n)
            here = readers.get(n, set()) if s is None else {s}
            for a in n.all_input_nodes:
                readers.setdefault(a, set()).update(here)
        self.readers = readers

    # ------------------------------------------------------------------ transfers
    def _chain(self) -> fx.Node:
        if self.token is None:
            self.token = call(self.g, aten.empty.memory_format, ([0],), self.fake_empty(),
                               {"device": self.device})
        return self.token

    def fake_empty(self):
        with self.fake:
            return torch.empty(0, device=self.device)

    def send(self, value: fx.Node, to_stage: int, tag: int) -> None:
        peer = self.mode.peer(to_stage, self.global_rank)
        self.token = call(self.g, ops.p2p_send, (value, self._chain(), peer, tag), self.fake_empty())
        self.sends += 1
        self.send_bytes += nbytes(value)

    def recv(self, like: fx.Node, from_stage: int, tag: int) -> fx.Node:
        v = like.meta["val"]
        posted = call(self.g, ops.p2p_recv, (self._chain(), list(v.shape), v.dtype,
                                              self.mode.peer(from_stage, self.global_rank), tag), self._fake_like(v))
        self.token = posted
        return call(self.g, ops.p2p_wait_recv, (posted,), self._fake_like(v))

    def _fake_like(self, v):
        with self.fake:
            return torch.empty(tuple(v.shape), dtype=v.dtype, device=v.device)

    # ------------------------------------------------------------------ the walk
    def write(self) -> fx.Graph:
        cut = self.cut
        self.device = next((ph.meta["val"].device for ph in cut.phs if isinstance(ph.meta.get("val"), torch.Tensor)),
                           torch.device("cpu"))
        self._tags: dict = {}  # (value, micro or None) -> tag, the same on every rank (assigned in graph order)
        self._assign_tags()
        for ph in cut.phs:
            new = self.g.placeholder(ph.name)
            new.meta = dict(ph.meta)
            if cut.slot[ph].kind is SlotKind.BATCH and self._batched(ph):
                v = ph.meta["val"]
                new.meta["val"] = self._fake_full(v)
            self.step_env[ph] = new
            self.ph_new[ph] = new
        self._step_level()
        for action in self.schedule.actions[self.rank]:
            before = list(self.g.nodes)[-1]
            self._action(action)
            node = before.next
            while node.op != "root":  # what the action added (the graph only grows at its end)
                node.meta[PP_ACTION] = (action.kind, action.stage, action.micro)
                node = node.next
        # every rank here, its micro-batches done (every transfer of theirs matched): the index checks of the stages
        # agree, before any update; a link of the transfers' chain, so no later receive is posted before it (a
        # rank that raises here leaves nothing of ours in flight)
        self.token = call(self.g, ops.agree_checks, (self._chain(),), self.fake_empty())
        self._gradients()
        outputs = self._post()
        if self.token is not None:
            done = call(self.g, ops.p2p_wait, (self.token,), self.fake_empty())
            p = self.mode.pipeline
            done.meta[PP_SCHEDULE] = {"schedule": p.schedule, "pp": self.mode.pp, "microbatches": p.microbatches,
                                      "stages_per_rank": p.stages_per_rank, "flops": self.stage_flops()}
        self.g.output(outputs)
        for node in list(self.g.nodes):  # each receive posted right after the transfer before it
            if node.op == "call_function" and node.target is ops.p2p_recv:
                node.args[0].append(node)
        return self.g

    def _batched(self, ph: fx.Node) -> bool:
        """Whether a batch input was cut into micro-batches (its dim 0 is the batch's)."""
        return self.cut.slot[ph].index in self.cut.ctx.micro_batched

    def _fake_full(self, v):
        with self.fake:
            return torch.empty((v.shape[0] * self.cut.micro, *v.shape[1:]), dtype=v.dtype, device=v.device)

    def _assign_tags(self) -> None:
        """A tag per transfer, the same on every rank: every cross-stage value in graph order, per micro-batch."""
        k = 0
        for n in self.cut.graph.nodes:
            s = self.stage_of(n)
            if s is None:
                continue
            others = self.readers.get(n, set()) - {s}
            if not others:
                continue
            per_micro = self.cut.kind.get(n) == MB
            for m in (range(self.cut.micro) if per_micro else [None]):
                for t in sorted(others):
                    k += 1
                    self._tags[(n, m, t)] = k
        for index, leaves in self.parts.items():  # a gradient's part another stage steps: once, summed
            for s in sorted({self.stage_of(leaf) for leaf in leaves}):
                k += 1
                self._tags[("grad", index, s)] = k
        k += 1
        self._tags[("loss",)] = k

    # values ------------------------------------------------------------
    def lookup(self, a: fx.Node, m: int | None) -> fx.Node:
        cut = self.cut
        kind = cut.kind.get(a)
        if kind == "batch":
            ph = self.step_env[a]
            if m is None or not self._batched(a):
                return ph
            key = ("slice", a)
            if key not in self.mb_env[m]:
                rows = cut.rows
                self.mb_env[m][key] = call(self.g, aten.slice.Tensor, (ph, 0, m * rows, (m + 1) * rows),
                                            a.meta["val"])
            return self.mb_env[m][key]
        if kind == FREE:
            if a not in self.step_env:
                self.step_env[a] = self._copy(a, None)
            return self.step_env[a]
        if kind == ANY:
            if a not in self.mb_env[m]:
                self.mb_env[m][a] = self._copy(a, m)
            return self.mb_env[m][a]
        if kind == MB:
            if a not in self.mb_env[m]:
                s = self.stage_of(a)
                assert s not in self.mine, f"{a.name} of stage {s} read before it was made"
                reader = self._reading_stage
                self.mb_env[m][a] = self.recv(a, s, self._tags[(a, m, reader)])
            return self.mb_env[m][a]
        # state placeholders, PRE and POST values
        if a not in self.step_env:
            s = self.stage_of(a)
            if s in self.mine or s == EVERY:
                raise AssertionError(f"{a.name} read before it was made")
            self.step_env[a] = self.recv(a, s, self._tags[(a, None, self._reading_stage)])
        return self.step_env[a]

    def _copy(self, n: fx.Node, m: int | None) -> fx.Node:
        return self.g.node_copy(n, lambda a: self.lookup(a, m))

    def _emit(self, n: fx.Node, m: int | None, stage: int) -> fx.Node:
        self._reading_stage = stage
        new = self._copy(n, m)
        (self.mb_env[m] if m is not None else self.step_env)[n] = new
        for t in sorted(self.readers.get(n, set()) - {stage}):
            key = (n, m, t)
            if key in self._tags and self.cut.kind.get(n) in (MB, PRE, POST, "state"):
                self.send(new, t, self._tags[key])
        for index in self.part_of.get(n, []):
            self._accumulate(index, stage, new, m)
        return new

    def _accumulate(self, index: int, stage: int, value: fx.Node, m: int) -> None:
        key = (index, stage)
        prev = self.acc.get(key)
        if self.weighting == "tokens":  # this micro-batch's share of the batch's counted tokens
            value = call(self.g, aten.mul.Tensor, (value, self.weight(m)), value.meta["val"])
        self.acc[key] = value if prev is None else call(self.g, aten.add.Tensor, (prev, value), value.meta["val"])

    # step-level values (parameters another stage reads, PRE) -----------------------------------------
    def _step_level(self) -> None:
        """Parameters another stage reads (sent by the stage that steps them) and what the parameters alone make,
        once per step, in graph order on every rank."""
        cut = self.cut
        for n in cut.graph.nodes:
            if n.op != "placeholder" and cut.kind.get(n) != PRE:
                continue
            s = self.stage_of(n)
            if s is None:
                continue
            if s in self.mine:
                if n.op == "placeholder":
                    self._reading_stage = s
                    for t in sorted(self.readers.get(n, set()) - {s}):
                        self.send(self.step_env[n], t, self._tags[(n, None, t)])
                else:
                    self._emit(n, None, s)
                continue
            wanted = sorted(self.readers.get(n, set()) & self.mine)
            if wanted:  # received once, it serves every stage of this rank
                self._reading_stage = wanted[0]
                self.step_env[n] = self.recv(n, s, self._tags[(n, None, wanted[0])])

    # actions -------------------------------------------------------------------------------------------
    def _action(self, action) -> None:
        cut = self.cut
        s, m = action.stage, action.micro
        for n in cut.graph.nodes:
            if n.op != "call_function" or cut.kind.get(n) != MB or n in self.skipped or self.stage_of(n) != s:
                continue
            fwd = phase(n) == "forward"
            if action.kind == "F" and not fwd:
                continue
            if action.kind in ("B", "W") and fwd:
                continue
            if self.schedule.split_w and action.kind in ("B", "W"):
                if (n in self.b_part[s]) != (action.kind == "B"):
                    continue
            self._emit(n, m, s)

    def stage_flops(self) -> dict:
        """FLOPs of one micro-batch's F, B and W on each stage (a plan prices the other ranks' stages by them)."""
        cut = self.cut
        out: dict = {}
        for n in cut.graph.nodes:
            if cut.kind.get(n) != MB or n in self.skipped:
                continue
            s = self.stage_of(n)
            kind = "F" if phase(n) == "forward" else (
                "B" if not self.schedule.split_w or n in self.b_part[s] else "W")
            out[(kind, s)] = out.get((kind, s), 0) + node_flops(n)
        return out

    def split_backward(self) -> None:
        """Zero bubble: each stage's backward nodes that the gradients it sends to earlier stages need (B)."""
        cut = self.cut
        self.b_part: dict[int, set[fx.Node]] = {s: set() for s in range(cut.n_stages)}
        nodes = [n for n in cut.graph.nodes if cut.kind.get(n) == MB and phase(n) == "backward"
                 and n not in self.skipped]
        for n in reversed(nodes):
            s = self.stage_of(n)
            sends_down = any(t < s for t in self.readers.get(n, set()))
            if sends_down or any(u in self.b_part[s] for u in n.users):
                self.b_part[s].add(n)

    # the micro-batches' losses, combined as the batch's ----------------------------------------------------
    def weight(self, m: int) -> fx.Node:
        """Micro-batch ``m``'s share of the batch's loss where it is a mean over counted tokens (targets other
        than ``ignore_index``): its count over the batch's, computed from the batch on every rank."""
        if m not in self.weights:
            nll = self.nll
            ignore = nll.args[4] if len(nll.args) > 4 else -100
            with self.fake:
                scalar = torch.empty((), dtype=nll.meta["val"][0].dtype)
            counts = []
            for k in range(self.cut.micro):
                target = self.lookup(nll.args[1], k)
                with self.fake:
                    mask = torch.empty(target.meta["val"].shape, dtype=torch.bool)
                    count = torch.empty((), dtype=torch.int64)
                kept = call(self.g, aten.ne.Scalar, (target, ignore), mask)
                n = call(self.g, aten.sum.default, (kept,), count)
                counts.append(call(self.g, aten._to_copy.default, (n,), scalar, {"dtype": scalar.dtype}))
            total = counts[0]
            for c in counts[1:]:
                total = call(self.g, aten.add.Tensor, (total, c), scalar)
            for k, c in enumerate(counts):
                self.weights[k] = call(self.g, aten.div.Tensor, (c, total), scalar)
        return self.weights[m]

    def _combine(self, values: list[fx.Node], like: fx.Node) -> fx.Node:
        """The batch's loss from the micro-batches': their mean (a mean over examples), sum, or sum weighted by
        their counted tokens."""
        if self.weighting == "tokens":
            values = [call(self.g, aten.mul.Tensor, (v, self.weight(m)), like.meta["val"])
                      for m, v in enumerate(values)]
        total = values[0]
        for v in values[1:]:
            total = call(self.g, aten.add.Tensor, (total, v), like.meta["val"])
        if self.weighting == "mean" and len(values) > 1:
            total = call(self.g, aten.div.Tensor, (total, len(values)), like.meta["val"])
        return total

    # the step's end --------------------------------------------------------------------------------------
    def _gradients(self) -> None:
        """Each parameter this rank steps: its parts summed over the micro-batches (and received from the
        stages that made them), divided by their number."""
        cut = self.cut
        self.grads: dict[int, fx.Node] = {}
        # the parts other stages step: sent once
        for (index, s), total in sorted(self.acc.items(), key=lambda kv: self._tags[("grad", kv[0][0], kv[0][1])]):
            owner = cut.owner.get(index, 0)
            if owner != s:
                self._reading_stage = s
                self.send(total, owner, self._tags[("grad", index, s)])
        for index in sorted(self.parts):
            owner = cut.owner.get(index, 0)
            if owner not in self.mine:
                continue
            pieces = []
            for s in sorted({self.stage_of(leaf) for leaf in self.parts[index]}):
                if s in self.mine:
                    pieces.append(self.acc[(index, s)])
                else:
                    self._reading_stage = owner
                    pieces.append(self.recv(self.tags[index].args[0], s, self._tags[("grad", index, s)]))
            total = pieces[0]
            for p in pieces[1:]:
                total = call(self.g, aten.add.Tensor, (total, p), p.meta["val"])
            if cut.micro > 1 and self.weighting == "mean":
                total = call(self.g, aten.div.Tensor, (total, cut.micro), total.meta["val"])
            self.grads[index] = total
        if self.mode.dp > 1:  # the pipelines' gradients averaged (DDP's arithmetic), every reduction started first
            group, started = self.mode.dp_group_name(), {}
            for index, g in self.grads.items():
                copy = call(self.g, aten.clone.default, (g,), g.meta["val"],
                             {"memory_format": torch.contiguous_format})
                started[index] = call(self.g, ops.all_reduce_, (copy, 1.0 / self.mode.dp, group), g.meta["val"])
                started[index].meta[GRADIENT_OF] = index
            for index, reduced in started.items():
                self.grads[index] = call(self.g, ops.wait_, (reduced,), reduced.meta["val"])

    def _post(self) -> list:
        cut = self.cut
        out = next(n for n in cut.graph.nodes if n.op == "output")
        flat = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
        # user outputs: a micro-batch's scalar is averaged over the micro-batches, on every rank
        last = cut.n_stages - 1
        user = {}
        for slot, a in zip(cut.ctx.output_slots, flat):
            if slot.kind is not SlotKind.USER or not isinstance(a, fx.Node):
                continue
            kind = cut.kind.get(a)
            if kind not in (MB, ANY):
                continue
            v = a.meta["val"]
            if not isinstance(v, torch.Tensor) or v.dim() != 0 or not v.dtype.is_floating_point:
                raise CompileError(f"pipeline parallelism: the step returns `{slot.name}`, a value of each "
                                   f"micro-batch of shape {tuple(v.shape)}; a pipelined step returns the mean of "
                                   "scalars over the micro-batches (the loss). Fix: return the loss alone, and "
                                   "compute other outputs in a forward of its own")
            s = self.stage_of(a) if kind == MB else last
            if s in self.mine:
                mean = self._combine([self.lookup(a, m) for m in range(cut.micro)], a)
                for t in range(self.mode.pp):  # (pipeline rank t runs stage t)
                    if t != self.rank:
                        self.send(mean, t, self._tags[("loss",)] + 1 + len(user))
            else:
                mean = self.recv(a, s, self._tags[("loss",)] + 1 + len(user))
            user[a] = mean
        self.user = user
        # clipping and the optimizer, this rank's part
        env = self.step_env
        for index, g in self.grads.items():
            env[self.tags[index]] = g
        post = [n for n in cut.graph.nodes if n.op == "call_function" and cut.kind.get(n) == POST]
        stage: dict[fx.Node, int | None] = {}
        for n in post:
            ins = []
            for a in n.all_input_nodes:
                if cut.kind.get(a) == TAGGED:
                    ins.append(cut.owner.get(a.args[1], 0))
                elif a in stage:
                    ins.append(stage[a])
                else:
                    ins.append(self.stage_of(a))
            staged = {s for s in ins if s is not None and s != EVERY}
            if n.target in ops.INPLACE_TWINS or n.target in ops.OPTIMIZER_OPS:
                stage[n] = self._optimizer(n)
                continue
            if n.target is operator.getitem and n.args[0] in self.opt_nodes:
                stage[n] = self._optimizer_item(n)
                continue
            if n.target is aten.stack.default and len(staged) > 1:
                stage[n] = EVERY
                self._norms(n, post)
                continue
            if n in self.completed:
                stage[n] = EVERY
                continue
            if len(staged) > 1:
                raise CompileError(
                    f"pipeline parallelism: `{n.name}` ({n.target}) after the backward reads values of stages "
                    f"{sorted(staged)}; across stages a step may read only the gradient norm (clipping) and the "
                    "optimizer's updates. Fix: compute it per parameter, or without pp", op=str(n.target))
            s = staged.pop() if staged else (EVERY if EVERY in ins else None)
            stage[n] = s
            if s is None or s == EVERY or s in self.mine:
                self._reading_stage = s
                env[n] = self.g.node_copy(n, lambda a: self.lookup(a, None))
        # the outputs: this rank's state, the others' passed through, the user outputs on every rank
        by_slot = {slot: ph for ph, slot in cut.slot.items()}
        values = []
        for slot, a in zip(cut.ctx.output_slots, flat):
            if not isinstance(a, fx.Node):
                values.append(a)
            elif a in user:
                values.append(user[a])
            elif a.op == "placeholder":
                values.append(self.ph_new[a])
            elif a in env:
                values.append(env[a])
            elif slot.kind is SlotKind.USER:
                s = stage.get(a, self.stage_of(a))
                raise CompileError(f"pipeline parallelism: the step returns `{slot.name}`, which stage {s} "
                                   "computes after the backward; a pipelined step returns the loss. Fix: return "
                                   "the loss alone")
            elif slot in by_slot:  # state another rank steps: passed through as it came
                values.append(self.ph_new[by_slot[slot]])
            else:
                raise CompileError(f"pipeline parallelism: the step makes `{slot.name}` ({slot.kind.value}) new, "
                                   "and another stage holds it. Fix: state made before the first step (the "
                                   "optimizer's state is made by a first step eagerly, or by the compiled step's "
                                   "prefill)")
        return values

    # the gradient norm across stages ---------------------------------------------------------------------
    def _norms(self, stack: fx.Node, post: list[fx.Node]) -> None:
        """``vector_norm(stack([norm(g) for g in grads]))`` across stages: this rank's norms' squares summed,
        all-reduced over the pipeline's ranks, square-rooted: every rank gets the whole model's norm."""
        users = list(stack.users)
        if len(users) != 1 or users[0].target not in NORM_OPS or (users[0].args[1:2] or [2])[0] not in (2, 2.0):
            raise CompileError(f"pipeline parallelism: `{stack.name}` stacks values of several stages, and only "
                               "the 2-norm of the gradients' norms (clip_grad_norm_) is computed across stages",
                               op=str(stack.target))
        total = users[0]
        mine = []
        for a in stack.args[0]:
            s = self._post_stage(a)
            if s in self.mine:
                mine.append(self.step_env[a])
        v = total.meta["val"]
        with self.fake:
            scalar = torch.empty((), dtype=v.dtype, device=v.device)
        if mine:
            squares = [call(self.g, aten.mul.Tensor, (x, x), scalar) for x in mine]
            part = squares[0]
            for sq in squares[1:]:
                part = call(self.g, aten.add.Tensor, (part, sq), scalar)
            part = call(self.g, aten.clone.default, (part,), scalar)
        else:
            part = call(self.g, aten.zeros.default, ([],), scalar, {"dtype": v.dtype, "device": v.device})
        reduced = call(self.g, ops.all_reduce_, (part, 1.0, self.mode.group_name()), scalar)
        done = call(self.g, ops.wait_, (reduced,), scalar)
        self.step_env[total] = call(self.g, aten.sqrt.default, (done,), scalar)
        self.completed = {total}

    def _post_stage(self, a: fx.Node) -> int | None:
        cut = self.cut
        if cut.kind.get(a) == TAGGED:
            return cut.owner.get(a.args[1], 0)
        todo = [a]
        while todo:  # the stage of a norm: its gradient's
            n = todo.pop()
            if cut.kind.get(n) == TAGGED:
                return cut.owner.get(n.args[1], 0)
            if n.op == "placeholder":
                return self.stage_of(n)
            todo += n.all_input_nodes
        return None

    # the optimizer, this rank's parameters --------------------------------------------------------------
    def _optimizer(self, n: fx.Node) -> int | None:
        schema = n.target._schema
        names = [a.name for a in schema.arguments]
        args = dict(zip(names, n.args))
        args.update(n.kwargs)
        if args.get("present") is not None:
            raise CompileError("pipeline parallelism: parameters whose gradients only opaque parts make are not "
                               "pipelined in this release. Fix: make those parts traceable", op=str(n.target))
        params = args["params"]
        keep = [j for j, p in enumerate(params) if self._post_stage(p) in self.mine]
        lists = [k for k, a in enumerate(schema.arguments) if str(a.type).startswith("List[Tensor]")]
        n_params = len(params)
        if not keep:
            self.opt_nodes[n] = None
            return None
        new_args = list(n.args)
        for k in lists:
            if k < len(new_args) and isinstance(new_args[k], (list, tuple)) and len(new_args[k]) == n_params:
                new_args[k] = [new_args[k][j] for j in keep]
        self._reading_stage = None
        new = self.g.create_node("call_function", n.target,
                                 fx.node.map_arg(tuple(new_args), lambda a: self.lookup(a, None)),
                                 fx.node.map_arg(dict(n.kwargs), lambda a: self.lookup(a, None)))
        vals = n.meta["val"]
        # the functional op returns its output lists one after another, each n_params long (an empty list: none)
        groups = len(vals) // n_params if n_params else 0
        new.meta = dict(n.meta)
        new.meta["val"] = [vals[g * n_params + j] for g in range(groups) for j in keep]
        index = {}
        for g in range(groups):
            for jj, j in enumerate(keep):
                index[g * n_params + j] = (g * len(keep) + jj, self._post_stage(params[j]))
        self.opt_nodes[n] = (new, index)
        self.step_env[n] = new
        return min(self.mine)

    def _optimizer_item(self, n: fx.Node) -> int | None:
        entry = self.opt_nodes.get(n.args[0])
        if entry is None:
            return None
        new, index = entry
        k = n.args[1]
        if k not in index:
            return None
        position, stage = index[k]
        item = call(self.g, operator.getitem, (new, position), n.meta["val"])
        item.meta = dict(n.meta)
        self.step_env[n] = item
        return stage


@graph_pass(requires=[GRADS_TAGGED], provides=[NO_GRAD_TAGS], invalidates=[GRADS_TAGGED])
def split_pipeline_stages_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The traced micro-batch step as this rank's stages of every micro-batch, in the schedule's order, with
    the transfers between stages, the gradients summed over micro-batches and this rank's optimizer."""
    mode = ctx.mode
    cut = _Cut(gm, ctx, mode)
    rows = {ph.meta["val"].shape[0] for ph in cut.phs if cut.slot[ph].kind is SlotKind.BATCH
            and isinstance(ph.meta.get("val"), torch.Tensor) and ph.meta["val"].dim() >= 1}
    if any(not isinstance(r, int) for r in rows):
        raise CompileError("pipeline parallelism compiles static batch shapes; the step was traced with a symbolic "
                           "batch dim. Fix: compile(dynamic=False)")
    cut.rows = ctx.micro_rows
    for slot, a in zip(ctx.output_slots, _flat_outputs(gm)):
        if slot.kind is SlotKind.BUFFER and isinstance(a, fx.Node) and a.op != "placeholder":
            raise CompileError(f"pipeline parallelism: the step updates buffer `{slot.name}` (a BatchNorm's running "
                               "statistics): per micro-batch they would not be the batch's. Fix: a model without "
                               "buffers updated in training (LayerNorm, RMSNorm), or without pp")
    rank = mode.pp_rank(ctx.rank)
    if mode.dp > 1:  # our groups of the (pp, dp) mesh made now, every rank together (made at their first
        # collective, a rank waiting in a receive could not join the others making one)
        data_group(mode.group_name())
        data_group(mode.dp_group_name())
    schedule = simulate(mode.pipeline.schedule, mode.pp, mode.pipeline.microbatches, mode.pipeline.stages_per_rank)
    writer = _Writer(cut, rank, schedule, ctx.rank)
    writer.split_backward()
    graph = writer.write()
    new = fx.GraphModule(gm, graph)
    ctx.results.record(PipelineStages(
        pp=mode.pp, rank=rank, stages=("",) + cut.split, mine=tuple(sorted(writer.mine)),
        microbatches=cut.micro, micro_batch=cut.rows, schedule=schedule, sends_per_step=writer.sends,
        send_bytes_per_step=writer.send_bytes,
        stepped=tuple(slot.name for slot in ctx.input_slots
                      if slot.kind is SlotKind.PARAM and cut.owner.get(slot.index) in writer.mine)))
    return new


def _flat_outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]


__all__ = ["PipelineStages", "split_pipeline_stages_pass"]
