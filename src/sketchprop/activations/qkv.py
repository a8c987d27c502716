"""Which of an attention block's projections make its Q, K and V, found by what they compute,
and Q, K, V made again from its input by them: shared by the recompute of
:mod:`~sketchprop.activations.attention` (exact and coded).

A block is one that calls transformers' attention interface and has linear projections of its own
(:func:`is_attention_block`). On its first call :func:`_find_slices` finds, for each of Q, K and V,
the projection and the columns of its output that give it as heads (through a QK-norm, rotated),
bit for bit; :func:`_spot_check` checks one row of that layout on every later call.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .norms import _rms_eps, rms_norm_form, rms_norm_value
from .projections import _linear_weights


def _linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
                 rows: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` in ``dtype`` (autocast's casts, done by hand). With ``rows``
    (flat indices into the ``B * L`` rows), only those rows are projected; the others are zeros."""
    weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    if rows is None:
        return F.linear(x.to(dtype), weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    part = F.linear(flat.index_select(0, rows).to(dtype), weight, bias)
    return part.new_zeros(flat.shape[0], part.shape[-1]).index_copy_(0, rows, part).view(
        *x.shape[:-1], -1)


def _as_heads(y: Tensor, head_dim: int, rope: tuple[Tensor, Tensor] | None = None,
              norm: tuple | None = None) -> Tensor:
    """A projection's output as heads, ``(B, L, H * D) -> (B, H, L, D)``, what an attention block
    gives the attention function; with ``norm = (weight, eps, form)``, each head RMS-normalised
    first (a QK-norm: :func:`~sketchprop.activations.norms.rms_norm_value`); with ``rope = (cos,
    sin)`` (``B, L, D``), rotated as Llama's ``apply_rotary_pos_emb`` does."""
    y = y.view(*y.shape[:-1], -1, head_dim)
    if norm is not None:
        y = rms_norm_value(y, *norm)
    y = y.transpose(1, 2)
    if rope is None:
        return y
    cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
    half = y.shape[-1] // 2
    return (y * cos) + (torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin)


def _qkv(x: Tensor, pairs: tuple, slices: tuple, norms: tuple, dtype: torch.dtype,
         head_dim: int, rope: tuple[Tensor, Tensor] | None = None,
         rows: Tensor | None = None) -> list[Tensor]:
    """Q, K and V made from ``x``: each source projection's output once (``pairs``: their
    ``(weight, bias)``), then each tensor's columns of its source (``slices``: ``(source, first
    column, columns, norm)``) as heads, normalised by ``norms[norm]`` where it is not None (a
    QK-norm), Q and K rotated."""
    outs = [_linear_rows(x, w, b, dtype, rows) for w, b in pairs]
    return [_as_heads(outs[src][..., first:first + n], head_dim, rope if i < 2 else None,
                      None if norm is None else norms[norm])
            for i, (src, first, n, norm) in enumerate(slices)]


_PROJECTIONS = ("query", "key", "value")
# A call with any of these set projects something else than its own input (an encoder's states).


def has_projections(module: nn.Module) -> bool:
    """Whether ``module`` has BERT's ``query``, ``key`` and ``value`` submodules (the default
    ``attention=`` reads them: :mod:`~sketchprop.activations.attention_models`)."""
    return all(isinstance(getattr(module, n, None), nn.Module) for n in _PROJECTIONS)


@functools.cache
def _forward_mentions(cls: type, name: str) -> bool:
    """Whether ``cls``'s forward's source names ``name`` (a function it calls)."""
    try:
        return name in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _calls_attention_interface(cls: type) -> bool:
    return _forward_mentions(cls, "ALL_ATTENTION_FUNCTIONS")


def _projection_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, c) for n, c in module.named_children() if _linear_weights(c) is not None]


def is_attention_block(module: nn.Module) -> bool:
    """Whether ``module`` is a self-attention block whose Q, K, V the recompute may make again
    from its input: it calls transformers' attention interface (or has BERT's ``query``,
    ``key``, ``value``) and has linear projections of its own. Which of them give Q, K and V, and
    which columns of their outputs, is found on its first call (:func:`_find_slices`),
    whatever their names and layout (separate, fused QKV, GPT-2's Conv1D)."""
    return (has_projections(module) or _calls_attention_interface(type(module))) \
        and bool(_projection_children(module))


