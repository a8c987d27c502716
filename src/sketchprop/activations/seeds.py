r"""Seeds and dropout masks: what the dropout, attention and GELU parts draw their randomness from.

**Seeds.** The dropout seeds (those of :class:`~sketchprop.activations.SeededDropout` and of the
attention probabilities) come from the global CPU generator, the stream ``nn.Dropout`` and
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

**Masks.** A mask element is dropped when a 16-bit random integer falls among the lowest
``round(p 2^16)`` of its 2^16 values, so the drop probability is ``p`` rounded to a multiple of
2^-16 (``0.1 -> 0.100006``) and the kept elements are scaled by the inverse of the rounded keep
probability: the expectation is exact. The 16-bit integers come from the Philox stream of
:mod:`sketchprop.rng` keyed by the seed (:func:`~sketchprop.rng.random_uint16`, two per 32-bit
word, drawn by :func:`~sketchprop.rng.map_uint16`): the same mask eager and compiled, on every
device. Mask and product are one fused
function (:func:`dropout_apply`), which backward calls again on ``dY``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compiling import fused
from ..functional import seed_tensor
from ..rng import map_uint16


def _draw_seed() -> Tensor:
    """A seed from the global CPU generator, as a 0-d int64 tensor (see the module docstring)."""
    return seed_tensor(int(torch.randint(0, 2**62, (), dtype=torch.int64)))


def _drop_threshold(p: float) -> tuple[int, float]:
    """``(dropped, scale)``: drop an element when its 16-bit draw ``r`` (in ``[0, 2^16)``) is below
    ``dropped``; ``scale`` is the inverse keep probability, so that ``E[keep * scale] = 1``
    exactly. (``p = 1`` drops everything before any draw; just below it, one draw in 2^16 is
    kept.)"""
    dropped = min(round(p * 65536), 65535)
    return dropped, 65536 / (65536 - dropped)


def key_of(seed, device) -> Tensor:
    """The Philox key (0-d int64 on ``device``) of a mask's ``seed`` (an int or a 0-d tensor)."""
    return seed_tensor(seed).to(device)


def _keep(like: Tensor, key: Tensor, dropped: int) -> Tensor:
    """The keep mask (uint8, 0 or 1, the shape of ``like``) that ``key`` makes."""
    # through int64, not bool: inductor's CPU code stores a vector of bools element by element
    # (12x slower on a 8x12x128x128 mask); the bytes are the same
    return map_uint16(lambda _, r: (r >= dropped).long().to(torch.uint8), like, key, 0)


@fused
def dropout_apply(x: Tensor, key: Tensor, dropped: int, scale: float) -> Tensor:
    """``x * keep * scale`` with the keep mask of ``key``: mask and product in one fused function
    (:func:`~sketchprop.compiling.fused`). Forward applies it to the input, backward to ``dY``."""
    return map_uint16(lambda x, r: (x * (r >= dropped) * scale).to(x.dtype), x, key, 0)


@fused
def _keep_like(like: Tensor, key: Tensor, dropped: int) -> Tensor:
    return _keep(like, key, dropped)  # uint8, viewed as bool by the caller


def keep_mask(shape, p: float, seed, device) -> Tensor:
    """The boolean keep mask of dropout probability ``p`` that ``seed`` (an int or a 0-d tensor)
    makes: the same on every device, eager or compiled."""
    like = torch.empty(shape, dtype=torch.uint8, device=device)  # carries shape and device only
    return _keep_like(like, key_of(seed, device), _drop_threshold(p)[0]).view(torch.bool)
