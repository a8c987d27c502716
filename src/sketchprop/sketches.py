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
- ``importance``: a deterministic top set plus rows drawn with replacement, with probabilities
  from the row norms of ``X`` and a running estimate of the output-gradient row norms
  (:class:`Importance`); row norms, a top-``k`` and one gather: ``O(B N + k N)``. Its sampled rows
  depend on ``X``, so it saves the ``k`` row indices and scales instead of a seed (``plan``).

Every kind computes in the input's dtype where it can (FFTs in float32 for 16-bit inputs).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SKETCHES", "GradNormEstimate", "Importance", "Sketch", "get_sketch", "num_proj_rows"]


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
    #: True when ``S`` depends on ``X`` (see :class:`Importance`): the layer forms a ``plan`` in
    #: forward and backward applies it, as no seed can regenerate ``S`` without ``X``.
    data_dependent: bool = False

    def apply(self, a: Tensor, k: int, seed: int, rows: Tensor | None = None) -> Tensor:
        raise NotImplementedError


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


@dataclass
class ImportancePlan:
    """The ``S`` of one :class:`Importance` call: ``S^T A = scale[:, None] * A[index]``.

    ``index`` (``k``, int32 or int64) are absolute row numbers into the flattened ``A``, the first
    ``ntop`` of them the deterministic top set (scale 1). ``ntop`` is a 0-d CPU int64 tensor so that
    all three can be saved for backward (and replaced together under activation checkpointing).
    """

    index: Tensor
    scale: Tensor
    ntop: Tensor

    def apply(self, a: Tensor) -> Tensor:
        """``S^T a`` for the flattened ``a`` (``B x N``)."""
        return a.index_select(0, self.index).mul_(self.scale.to(a.dtype)[:, None])


