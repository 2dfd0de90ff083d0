"""Run under torchrun: expert parallelism (``Parallel(dp_shard=N, ep=M, experts=...)``) against torch DDP.

    torchrun --standalone --nproc_per_node=2 tests/dist/ep_parity.py --out DIR [--scenarios a,b,...] [--ep 2]

Each scenario trains an HF mixture-of-experts model (tiny config, random weights) for ``STEPS`` AdamW steps with
gradient clipping, compiled with its experts spread over ``ep`` ranks, and the same model under torch DDP on the
same ranks and batches.  After every step, on every rank: the loss (1e-4) and every parameter and Adam moment
of the whole model (``full_state_dict``; 2e-3 relative per tensor).  Also: each rank holds 1/world of every
expert parameter and of its optimizer state, and the all-to-all bytes the step counted are what its routing
sent.

* ``mixtral`` / ``mixtral-ort``: ``MixtralForCausalLM`` (E=4, top-2), on fx and on ONNX Runtime;
* ``qwen3``: ``Qwen3MoeForCausalLM`` (E=8, top-2), its router's auxiliary (load-balancing) loss in the loss;
* ``deepseek``: ``DeepseekV3ForCausalLM`` (a dense first layer, shared experts and 8 routed experts, grouped top-k);
* ``meta``: Mixtral built on the meta device, ``spmd_ort.parallelize``d, ``to_empty`` and ``load_safetensors``
  (each rank reads its own experts' rows), then trained as the others;
* ``bf16``: FSDP2's mixed precision policy under ep against the same under fully_shard alone (one SGD step);
* ``titan``: a torchtitan-style MoE LM (tests/models.py: ``GroupedExperts`` called on rows sorted by expert with
  their counts, scores applied before the experts, a shared expert), on ORT;
* ``accum``: Mixtral with gradient accumulation (two micro-batches, each a backward, then one step);
* ``recompute``: Mixtral with every block checkpointed (``activation_memory_budget="full"``): the experts'
  backward runs their forward (and its exchanges) again;
* ``few`` (on 4 ranks): Mixtral with 2 experts (top-2: top-1 of 2 gives the router an analytically zero
  gradient), fewer than the ranks: ranks 0 and 1 hold the experts'
  rows, ranks 2 and 3 fully_shard's padding; each block of one expert is gathered over a holder and a padding rank;
* ``starved``: Mixtral whose router never picks expert 3: it gets no token from any rank (its gradient zero, as
  DDP's; the rank that computes it reports 0 tokens for it).

The all-to-all bytes are checked against the routing DDP's model chose (hooks on its experts modules): over
the world, four times the (token, expert) rows sent to an expert another rank computes (tokens out, results
back, and the backward's two), times the hidden size and the dtype's bytes.

Writes DIR/rank<r>.json: per scenario the losses, the worst relative parameter difference and the step's comm.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from dist_common import finish  # noqa: E402
import spmd_ort  # noqa: E402
from helpers import ort_report  # noqa: E402
from models import TitanMoELM  # noqa: E402
from zoo import clipped_lm_step, clipped_step  # noqa: E402

STEPS = 5
SEQ = 8
PER_RANK = 2
SCENARIOS = ("mixtral", "mixtral-ort", "qwen3", "deepseek", "titan", "accum", "recompute", "starved",
             "mixtral-even", "meta", "bf16", "errors")  # and "few" (4 ranks)
# per scenario (per-rank batch, sequence length): mixtral-even routes enough tokens for the plan's even split
SHAPES = {"mixtral-even": (4, 64)}


step_fn = clipped_lm_step
titan_step = clipped_step(lambda model, x: model(x, x), "titan_step")


def accum_step(model, opt, x):
    """Gradient accumulation: two micro-batches, each one backward, then one optimizer step."""
    total = 0.0
    for chunk in x.chunk(2):
        loss = model(input_ids=chunk, labels=chunk).loss / 2
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def build(name: str):
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    if name in ("mixtral", "mixtral-ort", "accum", "recompute", "starved", "mixtral-even", "meta", "bf16", "errors"):
        cfg = T.MixtralConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        return T.MixtralForCausalLM(cfg), "model.layers.*.mlp.experts"
    if name == "few":  # fewer experts than ranks (4): fully_shard's rows of the last ranks are padding
        cfg = T.MixtralConfig(**common, intermediate_size=64, num_local_experts=2, num_experts_per_tok=2)
        return T.MixtralForCausalLM(cfg), "model.layers.*.mlp.experts"
    if name == "qwen3":
        cfg = T.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=8,
                               output_router_logits=True, router_aux_loss_coef=0.01)  # the aux loss in the loss
        return T.Qwen3MoeForCausalLM(cfg), "model.layers.*.mlp.experts"
    if name == "deepseek":
        cfg = T.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                 num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                                 num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                 topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
                                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return T.DeepseekV3ForCausalLM(cfg), "model.layers.*.mlp.experts"
    if name == "titan":
        return TitanMoELM(), "layers.*.moe.experts"
    raise ValueError(name)


def starve(model) -> None:
    """The routers of ``model`` (Mixtral) never pick expert 3: its logit is masked before the softmax."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    class StarvedRouter(MixtralTopKRouter):
        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, self.weight)
            masked = logits.masked_fill(torch.arange(self.num_experts) == 3, -1e4)
            probs = torch.softmax(masked.float(), dim=-1)
            top, index = torch.topk(probs, self.top_k, dim=-1)
            return logits, top / top.sum(dim=-1, keepdim=True), index

    for layer in model.model.layers:
        layer.mlp.gate.__class__ = StarvedRouter


