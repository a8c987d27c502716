r"""Dropout that keeps no float mask for backward: a seed (``dropout="seeded"``) or one bit per
element (``dropout="packed"``).

**Dropout** (:class:`SeededDropout`, ``dropout="seeded"``): forward draws an 8-byte seed, makes
the mask from it and saves only the seed; backward makes the same mask again. ``"packed"``
(:class:`PackedDropout`) saves the mask at one bit per element instead, which spends 1/32 of a
float mask to skip drawing it twice. Both are exact: forward and backward use one mask.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..compiling import eager_island, fused
from ..functional import first_order
from ..packing import pack_codes, unpack_codes
from .seeds import _draw_seed, _drop_threshold, _keep, dropout_apply, key_of

#: ``dropout=`` values: masks kept as floats (the model's own), regenerated from a seed, or packed.
DROPOUT = ("stored", "seeded", "packed")


class _SeededDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: Tensor) -> Tensor:
        ctx.dropped, ctx.scale = _drop_threshold(p)
        ctx.save_for_backward(seed)
        return dropout_apply(x, key_of(seed, x.device), ctx.dropped, ctx.scale)

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        (seed,) = ctx.saved_tensors
        return dropout_apply(dy, key_of(seed, dy.device), ctx.dropped, ctx.scale), None, None


@fused
def _packed_forward(x: Tensor, key: Tensor, dropped: int, scale: float) -> tuple[Tensor, Tensor]:
    keep = _keep(x, key, dropped)
    return (x * keep * scale).to(x.dtype), pack_codes(keep, 1)


@fused
def _packed_backward(dy: Tensor, packed: Tensor, scale: float) -> Tensor:
    keep = unpack_codes(packed, 1, dy.numel()).view(dy.shape)
    return (dy * keep * scale).to(dy.dtype)


class _PackedDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: Tensor) -> Tensor:
        dropped, ctx.scale = _drop_threshold(p)
        out, packed = _packed_forward(x, key_of(seed, x.device), dropped, ctx.scale)
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        (packed,) = ctx.saved_tensors
        return _packed_backward(dy, packed, ctx.scale), None, None


class SeededDropout(nn.Dropout):
    """``nn.Dropout`` that saves an 8-byte seed for backward instead of its mask (exact: backward
    regenerates the forward's mask). Same ``p``, same train/eval behaviour."""

    _function = _SeededDropoutFunction

    @classmethod
    def from_dropout(cls, dropout: nn.Dropout) -> SeededDropout:
        new = cls(dropout.p, inplace=False)  # never in place: the input may be saved elsewhere
        new.train(dropout.training)
        return new

    @eager_island
    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p == 1:
            return x * 0
        return self._function.apply(x, self.p, _draw_seed())


class PackedDropout(SeededDropout):
    """``nn.Dropout`` that saves its mask packed one bit per element (1/32 of a float mask; exact)."""

    _function = _PackedDropoutFunction
