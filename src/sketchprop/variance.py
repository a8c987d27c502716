r"""Gradient variance of a sketched linear layer (paper Section 2.3, Figure 4).

Notation: ``X`` is the layer input (``B x N_in``, rows ``x_i``), ``Y`` the output gradient
(``B x N_out``, rows ``y_i``), ``G = X^T Y`` the exact weight gradient (transposed), ``k = B_proj``,

    sq_x = |X|_F^2,   sq_y = |Y|_F^2,   per_row = sum_i |x_i|^2 |y_i|^2,   xty = |X^T Y|_F^2.

**The paper's estimators** (as the authors' code computes them):

    D2_SGD = B/(B-1) * per_row - xty/(B-1)     (d2_sgd; B/(B-1) sum_i |x_i y_i^T - G/B|^2)
    D2_RMM = (sq_x * sq_y - xty) / k           (d2_rmm)
    alpha  = xty / (sq_x * sq_y)               (alpha)
    ratio  = k/(B-1) * D2_RMM / D2_SGD = (sq_x sq_y - xty) / (B per_row - xty)     (Figure 4)

``D2_RMM`` is the variance of an idealized sketch. **The exact variance**
``V = E|X^T S S^T Y - G|_F^2`` of each kind in :data:`~sketchprop.SKETCHES` has a closed form
(:func:`expected_variance`):

- ``gaussian`` (i.i.d. ``N(0, 1/k)``): ``V = (sq_x sq_y + xty) / k`` (a *plus* where D2_RMM has
  a minus; Isserlis)
- ``rademacher`` (i.i.d. ``+-1/sqrt k``): ``V = (sq_x sq_y + xty - 2 per_row) / k``
- ``rowsample`` (``k`` of ``B`` rows uniformly without replacement, scaled ``B/k``; the finite-
  population variance of a sample sum):
  ``V = B (B-k) / (k (B-1)) * (per_row - xty/B) = (B-k)/k * D2_SGD``
- ``dct``, ``dft`` and ``blocksrht`` (random signs ``D``, a real orthonormal transform ``T``, then
  ``k`` of the ``n`` transformed rows sampled without replacement, scaled ``sqrt(n/k)``). Given
  ``D`` this is row sampling of ``TDX`` and ``TDY``, whose product is still ``G``, so
  ``V = n (n-k) / (k (n-1)) * (E_D[Q] - xty/n)`` with ``Q = sum_r |(TDX)_r|^2 |(TDY)_r|^2``. With
  ``H = W^T W``, ``W = T o T`` (entrywise squares), the sign moments ``E[d_i d_j d_k d_l]`` give

      E_D[Q] = px^T H py + 2 sum_{i != j} H_ij (x_i . x_j)(y_i . y_j)   (px_i = |x_i|^2, ...)

  For ``blocksrht`` (``n`` = rows padded to whole blocks of size ``b``) ``H`` is block diagonal with
  entries ``1/b``, so ``E_D[Q] = (1/b) sum_blocks [Px Py + 2 (|X_blk^T Y_blk|^2 - per_row_blk)]``,
  which costs ``O(B b (N_in + N_out))``; block 1 is ``rowsample``. For ``dct``/``dft`` ``H`` is
  formed from the transform itself: ``O(B^2)`` memory, ``O(B^2 (N_in + N_out))`` time (a
  reference, not for the training loop). A full-length Hadamard (``H = 11^T/n``) would give
  ``(n-k)/(n-1)`` times the Rademacher variance.
- ``exact``: ``V = 0``.

**The memory-free online estimator** (:class:`VarianceTracker`). The forward keeps the ``B`` numbers
``px`` (in float32) besides ``S^T X``; the backward has ``Y``, ``S^T Y``, ``S^T X`` and
``dW^T = (S^T X)^T (S^T Y)``. From them, with ``sx_r``, ``sy_r`` the ``k`` sketched rows,

    total = |dW|_F^2 = |X^T S S^T Y|_F^2,      diag = sum_r |sx_r|^2 |sy_r|^2,

``sq_x``, ``sq_y``, ``per_row`` are exact, and ``xty`` is estimated without bias (a U-statistic over
pairs of sketched rows; ``total - diag`` is the sum over pairs ``r != s``):

- i.i.d. columns (``gaussian``, ``rademacher``): ``E[total] = xty + V`` and
  ``E[diag] = V + xty/k``, so ``xty_hat = k/(k-1) (total - diag)``.
- uniform sampling of ``k`` of ``n`` (transformed) rows without replacement (``rowsample``,
  ``dct``, ``dft``, ``blocksrht`` with ``n`` the padded row count): given the signs, a pair of
  population rows is in the sample with probability ``k(k-1)/(n(n-1))`` and a single row with
  probability ``k/n``, so
  ``E[total - diag] = n(k-1)/(k(n-1)) (xty - Q)`` and ``E[diag] = (n/k) Q``, and
  ``xty_hat = k(n-1)/(n(k-1)) (total - diag) + (k/n) diag``. (Halves of such a sample are not
  independent; this combination is exact instead.)
- ``importance`` (a deterministic top set ``T`` of ``c`` rows, then ``m = k - c`` rows drawn with
  replacement, :class:`~sketchprop.sketches.Importance`): the drawn part ``dW_R`` is a mean of
  ``m`` i.i.d. terms with mean ``X_R^T Y_R``, ``dW_T`` is exact. With ``rest = |dW_R|_F^2`` and
  ``diag`` summed over the drawn rows only,
  ``xty_hat = total + (rest - m diag) / (m - 1)``, so ``V_hat = (m diag - rest) / (m - 1)``
  (``c = 0`` gives the i.i.d. formula). Its exact variance given the sampling probabilities is
  :func:`importance_variance`.
- ``exact``: ``xty_hat = total``.

In every case ``V_hat = total - xty_hat`` estimates the sketch's own variance without bias, and
``D2_SGD``, ``D2_RMM`` and ``alpha`` (linear in ``xty``) are unbiased too; their ratio is a ratio of
estimates (consistent, not unbiased). Needs ``k >= 2`` (else NaN). The cost per tracked backward
is ``O(N_in N_out + B (N_in + N_out))`` flops and no device synchronisation: statistics stay on
the device until :attr:`VarianceTracker.records` is read. Each tracked forward adds ``B`` float32
numbers to the saved memory of the layer.

The statistics follow the gradient the layer receives: with a loss scaler (fp16) ``D2`` values carry
its square; ``alpha`` and the ratio do not. ``B`` is the number of rows the sketch covers (without
padding rows under ``skip_padding``).

This module needs only the sketch kinds, never the layer classes; attaching trackers to a patched
model, collecting their records and logging them is :mod:`sketchprop.tracking`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from .quantize import DEFAULT_GROUP, quantize
from .sketches import (
    BlockSRHT,
    Exact,
    Gaussian,
    Importance,
    Rademacher,
    Sketch,
    _Transform,
    get_sketch,
)

__all__ = [
    "d2_sgd",
    "d2_rmm",
    "alpha",
    "normalized_ratio",
    "batch_stats",
    "expected_variance",
    "importance_variance",
    "quantized_variance",
    "monte_carlo_variance",
    "sample_stats",
    "xty_estimate",
    "sketch_samples",
    "online_estimate",
    "estimator_design",
    "VarianceTracker",
]


# ---------------------------------------------------------------------------------------------
# The paper's estimators on full X and Y.


def _rows(a) -> Tensor:
    a = torch.as_tensor(a)
    return a.reshape(-1, a.shape[-1]).double()


def batch_stats(x, y) -> dict[str, float]:
    """``{b, sq_x, sq_y, per_row, xty}`` of rows ``x`` (``B x N_in``), ``y`` (``B x N_out``).

    Computed in float64; inputs of more than two dimensions are flattened to rows.
    """
    x, y = _rows(x), _rows(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y need the same number of rows, got {x.shape[0]} and {y.shape[0]}")
    px, py = x.square().sum(1), y.square().sum(1)
    return {
        "b": x.shape[0],
        "sq_x": px.sum().item(),
        "sq_y": py.sum().item(),
        "per_row": (px * py).sum().item(),
        "xty": (x.T @ y).square().sum().item(),
    }


def _d2_sgd(b, per_row, xty):
    return (b * per_row - xty) / (b - 1) if b > 1 else math.nan


def _d2_rmm(sq_x, sq_y, xty, k):
    return (sq_x * sq_y - xty) / k


def _alpha(sq_x, sq_y, xty):
    den = sq_x * sq_y
    return xty / den if den > 0 else math.nan


def d2_sgd(x, y) -> float:
    """``D2_SGD = B/(B-1) sum_k |x_k|^2 |y_k|^2 - |X^T Y|_F^2 / (B-1)`` (paper eq. 9)."""
    s = batch_stats(x, y)
    return _d2_sgd(s["b"], s["per_row"], s["xty"])


def d2_rmm(x, y, b_proj: int) -> float:
    """``D2_RMM = (|X|_F^2 |Y|_F^2 - |X^T Y|_F^2) / B_proj`` (paper eq. 11)."""
    if int(b_proj) < 1:
        raise ValueError(f"b_proj must be >= 1, got {b_proj!r}")
    s = batch_stats(x, y)
    return _d2_rmm(s["sq_x"], s["sq_y"], s["xty"], int(b_proj))


def alpha(x, y) -> float:
    """``alpha = |X^T Y|_F^2 / (|X|_F^2 |Y|_F^2)``, in [0, 1]."""
    s = batch_stats(x, y)
    return _alpha(s["sq_x"], s["sq_y"], s["xty"])


def normalized_ratio(d2_rmm_value: float, d2_sgd_value: float, b: int, b_proj: int) -> float:
    """Figure 4's ``B_proj / (B-1) * D2_RMM / D2_SGD`` (does not depend on ``B_proj``)."""
    if b < 2 or d2_sgd_value == 0:
        return math.nan
    return b_proj / (b - 1) * d2_rmm_value / d2_sgd_value


