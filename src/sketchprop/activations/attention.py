r"""Attention that keeps no probabilities for backward (``attention="recompute"``), and which
models it applies to.

**Attention** (:func:`recompute_attention`, ``attention="recompute"``): an attention function
registered in transformers' ``AttentionInterface`` that recomputes the probabilities (and their
dropout mask) in backward, as Megatron-LM's selective recomputation does (Korthikanti et al.
2022). It saves the padding mask, a seed, and, in place of Q, K and V, the self-attention
block's input, from which backward makes Q, K and V again with the projections' weights: one
activation of the hidden size instead of three, for a second Q/K/V projection in backward
(where a projection is not a linear layer, a peft LoRA layer for one, Q, K and V are kept).
Exact, bit for bit: on a padded batch backward projects only the rows it reads, and checks what it
made against fingerprints of forward's Q, K, V (:mod:`~sketchprop.activations.rows`; every row
again where they differ, and an error where those differ too, or, on a batch without padding,
where the first row's does: the block's Q, K, V are no longer the projections of its input found
on its first call). Which projections make Q, K and V is found by what they compute
(:func:`is_attention_block`), checked again each call on one row, and found again where candidates
match alike (equal weights at initialisation).
On CUDA it calls PyTorch's ``scaled_dot_product_attention``,
whose memory-efficient and flash kernels already keep no probabilities (but keep Q, K and V).

**Coded** (``attention="coded"``, the lean preset): the block's input is kept as its ``b``-bit
code, the one its LayerNorm filed or one made by :class:`CodeAttentionInput` (and shared with the
Q, K, V projections' codes: :mod:`sketchprop.codes`), and backward makes Q, K and V again from the
decoded input, only for the rows backward reads (not a padded batch's padding rows:
:func:`~sketchprop.activations.rows.needed_rows`). Not exact: the recomputed probabilities differ
from forward's, and the gradients of Q, K, V carry their error (a bias, as the softmax is not
linear); both measured by ``scripts/lean_check.py``. Coded, a Llama-style block (``q_proj``,
``k_proj``, ``v_proj`` and rotary ``position_embeddings``: :func:`has_rope_projections`) is made
again too: Q and K rotated with the call's ``cos, sin`` (saved, one pair shared by every layer),
checked bit for bit against forward's on the first call; a call with a cache that already held keys
keeps Q, K and V. On a CPU, coded attention runs PyTorch's fused kernels where they apply
(:func:`fused_cpu`): forward, and in backward forward again and backward; the same attention to
float rounding, in about a quarter of the unfused time at 512 tokens.

Attention (grouped K/V heads, rotary embeddings) goes through
:func:`recompute_attention`, which keeps the rotated Q and K and the
unrepeated K/V heads (``num_key_value_heads`` of them) and recomputes the probabilities.
"""

from __future__ import annotations

import threading
import warnings

import torch
from torch import Tensor, nn

from ..codes import SharedCode, code_of, make_code
from ..compiling import eager_island
from ..functional import first_order, seed_tensor
from ..rng import SeedStream
from .floor import offer
from .projections import forward_hooks_on
from .qkv import (
    _as_heads,  # noqa: F401  (the tests build Q, K, V by it)
    _find_slices,
    _linear_rows,  # noqa: F401
    _qkv,
    _spot_check,
    _versions,
    _with_weights,
    takes_rope,
)
from .rows import attendable, fingerprints, needed_rows, padded, same_rows
from .seeds import _draw_seed, _drop_threshold, keep_mask

#: ``attention=`` values.
ATTENTION = ("stored", "recompute", "coded")

#: The name under which :func:`recompute_attention` is registered with transformers.
ATTENTION_NAME = "sketchprop_recompute"


def _softmax_dtype(q: Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)  # half precision softmax in float32