class GradNormEstimate:
    """A running estimate of the output-gradient row norms of one layer, per token position.

    For a 3-D input ``(batch, T, N)`` flattened to rows, row ``r`` is at position ``r % T``; a 2-D
    input is one position. Backward calls :meth:`update` with ``dY``: each row's ``|dy_r|^2``,
    divided by the batch mean of ``|dy|^2`` (so the scale of the loss, a loss scaler or the layer
    does not matter, and layers that share one sketch count alike), is averaged per position; the
    next :meth:`weights` folds those means into an exponential moving average with ``decay``.
    :meth:`weights` predicts ``|dy_r|`` as the square root of that average at the row's position,
    and the mean over positions seen so far where a position was never seen (all ones before the
    first update).

    Memory: three float32 vectors of the longest sequence length seen, ``O(B)`` per layer at most,
    never per example. The state is not part of the ``state_dict`` and starts afresh in each process
    (under DDP each rank learns its own).
    """

    def __init__(self, decay: float = 0.9):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self.mean_sq: Tensor | None = None  # EMA of normalised |dy|^2 per position; NaN unseen
        self._acc: Tensor | None = None     # sums since the last fold, and their counts
        self._cnt: Tensor | None = None
        self.updates = 0

    @staticmethod
    def positions(shape: tuple[int, ...], rows: Tensor | None, device) -> tuple[Tensor, int]:
        """The position of each covered row of an input of ``shape``, and the sequence length."""
        t = shape[-2] if len(shape) >= 3 else 1
        r = torch.arange(math.prod(shape[:-1]), device=device) if rows is None else rows
        return (r % t if t > 1 else torch.zeros_like(r)), t

    def _grow(self, t: int, device) -> None:
        if self.mean_sq is None:
            self.mean_sq = torch.full((t,), math.nan, device=device)
            self._acc = torch.zeros(t, device=device)
            self._cnt = torch.zeros(t, device=device)
        elif self.mean_sq.shape[0] < t:
            extra = t - self.mean_sq.shape[0]
            self.mean_sq = torch.cat([self.mean_sq, self.mean_sq.new_full((extra,), math.nan)])
            self._acc = torch.cat([self._acc, self._acc.new_zeros(extra)])
            self._cnt = torch.cat([self._cnt, self._cnt.new_zeros(extra)])

    @torch.no_grad()
    def update(self, dy2: Tensor, shape: tuple[int, ...], rows: Tensor | None) -> None:
        """Add the row norms of the output gradient ``dy2`` (``B x N_out``) of an input of
        ``shape``; ``rows``: the covered rows (None for all). ``O(B N_out)`` flops."""
        sq = torch.linalg.vector_norm(dy2, dim=1, dtype=torch.float32).square()
        if rows is not None:
            sq = sq.index_select(0, rows)
        # An fp16 step whose gradient overflowed (the loss scaler skips it) must not poison the
        # estimate: non-finite rows count as zero, without a device synchronisation.
        sq = torch.where(torch.isfinite(sq), sq, 0.0)
        pos, t = self.positions(shape, rows, dy2.device)
        self._grow(t, dy2.device)
        sq = sq / sq.mean().clamp_min(torch.finfo(torch.float32).tiny)
        self._acc.index_add_(0, pos, sq)
        self._cnt.index_add_(0, pos, torch.ones_like(sq))
        self.updates += 1

    def _fold(self) -> None:
        if self._cnt is None:
            return
        seen = self._cnt > 0
        new = self._acc / self._cnt.clamp_min(1)
        old = self.mean_sq
        mixed = torch.where(torch.isnan(old), new, self.decay * old + (1 - self.decay) * new)
        self.mean_sq = torch.where(seen, mixed, old)
        self._acc.zero_()
        self._cnt.zero_()

    @torch.no_grad()
    def weights(self, shape: tuple[int, ...], rows: Tensor | None, device) -> Tensor:
        """Predicted ``|dy_r|`` (up to a common factor) of each covered row, float32."""
        pos, t = self.positions(shape, rows, device)
        if self.mean_sq is None:
            return torch.ones(pos.shape[0], device=device)
        self._fold()
        self._grow(t, device)
        est = self.mean_sq
        fill = torch.nanmean(est)
        est = torch.where(torch.isnan(est), fill, est).clamp_min(0)
        return est.index_select(0, pos).sqrt()

    def hook(self):
        """A backward hook for :class:`~sketchprop.functional.SketchedLinearFunction`."""
        def update(dy2, x_shape, rows, sx, sdy, dw, ntop, qvar=None):
            self.update(dy2, tuple(x_shape), rows)
        return update

    def nbytes(self) -> int:
        """Bytes of state held."""
        return sum(v.numel() * v.element_size() for v in (self.mean_sq, self._acc, self._cnt)
                   if v is not None)