def is_own_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a self-attention block that computes its attention itself, not
    through transformers' attention interface (DeBERTa's disentangled attention): three or more
    linear projections of its own and a softmax in its forward. Under ``attention="coded"`` it
    is made again in backward from the code of its input
    (:class:`~sketchprop.activations.recompute.RecomputedModule`)."""
    return not _calls_attention_interface(type(module)) and _forward_mentions(type(module), "softmax") \
        and len(_projection_children(module)) >= 3


def takes_rope(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes rotary ``position_embeddings`` (``cos, sin``)."""
    try:
        return "position_embeddings" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def has_rope_projections(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary self-attention block (:func:`is_attention_block` and
    :func:`takes_rope`): ``attention="coded"`` makes its Q and K again rotated."""
    return is_attention_block(module) and takes_rope(module)


def _find_slices(module: nn.Module, x: Tensor, tensors: tuple[Tensor, Tensor, Tensor],
                 rope: tuple[Tensor, Tensor] | None) -> tuple | None:
    """``(names, norm names, slices, unique)``: the projections of ``module`` that make its Q, K
    and V (``tensors``) from ``x``, the RMSNorms of its own that normalise a head (a QK-norm,
    Qwen3's ``q_norm``) and, for each of the three, ``(index in names, first column, columns,
    index in norm names or None)``, such that those columns of its source's output as heads,
    normalised and (Q and K) rotated, are the tensor, bit for bit; ``unique``: whether each
    tensor matched one candidate only (equal weights, as Q and K norms at initialisation, match
    several: the layout then holds for this call, and is found again on the next). None where
    some tensor matches none."""
    # Those that read the input: not the output projection, whose input is the heads' width.
    children = [(n, c) for n, c in _projection_children(module)
                if _linear_weights(c)[0].shape[-1] == x.shape[-1]]
    norms = [(n, c) for n, c in module.named_children() if rms_norm_form(c) is not None]
    with torch.no_grad():
        outs = {n: _linear_rows(x, *_linear_weights(c), tensors[0].dtype) for n, c in children}
        found, unique = [], True
        for i, t in enumerate(tensors):
            width, head_dim = t.shape[1] * t.shape[-1], t.shape[-1]
            hits = [(n, first, m) for m, norm in [(None, None), *norms]
                    for n, y in outs.items()
                    for first in range(0, y.shape[-1] - width + 1, head_dim)
                    if torch.equal(_as_heads(y[..., first:first + width], head_dim,
                                             rope if i < 2 else None,
                                             None if norm is None else _norm_of(norm)), t)]
            if not hits:
                return None
            unique &= len(hits) == 1
            found.append((hits[0][0], hits[0][1], width, hits[0][2]))
    names = list(dict.fromkeys(n for n, _, _, _ in found))
    norm_names = list(dict.fromkeys(m for *_, m in found if m is not None))
    return tuple(names), tuple(norm_names), tuple(
        (names.index(n), first, w, None if m is None else norm_names.index(m))
        for n, first, w, m in found), unique


def _spot_check(module: nn.Module, x: Tensor, found: tuple, rope,
                tensors: tuple[Tensor, Tensor, Tensor]) -> bool:
    """Whether the first row of Q, K and V made from ``x`` by the layout ``found`` is close to
    forward's (one row's projections: a product over one row may round otherwise than over the
    batch, so not bit for bit): checked on every call, so that a block whose Q, K, V are no longer
    these projections of its input (a learned scale of the input, a module swapped) is found
    again, or keeps Q, K and V."""
    with_weights = _with_weights(module, x, found, None, rope)
    if with_weights is None:
        return False
    _, pairs, slices, norms, *_ = with_weights
    row = torch.zeros(1, dtype=torch.long, device=x.device)
    with torch.no_grad():  # nothing recorded: a checkpoint's recompute saves as its forward did
        made = _qkv(x, pairs, slices, norms, tensors[0].dtype, tensors[0].shape[-1], rope, row)
        return all(torch.allclose(m[:1, :, :1], t[:1, :, :1], rtol=1e-3,
                                  atol=1e-3 * float(t[:1, :, :1].abs().max()))
                   for m, t in zip(made, tensors, strict=True))


def _norm_of(norm: nn.Module) -> tuple:
    """A QK-norm's ``(weight, eps, form)``, for :func:`_as_heads`."""
    return norm.weight, _rms_eps(norm), rms_norm_form(norm)


def _versions(module: nn.Module) -> tuple:
    """Which of the block's weights are these, changed how often (in place: an optimizer step)."""
    return tuple((id(p), p._version) for p in module.parameters())


def _with_weights(module: nn.Module, x: Tensor, found: tuple, code, rope) -> tuple | None:
    pairs = [_linear_weights(getattr(module, n, None)) for n in found[0]]
    if None in pairs:  # a projection replaced since by one that is not a linear layer
        return None
    norms = tuple(_norm_of(getattr(module, n)) for n in found[1])
    return x, tuple(pairs), found[2], norms, type(module).__name__, code, rope
