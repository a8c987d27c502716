r"""Compact activations: what backward keeps besides the linear layers' inputs.

A transformer encoder saves more for backward than its linear inputs: the attention core (softmax
output, dropped probabilities, Q, K, V), the dropout masks (a float per element on CPU) and the
GELU inputs. Each has a leaner form, here as drop-in replacements that
:func:`sketchprop.patch_activations` puts into a model:

- **Dropout** (:class:`SeededDropout`, ``dropout="seeded"``): forward draws an 8-byte seed, makes
  the mask from it and saves only the seed; backward makes the same mask again. ``"packed"``
  (:class:`PackedDropout`) saves the mask at one bit per element instead, which spends 1/32 of a
  float mask to skip drawing it twice. Both are exact: forward and backward use one mask.
- **Attention** (:func:`recompute_attention`, ``attention="recompute"``): an attention function
  registered in transformers' ``AttentionInterface`` that recomputes the probabilities (and their
  dropout mask) in backward, as Megatron-LM's selective recomputation does (Korthikanti et al.
  2022). It saves the padding mask, a seed, and, in place of Q, K and V, the self-attention
  block's input, from which backward makes Q, K and V again with the projections' weights: one
  activation of the hidden size instead of three, for a second Q/K/V projection in backward
  (where a projection is not a linear layer, a peft LoRA layer for one, Q, K and V are kept).
  Exact. On CUDA it calls PyTorch's ``scaled_dot_product_attention``, whose memory-efficient and
  flash kernels already keep no probabilities (but keep Q, K and V).
- **GELU** (:class:`CompactGELU`, ``gelu_bits=b``): keeps a ``b``-bit code of GELU's derivative
  ``g(x) = Phi(x) + x phi(x)`` instead of its input (the authors' follow-up: Novikov et al.,
  "Few-bit backward", ICML 2023), packed at ``b`` bits per element; backward returns
  ``dY * level(code)``. Two codes (:class:`GeluCode`):

  - ``"stochastic"``: ``2^b`` equally spaced levels spanning the range of ``g``
    (``[g(-sqrt 2), g(sqrt 2)] = [-0.1289, 1.1289]``), ``g(x)`` rounded up or down at random
    with the probabilities that make ``E[level] = g(x)``: ``dX`` is unbiased (to 2^-17 of a
    level step: the dither has 16 bits).
  - ``"optimal"``: deterministic, the authors' kind: the ``2^b`` levels and their borders that
    minimise ``E (g(x) - level)^2`` for the distribution of the module's inputs (Lloyd-Max on
    ``g(x)``, fit on the first training batch the module sees). The authors fit borders on ``x``
    with uniform weight; thresholds on ``g`` itself are optimal among all ``b``-bit codes of
    ``x`` and need no ``bucketize``. Biased: ``E[dX] != dX``.

  Both are arithmetic on the derivative: the forward adds one fused ``gelu_backward`` and a few
  elementwise passes, never a gather. Bias and variance of ``dX`` against exact for ``b = 1..4``
  on real MiniLM activations: ``scripts/gelu_bits.py`` (``results/bench/gelu_bits.md``).

  **Default: 2-bit stochastic.** It is unbiased, as the sketched weight gradients are, so every
  gradient stays an unbiased estimate; its noise is small beside the sketch's. On MiniLM's CoLA
  activations (``results/bench/gelu_bits.md``) it adds a variance of 0.24 |dW|^2 to each
  encoder linear weight's gradient (0.17 after 300 training steps), 2-3% of what blocksrht's
  sketch adds at rho 0.1 (8.95 and 11.5, ``results/bench/importance_variance.md``), and no bias
  the measurement can see. The optimal 2-bit code has no variance but a bias of 0.04 |dW|^2 on
  every step, which steps do not average away. One bit would save another 1/32 of the float
  input (about 0.5% of exact's bytes for roberta-base at 16x128) for 10 to 40 times the
  variance (at step 0 more than the sketch's own); three bits cut the variance five- to six-fold
  for 50% more code bytes. In training (MiniLM on CoLA with blocksrht at rho 0.1, the CPU recipe)
  the deterministic 3-bit code scored +0.64 ± 0.37 above this default, paired over three seeds: no
  difference measured (``results/README.md``), so the smaller, unbiased code stays.

- **LayerNorm** (:class:`OutputLayerNorm`, ``layernorm="output"``): keeps its output ``y`` and
  the per-row ``1 / std`` instead of its input, and makes the normalised input again in backward,
  ``x^ = (y - beta) / gamma`` (Tempo, Andoorveedu et al. 2022; Approx-BP's shared normalisation
  memory). Where the output is kept anyway (a post-LN block's output is the next self-attention
  block's input, which ``attention="recompute"`` keeps, and exact linear layers keep their
  inputs), the input's bytes are saved; elsewhere the output takes the input's place, the same
  size. Columns whose ``|gamma| < 0.01 (1 + |beta|)`` (zero, or too small to divide by without
  losing float32 accuracy) keep their input columns instead; a half-precision input keeps the
  stored path (its output, in float32 under autocast, would be larger). Exact to float32
  rounding: the gradients are within 1e-5 (relative) of the stored path's.

**Seeds.** The dropout seeds (those of :class:`SeededDropout` and of the attention
probabilities) come from the global CPU generator, the stream ``nn.Dropout`` and
``torch.utils.checkpoint`` know: a checkpointed block's recomputed forward (reentrant or not)
restores that stream and draws the same seed, so it makes the same masks and the same activations
as the first forward. Nothing else draws from it: attention without dropout draws no seed, and
the GELU code's rounding has a stream of its own per module (seeded by ``torch.initial_seed()``,
the module's name and the distributed rank), so a reentrant checkpoint's first pass, which makes
no code, and its recomputation, which does, draw the same dropout seeds; with every dropout at 0
the patched model draws from the global generator exactly what the plain model draws (nothing).
A dropout with ``p > 0`` draws one 64-bit word per call where ``nn.Dropout`` draws per element,
so the stream after it differs from the plain model's. The seed is saved as a tensor (as
:mod:`sketchprop.functional` does): were the recomputation to draw another seed, backward would
still pair masks with the activations they made.

**Eval mode.** Dropout is off and :class:`CompactGELU` is the exact GELU (it keeps its input):
gradients taken in eval mode (saliency, say) are the plain model's, and deterministic.

**Masks.** A mask element is dropped when a 16-bit random integer falls among the lowest
``round(p 2^16)`` of its 2^16 values, so the drop probability is ``p`` rounded to a multiple of
2^-16 (``0.1 -> 0.100006``) and the kept elements are scaled by the inverse of the rounded keep
probability: the expectation is exact. Drawing 64-bit words and splitting each into four 16-bit draws spends a
quarter of the generator calls that ``bernoulli_`` does.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .functional import seed_tensor
from .layers import RandomizedLinear, _stable_seed

__all__ = [
    "ATTENTION",
    "ATTENTION_NAME",
    "DROPOUT",
    "GELU_CODES",
    "DEFAULT_GELU_BITS",
    "DEFAULT_GELU_CODE",
    "CompactGELU",
    "GeluCode",
    "LAYERNORM",
    "OutputLayerNorm",
    "PackedDropout",
    "SeededDropout",
    "gelu_derivative",
    "is_exact_gelu",
    "is_layernorm",
    "keep_mask",
    "pack_codes",
    "recompute_attention",
    "register_attention",
    "unpack_codes",
]

#: ``dropout=`` values: masks kept as floats (the model's own), regenerated from a seed, or packed.
DROPOUT = ("stored", "seeded", "packed")
#: ``attention=`` values.
ATTENTION = ("stored", "recompute")
#: ``layernorm=`` values: LayerNorm keeps its input (the model's own) or its output.
LAYERNORM = ("stored", "output")
#: ``gelu_code=`` values (see the module docstring).
GELU_CODES = ("stochastic", "optimal")
DEFAULT_GELU_BITS = 2  # why: the module docstring, "Default"
DEFAULT_GELU_CODE = "stochastic"

#: The name under which :func:`recompute_attention` is registered with transformers.
ATTENTION_NAME = "sketchprop_recompute"

# Range of GELU's derivative: its extremes are at x = -+sqrt(2), where g'(x) = phi(x) (2 - x^2) = 0.
_G_MAX = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2.0) * math.exp(-1.0) / math.sqrt(2 * math.pi)
_G_MIN = 1.0 - _G_MAX


# ---------------------------------------------------------------------------------------------
# Seeds, masks and bit packing.


def _draw_seed() -> Tensor:
    """A seed from the global CPU generator, as a 0-d int64 tensor (see the module docstring)."""
    return seed_tensor(int(torch.randint(0, 2**62, (), dtype=torch.int64)))


def _random_int16(n: int, seed: int, device) -> Tensor:
    """``n`` uniform 16-bit integers from ``seed``: 64-bit words, each split into four."""
    gen = torch.Generator(device=device).manual_seed(seed)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-n // 4),), dtype=torch.int64, device=device,
                          generator=gen)
    return words.view(torch.int16)[:n]


def _drop_threshold(p: float) -> tuple[int, float]:
    """``(threshold, scale)``: keep a 16-bit draw ``r`` when ``r >= threshold``; ``scale`` is the
    inverse keep probability, so that ``E[keep * scale] = 1`` exactly. (``p = 1`` drops everything
    before any draw; just below it, one draw in 2^16 is kept.)"""
    dropped = min(round(p * 65536), 65535)
    return dropped - 32768, 65536 / (65536 - dropped)


def keep_mask(shape, p: float, seed: int, device) -> Tensor:
    """The boolean keep mask of dropout probability ``p`` that ``seed`` makes (same seed, same
    mask, on one device)."""
    threshold, _ = _drop_threshold(p)
    n = math.prod(shape)
    return (_random_int16(n, seed, device) >= threshold).view(shape)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack ``codes`` (uint8 values below ``2^bits``, ``bits`` in 1..8) into ``bits`` bytes per
    eight codes, a flat uint8 tensor."""
    flat = codes.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, 8)
    out = torch.zeros(groups.shape[0], bits, dtype=torch.uint8, device=codes.device)
    for j in range(8):
        byte, shift = divmod(bits * j, 8)
        out[:, byte] |= groups[:, j] << shift  # uint8: bits shifted past 8 fall off here ...
        if shift + bits > 8:
            out[:, byte + 1] |= groups[:, j] >> (8 - shift)  # ... and land in the next byte
    return out.reshape(-1)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """The first ``n`` codes of :func:`pack_codes`, as a flat uint8 tensor."""
    groups = packed.view(-1, bits)
    out = torch.empty(groups.shape[0], 8, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    for j in range(8):
        byte, shift = divmod(bits * j, 8)
        value = groups[:, byte] >> shift
        if shift + bits > 8:
            value |= groups[:, byte + 1] << (8 - shift)
        out[:, j] = value & mask
    return out.view(-1)[:n]


# ---------------------------------------------------------------------------------------------
# Dropout.


class _SeededDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: Tensor) -> Tensor:
        _, scale = _drop_threshold(p)
        ctx.p, ctx.scale = p, scale
        ctx.save_for_backward(seed)
        return (x * keep_mask(x.shape, p, int(seed), x.device)).mul_(scale)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (seed,) = ctx.saved_tensors
        keep = keep_mask(dy.shape, ctx.p, int(seed), dy.device)
        return (dy * keep).mul_(ctx.scale), None, None