@dataclass(frozen=True)
class Importance(Sketch):
    """Importance row sampling: a deterministic top set, the rest drawn with replacement.

    Each covered row ``i`` gets a score ``s_i = |x_i| w_i``, with ``w_i`` the predicted output-
    gradient row norm (:class:`GradNormEstimate`; ``|x_i| |dy_i|`` is the optimal score for row
    sampling, and ``dY`` is not known in forward). The ``c`` largest scores form the top set
    ``T``, kept with scale 1; ``c`` minimises the predicted variance ``S_R(c)^2 / (k - c)`` (``S_R``
    the summed score outside ``T``) with at least 2 rows left to draw. The other ``m = k - c``
    rows are drawn with replacement from the rest ``R`` with probabilities

        p_i = (1 - floor) s_i / S_R + floor / |R|          (i in R)

    and scaled by ``1 / sqrt(m p_i)``. Then

        E[dW] = sum_T y_i x_i^T + E[(1/m) sum_j y_j x_j^T / p_j] = dY^T X

    because every row of ``R`` has ``p_i >= floor / |R| > 0``: the estimate is unbiased for *any*
    state of the estimate ``w`` (a wrong estimate costs variance, never bias). Its variance is

        V = (1/m) (sum_R |x_i|^2 |y_i|^2 / p_i - |X_R^T Y_R|_F^2).

    Forward saves the ``k`` sampled rows of ``X`` (scaled) plus ``k`` row indices and ``k`` scales
    (:class:`ImportancePlan`), 8 bytes per row more than a seeded sketch's at int32 indices. Costs
    ``O(B N)`` for the row norms plus a top-``k`` over ``B``. Choosing ``c`` needs the scores on the
    host: one device synchronisation per forward on a GPU.
    """

    name: str = "importance"
    data_dependent: bool = True
    #: share of the sampling probability spread uniformly over the rest (the unbiasedness floor)
    floor: float = 0.1

    def __post_init__(self):
        if not 0.0 < self.floor <= 1.0:
            raise ValueError(f"floor must be in (0, 1], got {self.floor}")

    def apply(self, a, k, seed, rows=None):
        raise TypeError("the importance sketch depends on X and the gradient-norm estimate; "
                        "form it with plan(...) (RandomizedLinear does)")

    def design(self, scores: Tensor, k: int) -> tuple[Tensor, Tensor, int]:
        """``(top, p, m)`` for scores of the covered rows: ``top`` local indices of the top set,
        ``p`` (float64, over all covered rows, zero on ``top``) and ``m`` rows to draw."""
        n = scores.shape[0]
        s = scores.double().nan_to_num(0.0, posinf=0.0).clamp_min(0)  # non-finite: floor only
        c = 0
        if k > 2:
            top_vals, top_idx = torch.topk(s, k - 2)
            rest = s.sum() - torch.cat([s.new_zeros(1), top_vals.cumsum(0)])  # S_R(c), c=0..k-2
            c = int(torch.argmin(rest.square() / torch.arange(k, 1, -1, device=s.device,
                                                               dtype=s.dtype)))
            top = top_idx[:c]
        else:
            top = torch.zeros(0, dtype=torch.int64, device=s.device)
        in_rest = torch.ones(n, dtype=torch.bool, device=s.device)
        in_rest[top] = False
        s = s * in_rest
        total = s.sum()
        n_rest = n - c
        uniform = in_rest.double() / n_rest
        # Without any score outside the top set, uniform (a where, not an if: no synchronisation).
        p = torch.where(total > 0, (1 - self.floor) * s / total + self.floor * uniform, uniform)
        return top, p, k - c

    def scores(self, a: Tensor, rows: Tensor | None, weights: Tensor) -> Tensor:
        """``|x_i| w_i`` for the covered rows of the flattened input ``a`` (``B x N``), given the
        predicted gradient norms ``weights`` of those rows (float32)."""
        norms = torch.linalg.vector_norm(a, dim=1, dtype=torch.float32)
        if rows is not None:
            norms = norms.index_select(0, rows)
        return norms * weights

    def plan(self, a: Tensor, k: int, seed: int, rows: Tensor | None, weights: Tensor,
             index_dtype: torch.dtype = torch.int32) -> ImportancePlan:
        """Draw the ``k`` rows for the flattened input ``a`` (``B x N``), its covered ``rows`` and
        the predicted gradient norms ``weights`` of the covered rows."""
        top, p, m = self.design(self.scores(a, rows, weights), k)
        g = _generator(seed, a.device)
        drawn = torch.multinomial(p, m, replacement=True, generator=g)
        local = torch.cat([top, drawn])
        scale = torch.cat([torch.ones(top.shape[0], dtype=torch.float64, device=a.device),
                           (m * p.index_select(0, drawn)).rsqrt()]).float()
        index = local if rows is None else rows.index_select(0, local)
        return ImportancePlan(index.to(index_dtype), scale,
                              torch.tensor(top.shape[0], dtype=torch.int64))


SKETCHES: dict[str, Sketch] = {
    "exact": Exact(),
    "gaussian": Gaussian(),
    "rademacher": Rademacher(),
    "dct": DCT(),
    "dft": DFT(),
    "blocksrht": BlockSRHT(),
    "rowsample": BlockSRHT(name="rowsample", block=1),
    "importance": Importance(),
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
