"""Activation memory: compiled (fx) at activation_memory_budget 1.0 / 0.5 / 0.0 vs eager and eager with
``torch.utils.checkpoint`` on every block: the step's real peak memory and its time.

Run:  .venv/bin/python bench/memory.py [--steps 3] [--runners eager,eager+checkpoint,fx@1.0,fx@0.5,fx@0.0]
      [--model gpt|llama|nano|torch] [--vocab 256]

An activation-heavy LM: GPT, 6 layers, 4 heads, d 256, seq 512, vocab 256, batch 8, dropout 0.1 (in
attention and after each MLP), AdamW(lr 1e-3, ``fused=True``) for every runner.  Each runner is its own
process, started one after the other, with glibc returning freed memory to the system
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` at 128 KiB; ``SPMD_ORT_RETAIN_HOST_MEMORY=0``), so
the resident set follows the live tensors.  After the first step (compilation, first run) the worker resets
the kernel's high-water mark (``/proc/self/clear_refs``), then runs ``--steps`` steps:

* peak MiB: the high-water mark of the resident set over those steps minus the resident set before them
  (the step's own memory: what it allocates above the model, its optimizer state and the interpreter);
* ms/step: median over those steps;
* planned MiB (compiled runners): ``memory()``'s planned peak of the step's values and, of it, the forward
  values kept for the backward at that peak;
* bitwise: whether the loss after the last step and every parameter equal eager's bit for bit (the same
  seed before every step: the same dropout masks).

Runners: ``eager``; ``eager+checkpoint`` (each block in ``torch.utils.checkpoint(use_reentrant=False)``, which
replays the block's dropout in its recomputation); ``fx@B`` / ``ort@B`` (``spmd_ort.compile(backend=...,
activation_memory_budget=B)``; ``B`` a number, or ``full`` / ``selective``: torchtitan's checkpointing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the "ort" runner is the default backend as users get it (backend="auto"), as in RESULTS' tables
DEFAULT_BACKENDS = {"ort": "auto"}


ROOT = Path(__file__).resolve().parent.parent
RUNNERS = "eager,eager+checkpoint,fx@1.0,fx@0.5,fx@0.0"
# glibc hands every block above 128 KiB to mmap and gives it back on free: RSS follows the live tensors
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
             "SPMD_ORT_RETAIN_HOST_MEMORY": "0"}
MIB = 2**20
WHAT = {"gpt": "GPT", "llama": "HF Llama (SwiGLU FFN 688, 2 KV heads, no dropout)",
        "nano": "nanoGPT, attention written out (matmul, causal mask, softmax, dropout), untied head",
        "torch": "torch's nn.TransformerEncoderLayer (norm first, GELU, FFN 1024, causal mask), untied head"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runners", default=RUNNERS)
    ap.add_argument("--model", default="gpt", choices=tuple(WHAT),
                    help="gpt: examples/gpt.py (GELU MLP, dropout); llama: transformers' Llama (RMSNorm, SwiGLU "
                         "FFN 688, 2 KV heads, no dropout); nano: nanoGPT's attention written out (matmul, mask, "
                         "softmax, dropout on the probabilities), dropout after the embeddings and each residual "
                         "branch, untied head; d 256 and 4 heads all")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runners.split(","):
            out = Path(tmp) / "out.json"
            out.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--worker", name, "--out", str(out), "--steps", str(args.steps),
                   "--model", args.model, "--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            env.update({**ALLOCATOR, "SPMD_ORT_LOG_LEVEL": "WARNING"})
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not out.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                results[name] = {"error": " / ".join(tail)[-300:]}
            else:
                results[name] = json.loads(out.read_text())
            print(f"{name}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    report(results, args)


def report(results: dict, args) -> None:
    import torch

    what = WHAT[args.model]
    print(f"# bench/memory.py --model {args.model} — {what} {args.layers} layers, d 256, seq {args.seq}, batch "
          f"{args.batch}{'' if args.model == 'llama' else ', dropout 0.1'}; "
          f"torch {torch.__version__}, {os.cpu_count()} cores; glibc returning freed memory; {args.steps} steps "
          "after the first")
    print("| runner | peak MiB | x fx@1.0 | x eager+checkpoint | ms/step | x eager | x eager+checkpoint | "
          "planned peak MiB | planned kept for backward MiB | bitwise = eager |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    eager, ckpt, full = (results.get(k, {}) for k in ("eager", "eager+checkpoint", "fx@1.0"))

    def ratio(r, base, key):
        return f"{r[key] / base[key]:.2f}" if key in base and key in r else "-"

    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | | | | |")
            continue
        planned = (f"{r['planned'] / MIB:.0f} | {r['planned_saved'] / MIB:.0f}" if "planned" in r else "- | -")
        same = "-" if name == "eager" or "digest" not in eager else \
            ("yes" if r["digest"] == eager["digest"] else "no")
        print(f"| {name} | {r['peak'] / MIB:.0f} | {ratio(r, full, 'peak')} | {ratio(r, ckpt, 'peak')} | "
              f"{r['ms']:.0f} | {ratio(r, eager, 'ms')} | {ratio(r, ckpt, 'ms')} | {planned} | {same} |")
    if all("peak" in results.get(k, {}) for k in ("fx@0.0", "fx@0.5", "fx@1.0", "eager+checkpoint")):
        z, h = results["fx@0.0"], results["fx@0.5"]
        print(f"\ntargets: budget 0.0 peak {z['peak'] / full['peak']:.2f}x budget 1.0's (<= 0.5), time "
              f"{z['ms'] / ckpt['ms']:.2f}x eager+checkpoint's (<= 1.05) at {z['peak'] / ckpt['peak']:.2f}x its "
              f"memory (<= 1.1); budget 0.5 peak {h['peak'] / full['peak']:.2f}x budget 1.0's (<= 0.8) at "
              f"{h['ms'] / full['ms']:.2f}x its time (<= 1.15)")


# ------------------------------------------------------------------ one runner, in its own process
def nano_gpt(cfg):
    """nanoGPT (Karpathy's model.py) as it runs without flash attention: the attention written out, dropout on
    the embeddings, the attention probabilities and both residual branches, biases, an untied head."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(cfg.d, 3 * cfg.d), nn.Linear(cfg.d, cfg.d)
            self.attn_dropout, self.resid_dropout = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
            self.register_buffer("bias", torch.tril(torch.ones(cfg.seq, cfg.seq)).view(1, 1, cfg.seq, cfg.seq))

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, cfg.heads, C // cfg.heads).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(cfg.d), Attention(), nn.LayerNorm(cfg.d)
            self.mlp = nn.Sequential(nn.Linear(cfg.d, 4 * cfg.d), nn.GELU(), nn.Linear(4 * cfg.d, cfg.d),
                                     nn.Dropout(cfg.dropout))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class NanoGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.seq, cfg.d)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln_f, self.lm_head = nn.LayerNorm(cfg.d), nn.Linear(cfg.d, cfg.vocab, bias=False)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return NanoGPT()


