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

from ..compiling import eager_island
from .packing import pack_codes, unpack_codes
from .seeds import _draw_seed, _drop_threshold, keep_mask

#: ``dropout=`` values: masks kept as floats (the model's own), regenerated from a seed, or packed.
DROPOUT = ("stored", "seeded", "packed")


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
