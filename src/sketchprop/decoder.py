r"""Compact activations for decoder language models (Llama, Mistral, Qwen, GPT-2 and their kin).

A decoder fine-tuned with LoRA saves for backward mostly what its elementwise code keeps: the
SiLU-gated MLP keeps SiLU's input, its output and both factors of the product; an RMSNorm written
as Python ops keeps its input, its float32 normalised input and the product; the loss keeps the
log-probabilities of every token over the whole vocabulary. The parts here keep only what an exact
backward needs; :func:`sketchprop.patch_activations` applies each part the model has.

- **Gated MLP** (``mlp="recompute"``, :func:`gated_mlp_forward`): ``down(silu(gate(x)) * up(x))``
  keeps the gate and up projections' outputs and makes ``silu`` and the product again in backward
  (:class:`SiluProduct`); where ``down`` is a trainable ``nn.Linear``, its input (that product) is
  made again too, for its weight gradient (:class:`GatedDown`). Exact: backward uses PyTorch's own
  ``silu_backward``. ``mlp="input"`` (:func:`gated_mlp_input_forward`) keeps the MLP's input only
  and computes the gate and up projections again in backward, from the weights forward used
  (``nn.Linear``, ``RandomizedLinear``, peft LoRA layers of those without LoRA dropout, adapters on
  and not merged; taken in forward, so adapters switched or disabled before backward do not
  matter, and a weight changed in place raises; checked bit for bit on the first call and on
  every call while hooks are on the projections; any other MLP keeps the gate and up outputs):
  one activation of the hidden size instead of two of the MLP's width, for two more matmuls per
  MLP. Exact. ``mlp="auto"`` (the default, :func:`gated_mlp_auto_forward`) takes ``"input"`` where the
  gate and up weights are frozen (LoRA) and ``"recompute"`` where they train. Why, measured on a
  Llama shape (hidden 768, MLP 2048, GQA 12/4, 4x256 tokens, CPU): with LoRA + sketch + compact,
  ``"input"`` keeps 0.28x exact's saved bytes against 0.47x, and its step takes 0.99x exact's
  time against 0.86x; fully fine-tuned, where the two more matmuls come on top of the weight
  gradients' own, compact's step took 1.24x exact's with ``"input"`` against 1.06x.
- **RMSNorm** (``rmsnorm="compact"``, :class:`RMSNormFunction`): keeps its input and one float32
  statistic per row (``1 / rms``); backward makes the normalised input again. Exact. Applied to
  modules named ``*RMSNorm`` that compute ``weight * (x / rms(x))`` (checked on a random input
  and weight before anything changes; Gemma's ``(1 + weight)`` form is left as it is).
- **Language-model loss** (``lm_loss="chunked"``, :func:`chunked_lm_loss`): the cross-entropy of a
  causal LM computed by chunks of tokens, whose logits are made again in backward, so the
  ``(tokens, vocabulary)`` logits never exist at once and backward keeps only the final hidden
  states and one float32 log-sum-exp per token, as Liger-Kernel's fused linear cross-entropy and
  Apple's Cut Cross-Entropy do. Exact. Patched in, it replaces the causal LM's forward while the
  model trains with labels (the loss of ``model(**batch)`` is this one, and ``logits`` is None,
  as with Liger's patches); without labels, without gradients or in eval mode the forward is the
  model's own and returns logits.
- **GELU, tanh form** (``gelu_bits=b``, :class:`CompactTanhGELU`): GPT-2's ``gelu_new`` (and
  ``gelu_pytorch_tanh``, ``nn.GELU(approximate="tanh")``) with a ``b``-bit code of its own
  derivative, as :class:`~sketchprop.activations.CompactGELU` does for the erf form; the
  stochastic code spans the tanh form's derivative range, so it stays unbiased.

Attention (grouped K/V heads, rotary embeddings) goes through
:func:`~sketchprop.activations.recompute_attention`, which keeps the rotated Q and K and the
unrepeated K/V heads (``num_key_value_heads`` of them) and recomputes the probabilities.
"""

