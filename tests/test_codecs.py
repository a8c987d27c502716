"""The fused codecs (``sketchprop.compiling.fused``): compiled, each gives the eager function's
codes; a new batch shape or seed reuses its kernel; without a compiler, or past the variant limit,
it runs eagerly and says so once; ``SKETCHPROP_CODECS=eager`` and ``eager_codecs()`` force eager.

The rest of the suite runs the codecs eagerly (tests/conftest.py); here they are compiled."""

import pytest
import torch

from sketchprop import compiling
from sketchprop import quantize as q
from sketchprop.activations import dropout, gelu, norms
from sketchprop.activations import rows as attention_rows
from sketchprop.activations.seeds import dropout_apply

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def compiled_codecs(monkeypatch):
    monkeypatch.setenv("SKETCHPROP_CODECS", "compiled")
    monkeypatch.setattr(compiling, "_no_compiler", set())


def frames() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def both(fn, *args):
    """``fn(*args)`` compiled (asserting that it compiled or reused a graph) and eagerly."""
    got = fn(*args)
    with compiling.eager_codecs():
        want = fn(*args)
    return got, want


def assert_same(got, want):
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", q.BITS)
def test_quantize_and_dequantize_compiled_are_eager(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    a = (torch.randn(37, 200, generator=g) * 3).to(dtype)  # 200 columns: a padded last group
    got, want = both(lambda: q.quantize(a, bits, 64, seed=11, variance=True))
    assert_same(got[0], want[0])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=0)
    payload, spec, _ = got
    got, want = both(lambda: q.dequantize(payload, spec))
    torch.testing.assert_close(got, want, rtol=2**-23, atol=0)  # a fused multiply-add at most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_masks_compiled_are_eager(dtype):
    x = torch.randn(3, 5, 7).to(dtype)
    key = torch.tensor(123456789)
    dropped, scale = 6554, 65536 / (65536 - 6554)
    assert_same(*both(dropout_apply, x, key, dropped, scale))
    got, want = both(dropout._packed_forward, x, key, dropped, scale)
    assert_same(got, want)
    assert_same(*both(dropout._packed_backward, x, got[1], scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_floors_bit_codes_compiled_are_eager(dtype):
    """The floor's masks and a ReLU output's positive bits (a cast of bools that inductor's CPU
    code could not compile sent every codec eager, a 1.4x step becoming 2x)."""
    from sketchprop.activations import floor

    x = torch.rand(8195).to(dtype)
    x[::3] = 0
    mask = torch.rand(8195) > 0.5
    bits = floor._pack_positive(x)
    assert_same(*both(floor._pack_positive, x))
    assert_same(*both(floor._keep_positive, x, bits))
    assert torch.equal(floor._keep_positive(x, bits) > 0, x > 0)
    packed = floor._pack_mask(mask)
    assert_same(*both(floor._pack_mask, mask))
    assert_same(*both(floor._unpack_mask, packed, mask.numel()))
    assert not compiling._no_compiler  # every one compiled


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_code_compiled_is_eager_but_for_rare_rounding_flips(approximate):
    """The compiled derivative may differ from the eager kernel's in its last bit, and a value
    next to a level boundary then rounds the other way: at most 1 code in 10^4."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * 3
    code, key = gelu.GeluCode.uniform(2), torch.tensor(5)
    got, want = both(gelu._encode, x, key, *code.constants("cpu", "encode"), approximate)
    n = x.numel()
    flips = (gelu.unpack_codes(got, 2, n) != gelu.unpack_codes(want, 2, n)).sum().item()
    assert flips <= n // 10**4, flips
    dy = torch.randn_like(x)
    assert_same(*both(gelu._backward, dy, want, *code.constants("cpu", "decode")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_attention_fingerprints_compiled_are_eager(dtype):
    """Q's fingerprints (the exact recompute's check of the rows it made: an integer sum, so
    compiled must give the very same numbers), on forward's (B, H, L, D) view of (B, L, H, D)."""
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(3, 7, 4, 16, generator=g) * 5).to(dtype).transpose(1, 2)
    assert_same(*both(attention_rows.fingerprint, t))


