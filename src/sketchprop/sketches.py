"""Sketch kinds: how to form ``S^T A`` from a seed.

A sketch ``S`` is a random ``B x k`` matrix with ``E[S S^T] = I`` (``k = B_proj``). The layer
applies it to the flattened input ``X`` in forward and to the output gradient ``dY`` in backward,
with the same seed, so that ``(S^T dY)^T (S^T X)`` is an unbiased estimate of ``dY^T X``.

``S`` is never stored. Each kind draws its random numbers once per call, in the cheapest form it
can (normals for ``gaussian``, signs as bits, row indices as ints), from a ``torch.Generator``
seeded with the call's seed, so backward regenerates exactly the forward ``S``.

Every ``apply`` takes an optional ``rows`` index: the sketch then acts on ``A[rows]`` (the
non-padding rows) without the caller copying them first where the kind can avoid it.

Cost (``B`` rows, ``N`` columns, ``k`` sampled rows), measured in ``scripts/bench_layer.py``:

- ``gaussian``, ``rademacher``: a dense ``k x B`` matrix, ``O(k B N)``: the paper's sketches.
- ``dct``, ``dft``: one real FFT of length ``B`` along the rows, ``O(B N log B)``; only the ``k``
  sampled frequencies are turned into output rows. No ``k x B`` matrix is formed.
- ``blocksrht``: a randomized Hadamard transform within blocks of 8 rows, only the ``k`` sampled
  rows computed: ``O(8 k N)``, one sparse (CSR) product on CPU, 8 gathers elsewhere.
- ``rowsample``: ``k`` rows sampled uniformly without replacement: one gather, ``O(k N)``.

Every kind computes in the input's dtype where it can (FFTs in float32 for 16-bit inputs).
"""

from __future__ import annotations

import functools
import math
import warnings
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
    """``k`` of ``n`` row indices, uniformly without replacement, as int64, in increasing order.

    The order of the sampled rows does not change ``S S^T``; sorted indices make the gathers that
    follow read memory front to back.
    """
    if k == n:
        return torch.arange(n, device=device)
    return torch.randperm(n, generator=g, device=device)[:k].sort().values


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


def _rfft_rows(a: Tensor, signs: Tensor, order: Tensor | None = None) -> Tensor:
    """``rfft`` along dim 0 of ``diag(signs) a[order]`` (``order``: row indices, or None for all),
    returned transposed as ``(N, B//2+1)``.

    The transform runs along the contiguous dimension of a transposed copy, which FFT libraries do
    faster than a strided transform along dim 0; the one copy also gathers the rows and applies the
    signs.
    """
    n = a.shape[0] if order is None else order.shape[0]
    dtype = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
    v = torch.empty(a.shape[1], n, device=a.device, dtype=dtype)
    at = a.T if order is None else a.T.index_select(1, order)
    torch.mul(at, signs.to(dtype)[None, :], out=v)
    return torch.fft.rfft(v, dim=1)


def _dct_rows(a: Tensor, rows: Tensor | None, signs: Tensor, idx: Tensor, scale: float) -> Tensor:
    """Rows ``idx`` of the orthonormal DCT-II (along dim 0) of ``diag(signs) a[rows]``, times
    ``scale``.

    Makhoul: the DCT of ``a`` is ``Re(e^{-i pi m / 2B} FFT(v)_m)`` with ``v`` the even rows
    followed by the odd rows reversed. ``v`` is real, so ``FFT(v)_m = conj(FFT(v)_{B-m})`` and one
    ``rfft`` of half the size gives every needed frequency; only the ``k`` sampled ones are
    combined.
    """
    n = a.shape[0] if rows is None else rows.shape[0]
    dev = a.device
    order = torch.cat([torch.arange(0, n, 2, device=dev),
                       torch.arange(1, n, 2, device=dev).flip(0)])
    spec = _rfft_rows(a, signs.index_select(0, order),
                      order if rows is None else rows.index_select(0, order))
    m = idx.to(torch.float64)
    upper = idx > n // 2
    j = torch.where(upper, n - idx, idx)
    phi = math.pi * m / (2 * n)
    c = torch.where(idx == 0, math.sqrt(1.0 / n), math.sqrt(2.0 / n)) * scale
    cos_c = (torch.cos(phi) * c).to(spec.real.dtype)
    sin_c = (torch.sin(phi) * c * torch.where(upper, -1.0, 1.0)).to(spec.real.dtype)
    z = spec.index_select(1, j)
    out = torch.addcmul(z.real * cos_c[None, :], z.imag, sin_c[None, :])
    return out.T.contiguous()


