"""Small random train steps for the differential fuzzer (tests/test_fuzz.py), and the runner that checks one.

A :class:`Case` is plain data (hypothesis draws it; a counterexample is pasted into a
regular test as a ``Case(...)`` literal).  :func:`build` turns it into a model, an
optimizer factory, a step function and batches; :func:`run_case` trains an eager and a
compiled copy side by side and demands equality at every step with the tolerances of
tests/helpers.py: returned values, parameters, gradients, buffers, optimizer state and
the input's ``.grad``.

Some random steps are ill-conditioned (a BatchNorm over 2 values per channel behind a
saturating Tanh normalises a difference of nearly equal numbers): there eager float32
itself is far from the exact answer, and two float32 implementations that round
differently cannot agree to the usual tolerances.  So a float64 twin of the eager model
takes the same steps, and a step that misses the usual tolerances passes only if every
compiled value is within :data:`EAGER_NOISE_FACTOR` times eager float32's own distance
from the float64 value (:func:`within_eager_rounding`): the tolerance grows only where
eager's rounding error is measured to be that large, never by a fixed amount.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_ort
from helpers import RTOL, assert_close_normwise, assert_close_relmax, assert_ran_on_ort, assert_same_state

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU, "sigmoid": nn.Sigmoid,
               "mish": nn.Mish, "elu": nn.ELU, "softplus": nn.Softplus, "hardswish": nn.Hardswish}
LAYERS = ("linear", "conv", "layernorm", "batchnorm", "attention", "mha", "act", "dropout")


@dataclass(frozen=True)
class Layer:
    kind: str  # one of LAYERS
    residual: bool = False
    bias: bool = True
    act: str = "relu"  # for "act"
    causal: bool = False  # for "attention"
    heads: int = 1  # for "attention" / "mha"
    kernel: int = 1  # for "conv"


@dataclass(frozen=True)
class Case:
    seed: int = 0
    tokens: bool = False  # integer tokens into an Embedding (else a float input, which may require grad)
    d_in: int = 5
    width: int = 8
    batch: int = 2
    seq: int = 3
    classes: int = 4
    layers: tuple[Layer, ...] = ()
    shared: bool = False  # the first linear layer is applied twice (tied by module reuse)
    tie_head: bool = False  # tokens: the head's weight is the embedding's
    frozen: tuple[int, ...] = ()  # indices into the unique parameters: requires_grad=False
    warm_grads: bool = False  # one eager backward before training: every parameter starts with a .grad
    groups: int = 1  # param groups (contiguous chunks of the parameters), each its own lr / weight decay
    optimizer: str = "sgd"  # sgd | adam | adamw
    impl: str = "foreach"  # foreach | forloop | fused (eager's implementation; compiled always runs fused)
    momentum: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    lr: float = 1e-2
    clip: float | None = None  # clip_grad_norm_ max norm, passed to the step as a Python float
    scales: tuple[float, ...] = (1.0,)  # loss scale per step, a Python float argument (cycled)
    micro: int = 1  # backward passes per step (gradient accumulation within the step)
    zero: str = "end_none"  # end_none | end_zero | start_none | start_zero | never
    input_grad: bool = False  # float input only: the batch requires grad, its .grad accumulates across steps
    clear_input_grad: str = "keep"  # keep | none | zero: what the step does to x.grad at its end
    return_extra: str = "none"  # none | grad_norm | input_grad: a second output
    loss: str = "ce"  # ce | mse
    steps: int = 2
    notes: str = field(default="", compare=False)


class Attention(nn.Module):
    """Self-attention with F.scaled_dot_product_attention; no q/k/v bias (a key bias gets a zero gradient)."""

    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):  # (B, T, D)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, H, T, D/H)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MHA(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Channels(nn.Module):
    """Conv1d / BatchNorm1d over (B, T, D): channels are D."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.transpose(1, 2)).transpose(1, 2)