class _PackedDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: Tensor) -> Tensor:
        _, scale = _drop_threshold(p)
        keep = keep_mask(x.shape, p, int(seed), x.device)
        ctx.scale, ctx.shape = scale, x.shape
        ctx.save_for_backward(pack_codes(keep.view(torch.uint8), 1))
        return (x * keep).mul_(scale)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (packed,) = ctx.saved_tensors
        keep = unpack_codes(packed, 1, dy.numel()).view(torch.bool).view(ctx.shape)
        return (dy * keep).mul_(ctx.scale), None, None


class SeededDropout(nn.Dropout):
    """``nn.Dropout`` that saves an 8-byte seed for backward instead of its mask (exact: backward
    regenerates the forward's mask). Same ``p``, same train/eval behaviour."""

    _function = _SeededDropoutFunction

    @classmethod
    def from_dropout(cls, dropout: nn.Dropout) -> SeededDropout:
        new = cls(dropout.p, inplace=False)  # never in place: the input may be saved elsewhere
        new.train(dropout.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p == 1:
            return x * 0
        return self._function.apply(x, self.p, _draw_seed())


class PackedDropout(SeededDropout):
    """``nn.Dropout`` that saves its mask packed one bit per element (1/32 of a float mask; exact)."""

    _function = _PackedDropoutFunction


# ---------------------------------------------------------------------------------------------
# Attention.


def _softmax_dtype(q: Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)  # half precision softmax in float32


def _probabilities(q: Tensor, k: Tensor, mask: Tensor | None, scaling: float, p: float,
                   seed: int) -> tuple[Tensor, Tensor | None]:
    """Softmax probabilities (in float32 at least) and the dropout keep mask (None when
    ``p == 0``)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(_softmax_dtype(q)).mul_(scaling)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:
            scores += mask
    probs = torch.softmax(scores, dim=-1)
    keep = keep_mask(probs.shape, p, seed, probs.device) if p > 0 else None
    return probs, keep


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    """K or V with grouped heads (``num_key_value_heads`` of them) repeated to ``heads``, as
    transformers' ``repeat_kv`` does: key/value head ``j`` serves query heads ``j g .. j g + g - 1``."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(grad: Tensor, heads: int) -> Tensor:
    """The gradient of :func:`_repeat_heads`: each group of query heads summed into its head."""
    return grad if grad.shape[1] == heads else grad.unflatten(1, (heads, -1)).sum(2)


def _attend(q, k, v, mask, scaling: float, p: float, seed: int) -> Tensor:
    """``softmax(Q K^T * scaling + mask)``, dropped out, times ``V`` (K and V may have fewer,
    grouped heads)."""
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    probs, keep = _probabilities(q, k, mask, scaling, p, seed)
    if keep is not None:
        probs.mul_(keep).mul_(_drop_threshold(p)[1])
    return torch.matmul(probs.to(v.dtype), v)


def _attention_grads(dout, q, k, v, mask, scaling: float, p: float,
                     seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of :func:`_attend`, its probabilities and dropout mask made again."""
    kv_heads = k.shape[1]
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    probs, keep = _probabilities(q, k, mask, scaling, p, seed)
    dropped = probs
    dprobs = torch.matmul(dout, v.transpose(-1, -2)).to(probs.dtype)
    if keep is not None:
        scale = _drop_threshold(p)[1]
        dropped = (probs * keep).mul_(scale)
        dprobs.mul_(keep).mul_(scale)
    dv = torch.matmul(dropped.to(v.dtype).transpose(-1, -2), dout)
    # Softmax backward: dS = P * (dP - sum(dP * P)).
    dscores = (dprobs - (dprobs * probs).sum(-1, keepdim=True)).mul_(probs).mul_(scaling)
    dscores = dscores.to(q.dtype)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    return torch.matmul(dscores, k), _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


class _RecomputedAttention(torch.autograd.Function):
    """:func:`_attend` that saves Q, K, V, the mask and the dropout seed, and recomputes the
    probabilities in backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling: float, p: float, seed: Tensor):
        ctx.scaling, ctx.p = scaling, p
        ctx.save_for_backward(q, k, v, mask, seed)
        return _attend(q, k, v, mask, scaling, p, int(seed))

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, seed = ctx.saved_tensors
        return *_attention_grads(dout, q, k, v, mask, ctx.scaling, ctx.p, int(seed)), *[None] * 4


def _project(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
             head_dim: int) -> Tensor:
    """``F.linear(x, weight, bias)`` in ``dtype`` (autocast's casts, done by hand) as heads:
    ``(B, L, H * D) -> (B, H, L, D)``, what BERT's self-attention gives the attention function."""
    y = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return y.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


class _ProjectedAttention(torch.autograd.Function):
    """:func:`_attend` that saves the attention block's input ``x`` (and the projections' weights,
    which are parameters) in place of Q, K and V, and makes Q, K and V again in backward from
    ``x``: one activation of the hidden size kept instead of three. Its gradients are those of
    :class:`_RecomputedAttention`, bit for bit: the same ``F.linear`` gives the same Q, K, V."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling: float, p: float, seed: Tensor, x: Tensor,
                pairs: tuple):
        ctx.scaling, ctx.p, ctx.dtype, ctx.head_dim = scaling, p, q.dtype, q.shape[-1]
        # Detached views share storage and version counter: an in-place change to x or a weight
        # before backward still raises, and the meter counts x once with the linears' own copy.
        ctx.save_for_backward(mask, seed, x.detach(), *(None if t is None else t.detach()
                                                        for pair in pairs for t in pair))
        return _attend(q, k, v, mask, scaling, p, int(seed))

    @staticmethod
    def backward(ctx, dout):
        mask, seed, x, *weights = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            qkv = [_project(x, w, b, ctx.dtype, ctx.head_dim)
                   for w, b in zip(weights[0::2], weights[1::2], strict=True)]
        grads = _attention_grads(dout, *qkv, mask, ctx.scaling, ctx.p, int(seed))
        return *grads, *[None] * 6


#: Where :func:`recompute_attention` notes whether a module's Q, K, V check out. (The module's
#: input, which changes with every call, travels per call and per thread: :data:`_calls`.)
_CHECKED = "_sketchprop_qkv_checked"
_PROJECTIONS = ("query", "key", "value")
# A call with any of these set projects something else than its own input (a cache, an encoder).
_OTHER_SOURCES = ("cache", "past_key_values", "past_key_value", "encoder_hidden_states")


def has_projections(module: nn.Module) -> bool:
    """Whether ``module`` is a BERT-style self-attention: ``query``, ``key`` and ``value``
    submodules applied to its first argument."""
    return all(isinstance(getattr(module, n, None), nn.Module) for n in _PROJECTIONS)


# Per thread: {id(module): [input of each self-attention call in progress, innermost last]}.
# A call's input is per call, never module state: two threads, or a module called again inside
# its own call, each see their own.
_calls = threading.local()


def _inputs() -> dict[int, list]:
    inputs = getattr(_calls, "inputs", None)
    if inputs is None:
        inputs = _calls.inputs = {}
    return inputs


def keep_attention_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on a self-attention module: keep a reference to the call's input (no
    copy), for this call and thread only, for :func:`recompute_attention` to save in place of
    Q, K and V."""
    x = args[0] if args else kwargs.get("hidden_states")
    own = isinstance(x, Tensor) and all(kwargs.get(k) is None for k in _OTHER_SOURCES)
    _inputs().setdefault(id(module), []).append(x if own else None)


def drop_attention_input(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    """Forward hook (also on an exception): forget what :func:`keep_attention_input` kept."""
    inputs = _inputs()
    stack = inputs.get(id(module))
    if stack:
        stack.pop()
        if not stack:
            del inputs[id(module)]


def _attention_input(module: nn.Module) -> Tensor | None:
    stack = _inputs().get(id(module))
    return stack[-1] if stack else None


def forget_attention_check(module: nn.Module) -> None:
    """Drop what :func:`recompute_attention` noted on ``module`` (its Q, K, V check)."""
    module.__dict__.pop(_CHECKED, None)


def forward_hooks_on(modules) -> bool:
    """Whether a forward hook or pre-hook may act on any of ``modules`` in this call: one of their
    own, or a global one."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks) or any(
        m._forward_pre_hooks or m._forward_hooks for m in modules)


def _hooked(module: nn.Module) -> bool:
    """Whether hooks may change what reaches or leaves the projections in this call: a forward
    hook on a projection, a global forward hook, or a pre-hook on ``module`` besides
    :func:`keep_attention_input` (one added after it sees, and may change, the input after it
    was kept)."""
    return len(module._forward_pre_hooks) > 1 or forward_hooks_on(
        getattr(module, n) for n in _PROJECTIONS)


def _linear_weights(module) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` such that ``module(x) == F.linear(x, weight, bias)``: nn.Linear and
    :class:`~sketchprop.layers.RandomizedLinear` (whose forward is that ``F.linear``); None for
    anything else (peft's LoRA layers, subclasses with a forward of their own)."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if isinstance(module, RandomizedLinear):
        return (module.weight.T if module.fan_in_fan_out else module.weight), module.bias
    return None


def _projection_weights(module: nn.Module, query: Tensor, key: Tensor,
                        value: Tensor) -> tuple[Tensor, tuple] | None:
    """The attention block's input and its Q, K, V projections' ``(weight, bias)`` pairs when Q,
    K and V can be made again from them, else None. The first call on a module checks that they
    give the very Q, K, V the model passed (one extra projection, once), and so does every call
    while hooks may change them (:func:`_hooked`); a module that fails the check keeps Q, K and V
    from then on, with a warning."""
    x = _attention_input(module)
    pairs = [_linear_weights(getattr(module, n, None)) for n in _PROJECTIONS]
    if x is None or None in pairs or x.shape[:-1] != (query.shape[0], query.shape[2]) \
            or key.shape[2] != query.shape[2] or module.__dict__.get(_CHECKED) is False:
        return None
    if _CHECKED not in module.__dict__ or _hooked(module):
        with torch.no_grad():
            same = all(torch.equal(_project(x, w, b, t.dtype, t.shape[-1]), t)
                       for (w, b), t in zip(pairs, (query, key, value), strict=True))
        module.__dict__[_CHECKED] = same
        if not same:
            warnings.warn(f"{type(module).__name__}'s Q, K, V are not its projections of its "
                          "input; recompute_attention keeps Q, K and V for this module",
                          stacklevel=3)
            return None
    return x, tuple(pairs)


def recompute_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                        attention_mask: Tensor | None, scaling: float | None = None,
                        dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """An attention function for transformers' ``AttentionInterface`` (same signature as its
    ``eager_attention_forward``) that keeps no probabilities for backward.

    On CUDA it is PyTorch's ``scaled_dot_product_attention`` (through transformers'
    ``sdpa_attention_forward``), whose efficient kernels recompute the probabilities themselves;
    elsewhere :class:`_RecomputedAttention` (SDPA too when there is neither a gradient to keep
    anything for nor a dropout mask to draw). ``attention_mask`` is the boolean mask
    of the mask function registered beside it (True: attend), or None without padding; an additive
    float mask works too. Returns ``(output (B, L, H, D), None)``: attention weights are not
    materialised, except when the model asks for them (``output_attentions=True``): then the
    probabilities are computed as eager attention does, returned and kept for backward.
    """
    if query.shape[1] % key.shape[1] or value.shape[1] != key.shape[1]:
        raise ValueError("recompute_attention needs the query heads to be a multiple of the "
                         f"key/value heads, got {query.shape[1]} and {key.shape[1]}/{value.shape[1]}")
    # It computes plain softmax attention: a soft cap on the scores or attention sinks would be
    # left out, silently (patch_activations refuses such models before it changes them).
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"recompute_attention does not support {name}; pass attention='stored'")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    # A forward without grad but with dropout (a reentrant checkpoint's first pass) draws its
    # masks as the recomputation will: through the Function, not SDPA's own generator.
    weights = kwargs.get("output_attentions")
    if not weights and (query.device.type == "cuda" or not (needs_grad or dropout > 0)):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    autocast = torch.is_autocast_enabled(query.device.type)
    if autocast:  # compute in the dtype autocast gives the projections' matmuls, as eager does
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if weights:
        return _attention_with_weights(query, key, value, attention_mask, scaling, dropout)
    projected = _projection_weights(module, query, key, value) if needs_grad else None
    # No dropout, no seed: the global stream stays as the plain model leaves it.
    seed = _draw_seed() if dropout > 0 else seed_tensor(0)
    with torch.autocast(query.device.type, enabled=False):
        args = (query, key, value, attention_mask, float(scaling), float(dropout), seed)
        if projected is None:
            out = _RecomputedAttention.apply(*args)
        else:
            out = _ProjectedAttention.apply(*args, *projected)
    return out.transpose(1, 2).contiguous(), None


def _attention_with_weights(q, k, v, mask, scaling: float, p: float) -> tuple[Tensor, Tensor]:
    """Attention by autograd that returns its (dropped) probabilities in ``q``'s dtype, as
    transformers' eager attention does: for ``output_attentions=True``."""
    seed = int(_draw_seed()) if p > 0 else 0
    with torch.autocast(q.device.type, enabled=False):
        probs, keep = _probabilities(q, k, mask, float(scaling), p, seed)
        if keep is not None:
            probs = probs * keep * _drop_threshold(p)[1]
        out = torch.matmul(probs.to(v.dtype), v)
    return out.transpose(1, 2).contiguous(), probs.to(q.dtype)


