"""The Hugging Face Trainer case the integration tests share (tests/test_hf_trainer.py, tests/dist/hf_trainer.py):
a tiny Llama, a padded token dataset with ``-100`` labels, the Trainer's arguments, and one run's record."""

from __future__ import annotations

import os

import torch

VOCAB = 128


def llama_config(**kw):
    import transformers

    return transformers.LlamaConfig(**{"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 75,
                                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "max_position_embeddings": 64, **kw})


def llama(seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(**kw))


def dataset(n: int = 48, length: int = 16, seed: int = 0) -> list[dict]:
    """Sequences of ``length`` tokens, up to 4 of them padding (attention mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        labels, mask = ids.clone(), torch.ones(length, dtype=torch.long)
        pad = int(torch.randint(0, 5, (1,), generator=g))
        if pad:
            labels[-pad:], mask[-pad:] = -100, 0
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def training_args(output_dir, **kw):
    import transformers

    return transformers.TrainingArguments(**{
        "output_dir": str(output_dir), "per_device_train_batch_size": 2, "per_device_eval_batch_size": 4,
        "gradient_accumulation_steps": 2, "max_steps": 6, "learning_rate": 2e-3, "lr_scheduler_type": "cosine",
        "warmup_steps": 2, "max_grad_norm": 0.5, "weight_decay": 0.1, "logging_steps": 1, "report_to": [],
        "save_strategy": "no", "seed": 0, "use_cpu": True, "disable_tqdm": True,
        **({"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}), **kw})


def record(trainer) -> dict:
    """What the Trainer logged: the loss and gradient norm of each optimizer step, the learning rate, and the
    evaluation losses."""
    logs = trainer.state.log_history
    return {"loss": [h["loss"] for h in logs if "loss" in h],
            "grad_norm": [float(h["grad_norm"]) for h in logs if "loss" in h],
            "lr": [h["learning_rate"] for h in logs if "loss" in h],
            "eval_loss": [h["eval_loss"] for h in logs if "eval_loss" in h]}