from __future__ import annotations

import inspect
import math
import re
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .activations import (
    DEFAULT_GELU_BITS,
    DEFAULT_GELU_CODE,
    CompactGELU,
    GeluCode,
    _linear_weights,
    forward_hooks_on,
    gelu_derivative,
)

__all__ = [
    "CompactTanhGELU",
    "GatedDown",
    "GatedFromInput",
    "RMSNormFunction",
    "SiluProduct",
    "chunked_lm_loss",
    "frozen_projections",
    "gated_mlp_auto_forward",
    "gated_mlp_forward",
    "gated_mlp_input_forward",
    "gelu_tanh_derivative",
    "is_gated_mlp",
    "keeps_input",
    "is_rms_norm",
    "is_tanh_gelu",
    "LMLossForward",
    "lm_loss_refusal",
    "rms_norm_forward",
]


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast gives a matmul on ``x``'s device, or None when autocast is off."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


# ---------------------------------------------------------------------------------------------
# GELU, tanh form.


def gelu_tanh_derivative(x: Tensor) -> Tensor:
    """The derivative of ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` in float32, by the
    fused kernel of its own backward."""
    return gelu_derivative(x, approximate="tanh")


def _tanh_derivative_range() -> tuple[float, float]:
    """Minimum and maximum of the tanh form's derivative (a dense float64 grid around its two
    extremes, widened by 2^-20 so that float32 values stay inside)."""
    x = torch.linspace(-4, 4, 800001, dtype=torch.float64)
    c = math.sqrt(2 / math.pi)
    t = torch.tanh(c * (x + 0.044715 * x**3))
    g = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    return float(g.min()) - 2**-20, float(g.max()) + 2**-20


_TANH_G_MIN, _TANH_G_MAX = _tanh_derivative_range()


class CompactTanhGELU(CompactGELU):
    """GELU's tanh form (``F.gelu(x, approximate="tanh")``) with backward from a ``bits``-bit code
    of its own derivative: the stochastic code's ``2^bits`` levels span that derivative's range
    (unbiased), the optimal code is fit on it (deterministic, biased)."""

    approximate = "tanh"

    def __init__(self, bits: int = DEFAULT_GELU_BITS, code: str = DEFAULT_GELU_CODE,
                 name: str = ""):
        super().__init__(bits, code, name)
        if code == "stochastic":
            step = (_TANH_G_MAX - _TANH_G_MIN) / (2**bits - 1)
            self.fitted = GeluCode(bits, tuple(_TANH_G_MIN + i * step for i in range(2**bits)))


