"""Run under torchrun: compiled tensor parallelism vs eager DTensor tensor parallelism, step by step.

    torchrun --standalone --nproc_per_node=2 tests/dist/tp_parity.py --backend fx --apply mode --out DIR
    torchrun --standalone --nproc_per_node=4 tests/dist/tp_parity.py --out DIR --case="--dp 2 --mp" --case=...

A small transformer LM (embedding, pre-norm blocks of attention and MLP, LM head) is parallelized Megatron-style
with torch's own plan (``ColwiseParallel`` for q/k/v and the MLP's first linear, ``RowwiseParallel`` for the
projections back) and trained eagerly (``parallelize_module``) and compiled, on the same batch on every rank.
``--apply mode`` compiles with ``parallel_mode=spmd_ort.TensorParallel(plan)`` (the plan applied at the first call);
``--apply user`` parallelizes the module first and compiles with ``parallel_mode=None`` (expand mode).
Loss, parameters, gradients and optimizer state (local shards) are checked after every step; a one-process eager
run on the same batch bounds the distance.  Writes DIR/rank<r>.json (collectives per step, bytes, placements).
``--mp`` (2-D only): a bf16 ``MixedPrecisionPolicy`` on the dp dim, against FSDP2 + TP with the same policy (FSDP2's
``fully_shard`` of every block and the root on the dp dim), each dp replica on its share of the batch.
``--loss-parallel`` (sequence plan): the head's logits stay sharded over the vocabulary and the cross-entropy runs
under torch's ``loss_parallel()`` (torchtitan's default), eagerly and compiled.
``--case`` (repeated): each case's options one after the other in one launch, each with its own meshes, models and
step; DIR/rank<r>.json maps each case's string to its result.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fnmatch
import shlex
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import UserTraffic, finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import _close, ort_report  # noqa: E402
from spmd_ort.passes import expand  # noqa: E402

VOCAB, DIM, HEADS, SEQ, LAYERS = 64, 32, 4, 16, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them (torchtitan's convention)
        q, k, v = (lin(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


PLAN = {"blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.fc": ColwiseParallel(), "blocks.*.out": RowwiseParallel()}
# sequence parallel (torchtitan's plan): the residual stream is split along the sequence; norms run on the shards
SP_PLAN = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "blocks.*.ln1": SequenceParallel(), "blocks.*.ln2": SequenceParallel(),
           "blocks.*.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
           "blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
           "blocks.*.attn.v": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
           "blocks.*.fc": ColwiseParallel(input_layouts=Shard(1)),
           "blocks.*.out": RowwiseParallel(output_layouts=Shard(1)),
           "ln": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
ROWWISE = sum(1 for s in PLAN.values() if isinstance(s, RowwiseParallel)) * LAYERS
COLWISE = sum(1 for s in PLAN.values() if isinstance(s, ColwiseParallel)) * LAYERS
# the activations the column-wise layers read (ln1's output: q, k and v; ln2's: fc): eager DTensor all-reduces
# each layer's input gradient, the compiled step their sum (merge_summed_all_reduces_pass)
COLWISE_INPUTS = 2 * LAYERS


# --loss-parallel: the head's output stays a DTensor sharded over the vocabulary, and the loss and its backward run
# under loss_parallel() (on the one-process model's plain logits it changes nothing)
LP_HEAD = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
LOSS_PARALLEL = False
DEFAULT_SPLIT_MIN_K = expand.SPLIT_MIN_K


def step_fn(model, opt, ids, labels, clip=torch.nn.utils.clip_grad_norm_):
    logits = model(ids)
    with loss_parallel() if LOSS_PARALLEL else contextlib.nullcontext():
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
    # over DTensor and plain gradients: eager raises unless under implicit_replication (as eager_step runs it);
    # the compiled step completes the norm across both by itself
    clip(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss


@torch.no_grad()
def clip_across_meshes(params, max_norm):
    """clip_grad_norm_ for FSDP2 + TP, whose gradients live on two meshes (dp, and dp x tp), which torch's own
    refuses to stack: each gradient's norm made whole first (as torchtitan does), then torch's formula."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


