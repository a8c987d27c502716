"""sketchprop.rng: Philox-4x32-10 against Random123's known answers and a pure-Python Philox (the
bit layout), uniform and independent bits (seeds, streams, calls, ranks), element ``i`` independent
of the shape asked for, the same bits eager and compiled without a recompile per seed, and on
CUDA as on the CPU.

The statistical tests use a fixed seed, so they pass or fail deterministically; each bound is the
quantile of the statistic's distribution at a false-alarm rate of FALSE_ALARM per statistic."""

import hashlib
import math

import pytest
import torch
from scipy import stats

from sketchprop.rng import (
    MASK32,
    dither16,
    dither_of,
    map_uint16,
    philox4x32,
    random_bits,
    random_int16,
    random_uint16,
    stream_key,
    uniform,
)

FALSE_ALARM = 1e-6
N = 1 << 20  # draws for the uniformity and independence tests
Z = stats.norm.isf(FALSE_ALARM / 2)  # two-sided bound, in standard errors

# Random123's tests/kat_vectors (github.com/DEShawResearch/random123), the three "philox4x32 10"
# lines: counter (4 words), key (2 words), expected output (4 words).
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),  # pi's digits
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def reference_philox(counter, key, rounds=10):
    """Philox-4x32 in Python ints, written from Salmon et al. (2011) / Random123's philox.h."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def reference_words(key: int, call: int, n: int) -> list[int]:
    """The module docstring's layout, in Python ints: word i is word i % 4 of the block at
    counter (i // 4, call) under the key's two halves."""
    k, c = key % 2**64, call % 2**64
    words = []
    for j in range(-(-n // 4)):
        words += reference_philox((j & MASK32, j >> 32, c & MASK32, c >> 32), (k & MASK32, k >> 32))
    return words[:n]


def words(*ws):
    return torch.tensor(ws, dtype=torch.int64)


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_known_answers(counter, key, expected):
    assert reference_philox(counter, key) == expected
    assert philox4x32(words(*counter), words(*key)).tolist() == list(expected)


def test_batched_blocks_match_the_reference():
    g = torch.Generator().manual_seed(0)
    counters = torch.randint(0, 2**32, (64, 4), generator=g)
    keys = torch.randint(0, 2**32, (64, 2), generator=g)
    out = philox4x32(counters, keys)
    for c, k, o in zip(counters.tolist(), keys.tolist(), out.tolist(), strict=True):
        assert tuple(o) == reference_philox(c, k)


def test_stream_key_is_the_documented_hash():
    digest = hashlib.blake2b(b"7/encoder.layer.3.output.dense/2", digest_size=8).digest()
    key = stream_key(7, "encoder.layer.3.output.dense", rank=2)
    assert key.dtype == torch.int64 and key.dim() == 0
    assert key.item() == int.from_bytes(digest, "little", signed=True)
    assert stream_key(7, "x").item() == stream_key(7, "x", 0).item() != stream_key(7, "x", 1).item()


@pytest.mark.parametrize("call", [0, 5, 2**32 + 3, -1])  # -1: both call words 0xffffffff
def test_bit_layout(call):
    key = stream_key(7, "encoder.layer.3.output.dense", rank=2)
    n = 23
    expected = reference_words(key.item(), call, n)
    assert random_bits(key, torch.tensor(call), n).tolist() == expected
    for m in (n, n - 1):  # 2n and 2n - 1 halves: low halves of the n words, then high halves
        halves = ([w & 0xFFFF for w in expected] + [w >> 16 for w in expected])[:n + m]
        assert random_uint16(key, call, n + m).tolist() == halves
        assert random_int16(key, call, n + m).tolist() == [h - 2**16 if h >= 2**15 else h
                                                           for h in halves]
        assert dither16(key, call, n + m).tolist() == [(h + 0.5) * 2.0**-16 for h in halves]
        # half by half: element i meets draw i, and the result keeps the input's shape
        x = torch.arange(n + m).view(-1, 1)
        out = map_uint16(lambda x, r: x * 2**16 + r, x, key, call)
        assert out.shape == x.shape and out.view(-1).tolist() == [i * 2**16 + h for i, h in enumerate(halves)]
    assert uniform(key, call, n).tolist() == [(w >> 8) * 2.0**-24 for w in expected]


def test_element_i_does_not_depend_on_the_shape_or_the_call_order():
    key, call = stream_key(1, "a"), torch.tensor(9)
    assert torch.equal(random_bits(key, call, 10)[:5], random_bits(key, call, 5))
    assert torch.equal(random_bits(key, call, 4097)[:4093], random_bits(key, call, 4093))
    assert torch.equal(uniform(key, call, (3, 4)), uniform(key, call, 12).view(3, 4))
    later_first = [random_bits(key, c, 6) for c in (3, 2, 1)][::-1]
    assert_same(later_first, [random_bits(key, c, 6) for c in (1, 2, 3)])


@pytest.mark.parametrize("dtype, b", [(torch.float32, 24), (torch.float64, 32), (torch.float16, 11),
                                      (torch.bfloat16, 8)])
def test_uniform_is_exact_in_its_type(dtype, b):
    key = stream_key(2, "u")
    u = uniform(key, 0, 1 << 14, dtype=dtype)
    k = random_bits(key, 0, 1 << 14) >> (32 - b)
    assert u.dtype == dtype and torch.equal(u.double(), k.double() * 2.0**-b)
    assert u.max() < 1 and u.min() >= 0
    if b <= 11:  # the top of the grid is reached, and stays below 1 in the type
        assert u.max().item() == 1 - 2.0**-b


@pytest.fixture(scope="module")
def draws():
    """N words of one stream."""
    return random_bits(stream_key(0, "uniformity"), torch.tensor(0), N)


def chi_square(values: torch.Tensor, bins: int) -> float:
    counts = torch.bincount(values, minlength=bins).double()
    expected = values.numel() / bins
    return ((counts - expected).square() / expected).sum().item()


def test_uniform_over_256_bins(draws):
    """Chi-square over 256 bins of N draws, bound at FALSE_ALARM per statistic: of the words' top
    byte, low byte, of uniform() and of the int16 helper's high byte."""
    bound = stats.chi2.isf(FALSE_ALARM, 255)
    key = stream_key(0, "uniformity")
    for name, v in [("top byte", draws >> 24), ("low byte", draws & 0xFF),
                    ("uniform", (uniform(key, 1, N) * 256).long()),
                    ("int16 high byte", (random_int16(key, 2, N).long() + 2**15) >> 8)]:
        assert chi_square(v, 256) < bound, name


def test_every_bit_is_balanced(draws):
    ones = torch.tensor([((draws >> s) & 1).sum().item() for s in range(32)], dtype=torch.float64)
    assert ((ones - N / 2).abs() / math.sqrt(N / 4)).max() < Z


def test_no_serial_correlation_within_a_stream(draws):
    """Words 1 to 8 apart (other lanes of a block, and the next blocks) are uncorrelated."""
    x = draws.double() / 2**32 - 0.5
    for lag in range(1, 9):
        r = torch.corrcoef(torch.stack([x[:-lag], x[lag:]]))[0, 1].item()
        assert abs(r) < Z / math.sqrt(N - lag), lag


def test_streams_that_differ_in_one_input_are_independent():
    """Seed, stream name, rank and call count: each changed alone gives words uncorrelated with
    the base stream's (within Z standard errors 1/sqrt(n)), each of whose bits differs from the
    base's half the time, and no more equal words at equal indices than chance (n 2^-32 expected;
    3 or more has probability below 1e-11)."""
    n = N // 4
    base = dict(seed=0, name="layer.0", rank=0, call=0)
    variants = [dict(base, seed=1), dict(base, name="layer.1"), dict(base, rank=1), dict(base, call=1),
                dict(base, call=2**32)]

    def draw(seed, name, rank, call):
        return random_bits(stream_key(seed, name, rank), torch.tensor(call), n)

    a = draw(**base)
    for v in variants:
        b = draw(**v)
        r = torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1].item()
        assert abs(r) < Z / math.sqrt(n), v
        x = a ^ b
        differ = torch.tensor([((x >> s) & 1).sum().item() for s in range(32)], dtype=torch.float64)
        assert ((differ - n / 2).abs() / math.sqrt(n / 4)).max() < Z, v
        assert (a == b).sum().item() <= 2, v


def draw_all(key, call):
    """What the compiled tests draw: every helper, bfloat16 uniforms included."""
    return (random_bits(key, call, 10), uniform(key, call, (2, 3)),
            uniform(key, call, 5, dtype=torch.bfloat16), random_int16(key, call, 5),
            random_uint16(key, call, 7), dither16(key, call, 9),
            map_uint16(lambda x, r: x + dither_of(r), torch.arange(11.0).view(11, 1), key, call))


def assert_same(a, b):
    assert all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b, strict=True))