def is_tanh_gelu(module: nn.Module) -> bool:
    """Whether ``module`` computes GELU's tanh form: ``nn.GELU(approximate="tanh")`` or
    transformers' ``NewGELUActivation`` (``gelu_new``, GPT-2's) or ``GELUTanh``
    (``gelu_pytorch_tanh``)."""
    if type(module) is nn.GELU:
        return module.approximate == "tanh"
    try:
        from transformers import activations as hf
    except ImportError:  # pragma: no cover
        return False
    kinds = [getattr(hf, n, None) for n in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh")]
    return type(module) in [k for k in kinds if k is not None]


# ---------------------------------------------------------------------------------------------
# The SiLU-gated MLP.


class SiluProduct(torch.autograd.Function):
    """``silu(g) * u``, keeping ``g`` and ``u`` (SiLU's output and the product are made again in
    backward). Gradients are autograd's: the same ``silu_backward`` on the same values."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dy: Tensor):
        g, u = ctx.saved_tensors
        dg = torch.ops.aten.silu_backward(dy * u, g) if ctx.needs_input_grad[0] else None
        du = dy * F.silu(g) if ctx.needs_input_grad[1] else None
        return dg, du


class GatedDown(torch.autograd.Function):
    """``F.linear(silu(g) * u, weight, bias)``, keeping ``g``, ``u`` and the weight: the down
    projection's input is made again in backward for its weight gradient. Autocast's casts are
    done by hand (``dtype``: the matmul's dtype), so backward computes in the forward's dtypes."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, weight: Tensor, bias: Tensor | None,
                dtype: torch.dtype) -> Tensor:
        ctx.dtype = dtype
        ctx.save_for_backward(g, u, weight)
        ctx.has_bias = bias is not None
        with torch.autocast(g.device.type, enabled=False):
            h = (F.silu(g) * u).to(dtype)
            return F.linear(h, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, dy: Tensor):
        g, u, weight = ctx.saved_tensors
        s = F.silu(g)
        h = (s * u).to(ctx.dtype)
        dy = dy.to(ctx.dtype)
        dw = db = None
        if ctx.needs_input_grad[2]:
            dw = dy.reshape(-1, dy.shape[-1]).T.matmul(h.reshape(-1, h.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0).to(weight.dtype)
        dh = dy.matmul(weight.to(ctx.dtype)).to(g.dtype)
        dg = torch.ops.aten.silu_backward(dh * u, g) if ctx.needs_input_grad[0] else None
        du = dh * s if ctx.needs_input_grad[1] else None
        return dg, du, dw, db, None


_GATED = re.compile(r"self\.down_proj\(\s*self\.act_fn\(\s*self\.gate_proj\(\s*(\w+)\s*\)\s*\)"
                    r"\s*\*\s*self\.up_proj\(\s*\1\s*\)\s*\)")


def _is_silu(module) -> bool:
    if type(module) is nn.SiLU:
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover
        return False
    return type(module) is SiLUActivation


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a SiLU-gated MLP of Llama's form: ``gate_proj``, ``up_proj``,
    ``down_proj`` and a SiLU ``act_fn``, its forward ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))`` (read from its class's source)."""
    if not (all(isinstance(getattr(module, n, None), nn.Module)
                for n in ("gate_proj", "up_proj", "down_proj"))
            and _is_silu(getattr(module, "act_fn", None))):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return _GATED.search(source) is not None


_INPUT_CHECKED = "_sketchprop_projections_checked"


def _projection_plan(module: nn.Module) -> tuple | None:
    """How ``module(x)`` is computed, with the tensors it uses taken now: ``("linear", weight,
    bias)`` for an ``nn.Linear`` or a :class:`~sketchprop.layers.RandomizedLinear` (whose output is
    that ``F.linear``); ``("lora", base, adapters, cast)`` for a peft LoRA ``Linear`` built of those
    (plain LoRA, no dropout, adapters on and not merged), ``adapters`` its active ones as ``(A, B,
    scaling, A's dtype)``; None for anything else. Taken in forward, so that backward makes the
    output again as forward computed it, whatever the module's adapters are set to by then."""
    pair = _linear_weights(module)
    if pair is not None:
        return ("linear", *pair)
    names = ("base_layer", "lora_A", "lora_B", "lora_dropout", "scaling", "active_adapters")
    if not all(hasattr(module, n) for n in names) or getattr(module, "merged", True) \
            or getattr(module, "disable_adapters", True) or getattr(module, "lora_variant", None):
        return None
    base = _projection_plan(module.base_layer)
    if base is None:
        return None
    adapters = []
    for name in module.active_adapters:
        if name not in module.lora_A.keys():
            continue
        if type(module.lora_dropout[name]) is not nn.Identity:
            return None
        a, b = _projection_plan(module.lora_A[name]), _projection_plan(module.lora_B[name])
        if a is None or b is None:
            return None
        adapters.append((a, b, module.scaling[name], module.lora_A[name].weight.dtype))
    return ("lora", base, tuple(adapters), getattr(module, "cast_input_dtype_enabled", True))


def _plan_value(plan: tuple, x: Tensor) -> Tensor:
    """The output a :func:`_projection_plan` describes, for input ``x`` (peft's arithmetic)."""
    if plan[0] == "linear":
        return F.linear(x, plan[1], plan[2])
    _, base, adapters, cast = plan
    result = _plan_value(base, x)
    dtype = result.dtype
    for a, b, scaling, a_dtype in adapters:
        xa = x.to(a_dtype) if cast and x.dtype != a_dtype else x
        result = result + _plan_value(b, _plan_value(a, xa)) * scaling
    return result.to(dtype)


def _plan_tensors(plan: tuple) -> list[Tensor]:
    """The weights and biases a plan uses (kept by backward to catch a change made in place)."""
    if plan[0] == "linear":
        return [t for t in plan[1:] if t is not None]
    _, base, adapters, _ = plan
    return [*_plan_tensors(base), *(t for a, b, _, _ in adapters
                                    for t in (*_plan_tensors(a), *_plan_tensors(b)))]


class GatedFromInput(torch.autograd.Function):
    """``silu(g) * u`` for ``g = gate(x)``, ``u = up(x)``, keeping ``x`` only: backward computes
    ``g`` and ``u`` again from ``x`` by the plans taken in forward (:func:`_projection_plan`,
    under the forward's autocast). The plans' weights are saved too (no copy), so a change made
    to them in place between forward and backward raises, as it does for any saved tensor. The
    gradients reach ``gate`` and ``up`` through the graphs their own forward built."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, x: Tensor, plans: tuple,
                autocast: torch.dtype | None) -> Tensor:
        ctx.plans, ctx.autocast = plans, autocast
        ctx.save_for_backward(x.detach(), *(t for plan in plans for t in _plan_tensors(plan)))
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dy: Tensor):
        x = ctx.saved_tensors[0]  # unpacking checks that no saved weight changed in place
        with torch.no_grad(), torch.autocast(x.device.type, dtype=ctx.autocast or torch.bfloat16,
                                             enabled=ctx.autocast is not None):
            g, u = (_plan_value(plan, x) for plan in ctx.plans)
        dg = torch.ops.aten.silu_backward(dy * u, g) if ctx.needs_input_grad[0] else None
        du = dy * F.silu(g) if ctx.needs_input_grad[1] else None
        return dg, du, None, None, None


def _recomputable(mlp: nn.Module, x: Tensor, g: Tensor, u: Tensor, plans: tuple) -> bool:
    """Whether ``mlp``'s gate and up outputs are made again from ``x`` by ``plans``, bit for bit:
    checked on the first call (one extra projection) and on every call while hooks may change the
    outputs; a module that fails keeps g and u from then on, with a warning."""
    checked = mlp.__dict__.get(_INPUT_CHECKED)
    if checked is None or (checked and forward_hooks_on(
            m for proj in (mlp.gate_proj, mlp.up_proj) for m in proj.modules())):
        with torch.no_grad():
            checked = all(torch.equal(_plan_value(plan, x), t)
                          for plan, t in zip(plans, (g, u), strict=True))
        mlp.__dict__[_INPUT_CHECKED] = checked
        if not checked:
            warnings.warn(f"{type(mlp).__name__}'s gate and up outputs are not its projections of "
                          "its input; mlp='input' keeps them for this module", stacklevel=3)
    return checked


def keeps_input(mlp: nn.Module) -> bool:
    """Whether ``mlp="auto"`` keeps this gated MLP's input now: its gate and up weights frozen and
    both projections plain or LoRA linear layers that can be made again (no LoRA dropout, adapters
    on and not merged)."""
    return frozen_projections(mlp) and None not in (_projection_plan(mlp.gate_proj),
                                                    _projection_plan(mlp.up_proj))


def forget_mlp_check(module: nn.Module) -> None:
    module.__dict__.pop(_INPUT_CHECKED, None)


def gated_mlp_input_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward of ``mlp="input"``: the gated MLP keeps its input only, and backward computes
    the gate and up projections again (two more matmuls of the MLP's width per token); where they
    cannot be made again bit for bit, :func:`gated_mlp_forward`'s."""
    g, u = self.gate_proj(x), self.up_proj(x)
    if not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad)):
        return _gated_rest(self, g, u)
    plans = (_projection_plan(self.gate_proj), _projection_plan(self.up_proj))
    if None in plans or not _recomputable(self, x, g, u, plans):
        return _gated_rest(self, g, u)
    return self.down_proj(GatedFromInput.apply(g, u, x, plans, _autocast_dtype(x)))