# the key bias's gradient is analytically zero (softmax is shift-invariant): rounding noise, which Adam turns
# into +-lr steps in any two implementations; checked to be noise instead of compared
NOISE = "blocks.*.attn.k.bias"


# A compiled value may be this many times further from eager TP's than one-process eager's is (fuzz_cases' factor)
EAGER_NOISE_FACTOR = 10


def _single_local(value, like):
    """The piece of one-process eager's full ``value`` that eager TP's ``like`` holds on this rank (no collective)."""
    if not isinstance(like, DTensor):
        return value
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _close_or_within_eager_noise(actual, expected, single, kind, normwise, msg):
    """``actual`` (compiled) against ``expected`` (eager TP); where they differ beyond the tolerance, the difference
    may still be no larger than eager TP's own from one-process eager (``single``, the same piece): an
    ill-conditioned value (a key weight's gradient over near-uniform attention) that two float32 implementations
    round apart, as eager TP's reduction order does."""
    try:
        _close(actual, expected, kind, normwise, msg)
    except AssertionError as exc:
        if single is None:
            raise
        ours = (actual.double() - expected.double()).norm().item()
        eager = (single.double() - expected.double()).norm().item()
        if not ours <= EAGER_NOISE_FACTOR * eager:
            raise AssertionError(f"{exc}; one-process eager is {eager:.3g} from eager TP") from None


def compare(eager, compiled, eager_opt, compiled_opt, where, normwise, single=None, single_opt=None):
    names = [n for n, _ in eager.named_parameters()]
    singles = dict(single.named_parameters()) if single is not None else {}
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        assert type(a) is type(b) and getattr(a, "placements", None) == getattr(b, "placements", None), name
        if not fnmatch.fnmatch(name, NOISE):
            s = _single_local(singles[name].detach(), a) if name in singles else None
            _close_or_within_eager_noise(local(b), local(a), s, "param", normwise, f"{where} param {name}")
    sa, sb = eager_opt.state_dict()["state"], compiled_opt.state_dict()["state"]
    ss = single_opt.state_dict()["state"] if single_opt is not None else {}
    assert sa.keys() == sb.keys(), where
    for k in sa:
        for key, va in sa[k].items():
            vb = local(sb[k][key])
            if fnmatch.fnmatch(names[k], NOISE) and key == "exp_avg":
                assert max(local(va).abs().max().item(), vb.abs().max().item()) < 1e-8, (where, names[k])
            elif not fnmatch.fnmatch(names[k], NOISE):
                s = _single_local(ss[k][key], va) if k in ss and va.dim() else None
                _close_or_within_eager_noise(vb, local(va), s, "state", normwise,
                                             f"{where} opt state {names[k]}.{key}")


