"""Run under torchrun: each Hugging Face family of spmd_ort.plan.hf_configs, from its tiny config, trained 3 steps
by the compiled step (DataParallel, fx) against torch DDP on the same ranks.

    torchrun --standalone --nproc_per_node=2 tests/dist/hf_zoo_parity.py --families llama3-8b,gemma2-9b --out OUT

Every rank builds the tiny model from one seed, trains a DDP copy (``find_unused_parameters``: a routed expert
may get no token) and a compiled copy on its own batches (2 x 16 tokens) with AdamW (weight decay) and clipping
at 1.0, and compares after every step: its loss within 1e-4, every parameter within 2e-3 relative (the norm of
the difference over the tensor's). ``--layout tp``: with SGD, whose update follows the gradient's scale, the
compiled copy under the family's tensor-parallel plan
(``spmd_ort.plan``'s ``llama_tensor_parallel_plan``, over both ranks, the same batches on each) against the
model trained eagerly in the process, every parameter gathered. SGD without momentum at lr 0.1 (over the 3
steps a unit of gradient moves the parameters 0.3, 0.28 with momentum 0.9 at lr 0.05) is stateless: each family
compiles one variant; ``MOMENTUM`` (Qwen 3: Megatron's attention and MLP, and per-head norms whose gradient is
summed over the group) keeps momentum 0.9 at lr 0.05, whose first step (no buffers yet) is a variant of its own:
the momentum buffers of DTensor parameters. Except the tensors whose gradient is analytically zero (``NOISE``: a
key bias, which Adam turns rounding noise into ±lr steps of in any two implementations). A family that fails
records its error and the others go on. Every rank writes OUT/rank<r>.json: ``{family: {"ok", "loss", "worst",
"error", "seconds"}}``; with several layouts (``--layout dp,tp``: both in one launch),
``{layout: {family: ...}}``.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "dist"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
from zoo import clipped_lm_step as step  # noqa: E402
import spmd_ort  # noqa: E402
from spmd_ort.plan.hf_configs import CONFIGS, config  # noqa: E402

STEPS = 3
# tp: the families whose SGD keeps momentum (the others' is stateless: one variant each)
MOMENTUM = ("qwen3-8b",)
# parameters whose gradient is (partly) analytically zero: a key bias shifts every score of a query alike
NOISE = {"qwen2": ("*.k_proj.bias",), "stablelm": ("*.k_proj.bias",), "gpt_oss": ("*.k_proj.bias",),
         "gpt2": ("*.c_attn.bias",), "gpt_neox": ("*.query_key_value.bias",)}


def family(name: str, rank: int, layout: str) -> dict:
    """``dp``: the compiled step on this rank's batch against DDP; ``tp``: the family's tensor-parallel plan
    (spmd_ort.plan's, over both ranks, the same batch on each) against the model trained eagerly in this process."""
    import transformers

    from spmd_ort.plan.__main__ import llama_tensor_parallel_plan

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config(name, tiny=True))
    eager_model = copy.deepcopy(base)
    eager = DDP(eager_model, find_unused_parameters=True) if layout == "dp" else eager_model
    ours = copy.deepcopy(base)
    # tp: SGD, whose update follows the gradient's scale (Adam's would hide a gradient summed twice); with momentum
    # on MOMENTUM's families only (its first step, without buffers, is a variant of its own: a second compile)
    make_opt = (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1)) if layout == "dp" else \
        (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)) if name in MOMENTUM else \
        (lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt_e, opt_c = make_opt(eager_model.parameters()), make_opt(ours.parameters())
    mode = None
    if layout == "tp":
        mode = spmd_ort.TensorParallel(llama_tensor_parallel_plan(ours, dist.get_world_size()))
    compiled = spmd_ort.compile(backend="fx", parallel_mode=mode)(step)
    noise = NOISE.get(CONFIGS[name][0], ())
    losses, worst = [], 0.0
    for i in range(STEPS):
        seed = 100 * i + (rank if layout == "dp" else 0)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
        want = step(eager, opt_e, x).item()
        got = compiled(ours, opt_c, x).item()
        assert abs(got - want) <= 1e-4, f"step {i + 1}: loss {got} against eager's {want}"
        losses.append(got)
        for (pname, p), q in zip(ours.named_parameters(), eager_model.parameters(), strict=True):
            p = p.full_tensor() if hasattr(p, "full_tensor") else p  # (collective: every rank, in order)
            if any(fnmatch.fnmatch(pname, pat) for pat in noise):
                continue
            rel = ((p.detach() - q.detach()).norm() / q.detach().norm().clamp_min(1e-12)).item()
            worst = max(worst, rel)
            assert rel <= 2e-3, f"step {i + 1}: {pname} differs from eager's by {rel:.2e} (relative)"
    return {"loss": losses, "worst": worst, "skipped": list(noise)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(CONFIGS))
    ap.add_argument("--layout", default="dp", help="dp, tp, or both (dp,tp): one launch")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    layouts = a.layout.split(",")
    if not set(layouts) <= {"dp", "tp"}:
        ap.error(f"--layout: dp, tp or dp,tp, not {a.layout}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {layout: {} for layout in layouts}
    for layout in layouts:
        for name in a.families.split(","):
            t0 = time.perf_counter()
            try:
                got = {"ok": True, **family(name, rank, layout)}
            except Exception as exc:  # noqa: BLE001 - recorded, the other families go on
                got = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                       "trace": traceback.format_exc()[-2000:]}
            got["seconds"] = time.perf_counter() - t0
            ok = torch.tensor([int(got["ok"])])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # a family failed on one rank is failed on every rank
            got["ok"] = bool(ok.item())
            results[layout][name] = got
            if rank == 0:
                print(f"{layout} {name}: {'ok' if got['ok'] else got.get('error', 'failed on another rank')}"
                      f" ({got['seconds']:.1f} s)", flush=True)
    finish(a.out, results if len(layouts) > 1 else results[layouts[0]])


if __name__ == "__main__":
    main()