def _gated_rest(self: nn.Module, g: Tensor, u: Tensor) -> Tensor:
    if not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad)):
        return self.down_proj(self.act_fn(g) * u)
    down = self.down_proj
    if type(down) is nn.Linear and down.weight.requires_grad:  # decided per call: patch_linear
        dtype = _autocast_dtype(g) or torch.promote_types(g.dtype, u.dtype)  # may swap it later
        return GatedDown.apply(g, u, down.weight, down.bias, dtype)
    return down(SiluProduct.apply(g, u))


def gated_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward :func:`~sketchprop.patch_activations` gives a SiLU-gated MLP (bound to it):
    the model's own arithmetic, keeping the gate and up outputs only (module docstring)."""
    return _gated_rest(self, self.gate_proj(x), self.up_proj(x))


def _full_weight(module: nn.Module) -> Tensor | None:
    """A projection's full-size weight: its own, or (peft adapters) its base layer's."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, Tensor) else None


def frozen_projections(mlp: nn.Module) -> bool:
    """Whether a gated MLP's gate and up projections' full-size weights are frozen (LoRA)."""
    weights = (_full_weight(mlp.gate_proj), _full_weight(mlp.up_proj))
    return all(w is not None and not w.requires_grad for w in weights)


def gated_mlp_auto_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward of ``mlp="auto"`` (the default): :func:`gated_mlp_input_forward`'s where the
    gate and up projections' full-size weights are frozen (LoRA), :func:`gated_mlp_forward`'s
    where they train. Decided on each call, so freezing before or after patching is the same."""
    if frozen_projections(self):
        return gated_mlp_input_forward(self, x)
    return gated_mlp_forward(self, x)