def _recompute_attention_mask(*args, **kwargs):
    """transformers' boolean SDPA mask, never skipped for a causal pattern (the attention function
    reads only the mask, never ``is_causal``); None for full attention without padding."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention() -> str:
    """Register :func:`recompute_attention` in transformers' ``AttentionInterface`` and its mask
    function in ``AttentionMaskInterface`` (without the latter the model builds no mask for it and
    padding is attended); returns the name. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, recompute_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _recompute_attention_mask)
    return ATTENTION_NAME


# ---------------------------------------------------------------------------------------------
# GELU.


def gelu_derivative(x: Tensor, approximate: str = "none") -> Tensor:
    """``GELU'(x) = Phi(x) + x phi(x)`` in float32 (or, with ``approximate="tanh"``, the tanh
    form's derivative), by the fused kernel of GELU's own backward."""
    x = x.float()
    return torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate=approximate)


@dataclass(frozen=True)
class GeluCode:
    """A ``bits``-bit code of GELU's derivative: ``levels`` (``2^bits`` increasing values) and, for
    a deterministic code, the ``thresholds`` between them (a value above ``thresholds[i]`` gets a
    code above ``i``). A stochastic code has equally spaced levels and no thresholds: values are
    rounded to a neighbouring level at random, without bias."""

    bits: int
    levels: tuple[float, ...]
    thresholds: tuple[float, ...] | None = None

    @property
    def stochastic(self) -> bool:
        return self.thresholds is None

    @classmethod
    def uniform(cls, bits: int) -> GeluCode:
        """The stochastic code: ``2^bits`` levels from ``g``'s minimum to its maximum."""
        n = 2**bits
        step = (_G_MAX - _G_MIN) / (n - 1)
        return cls(bits, tuple(_G_MIN + i * step for i in range(n)))

    @classmethod
    def fit(cls, x: Tensor, bits: int, iters: int = 100, derivative=None) -> GeluCode:
        """The deterministic code minimising ``mean (g(x) - level)^2`` over the sample ``x``
        (Lloyd-Max: thresholds midway between levels, each level the mean of its cell); ``g`` is
        ``derivative`` (default :func:`gelu_derivative`)."""
        x = x.detach().reshape(-1)
        x = x[:: max(1, x.numel() // 2**20)]  # a strided sample of at most ~2^21 values
        g = (derivative or gelu_derivative)(x).double().sort().values.cpu()
        n = 2**bits
        levels = torch.quantile(g, (torch.arange(n, dtype=torch.float64) + 0.5) / n)
        sums = torch.cat([g.new_zeros(1), g.cumsum(0)])
        for _ in range(iters):
            thresholds = (levels[1:] + levels[:-1]) / 2
            edges = torch.cat([g.new_zeros(1, dtype=torch.long),
                               torch.searchsorted(g, thresholds, right=True),
                               g.new_full((1,), g.numel(), dtype=torch.long)])
            counts = edges[1:] - edges[:-1]
            means = (sums[edges[1:]] - sums[edges[:-1]]) / counts.clamp(min=1)
            new = torch.where(counts > 0, means, levels)  # an empty cell keeps its level
            if torch.equal(new, levels):
                break
            levels = new
        thresholds = (levels[1:] + levels[:-1]) / 2
        return cls(bits, tuple(levels.tolist()), tuple(thresholds.tolist()))

    def encode(self, g: Tensor, seed: int | None = None) -> Tensor:
        """Codes (uint8, the shape of ``g``) of the float32 derivative values ``g`` (consumed).
        A stochastic code rounds with the dither ``seed`` makes (None: one drawn from the global
        generator)."""
        top = 2**self.bits - 1
        if self.stochastic:
            lo, step = self.levels[0], self.levels[1] - self.levels[0]
            if seed is None:
                seed = int(_draw_seed())
            # code = floor((g - lo) / step + u), u = (r + 2^15 + 1/2) / 2^16 for a 16-bit r.
            dither = _random_int16(g.numel(), seed, g.device).view(g.shape)
            v = g.mul_(1 / step).add_(32768.5 / 65536 - lo / step).add_(dither, alpha=1 / 65536)
            return v.clamp_(0, top).to(torch.uint8)  # truncation is floor for v >= 0
        code = torch.zeros(g.shape, dtype=torch.uint8, device=g.device)
        for t in self.thresholds:
            code += g > t
        return code

    def decode(self, code: Tensor) -> Tensor:
        """The level (float32) of each code."""
        if self.stochastic:
            lo, step = self.levels[0], self.levels[1] - self.levels[0]
            return code.float().mul_(step).add_(lo)
        out = torch.full(code.shape, self.levels[0], dtype=torch.float32, device=code.device)
        for i in range(1, len(self.levels)):
            out += (code >= i) * (self.levels[i] - self.levels[i - 1])
        return out


class _CompactGeluFunction(torch.autograd.Function):
    """GELU of the form ``approximate`` (``"none"``: erf, ``"tanh"``), saving only the packed
    codes of its derivative."""

    @staticmethod
    def forward(ctx, x: Tensor, code: GeluCode, seed: int | None = None,
                approximate: str = "none") -> Tensor:
        codes = code.encode(gelu_derivative(x, approximate), seed)
        ctx.code, ctx.shape = code, x.shape
        ctx.save_for_backward(pack_codes(codes, code.bits))
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (packed,) = ctx.saved_tensors
        codes = unpack_codes(packed, ctx.code.bits, dy.numel()).view(ctx.shape)
        return (dy * ctx.code.decode(codes)).to(dy.dtype), None, None, None


class CompactGELU(nn.Module):
    """Exact GELU forward; backward from a ``bits``-bit code of its derivative (module docstring).

    ``code``: ``"stochastic"`` (unbiased) or ``"optimal"`` (deterministic, fit by
    :meth:`GeluCode.fit` on the first training batch this module sees; ``fitted`` holds it).
    ``name`` (the module's qualified name) seeds the stochastic code's rounding stream, with
    ``torch.initial_seed()`` and the distributed rank; the global generator is never drawn from
    (module docstring, "Seeds"). In eval mode the module is the exact GELU.
    """

    approximate = "none"  # GELU's form, as F.gelu's keyword; the tanh form's subclass sets "tanh"

    def __init__(self, bits: int = DEFAULT_GELU_BITS, code: str = DEFAULT_GELU_CODE,
                 name: str = ""):
        super().__init__()
        if not (isinstance(bits, int) and 1 <= bits <= 8):
            raise ValueError(f"gelu_bits must be an integer in 1..8 or None, got {bits!r}")
        if code not in GELU_CODES:
            raise ValueError(f"unknown gelu_code {code!r}; choose one of {list(GELU_CODES)}")
        self.bits, self.code, self.name = bits, code, name
        self.fitted: GeluCode | None = GeluCode.uniform(bits) if code == "stochastic" else None
        self._gen: torch.Generator | None = None

    def extra_repr(self) -> str:
        return f"bits={self.bits}, code={self.code}"

    def _next_seed(self) -> int:
        if self._gen is None:
            rank = 0
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                rank = torch.distributed.get_rank()  # each rank rounds with its own dither
            self._gen = torch.Generator().manual_seed(
                _stable_seed("gelu", torch.initial_seed(), self.name, rank))
        return int(torch.randint(0, 2**62, (), generator=self._gen))

    def forward(self, x: Tensor) -> Tensor:
        form = self.approximate
        if not (self.training and torch.is_grad_enabled() and x.requires_grad):
            return F.gelu(x, approximate=form)  # eval mode: exact (and deterministic) gradients
        if self.fitted is None:
            self.fitted = GeluCode.fit(x, self.bits, derivative=partial(gelu_derivative,
                                                                        approximate=form))
        seed = self._next_seed() if self.fitted.stochastic else None
        return _CompactGeluFunction.apply(x, self.fitted, seed, form)


def is_exact_gelu(module: nn.Module) -> bool:
    """Whether ``module`` computes the exact (erf) GELU: ``nn.GELU()`` or transformers'
    ``GELUActivation`` (``hidden_act="gelu"``), the activations :class:`CompactGELU` replaces."""
    if type(module) is nn.GELU:
        return module.approximate == "none"
    try:
        from transformers.activations import GELUActivation
    except ImportError:  # pragma: no cover
        return False
    return type(module) is GELUActivation


# ---------------------------------------------------------------------------------------------
# LayerNorm.

# A column whose |gamma| is below this times (1 + |beta|) keeps its input: dividing by it would
# lose float32 accuracy (the error of x^ grows as |beta| / |gamma| times float32's epsilon).
_GAMMA_FLOOR = 1e-2


class _OutputLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dimension of a 2-D ``x`` that saves its output, ``1 / std`` per row
    and the input columns listed in ``kept`` (with the row means), not the input."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, kept: Tensor | None):
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        cols = None if kept is None else x.index_select(-1, kept)
        ctx.save_for_backward(y, rstd, weight, bias, kept, cols, None if kept is None else mean)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd, weight, bias, kept, cols, mean = ctx.saved_tensors
        if weight is None:
            xhat = y if bias is None else y - bias
        else:  # (y - beta) / gamma as y / gamma - beta / gamma: one new tensor, two passes
            inverse = weight.reciprocal()
            xhat = y * inverse
            if bias is not None:
                xhat.sub_(bias * inverse)
        if kept is not None:
            xhat.index_copy_(-1, kept, (cols - mean).mul_(rstd))
        need = ctx.needs_input_grad
        # The native backward given x^ with mean 0 and 1 / std = 1 returns dX / rstd.
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy, xhat, (y.shape[-1],), torch.zeros_like(rstd), torch.ones_like(rstd), weight, bias,
            [need[0], need[1] and weight is not None, need[2] and bias is not None])
        return None if dx is None else dx.mul_(rstd), dw, db, None, None


class OutputLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose backward works from its output and per-row statistics (module
    docstring, "LayerNorm"); same Parameters, same forward. Made by :meth:`from_layernorm`."""

    @classmethod
    def from_layernorm(cls, norm: nn.LayerNorm) -> OutputLayerNorm:
        new = cls(norm.normalized_shape, eps=norm.eps, elementwise_affine=False, device="meta")
        new.elementwise_affine = norm.elementwise_affine
        new.weight, new.bias = norm.weight, norm.bias
        new.train(norm.training)
        return new

    def _kept_columns(self) -> Tensor | None:
        """Indices of the columns that keep their input (None: none), computed again only when
        ``gamma`` or ``beta`` changed (one host sync per optimizer step)."""
        weight, bias = self.weight, self.bias
        if weight is None:
            return None
        key = (weight.data_ptr(), weight._version, None if bias is None else
               (bias.data_ptr(), bias._version))
        cached = self.__dict__.get("_kept")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                floor = _GAMMA_FLOOR * (1 + (0 if bias is None else bias.abs()))
                kept = (weight.abs() < floor).reshape(-1).nonzero().squeeze(1)
            cached = self.__dict__["_kept"] = (key, kept if kept.numel() else None)
        return cached[1]

    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and (x.requires_grad or any(
                p is not None and p.requires_grad for p in (self.weight, self.bias)))) \
                or x.dtype not in (torch.float32, torch.float64):
            return super().forward(x)
        n = math.prod(self.normalized_shape)
        weight = None if self.weight is None else self.weight.reshape(n).to(x.dtype)
        bias = None if self.bias is None else self.bias.reshape(n).to(x.dtype)
        kept = self._kept_columns()
        # Autocast computes a float32 LayerNorm in float32: the Function runs without it.
        with torch.autocast(x.device.type, enabled=False):
            y = _OutputLayerNormFunction.apply(x.reshape(-1, n), weight, bias, self.eps, kept)
        return y.view(x.shape)


def is_layernorm(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.LayerNorm`` (that type, not a subclass), which
    :class:`OutputLayerNorm` replaces."""
    return type(module) is nn.LayerNorm
