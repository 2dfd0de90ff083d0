"""Run under torchrun: compiled data parallel vs torch DDP, step by step, on every rank.

    torchrun --standalone --nproc_per_node=2 tests/dist/dp_parity.py --model mlp --opt sgd --backend fx --out DIR
    torchrun --standalone --nproc_per_node=2 tests/dist/dp_parity.py --out DIR --case="--model gpt --opt adamw" --case=...

Each rank builds its model from a different seed (both DDP and the compiled step
must broadcast rank 0's weights), trains a DDP copy and a compiled copy on its own
shard of the same global batches, checks loss, parameters and optimizer state
after every step and that the compiled parameters are identical on all ranks,
and writes DIR/rank<r>.json.  Any mismatch raises (non-zero exit).  ``--case`` (repeated): each case's options
one after the other in one launch, each with its own models and step; DIR/rank<r>.json maps each to its result.

``--budget B`` compiles with ``activation_memory_budget=B`` and trains a second compiled copy at 1.0
beside it: on fx the two agree bit for bit (recomputation replays eager's kernels on the same
inputs), on ORT to the tolerances of every comparison here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import UserTraffic, finish  # noqa: E402
import spmd_ort  # noqa: E402
from spmd_ort.passes.data_parallel import GradientBuckets  # noqa: E402
from spmd_ort.passes.recompute import Recomputation  # noqa: E402
from helpers import accumulation_step, assert_same_state, ort_report, train_step  # noqa: E402
from models import CNN, GPT, MLP, GPTConfig  # noqa: E402


def make(model: str, seed: int):
    torch.manual_seed(seed)
    if model == "mlp":
        return MLP(), lambda g, n: (torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    if model == "cnn":
        return CNN(), lambda g, n: (torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))
    # gpt-wide: an 8192-class head over 64-token rows (8 a rank: 512 rows), which fuse_linear_cross_entropy_pass fuses
    # gpt-96: issue 55's GPT (d 96, 4 heads, untied head over 512 tokens of 64)
    cfg = {"gpt-wide": GPTConfig(vocab=8192, seq=64),
           "gpt-96": GPTConfig(vocab=512, seq=64, d=96, heads=4, tie_head=False)}.get(model, GPTConfig())
    return GPT(cfg), lambda g, n: (torch.randint(0, cfg.vocab, (n, cfg.seq), generator=g),
                                   torch.randint(0, cfg.vocab, (n, cfg.seq), generator=g))


def make_opt(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--opt", default="sgd")
    ap.add_argument("--backend", default="fx")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--bucket-mb", type=lambda v: v if v == "auto" else float(v), default=25.0)
    ap.add_argument("--mismatch", action="store_true", help="rank 1 uses another batch size")
    ap.add_argument("--dynamic", choices=["auto", "1", "0"], default="auto", help="compile(dynamic=...)")
    ap.add_argument("--stats", help="write activation statistics of the DDP and the compiled model here")
    ap.add_argument("--profile", help="profile the compiled step's last two steps into this path")
    ap.add_argument("--input-grads", action="store_true",
                    help="the batch requires grad: its .grad accumulates, per rank (never all-reduced), as in DDP")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="gradient accumulation in the step: one backward per micro-batch, then one optimizer step; "
                         "DDP runs no_sync on all but the last (one all-reduce per step is asserted)")
    ap.add_argument("--read-between", action="store_true",
                    help="with --micro-batches: the step reads a gradient between micro-batches (DDP then syncs "
                         "every micro-batch, and the reads must equal DDP's reduced values)")
    ap.add_argument("--skew-timing", action="store_true",
                    help="each rank times its segments as if the other executor were 100x slower (rank 0: fx, rank "
                         "1: ORT): the ranks would choose differently, and must not")
    ap.add_argument("--mixed-executors", action="store_true",
                    help="every rank runs segments of at most 3 ops on fx and the rest on ORT, the choice timings make "
                         "where fx wins the small segments: fx segments then read ORT's (contiguous) outputs")
    ap.add_argument("--user-collectives", action="store_true",
                    help="the user's own collectives on the default group: a thread all-reducing while each step "
                         "runs (a logging or checkpointing thread), a barrier and the loss's all-reduce between steps")
    ap.add_argument("--break-compiled-on-rank1", action="store_true",
                    help="inductor: the first compiled segment fails its checked run on rank 1 only; every rank "
                         "must run it on fx (replicas compute alike)")
    ap.add_argument("--candidate-free", action="store_true",
                    help="the inductor candidate's compile is predicted free: it is compiled, checked and timed "
                         "once 3 steady steps are measured (step 5), not when the steady steps have spent its "
                         "predicted minutes; the compile and the timing are real")
    ap.add_argument("--budget", type=float, help="compile(activation_memory_budget=...); below 1.0 a copy "
                    "compiled at 1.0 trains beside it and must agree (fx: bit for bit)")
    ap.add_argument("--case", action="append", default=[],
                    help="several cases in one launch, one after the other: each --case=\"--model gpt --opt adamw\" "
                         "this script's options (none that patches the library for the process)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cases = [ap.parse_args([*shlex.split(case), "--out", args.out]) for case in args.case]
    patching = ("candidate_free", "skew_timing", "break_compiled_on_rank1", "mixed_executors")
    if any(getattr(c, flag) for c in cases for flag in patching):
        ap.error(f"--case: {', '.join(patching)} patch the library for the whole process: launch them alone")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cases:
        result = {case: run(c, rank, world) for case, c in zip(args.case, cases, strict=True)}
    else:
        result = run(args, rank, world)
    finish(args.out, result)


def run(args, rank: int, world: int) -> dict:
    result: dict = {"rank": rank, "world": world}
    if args.candidate_free:
        from spmd_ort import tuner

        tuner.CompileCost.predict = classmethod(lambda cls, nodes: (0.0, "predicted free by the test"))
    if args.skew_timing:  # fx's time comes from timed_fx_runs, ORT's from fastest: skew the one each rank slows
        from spmd_ort.backends.ort import choice

        skewed = result["skewed"] = []
        if rank == 0:
            timed = choice.timed_fx_runs

            def slow_fx(run, a, repeat):
                seconds, out = timed(run, a, repeat)
                skewed.append("fx")
                return seconds * 100, out

            choice.timed_fx_runs = slow_fx
        else:
            fastest = choice.fastest

            def slow_ort(run, a, first):
                skewed.append("ort")
                return fastest(run, a, first) * 100

            choice.fastest = slow_ort
    if args.break_compiled_on_rank1 and rank == 1:
        from spmd_ort.backends.inductor import InductorSegment

        run_compiled = InductorSegment.run_compiled

        def broken(self, *a):
            if self.name == "fused_0":
                raise RuntimeError("broken on rank 1 by the test")
            return run_compiled(self, *a)

        InductorSegment.run_compiled = broken
    if args.mixed_executors:
        from spmd_ort.backends.ort import choice

        def small_on_fx(self, seg, times, known=None):
            ops = sum(1 for n in seg.fallback.graph.nodes if n.op == "call_function")
            times = {"fx": 0.0, "ort": 1.0} if ops <= 3 else {"fx": 1.0, "ort": 0.0}
            result.setdefault("forced", {})[seg.name] = "fx" if ops <= 3 else "ort"
            choose(self, seg, times, known)

        choose, choice.FirstRun._choose = choice.FirstRun._choose, small_on_fx
        from spmd_ort.backends.ort import executor as executor_module
        from spmd_ort.backends.ort.stats import WholeChoice

        def as_chosen(runners, inputs, stats, field="whole", keep=None):  # the steps run the mix (never revisited)
            setattr(stats, field, WholeChoice("segments", tuple((k, 0.0 if k == "segments" else 1e9) for k in runners)))
            return "segments"

        executor_module.choose_whole = as_chosen
    try:
        base, batch_fn = make(args.model, seed=rank)  # a different init on every rank
        ddp_model = DDP(copy.deepcopy(base))  # broadcasts rank 0's weights
        model = copy.deepcopy(base)
        opt_ref, opt = make_opt(args.opt, ddp_model.parameters()), make_opt(args.opt, model.parameters())
        mode = spmd_ort.DataParallel(bucket_cap_mb=args.bucket_mb)
        dynamic = {"auto": None, "1": True, "0": False}[args.dynamic]
        accumulate = args.micro_batches > 1
        step_fn = accumulation_step if accumulate else train_step

        def compiled(budget):
            return spmd_ort.compile(parallel_mode=mode, backend=args.backend, dynamic=dynamic,
                                    activation_memory_budget=budget)(step_fn)

        step = compiled(args.budget)
        full = None  # (model, optimizer, step) compiled at budget 1.0, beside one below it
        if args.budget is not None and args.budget < 1.0:
            full_model = copy.deepcopy(base)
            full = (full_model, make_opt(args.opt, full_model.parameters()), compiled(1.0))
        if args.stats:  # every rank writes its own directory: <stats>/<run>/rank<r>
            from spmd_ort.debug import GlobalSubscriberManager, StatisticsSubscriber

            for run_name, m in (("ddp", ddp_model.module), ("compiled", model)):
                GlobalSubscriberManager.subscribe(m, [StatisticsSubscriber(Path(args.stats) / run_name,
                                                                           override_output_dir=True)])
        g = torch.Generator().manual_seed(1234)
        losses, comm = [], []
        for i in range(args.steps):
            x, y = batch_fn(g, args.batch * world)  # the global batch; each rank takes its shard
            n = args.batch
            if args.mismatch and rank == 1:
                n = args.batch // 2
            x, y = x[rank * args.batch: rank * args.batch + n], y[rank * args.batch: rank * args.batch + n]
            if args.profile and i == args.steps - 2:
                step.profile(steps=2, path=args.profile)
            x_ref = x
            if args.input_grads:  # one input tensor per side, reused: its .grad accumulates over the steps
                if i == 0:
                    x_in, x_ref_in = x.clone().requires_grad_(), x.clone().requires_grad_()
                with torch.no_grad():
                    x_in.copy_(x)
                    x_ref_in.copy_(x)
                x, x_ref = x_in, x_ref_in
            t0 = time.perf_counter()
            traffic = UserTraffic(rank, world) if args.user_collectives else contextlib.nullcontext()
            with traffic:
                if accumulate:
                    xs, ys = x.chunk(args.micro_batches), y.chunk(args.micro_batches)
                    xs_ref = x_ref.chunk(args.micro_batches)
                    loss, reads = step(model, opt, xs, ys, read_between=args.read_between)
                else:
                    loss = step(model, opt, x, y)
            if args.user_collectives:  # between steps, as users do before timing, logging or a checkpoint
                dist.barrier()
                logged = loss.detach().clone()
                dist.all_reduce(logged)
                result.setdefault("logged_losses", []).append(float(logged) / world)
                result["user_all_reduces"] = result.get("user_all_reduces", 0) + traffic.calls
            result.setdefault("step_s", []).append(time.perf_counter() - t0)
            if accumulate:
                no_sync = None if args.read_between else ddp_model.no_sync
                ref, reads_ref = accumulation_step(ddp_model, opt_ref, xs_ref, ys, read_between=args.read_between,
                                                   no_sync=no_sync)
                for got, want in zip(reads, reads_ref, strict=True):  # reduced partial sums, as DDP syncs them
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            else:
                ref = train_step(ddp_model, opt_ref, x_ref, y)
            if args.input_grads:
                torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-7)
                result.setdefault("input_grad_sums", []).append(float(x.grad.double().sum()))
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
            # fx runs DDP's own kernels (elementwise), but for a fused head's (torch's chunked operator: per tensor)
            try:
                assert_same_state(ddp_model.module, model, opt_ref, opt, where=f"rank {rank} step {i}",
                                  normwise=args.backend != "fx" or args.model == "gpt-wide")
            except AssertionError as exc:  # what the step ran: its tuner's choices and its program
                prog = step.compiled
                off = [f"{n}: {float((a - b).norm()):.3g}" for (n, a), b in
                       zip(ddp_model.module.named_parameters(), model.parameters()) if not torch.allclose(a, b)]
                raise AssertionError(f"{exc}\nparameters off: {', '.join(off)}\nchoices:\n" + "\n".join(step.tuner.lines(prog))
                                     + "\n" + (prog.describe() if prog is not None else "")) from None
            if full is not None:
                full_loss = full[2](full[0], full[1], x, y)
                if args.backend == "fx":
                    assert torch.equal(loss, full_loss), (rank, i, float(loss), float(full_loss))
                    for (name, p), q in zip(model.named_parameters(), full[0].parameters(), strict=True):
                        assert torch.equal(p, q), f"rank {rank} step {i}: {name} differs from budget 1.0's"
                else:
                    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-6)
                    assert_same_state(full[0], model, full[1], opt, where=f"rank {rank} step {i} (budget 1.0)",
                                      normwise=True)
            losses.append(float(loss))
            c = step.comm
            comm.append({"all_reduce_calls": c.all_reduce_calls, "all_reduce_bytes": c.all_reduce_bytes,
                         "broadcast_calls": c.broadcast_calls, "overlap": c.overlap})
        if args.stats:
            GlobalSubscriberManager.flush()
        # the compiled parameters are identical on every rank
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(gathered[0], t) for t in gathered), "parameters differ between ranks"
        prog = step.compiled
        result.update(
            losses=losses, comm=comm, traces=step.transitions.traces, ort=ort_report(step),
            grad_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            params=sum(1 for _ in model.parameters()),
            first_param_bytes=next(model.parameters()).numel() * next(model.parameters()).element_size(),
            buckets=len(prog.results.get(GradientBuckets).nbytes),
            bucket_bytes=list(prog.results.get(GradientBuckets).nbytes),
            describe=prog.describe(), decisions=step.tuner.lines(prog),
            recompiles=list(step.tuner.recompiles.values()), variants=len(step.variants),
            recomputed_copies=recomputed.copies if (recomputed := prog.results.get(Recomputation)) else 0,
            bucket_choice=step.buckets.choice.lines() if step.buckets.choice is not None else None)
    except spmd_ort.CompileError as exc:
        result["compile_error"] = str(exc)
    return result


if __name__ == "__main__":
    main()