def torch_lm(cfg):
    """A causal LM of torch's own ``nn.TransformerEncoderLayer`` blocks (pre-norm, GELU, dropout everywhere
    torch puts it: the attention probabilities, both residual branches, inside the FFN), an untied head."""
    import torch
    from torch import nn

    class TorchLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.seq, cfg.d)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(cfg.d, cfg.heads, 4 * cfg.d, cfg.dropout, activation="gelu",
                                           batch_first=True, norm_first=True) for _ in range(cfg.layers))
            self.ln_f, self.head = nn.LayerNorm(cfg.d), nn.Linear(cfg.d, cfg.vocab, bias=False)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq), persistent=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            mask = self.mask[:idx.shape[1], :idx.shape[1]]
            for block in self.blocks:
                x = block(x, src_mask=mask, is_causal=True)
            return self.head(self.ln_f(x))

    return TorchLM()


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    sys.path.insert(0, str(ROOT))
    import spmd_ort
    from examples.gpt import GPT, GPTConfig

    class Checkpointed(nn.Module):
        def __init__(self, block: nn.Module):
            super().__init__()
            self.block = block

        def forward(self, *args, **kwargs):
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    def step_fn(model, opt, x, y):
        logits = model(input_ids=x).logits if hasattr(model, "config") else model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d=256, heads=4, layers=args.layers, dropout=0.1)
    torch.manual_seed(0)
    if args.model == "gpt":
        model = GPT(cfg)
        blocks = model.blocks
    elif args.model == "nano":
        model = nano_gpt(cfg)
        blocks = model.blocks
    elif args.model == "torch":
        model = torch_lm(cfg)
        blocks = model.blocks
    else:
        import transformers

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=cfg.vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * args.seq,
            attn_implementation="sdpa"))
        blocks = model.model.layers
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    name = args.worker
    compiled = None
    if name == "eager+checkpoint":
        for i, block in enumerate(blocks):
            blocks[i] = Checkpointed(block)
        step = lambda x, y: step_fn(model, opt, x, y)
    elif name == "eager":
        step = lambda x, y: step_fn(model, opt, x, y)
    else:
        backend, budget = name.split("@")
        compiled = spmd_ort.compile(backend=DEFAULT_BACKENDS.get(backend, backend), activation_memory_budget=budget if budget in ("full", "selective") else float(budget))(step_fn)
        step = lambda x, y: compiled(model, opt, x, y)
    g = torch.Generator().manual_seed(0)
    times, loss = [], None
    for i in range(1 + args.steps):
        x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=g)
        y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=g)
        torch.manual_seed(100 + i)  # the same dropout masks in every runner
        if i == 1:
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS
            base = _rss("VmRSS")
        t0 = time.perf_counter()
        loss = step(x, y)
        if i >= 1:
            times.append(time.perf_counter() - t0)
    peak = _rss("VmHWM") - base
    digest = hashlib.sha256(loss.detach().numpy().tobytes())
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    out = {"peak": peak, "ms": statistics.median(times) * 1e3, "digest": digest.hexdigest()}
    if compiled is not None:
        mem = compiled.memory()
        out.update(planned=mem["planned_activation_peak"], planned_saved=mem["planned_saved_for_backward"])
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
