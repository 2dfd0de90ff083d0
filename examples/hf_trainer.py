"""Train a tiny Llama with the Hugging Face Trainer, each optimizer step compiled by spmd_ort.

Run:  python examples/hf_trainer.py [--steps 60] [--parallel fully_shard] [--backend fx] [--eager]
  or: torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py [--parallel fully_shard]

The script is the Trainer as users write it; the one changed line is the import of ``Trainer`` (``--eager``
takes transformers' own, for comparison). The corpus is this repository's Python sources and docs, cut into
128-character sequences (a character vocabulary), so nothing is downloaded. Under torchrun each rank trains on
its shard of the data (the Trainer's dataloader) and the compiled step averages gradients over the ranks
(``--parallel fully_shard``: each rank holds half the parameters and optimizer state). At the end the model is
saved with ``trainer.save_model`` and read back with ``transformers.AutoModelForCausalLM.from_pretrained``.
See docs/huggingface.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from spmd_ort.integrations.transformers import Trainer  # noqa: E402  (was: from transformers import Trainer)


def corpus_dataset(length: int = 128, limit: int = 4096) -> tuple[list[dict], int]:
    """The repository's own text as ``limit`` sequences of ``length`` characters (labels = inputs: the model
    shifts them), and the vocabulary's size."""
    files = sorted(p for ext in ("*.py", "*.md") for p in ROOT.rglob(ext)
                   if ".venv" not in p.parts and ".git" not in p.parts)
    text = "\n".join(p.read_text(errors="ignore") for p in files)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text[: length * limit]], dtype=torch.long)
    ids = ids[: len(ids) // length * length].view(-1, length)
    return [{"input_ids": row, "labels": row} for row in ids], len(chars)


def trainer(args, out: str, eager: bool = False, callbacks=()):
    data, vocab = corpus_dataset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=args.width, intermediate_size=args.width * 3,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128))
    targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
                              gradient_accumulation_steps=args.ga, learning_rate=3e-3, lr_scheduler_type="cosine",
                              warmup_steps=max(1, args.steps // 10), max_grad_norm=1.0, weight_decay=0.1,
                              logging_steps=max(1, args.steps // 6), save_strategy="no", report_to=[], use_cpu=True,
                              disable_tqdm=True, seed=0, bf16=args.bf16)
    if eager:
        return transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=list(callbacks))
    options = {"backend": args.backend} if args.backend else {}
    return Trainer(model=model, args=targs, train_dataset=data, callbacks=list(callbacks),
                   parallel_mode=args.parallel, compile_options=options)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--parallel", default=None, help="None (DataParallel under torchrun), replicate, fully_shard")
    ap.add_argument("--backend", default=None, help="spmd_ort.compile's backend (default: auto)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--eager", action="store_true", help="transformers' own Trainer, for comparison")
    ap.add_argument("--out", default="out/hf_trainer")
    return ap


def main() -> None:
    args = parser().parse_args()
    t = trainer(args, args.out, eager=args.eager)
    start = time.perf_counter()
    result = t.train()
    t.save_model(args.out)
    if t.args.process_index == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(args.out)
        print(f"trained {result.global_step} steps in {time.perf_counter() - start:.1f} s, loss "
              f"{result.training_loss:.3f}; saved to {args.out} and read back by from_pretrained "
              f"({sum(p.numel() for p in loaded.parameters()):,} parameters)")


if __name__ == "__main__":
    main()
