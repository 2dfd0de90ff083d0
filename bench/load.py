"""Loading a 5 GB-class safetensors checkpoint on 2 ranks (gloo, CPU): load_safetensors against plain reads.

Run:  .venv/bin/python bench/load.py [--layers 24] [--width 2048] [--reps 5] [--modes fully_shard,tensor_parallel]

Writes random fp32 weights of a GPT (examples/gpt.py, ``split_qkv=True``, tied head; default 24 layers, d=2048,
vocab 32000, seq 1024: 1.27 G parameters, 5.1 GB) in Hugging Face's sharded layout (``model-0000k-of-0000n
.safetensors`` of at most ``--shard-gib`` each and ``model.safetensors.index.json``), one tensor at a time from
the shapes of a meta-built model (the writer never holds the model, only one file's tensors), into a temporary
directory under /tmp that is deleted at the end.  Then, per mode, one ``torchrun`` of 2 ranks builds the model on
meta, ``spmd_ort.parallelize``s it (``fully_shard``: ``DataParallel(parallel_style="fully_shard")``, each rank
half of every tensor's rows; ``tensor_parallel``: ``TensorParallel(tensor_parallel_plan())``, Megatron's shards
of the blocks and the embeddings replicated), ``to_empty``, and times on each rank, alternately:

* ``baseline``: the same byte ranges of the same files that ``load_safetensors`` reads for this rank, read with
  ``os.preadv`` straight into the rank's own parameter memory (no checks, no staging: the floor);
* ``load``: ``spmd_ort.load_safetensors(model, directory)``.

Both in two cache states: ``cold`` (the checkpoint's pages dropped from the page cache before each timed read,
``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file after ``fsync``, so each rank reads from the disk) and
``warm`` (every page cached: the read is a copy out of the page cache).  Each repetition times cold then warm,
baseline then load (odd repetitions: load then baseline); the table gives the median over ``--reps`` per rank,
and the ratio load / baseline per rank, the max over ranks (the target: at most 1.5x).  Both write into memory
that earlier reads have touched: the first load into a model fresh from ``to_empty`` also pays for the kernel's
first touch of its pages, as any first read into new memory does.  At the end each rank zeroes its tensors,
loads, and checks that they hold exactly the bytes the baseline reads.  ``bytes read / share``: ``LoadReport.bytes_read``
over the bytes of this rank's part of the model (1.00: it reads its part and nothing more); ``share / file``: that
part over the checkpoint's tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("fully_shard", "tensor_parallel")
GB = 1e9


def config(args):
    from examples.gpt import GPTConfig

    return GPTConfig(vocab=args.vocab, seq=args.seq, d=args.width, heads=16, layers=args.layers, split_qkv=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--shard-gib", type=float, default=1.0, help="largest file of the checkpoint (GiB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--caches", default="cold,warm")
    ap.add_argument("--dir", default=None, help="write the checkpoint here (kept) instead of a temporary directory")
    ap.add_argument("--profile", default=None, help="write rank 0's cProfile of its last warm load here (.prof)")
    ap.add_argument("--json", default=None, help="write every timing (each rank, each repetition) here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="spmd_ort_load_") as tmp:
        ckpt = Path(args.dir) if args.dir else Path(tmp) / "ckpt"
        t0 = time.perf_counter()
        if not (ckpt / "model.safetensors.index.json").exists():
            total, files = write_checkpoint(config(args), ckpt, int(args.shard_gib * 2**30))
        else:
            index = json.loads((ckpt / "model.safetensors.index.json").read_text())
            total, files = index["metadata"]["total_size"], len(set(index["weight_map"].values()))
        print(f"checkpoint: {total / GB:.2f} GB in {files} files ({time.perf_counter() - t0:.0f}s)",
              file=sys.stderr, flush=True)
        for name in args.modes.split(","):
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "--worker", name, "--ckpt", str(ckpt), "--out", str(out), "--reps", str(args.reps),
                   "--caches", args.caches, "--layers", str(args.layers), "--width", str(args.width),
                   "--vocab", str(args.vocab), "--seq", str(args.seq)] + \
                (["--profile", args.profile] if args.profile else [])
            env = {**os.environ, "OMP_NUM_THREADS": "1", "SPMD_ORT_LOG_LEVEL": "WARNING"}
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not out.exists():
                results[name] = {"error": " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[-300:]}
            else:
                results[name] = json.loads(out.read_text())
            print(f"{name}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, args, total, files)


def write_checkpoint(cfg, directory: Path, limit: int) -> tuple[int, int]:
    """Random weights with the state dict's names and shapes (a tied weight once, under its first name), in
    files of at most ``limit`` bytes, as save_pretrained lays them out; returns (tensor bytes, files)."""
    import torch
    from safetensors.torch import save_file

    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    seen, entries = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            entries.append((name, tuple(t.shape), t.dtype))
    del model
    buckets, size = [[]], 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * dtype.itemsize
        if buckets[-1] and size + n > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((name, shape, dtype))
        size += n
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k, bucket in enumerate(buckets, 1):
        fname = f"model-{k:05d}-of-{len(buckets):05d}.safetensors"
        tensors = {name: torch.randn(shape, generator=g, dtype=dtype) * 0.02 for name, shape, dtype in bucket}
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
        fd = os.open(directory / fname, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total, len(buckets)


def report(results: dict, args, total: int, files: int) -> None:
    print(f"\nGPT {args.layers} layers, d={args.width}, vocab {args.vocab}: fp32 safetensors checkpoint of "
          f"{total / GB:.2f} GB in {files} files; 2 ranks (gloo, CPU, 1 thread each); median of {args.reps} per "
          "rank; ratio = load / baseline per rank, max over ranks (target <= 1.5x)\n")
    print("| mode | cache | GB per rank | baseline s | load s | ratio | baseline GB/s | load GB/s | "
          "bytes read / share | share / file |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error']} | | | | | | | | |")
            continue
        for cache in args.caches.split(","):
            ranks = r["ranks"]
            base = [x["baseline"][cache] for x in ranks]
            load = [x["load"][cache] for x in ranks]
            ratio = max(ld / b for ld, b in zip(load, base))
            share = max(x["share"] for x in ranks)
            read = max(x["read"] / x["share"] for x in ranks)
            print(f"| {name} | {cache} | {share / GB:.2f} | {_pair(base)} | {_pair(load)} | {ratio:.2f}x | "
                  f"{share / max(base) / GB:.2f} | {share / max(load) / GB:.2f} | {read:.2f} | "
                  f"{share / total:.2f} |")
    print("\nbaseline s, load s: rank 0 / rank 1; GB/s: the rank's share over the slower rank's time.")


def _pair(xs: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in xs)


# ------------------------------------------------------------------ workers (under torchrun)
def _headers(ckpt: Path) -> dict[str, tuple[Path, int, str]]:
    """{key: (file, offset of its data in the file, dtype)} from the files' headers."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(weight_map.values())):
        with open(ckpt / fname, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, entry in header.items():
            if key != "__metadata__":
                out[key] = (ckpt / fname, 8 + n + entry["data_offsets"][0], entry["dtype"])
    return out


def _ranges(model, ckpt: Path) -> tuple[list[tuple[Path, int, memoryview]], int]:
    """This rank's part of every tensor as (file, offset, destination in the live local tensor's memory), in the
    order they lie in the files, and its bytes.  A part is a box of the global tensor (Shard/Replicate on a 1-D
    mesh): one run of bytes per index of the dims before the last one it cuts."""
    import itertools

    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    stored = _headers(ckpt)
    out, share, seen = [], 0, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or name not in stored:
            continue  # a tied weight is stored (and read) once, under its first name
        seen.add(id(t))
        file, base, _ = stored[name]
        shape = tuple(t.shape)
        if isinstance(t, DTensor):
            local = t._local_tensor
            lshape, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
        else:
            local, lshape, offset = t, shape, (0,) * len(shape)
        assert tuple(local.shape) == tuple(lshape) and local.is_contiguous()
        es = local.element_size()
        share += local.numel() * es
        if local.numel() == 0:
            continue
        dest = memoryview(local.detach().view(-1).view(torch.uint8).numpy())
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        cut = max([d for d in range(len(shape)) if lshape[d] != shape[d]], default=0)
        run = lshape[cut] * strides[cut] * es if shape else es
        pos = 0
        for outer in itertools.product(*(range(offset[d], offset[d] + lshape[d]) for d in range(cut))):
            start = sum(i * s for i, s in zip(outer, strides)) + (offset[cut] * strides[cut] if shape else 0)
            out.append((file, base + start * es, dest[pos:pos + run]))
            pos += run
        assert pos == local.numel() * es, name
    order = {f: k for k, f in enumerate(dict.fromkeys(f for f, _, _ in out))}
    out.sort(key=lambda x: (order[x[0]], x[1]))  # each file in turn, from its start to its end
    return out, share


def _baseline(ranges) -> None:
    fds = {}
    try:
        for file, offset, dest in ranges:
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(file, os.O_RDONLY)
            n = os.preadv(fd, [dest], offset)
            while n < len(dest):  # a short read: the rest
                n += os.preadv(fd, [dest[n:]], offset + n)
    finally:
        for fd in fds.values():
            os.close(fd)


def _drop_cache(ckpt: Path) -> None:
    for file in ckpt.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import spmd_ort
    from examples.gpt import GPT, tensor_parallel_plan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = Path(args.ckpt)
    if args.worker == "fully_shard":
        mode = spmd_ort.DataParallel(parallel_style="fully_shard")
    else:
        mode = spmd_ort.TensorParallel(tensor_parallel_plan())
    with torch.device("meta"):
        model = GPT(config(args))
    spmd_ort.parallelize(model, mode)
    model.to_empty(device="cpu")
    ranges, share = _ranges(model, ckpt)
    caches = args.caches.split(",")
    times = {"baseline": {c: [] for c in caches}, "load": {c: [] for c in caches}}
    read = None

    def timed(kind: str, cache: str):
        nonlocal read
        if cache == "cold":
            if rank == 0:
                _drop_cache(ckpt)
        elif not times["baseline"][cache] and not times["load"][cache]:
            _baseline(ranges)  # every page of this rank's part in the cache (a cold read before left it so too)
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "baseline":
            _baseline(ranges)
        else:
            read = spmd_ort.load_safetensors(model, ckpt).bytes_read
        times[kind][cache].append(time.perf_counter() - t0)
        dist.barrier()

    for rep in range(args.reps):
        for cache in caches:
            for kind in ("baseline", "load") if rep % 2 == 0 else ("load", "baseline"):
                timed(kind, cache)
    # a load into zeroed tensors leaves exactly the bytes the baseline reads: compare checksums after each
    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.state_dict().values()]
    sums = lambda: torch.stack([t.sum(dtype=torch.float64) for t in locals_])
    with torch.no_grad():
        for t in locals_:
            t.zero_()
        spmd_ort.load_safetensors(model, ckpt)
        after_load = sums()
        _baseline(ranges)
        same = bool(torch.equal(after_load, sums()))
    if args.profile:  # a warm load under cProfile (every rank: it is collective); rank 0 writes its profile
        import cProfile

        prof = cProfile.Profile()
        dist.barrier()
        prof.runcall(spmd_ort.load_safetensors, model, ckpt)
        if rank == 0:
            prof.dump_stats(args.profile)
    mine = {"share": share, "read": read, "same": same,
            "baseline": {c: sorted(v)[len(v) // 2] for c, v in times["baseline"].items()},
            "load": {c: sorted(v)[len(v) // 2] for c, v in times["load"].items()},
            "all": times}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        if not all(g["same"] for g in gathered):
            raise SystemExit("load_safetensors left other bytes than the baseline read")
        Path(args.out).write_text(json.dumps({"ranks": gathered}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
