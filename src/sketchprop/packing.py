"""Bit packing: codes of ``bits`` bits (1..8), eight of them in ``bits`` bytes. Packed dropout masks
(one bit) and the GELU codes are kept this way.

Code ``j`` of a run of eight occupies bits ``[bits j, bits (j + 1))`` of the run's ``bits``
bytes read as one little-endian number. Both directions are plain integer arithmetic on 64-bit
words (eight codes are one word), with no Python branching on values, so that a compiled caller
(:func:`~sketchprop.compiling.fused`) fuses them into its own loop.
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
    elif not torch.compiler.is_compiling() and flat.storage_offset() % 8:
        # an int64 view needs its first byte 8-byte aligned (a compiled caller's are fresh)
        flat = flat.clone()
    if bits == 8:
        return flat
    word = flat.view(torch.int64)  # eight codes, code j in byte j (little-endian)
    out = word & 0xFF
    for j in range(1, 8):  # code j from byte j to bits [bits j, bits (j + 1))
        out = out | (((word >> (8 * j)) & 0xFF) << (bits * j))
    return torch.stack([(out >> (8 * b)) & 0xFF for b in range(bits)], -1).to(torch.uint8).view(-1)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """The first ``n`` codes of :func:`pack_codes`, as a flat uint8 tensor."""
    mask = (1 << bits) - 1
    if 8 % bits == 0:  # whole codes per byte: code i of a byte at bits [bits i, bits (i + 1))
        codes = torch.stack([(packed >> (bits * i)) & mask for i in range(8 // bits)], -1)
        return codes.view(-1)[:n]
    groups = packed.view(-1, bits).long()
    word = groups[:, 0]
    for b in range(1, bits):
        word = word | (groups[:, b] << (8 * b))
    return torch.stack([(word >> (bits * j)) & mask for j in range(8)], -1).to(torch.uint8).view(-1)[:n]
