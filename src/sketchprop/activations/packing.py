"""Bit packing: codes of ``bits`` bits (1..8), eight of them in ``bits`` bytes. Packed dropout masks
(one bit) and the GELU codes are kept this way.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack ``codes`` (uint8 values below ``2^bits``, ``bits`` in 1..8) into ``bits`` bytes per
    eight codes, a flat uint8 tensor."""
    flat = codes.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, 8)
    out = torch.zeros(groups.shape[0], bits, dtype=torch.uint8, device=codes.device)
    for j in range(8):
        byte, shift = divmod(bits * j, 8)
        out[:, byte] |= groups[:, j] << shift  # uint8: bits shifted past 8 fall off here ...
        if shift + bits > 8:
            out[:, byte + 1] |= groups[:, j] >> (8 - shift)  # ... and land in the next byte
    return out.reshape(-1)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """The first ``n`` codes of :func:`pack_codes`, as a flat uint8 tensor."""
    groups = packed.view(-1, bits)
    out = torch.empty(groups.shape[0], 8, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    for j in range(8):
        byte, shift = divmod(bits * j, 8)
        value = groups[:, byte] >> shift
        if shift + bits > 8:
            value |= groups[:, byte + 1] << (8 - shift)
        out[:, j] = value & mask
    return out.view(-1)[:n]