def _probabilities(q: Tensor, k: Tensor, mask: Tensor | None, scaling: float, p: float,
                   seed: int, bias: Tensor | None = None, softcap: float | None = None
                   ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Softmax probabilities (in float32 at least) of ``Q K^T * scaling``, capped to
    ``softcap * tanh(. / softcap)`` where ``softcap`` is given (Gemma 2), plus ``bias``, masked;
    the dropout keep mask (None when ``p == 0``) and the cap's ``tanh`` (None without a cap)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(_softmax_dtype(q)).mul_(scaling)
    tanh = None
    if softcap is not None:  # in the order of transformers' eager attention: bit for bit
        tanh = scores.div_(softcap).tanh_()
        scores = tanh * softcap
    if bias is not None:  # an additive bias the model may learn (T5's relative position bias)
        scores += bias
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:
            scores += mask
    probs = torch.softmax(scores, dim=-1)
    keep = keep_mask(probs.shape, p, seed, probs.device) if p > 0 else None
    return probs, keep, tanh


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    """K or V with grouped heads (``num_key_value_heads`` of them) repeated to ``heads``, as
    transformers' ``repeat_kv`` does: key/value head ``j`` serves query heads ``j g .. j g + g - 1``."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(grad: Tensor, heads: int) -> Tensor:
    """The gradient of :func:`_repeat_heads`: each group of query heads summed into its head."""
    return grad if grad.shape[1] == heads else grad.unflatten(1, (heads, -1)).sum(2)


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """``grad`` summed over the dimensions that a tensor of ``shape`` was broadcast along."""
    lead = grad.dim() - len(shape)
    dims = [*range(lead), *(lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)]
    return (grad.sum(dims, keepdim=True) if dims else grad).reshape(shape)


def _attend(q, k, v, mask, scaling: float, p: float, seed: int,
            bias: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """``softmax(cap(Q K^T * scaling) + bias + mask)``, dropped out, times ``V`` (K and V may
    have fewer, grouped heads)."""
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    probs, keep, _ = _probabilities(q, k, mask, scaling, p, seed, bias, softcap)
    if keep is not None:
        probs.mul_(keep).mul_(_drop_threshold(p)[1])
    return torch.matmul(probs.to(v.dtype), v)


def _attention_grads(dout, q, k, v, mask, scaling: float, p: float, seed: int,
                     bias: Tensor | None = None, softcap: float | None = None
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """dQ, dK, dV and the bias's gradient (None without a bias that requires one) of
    :func:`_attend`, its probabilities and dropout mask made again."""
    kv_heads = k.shape[1]
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    probs, keep, tanh = _probabilities(q, k, mask, scaling, p, seed, bias, softcap)
    dropped = probs
    dprobs = torch.matmul(dout, v.transpose(-1, -2)).to(probs.dtype)
    if keep is not None:
        scale = _drop_threshold(p)[1]
        dropped = (probs * keep).mul_(scale)
        dprobs.mul_(keep).mul_(scale)
    dv = torch.matmul(dropped.to(v.dtype).transpose(-1, -2), dout)
    # Softmax backward: dS = P * (dP - sum(dP * P)), the bias's gradient (summed over what it
    # was broadcast along: T5's is one per head, shared by the batch).
    dscores = (dprobs - (dprobs * probs).sum(-1, keepdim=True)).mul_(probs)
    dbias = None
    if bias is not None and bias.requires_grad:  # (a copy: dscores is scaled in place next)
        dbias = _sum_to(dscores, bias.shape).to(bias.dtype, copy=True)
    if tanh is not None:  # through the cap, as autograd goes: * softcap, tanh's, / softcap
        dscores.mul_(softcap).mul_(1 - tanh * tanh).div_(softcap)
    dscores = dscores.mul_(scaling).to(q.dtype)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    return torch.matmul(dscores, k), _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads), dbias


# PyTorch's fused CPU attention kernels (flash attention for CPU, SDPA's there): forward gives the
# output and log-sum-exp, backward dQ, dK, dV from them, never the probabilities whole.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def fused_cpu(q: Tensor, mask: Tensor | None, p: float, bias: Tensor | None,
              softcap: float | None) -> bool:
    """Whether the coded attention's probabilities go through PyTorch's fused CPU kernels: on the
    CPU, no dropout (the kernels draw none), no bias that learns (they give no gradient for it),
    no soft cap (they have none), in a dtype they take, and every query with a key to attend to
    (a left-padded causal row's first queries have none: eager spreads them over every key, and
    the kernels' backward there is not its gradient, measured)."""
    return (_FLASH_CPU is not None and q.device.type == "cpu" and p == 0 and bias is None
            and softcap is None and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (mask is None or ((mask.dtype == torch.bool or mask.is_floating_point())
                                  and bool(attendable(mask).any(-1).all()))))


def _causal(mask: Tensor | None) -> bool:
    """Whether ``mask`` is the causal pattern alone: the fused kernels take it as ``is_causal``,
    about 10% faster on a CPU than the mask whole (4 x 512 tokens, 12 heads of 32)."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 \
            or mask.shape[-1] != mask.shape[-2]:
        return False
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril_()
    return torch.equal(mask, causal.expand(mask.shape))


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A mask as the fused kernels take it: additive, in the query's dtype (a boolean mask's
    masked keys at the dtype's minimum, as eager attention fills them: a query with no key to
    attend to spreads over all, where ``-inf`` would give NaN)."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min)


def _fused_attend(q, k, v, mask, scaling: float, causal: bool) -> Tensor:
    """:func:`_attend` without dropout, bias or cap, by the fused CPU kernel (``causal``:
    :func:`_causal`)."""
    return _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=None if causal else _additive(mask, q.dtype),
                      scale=scaling)[0]


def _fused_grads(dout, q, k, v, mask, scaling: float,
                 causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of :func:`_fused_attend` by the fused kernels: its forward once more (for the
    output and log-sum-exp its backward reads; nothing of it was kept), then its backward."""
    additive = None if causal else _additive(mask, q.dtype)
    out, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=additive, scale=scaling)
    return _FLASH_CPU_BACKWARD(dout.to(q.dtype), q, k, v, out, lse, 0.0, causal,
                               attn_mask=additive, scale=scaling)


class _RecomputedAttention(torch.autograd.Function):
    """:func:`_attend` that saves Q, K, V, the mask, the bias and the dropout seed, and
    recomputes the probabilities in backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling: float, p: float, seed: Tensor,
                bias: Tensor | None = None, softcap: float | None = None):
        ctx.scaling, ctx.p, ctx.softcap = scaling, p, softcap
        offer(q, k, v)  # under the floor, kept as its code (they are the rest of the block's saves)
        ctx.save_for_backward(q, k, v, mask, seed, bias)
        return _attend(q, k, v, mask, scaling, p, int(seed), bias, softcap)

    @staticmethod
    @first_order
    def backward(ctx, dout):
        q, k, v, mask, seed, bias = ctx.saved_tensors
        dq, dk, dv, dbias = _attention_grads(dout, q, k, v, mask, ctx.scaling, ctx.p, int(seed),
                                             bias, ctx.softcap)
        return dq, dk, dv, None, None, None, None, dbias, None


class _ProjectedAttention(torch.autograd.Function):
    """:func:`_attend` that saves the attention block's input ``x`` (and the projections' weights,
    which are parameters) in place of Q, K and V, and makes Q, K and V again in backward from
    ``x``: one activation of the hidden size kept instead of three. Its gradients are those of
    :class:`_RecomputedAttention`, bit for bit: the same ``F.linear`` gives the same Q, K, V. Only
    the rows backward reads are projected; on a padded batch, forward keeps Q's, K's and V's
    fingerprints, and where the rows made in backward do not match them, all rows are made
    again. From a code of ``x`` (``attention="coded"``), only the rows backward reads, unchecked
    (they differ from forward's anyway)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling: float, p: float, seed: Tensor, x: Tensor,
                pairs: tuple, slices: tuple, norms: tuple, module_name: str,
                code: SharedCode | None = None, rope: tuple[Tensor, Tensor] | None = None,
                bias: Tensor | None = None, softcap: float | None = None):
        ctx.scaling, ctx.p, ctx.dtype, ctx.head_dim = scaling, p, q.dtype, q.shape[-1]
        ctx.softcap = softcap
        ctx.slices, ctx.norms = slices, [(eps, form) for _, eps, form in norms]
        ctx.n_pairs = len(pairs)
        ctx.code = None if code is None else (code.spec, x.shape, x.dtype)
        ctx.rope = rope is not None
        # Detached views share storage and version counter: an in-place change to x or a weight
        # before backward still raises, and the meter counts x once with the linears' own copy.
        # With a code of x (attention="coded"), its payload in x's place. Under the floor, x is
        # its code, the one the projections' own saves of x have: kept in full besides, it
        # would be kept twice (and Q, K, V made from its code are not forward's: no prints).
        x = x.detach() if code is None else code.payload
        ctx.coded = code is not None or offer(x)
        # Exact, every call keeps fingerprints of Q, K and V: of every row on a padded batch
        # (backward makes only the rows it reads, and checks them), of the first row otherwise.
        # Backward checks what it made against them: a block whose Q, K, V stopped being these
        # projections of its input since its layout was found raises there, rather than give
        # other gradients.
        ctx.first_row = not (ctx.coded or padded(mask))
        prints = None if ctx.coded else fingerprints(
            *((t[:1, :, :1] for t in (q, k, v)) if ctx.first_row else (q, k, v)))
        ctx.module_name = module_name
        # not exact anyway (from a code): the fused kernels where they apply
        ctx.fused = ctx.coded and fused_cpu(q, mask, p, bias, softcap)
        ctx.save_for_backward(mask, seed, bias, x,
                              *(rope or (None, None)), prints,
                              *(None if t is None else t.detach() for pair in pairs for t in pair),
                              *(w.detach() for w, _, _ in norms))
        if ctx.fused:
            ctx.causal = _causal(mask)
            return _fused_attend(q, k, v, mask, scaling, ctx.causal)
        return _attend(q, k, v, mask, scaling, p, int(seed), bias, softcap)

    @staticmethod
    @first_order
    def backward(ctx, dout):
        mask, seed, bias, x, cos, sin, prints, *weights = ctx.saved_tensors
        if ctx.code is not None:
            spec, shape, dtype = ctx.code
            x = SharedCode(x, spec).decode(dtype).view(shape)
        rope = (cos, sin) if ctx.rope else None
        rows = None if not ctx.coded and (prints is None or ctx.first_row) else \
            needed_rows(dout, mask, x.shape)

        linear, norm_weights = weights[:2 * ctx.n_pairs], weights[2 * ctx.n_pairs:]
        pairs = tuple(zip(linear[0::2], linear[1::2], strict=True))
        norms = tuple((w, *meta) for w, meta in zip(norm_weights, ctx.norms, strict=True))

        def project(rows):
            return _qkv(x, pairs, ctx.slices, norms, ctx.dtype, ctx.head_dim, rope, rows)
        with torch.autocast(x.device.type, enabled=False):
            qkv = project(rows)
            if rows is not None and prints is not None and not same_rows(qkv, prints, rows):
                qkv = project(None)  # a product over fewer rows rounded otherwise: all, as forward
                rows = None
            if prints is not None and not same_rows(
                    [t[:1, :, :1] for t in qkv] if ctx.first_row else qkv, prints, rows):
                raise RuntimeError(
                    f"{ctx.module_name}'s Q, K, V made again in backward are not forward's: its "
                    "Q, K, V stopped being the projections of its input found on its first call "
                    "(a hook, a scale or a module changed since); pass attention='stored'")
        if ctx.fused:
            (dq, dk, dv), dbias = _fused_grads(dout, *qkv, mask, ctx.scaling, ctx.causal), None
        else:
            dq, dk, dv, dbias = _attention_grads(dout, *qkv, mask, ctx.scaling, ctx.p, int(seed),
                                                 bias, ctx.softcap)
        return dq, dk, dv, *[None] * 11, dbias, None