# ---------------------------------------------------------------------------------------------
# RMSNorm.


class RMSNormFunction(torch.autograd.Function):
    """Llama's RMSNorm, ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``, keeping
    ``x`` and the float32 ``rsqrt`` per row; backward makes the normalised input again."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, r = ctx.saved_tensors
        xf = x.to(torch.float32)
        dw = None
        if ctx.needs_input_grad[1]:
            n = (xf * r).to(x.dtype)
            dw = (dy * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dxhat = (dy * weight).to(x.dtype).to(torch.float32)
            # d/dx of x * r(x), r = (mean(x^2) + eps)^-1/2: dxhat * r - x r^3 mean(dxhat * x).
            dot = (dxhat * xf).mean(-1, keepdim=True)
            dx = (dxhat * r - xf * r.pow(3) * dot).to(x.dtype)
        return dx, dw, None


def _rms_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm of Llama's form: a class named ``*RMSNorm`` with a 1-D
    ``weight``, a float ``variance_epsilon`` (or ``eps``), no other parameters or submodules, whose
    output on a random input and a random weight is :class:`RMSNormFunction`'s (checked here,
    without changing the module)."""
    w = getattr(module, "weight", None)
    eps = _rms_eps(module)
    if not (type(module).__name__.endswith("RMSNorm") and isinstance(w, nn.Parameter)
            and w.dim() == 1 and eps is not None and len(list(module.parameters())) == 1
            and not list(module.children())):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g).to(w.device)
    weight = torch.randn(w.shape[0], generator=g).to(w.device)
    with torch.no_grad():
        try:
            got = torch.func.functional_call(module, {"weight": weight}, (x,))
        except Exception:  # a norm that cannot run on this input is not one we know
            return False
        return torch.equal(got, RMSNormFunction.apply(x, weight, eps))


def rms_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward :func:`~sketchprop.patch_activations` gives an RMSNorm (bound to it)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
        return type(self).forward(self, x)
    return RMSNormFunction.apply(x, self.weight, _rms_eps(self))


# ---------------------------------------------------------------------------------------------
# The language-model loss.


#: Logits per chunk of :func:`chunked_lm_loss` by default (64 MiB in float32): chunks of a few
#: rows would read the whole output weight once per chunk, which on a CPU costs more than the
#: matmuls (16-row chunks made a Llama-shaped step 3x slower).
CHUNK_LOGITS = 2**24


