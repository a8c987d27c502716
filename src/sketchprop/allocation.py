"""Per-layer row allocation: move sketch rows to the layers whose gradients are noisiest.

With a uniform ``rho`` every layer stores ``k_u = ceil(rho B)`` rows of its input. The variance of
a sketched weight gradient falls like ``1/(k - t)``, with ``t`` the rows an importance sketch keeps
deterministically (its top set, which carries no variance; ``t = 0`` for the other kinds). In
units of the uniform rows, ``f = k / k_u`` and ``tau = t / k_u``, the summed normalised variance of
the model is about ``sum_g C_g / (f_g - tau_g)`` with ``C_g = (f_g - tau_g) V_g / |G_g|^2``
(``V_g`` the variance, ``G_g`` the exact gradient). Storing the rows costs ``w_g f_g`` floats with
``w_g = N_g k_u,g``; minimising the sum under a fixed total (a Lagrange multiplier) gives

    f_g = clip(tau_g + mu * sqrt(C_g / w_g), lower_g, B_g / k_u,g),

with ``mu`` found by bisection so that ``sum_g w_g f_g`` equals the uniform rows' total, and
``lower_g`` the largest of ``floor``, ``min_rows / k_u`` and ``(t + 2) / k_u`` (the top set and two
drawn rows). For the seeded kinds (``tau = 0``) this is ``k_g`` proportional to
``sqrt(C_g / N_g)``. A layer then takes ``round(f_g k_u)`` rows: rounding to the nearest adds
nothing to the total on average.

:class:`VarianceAllocation` estimates ``V_g`` and ``|G_g|^2`` online, without bias and without
stored state (:func:`sketchprop.variance.sample_stats`: only the sketched rows the backward has),
sums them over ``every`` steps, and then recomputes the rates. A group ``g`` is one layer, or the
layers that share one sketch (``share_inputs``: Q, K and V store one ``S^T X``, so they move
together and their variances add). Layers whose sketch keeps every row (``k >= B``) and layers held
at ``min_rows`` (``ceil(rho B) < min_rows``, e.g. a pooler that sees one row per example) take no
part.
Every layer's estimate stays unbiased whatever its rate.

Rates are per process: under DDP each rank allocates from its own statistics.
"""

from __future__ import annotations

import math

import torch

from .variance import estimator_design, sample_stats, xty_estimate

__all__ = ["ALLOCATIONS", "VarianceAllocation"]

ALLOCATIONS = ("uniform", "variance")


