r"""GELU that keeps a few-bit code of its derivative for backward (``gelu_bits=b``,
``gelu_code=``), for the exact (erf) form and the tanh form.

**GELU** (:class:`CompactGELU`, ``gelu_bits=b``): keeps a ``b``-bit code of GELU's derivative
``g(x) = Phi(x) + x phi(x)`` instead of its input (the authors' follow-up: Novikov et al.,
"Few-bit backward", ICML 2023), packed at ``b`` bits per element; backward returns
``dY * level(code)``. Two codes (:class:`GeluCode`):

- ``"stochastic"``: ``2^b`` equally spaced levels spanning the range of ``g``
  (``[g(-sqrt 2), g(sqrt 2)] = [-0.1289, 1.1289]``), ``g(x)`` rounded up or down at random
  with the probabilities that make ``E[level] = g(x)``: ``dX`` is unbiased (to 2^-17 of a
  level step: the dither has 16 bits).
- ``"optimal"``: deterministic, the authors' kind: the ``2^b`` levels and their borders that
  minimise ``E (g(x) - level)^2`` for the distribution of the module's inputs (Lloyd-Max on
  ``g(x)``, fit on the first training batch the module sees). The authors fit borders on ``x``
  with uniform weight; thresholds on ``g`` itself are optimal among all ``b``-bit codes of
  ``x`` and need no ``bucketize``. Biased: ``E[dX] != dX``.

Both are arithmetic on the derivative: the forward adds one fused ``gelu_backward`` and a few
elementwise passes, never a gather. Bias and variance of ``dX`` against exact for ``b = 1..4``
on real MiniLM activations: ``scripts/gelu_bits.py`` (``results/bench/gelu_bits.md``).

**Default: 2-bit stochastic.** It is unbiased, as the sketched weight gradients are, so every
gradient stays an unbiased estimate; its noise is small beside the sketch's. On MiniLM's CoLA
activations (``results/bench/gelu_bits.md``) it adds a variance of 0.24 |dW|^2 to each
encoder linear weight's gradient (0.17 after 300 training steps), 2-3% of what blocksrht's
sketch adds at rho 0.1 (8.95 and 11.5, ``results/bench/importance_variance.md``), and no bias
the measurement can see. The optimal 2-bit code has no variance but a bias of 0.04 |dW|^2 on
every step, which steps do not average away. One bit would save another 1/32 of the float
input (about 0.5% of exact's bytes for roberta-base at 16x128) for 10 to 40 times the
variance (at step 0 more than the sketch's own); three bits cut the variance five- to six-fold
for 50% more code bytes. In training (MiniLM on CoLA with blocksrht at rho 0.1, the CPU recipe)
the deterministic 3-bit code scored +0.64 ± 0.37 above this default, paired over three seeds: no
difference measured (``results/README.md``), so the smaller, unbiased code stays.

**GELU, tanh form** (``gelu_bits=b``, :class:`CompactTanhGELU`): GPT-2's ``gelu_new`` (and
``gelu_pytorch_tanh``, ``nn.GELU(approximate="tanh")``) with a ``b``-bit code of its own
derivative, as :class:`CompactGELU` does for the erf form; the
stochastic code spans the tanh form's derivative range, so it stays unbiased.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compiling import eager_island, fused
from ..functional import first_order, seed_tensor
from ..packing import pack_codes, unpack_codes
from ..rng import SeedStream, dither_of, map_uint16
from .seeds import _draw_seed

#: ``gelu_code=`` values (see the module docstring).
GELU_CODES = ("stochastic", "optimal")
DEFAULT_GELU_BITS = 2  # why: the module docstring, "Default"
DEFAULT_GELU_CODE = "stochastic"

# Range of GELU's derivative: its extremes are at x = -+sqrt(2), where g'(x) = phi(x) (2 - x^2) = 0.
_G_MAX = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2.0) * math.exp(-1.0) / math.sqrt(2 * math.pi)
_G_MIN = 1.0 - _G_MAX


def gelu_derivative(x: Tensor, approximate: str = "none") -> Tensor:
    """``GELU'(x) = Phi(x) + x phi(x)`` in float32 (or, with ``approximate="tanh"``, the tanh
    form's derivative), by the fused kernel of GELU's own backward."""
    x = x.float()
    return torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate=approximate)


@dataclass(frozen=True)
class GeluCode:
    """A ``bits``-bit code of GELU's derivative: ``levels`` (``2^bits`` increasing values) and, for
    a deterministic code, the ``thresholds`` between them (a value above ``thresholds[i]`` gets a
    code above ``i``). A stochastic code has equally spaced levels and no thresholds: values are
    rounded to a neighbouring level at random, without bias."""

    bits: int
    levels: tuple[float, ...]
    thresholds: tuple[float, ...] | None = None

    @property
    def stochastic(self) -> bool:
        return self.thresholds is None

    @classmethod
    def uniform(cls, bits: int) -> GeluCode:
        """The stochastic code: ``2^bits`` levels from ``g``'s minimum to its maximum."""
        n = 2**bits
        step = (_G_MAX - _G_MIN) / (n - 1)
        return cls(bits, tuple(_G_MIN + i * step for i in range(n)))

    @classmethod
    def fit(cls, x: Tensor, bits: int, iters: int = 100, derivative=None) -> GeluCode:
        """The deterministic code minimising ``mean (g(x) - level)^2`` over the sample ``x``
        (Lloyd-Max: thresholds midway between levels, each level the mean of its cell); ``g`` is
        ``derivative`` (default :func:`gelu_derivative`)."""
        x = x.detach().reshape(-1)
        x = x[:: max(1, x.numel() // 2**20)]  # a strided sample of at most ~2^21 values
        g = (derivative or gelu_derivative)(x).double().sort().values.cpu()
        n = 2**bits
        levels = torch.quantile(g, (torch.arange(n, dtype=torch.float64) + 0.5) / n)
        sums = torch.cat([g.new_zeros(1), g.cumsum(0)])
        for _ in range(iters):
            thresholds = (levels[1:] + levels[:-1]) / 2
            edges = torch.cat([g.new_zeros(1, dtype=torch.long),
                               torch.searchsorted(g, thresholds, right=True),
                               g.new_full((1,), g.numel(), dtype=torch.long)])
            counts = edges[1:] - edges[:-1]
            means = (sums[edges[1:]] - sums[edges[:-1]]) / counts.clamp(min=1)
            new = torch.where(counts > 0, means, levels)  # an empty cell keeps its level
            if torch.equal(new, levels):
                break
            levels = new
        thresholds = (levels[1:] + levels[:-1]) / 2
        return cls(bits, tuple(levels.tolist()), tuple(thresholds.tolist()))

    def encode(self, g: Tensor, seed: int | None = None) -> Tensor:
        """Codes (uint8, the shape of ``g``) of the float32 derivative values ``g``. A stochastic
        code rounds with the dither of the Philox stream keyed by ``seed`` (None: a seed drawn
        from the global generator)."""
        if self.stochastic and seed is None:
            seed = int(_draw_seed())
        key = None if seed is None else seed_tensor(seed).to(g.device)
        return _codes(g, key, *self.constants(g.device, "encode"))

    def decode(self, code: Tensor) -> Tensor:
        """The level (float32) of each code."""
        return _levels(code, *self.constants(code.device, "decode"))

    def constants(self, device, side: str) -> tuple:
        """What :func:`_codes` (``side="encode"``) or :func:`_levels` (``"decode"``) take after
        their first argument: ``(table, bits, lo, step)``. A stochastic code is its width and two
        numbers, constants of a compiled kernel (one for every module with that code); a fitted
        code's ``table`` (float32 thresholds, or the first level and the steps between levels) is a
        tensor, so that modules with codes of their own share the kernel."""
        if self.stochastic:
            return None, self.bits, self.levels[0], self.levels[1] - self.levels[0]
        return _table(self, torch.device(device), side), self.bits, None, None


@functools.lru_cache(maxsize=256)
def _table(code: GeluCode, device: torch.device, side: str) -> Tensor:
    values = code.thresholds if side == "encode" else (
        code.levels[0], *(code.levels[i] - code.levels[i - 1] for i in range(1, len(code.levels))))
    return torch.tensor(values, dtype=torch.float32, device=device)


def _codes(x: Tensor, key: Tensor | None, table: Tensor | None, bits: int, lo: float | None,
           step: float | None, of=lambda x: x) -> Tensor:
    """:meth:`GeluCode.encode` of the values ``g = of(x)``: stochastic (``table`` None) with the
    Philox stream ``key``, or by the thresholds in ``table``. (``of`` runs on each half of the
    draws, :func:`~sketchprop.rng.map_uint16`: a compiled caller then never stores ``g``.)"""
    if table is None:
        # code = floor((g - lo) / step + u), u uniform on a 16-bit grid inside (0, 1)
        return map_uint16(lambda x, r: (of(x) * (1 / step) + (-lo / step) + dither_of(r))
                          .clamp(0, 2**bits - 1).to(torch.uint8), x, key, 0)  # truncation: floor
    g = of(x)
    code = torch.zeros(g.shape, dtype=torch.uint8, device=g.device)
    for i in range(table.shape[0]):
        code = code + (g > table[i])
    return code


def _levels(code: Tensor, table: Tensor | None, bits: int, lo: float | None,
            step: float | None) -> Tensor:
    """:meth:`GeluCode.decode`: ``lo + code * step``, or the first level plus the steps between
    levels up to the code (``table``)."""
    if table is None:
        return code.float() * step + lo
    out = torch.zeros(code.shape, dtype=torch.float32, device=code.device) + table[0]
    for i in range(1, table.shape[0]):
        out = out + (code >= i) * table[i]
    return out


@fused
def _encode(x: Tensor, key: Tensor | None, table: Tensor | None, bits: int, lo: float | None,
            step: float | None, approximate: str) -> Tensor:
    """The packed code of GELU's derivative at ``x``: derivative, rounding and packing in one
    fused function (:func:`~sketchprop.compiling.fused`)."""
    return pack_codes(_codes(x, key, table, bits, lo, step,
                             lambda x: gelu_derivative(x, approximate)), bits)


@fused
def _backward(dy: Tensor, packed: Tensor, table: Tensor | None, bits: int, lo: float | None,
              step: float | None) -> Tensor:
    """``dY * level(code)``: unpacking, decoding and the product in one fused function."""
    codes = unpack_codes(packed, bits, dy.numel()).view(dy.shape)
    return (dy * _levels(codes, table, bits, lo, step)).to(dy.dtype)


class _CompactGeluFunction(torch.autograd.Function):
    """GELU of the form ``approximate`` (``"none"``: erf, ``"tanh"``), saving only the packed
    codes of its derivative."""

    @staticmethod
    def forward(ctx, x: Tensor, code: GeluCode, seed: int | None = None,
                approximate: str = "none") -> Tensor:
        if code.stochastic and seed is None:
            seed = int(_draw_seed())
        key = None if seed is None else seed_tensor(seed).to(x.device)
        ctx.code = code
        ctx.save_for_backward(_encode(x, key, *code.constants(x.device, "encode"), approximate))
        return F.gelu(x, approximate=approximate)

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        (packed,) = ctx.saved_tensors
        return _backward(dy, packed, *ctx.code.constants(dy.device, "decode")), None, None, None


class CompactGELU(nn.Module):
    """Exact GELU forward; backward from a ``bits``-bit code of its derivative (module docstring).

    ``code``: ``"stochastic"`` (unbiased) or ``"optimal"`` (deterministic, fit by
    :meth:`GeluCode.fit` on the first training batch this module sees; ``fitted`` holds it).
    ``name`` (the module's qualified name) seeds the stochastic code's rounding stream, with
    ``torch.initial_seed()`` and the distributed rank; the global generator is never drawn from
    (:mod:`~sketchprop.activations.seeds`). In eval mode the module is the exact GELU.
    """

    approximate = "none"  # GELU's form, as F.gelu's keyword; the tanh form's subclass sets "tanh"

    def __init__(self, bits: int = DEFAULT_GELU_BITS, code: str = DEFAULT_GELU_CODE,
                 name: str = ""):
        super().__init__()
        if not (isinstance(bits, int) and 1 <= bits <= 8):
            raise ValueError(f"gelu_bits must be an integer in 1..8 or None, got {bits!r}")
        if code not in GELU_CODES:
            raise ValueError(f"unknown gelu_code {code!r}; choose one of {list(GELU_CODES)}")
        self.bits, self.code, self.name = bits, code, name
        self.fitted: GeluCode | None = GeluCode.uniform(bits) if code == "stochastic" else None
        self.seeds = SeedStream("gelu", name)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, code={self.code}"

    @eager_island
    def forward(self, x: Tensor) -> Tensor:
        form = self.approximate
        if not (self.training and torch.is_grad_enabled() and x.requires_grad):
            return F.gelu(x, approximate=form)  # eval mode: exact (and deterministic) gradients
        if self.fitted is None:
            self.fitted = GeluCode.fit(x, self.bits, derivative=partial(gelu_derivative,
                                                                        approximate=form))
        seed = self.seeds.next() if self.fitted.stochastic else None
        return _CompactGeluFunction.apply(x, self.fitted, seed, form)


def is_exact_gelu(module: nn.Module) -> bool:
    """Whether ``module`` computes the exact (erf) GELU: ``nn.GELU()`` or transformers'
    ``GELUActivation`` (``hidden_act="gelu"``), the activations :class:`CompactGELU` replaces."""
    if type(module) is nn.GELU:
        return module.approximate == "none"
    try:
        from transformers.activations import GELUActivation
    except ImportError:  # pragma: no cover
        return False
    return type(module) is GELUActivation


# The tanh form (GPT-2's gelu_new).


def gelu_tanh_derivative(x: Tensor) -> Tensor:
    """The derivative of ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` in float32, by the
    fused kernel of its own backward."""
    return gelu_derivative(x, approximate="tanh")


def _tanh_derivative_range() -> tuple[float, float]:
    """Minimum and maximum of the tanh form's derivative (a dense float64 grid around its two
    extremes, widened by 2^-20 so that float32 values stay inside)."""
    x = torch.linspace(-4, 4, 800001, dtype=torch.float64)
    c = math.sqrt(2 / math.pi)
    t = torch.tanh(c * (x + 0.044715 * x**3))
    g = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    return float(g.min()) - 2**-20, float(g.max()) + 2**-20


_TANH_G_MIN, _TANH_G_MAX = _tanh_derivative_range()


class CompactTanhGELU(CompactGELU):
    """GELU's tanh form (``F.gelu(x, approximate="tanh")``) with backward from a ``bits``-bit code
    of its own derivative: the stochastic code's ``2^bits`` levels span that derivative's range
    (unbiased), the optimal code is fit on it (deterministic, biased)."""

    approximate = "tanh"

    def __init__(self, bits: int = DEFAULT_GELU_BITS, code: str = DEFAULT_GELU_CODE,
                 name: str = ""):
        super().__init__(bits, code, name)
        if code == "stochastic":
            step = (_TANH_G_MAX - _TANH_G_MIN) / (2**bits - 1)
            self.fitted = GeluCode(bits, tuple(_TANH_G_MIN + i * step for i in range(2**bits)))


def is_tanh_gelu(module: nn.Module) -> bool:
    """Whether ``module`` computes GELU's tanh form: ``nn.GELU(approximate="tanh")`` or
    transformers' ``NewGELUActivation`` (``gelu_new``, GPT-2's) or ``GELUTanh``
    (``gelu_pytorch_tanh``)."""
    if type(module) is nn.GELU:
        return module.approximate == "tanh"
    try:
        from transformers import activations as hf
    except ImportError:  # pragma: no cover
        return False
    kinds = [getattr(hf, n, None) for n in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh")]
    return type(module) in [k for k in kinds if k is not None]