def routed_rows(model, world: int, ep: int, rank: int) -> list:
    """Hooks on ``model``'s experts modules; the list they fill with, per call, the (token, expert) rows this rank
    sends to experts another rank of its ep group computes."""
    sent: list = []
    block = world // ep

    def hook(mod, args):
        experts = mod.num_experts
        if len(args) == 2:  # torchtitan's call: rows sorted by expert, and their counts
            per_block = args[1].long().view(ep, experts // ep).sum(1)
            rows = int(per_block.sum() - per_block[rank // block])
        else:
            owner = args[1].reshape(-1) // (experts // ep)
            rows = int((owner != rank // block).sum())
        sent.append(rows * args[0].shape[-1] * args[0].element_size())

    for fqn, mod in model.named_modules():
        if fqn.endswith(".experts"):
            mod.register_forward_pre_hook(hook)
    return sent


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def scenario(name: str, rank: int, world: int, ep: int, out_dir: str = "") -> dict:
    torch.manual_seed(0)
    base, pattern = build(name)
    if name == "starved":
        starve(base)
    ddp = DDP(copy.deepcopy(base))
    sent = routed_rows(ddp.module, world, ep, rank)
    layout = spmd_ort.Parallel(dp_shard=world, ep=ep, experts=pattern)
    loaded = None
    if name == "meta":  # nothing allocated but this rank's part, filled from a file of the base's weights
        directory = Path(out_dir) / "weights"
        spmd_ort.save_safetensors(base, directory)
        with torch.device("meta"):
            model, _ = build(name)
        spmd_ort.parallelize(model, layout)
        model.to_empty(device="cpu")
        report = spmd_ort.load_safetensors(model, directory)
        with torch.no_grad():  # non-persistent buffers (the rotary inv_freq) are in no file: computed again
            for n, b in model.named_buffers():
                b.copy_(base.get_buffer(n))
        experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}
        for n, p in experts.items():  # this rank's rows of every expert parameter, as the file holds them
            rows = p.shape[0] // world
            assert torch.equal(p.to_local(), base.get_parameter(n).detach()[rank * rows:(rank + 1) * rows]), n
        loaded = {"bytes_read": report.bytes_read, "bytes_total": report.bytes_total}
    else:
        model = copy.deepcopy(base)
    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)  # noqa: E731
    opt_ref, opt = make(ddp.parameters()), make(model.parameters())
    backend = "ort" if name.endswith("-ort") or name == "titan" else "fx"
    fn = {"titan": titan_step, "accum": accum_step}.get(name, step_fn)
    budget = "full" if name == "recompute" else 1.0
    step = spmd_ort.compile(parallel_mode=layout, backend=backend, activation_memory_budget=budget)(fn)
    losses, worst = [], 0.0
    names = [n for n, _ in base.named_parameters()]
    for i in range(STEPS):
        sent.clear()
        g = torch.Generator().manual_seed(300 + i)
        per_rank, seq = SHAPES.get(name, (PER_RANK, SEQ))
        x = torch.randint(3, 64, (per_rank * world, seq), generator=g)[per_rank * rank: per_rank * (rank + 1)]
        loss = step(model, opt, x)
        ref = fn(ddp, opt_ref, x).detach()
        torch.testing.assert_close(loss.detach(), ref, rtol=1e-4, atol=1e-4, msg=f"{name} rank {rank} step {i} loss")
        full = spmd_ort.full_state_dict(model, opt, rank0_only=False)
        for n, want in ddp.module.state_dict().items():
            r = rel(full["model"][n], want)
            worst = max(worst, r)
            assert r <= 2e-3, f"{name} rank {rank} step {i}: {n} differs by {r:.2e} relative"
        ref_state = opt_ref.state_dict()["state"]
        for k, st in ref_state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                r = rel(full["optim"]["state"][k][key], st[key])
                assert r <= 2e-3, f"{name} rank {rank} step {i}: {names[k]} {key} differs by {r:.2e} relative"
        losses.append(float(loss))
    # each rank holds 1/world of every expert parameter and of its Adam moments
    expert = {n: p for n, p in model.named_parameters() if ".experts." in n}
    held = {n: tuple(p.to_local().shape) for n, p in expert.items()}
    for n, p in expert.items():  # (fewer experts than ranks: one row each, the last ranks' padding)
        assert p.to_local().shape[0] == (p.shape[0] // world if p.shape[0] >= world else int(rank < p.shape[0])), \
            (n, held[n])
        st = opt.state[p]
        assert st["exp_avg"].to_local().shape == p.to_local().shape, n
    comm = step.comm
    # the bytes the step counted, over the world, are what the routing sent (4 times: out, back, and backward;
    # recomputed, 6: the backward sends the tokens out and back again)
    counted = torch.tensor([comm.all_to_all_bytes, (6 if name == "recompute" else 4) * sum(sent)],
                           dtype=torch.float64)
    dist.all_reduce(counted)
    assert counted[0] == counted[1], f"{name}: all-to-all bytes counted {counted[0]:.0f}, routed {counted[1]:.0f}"
    if name == "starved":  # the rank computing expert 3 got no token for it, in every layer
        if rank // (world // ep) == ep - 1:
            for fqn, per_call in comm.expert_tokens.items():
                assert per_call[-1][-1] == 0, (fqn, per_call)
    # the all-to-all bytes: what this rank's routing sent to other ranks (tokens, results, both gradients)
    stats = {"all_to_all_bytes": comm.all_to_all_bytes, "all_to_all_calls": comm.all_to_all_calls,
             "expert_tokens": comm.expert_tokens, "all_gather_bytes": comm.all_gather_bytes,
             "reduce_scatter_bytes": comm.reduce_scatter_bytes}
    out = {"losses": losses, "worst_rel": worst, "held": held, "comm": stats, "loaded": loaded,
           "explain": step.explain(),
           "opaque": [c.describe() for c in step.compiled.opaque]}
    if backend == "ort":
        out["ort"] = ort_report(step)
    del ddp
    gc.collect()
    return out


def bf16(rank: int, world: int, ep: int) -> dict:
    """FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 reductions) under ep against the same policy under
    fully_shard alone (tested against FSDP2 in test_mixed_precision): one SGD step's update of every parameter
    within bf16's rounding (2e-2 relative; bf16 keeps 8 bits), the loss within 1e-3."""
    torch.manual_seed(0)
    base, pattern = build("bf16")
    policy = spmd_ort.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    g = torch.Generator().manual_seed(300)
    x = torch.randint(3, 64, (PER_RANK * world, SEQ), generator=g)[PER_RANK * rank: PER_RANK * (rank + 1)]
    got = {}
    for name, layout in (("fully_shard", spmd_ort.Parallel(dp_shard=world, mixed_precision=policy)),
                         ("ep", spmd_ort.Parallel(dp_shard=world, ep=ep, experts=pattern, mixed_precision=policy))):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        loss = spmd_ort.compile(parallel_mode=layout, backend="fx")(step_fn)(model, opt, x)
        got[name] = (float(loss), spmd_ort.full_state_dict(model, rank0_only=False)["model"])
    worst = 0.0
    assert abs(got["ep"][0] - got["fully_shard"][0]) < 1e-3, (got["ep"][0], got["fully_shard"][0])
    for n, start in base.state_dict().items():
        r = rel(got["ep"][1][n] - start, got["fully_shard"][1][n] - start)
        worst = max(worst, r)
        assert r < 2e-2, f"bf16 rank {rank}: the update of {n} differs by {r:.2e} relative"
    return {"worst_rel": worst}


def errors(rank: int, world: int, ep: int) -> dict:
    """A glob that matches nothing: a ConfigError on every rank, before anything is traced, and the model and
    optimizer as they were."""
    torch.manual_seed(0)
    model, _ = build("errors")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = spmd_ort.Parallel(dp_shard=world, ep=ep, experts="model.layers.*.moe.experts")
    step = spmd_ort.compile(parallel_mode=layout)(step_fn)
    x = torch.randint(3, 64, (PER_RANK, SEQ))
    try:
        step(model, opt, x)
    except spmd_ort.ConfigError as exc:
        message = str(exc)
    else:
        raise AssertionError("a glob that matches no module compiled")
    for n, p in model.named_parameters():  # plain tensors still (not laid out), with their values
        assert not hasattr(p, "placements") and torch.equal(p, before[n]), n
    assert not opt.state
    return {"error": message}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank, "world": world}
    for name in args.scenarios.split(","):
        if name in ("errors", "bf16"):
            result[name] = (errors if name == "errors" else bf16)(rank, world, args.ep)
        else:
            result[name] = scenario(name, rank, world, args.ep, args.out)
    finish(args.out, result)


if __name__ == "__main__":
    main()