#: Where :func:`recompute_attention` notes whether a module's Q, K, V check out. (The module's
#: input, which changes with every call, travels per call and per thread: :data:`_calls`.)
_CHECKED = "_sketchprop_qkv_checked"
# Where a layout that candidates matched alike is kept, with the block's weights' versions.
_ALIKE = "_sketchprop_qkv_alike"
_OTHER_SOURCES = ("encoder_hidden_states", "key_value_states")
_CACHES = ("cache", "past_key_values", "past_key_value")


# Per thread: {id(module): [(input, its code or None) of each self-attention call in progress,
# innermost last]}.
# A call's input is per call, never module state: two threads, or a module called again inside
# its own call, each see their own.
_calls = threading.local()


def _inputs() -> dict[int, list]:
    inputs = getattr(_calls, "inputs", None)
    if inputs is None:
        inputs = _calls.inputs = {}
    return inputs


@eager_island
def keep_attention_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on a self-attention module: keep a reference to the call's input (no
    copy), for this call and thread only, for :func:`recompute_attention` to save in place of
    Q, K and V."""
    _inputs().setdefault(id(module), []).append((_own_input(module, args, kwargs), None, None, 0))


def _own_input(module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
    """A self-attention call's input, where it projects its own input: no encoder, and a cache
    (a training forward with ``use_cache`` on has one) that held nothing for this layer before
    the call, so that K and V are this call's own."""
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, Tensor) or any(kwargs.get(k) is not None for k in _OTHER_SOURCES):
        return None
    for name in _CACHES:
        cache = kwargs.get(name)
        if cache is not None and not (callable(getattr(cache, "get_seq_length", None))
                                      and cache.get_seq_length(getattr(module, "layer_idx", 0))
                                      == 0):
            return None
    return x