# ---------------------------------------------------------------------------------------------
# Exact expected variance of each sketch kind (the one place these formulas live).


def _sampling_factor(n: int, k: int) -> float:
    return n * (n - k) / (k * (n - 1))


def _blocksrht_variance(x: Tensor, y: Tensor, k: int, block: int) -> float:
    n = x.shape[0]
    n_pad = -(-n // block) * block
    if k >= n_pad or n_pad < 2:
        return 0.0
    if n_pad > n:
        x = torch.cat([x, x.new_zeros(n_pad - n, x.shape[1])])
        y = torch.cat([y, y.new_zeros(n_pad - n, y.shape[1])])
    xb, yb = x.reshape(-1, block, x.shape[1]), y.reshape(-1, block, y.shape[1])
    px, py = xb.square().sum(-1), yb.square().sum(-1)  # (blocks, block)
    per_row_blk = (px * py).sum(1)
    # |X_blk^T Y_blk|^2 through the b x b Gram matrices: no N_in x N_out matrix per block.
    xty_blk = (torch.bmm(xb, xb.transpose(1, 2)) * torch.bmm(yb, yb.transpose(1, 2))).sum((1, 2))
    q = (px.sum(1) * py.sum(1) + 2 * (xty_blk - per_row_blk)).sum().item() / block
    xty = (x.T @ y).square().sum().item()
    return _sampling_factor(n_pad, k) * (q - xty / n_pad)


def _transform_variance(x: Tensor, y: Tensor, k: int, t: Tensor) -> float:
    """Signs, real orthonormal ``t`` (``n x n``), ``k`` rows sampled without replacement."""
    n = x.shape[0]
    if k >= n or n < 2:
        return 0.0
    w = t.double().square()
    h = w.T @ w
    px, py = x.square().sum(1), y.square().sum(1)
    kxy = (x @ x.T) * (y @ y.T)
    q = (px @ h @ py + 2 * ((h * kxy).sum() - (h.diagonal() * px * py).sum())).item()
    xty = (x.T @ y).square().sum().item()
    return _sampling_factor(n, k) * (q - xty / n)


def expected_variance(sketch: str | Sketch, x, y, k: int) -> float | None:
    """Exact ``E |X^T S S^T Y - X^T Y|_F^2`` for ``k = B_proj`` sketched rows, or None for a kind
    without a closed form here. The formulas are in the module docstring."""
    sk = get_sketch(sketch)
    x, y = _rows(x), _rows(y)
    k = int(k)
    if isinstance(sk, Exact):
        return 0.0
    n = x.shape[0]
    if isinstance(sk, (Gaussian, Rademacher)):
        s = batch_stats(x, y)
        v = s["sq_x"] * s["sq_y"] + s["xty"]
        if isinstance(sk, Rademacher):
            v -= 2 * s["per_row"]
        return v / k
    if isinstance(sk, BlockSRHT):
        return _blocksrht_variance(x, y, k, sk.block)
    if isinstance(sk, _Transform):
        t = _transform_matrix(sk, n, x.device)
        return None if t is None else _transform_variance(x, y, k, t)
    return None


def importance_variance(x, y, top: Tensor, p: Tensor, m: int) -> float:
    """Exact variance of the :class:`~sketchprop.sketches.Importance` estimate for rows ``x``,
    ``y`` whose top set is ``top`` (indices) and whose other rows are drawn ``m`` times with
    probabilities ``p`` (zero on ``top``): ``(1/m)(sum_R |x_i|^2 |y_i|^2 / p_i - |X_R^T Y_R|^2)``."""
    x, y = _rows(x), _rows(y)
    rest = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    rest[top] = False
    xr, yr, pr = x[rest], y[rest], p.double()[rest]
    a2 = xr.square().sum(1) * yr.square().sum(1)
    return ((a2 / pr).sum() - (xr.T @ yr).square().sum()).item() / m


def quantized_variance(x, y, bits: int, group: int = DEFAULT_GROUP) -> float:
    """Exact variance ``E|dW^ - Y^T X|_F^2`` when the rows of ``x`` are stored as ``bits``-bit codes
    (:mod:`sketchprop.quantize`, groups of ``group`` columns) and ``dW^ = Y^T Q(X)``: the rounding
    errors are independent with variance ``step^2 f (1 - f)`` each (``f`` the value's fractional
    position between its two levels), so ``sum_b |y_b|^2 sum_j step_bj^2 f_bj (1 - f_bj)``."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    _, _, row_var = quantize(x2, bits, group, seed=0, variance=True)  # the grid has no seed
    return float((y2.double().square().sum(1) * row_var.double()).sum())


def _transform_matrix(sk: Sketch, n: int, device) -> Tensor | None:
    """The ``n x n`` orthonormal transform of a ``dct``/``dft`` sketch, read off the sketch itself
    (applied to the identity with unit signs and every row kept)."""
    eye = torch.eye(n, dtype=torch.float32, device=device)
    if hasattr(sk, "transform_rows"):
        ones = torch.ones(n, dtype=torch.float32, device=device)
        return sk.transform_rows(eye, None, ones, torch.arange(n, device=device), 1.0).double()
    if hasattr(sk, "transform"):
        return sk.transform(eye).double()
    return None


def sketch_samples(sketch: str | Sketch, x, y, k: int,
                   seeds: Iterable[int]) -> tuple[Tensor, Tensor]:
    """``S^T X`` and ``S^T Y`` for each seed, stacked: ``(seeds, k, N_in)``, ``(seeds, k, N_out)``.

    One ``apply`` per seed on ``[X | Y]``, the same ``S`` for both, as the layer does.
    """
    sk = get_sketch(sketch)
    x, y = _rows(x), _rows(y)
    xy = torch.cat([x, y], 1)
    out = torch.stack([sk.apply(xy, k, int(s)) for s in seeds]).double()
    return out[..., : x.shape[1]], out[..., x.shape[1]:]


def monte_carlo_variance(sketch: str | Sketch, x, y, k: int, samples: int = 2000,
                         seed: int = 0) -> tuple[float, float]:
    """Monte-Carlo ``E |X^T S S^T Y - X^T Y|_F^2`` over ``samples`` seeds: ``(mean, std. error)``.

    Works for every kind, including any without a closed form.
    """
    sx, sy = sketch_samples(sketch, x, y, k, range(seed, seed + samples))
    g = _rows(x).T @ _rows(y)
    err = (sx.transpose(1, 2) @ sy - g).square().sum((1, 2))
    return err.mean().item(), (err.std() / math.sqrt(samples)).item()


# ---------------------------------------------------------------------------------------------
# The online estimator.


def estimator_design(sketch: Sketch, n: int, k: int) -> tuple[str, int]:
    """How the sketch draws its ``k`` rows: ``("exact", n)``, ``("iid", n)`` or
    ``("sampling", n_pop)`` (uniform without replacement from ``n_pop`` rows). ``ValueError`` for a
    kind the online estimator does not cover."""
    if sketch.exact:
        return "exact", n
    if isinstance(sketch, (Gaussian, Rademacher)):
        return "iid", n
    if isinstance(sketch, BlockSRHT):
        return "sampling", -(-n // sketch.block) * sketch.block
    if isinstance(sketch, _Transform):
        return "sampling", n
    if isinstance(sketch, Importance):
        return "importance", n
    raise ValueError(
        f"variance tracking has no unbiased online estimator for sketch {sketch.name!r}; "
        "it covers exact, gaussian, rademacher, dct, dft, blocksrht, rowsample and importance"
    )


def xty_estimate(total, diag, k: int, design: str, n_pop: int, rest=None, ntop: int = 0):
    """Unbiased ``|X^T Y|_F^2`` from the statistics of one sketched product (module docstring):
    ``total = |dW|^2``, ``diag`` (over the drawn rows), ``rest = |dW_R|^2`` (importance only)."""
    m = k - ntop
    if design == "exact" or (design == "sampling" and k >= n_pop):
        return total
    if m < 2:
        return total * math.nan
    if design == "iid":
        return k / (k - 1) * (total - diag)
    if design == "sampling":
        return k * (n_pop - 1) / (n_pop * (k - 1)) * (total - diag) + k / n_pop * diag
    if design == "importance":
        return total + ((total if rest is None else rest) - m * diag) / (m - 1)
    raise ValueError(f"unknown design {design!r}")


def sample_stats(sx: Tensor, sdy: Tensor, dw: Tensor, ntop: int = 0,
                 qvar: Tensor | None = None) -> Tensor:
    """``[total, diag, rest, quant]`` (float32, on the device) of one sketched product
    ``dW^T = sdy^T sx``: ``|dW|^2``, ``sum_r |sx_r|^2 |sdy_r|^2`` over the drawn rows (past the
    first ``ntop``), the squared norm of their part of ``dW``, and the rounding variance of stored
    ``b``-bit rows, ``quant = sum_r |sdy_r|^2 qvar_r`` (0 without ``qvar``).

    With ``qvar`` (the stored rows' rounding variances, :func:`~sketchprop.quantize.quantize`),
    ``sx`` is the decoded rows: rounding adds ``|sdy_r|^2 qvar_r`` to the expectation of both
    ``|dW|^2`` and ``|sx_r|^2 |sdy_r|^2``, so those terms are taken off the first three, which
    then estimate the unrounded product's statistics."""
    total = torch.linalg.vector_norm(dw, dtype=torch.float32).square()
    sx_r, sdy_r = sx[ntop:], sdy[ntop:]
    sq_dy = _sqnorm_rows(sdy)
    diag = (_sqnorm_rows(sx_r) * sq_dy[ntop:]).sum()
    rest = None if ntop == 0 else torch.linalg.vector_norm(sdy_r.T @ sx_r,
                                                           dtype=torch.float32).square()
    quant = total.new_zeros(())
    if qvar is not None:
        q = sq_dy * qvar
        quant, drawn = q.sum(), q[ntop:].sum()
        total, diag = total - quant, diag - drawn
        rest = None if rest is None else rest - drawn
    return torch.stack([total, diag, total if rest is None else rest, quant])


def online_estimate(sq_x, sq_y, per_row, total, diag, b: int, k: int, design: str,
                    n_pop: int | None = None, rest=None, ntop: int = 0,
                    quant=0.0) -> dict[str, float]:
    """Estimates from the memory-free statistics (see the module docstring).

    Returns ``xty`` (unbiased ``|X^T Y|_F^2``), ``d2_sketch`` (unbiased variance of the estimator
    in use: the sketch's, plus the rounding's ``quant`` for ``b``-bit rows), ``d2_quant``,
    ``d2_sgd``, ``d2_rmm``, ``alpha`` and ``ratio``. Arguments may be floats or tensors
    (elementwise). ``rest`` and ``ntop``: the importance design's drawn part; ``total``,
    ``diag``, ``rest`` and ``quant`` as :func:`sample_stats` returns them.
    """
    n_pop = b if n_pop is None else n_pop
    xty = xty_estimate(total, diag, k, design, n_pop, rest, ntop)
    d2s = _d2_sgd(b, per_row, xty)
    d2r = _d2_rmm(sq_x, sq_y, xty, k)
    return {
        "xty": xty,
        "d2_sketch": total + quant - xty,
        "d2_quant": quant,
        "d2_sgd": d2s,
        "d2_rmm": d2r,
        "alpha": _div(xty, sq_x * sq_y),
        "ratio": _div(sq_x * sq_y - xty, b * per_row - xty),
    }


def _div(a, b):
    if isinstance(b, Tensor) or isinstance(a, Tensor):
        return a / b
    return a / b if b != 0 else math.nan


def _sqnorm_rows(a: Tensor) -> Tensor:
    return torch.linalg.vector_norm(a, dim=1, dtype=torch.float32).square()


_FIELDS = ("sq_x", "sq_y", "per_row", "total", "diag", "rest", "quant")


class VarianceTracker:
    """Per-step variance estimates of one :class:`~sketchprop.layers.RandomizedLinear`.

    Attach with ``patch_linear(..., track_variance=...)`` or
    :func:`sketchprop.tracking.track_variance`. Hooks (called
    by the layer and its autograd Function):

    - ``forward(x2, rows, k, sketch) -> Tensor | None``: the ``B`` row norms to save for backward
      (the Function saves them with ``save_for_backward``), or None to skip this call;
    - ``backward(state, dy2, rows, sdy, sx, dw, sketch, k, ntop, qvar)``: record one step
      (``qvar``: the stored rows' rounding variances, for ``b``-bit rows).

    ``step`` is the training step to stamp records with (set by
    :class:`~sketchprop.tracking.VarianceCallback`); while it
    is None records are numbered by tracked backward calls. ``records`` is a list of dicts
    ``{step, layer, d2_sgd, d2_rmm, ratio, alpha, d2_sketch, d2_quant, xty, b, b_proj, sketch}``.
    """

    #: pending per-step statistics are moved to the CPU (one synchronisation) this often
    FLUSH_EVERY = 256

    def __init__(self, layer: str, enabled: bool = True):
        self.layer = layer
        self.enabled = enabled
        self.step: int | None = None
        self.calls = 0
        self._pending: list[tuple[int, int, int, str, int, str, int, Tensor]] = []
        self._records: list[dict] = []

    def forward(self, x2: Tensor, rows: Tensor | None, k: int, sketch: Sketch) -> Tensor | None:
        if not self.enabled:
            return None
        px = _sqnorm_rows(x2)
        return px if rows is None else px.index_select(0, rows)

    @torch.no_grad()
    def backward(self, state: Tensor | None, dy2: Tensor, rows: Tensor | None, sdy: Tensor,
                 sx: Tensor, dw: Tensor, sketch: Sketch, k: int, ntop: int = 0,
                 qvar: Tensor | None = None) -> None:
        if state is None:
            return
        py = _sqnorm_rows(dy2)
        if rows is not None:
            py = py.index_select(0, rows)
        b = py.shape[0]
        design, n_pop = estimator_design(sketch, b, k)
        stats = torch.cat([
            torch.stack([state.sum(), py.sum(), (state * py).sum()]),
            sample_stats(sx, sdy, dw, ntop, qvar),
        ])
        self.calls += 1
        step = self.step if self.step is not None else self.calls
        self._pending.append((step, b, k, design, n_pop, sketch.name, ntop, stats))
        if len(self._pending) >= self.FLUSH_EVERY:  # bound the small device tensors kept
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        values = torch.stack([p[-1] for p in self._pending]).double().cpu().tolist()
        for (step, b, k, design, n_pop, name, ntop, _), vals in zip(self._pending, values,
                                                                    strict=True):
            raw = dict(zip(_FIELDS, vals, strict=True))
            est = online_estimate(raw["sq_x"], raw["sq_y"], raw["per_row"], raw["total"],
                                  raw["diag"], b, k, design, n_pop, raw["rest"], ntop,
                                  raw["quant"])
            self._records.append({
                "step": step, "layer": self.layer,
                "d2_sgd": _finite(est["d2_sgd"]), "d2_rmm": _finite(est["d2_rmm"]),
                "ratio": _finite(est["ratio"]), "alpha": _finite(est["alpha"]),
                "d2_sketch": _finite(est["d2_sketch"]), "d2_quant": _finite(est["d2_quant"]),
                "xty": _finite(est["xty"]),
                "b": b, "b_proj": k, "sketch": name,
            })
        self._pending.clear()

    @property
    def records(self) -> list[dict]:
        """All records so far (reading them moves the statistics to the CPU once)."""
        self._flush()
        return self._records

    def clear(self) -> None:
        self._pending.clear()
        self._records.clear()


def _finite(v: float) -> float | None:
    """JSON-safe: NaN and infinities become None."""
    v = float(v)
    return v if math.isfinite(v) else None
