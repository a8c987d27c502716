"""Sketch kinds: how to form ``S^T A`` from a seed.

A sketch ``S`` is a random ``B x k`` matrix with ``E[S S^T] = I`` (``k = B_proj``). The layer applies
it to the flattened input ``X`` in forward and to the output gradient ``dY`` in backward, with the
same seed, so that ``(S^T dY)^T (S^T X)`` is an unbiased estimate of ``dY^T X``.

``S`` is never stored. Each kind draws its random numbers once per call, in the cheapest form it
can (normals for ``gaussian``, signs as bits, row indices as ints), from a ``torch.Generator``
seeded with the call's seed, so backward regenerates exactly the forward ``S``.

Every ``apply`` takes an optional ``rows`` index: the sketch then acts on ``A[rows]`` (the
non-padding rows) without the caller copying them first where the kind can avoid it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SKETCHES", "Sketch", "get_sketch", "num_proj_rows"]


def num_proj_rows(b: int, rho: float, min_rows: int) -> int:
    """``B_proj = max(min_rows, ceil(rho * B))``, never more than ``B``."""
    # Guard against ceil(0.1 * 4096) = 410 turning into 411 through float error.
    k = max(min_rows, math.ceil(rho * b - 1e-9))
    return min(k, b)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _signs(n: int, g: torch.Generator, device, dtype) -> Tensor:
    """``n`` random +-1 values, drawn as bits."""
    bits = torch.randint(0, 2, (n,), generator=g, device=device, dtype=torch.int8)
    return (bits * 2 - 1).to(dtype)


def _sample_rows(n: int, k: int, g: torch.Generator, device) -> Tensor:
    """``k`` of ``n`` row indices, uniformly without replacement, as int64."""
    if k == n:
        return torch.arange(n, device=device)
    return torch.randperm(n, generator=g, device=device)[:k]


def _take(a: Tensor, rows: Tensor | None) -> Tensor:
    return a if rows is None else a.index_select(0, rows)


@dataclass(frozen=True)
class Sketch:
    """Base class. ``apply(a, k, seed)`` returns ``S^T a`` of shape ``(k, a.shape[1])``."""

    name: str = "base"
    #: True when the forward stores ``X`` itself (no compression, no variance).
    exact: bool = False

    def apply(self, a: Tensor, k: int, seed: int, rows: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def expected_variance(self, x: Tensor, y: Tensor, k: int) -> float | None:
        """``E |X^T S S^T Y - X^T Y|_F^2`` in closed form, or None where none is implemented.

        The formulas of all kinds live in one place, :func:`sketchprop.variance.expected_variance`.
        """
        from .variance import expected_variance

        return expected_variance(self, x, y, k)


@dataclass(frozen=True)
class Exact(Sketch):
    """No sketch: ``S = I``; the forward stores ``X`` (the reference path through the same code)."""

    name: str = "exact"
    exact: bool = True

    def apply(self, a, k, seed, rows=None):
        return _take(a, rows)


@dataclass(frozen=True)
class Gaussian(Sketch):
    """I.i.d. ``N(0, 1/k)`` entries. Cost ``O(k B N)`` plus ``k B`` normals per call."""

    name: str = "gaussian"

    def apply(self, a, k, seed, rows=None):
        a = _take(a, rows)
        g = _generator(seed, a.device)
        s = torch.randn(k, a.shape[0], generator=g, device=a.device, dtype=torch.float32)
        s = s.mul_(1.0 / math.sqrt(k)).to(a.dtype)
        return s @ a


@dataclass(frozen=True)
class Rademacher(Sketch):
    """I.i.d. ``+-1/sqrt(k)`` entries, drawn as bits."""

    name: str = "rademacher"

    def apply(self, a, k, seed, rows=None):
        a = _take(a, rows)
        g = _generator(seed, a.device)
        bits = torch.randint(0, 2, (k, a.shape[0]), generator=g, device=a.device, dtype=torch.int8)
        s = (bits * 2 - 1).to(a.dtype).mul_(1.0 / math.sqrt(k))
        return s @ a


def _dct_ortho(a: Tensor) -> Tensor:
    """Orthonormal DCT-II along dim 0 through one FFT of length ``B`` (Makhoul's reordering)."""
    n = a.shape[0]
    v = torch.cat([a[0::2], a[1::2].flip(0)], dim=0)
    spec = torch.fft.fft(v.float(), dim=0)
    k = torch.arange(n, device=a.device, dtype=torch.float32)
    w = torch.polar(torch.ones_like(k), -math.pi * k / (2 * n))
    out = (spec * w[:, None]).real
    out[0] *= math.sqrt(1.0 / n)
    out[1:] *= math.sqrt(2.0 / n)
    return out


def _dft_real_ortho(a: Tensor) -> Tensor:
    """The ``B`` real rows of the unitary DFT along dim 0: ``Re`` and ``Im`` of ``rfft`` as rows.

    The cosine and sine rows (each scaled by ``sqrt 2``, the DC and Nyquist rows not) form a real
    orthonormal basis, so the DFT sketch stores real numbers only and its memory matches its rho.
    """
    n = a.shape[0]
    spec = torch.fft.rfft(a.float(), dim=0, norm="ortho")
    n_im = (n - 1) // 2  # imaginary parts that are not identically zero: rows 1 .. ceil(n/2)-1
    re = spec.real
    re[1 : n_im + 1] *= math.sqrt(2.0)
    im = spec.imag[1 : n_im + 1] * math.sqrt(2.0)
    return torch.cat([re, im], dim=0)


@dataclass(frozen=True)
class _Transform(Sketch):
    """Random signs, an orthonormal transform along rows, ``k`` rows sampled, scaled by sqrt(B/k).

    ``S^T = sqrt(B/k) P T D``; ``E[P^T P] = (k/B) I`` for uniform sampling without replacement and
    ``T`` is orthonormal, so ``E[S S^T] = I``. Costs ``O(B N log B)``: a full-length FFT.
    """

    def transform(self, a: Tensor) -> Tensor:
        raise NotImplementedError

    def apply(self, a, k, seed, rows=None):
        a = _take(a, rows)
        n = a.shape[0]
        g = _generator(seed, a.device)
        d = _signs(n, g, a.device, a.dtype)
        idx = _sample_rows(n, k, g, a.device)
        t = self.transform(a * d[:, None])
        return t.index_select(0, idx).mul_(math.sqrt(n / k)).to(a.dtype)


@dataclass(frozen=True)
class DCT(_Transform):
    name: str = "dct"

    def transform(self, a):
        return _dct_ortho(a)


@dataclass(frozen=True)
class DFT(_Transform):
    name: str = "dft"

    def transform(self, a):
        return _dft_real_ortho(a)


def _hadamard(b: int, device, dtype) -> Tensor:
    h = torch.ones(1, 1, device=device, dtype=dtype)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(b)


@dataclass(frozen=True)
class BlockSRHT(Sketch):
    """Subsampled randomized Hadamard transform within blocks of ``block`` rows.

    Rows are grouped in blocks of ``block`` (a power of two; the last block padded with zero rows),
    each block gets random signs and an orthonormal Hadamard transform, and ``k`` of the mixed rows
    are sampled uniformly without replacement and scaled by ``sqrt(B'/k)``. Only the sampled rows
    are ever computed: each is a signed sum of the ``block`` rows of its block, so the cost is
    ``O(k * block * N)`` gathers and no ``B``-long transform or ``k x B`` matrix is formed.

    Mixing spreads a large row over its block, which keeps the variance near the Gaussian one when
    row norms are uneven; ``block=1`` is plain uniform row sampling.
    """

    name: str = "blocksrht"
    block: int = 8

    def __post_init__(self):
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two, got {self.block}")

    def plan(self, n: int, k: int, seed: int, device) -> tuple[Tensor, Tensor]:
        """Source row indices ``(k, block)`` into ``range(n)`` and their coefficients ``(k, block)``.

        Coefficients of rows past ``n`` (the zero padding of the last block) are zero.
        """
        b = self.block
        n_pad = -(-n // b) * b
        g = _generator(seed, device)
        idx = _sample_rows(n_pad, k, g, device)
        blk, r = idx // b, idx % b
        src = blk[:, None] * b + torch.arange(b, device=device)[None, :]
        if b == 1:
            coef = torch.ones(k, 1, device=device)
        else:
            signs = _signs(n_pad, g, device, torch.float32)
            coef = _hadamard(b, device, torch.float32)[r] * signs[src]
        coef = coef * math.sqrt(n_pad / k)
        valid = src < n
        return src.masked_fill(~valid, 0), coef.masked_fill(~valid, 0.0)

    def apply(self, a, k, seed, rows=None):
        n = a.shape[0] if rows is None else rows.shape[0]
        src, coef = self.plan(n, k, seed, a.device)
        if rows is not None:
            src = rows[src]
        coef = coef.to(a.dtype)
        out = a.index_select(0, src[:, 0]).mul_(coef[:, :1])
        for t in range(1, self.block):
            out.addcmul_(a.index_select(0, src[:, t]), coef[:, t : t + 1])
        return out


SKETCHES: dict[str, Sketch] = {
    "exact": Exact(),
    "gaussian": Gaussian(),
    "rademacher": Rademacher(),
    "dct": DCT(),
    "dft": DFT(),
    "blocksrht": BlockSRHT(),
    "rowsample": BlockSRHT(name="rowsample", block=1),
}


def get_sketch(name: str | Sketch) -> Sketch:
    """Look a sketch up by name; raises ``ValueError`` naming the unknown value."""
    if isinstance(name, Sketch):
        return name
    try:
        return SKETCHES[name]
    except KeyError:
        raise ValueError(
            f"unknown sketch {name!r}; choose one of {sorted(SKETCHES)}"
        ) from None