def _chunk_rows(rows: int, hidden: int, vocab: int, chunk_size: int | None) -> int:
    """Rows per chunk: ``chunk_size``, or as many as make :data:`CHUNK_LOGITS` logits, at least
    one."""
    if chunk_size is not None:
        return chunk_size
    return max(1, min(rows, CHUNK_LOGITS // vocab))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``-log softmax(h W^T + b)[target]``, by chunks of rows, times ``scale``;
    keeps ``h``, the weight and each row's log-sum-exp (float32)."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, scale: float,
                chunk: int, dtype: torch.dtype) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for i in range(0, h.shape[0], chunk):
                logits = F.linear(h[i:i + chunk].to(dtype), w, b).float()
                lse[i:i + chunk] = torch.logsumexp(logits, -1)
                picked = logits.gather(1, target[i:i + chunk, None])[:, 0]
                total += (lse[i:i + chunk] - picked).sum()
        ctx.save_for_backward(h, weight, bias, target, lse)
        ctx.scale, ctx.chunk, ctx.dtype = scale, chunk, dtype
        return total * scale

    @staticmethod
    def backward(ctx, dloss: Tensor):
        h, weight, bias, target, lse = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        b = None if bias is None else bias.to(ctx.dtype)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) \
            if want_b and bias is not None else None
        factor = dloss.float() * ctx.scale
        for i in range(0, h.shape[0], ctx.chunk):
            hc = h[i:i + ctx.chunk].to(ctx.dtype)
            logits = F.linear(hc, w, b).float()
            # d loss / d logits = softmax - one_hot(target), times the upstream factor.
            dlogits = logits.sub_(lse[i:i + ctx.chunk, None]).exp_()
            rows = torch.arange(dlogits.shape[0], device=h.device)
            dlogits[rows, target[i:i + ctx.chunk]] -= 1
            dlogits.mul_(factor)
            if db is not None:
                db += dlogits.sum(0)
            dlogits = dlogits.to(ctx.dtype)
            if dh is not None:
                dh[i:i + ctx.chunk] = dlogits.matmul(w).to(h.dtype)
            if dw is not None:
                dw += dlogits.T.matmul(hc).float()
        return (dh, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None)


