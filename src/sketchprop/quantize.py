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
- **16-bit dither** from the layer's own generator (a seed per call, never the global stream, as
  the sketches'): a 16-bit uniform draw makes ``E[code]`` exact to ``2^-17`` of a level step,
  and four draws come from one 64-bit word.
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

__all__ = ["BITS", "DEFAULT_GROUP", "QuantSpec", "check_bits", "check_group", "dequantize",
           "quantize", "stored_bits"]

#: Supported code widths: a whole number of codes per byte.
BITS = (8, 4, 2)
#: Columns per group (one bfloat16 lower end and spacing each): 0.5 bits per element on top of the
#: codes. Why 64: the module docstring.
DEFAULT_GROUP = 64
# Seeds for the rounding's dither are the sketch's seed XOR this constant: another stream of the
# layer's generator, independent of the sketch's draws.
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


def _dither(n: int, seed: int, device) -> Tensor:
    """``n`` uniform draws in (0, 1) on a 16-bit grid, ``(r + 1/2) / 2^16``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-n // 4),), dtype=torch.int64, device=device,
                          generator=gen)
    r = words.view(torch.int16)[:n].float()
    return r.add_(32768.5).mul_(1.0 / 65536)


def _outward(value: Tensor, widened: Tensor, holds) -> Tensor:
    """``value`` in bfloat16 where rounding to nearest ``holds``, else ``widened`` in bfloat16."""
    near = value.to(torch.bfloat16)
    return torch.where(holds(near), near, widened.to(torch.bfloat16))


def _grid(a: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor]:
    """``(t, lo, step)``: each value's position on its group's grid (``rows x groups x group``,
    float32) and the groups' bfloat16 ends."""
    x = a.float()
    pad = spec.groups * spec.group - spec.cols
    if pad:  # repeat the last column: the padded group's range stays its own
        x = torch.cat([x, x[:, -1:].expand(spec.rows, pad)], dim=1)
    x = x.view(spec.rows, spec.groups, spec.group)
    levels = (1 << spec.bits) - 1
    lo_x, hi_x = x.amin(-1), x.amax(-1)
    # Outward rounding (see the module docstring): where rounding to nearest moved an end inward,
    # a relative margin of 2^-7 (over bfloat16's rounding error of 2^-9) moves it out, so that
    # lo <= min and lo + levels * step >= max; an end bfloat16 holds (0, a constant) stays exact.
    lo = _outward(lo_x, lo_x - lo_x.abs() * 2**-7, lambda v: v.float() <= lo_x)
    span = (hi_x - lo.float()) / levels
    step = _outward(span, span * (1 + 2**-7), lambda v: lo.float() + levels * v.float() >= hi_x)
    step_f = step.float().unsqueeze(-1)
    t = torch.sub(x, lo.float().unsqueeze(-1)).div_(step_f)
    t.masked_fill_(~(step_f > 0), 0)  # a constant group: every code 0
    return t.clamp_(0, levels), lo, step


def _pack(codes: Tensor, bits: int) -> Tensor:
    """``8 / bits`` codes (each below ``2^bits``) per byte, the first in the low bits: a byte's
    worth of codes is read as one little-endian word, and shifts move each code into the low
    byte (one pass per code over whole words, not strided bytes)."""
    if bits == 8:
        return codes
    per_byte = 8 // bits  # a group is a multiple of 8 codes: whole words (little-endian)
    # Codes are below 2^bits, so byte i of a word, shifted right by i * (8 - bits), lands in bits
    # [i * bits, (i + 1) * bits) of the low byte and nothing else does.
    word = codes.view(torch.int16 if per_byte == 2 else torch.int32)
    packed = word.clone()
    for i in range(1, per_byte):
        packed |= word >> (i * (8 - bits))
    return (packed & 0xFF).to(torch.uint8)


def quantize(a: Tensor, bits: int, group: int, seed: int,
             variance: bool = False) -> tuple[Tensor, QuantSpec, Tensor | None]:
    """Stochastically round the rows of ``a`` (``rows x cols``) to ``bits``-bit codes.

    Returns ``(payload, spec, row_variance)``: the packed codes followed by the groups' ends (one
    flat uint8 tensor), what :func:`dequantize` needs, and, with ``variance``, each row's rounding
    variance ``sum_j step_j^2 f_j (1 - f_j)`` (float32, ``rows``) else None.
    """
    rows, cols = a.shape
    spec = QuantSpec(check_bits(bits), check_group(group), rows, cols, a.dtype)
    t, lo, step = _grid(a, spec)
    u = _dither(t.numel(), seed ^ _DITHER, a.device).view_as(t)
    row_var = None
    if variance:
        f = t - t.floor()
        f_var = f * (1 - f)
        pad = spec.groups * spec.group - cols
        if pad:  # the repeated columns are not part of the rows
            f_var[:, -1, spec.group - pad:] = 0
        row_var = (f_var.sum(-1) * step.float().square()).sum(-1)
    # t is ours (a fresh tensor): round in place.
    codes = t.add_(u).floor_().clamp_(max=(1 << bits) - 1).to(torch.uint8)
    packed = _pack(codes.view(-1), bits)
    ends = torch.stack([lo, step], dim=-1).reshape(-1).view(torch.uint8)
    return torch.cat([packed, ends]), spec, row_var


def dequantize(payload: Tensor, spec: QuantSpec) -> Tensor:
    """The rows that ``payload`` codes (``spec.rows x spec.cols``, in ``spec.dtype``)."""
    packed, ends = payload[:spec.code_bytes], payload[spec.code_bytes:]
    ends = ends.view(torch.bfloat16).view(spec.rows, spec.groups, 2).float()
    per_byte, mask = 8 // spec.bits, (1 << spec.bits) - 1
    codes = torch.stack([(packed >> (spec.bits * i)) & mask for i in range(per_byte)], dim=1)
    codes = codes.view(spec.rows, spec.groups, spec.group).float()
    x = torch.addcmul(ends[..., :1], codes, ends[..., 1:])
    return x.view(spec.rows, -1)[:, :spec.cols].to(spec.dtype)