class Residual(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class Net(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        d = case.width
        self.stem = nn.Embedding(case.classes + 3, d) if case.tokens else nn.Linear(case.d_in, d)
        blocks = []
        for layer in case.layers:
            block = _block(layer, d, layer.bias)
            blocks.append(Residual(block) if layer.residual and layer.kind != "batchnorm" else block)
        self.blocks = nn.Sequential(*blocks)
        self.shared = nn.Linear(d, d) if case.shared else None
        out = case.classes + 3 if case.tie_head else case.classes
        self.head = nn.Linear(d, out, bias=not case.tie_head)
        if case.tie_head:
            self.head.weight = self.stem.weight

    def forward(self, x):
        h = self.stem(x)
        if self.shared is not None:
            h = torch.tanh(self.shared(h))
        h = self.blocks(h)
        if self.shared is not None:
            h = self.shared(h)
        return self.head(h)


def _block(layer: Layer, d: int, bias: bool) -> nn.Module:
    kind = layer.kind
    if kind == "linear":
        return nn.Linear(d, d, bias=bias)
    if kind == "conv":
        return Channels(nn.Conv1d(d, d, layer.kernel, padding=layer.kernel // 2, bias=bias))
    if kind == "layernorm":
        return nn.LayerNorm(d, elementwise_affine=layer.bias)
    if kind == "batchnorm":
        # After a nonlinearity: BatchNorm removes any per-channel constant, so a bias reaching it through
        # affine layers only (even the stem's, through residual Linears) has an analytically zero gradient,
        # whose rounding noise Adam turns into +-lr steps in any two implementations (docs/api.md, numerical notes).
        return nn.Sequential(nn.Tanh(), Channels(nn.BatchNorm1d(d)))
    if kind == "attention":
        return Attention(d, layer.heads, layer.causal)
    if kind == "mha":
        return MHA(d, layer.heads)
    if kind == "act":
        return ACTIVATIONS[layer.act]()
    if kind == "dropout":
        return nn.Dropout(0.1)
    raise ValueError(kind)


def make_optimizer(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    n = max(1, min(case.groups, len(params)))
    chunks = [params[i * len(params) // n:(i + 1) * len(params) // n] for i in range(n)]
    groups = [{"params": chunk, "lr": case.lr * (1 + i), "weight_decay": case.weight_decay * (i % 2 == 0)}
              for i, chunk in enumerate(chunks) if chunk]
    impl = {"foreach": {"foreach": True}, "forloop": {"foreach": False}, "fused": {"fused": True}}[case.impl]
    if case.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=case.lr, momentum=case.momentum, nesterov=case.nesterov,
                               dampening=case.dampening, maximize=case.maximize, **impl)
    cls = torch.optim.Adam if case.optimizer == "adam" else torch.optim.AdamW
    return cls(groups, lr=case.lr, amsgrad=case.amsgrad, maximize=case.maximize, **impl)


def make_step(case: Case):
    """The train step: forward, ``micro`` backward passes, clipping, step, zero_grad, input-grad handling."""

    def step(model, opt, x, y, scale, clip):
        if case.zero.startswith("start"):
            opt.zero_grad(set_to_none=case.zero == "start_none")
        total = 0.0
        for xs, ys in zip(x.chunk(case.micro), y.chunk(case.micro)):
            out = model(xs)
            if case.loss == "ce":
                loss = F.cross_entropy(out.flatten(0, -2), ys.flatten())
            else:
                loss = F.mse_loss(out, ys)
            (loss * scale / case.micro).backward()
            total = total + loss.detach()
        norm = None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if case.zero.startswith("end"):
            opt.zero_grad(set_to_none=case.zero == "end_none")
        extra = None
        if case.return_extra == "grad_norm" and norm is not None:
            extra = norm
        elif case.return_extra == "input_grad" and x.requires_grad and x.grad is not None:
            extra = x.grad.clone()
        if x.requires_grad and x.grad is not None:
            if case.clear_input_grad == "none":
                x.grad = None
            elif case.clear_input_grad == "zero":
                x.grad.zero_()
        return total if extra is None else (total, extra)

    return step


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + case.seed)
    out = []
    for _ in range(case.steps):
        b, t = case.batch * case.micro, case.seq
        if case.tokens:
            x = torch.randint(0, case.classes + 3, (b, t), generator=g)
        else:
            x = torch.randn(b, t, case.d_in, generator=g)
        n_out = case.classes + 3 if case.tie_head else case.classes
        if case.loss == "ce":
            y = torch.randint(0, n_out, (b, t), generator=g)
        else:
            y = torch.randn(b, t, n_out, generator=g)
        out.append((x, y))
    return out


def build(case: Case):
    torch.manual_seed(case.seed)
    model = Net(case)
    params = list(model.parameters())
    data = batches(case)
    if case.warm_grads:  # every parameter starts with a gradient (later frozen ones keep it)
        x, y = data[0]
        out = model(x)
        loss = F.cross_entropy(out.flatten(0, -2), y.flatten()) if case.loss == "ce" else F.mse_loss(out, y)
        loss.backward()
    for i in case.frozen:
        params[i % len(params)].requires_grad_(False)
    return model, data


# A compiled value may be this many times further from the float64 value than eager float32 is.
EAGER_NOISE_FACTOR = 10


def run_case(case: Case, backend: str) -> Exception | None:
    """Train eager and compiled copies side by side; every step's outputs and state must agree.

    A step that eager PyTorch refuses must fail compiled too; then the eager error is returned.  On ORT a case
    trains at least 5 steps: each variant's first run is a checked one (fx's outputs), and SGD's first step with
    momentum, the first step with gradients present, and a loss scale that changes make variants of their own,
    so that 2 steps train on ORT's outputs (assert_ran_on_ort).
    """
    if backend == "ort" and case.steps < 5:
        case = dataclasses.replace(case, steps=5)
    eager, data = build(case)
    compiled = copy.deepcopy(eager)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        b.grad = None if a.grad is None else a.grad.clone()
    exact = copy.deepcopy(eager).double()  # the float64 twin
    for a, b in zip(eager.parameters(), exact.parameters()):  # (deepcopy of a Parameter leaves its .grad behind)
        b.grad = None if a.grad is None else a.grad.double()
    opt_e, opt_c, opt_x = (make_optimizer(case, m) for m in (eager, compiled, exact))
    fn = make_step(case)
    # on ORT the static choice (every segment ORT supports runs on ORT): the case fuzzes ORT's translations
    step = spmd_ort.compile(backend=backend, autotune=False if backend == "ort" else None)(fn)
    normwise = backend == "ort"
    x_e = x_c = x_x = None
    for i, (x, y) in enumerate(data):
        if case.input_grad and not case.tokens:
            if x_e is None:  # one input tensor per side for the whole run: its .grad accumulates
                x_e, x_c, x_x = x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()
            with torch.no_grad():
                x_e.copy_(x)
                x_c.copy_(x)
                x_x.copy_(x)
            xe, xc, xx = x_e, x_c, x_x
        else:
            xe, xc, xx = x, x, (x if case.tokens else x.double())
        scale = case.scales[i % len(case.scales)]
        torch.manual_seed(10 + i)  # dropout: the same masks on both sides
        try:
            out_e = fn(eager, opt_e, xe, y, scale, case.clip)
        except Exception as exc:  # noqa: BLE001 - a step eager refuses (e.g. nothing requires grad)
            with pytest.raises(Exception):  # must fail compiled too, not train silently
                step(compiled, opt_c, xc, y, scale, case.clip)
            return exc
        torch.manual_seed(10 + i)
        out_c = step(compiled, opt_c, xc, y, scale, case.clip)
        torch.manual_seed(10 + i)
        out_x = fn(exact, opt_x, xx, y if y.dtype == torch.int64 else y.double(), scale, case.clip)
        outs_e = out_e if isinstance(out_e, tuple) else (out_e,)
        outs_c = out_c if isinstance(out_c, tuple) else (out_c,)
        assert len(outs_e) == len(outs_c), f"step {i}: {len(outs_c)} outputs, eager {len(outs_e)}"
        try:
            for k, (a, b) in enumerate(zip(outs_c, outs_e)):
                _close(a, b.detach(), normwise, f"step {i} output {k}")
            assert_same_state(eager, compiled, opt_e, opt_c, where=f"step {i}", normwise=normwise)
            if xe is not x:
                assert (xc.grad is None) == (xe.grad is None), \
                    f"step {i}: x.grad {xc.grad is None} vs {xe.grad is None}"
                if xe.grad is not None:
                    _close(xc.grad, xe.grad, normwise, f"step {i} x.grad")
        except AssertionError as exc:
            outs_x = out_x if isinstance(out_x, tuple) else (out_x,)
            why = within_eager_rounding(values(compiled, opt_c, outs_c, xc), values(eager, opt_e, outs_e, xe),
                                        values(exact, opt_x, outs_x, xx))
            if why is not None:
                raise AssertionError(f"{exc}\n{why}") from None
    if backend == "ort":
        assert_ran_on_ort(step)
    return None


def values(model: nn.Module, opt, outs: tuple, x) -> dict[str, torch.Tensor]:
    """Everything a step is compared on, by name: outputs, parameters, gradients, buffers, optimizer state."""
    out = {f"output {k}": o.detach() for k, o in enumerate(outs) if isinstance(o, torch.Tensor)}
    for name, p in model.named_parameters():
        out[f"param {name}"] = p.detach()
        if p.grad is not None:
            out[f"grad {name}"] = p.grad
    out.update((f"buffer {name}", b) for name, b in model.named_buffers())
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names.get(id(p), str(k)) for k, p in enumerate(p for g in opt.param_groups for p in g["params"])]
    for k, state in opt.state_dict()["state"].items():  # (state_dict's keys: positions in param_groups' order)
        out.update((f"opt state {order[k]}.{key}", v) for key, v in state.items() if isinstance(v, torch.Tensor))
    if isinstance(x, torch.Tensor) and x.grad is not None:
        out["x.grad"] = x.grad
    return out


# A gradient element this far below its tensor's largest, in float64, is analytically zero (attention over a
# single key: the query's and key's weights get none, the softmax being constant): each float32 implementation
# gets its own rounding noise there, and Adam turns any noise into +-lr steps.
ANALYTIC_ZERO = 1e-11


def _analytic_zeros(exact: dict) -> dict[str, torch.Tensor]:
    """Per parameter name: the elements whose float64 gradient this step is analytically zero."""
    zeros = {}
    for key, g in exact.items():
        if key.startswith("grad ") and g.dtype.is_floating_point and g.numel():
            top = g.abs().max()
            if top > 0:
                zeros[key[len("grad "):]] = g.abs() <= ANALYTIC_ZERO * top
    return zeros


def _owner(name: str, zeros: dict) -> str | None:
    """The parameter a value of :func:`values` belongs to (its gradient, its optimizer state), if any."""
    for prefix in ("param ", "grad "):
        if name.startswith(prefix) and name[len(prefix):] in zeros:
            return name[len(prefix):]
    if name.startswith("opt state "):
        param = name[len("opt state "):].rsplit(".", 1)[0]
        return param if param in zeros else None
    return None


def within_eager_rounding(compiled: dict, eager: dict, exact: dict) -> str | None:
    """None if every compiled value is as close to the float64 value as :data:`EAGER_NOISE_FACTOR` times
    eager float32's own distance from it (or within the usual relative tolerance of it); else the first
    value that is not, with the three distances.  Elements of a parameter (and of its gradient and
    optimizer state) whose float64 gradient is analytically zero are left out (:data:`ANALYTIC_ZERO`)."""
    if compiled.keys() != eager.keys() or eager.keys() != exact.keys():
        return f"different values: {sorted(compiled.keys() ^ eager.keys())}"
    zeros = _analytic_zeros(exact)
    for name, x in exact.items():
        c, e = compiled[name].double(), eager[name].double()
        if not x.dtype.is_floating_point:
            if not (torch.equal(c, e) and torch.equal(e, x.double())):
                return f"{name}: integers differ"
            continue
        owner = _owner(name, zeros)
        if owner is not None and zeros[owner].shape == x.shape:
            keep = ~zeros[owner]
            c, e, x = c[keep], e[keep], x[keep]
        eager_err, compiled_err = (e - x).norm().item(), (c - x).norm().item()
        bound = max(RTOL * x.norm().item(), EAGER_NOISE_FACTOR * eager_err)
        if compiled_err > bound:
            return (f"{name}: compiled is {compiled_err:.3g} from the float64 value, eager float32 {eager_err:.3g} "
                    f"(bound {bound:.3g}): not eager's rounding error")
    return None


def _close(actual: torch.Tensor, expected: torch.Tensor, normwise: bool, msg: str) -> None:
    if actual.dim() == 0 or not actual.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=1e-6, msg=lambda m: f"{msg}: {m}")
    elif normwise:
        assert_close_normwise(actual, expected, atol=0.0, msg=msg)
    else:
        assert_close_relmax(actual, expected, msg=msg)
