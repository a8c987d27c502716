r"""Stored rows as packed ``b``-bit codes, rounded stochastically so that ``dW`` stays unbiased.

``patch_linear(..., bits=b)`` stores the rows a layer keeps for its weight gradient (``X`` itself
with ``sketch="exact"``, or the sketch's rows ``S^T X``) as ``b``-bit integer codes instead of
floats. Each row is cut into groups of ``group`` columns; a group keeps two bfloat16 numbers, its
lower end ``lo`` and its level spacing ``step``, so that its ``2^b`` levels
``lo, lo + step, ..., lo + (2^b - 1) step`` span its values. A value at ``t = (x - lo) / step``
(between levels ``floor(t)`` and ``floor(t) + 1``) is rounded up with probability
``t - floor(t)``: ``E[code] = t``, so ``E[lo + code * step] = x`` and
``E[dY_s^T Q(S^T X)] = dY_s^T S^T X``. The rounding is independent of the sketch, so the two
errors add: the weight gradient stays unbiased, and its variance grows by
``sum_b |dY_s,b|^2 sum_j step_bj^2 f_bj (1 - f_bj)`` (``f = t - floor(t)``; the closed form is
:func:`sketchprop.variance.quantized_variance`). ``dX`` and ``db`` never read the stored rows:
they stay exact.

Why these choices:

- **Asymmetric groups** (a lower end and a spacing, not a symmetric ``+-max``): the inputs of a
  transformer's output projections are GELU outputs, bounded below by -0.17; a symmetric grid
  would waste half its levels there, and at 2 bits keep 3 of 4.
- **bfloat16 ends**, rounded outward (``lo`` down, ``step`` up) so that every value lies on the
  grid's span: 4 bytes per group, half of float32's, with float32's range.
- **16-bit dither** from the Philox stream of :mod:`sketchprop.rng`, keyed by the seed the layer
  draws for the call (never the global stream, as the sketches'): a 16-bit uniform draw makes
  ``E[code]`` exact to ``2^-17`` of a level step, and two draws come from one 32-bit word. (At 8
  bits, positions ``t >= 128`` have a float32 spacing of ``2^-16``, so ``t + u`` can land on a tie
  that rounds to even: an upward bias of at most ``2^-16`` of a step there, about ``6e-8`` of the
  group's range; measured, and left.) A
  counter-based stream gives the same bits eager and compiled, on any device.
- **One fused function** each way (:func:`~sketchprop.compiling.fused`): grid, dither, rounding
  and packing compile into one pass over the rows, unpacking and decoding into another.
- **Packing**: ``8 / b`` codes per byte (``b`` in 8, 4, 2), then the groups' ends; one uint8
  tensor per stored sketch, which is all the layer saves for ``dW`` besides its seed.

The default group size, :data:`DEFAULT_GROUP`, is the measured choice of
``scripts/equal_bytes.py`` (``results/bench/equal_bytes.md``): the relative weight-gradient error
per stored bit on MiniLM's real activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .compiling import fused
from .packing import pack_codes, unpack_codes
from .rng import dither_of, map_uint16

__all__ = ["BITS", "DEFAULT_GROUP", "QuantSpec", "check_bits", "check_group", "dequantize",
           "payload_rows", "quantize", "stored_bits"]

#: Supported code widths: a whole number of codes per byte.
BITS = (8, 4, 2)
#: Columns per group (one bfloat16 lower end and spacing each): 0.5 bits per element on top of the
#: codes. Why 64: the module docstring.
DEFAULT_GROUP = 64
# The dither's Philox key is the sketch's seed XOR this constant: a stream apart from the sketch's
# draws (which come from torch generators seeded with the seed itself).
_DITHER = 0x2545F4914F6CDD1D


def check_bits(bits) -> int | None:
    """``bits`` as an int in :data:`BITS`, or None; ``ValueError`` naming it otherwise."""
    if bits is None:
        return None
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"bits must be one of {list(BITS)} or None, got {bits!r}")
    return bits


def check_group(group) -> int:
    """``group`` as a positive multiple of 8 (whole bytes of codes at every width)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 8 or group % 8:
        raise ValueError(f"group must be a positive multiple of 8, got {group!r}")
    return group


def stored_bits(bits: int, group: int) -> float:
    """Bits stored per element: the code and its share of the group's two bfloat16 ends."""
    return bits + 32 / group