def chunked_lm_loss(hidden_states: Tensor, weight: Tensor, labels: Tensor | None = None,
                    bias: Tensor | None = None, *, shift_labels: Tensor | None = None,
                    ignore_index: int = -100, num_items_in_batch: Tensor | int | None = None,
                    chunk_size: int | None = None) -> Tensor:
    """A causal LM's cross-entropy loss from its final hidden states and its output layer's
    ``weight`` (and ``bias``), never forming all the logits at once: exactly transformers'
    ``ForCausalLMLoss`` on ``F.linear(hidden_states, weight, bias)``.

    ``labels`` (``(batch, length)``, ``ignore_index`` where no loss) are shifted left by one, as
    transformers does (or pass ``shift_labels`` already shifted). The mean is over the tokens that
    have a label, or the sum divided by ``num_items_in_batch`` where given (gradient accumulation,
    as HF's Trainer passes it). Rows without a label are left out before any logit is computed.

    Tokens are taken by chunks of ``chunk_size`` rows (default: as many as make 2^24 logits, 64
    MiB in float32); backward computes each chunk's logits again from the
    hidden states it kept and the per-token log-sum-exp. Under autocast the logits are computed in
    autocast's dtype and the softmax in float32, as the unpatched model does.

    To use it without :func:`~sketchprop.patch_activations` (a peft or hand-written loop)::

        out = model.model(input_ids, attention_mask=mask)   # the decoder, without its head
        loss = chunked_lm_loss(out.last_hidden_state, model.lm_head.weight, labels)
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.shape != hidden_states.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(shift_labels.shape)} do not match hidden states "
                         f"of shape {tuple(hidden_states.shape)}")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shift_labels.reshape(-1).to(h.device)
    keep = (target != ignore_index).nonzero()[:, 0]
    h, target = h.index_select(0, keep), target.index_select(0, keep)
    if num_items_in_batch is None:
        scale = 1.0 / keep.numel() if keep.numel() else float("nan")
    else:
        scale = 1.0 / float(num_items_in_batch)
    dtype = _autocast_dtype(h) or torch.promote_types(h.dtype, weight.dtype)
    chunk = _chunk_rows(h.shape[0], h.shape[1], weight.shape[0], chunk_size)
    return _ChunkedCrossEntropy.apply(h, weight, bias, target, scale, chunk, dtype)


#: Config attributes that, set, make a model change its logits after the output layer.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                         "output_multiplier_scale")


def lm_loss_refusal(owner: nn.Module) -> str | None:
    """Why the chunked loss cannot replace ``owner``'s (a transformers model), or None when it
    can: a causal LM with transformers' standard loss, a plain ``nn.Linear`` output layer, and no
    change to its logits after that layer."""
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for n in ((v,) if isinstance(v, str) else v)}
    if type(owner).__name__ not in names:
        return f"{type(owner).__name__} is not a transformers causal LM"
    # transformers' own rule (PreTrainedModel.loss_function), without its warning.
    loss = owner.__dict__.get("_loss_function") or LOSS_MAPPING.get(
        getattr(owner, "loss_type", None), LOSS_MAPPING["ForCausalLM"])
    if loss is not LOSS_MAPPING["ForCausalLM"]:
        return f"{type(owner).__name__}'s loss is not transformers' ForCausalLM loss"
    if "labels" not in inspect.signature(type(owner).forward).parameters:
        return f"{type(owner).__name__}.forward takes no labels"
    head = owner.get_output_embeddings() if hasattr(owner, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"its output layer is {type(head).__name__}, not an nn.Linear"
    config = getattr(owner, "config", None)
    for name in _LOGIT_POSTPROCESSING:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"it changes its logits after the output layer (config.{name})"
    return None


_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


class LMLossForward:
    """A causal LM's forward that computes its training loss with :func:`chunked_lm_loss`: the
    model's own forward runs without labels while its output layer hands over its input (and
    returns an empty tensor), and the loss comes from that input. Without labels, without
    gradients, in eval mode, with ``return_dict=False`` or once the output layer is no longer an
    ``nn.Linear``, it is the model's own forward. Its signature is the model's (HF's Trainer reads
    it); a ``copy.deepcopy`` of the model calls its own copy."""

    def __init__(self, owner: nn.Module):
        self.owner = owner

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.owner).forward.__get__(self.owner))

    def __call__(self, *args, labels=None, **kwargs):
        owner = self.owner
        original = type(owner).forward.__get__(owner)
        head = owner.get_output_embeddings()
        if labels is None or not (owner.training and torch.is_grad_enabled()) \
                or kwargs.get("return_dict") is False or type(head) is not nn.Linear:
            return original(*args, labels=labels, **kwargs)
        seen = {}

        def capture(x):
            seen["hidden"] = x
            return x.new_empty(*x.shape[:-1], 0)

        head.forward = capture
        try:
            out = original(*args, **kwargs)
        finally:
            del head.forward
        loss = chunked_lm_loss(seen["hidden"], head.weight, labels, head.bias,
                               **{k: kwargs[k] for k in _LOSS_KWARGS if k in kwargs})
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        return type(out)(loss=loss, logits=None, **fields)


def override_forward(module: nn.Module, forward: Callable) -> None:
    """Give ``module`` its own ``forward`` (an instance attribute, as :func:`restore_forward` finds
    it): its type, parameters, submodules and state_dict stay as they are."""
    module.__dict__["forward"] = forward


def bound(fn: Callable, module: nn.Module) -> Callable:
    return types.MethodType(fn, module)


def restore_forward(module: nn.Module, forward: Callable) -> None:
    """Undo :func:`override_forward` where ``forward`` is still the module's own forward."""
    if module.__dict__.get("forward") is forward:
        del module.__dict__["forward"]