def _dft_rows(a: Tensor, rows: Tensor | None, signs: Tensor, idx: Tensor, scale: float) -> Tensor:
    """Rows ``idx`` of the real orthonormal DFT basis applied along dim 0 of
    ``diag(signs) a[rows]``.

    The ``B`` real rows are ``Re`` of ``rfft`` bins ``0 .. B//2`` followed by ``Im`` of bins
    ``1 .. ceil(B/2)-1`` (those not identically zero), scaled by ``sqrt 2`` except the DC and
    Nyquist rows: a real orthonormal basis, so the DFT sketch stores real numbers only.
    """
    n = a.shape[0] if rows is None else rows.shape[0]
    spec = _rfft_rows(a, signs, rows)
    n_re = n // 2 + 1
    n_im = (n - 1) // 2
    is_im = idx >= n_re
    j = torch.where(is_im, idx - n_re + 1, idx)
    w = torch.where(is_im | ((idx >= 1) & (idx <= n_im)), math.sqrt(2.0 / n), math.sqrt(1.0 / n))
    w = (w * scale).to(spec.real.dtype)
    z = spec.index_select(1, j)
    out = torch.where(is_im[None, :], z.imag, z.real) * w[None, :]
    return out.T.contiguous()


@dataclass(frozen=True)
class _Transform(Sketch):
    """Random signs, an orthonormal transform along rows, ``k`` rows sampled, scaled by sqrt(B/k).

    ``S^T = sqrt(B/k) P T D``; ``E[P^T P] = (k/B) I`` for uniform sampling without replacement and
    ``T`` is orthonormal, so ``E[S S^T] = I``. Costs ``O(B N log B)``: one real FFT of length ``B``;
    only the ``k`` sampled rows of ``T D a`` are formed.
    """

    def transform_rows(self, a: Tensor, rows: Tensor | None, signs: Tensor, idx: Tensor,
                       scale: float) -> Tensor:
        raise NotImplementedError

    def apply(self, a, k, seed, rows=None):
        n = a.shape[0] if rows is None else rows.shape[0]
        g = _generator(seed, a.device)
        d = _signs(n, g, a.device, torch.float32)
        idx = _sample_rows(n, k, g, a.device)
        return self.transform_rows(a, rows, d, idx, math.sqrt(n / k)).to(a.dtype)


@dataclass(frozen=True)
class DCT(_Transform):
    name: str = "dct"

    def transform_rows(self, a, rows, signs, idx, scale):
        return _dct_rows(a, rows, signs, idx, scale)


@dataclass(frozen=True)
class DFT(_Transform):
    name: str = "dft"

    def transform_rows(self, a, rows, signs, idx, scale):
        return _dft_rows(a, rows, signs, idx, scale)


#: Block SRHT off the CPU sparse path: gather all ``k x block`` source rows at once (one temporary
#: of that many elements) up to this size, else gather and accumulate one block column at a time.
GATHER_LIMIT = 1 << 24


