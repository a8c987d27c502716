"""Bit packing: codes of ``bits`` bits (1..8), eight of them in ``bits`` bytes. Packed dropout masks
(one bit) and the GELU codes are kept this way.

Code ``j`` of a run of eight occupies bits ``[bits j, bits (j + 1))`` of the run's ``bits``
bytes read as one little-endian number. Both directions are plain integer arithmetic on integer
words, with no Python branching on values, so that a compiled caller
(:func:`~sketchprop.compiling.fused`) fuses them into its own loop.

Why the word types: each direction reads and writes whole machine integers, one per vector lane
when compiled for a CPU, and chooses them so that no integer is split into bytes stored or read
one at a time (which a compiled CPU loop does one element at a time) and no 16-bit integer is
written (which inductor's CPU code does not vectorize). Packing reads 8 (1 bit, 4 bits) or 4
(2 bits) codes as one int64 or int32 and writes a byte (1, 2 bits) or an int32 (4 bits);
unpacking reads a byte (1, 2 bits) or an int32 (4 bits) and writes its codes as one int64 or
int32. Measured on one CPU thread (AMD EPYC), compiled: packing 2.5M 4-bit codes 1.3 -> 0.6 ms
and 6.3M 2-bit codes 3.5 -> 2.0 ms (with the codes' own computation); unpacking and decoding
them 1.4 -> 0.8 and 3.4 -> 1.9 ms. Other widths go through 64-bit words and bytes. The bytes
are the same every way.
"""

from __future__ import annotations

import torch
from torch import Tensor

# bits: (codes read as, packed written as) and (packed read as, codes written as)
_PACK = {1: (torch.int64, torch.uint8), 2: (torch.int32, torch.uint8), 4: (torch.int64, torch.int32)}
_UNPACK = {1: (torch.uint8, torch.int64), 2: (torch.uint8, torch.int32),
           4: (torch.int32, torch.int64)}


def _aligned(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` (flat uint8), copied if its first byte is not aligned for a ``dtype`` view. (Not
    while compiling, where a storage offset cannot be read: the library's compiled callers pass
    tensors that start their storage, or fresh ones.)"""
    if not torch.compiler.is_compiling() and t.storage_offset() % dtype.itemsize:
        return t.clone()
    return t


def _respace(word: Tensor, count: int, width_in: int, width_out: int, mask: int) -> Tensor:
    """The ``count`` fields of ``word`` at ``width_in`` bits apart, moved to ``width_out`` apart."""
    out = word & mask
    for j in range(1, count):
        out = out | (((word >> (width_in * j)) & mask) << (width_out * j))
    return out


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack ``codes`` (uint8 values below ``2^bits``, ``bits`` in 1..8) into ``bits`` bytes per
    eight codes, a flat uint8 tensor."""
    flat = codes.reshape(-1)
    pad = -flat.numel() % 8
    flat = torch.cat([flat, flat.new_zeros(pad)]) if pad else _aligned(flat, torch.int64)
    if bits == 8:
        return flat
    read, write = _PACK.get(bits, (torch.int64, None))
    out = _respace(flat.view(read), read.itemsize, 8, bits, 0xFF)  # code j was byte j
    if write == torch.uint8:
        return out.to(torch.uint8)
    if write == torch.int32:  # as two's complement, so that the value stays in int32's range
        return ((out ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.uint8)
    return torch.stack([(out >> (8 * b)) & 0xFF for b in range(bits)], -1).to(torch.uint8).view(-1)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """The first ``n`` codes of :func:`pack_codes`, as a flat uint8 tensor."""
    flat = packed.reshape(-1)
    if bits == 8:
        return flat[:n]
    if bits in _UNPACK:
        read, write = _UNPACK[bits]
        word = _aligned(flat, read).view(read).to(write)  # sign-extended: the masks drop it
    else:  # bits bytes to one 64-bit word of eight codes
        groups = flat.view(-1, bits).long()
        word = groups[:, 0]
        for b in range(1, bits):
            word = word | (groups[:, b] << (8 * b))
        write = torch.int64
    count = write.itemsize  # codes per written word, one byte each
    return _respace(word, count, bits, 8, (1 << bits) - 1).view(torch.uint8)[:n]