def compare_full(eager, compiled, eager_opt, compiled_opt, where):
    """FSDP2 + TP (2-D DTensors) against the compiled 2-D step (tp DTensors, replicated over dp): full values."""
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    names = [n for n, _ in eager.named_parameters()]
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        if not fnmatch.fnmatch(name, NOISE):
            _close(full(b).detach(), full(a).detach(), "param", True, f"{where} param {name}")
    sa, sb = eager_opt.state_dict()["state"], compiled_opt.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(sa[k].keys() == sb[k].keys() for k in sa), (where, sa.keys(), sb.keys())
    for k in sa:
        for key, va in sa[k].items():
            if not fnmatch.fnmatch(names[k], NOISE):
                _close(full(sb[k][key]), full(va), "state", True, f"{where} opt state {names[k]}.{key}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--apply", choices=("mode", "user"), default="mode")
    ap.add_argument("--plan", choices=("megatron", "sequence"), default="megatron")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1, help="2-D: data-parallel replicas (mesh dp x tp), replicate")
    ap.add_argument("--vary-batch", action="store_true", help="batch sizes 4, 3, 2, ...: dynamic shapes")
    ap.add_argument("--vary-seq", action="store_true", help="sequence lengths 16, 12, 10, 16, 12, 10: dynamic shapes")
    ap.add_argument("--checkpoint", default=None, help="save the DTensor state with DCP here and load it back")
    ap.add_argument("--mp", action="store_true", help="2-D: bf16 MixedPrecisionPolicy, against FSDP2 + TP")
    ap.add_argument("--fully-shard", action="store_true", help="2-D: fully_shard on the dp dim, against FSDP2 + TP")
    ap.add_argument("--deepspeed", type=int, default=None, metavar="STAGE",
                    help="2-D: a DeepSpeed config of this ZeRO stage with the plan (from_deepspeed_config), against "
                         "FSDP2 + TP")
    ap.add_argument("--loss-parallel", action="store_true", help="sequence plan: vocabulary-sharded logits and "
                    "loss_parallel(), eagerly and compiled")
    ap.add_argument("--split-min-k", type=int, default=None,
                    help="split_replicated_matmuls_pass's threshold (the test model's head is below the default)")
    ap.add_argument("--user-collectives", action="store_true",
                    help="a thread of the user's all-reducing on the default group while each compiled step runs (from the second)")
    ap.add_argument("--case", action="append", default=[],
                    help="several cases in one launch, one after the other: each --case=\"--plan sequence --dp 2\" "
                         "this script's options")
    ap.add_argument("--out", required=True)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    args = ap.parse_args(argv)
    if (args.mp or args.fully_shard or args.deepspeed is not None) and args.dp < 2:
        ap.error("--mp / --fully-shard compare against FSDP2 + TP: give --dp 2")
    if args.loss_parallel and args.plan != "sequence":
        ap.error("--loss-parallel goes with --plan sequence (its head is column-wise)")
    return args


def main() -> None:
    ap = parser()
    args = parse(ap)
    cases = [parse(ap, [*shlex.split(case), "--out", args.out]) for case in args.case]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cases:
        finish(args.out, {case: run(c, rank, world) for case, c in zip(args.case, cases, strict=True)})
    else:
        finish(args.out, run(args, rank, world))