@dataclass(frozen=True)
class QuantSpec:
    """How a payload of :func:`quantize` decodes: code width, group size, the rows' shape and the
    dtype to decode into."""

    bits: int
    group: int
    rows: int
    cols: int
    dtype: torch.dtype

    @property
    def groups(self) -> int:
        return -(-self.cols // self.group)

    @property
    def code_bytes(self) -> int:
        return self.rows * self.groups * self.group * self.bits // 8


def _grouped(a: Tensor, group: int) -> Tensor:
    """``a`` (``rows x cols``) in float32 as ``(rows groups) x group``: the last column repeated up
    to whole groups (the padded group's range stays its own). Shaped here, outside the fused
    function, so that its loops index by a product of sizes, never by a division. (One dimension
    of groups, not ``rows x groups``: once the rows are fixed and the columns vary, as over one
    batch's layers, the compiled code would otherwise take the groups as symbolic and the rows as
    constant, and index the second half of the draws (:func:`~sketchprop.rng.map_uint16`) by
    divisions, element by element: 2.2x slower, measured on one CPU thread.)"""
    rows, cols = a.shape
    pad = -cols % group
    x = a.float()
    if pad:
        x = torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1)
    # reshape, not view: a strided input (a slice, a transpose, an expanded view) is copied here,
    # where a view could merge rows and groups only for a contiguous one
    return x.reshape(rows * ((cols + pad) // group), group)


def _grid(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(t, lo, step)``: each value's position on its group's grid (float32, the shape of ``x``,
    ``groups x group``) and the groups' bfloat16 ends (``groups``)."""
    levels = (1 << bits) - 1
    lo_x, hi_x = x.amin(-1), x.amax(-1)
    # Outward rounding (see the module docstring): where rounding to nearest moved an end inward,
    # a relative margin of 2^-7 (over bfloat16's rounding error of 2^-9) moves it out, so that
    # lo <= min and lo + levels * step >= max; an end bfloat16 holds (0, a constant) stays exact.
    lo = lo_x.to(torch.bfloat16)
    lo = torch.where(lo.float() <= lo_x, lo, (lo_x - lo_x.abs() * 2**-7).to(torch.bfloat16))
    span = (hi_x - lo.float()) / levels
    step = span.to(torch.bfloat16)
    step = torch.where(lo.float() + levels * step.float() >= hi_x, step,
                       (span * (1 + 2**-7)).to(torch.bfloat16))
    step_f = step.float().unsqueeze(-1)
    t = (x - lo.float().unsqueeze(-1)) / step_f
    t = t.masked_fill(~(step_f > 0), 0)  # a constant group: every code 0
    return t.clamp(0, levels), lo, step


@fused
def _encode(x: Tensor, key: Tensor, bits: int,
            real: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The packed codes of the groups ``x`` (:func:`_grouped`), their ends (bfloat16) and, given
    ``real`` (``groups x group`` of one row: 1 where a column is the input's, 0 where it pads),
    each row's rounding variance: one fused function (:func:`~sketchprop.compiling.fused`), one
    pass over the rows."""
    t, lo, step = _grid(x, bits)
    row_var = None
    if real is not None:
        f = t - t.floor()
        per_group = (f * (1 - f)).view(-1, *real.shape) * real
        row_var = (per_group.sum(-1) * step.float().square().view(-1, real.shape[0])).sum(-1)
    levels = (1 << bits) - 1
    codes = map_uint16(lambda t, r: (t + dither_of(r)).floor().clamp(max=levels).to(torch.uint8),
                       t, key, 0)
    return pack_codes(codes, bits), lo, step, row_var


def quantize(a: Tensor, bits: int, group: int, seed: int,
             variance: bool = False) -> tuple[Tensor, QuantSpec, Tensor | None]:
    """Stochastically round the rows of ``a`` (``rows x cols``) to ``bits``-bit codes, with the
    dither of the Philox stream keyed by ``seed`` (:func:`sketchprop.rng.dither16`).

    Returns ``(payload, spec, row_variance)``: the packed codes followed by the groups' ends (one
    flat uint8 tensor), what :func:`dequantize` needs, and, with ``variance``, each row's rounding
    variance ``sum_j step_j^2 f_j (1 - f_j)`` (float32, ``rows``) else None.
    """
    rows, cols = a.shape
    spec = QuantSpec(check_bits(bits), check_group(group), rows, cols, a.dtype)
    x = _grouped(a, group)
    key = torch.tensor(seed ^ _DITHER, dtype=torch.int64, device=a.device)
    real = None
    if variance:
        groups = spec.groups
        real = (torch.arange(groups * group, device=a.device) < cols).float().view(groups, group)
    packed, lo, step, row_var = _encode(x, key, bits, real)
    ends = torch.stack([lo, step], dim=-1).reshape(-1).view(torch.uint8)
    return torch.cat([packed, ends]), spec, row_var


def payload_rows(payload: Tensor, bits: int, group: int, cols: int) -> int:
    """The rows a payload of :func:`quantize` holds (``cols`` columns each): a row is its packed
    codes and its groups' two bfloat16 ends."""
    return payload.numel() // (-(-cols // group) * (group * bits // 8 + 4))


@fused
def _decode(packed: Tensor, ends: Tensor, bits: int, group: int, dtype: torch.dtype) -> Tensor:
    """The grouped rows (``groups x group``, ``dtype``) of packed codes and their groups' ends
    (bfloat16, ``groups x 2``): one fused function (:func:`~sketchprop.compiling.fused`)."""
    codes = unpack_codes(packed, bits, packed.numel() * 8 // bits).view(-1, group).float()
    ends = ends.float()
    return (ends[:, :1] + codes * ends[:, 1:]).to(dtype)


def dequantize(payload: Tensor, spec: QuantSpec) -> Tensor:
    """The rows that ``payload`` codes (``spec.rows x spec.cols``, in ``spec.dtype``)."""
    packed, ends = payload[:spec.code_bytes], payload[spec.code_bytes:]
    ends = ends.view(torch.bfloat16).view(spec.rows * spec.groups, 2)
    x = _decode(packed, ends, spec.bits, spec.group, spec.dtype)
    x = x.view(spec.rows, spec.groups * spec.group)
    return x[:, :spec.cols] if spec.groups * spec.group > spec.cols else x