class VarianceAllocation:
    """Shared by the layers of one patched model (``patch_linear(..., allocate="variance")``).

    Args:
        every: recompute the rates after this many backward passes per layer.
        floor: no group goes below ``floor`` times its uniform rate (keeps every layer's estimate
            usable while its variance is learned).
        decay: the per-group ``c_g`` is an exponential moving average over recomputations.
    """

    def __init__(self, every: int = 20, floor: float = 0.25, decay: float = 0.5):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every!r}")
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"floor must be in (0, 1], got {floor!r}")
        self.every, self.floor, self.decay = every, floor, decay
        self.factors: dict[str, float] = {}  # layer name -> f (1 until first recomputation)
        #: the last recomputation, per group: f, tau, C, w, and f's bounds (lower, cap)
        self.last: dict[str, dict[str, float]] = {}
        self.last_mu: float | None = None
        self.updates = 0
        self._sums: dict[str, torch.Tensor] = {}  # name -> [sum (k - t) V_hat, sum xty_hat]
        self._top: dict[str, float] = {}  # name -> t / k_uniform of its last call (tau)
        self._calls: dict[str, int] = {}
        self._cost: dict[str, float] = {}  # name -> N k_uniform (stored floats per unit of f)
        self._cap: dict[str, float] = {}  # name -> the largest f: every row
        self._lower: dict[str, float] = {}  # name -> the least f: floor, min_rows, top set + 2
        self._leader: dict[str, str] = {}  # name -> the layer whose sketch it shares
        self._c: dict[str, float] = {}  # group leader -> EMA of c_g

    def factor(self, name: str) -> float:
        """The current rate factor ``f`` of layer ``name``."""
        return self.factors.get(self._leader.get(name, name), 1.0)

    def rows(self, name: str, k_uniform: int, n: int, min_rows: int) -> int:
        """Rows for layer ``name`` whose uniform rate gives ``k_uniform`` of ``n`` rows:
        ``f k_uniform`` rounded to the nearest (so rounding adds nothing on average), at least
        ``min_rows`` and 2, at most ``n``."""
        return min(n, max(min_rows, 2, round(self.factor(name) * k_uniform)))

    def share(self, follower: str, leader: str) -> None:
        """Record that ``follower`` uses the sketch ``leader`` formed (they move together)."""
        self._leader[follower] = self._leader.get(leader, leader)

    def hook(self, name: str, sketch, k: int, k_uniform: int, n: int, min_rows: int):
        """The backward hook of one forward call of layer ``name``: ``k`` rows now, ``k_uniform``
        at its uniform rate, of ``n``."""

        @torch.no_grad()
        def observe(dy2, x_shape, rows, sx, sdy, dw, ntop, qvar=None):
            design, n_pop = estimator_design(sketch, n, k)
            total, diag, rest, quant = sample_stats(sx, sdy, dw, ntop, qvar)
            xty = xty_estimate(total, diag, k, design, n_pop, rest, ntop)
            # b-bit rows: their rounding variance scales as 1/k like the sketch's, so it counts.
            stat = torch.stack([(k - ntop) / k_uniform * (total + quant - xty), xty]).double()
            self._sums[name] = self._sums[name] + stat if name in self._sums else stat
            self._calls[name] = self._calls.get(name, 0) + 1
            self._cost[name] = sx.shape[1] * k_uniform
            self._cap[name] = n / k_uniform
            self._top[name] = ntop / k_uniform
            self._lower[name] = max(self.floor, (ntop + 2) / k_uniform, min_rows / k_uniform)
            if min(self._calls.values()) >= self.every:
                self._recompute()

        return observe

    def _recompute(self) -> None:
        sums = {n: v.tolist() for n, v in self._sums.items()}  # one synchronisation
        self._sums.clear()
        self._calls.clear()
        c: dict[str, float] = {}
        cost: dict[str, float] = {}
        for name, (kv, xty) in sums.items():
            g = self._leader.get(name, name)
            if xty > 0 and math.isfinite(kv):
                c[g] = c.get(g, 0.0) + max(kv, 0.0) / xty
            if g == name:
                cost[g] = self._cost[name]
        for g, value in c.items():
            old = self._c.get(g)
            self._c[g] = value if old is None else self.decay * old + (1 - self.decay) * value
        groups = [g for g in cost if g in self._c]
        if len(groups) < 2:
            return
        caps = {g: self._cap[g] for g in groups}
        lower = {g: min(self._lower[g], caps[g]) for g in groups}
        budget = sum(cost[g] for g in groups)
        want = {g: math.sqrt(max(self._c[g], 0.0) / cost[g]) for g in groups}

        def rate(g, mu):
            return min(max(self._top[g] + mu * want[g], lower[g]), caps[g])

        def spend(mu):
            return sum(cost[g] * rate(g, mu) for g in groups)

        if spend(0.0) >= budget:  # the lower bounds alone spend the budget: keep the rates
            return

        lo, hi = 0.0, 1.0
        while spend(hi) < budget and hi < 1e12:
            hi *= 2
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if spend(mid) < budget else (lo, mid)
        mu = (lo + hi) / 2
        for g in groups:
            self.factors[g] = rate(g, mu)
        self.last = {g: {"f": self.factors[g], "tau": self._top[g], "c": self._c[g],
                         "w": cost[g], "lower": lower[g], "cap": caps[g]} for g in groups}
        self.last_mu = mu
        self.updates += 1