def _own_rope_input(module: nn.Module, args: tuple,
                    kwargs: dict) -> tuple[Tensor | None, tuple[Tensor, Tensor] | None]:
    """A rotary self-attention call's input (:func:`_own_input`) and its ``(cos, sin)``."""
    rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    if not (isinstance(rope, tuple) and len(rope) == 2 and all(isinstance(t, Tensor)
                                                               for t in rope)):
        return None, None
    x = _own_input(module, args, kwargs)
    return (x, rope) if x is not None else (None, None)


class CodeAttentionInput:
    """Forward pre-hook on a self-attention module under ``attention="coded"``: as
    :func:`keep_attention_input`, and in training with gradients the input's ``bits``-bit code
    (the one filed under it, or one made and filed here: :mod:`sketchprop.codes`), from which
    backward makes Q, K and V again. Made here, before the projections run, so that Q, K and V
    save the same code. ``name`` (the module's qualified name) seeds the rounding's stream. A
    class, not a closure, so that ``torch.save(model)`` can pickle it."""

    def __init__(self, bits: int, group: int, name: str = ""):
        self.bits, self.group, self.seeds = bits, group, SeedStream("attention-input", name)

    @eager_island
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if takes_rope(module):
            x, rope = _own_rope_input(module, args, kwargs)
        else:
            x, rope = _own_input(module, args, kwargs), None
        code = None
        # Float32 (float64 too where the block is BERT's, as its coded LayerNorm): a rotary
        # block's norm and MLP code float32 only.
        if x is not None and module.training and torch.is_grad_enabled() \
                and x.dtype in ((torch.float32,) if rope else (torch.float32, torch.float64)):
            code = code_of(x) or make_code(x, self.bits, self.group, self.seeds.next())
        # The input's version now: a later hook that changes it in place leaves the code stale.
        _inputs().setdefault(id(module), []).append((x, code, rope, getattr(x, "_version", 0)))