@functools.lru_cache(maxsize=32)
def _hadamard(b: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The orthonormal ``b x b`` Sylvester-Hadamard matrix (``b`` a power of two), cached."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(b)).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class BlockSRHT(Sketch):
    """Subsampled randomized Hadamard transform within blocks of ``block`` rows.

    Rows are grouped in blocks of ``block`` (a power of two; the last block padded with zero rows),
    each block gets random signs and an orthonormal Hadamard transform, and ``k`` of the mixed rows
    are sampled uniformly without replacement and scaled by ``sqrt(B'/k)``. Only the sampled rows
    are ever computed: each is a signed sum of the ``block`` rows of its block, so the cost is
    ``O(k * block * N)`` and no ``B``-long transform or ``k x B`` dense matrix is formed. On CPU
    (float32/float64) ``S^T`` is built as a ``k x B`` CSR matrix with ``k * block`` entries and
    applied in one sparse product; elsewhere (CUDA, 16-bit) as one gather of the ``k * block``
    source rows and one batched product (``block`` gathers with multiply-adds past
    :data:`GATHER_LIMIT` elements).

    Mixing spreads a large row over its block, which keeps the variance near the Gaussian one when
    row norms are uneven; ``block=1`` is plain uniform row sampling (one gather).
    """

    name: str = "blocksrht"
    block: int = 8

    def __post_init__(self):
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two, got {self.block}")

    def plan(self, n: int, k: int, seed: int, device) -> tuple[Tensor, Tensor]:
        """Source row indices ``(k, block)`` into ``range(n)`` and coefficients ``(k, block)``.

        Coefficients of rows past ``n`` (the zero padding of the last block) are zero (and their
        indices 0).
        """
        src, coef, valid = self._plan(n, k, seed, device)
        if valid is not None:
            src, coef = src.masked_fill(~valid, 0), coef.masked_fill(~valid, 0.0)
        return src, coef

    def _plan(self, n, k, seed, device) -> tuple[Tensor, Tensor, Tensor | None]:
        # Only index_select and elementwise ops on k x block tensors: advanced indexing and take
        # run a parallel kernel even for tiny tensors, which costs milliseconds on a busy CPU.
        b = self.block
        n_pad = -(-n // b) * b
        g = _generator(seed, device)
        idx = _sample_rows(n_pad, k, g, device)
        if b == 1:
            return idx[:, None], torch.full((k, 1), math.sqrt(n / k), device=device), None
        base = idx.div(b, rounding_mode="floor").mul_(b)
        src = base[:, None] + torch.arange(b, device=device)[None, :]
        signs = _signs(n_pad, g, device, torch.float32)
        h = _hadamard(b, torch.device(device), torch.float32).index_select(0, idx - base)
        coef = h.mul_(signs.index_select(0, src.view(-1)).view(k, b)).mul_(math.sqrt(n_pad / k))
        return src, coef, (src < n) if n_pad != n else None

    def apply(self, a, k, seed, rows=None):
        n = a.shape[0] if rows is None else rows.shape[0]
        src, coef, valid = self._plan(n, k, seed, a.device)
        b = self.block
        if valid is not None:
            src, coef = src.masked_fill(~valid, 0), coef.masked_fill(~valid, 0.0)
        if rows is not None:
            src = rows.index_select(0, src.view(-1)).view(k, b)
        if b == 1:
            return a.index_select(0, src.view(-1)).mul_(math.sqrt(n / k))
        if a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64):
            # One sparse product; the zero-padding entries are dropped, columns stay sorted.
            if valid is None:
                crow = torch.arange(0, k * b + 1, b)
                col, val = src.view(-1), coef.view(-1)
            else:
                crow = torch.zeros(k + 1, dtype=torch.int64)
                torch.cumsum(valid.sum(1), 0, out=crow[1:])
                col, val = src.masked_select(valid), coef.masked_select(valid)
            with warnings.catch_warnings():  # torch warns that sparse CSR support is "beta"
                warnings.simplefilter("ignore")
                s_t = torch.sparse_csr_tensor(crow, col, val.to(a.dtype), size=(k, a.shape[0]),
                                              check_invariants=False)
            return s_t @ a
        coef = coef.to(a.dtype)
        if k * b * a.shape[1] <= GATHER_LIMIT:
            # Two kernels: gather the k blocks of source rows, then one batched product.
            g = a.index_select(0, src.view(-1)).view(k, b, a.shape[1])
            return torch.bmm(coef.view(k, 1, b), g).view(k, a.shape[1])
        # Large: b gathers of k rows each, so the temporary stays at the size of the output.
        out = a.index_select(0, src[:, 0]).mul_(coef[:, :1])
        for t in range(1, b):
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