def run(args, rank: int, world: int) -> dict:
    """One case: the compiled step against eager tensor parallelism (asserted at every step); the result to write."""
    global LOSS_PARALLEL
    expand.SPLIT_MIN_K = DEFAULT_SPLIT_MIN_K if args.split_min_k is None else args.split_min_k
    fsdp = args.mp or args.fully_shard or args.deepspeed is not None  # eager is FSDP2 + TP
    sharded = args.fully_shard or (args.deepspeed or 0) > 0  # the compiled side: fully_shard on dp
    mesh2d = init_device_mesh("cpu", (args.dp, world // args.dp), mesh_dim_names=("dp", "tp")) if args.dp > 1 else None
    mesh = mesh2d["tp"] if mesh2d is not None else init_device_mesh("cpu", (world,))
    dp_rank = mesh2d["dp"].get_local_rank() if mesh2d is not None else 0
    torch.manual_seed(0)
    base = LM()
    single = copy.deepcopy(base)
    plan = PLAN if args.plan == "megatron" else SP_PLAN
    LOSS_PARALLEL = args.loss_parallel
    if args.loss_parallel:
        plan = {**SP_PLAN, "head": LP_HEAD}
    eager = parallelize_module(copy.deepcopy(base), mesh, plan)
    dp_mode = spmd_ort.DataParallel(parallel_style="fully_shard" if args.fully_shard else "replicate")
    if fsdp:  # FSDP2 + TP (with the policy), as torchtitan builds it
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.mp else None)
        for blk in eager.blocks:
            fully_shard(blk, mesh=mesh2d["dp"], mp_policy=policy)
        fully_shard(eager, mesh=mesh2d["dp"], mp_policy=policy)
        if args.mp:
            dp_mode = dataclasses.replace(dp_mode, mixed_precision=spmd_ort.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16))
    compiled = copy.deepcopy(base)
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)  # noqa: E731
    opt_s, opt_e = make_opt(single), make_opt(eager)
    if args.apply == "user":
        compiled = parallelize_module(compiled, mesh, plan)
        mode = None
    else:
        mode = spmd_ort.TensorParallel(plan) if mesh2d is None else spmd_ort.TensorParallel(
            plan, mesh=mesh2d, data_parallel=dp_mode)
    opt_c = make_opt(compiled)  # built on the plain parameters under --apply mode: the plan moves it to DTensors
    step = spmd_ort.compile(backend=args.backend, parallel_mode=mode)(step_fn)
    run = step
    if args.deepspeed is not None:  # the DeepSpeed engine's step from a config, its ZeRO stage on the dp dim
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
                  "zero_optimization": {"stage": args.deepspeed, "reduce_bucket_size": 2**20}}
        ds = spmd_ort.from_deepspeed_config(config, compiled, tensor_parallel_plan=plan, mesh=mesh2d)
        assert ds.train_batch_size == 4 * args.dp and isinstance(ds.parallel_mode, spmd_ort.TensorParallel)
        assert ds.parallel_mode.data_parallel.sharded == (args.deepspeed > 0)
        opt_c = ds.optimizer

        def loss_fn(model, ids, labels):
            return F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))

        step = spmd_ort.compile(backend=args.backend, parallel_mode=ds.parallel_mode)(ds.make_train_step(loss_fn))

        def run(model, opt, ids, labels):
            return step(model, opt, None, [(ids, labels)])
    if args.apply == "mode" and args.deepspeed is None:
        # a first call whose compile fails (numpy labels) leaves the module and optimizer as they were
        params = list(compiled.parameters())
        ids = torch.randint(0, VOCAB, (4, SEQ))
        try:
            step(compiled, opt_c, ids, ids.numpy())
            raise AssertionError("numpy labels compiled")
        except spmd_ort.CompileError as exc:
            assert "labels" in str(exc), exc
        assert all(type(p) is nn.Parameter and p is q for p, q in zip(compiled.parameters(), params, strict=True))
        assert opt_c.param_groups[0]["params"] == params and not opt_c.state
        assert not compiled.blocks[0].fc._forward_pre_hooks, "the plan's hooks were left behind"
        for a, b in zip(compiled.parameters(), base.parameters()):
            assert torch.equal(a, b)
        # a plan key that names no submodule: an error naming it, on every rank
        bad = spmd_ort.compile(backend=args.backend, parallel_mode=spmd_ort.TensorParallel(
            {"blocks.*.mlp.fc": ColwiseParallel()}))(step_fn)
        try:
            bad(compiled, opt_c, ids, ids)
            raise AssertionError("a plan naming no submodule compiled")
        except spmd_ort.CompileError as exc:
            assert "blocks.*.mlp.fc" in str(exc) and "blocks.0.fc" in str(exc), exc
        # an opaque part under a tensor-parallel plan: an error naming it and the fix, the module unchanged
        opaque = spmd_ort.compile(backend=args.backend, parallel_mode=mode,
                                  module_override=[spmd_ort.OpaqueOverride("blocks.0.fc")])(step_fn)
        try:
            opaque(compiled, opt_c, ids, ids)
            raise AssertionError("an opaque part with DTensor parameters compiled")
        except spmd_ort.CompileError as exc:
            assert "`blocks.0.fc` runs opaquely" in str(exc) and "do not take DTensors" in str(exc), exc
        assert all(type(p) is nn.Parameter and p is q for p, q in zip(compiled.parameters(), params, strict=True))
    # 2-D: eager and one process train on the global batch; the compiled step on its dp replica's share, its
    # gradients averaged over dp: the same sums in another order
    normwise = args.backend != "fx" or args.dp > 1
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(args.steps):
        b = (4, 3, 2)[i % 3] if args.vary_batch else 4
        # (sequence parallel: even lengths; eager DTensor's all-gather of uneven sequence shards fails over gloo)
        # (the static program serves 16 at step 1 only; the symbolic one checks its first 3 sets of sizes, 12, 10
        # and 16, whose outputs are fx's: steps 5 and 6 train on the executor's own)
        t = (16, 12, 10, 16, 12, 10)[i % 6] if args.vary_seq else SEQ
        ids = torch.randint(0, VOCAB, (b * args.dp, t), generator=g)
        labels = torch.randint(0, VOCAB, (b * args.dp, t), generator=g)
        mine = slice(b * dp_rank, b * (dp_rank + 1))  # this dp replica's share of the global batch
        ls = step_fn(single, opt_s, ids, labels)
        with CommDebugMode() as eager_comm, implicit_replication():  # eager DTensor's collectives in one step
            # (FSDP2 + TP: each dp replica on its share)
            le = step_fn(eager, opt_e, ids[mine], labels[mine], clip_across_meshes) if fsdp else step_fn(
                eager, opt_e, ids, labels)
        # (from the second step: the first lays the model out with torch's parallelize_module, on the mesh's groups)
        traffic = args.user_collectives and i > 0
        with UserTraffic(rank, world) if traffic else contextlib.nullcontext():
            lc = run(compiled, opt_c, ids[mine], labels[mine])
        # what eager returns: a plain loss, or under loss_parallel a replicated DTensor (compared whole)
        assert isinstance(lc, DTensor) == isinstance(le, DTensor) == args.loss_parallel, (type(lc), type(le))
        if args.loss_parallel:
            assert lc.placements == le.placements, (lc.placements, le.placements)
            lc, le = lc.full_tensor(), le.full_tensor()
        if fsdp:  # each dp replica's loss against FSDP2 + TP's on the same share (bf16: the same policy, casts)
            tol = dict(rtol=1e-3, atol=1e-3) if args.mp else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lc.detach(), le.detach(), **tol)
            compare_full(eager, compiled, opt_e, opt_c, f"rank {rank} step {i}")
            losses.append(float(lc))
            continue
        if mesh2d is not None:  # the mean over the dp replicas' losses: the global batch's
            lc = lc.detach().clone()
            dist.all_reduce(lc, group=mesh2d["dp"].get_group())
            lc /= args.dp
        torch.testing.assert_close(lc.detach(), le.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lc.detach(), ls.detach(), rtol=1e-4, atol=1e-5)
        compare(eager, compiled, opt_e, opt_c, f"rank {rank} step {i}", normwise, single, opt_s)
        losses.append(float(lc))
    placements = {n: [str(p) for p in getattr(t, "placements", ())] for n, t in compiled.state_dict().items()}
    local_bytes = sum(local(p).numel() * local(p).element_size() for p in compiled.parameters())
    if sharded:  # FSDP2 + TP's state dict: 2-D DTensors of the global shapes, each rank its piece
        for (name, a), (_, b) in zip(eager.state_dict().items(), compiled.state_dict().items(), strict=True):
            assert isinstance(b, DTensor) and b.shape == a.shape and b.placements == a.placements, \
                (name, b.shape, a.shape, getattr(b, "placements", None), a.placements)
        # full_state_dict gathers both dims; load_state_dict takes those full plain tensors back (each rank its
        # piece of its tensor-parallel piece), changing nothing
        whole = spmd_ort.full_state_dict(compiled, rank0_only=False)["model"]
        before = {n: local(t).clone() for n, t in compiled.state_dict().items()}
        for name, t in eager.state_dict().items():
            if not fnmatch.fnmatch(name, NOISE):
                _close(whole[name], t.full_tensor(), "param", True, f"full_state_dict {name}")
        compiled.load_state_dict(whole)
        for name, t in compiled.state_dict().items():
            assert isinstance(t, DTensor) and torch.equal(local(t), before[name]), f"load_state_dict {name}"
        spmd_ort.load_state_dict(step, {"model": whole}, compiled)  # spmd_ort's own, full tensors too
        for name, t in compiled.state_dict().items():
            assert torch.equal(local(t), before[name]), f"spmd_ort.load_state_dict {name}"
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    sharded_full = sum(p.numel() * p.element_size() for n, p in compiled.named_parameters()
                       if isinstance(p, DTensor) and p.placements[-1].is_shard()
                       and p.device_mesh.ndim == (2 if sharded else 1))  # (2-D fully_shard: 2-D ones)
    eager_local_bytes = sum(local(p).numel() * local(p).element_size() for p in eager.parameters())
    # eval outside the compiled step: the module's own forward on DTensor parameters, as eager TP runs it
    # (--mp: FSDP2's forward runs in bf16, the module's own in fp32: not compared)
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        if not args.mp:
            torch.testing.assert_close(compiled(ids), eager(ids), rtol=1e-4, atol=1e-5)
    comm = step.comm
    if args.checkpoint:  # torch's DCP on the DTensor state dict, into a freshly parallelized model
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": compiled.state_dict()}, checkpoint_id=args.checkpoint)
        fresh = parallelize_module(copy.deepcopy(base), mesh, plan)
        if fsdp:  # into FSDP2 + TP
            from torch.distributed.fsdp import fully_shard

            for blk in fresh.blocks:
                fully_shard(blk, mesh=mesh2d["dp"])
            fully_shard(fresh, mesh=mesh2d["dp"])
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=args.checkpoint)
        fresh.load_state_dict(state["model"])
        for (name, a), (_, b) in zip(compiled.named_parameters(), fresh.named_parameters(), strict=True):
            assert type(a) is type(b) and torch.equal(local(a), local(b)), name
        # spmd_ort's own checkpoint: resuming from it continues bit for bit
        spmd_ort.save_checkpoint(f"{args.checkpoint}_spmd", step, compiled, opt_c)
        ids, labels = (torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(2))
        want = step(compiled, opt_c, ids, labels)
        resumed = copy.deepcopy(base)
        opt_r = make_opt(resumed)
        step_r = spmd_ort.compile(backend=args.backend, parallel_mode=mode)(step_fn)
        spmd_ort.load_checkpoint(f"{args.checkpoint}_spmd", step_r, resumed, opt_r)
        assert torch.equal(step_r(resumed, opt_r, ids, labels), want)
        # and into the model that saved it (sharded already, a step further): back to the saved state
        spmd_ort.load_checkpoint(f"{args.checkpoint}_spmd", step, compiled, opt_c)
        assert torch.equal(step(compiled, opt_c, ids, labels), want)
        for (name, a), (_, b) in zip(compiled.named_parameters(), resumed.named_parameters(), strict=True):
            assert type(a) is type(b) and torch.equal(local(a), local(b)), f"resumed {name}"
    return {
        "traces": step.transitions.traces,
        "losses": losses, "placements": placements, "local_param_bytes": local_bytes,
        "full_param_bytes": full_bytes, "eager_local_param_bytes": eager_local_bytes, "sharded_param_bytes": sharded_full, "world": world, "tp": world // args.dp,
        "dp": args.dp,
        "eager_collectives": {str(k): v for k, v in eager_comm.get_comm_counts().items()},
        "all_reduce_calls": comm.all_reduce_calls, "all_reduce_bytes": comm.all_reduce_bytes, "all_gather_calls": comm.all_gather_calls,
        "reduce_scatter_calls": comm.reduce_scatter_calls,
        "bytes": comm.all_reduce_bytes + comm.all_gather_bytes + comm.reduce_scatter_bytes, "rowwise": ROWWISE, "colwise": COLWISE, "colwise_inputs": COLWISE_INPUTS,
        "optimizer_params_are_dtensors": sum(isinstance(p, DTensor) for gr in opt_c.param_groups for p in gr["params"]),
        "describe": step.explain() if rank == 0 else "",
        "split_matmuls": _split_matmuls(step.compiled),
        "recomputed_all_gathers": _recomputed_all_gathers(step.compiled),
        "ort": ort_report(step),
    }


def _recomputed_all_gathers(program) -> int:
    """All-gathers the backward runs again (activation checkpointing under sequence parallelism)."""
    from spmd_ort.graph import ops
    from spmd_ort.passes.recompute import RECOMPUTED

    return sum(1 for n in program.gm.graph.nodes if n.target is ops.all_gather and RECOMPUTED in n.meta)


def _split_matmuls(program) -> int:
    """How many replicated matmuls the last call's program splits over the tensor-parallel group."""
    from spmd_ort.passes.expand import SplitMatmuls

    result = program.results.get(SplitMatmuls)
    return 0 if result is None else result.count


if __name__ == "__main__":
    main()