@eager_island
def drop_attention_input(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    """Forward hook (also on an exception): forget what :func:`keep_attention_input` kept."""
    inputs = _inputs()
    stack = inputs.get(id(module))
    if stack:
        stack.pop()
        if not stack:
            del inputs[id(module)]


def _attention_input(module: nn.Module) -> tuple[Tensor | None, SharedCode | None, tuple | None]:
    """The call's input, its code (None where there is none, or where the input changed in place
    since it was coded) and its rotary ``(cos, sin)`` (None: not a rotary block)."""
    stack = _inputs().get(id(module))
    if not stack:
        return None, None, None
    x, code, rope, version = stack[-1]
    return x, None if x is None or x._version != version else code, rope


def forget_attention_check(module: nn.Module) -> None:
    """Drop what :func:`recompute_attention` noted on ``module`` (its Q, K, V check)."""
    module.__dict__.pop(_CHECKED, None)
    module.__dict__.pop(_ALIKE, None)


def _hooked(module: nn.Module) -> bool:
    """Whether hooks may change what reaches or leaves the projections in this call: a forward
    hook on a child (a projection, a QK-norm), a global forward hook, or a pre-hook on ``module`` besides
    :func:`keep_attention_input` (one added after it sees, and may change, the input after it
    was kept)."""
    return len(module._forward_pre_hooks) > 1 or forward_hooks_on(
        m for c in module.children() for m in c.modules())


def _projection_weights(module: nn.Module, query: Tensor, key: Tensor,
                        value: Tensor) -> tuple | None:
    """``(x, pairs, slices, norms, code, rope)``: the attention block's input, the ``(weight,
    bias)`` of the projections that make Q, K, V, their columns and QK-norms (:func:`_find_slices`),
    the input's
    code under ``attention="coded"`` (else None) and, for a rotary block, its ``(cos, sin)``
    (else None), when Q, K and V can be made again from them; else None. The first call on a
    module finds the projections from the very Q, K, V the model passed (one extra projection,
    once), and every call while hooks may change them checks them again (:func:`_hooked`); a
    module where they are not found keeps Q, K and V from then on, with a warning."""
    x, code, rope = _attention_input(module)
    found = module.__dict__.get(_CHECKED)
    if x is None or x.shape[:-1] != (query.shape[0], query.shape[2]) \
            or key.shape[2] != query.shape[2] or found is False:
        return None
    if rope is not None and (rope[0].shape[-1] != query.shape[-1]
                             or torch.is_autocast_enabled(x.device.type)):
        # Rotary on part of each head (Phi), or autocast's casts around the rotation: Q, K, V kept
        return None
    alike = module.__dict__.get(_ALIKE)
    if found is None and alike is not None and alike[1] == _versions(module):
        found = alike[0]  # matched alike, and no weight of the block changed since: still holds
    if found is not None and not _hooked(module) \
            and not _spot_check(module, x, found, rope, (query, key, value)):
        found = None  # no longer these projections of the input: found again, or Q, K, V kept
    if found is None or _hooked(module):
        found = _find_slices(module, x, (query, key, value), rope)
        if found is not None and found[0] != module.__dict__.get(_CHECKED, found)[0]:
            found = None  # under a hook, other projections than the first call's: not ours
        # A rotation that moves nothing (one token at position 0: sin = 0) proves nothing about
        # the rotary form (interleaved pairs, Cohere's, would pass): found again next call. Nor
        # do candidates that match alike (equal weights, as Q's and K's norms at
        # initialisation): kept until a weight of the block changes (an optimizer step).
        if found is not None and rope is not None and not bool(rope[1].ne(0).any()):
            return _with_weights(module, x, found, code, rope)
        if found is not None and not found[3]:
            module.__dict__[_ALIKE] = (found, _versions(module))
            return _with_weights(module, x, found, code, rope)
        module.__dict__[_CHECKED] = found or False
        if found is None:
            warnings.warn(f"{type(module).__name__}'s Q, K, V are not its projections of its "
                          "input; recompute_attention keeps Q, K and V for this module",
                          stacklevel=3)
            return None
    return _with_weights(module, x, found, code, rope)


@eager_island
def recompute_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                        attention_mask: Tensor | None, scaling: float | None = None,
                        dropout: float = 0.0, position_bias: Tensor | None = None,
                        softcap: float | None = None, **kwargs) -> tuple[Tensor, None]:
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
    ``position_bias`` (T5's relative position bias, learned) is added to the scores, and its
    gradient passed back; so is a float ``attention_mask`` that requires one. ``softcap``
    (Gemma 2's ``attn_logit_softcapping``) caps the scaled scores to ``softcap * tanh(scores /
    softcap)`` before the bias and the mask, as its eager attention does (never through SDPA,
    which has no cap). Any other floating tensor among ``kwargs`` shaped as the scores raises:
    this function would leave it out.
    """
    if query.shape[1] % key.shape[1] or value.shape[1] != key.shape[1]:
        raise ValueError("recompute_attention needs the query heads to be a multiple of the "
                         f"key/value heads, got {query.shape[1]} and {key.shape[1]}/{value.shape[1]}")
    # Attention sinks would be left out, silently (patch_activations refuses such models before
    # it changes them).
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"recompute_attention does not support {name}; pass attention='stored'")
    # A floating tensor shaped as the scores (its last dimension the keys) would enter the
    # attention in the model's own function; what else travels in kwargs (the Trainer's
    # num_items_in_batch, sequence offsets) is not for it.
    unknown = [n for n, t in kwargs.items() if isinstance(t, Tensor) and t.is_floating_point()
               and t.dim() >= 2 and t.shape[-1] == key.shape[2]]
    if unknown:
        raise ValueError(f"{type(module).__name__} gives its attention function the tensor "
                         f"{unknown[0]!r}, which recompute_attention does not read: it would be "
                         "left out of the attention and its gradient; pass attention='stored'")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    # A forward in training without grad (a reentrant checkpoint's first pass) computes as the
    # recomputation will, through the Function: its dropout masks, not SDPA's own generator's,
    # and its float rounding, by which the recomputation tells its call from another's.
    weights = kwargs.get("output_attentions")
    if softcap is not None:
        softcap = float(softcap)
    elif not weights and (query.device.type == "cuda" or not (
            needs_grad or dropout > 0 or getattr(module, "training", False))):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, position_bias=position_bias, **kwargs)
    # Below, the mask is a constant: a learned one joins the bias, which gets its gradient. (Not
    # on SDPA's path above: a mask of None there would make it add a causal one.)
    bias = position_bias
    if isinstance(attention_mask, Tensor) and attention_mask.requires_grad:
        bias = attention_mask if bias is None else bias + attention_mask
        attention_mask = None
    autocast = torch.is_autocast_enabled(query.device.type)
    if autocast:  # compute in the dtype autocast gives the projections' matmuls, as eager does
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if weights:
        return _attention_with_weights(query, key, value, attention_mask, scaling, dropout, bias,
                                       softcap)
    projected = _projection_weights(module, query, key, value) if needs_grad else None
    # No dropout, no seed: the global stream stays as the plain model leaves it.
    seed = _draw_seed() if dropout > 0 else seed_tensor(0)
    with torch.autocast(query.device.type, enabled=False):
        args = (query, key, value, attention_mask, float(scaling), float(dropout), seed)
        if projected is None:
            out = _RecomputedAttention.apply(*args, bias, softcap)
        else:
            out = _ProjectedAttention.apply(*args, *projected, bias, softcap)
    return out.transpose(1, 2).contiguous(), None


def _attention_with_weights(q, k, v, mask, scaling: float, p: float, bias: Tensor | None = None,
                            softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention by autograd that returns its (dropped) probabilities in ``q``'s dtype, as
    transformers' eager attention does: for ``output_attentions=True``."""
    seed = int(_draw_seed()) if p > 0 else 0
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])  # grouped K/V heads
    with torch.autocast(q.device.type, enabled=False):
        probs, keep, _ = _probabilities(q, k, mask, float(scaling), p, seed, bias, softcap)
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
