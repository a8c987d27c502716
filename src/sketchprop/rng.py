r"""Counter-based random bits (Philox-4x32-10) in plain torch integer ops: the same bits eager,
under ``torch.compile`` and on any device.

The library's random draws (sketches, the stochastic rounding of ``b``-bit codes, dropout masks,
the GELU code's rounding) come from stateful ``torch.Generator`` objects seeded with Python ints.
A compiled graph guards on such an int, so it recompiles at every new seed, and the generators'
bits differ between devices. This module computes random bits as a *pure function* of tensors:

    word i = Philox-4x32-10(counter = (block, call), key = stream key)[lane],  block = i // 4, lane = i % 4

where the stream key hashes (run seed, stream name, rank) and ``call`` counts a stream's calls.
The key and the call counter are 0-d int64 **tensors**, so a compiled graph takes them as inputs
and does not guard on their values: a new step, seed or rank reuses the graph. Nothing here
holds state; a caller keeps a counter per stream and advances it (``counter.add_(1)``).

**The generator.** Philox-4x32 with 10 rounds, the default of Random123 (Salmon, Moraes, Dror and
Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011), which is also cuRAND's
``Philox4_32_10`` and the generator behind PyTorch's own CUDA random ops. It maps a 128-bit
counter and a 64-bit key to 128 bits through 10 rounds of two 32x32->64-bit multiplications, xors
and a Weyl-sequence key schedule. Chosen over the paper's other hash, Threefry, because it is the
widely used one (known-answer vectors everywhere) and needs only multiply, shift, and, xor, add:
torch integer ops that every backend (CPU, CUDA, inductor's C++ and Triton code) computes
exactly. The words are held in int64 tensors with values in ``[0, 2^32)``; the 32x32-bit products
are split into two 32x16-bit products (each below 2^48), so no int64 ever overflows and no
signedness question arises. The known-answer vectors of Random123's ``tests/kat_vectors`` are
checked in ``tests/test_rng.py``. A call costs about 260 int64 operations per block of 4 words:
eager, each is a pass over memory; compiled, they fuse into one loop (one kernel).

**Statistical properties** (from the paper, and checked at small scale in the tests):

- Philox-4x32 passes TestU01's BigCrush from 7 rounds on, with the structured inputs the paper
  feeds it (counters that count up, many streams of neighbouring keys); 10 rounds is the safety
  margin the authors recommend and Random123 ships.
- For a fixed key, Philox is a bijection of the 128-bit counter: the blocks of one stream never
  repeat over its 2^64 calls of up to 2^66 words each, and its words are equidistributed over a
  full period.
- Streams differ by their 64-bit key (a blake2b hash of seed, name and rank): two of ``m``
  streams share a key with probability about ``m^2 / 2^65``; bits of different keys, different
  calls or different elements are, as far as the tests of the paper can tell, independent.
- :func:`uniform` gives ``k 2^-b`` with ``k`` uniform on ``[0, 2^b)`` and ``b`` the float type's
  significand width (24 for float32, 8 for bfloat16, 11 for float16, 32 for float64): every value
  is exact in the type (no rounding up to 1), the mean is ``1/2 - 2^-(b+1)``, and
  ``P(u < p) = ceil(p 2^b) 2^-b``: a stochastic rounding ``floor(t) + (u < frac(t))`` rounds up
  with the probability ``frac(t)`` rounded up to the ``2^-b`` grid, ``floor(t + u)`` with it
  rounded down (both exact when ``frac(t)`` lies on the grid).

**Bit layout** (the same on every device; ``tests/test_rng.py`` checks it against a pure-Python
Philox):

- key: ``K = stream_key(seed, name, rank)``, the 64-bit blake2b digest of
  ``f"{seed}/{name}/{rank}"`` read little-endian as a signed int64;
  Philox key words ``k0 = K mod 2^32``, ``k1 = (K >> 32) mod 2^32``.
- counter: call ``C`` (an int64, taken mod 2^64) and word index ``i``, block ``j = i // 4``:
  counter words ``(c0, c1, c2, c3) = (j mod 2^32, j >> 32, C mod 2^32, (C >> 32) mod 2^32)``.
- :func:`random_bits` word ``i`` is output word ``i % 4`` of block ``j`` (Random123's order).
  Element ``i`` depends on ``(key, call, i)`` alone: ``random_bits(k, c, 10)[:5] ==
  random_bits(k, c, 5)``, whatever the shape asked for or the order of the calls.
- :func:`uniform` element ``i`` (of the flattened shape, row-major) is
  ``(word_i >> (32 - b)) 2^-b``.
- :func:`random_uint16` of ``n`` elements, ``m = ceil(n / 2)``: element ``i < m`` is the low
  half of word ``i``, element ``m + i`` its high half; :func:`random_int16` reads each as a
  two's-complement int16 and :func:`dither16` as ``(half + 1/2) 2^-16``. (These depend on ``n``
  as well as ``i``.) :func:`map_uint16` gives element ``i`` of a tensor of ``n`` elements the same
  half, computed half by half so that compiled code never stores the draws.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the key schedule's Weyl increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10


def stream_key(seed: int, name: str, rank: int = 0, device=None) -> Tensor:
    """The 64-bit key of stream ``name`` of run ``seed`` on distributed ``rank``, as a 0-d int64
    tensor: the blake2b digest of ``f"{seed}/{name}/{rank}"`` (the same in every process, unlike
    ``hash``). Computed once per stream, in Python; what a compiled graph sees is the tensor."""
    digest = hashlib.blake2b(f"{seed}/{name}/{rank}".encode(), digest_size=8).digest()
    return torch.tensor(int.from_bytes(digest, "little", signed=True), dtype=torch.int64,
                        device=device)


def stable_seed(*parts) -> int:
    """A 63-bit seed from the parts, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def process_rank() -> int:
    """This process's rank in the default process group; 0 without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class SeedStream:
    """One module's seeds, one per call: a ``torch.Generator`` seeded with
    ``stable_seed(kind, torch.initial_seed(), name, rank)``, never the global one. The rank is read
    at every draw: a stream begun before the process group existed was rank 0's on every process,
    and kept, the ranks' rounding noise would no longer average out."""

    def __init__(self, kind: str, name: str = ""):
        self.kind, self.name = kind, name
        self._gen: torch.Generator | None = None
        self._rank: int | None = None  # the rank ``_gen`` was seeded for

    def next(self) -> int:
        rank = process_rank()
        if self._gen is None or self._rank != rank:
            self._gen = torch.Generator().manual_seed(
                stable_seed(self.kind, torch.initial_seed(), self.name, rank))
            self._rank = rank
        return int(torch.randint(0, 2**62, (), generator=self._gen))


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The high and low 32-bit words of ``a * m`` (``a`` in ``[0, 2^32)``, ``m`` a 32-bit
    constant), from two products below 2^48 so that int64 never overflows."""
    p_hi = a * (m >> 16)
    p_lo = a * (m & 0xFFFF)
    t = ((p_hi & 0xFFFF) << 16) + p_lo  # a * m = (p_hi >> 16) 2^32 + t, t < 2^49
    return (p_hi >> 16) + (t >> 32), t & MASK32


def _rounds(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS) -> tuple[Tensor, ...]:
    """Philox-4x32's rounds on counter words ``c0..c3`` under key words ``k0, k1`` (int64 tensors
    of words in ``[0, 2^32)``, broadcast together): the four output words. Words are passed one
    by one, never stacked, so that a compiled caller fuses the whole of it into one loop."""
    for r in range(rounds):
        if r:  # the key schedule: bumped before every round but the first
            k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32(counter: Tensor, key: Tensor, rounds: int = ROUNDS) -> Tensor:
    """Philox-4x32 of ``counter`` (int64, shape ``(..., 4)``) under ``key`` (int64, ``(..., 2)``,
    broadcast against the counter), both as words in ``[0, 2^32)``: int64 words ``(..., 4)`` in
    ``[0, 2^32)``, Random123's ``philox4x32_R(rounds, counter, key)``."""
    words = _rounds(*counter.unbind(-1), *key.unbind(-1), rounds)
    return torch.stack(torch.broadcast_tensors(*words), -1)