@pytest.mark.compile
def test_compiled_gives_the_same_bits_without_recompiling():
    """Inductor on the CPU: the eager bits, and one graph for every seed, stream, rank and call."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(draw_all, backend="inductor", fullgraph=True)
    cases = [(stream_key(0, "a"), torch.tensor(0)), (stream_key(1, "b", rank=3), torch.tensor(2**40 + 7)),
             (stream_key(2, "a"), torch.tensor(-1))]
    # compile_threads=1: no pool of compile workers to start for one small kernel
    with torch._dynamo.config.patch(error_on_recompile=True), torch._inductor.config.patch(compile_threads=1):
        for key, call in cases:
            assert_same(compiled(key, call), draw_all(key, call))
            call.add_(1)  # a counter advanced in place, as a stream's would be
            assert_same(compiled(key, call), draw_all(key, call))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_cpu_bits():
    key, call = stream_key(3, "x", rank=1), torch.tensor(2**33 + 5)
    n = 4099
    cpu = random_bits(key, call, n)
    assert torch.equal(random_bits(key.cuda(), call.cuda(), n).cpu(), cpu)
    assert torch.equal(random_bits(key, call, n, device="cuda").cpu(), cpu)  # a CPU key, moved
    assert_same(draw_all(key.cuda(), call.cuda()), draw_all(key, call))


@pytest.mark.compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_on_cuda_gives_the_cpu_bits():
    torch._dynamo.reset()
    compiled = torch.compile(draw_all, backend="inductor", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, call in [(0, 0), (1, 2**40 + 7)]:
            key = stream_key(seed, "a")
            assert_same(compiled(key.cuda(), torch.tensor(call, device="cuda")), draw_all(key, call))
