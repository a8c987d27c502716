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
probability: the expectation is exact. Drawing 64-bit words and splitting each into four 16-bit draws spends a
quarter of the generator calls that ``bernoulli_`` does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..functional import seed_tensor


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