@pytest.mark.parametrize("kept", [False, True])
def test_layer_norm_backward_from_output_compiled_is_eager_and_native(kept):
    """LayerNorm's backward from its output, compiled, gives the eager function's gradients and
    the native backward's on the input, to float32 rounding (sums reassociated)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 96, generator=g) * 3 + 1
    w, b = torch.randn(96, generator=g) * 0.5 + 1, torch.randn(96, generator=g)
    dy = torch.randn(50, 96, generator=g)
    y, mean, rstd = torch.native_layer_norm(x, (96,), w, b, 1e-5)
    cols = idx = None
    if kept:  # these columns make x^ from the input, not the output
        idx = torch.tensor([0, 7, 95])
        cols, w = x.index_select(-1, idx), w.index_fill(0, idx, 0.0)
        y, mean, rstd = torch.native_layer_norm(x, (96,), w, b, 1e-5)
    args = (dy, y, rstd, w, b, idx, cols, None if idx is None else mean, True, True, True)
    got, want = both(norms._layer_norm_backward, *args)
    native = torch.ops.aten.native_layer_norm_backward(dy, x, (96,), mean, rstd, w, b, [True] * 3)
    for a, e, n in zip(got, want, native, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, n, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("first", ["rows", "columns"])
def test_a_new_shape_or_seed_reuses_the_kernels(first):
    """After two shapes (the second makes a size symbolic), further shapes and seeds compile
    nothing: the rows of two batches, or the widths of one batch's layers (rows fixed, columns
    varying, as a feed-forward block's 768 and 3072), come first. (The quantizer sees one dimension
    of groups: as rows x groups, the widths' order made only the groups symbolic, the next batch
    compiled again, and that kernel indexed the draws by divisions, 2.2x slower.)"""
    torch._dynamo.reset()
    key = torch.tensor(1)
    shapes = ((10, 128), (20, 128)) if first == "rows" else ((10, 128), (10, 512))
    for mask_rows, (rows, cols) in zip((10, 20), shapes, strict=True):
        q.dequantize(*q.quantize(torch.randn(rows, cols), 4, 64, seed=rows)[:2])
        dropout_apply(torch.randn(mask_rows, 48), key, 6554, 1.1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows, cols in ((30, 128), (41, 512), (7, 192)):
            q.dequantize(*q.quantize(torch.randn(rows, cols), 4, 64, seed=rows)[:2])
            dropout_apply(torch.randn(rows, 48), key.add(rows), 6554, 1.1)


def test_without_a_compiler_the_codecs_run_eagerly_after_one_notice():
    f = compiling.fused(lambda x, c: x * c + 1)
    x = torch.randn(9)
    # A compiler that is not there (and no cached kernel to fall back on).
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}):
        with pytest.warns(UserWarning, match="codecs run eagerly on cpu") as record:
            out = f(x, 2.5)
        assert len(record) == 1
        assert torch.equal(out, x * 2.5 + 1)
        assert "cpu" in compiling._no_compiler
        before = frames()
        assert torch.equal(f(x, 3.5), x * 3.5 + 1)  # eager from now on, without a word
        assert frames() == before


def test_past_the_variant_limit_new_variants_run_eagerly(monkeypatch):
    monkeypatch.setitem(compiling._SETTINGS, "recompile_limit", 1)
    f = compiling.fused(lambda x, c: x * c)
    x = torch.randn(5)
    assert torch.equal(f(x, 2.0), x * 2.0)
    with pytest.warns(UserWarning, match="compiled variants; new ones run eagerly"):
        assert torch.equal(f(x, 3.0), x * 3.0)


def test_the_switch_forces_eager_and_names_itself(monkeypatch):
    f = compiling.fused(lambda x: x.exp() + 1)
    x = torch.randn(4)
    before = frames()
    monkeypatch.setenv("SKETCHPROP_CODECS", "eager")
    assert torch.equal(f(x), x.exp() + 1)
    monkeypatch.setenv("SKETCHPROP_CODECS", "compiled")
    with compiling.eager_codecs():
        assert torch.equal(f(x), x.exp() + 1)
    assert frames() == before
    monkeypatch.setenv("SKETCHPROP_CODECS", "fast")
    with pytest.raises(ValueError, match="SKETCHPROP_CODECS must be 'compiled' or 'eager'"):
        f(x)


@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_edge_inputs(mode, monkeypatch):
    """No rows to code (every row padding) and codes in a slice that starts mid-word."""
    monkeypatch.setenv("SKETCHPROP_CODECS", mode)
    payload, spec, var = q.quantize(torch.randn(0, 100), 4, 64, seed=1, variance=True)
    assert q.dequantize(payload, spec).shape == (0, 100) and var.shape == (0,)
    codes = torch.randint(0, 8, (41,), dtype=torch.uint8)
    for bits in (3, 4):
        assert torch.equal(gelu.unpack_codes(gelu.pack_codes(codes[1:], bits), bits, 40), codes[1:])


def test_fitted_gelu_codes_share_one_kernel():
    """Each module fits a deterministic code of its own; its thresholds and levels reach the
    kernel as tensors, so a second module's code compiles nothing new, and compiled decodes as
    eager."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    codes = [gelu.GeluCode.fit(x * s, 2) for s in (1.0, 2.0, 3.0)]
    assert len(set(codes)) == 3
    dy = torch.randn_like(x)

    def step(code):
        packed = gelu._encode(x, None, *code.constants("cpu", "encode"), "none")
        return packed, gelu._backward(dy, packed, *code.constants("cpu", "decode"))

    for code in codes[:2]:
        got = step(code)
        with compiling.eager_codecs():
            assert_same(got, step(code))
        assert torch.equal(got[1], dy * code.decode(code.encode(gelu.gelu_derivative(x))))
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(codes[2])