def random_bits(key: Tensor, counter: Tensor | int, n: int, device=None) -> Tensor:
    """``n`` random 32-bit words (int64 values in ``[0, 2^32)``) of stream ``key`` (a 0-d int64
    tensor, :func:`stream_key`) at call ``counter`` (a 0-d int64 tensor; an int works too, but a
    compiled graph then guards on its value), on ``device`` (default: the key's). Word ``i`` is
    word ``i % 4`` of the Philox block at counter ``(i // 4, counter)`` (the module docstring)."""
    key = torch.as_tensor(key, dtype=torch.int64, device=device)
    counter = torch.as_tensor(counter, dtype=torch.int64, device=key.device)
    block = torch.arange(-(-n // 4), dtype=torch.int64, device=key.device)
    words = _rounds(block & MASK32, block >> 32, counter & MASK32, (counter >> 32) & MASK32,
                    key & MASK32, (key >> 32) & MASK32)
    return torch.stack(torch.broadcast_tensors(*words), -1).flatten()[:n]


def uniform(key: Tensor, counter: Tensor | int, shape, device=None,
            dtype: torch.dtype = torch.float32) -> Tensor:
    """Uniform draws on ``[0, 1)`` of ``shape`` and ``dtype``: ``k 2^-b`` with ``k`` the top ``b``
    bits of a :func:`random_bits` word and ``b`` the type's significand width (24 for float32,
    at most 32), so that every value, 1 - 2^-b included, is exact in ``dtype``."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    b = min(1 - round(math.log2(torch.finfo(dtype).eps)), 32)  # eps = 2^(1 - b)
    words = random_bits(key, counter, math.prod(shape), device)
    # k < 2^b is exact in dtype, and so is the power-of-two scale: no rounding anywhere
    return ((words >> (32 - b)).to(dtype) * 2.0 ** -b).view(shape)


def random_uint16(key: Tensor, counter: Tensor | int, n: int, device=None) -> Tensor:
    """``n`` uniform 16-bit integers (int64 values in ``[0, 2^16)``), two from each of the first
    ``m = ceil(n / 2)`` :func:`random_bits` words: element ``i < m`` is the low half of word ``i``,
    element ``m + i`` its high half. What the stochastic rounding of the codes and the dropout
    masks draw. (Halves side by side, rather than interleaved, so that a compiled caller loads
    them contiguously, which a CPU compiler vectorizes.)"""
    words = random_bits(key, counter, -(-n // 2), device)
    return torch.cat((words & 0xFFFF, words >> 16))[:n]


def random_int16(key: Tensor, counter: Tensor | int, n: int, device=None) -> Tensor:
    """``n`` uniform 16-bit integers (int16, every value of ``[-2^15, 2^15)`` equally likely):
    :func:`random_uint16`'s halves read as two's complement."""
    halves = random_uint16(key, counter, n, device)
    return ((halves ^ 0x8000) - 0x8000).to(torch.int16)  # two's complement without a branch


def map_uint16(fn, x: Tensor, key: Tensor, counter: Tensor | int) -> Tensor:
    """``fn(x.reshape(-1), random_uint16(key, counter, x.numel()))`` in the shape of ``x``, for an
    elementwise ``fn``, computed half by half: the first ``m = ceil(n / 2)`` elements with the
    words' low halves, the rest with their high halves. The same values; but a compiled caller
    reads each word once and never stores the draws as int64 (:func:`random_uint16`'s ``cat``),
    which took about a fifth of the compiled 4-bit quantizer's time on a CPU."""
    n = x.numel()
    m = -(-n // 2)
    words = random_bits(key, counter, m, x.device)
    flat = x.reshape(-1)
    return torch.cat((fn(flat[:m], words & 0xFFFF), fn(flat[m:], (words >> 16)[:n - m]))).view(x.shape)


def dither_of(r: Tensor) -> Tensor:
    """The float32 draws ``(r + 1/2) 2^-16`` of 16-bit integers ``r``: uniform on a 16-bit grid
    strictly inside ``(0, 1)``, mean exactly 1/2. ``floor(t + u)`` then rounds ``t`` up with
    probability ``frac(t)`` rounded to the nearest multiple of 2^-16: an error in
    ``E[floor(t + u)]`` of at most 2^-17 (before the float32 rounding of ``t + u``)."""
    return (r.float() + 0.5) * 2.0 ** -16


def dither16(key: Tensor, counter: Tensor | int, n: int, device=None) -> Tensor:
    """``n`` float32 draws :func:`dither_of` ``r`` with ``r`` from :func:`random_uint16`."""
    return dither_of(random_uint16(key, counter, n, device))