# Inputs as models hand them over: a slice (a BERT pooler's hidden_states[:, 0]), a transpose,
# an expanded view, a slice with a column stride, one row, no rows.
LAYOUTS = {
    "slice": lambda x: x[:, 0],
    "transposed": lambda x: x[:, 0].t().contiguous().t(),
    "expanded": lambda x: x[:1, 0].expand(5, -1),
    "column-stride": lambda x: x[:, :2, :].transpose(1, 2).reshape(6, -1)[:, ::2],
    "one-row": lambda x: x[0, 0:1],
    "no-rows": lambda x: x[0, 0:0],
}


# Eager at three widths (one group, two, a padded last group); compiled at two groups (each
# layout compiles its own kernels: a minute in all).
@pytest.mark.parametrize("mode, cols", [("eager", 64), ("eager", 128), ("eager", 200),
                                        ("compiled", 128)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_codec_takes_any_layout_as_its_contiguous_copy(mode, layout, cols, monkeypatch):
    """Each codec, given a strided, transposed or expanded input, codes what it codes of the
    input's contiguous copy, byte for byte (the b-bit rows crashed on a strided input wider than
    one group)."""
    monkeypatch.setenv("SKETCHPROP_CODECS", mode)
    g = torch.Generator().manual_seed(cols)
    a = LAYOUTS[layout](torch.randn(6, 3, cols, generator=g) * 2)
    assert a.shape[-1] == cols and (a.shape[0] <= 1 or not a.is_contiguous())
    c = a.contiguous()
    key = torch.tensor(9)
    for bits in q.BITS:
        got, want = q.quantize(a, bits, 64, seed=3, variance=True), q.quantize(c, bits, 64, seed=3,
                                                                             variance=True)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=0)  # sums reassociated
        assert torch.equal(q.dequantize(*got[:2]), q.dequantize(*want[:2]))
    code = gelu.GeluCode.uniform(2)
    packed = gelu._encode(a, key, *code.constants("cpu", "encode"), "none")
    assert torch.equal(packed, gelu._encode(c, key, *code.constants("cpu", "encode"), "none"))
    assert torch.equal(gelu._backward(a, packed, *code.constants("cpu", "decode")),
                       gelu._backward(c, packed, *code.constants("cpu", "decode")))
    assert_same(dropout._packed_forward(a, key, 6554, 1.1), dropout._packed_forward(c, key, 6554,
                                                                                  1.1))
    assert torch.equal(dropout_apply(a, key, 6554, 1.1), dropout_apply(c, key, 6554, 1.1))
