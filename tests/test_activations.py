"""Compact activations (sketchprop.activations, patch_activations): exact where they can be
(seeded and packed dropout, recomputed attention), unbiased or measured where not (GELU codes);
reversible, composable with patch_linear, checkpointing and autocast, on BERT and RoBERTa."""

import copy
import math

import pytest
import torch
from scipy import stats
from test_patching import batch, tiny_roberta
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import BertConfig, BertForSequenceClassification

from sketchprop import SKETCHES, patch_activations, patch_linear, unpatch_activations, unpatch_linear
from sketchprop import activations as act
from sketchprop.codes import make_code
from sketchprop.compiling import fused
from sketchprop.functional import seed_tensor
from sketchprop.measure import SavedTensorMeter

pytestmark = pytest.mark.usefixtures("one_thread")

FALSE_ALARM = 1e-4


def tiny_bert(layers=2, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, num_labels=2,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(cfg)


MODELS = {"roberta": tiny_roberta, "bert": tiny_bert}


def grads(model, b, checkpointing=False):
    model.train()
    model.zero_grad(set_to_none=True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    out = model(**b)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(a, b, rtol=1e-5, atol=1e-6):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=rtol, atol=atol, msg=name)


# ---------------------------------------------------------------------------------------------
# Pieces.


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 8, 13, 1000])
def test_pack_unpack_round_trip(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(bits))
    packed = act.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8) * bits
    assert torch.equal(act.unpack_codes(packed, bits, n), codes)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("bits", range(1, 9))
def test_packed_bytes_follow_the_documented_layout(bits, compiled):
    # Code j of a run of eight at bits [bits j, bits (j + 1)) of the run's bytes read as one
    # little-endian number, whatever word type packs or unpacks it; a slice that does not start
    # its storage unpacks too.
    n = 29
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(bits))
    want = []
    padded = codes.tolist() + [0] * (-n % 8)
    for r in range(0, len(padded), 8):
        number = sum(c << (bits * j) for j, c in enumerate(padded[r:r + 8]))
        want += list(number.to_bytes(bits, "little"))
    pack, unpack = act.pack_codes, act.unpack_codes
    if compiled:
        pack, unpack = fused(pack), fused(unpack)
    packed = pack(codes, bits)
    assert packed.tolist() == want
    assert torch.equal(unpack(packed, bits, n), codes)
    if not compiled:
        shifted = torch.cat([packed.new_zeros(1), packed])[1:]
        assert torch.equal(unpack(shifted, bits, n), codes)


def test_keep_mask_rate_and_reproducibility():
    p, n = 0.1, 400_000
    keep = act.keep_mask((n,), p, seed=7, device="cpu")
    assert torch.equal(keep, act.keep_mask((n,), p, seed=7, device="cpu"))
    assert not torch.equal(keep, act.keep_mask((n,), p, seed=8, device="cpu"))
    q = 1 - round(p * 65536) / 65536  # the keep probability after rounding to 16 bits
    threshold, scale = act.seeds._drop_threshold(p)
    assert scale * q == pytest.approx(1.0, abs=1e-12)
    z = (keep.double().mean().item() - q) / (q * (1 - q) / n) ** 0.5
    assert abs(z) < stats.norm.isf(FALSE_ALARM / 2)
    # Each of the four 16-bit lanes of a 64-bit word keeps at the same rate.
    lanes = keep.view(-1, 4).double().mean(0)
    assert (lanes - q).abs().max() < 5 * (q * (1 - q) / (n / 4)) ** 0.5


@pytest.mark.parametrize("kind", [act.SeededDropout, act.PackedDropout])
def test_dropout_forward_and_backward_use_one_mask(kind):
    drop = kind(0.5)
    x = torch.randn(6, 50).abs().add_(0.1).requires_grad_(True)  # no zeros: y == 0 means dropped
    g = torch.randn(6, 50)
    y = drop(x)
    y.backward(g)
    keep = y.detach() != 0
    scale = act.seeds._drop_threshold(0.5)[1]
    assert 0.3 < keep.float().mean() < 0.7
    torch.testing.assert_close(y.detach(), x.detach() * keep * scale, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, g * keep * scale, rtol=0, atol=0)
    drop.eval()
    assert drop(x) is x


@pytest.mark.stack("ckpt-reentrant", "compact")
@pytest.mark.stack("ckpt-nonreentrant", "compact")
@pytest.mark.parametrize("kind", [act.SeededDropout, act.PackedDropout])
@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_under_checkpointing_makes_the_same_mask(kind, reentrant):
    """The recomputed forward draws the seed the first forward drew (checkpointing restores the
    generator it is drawn from), so the gradient equals the one of the same forward without
    checkpointing; a mask drawn anew in the recomputation would differ."""
    torch.manual_seed(0)
    block = nn.Sequential(kind(0.5), nn.Tanh(), nn.Linear(40, 40))
    x = torch.randn(8, 40)
    out = []
    for ck in (True, False):
        xx = x.clone().requires_grad_(True)
        block.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        y = checkpoint(block, xx, use_reentrant=reentrant) if ck else block(xx)
        y.square().sum().backward()
        out.append((y.detach(), xx.grad, block[2].weight.grad))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def reference_attention(q, k, v, mask, scaling, p, seed):
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, -1)
    if p > 0:
        probs = probs * act.keep_mask(probs.shape, p, seed, "cpu") * act.seeds._drop_threshold(p)[1]
    return probs @ v


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_recomputed_attention_is_exact(p):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
               for _ in range(3))
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    mask[1, ..., 5:] = False  # padding keys of the second sequence
    seed = seed_tensor(123)
    out = act.attention._RecomputedAttention.apply(q, k, v, mask, 0.5, p, seed)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = reference_attention(q, k, v, mask, 0.5, p, 123)
    want = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shape", [(1, 3, 7, 7), (2, 3, 7, 7), (2, 1, 1, 7)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_recomputed_attention_passes_the_gradient_of_its_bias(p, shape):
    """An additive bias (T5's learned relative position bias: one per head, shared by the batch)
    is added to the scores and gets its gradient, summed over what it was broadcast along."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
               for _ in range(3))
    bias = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_(True)
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    mask[1, ..., 5:] = False
    out = act.attention._RecomputedAttention.apply(q, k, v, mask, 0.5, p, seed_tensor(7), bias)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, bias), g)
    scores = (q @ k.transpose(-1, -2)) * 0.5 + bias
    probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), -1)
    if p > 0:
        probs = probs * act.keep_mask(probs.shape, p, 7, "cpu") * act.seeds._drop_threshold(p)[1]
    want = torch.autograd.grad(probs @ v, (q, k, v, bias), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_an_attention_input_it_would_leave_out_refuses(monkeypatch):
    """A model whose attention takes an input recompute_attention does not read refuses at patch
    time, naming it (asked for), or keeps its attention (by default); a floating tensor passed
    at call time that it does not read raises, naming it."""
    from transformers.models.bert import modeling_bert

    def eager_with_bias(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        learned_bias=None, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_bert, "eager_attention_forward", eager_with_bias)
    with pytest.raises(ValueError, match="takes 'learned_bias'"):
        patch_activations(tiny_bert(), attention="recompute")
    model = tiny_bert()
    assert "bert.encoder.layer.0.attention.self.dropout" in patch_activations(model)
    assert model.config._attn_implementation != act.ATTENTION_NAME
    monkeypatch.undo()
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="'alibi'.*pass attention='stored'"):
        act.recompute_attention(nn.Module(), q, q, q, None, alibi=torch.zeros(1, 2, 3, 3),
                                num_items_in_batch=torch.tensor(3.0))


# Q, K and V each the whole output of its own projection (source, first column, columns, no norm).
SLICES = ((0, 0, 8, None), (1, 0, 8, None), (2, 0, 8, None))


def padded_attention(case: str, monkeypatch, rounding=None):
    """A two-sequence batch for :class:`_ProjectedAttention` whose second sequence has two padding
    rows, with ``F.linear`` applied row by row (so that a product over fewer rows gives the same
    bits, whatever BLAS does) or, with ``rounding``, moved one float step where it gets fewer
    rows than the batch's 12. Returns ``(x, pairs, q, k, v, mask, dout, seed, seen)``, ``seen``
    the rows of each ``F.linear`` call from then on."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 8, generator=gen)
    pairs = [(torch.randn(8, 8, generator=gen), torch.randn(8, generator=gen)) for _ in range(3)]
    seen, linear = [], torch.nn.functional.linear

    def by_row(t, w, b=None):
        flat = t.reshape(-1, t.shape[-1])
        seen.append(flat.shape[0])
        out = torch.stack([linear(r, w, b) for r in flat])
        if rounding and flat.shape[0] < 12:
            out[0, 0] = out[0, 0].nextafter(torch.tensor(math.inf))
        return out.view(*t.shape[:-1], -1)

    monkeypatch.setattr(torch.nn.functional, "linear", by_row)
    q, k, v = (act.attention._as_heads(act.attention._linear_rows(x, w, b, torch.float32), 4)
               .requires_grad_(True) for w, b in pairs)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[1, ..., 4:] = False  # padding keys of the second sequence
    if case == "blind query":
        mask[1, :, 3] = False  # a live query of the second sequence that may attend to no key
    if case == "float mask":
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    dout = torch.randn(2, 2, 6, 4, generator=gen)
    dout[1, :, 4:] = 0  # padding queries get no gradient
    seen.clear()
    return x, pairs, q, k, v, mask, dout, seed_tensor(7), seen


@pytest.mark.parametrize("case", ["padded", "float mask", "blind query"])
def test_recompute_projects_only_the_rows_backward_reads(case, monkeypatch):
    """Backward makes Q, K, V again only for live queries and attendable keys (10 of 12 rows here:
    the second sequence's two padding rows are neither), unless a live query can attend to no key,
    whose softmax then reads every key of its sequence (12). From the exact block input its
    gradients are those of keeping Q, K, V, bit for bit; from a code of it, those of projecting
    every row of the code, to float rounding."""
    x, pairs, q, k, v, mask, dout, seed, seen = padded_attention(case, monkeypatch)
    rows = 12 if case == "blind query" else 10

    def grads(code=None):
        out = act.attention._ProjectedAttention.apply(q, k, v, mask, 0.5, 0.3, seed, x, pairs,
                                                      SLICES, (), "block", code)
        seen.clear()
        return torch.autograd.grad(out, (q, k, v), dout)

    kept = torch.autograd.grad(
        act.attention._RecomputedAttention.apply(q, k, v, mask, 0.5, 0.3, seed), (q, k, v), dout)
    exact = grads()
    assert all(torch.equal(a, b) for a, b in zip(exact, kept, strict=True))
    assert seen == [rows] * 3
    code = make_code(x, 4, 8, seed=1)
    coded = grads(code)
    assert seen == [rows] * 3
    monkeypatch.setattr(act.attention, "needed_rows", lambda *a: None)
    every_row = grads(code)
    assert seen == [12] * 3
    for a, b in zip(coded, every_row, strict=True):
        torch.testing.assert_close(a, b)


def test_exact_recompute_makes_every_row_where_fewer_round_otherwise(monkeypatch):
    """Where a product over the 10 rows backward reads rounds one value otherwise than forward's
    product over all 12, the fingerprints tell, and Q, K, V are made again from every row: the
    gradients stay those of keeping Q, K, V, bit for bit. Unchecked, they would not be."""
    x, pairs, q, k, v, mask, dout, seed, seen = padded_attention("padded", monkeypatch,
                                                                  rounding=True)
    kept = torch.autograd.grad(
        act.attention._RecomputedAttention.apply(q, k, v, mask, 0.5, 0.3, seed), (q, k, v), dout)

    def grads():
        out = act.attention._ProjectedAttention.apply(q, k, v, mask, 0.5, 0.3, seed, x, pairs,
                                                      SLICES, (), "block")
        seen.clear()
        return torch.autograd.grad(out, (q, k, v), dout)

    assert all(torch.equal(a, b) for a, b in zip(grads(), kept, strict=True))
    assert seen == [10] * 3 + [12] * 3
    monkeypatch.setattr(act.attention, "same_rows", lambda *a: True)
    assert not all(torch.equal(a, b) for a, b in zip(grads(), kept, strict=True))


@pytest.mark.parametrize("padding", [True, False])
def test_exact_recompute_raises_where_no_row_made_again_is_forwards(monkeypatch, padding):
    """Q, K, V that are not the projections of the kept input (a scale between that changed since
    the layout was found): backward's rows match forward's fingerprints neither over the rows it
    reads nor over all of them (a padded batch), nor on the first row (one without padding), and
    it raises rather than give other gradients."""
    x, pairs, q, k, v, mask, dout, seed, seen = padded_attention("padded", monkeypatch)
    if not padding:
        mask = torch.ones_like(mask)
    out = act.attention._ProjectedAttention.apply(q * 2, k, v, mask, 0.5, 0.3, seed, x, pairs,
                                                  SLICES, (), "block")
    with pytest.raises(RuntimeError, match="block's Q, K, V made again in backward are not"):
        torch.autograd.grad(out, (q, k, v), dout)


def test_fingerprint_sees_one_float_step_in_any_layout():
    """A row's fingerprint is the same in a batch of other rows and in another layout, and moves
    when any one of its values moves one float step (every value of a row, each dtype). (Compiled
    as eager: tests/test_codecs.py.)"""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = torch.randn(2, 3, 6, 4, generator=gen).to(dtype).transpose(1, 2)  # (B, H, L, D)
        prints = act.rows.fingerprint(t)
        assert prints.shape == (2, 3) and prints.dtype == torch.int64
        alone = act.rows.fingerprint(t[1:, :, 2:].contiguous())
        assert torch.equal(alone, prints[1:, 2:])
        for h in range(6):
            for d in range(4):
                moved = t.clone()
                moved[1, h, 2, d] = moved[1, h, 2, d].nextafter(torch.tensor(-math.inf, dtype=dtype))
                after = act.rows.fingerprint(moved)
                assert after[1, 2] != prints[1, 2]
                after[1, 2] = prints[1, 2]
                assert torch.equal(after, prints)
    # no whole 16-bit words per row: no fingerprint (the rows are then all made again), no error
    assert act.rows.fingerprint(torch.zeros(1, 1, 2, 3, dtype=torch.int8)) is None
    assert act.rows.fingerprint(torch.zeros(1, 1, 2, 6)[..., ::2]) is None


# ---------------------------------------------------------------------------------------------
# GELU codes.


def test_gelu_derivative_and_range():
    x = torch.linspace(-6, 6, 10001, dtype=torch.float64).requires_grad_(True)
    (want,) = torch.autograd.grad(nn.functional.gelu(x).sum(), x)
    torch.testing.assert_close(act.gelu_derivative(x), want.float())
    assert want.min().item() == pytest.approx(act.gelu._G_MIN, abs=1e-6)
    assert want.max().item() == pytest.approx(act.gelu._G_MAX, abs=1e-6)


def gelu_backward_draws(bits, code, x, draws):
    """``draws`` independent ``dX`` of CompactGELU for the rows ``x`` with ``dY = 1``."""
    gelu = act.CompactGELU(bits, code)
    xx = x.expand(draws, -1).clone().requires_grad_(True)
    y = gelu(xx)
    torch.testing.assert_close(y, nn.functional.gelu(xx), rtol=0, atol=0)  # forward is exact
    y.backward(torch.ones_like(y))
    return xx.grad.double()


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_stochastic_gelu_code_is_unbiased(bits):
    """Each dX element is a two-point variable with known variance step^2 f (1 - f): the sum of
    squared z-scores of the means over N draws is chi^2 with one degree per element. A code
    biased by a tenth of a step per element (the control) must fail the same test."""
    x = torch.linspace(-3, 3, 100)
    code = act.GeluCode.uniform(bits)
    step = code.levels[1] - code.levels[0]
    g = act.gelu_derivative(x).double()
    frac = ((g - code.levels[0]) / step) % 1
    var = step**2 * frac * (1 - frac)
    use = (frac > 0.05) & (frac < 0.95)  # where the mean of N draws is close to normal
    assert use.sum() >= 50
    n = 4000
    mean = gelu_backward_draws(bits, "stochastic", x, n).mean(0)
    bound = stats.chi2.isf(FALSE_ALARM, int(use.sum()))

    def chi2(target):
        return ((mean - target)[use].square() / (var[use] / n)).sum().item()

    assert chi2(g) < bound, f"chi^2 {chi2(g):.1f}, bound {bound:.1f}"
    assert chi2(g + 0.1 * step) > bound  # power against a small bias


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_optimal_gelu_code_is_lloyd_max(bits):
    """The fitted code is a fixed point (each level the mean of its cell, thresholds midway), its
    error is below that of rounding to the stochastic code's grid, and it is deterministic."""
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0)) - 0.8
    code = act.GeluCode.fit(x, bits)
    g = act.gelu_derivative(x).double()
    cells = torch.bucketize(g, torch.tensor(code.thresholds, dtype=torch.float64), right=True)
    encoded = code.encode(act.gelu_derivative(x))
    assert torch.equal(encoded.long(), cells)
    for i, level in enumerate(code.levels):
        if (cells == i).any():
            assert g[cells == i].mean().item() == pytest.approx(level, abs=1e-9)
    decoded = code.decode(encoded).double()
    torch.testing.assert_close(decoded, torch.tensor(code.levels, dtype=torch.float64)[cells])
    grid = torch.tensor(act.GeluCode.uniform(bits).levels, dtype=torch.float64)
    nearest = grid[(g[:, None] - grid).abs().argmin(1)]
    assert (decoded - g).square().mean() < (nearest - g).square().mean()
    a = gelu_backward_draws(bits, "optimal", x[:50], 2)
    assert torch.equal(a[0], a[1])


def test_compact_gelu_fits_once_and_validates():
    gelu = act.CompactGELU(2, "optimal")
    assert gelu.fitted is None
    gelu(torch.randn(100, requires_grad=True))
    fitted = gelu.fitted
    gelu(torch.randn(100, requires_grad=True) + 5)
    assert gelu.fitted is fitted
    for bits in (0, 9, 2.0):
        with pytest.raises(ValueError, match="gelu_bits"):
            act.CompactGELU(bits)
    with pytest.raises(ValueError, match="gelu_code"):
        act.CompactGELU(2, "nearest")


# ---------------------------------------------------------------------------------------------
# The model: exact parts give the unpatched model's gradients.


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dropout", ["seeded", "packed"])
def test_exact_parts_give_the_unpatched_gradients(family, checkpointing, dropout):
    """Dropout probabilities 0 (so the masks are the same), a padded batch: with gelu_bits=None
    every parameter gradient equals the unpatched model's. Padding attended to (no mask reaching
    the attention function) would change the logits of the padded rows."""
    model = MODELS[family](dropout=0.0)
    ref = copy.deepcopy(model)
    b = batch()
    names = patch_activations(model, dropout=dropout, gelu_bits=None)
    drops = [n for n in names if not isinstance(model.get_submodule(n), act.OutputLayerNorm)]
    assert drops and all(isinstance(model.get_submodule(n), act.SeededDropout) for n in drops)
    assert model.config._attn_implementation == act.ATTENTION_NAME
    assert_same_grads(grads(model, b, checkpointing), grads(ref, b, checkpointing))


@pytest.mark.parametrize("family", MODELS)
def test_attention_sees_the_padding_mask(family):
    """Without the mask function registered beside the attention function, transformers passes
    no mask and padding is attended: this test fails then."""
    model = MODELS[family]()
    ref = copy.deepcopy(model)
    b = batch()
    patch_activations(model, dropout="stored", gelu_bits=None)
    model.eval(), ref.eval()
    seen = []
    real = act.recompute_attention

    def spy(module, q, k, v, mask, **kw):
        seen.append(mask)
        return real(module, q, k, v, mask, **kw)

    from transformers import AttentionInterface

    AttentionInterface.register(act.ATTENTION_NAME, spy)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(**b).logits, ref(**b).logits)
    finally:
        act.register_attention()
    assert seen and all(m is not None and m.dtype == torch.bool for m in seen)
    assert not seen[0][1, 0, 0, -5:].any()  # the second row's five padding keys


def test_attention_dropout_regenerated_in_backward(monkeypatch):
    """With attention dropout on, the model's gradients equal those of an eager reference that
    uses the very masks the recomputing function draws (its seeds, recorded)."""
    model = tiny_roberta(dropout=0.0)
    model.config.attention_probs_dropout_prob = 0.3
    for layer in model.roberta.encoder.layer:
        layer.attention.self.dropout.p = 0.3
    ref = copy.deepcopy(model)
    patch_activations(model, dropout="stored", gelu_bits=None)
    seeds, draw = [], act.attention._draw_seed
    monkeypatch.setattr(act.attention, "_draw_seed", lambda: seeds.append(draw()) or seeds[-1])
    b = batch()
    got = grads(model, b)
    assert len(seeds) == len(model.roberta.encoder.layer)

    def eager_with_masks(module, q, k, v, mask, scaling=None, dropout=0.0, **kw):
        out = reference_attention(q, k, v, mask, scaling, dropout, int(seeds.pop(0)))
        return out.transpose(1, 2).contiguous(), None

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("test_eager_with_masks", eager_with_masks)
    AttentionMaskInterface.register("test_eager_with_masks", act.attention._recompute_attention_mask)
    ref.set_attn_implementation("test_eager_with_masks")
    want = grads(ref, b)
    assert not seeds
    assert_same_grads(got, want)


def keep_qkv(model):
    """Make recompute_attention keep Q, K and V (its fallback) in every self-attention module."""
    for m in model.modules():
        if act.has_projections(m):
            m.__dict__[act.attention._CHECKED] = False


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("setup", ["plain", "sketch", "checkpointing", "bf16"])
def test_attention_keeps_the_block_input_not_qkv(family, setup):
    """Q, K, V made again in backward from the block's input give the gradients that keeping them
    gives, bit for bit (dropout on, so the seeded masks must match too), and backward keeps
    exactly three activations of the hidden size fewer per layer when the linears keep their
    inputs (the exact model's linears already hold the block input), less Q's, K's and V's
    fingerprints (the batch is padded: backward makes only the rows it reads, and checks them)."""
    def build():  # twice, not deepcopy: a copy's skip_padding hook feeds the original's context
        model = MODELS[family](dropout=0.1)
        if setup == "sketch":
            patch_linear(model, "blocksrht", rho=0.5)
        patch_activations(model, gelu_bits=None)
        return model

    model, ref = build(), build()
    keep_qkv(ref)
    b = batch()
    ckpt = setup == "checkpointing"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup == "bf16"):
        torch.manual_seed(1)
        got = grads(model, b, ckpt)
        torch.manual_seed(1)
        want = grads(ref, b, ckpt)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    found = [m.__dict__.get(act.attention._CHECKED) for m in model.modules() if act.has_projections(m)]
    assert [f[0] for f in found] == [("query", "key", "value")] * 2  # their projections, found
    if setup == "plain":
        model.zero_grad(), ref.zero_grad()
        cfg = model.config
        row = b["input_ids"].numel() * cfg.hidden_size * 4
        prints = b["input_ids"].numel() * 8  # the padded batch's fingerprint: an int64 per row
        assert saved_bytes(ref, b) - saved_bytes(model, b) == cfg.num_hidden_layers * 3 * (
            row - prints)


def test_attention_keeps_qkv_when_they_are_not_the_inputs_projections():
    """A query projection that sees something else than the block's input (here a hook scales
    it) fails the first call's check: a warning, Q, K, V kept, the gradients still exact."""
    model = tiny_bert()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.bert.encoder.layer[0].attention.self.query.register_forward_pre_hook(
            lambda module, args: (args[0] * 2,))
    patch_activations(model, dropout="stored", gelu_bits=None)
    b = batch()
    with pytest.warns(UserWarning, match="keeps Q, K and V"):
        got = grads(model, b)
    assert_same_grads(got, grads(ref, b))
    found = [m.__dict__.get(act.attention._CHECKED) for m in model.modules() if act.has_projections(m)]
    assert found[0] is False and found[1][0] == ("query", "key", "value")


@pytest.mark.stack("ckpt-reentrant", "compact")
@pytest.mark.stack("ckpt-nonreentrant", "compact")
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_the_same_masks(reentrant):
    """With every dropout on (hidden and attention), a checkpointed model's gradients equal the
    same model's without checkpointing from the same generator state: the recomputation (and a
    reentrant checkpoint's no-grad first pass) makes the very masks the forward made."""
    model = tiny_roberta(dropout=0.3)
    patch_activations(model, gelu_bits=None)
    b = batch()
    torch.manual_seed(3)
    plain = grads(model, b)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    torch.manual_seed(3)
    assert_same_grads(grads(model, b), plain)


SECOND_ORDER = {
    "sketch": lambda m: patch_linear(m, sketch="gaussian", rho=0.5),
    "bits": lambda m: patch_linear(m, sketch="exact", bits=4),
    "compact": lambda m: patch_activations(m),
    "packed dropout": lambda m: patch_activations(m, dropout="packed"),
    "layernorm output": lambda m: patch_activations(m, layernorm="output"),
    "lean": lambda m: (patch_linear(m, sketch="exact", bits=4),
                       patch_activations(m, preset="lean")),
}


@pytest.mark.stack("second-order", "sketch", "bits", "compact", refused="differentiate twice")
@pytest.mark.parametrize("name", SECOND_ORDER)
def test_a_second_derivative_is_refused_not_wrong(name):
    """Backward of these parts reads what forward kept (sketches, codes, outputs), which carries no
    graph: differentiated again (a gradient penalty, ``create_graph=True``) it would miss terms.
    It raises instead, naming the reason; a first derivative with ``create_graph`` is fine."""
    model = tiny_bert(dropout=0.1)
    SECOND_ORDER[name](model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    first = torch.autograd.grad(model(**batch()).loss, params, create_graph=True)
    penalty = sum(g.square().sum() for g in first)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        penalty.backward()


# ---------------------------------------------------------------------------------------------
# Surgery: reversible, composable, checked before it changes anything.


def module_types(model):
    return {n: type(m) for n, m in model.named_modules()}


@pytest.mark.parametrize("family", MODELS)
def test_round_trip(family):
    model = MODELS[family]()
    types, keys = module_types(model), list(model.state_dict())
    impl = model.config._attn_implementation
    names = patch_activations(model)
    assert list(model.state_dict()) == keys
    gelus = [n for n in names if n.endswith("intermediate_act_fn")]
    assert len(gelus) == 2 and all(isinstance(model.get_submodule(n), act.CompactGELU)
                                   for n in gelus)
    model.train()
    model(**batch()).loss.backward()
    assert unpatch_activations(model) == names
    assert module_types(model) == types and model.config._attn_implementation == impl
    assert not any(m._forward_pre_hooks or m._forward_hooks or act.attention._CHECKED in vars(m)
                   for m in model.modules())
    assert not act.attention._inputs()  # no call's input left behind
    assert unpatch_activations(model) == []
    assert patch_activations(model) == names  # patchable again


def test_saved_while_patched_loads_as_the_plain_model(tmp_path):
    """save_pretrained keeps the weights and not the attention switch: the saved model loads
    without sketchprop, with its default attention, and computes what the unpatched model does."""
    model = tiny_bert().eval()
    b = batch()
    with torch.no_grad():
        want = model(**b).logits
    impl = model.config._attn_implementation
    patch_activations(model)
    model.save_pretrained(tmp_path)
    loaded = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == impl
    assert not any(isinstance(m, (act.CompactGELU, act.SeededDropout)) for m in loaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**b).logits, want)


@pytest.mark.parametrize("first", ["linear", "activations"])
@pytest.mark.parametrize("sketch", sorted(SKETCHES))
def test_composes_with_patch_linear(first, sketch):
    """Either order, every sketch: the forward is the unpatched model's (neither part changes
    it); with the exact sketch every gradient is too; both undo to the original modules."""
    model = tiny_roberta()
    ref = copy.deepcopy(model)
    types = module_types(model)
    b = batch()
    steps = [lambda: patch_linear(model, sketch, rho=0.5, share_inputs=True, skip_padding=True),
             lambda: patch_activations(model, gelu_bits=None)]
    for step in steps if first == "linear" else steps[::-1]:
        step()
    got, want = grads(model, b), grads(ref, b)
    if sketch == "exact":
        assert_same_grads(got, want)
    else:
        torch.testing.assert_close(got[0], want[0])
    unpatch_linear(model)
    unpatch_activations(model)
    assert module_types(model) == types


@pytest.mark.stack("autocast-bf16", "sketch", "compact")
def test_autocast_bf16():
    model = tiny_roberta()
    ref = copy.deepcopy(model)
    patch_activations(model)
    patch_linear(model, "blocksrht", rho=0.5)
    b = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, g = grads(model, b)
        ref_logits, _ = grads(ref, b)
    torch.testing.assert_close(logits, ref_logits, rtol=0.05, atol=0.05)
    assert all(torch.isfinite(v).all() for v in g.values())


@pytest.mark.parametrize("kwargs, match", [
    ({"dropout": "mask"}, "unknown dropout"),
    ({"attention": "flash"}, "unknown attention"),
    ({"gelu_bits": 0}, "gelu_bits"),
    ({"gelu_code": "nearest"}, "gelu_code"),
    ({"layernorm": "input"}, "unknown layernorm"),
    ({"dropout": "stored", "attention": "stored", "gelu_bits": None, "layernorm": "stored"},
     "nothing to patch"),
    ({"targets": "nothing"}, "targets='nothing' exclude=None match no module"),
    ({"targets": "nothing", "dropout": "seeded"}, "dropout='seeded': .* pass dropout='stored'"),
    ({"exclude": "intermediate", "dropout": "stored", "gelu_bits": 2},
     "gelu_bits=2: .* pass gelu_bits=None"),
    ({"targets": "("}, "not a valid regex"),
])
def test_bad_calls_change_nothing(kwargs, match):
    model = tiny_roberta()
    types, impl = module_types(model), model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        patch_activations(model, **kwargs)
    assert module_types(model) == types and model.config._attn_implementation == impl
    assert not hasattr(model, "_sketchprop_activations")


def test_attention_needs_a_transformers_model_and_patching_twice_raises():
    """Asked for, attention needs a transformers model; by default it is left on another."""
    plain = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Dropout(0.1))
    with pytest.raises(ValueError, match="PreTrainedModel"):
        patch_activations(plain, attention="recompute")
    assert type(plain[1]) is nn.GELU
    assert patch_activations(plain) == ["1", "2"]
    with pytest.raises(ValueError, match="already patched"):
        patch_activations(plain, attention="stored")


# ---------------------------------------------------------------------------------------------
# What backward keeps.


def test_saved_bytes_are_the_codes_and_seeds():
    """The meter sees exactly the packed codes, the seeds and the packed masks."""
    x = torch.randn(3, 100, requires_grad=True)
    n = x.numel()
    for module, want in [(act.CompactGELU(3), -(-n // 8) * 3), (act.SeededDropout(0.1), 8),
                         (act.PackedDropout(0.1), -(-n // 8))]:
        with SavedTensorMeter() as meter:
            module(x)
        assert meter.bytes == want, type(module).__name__


def saved_bytes(model, b):
    torch.manual_seed(0)
    with SavedTensorMeter(model) as meter:
        model(**b).loss.backward()
    return meter.bytes


def test_compact_model_saves_less():
    b = batch(length=32)
    sizes = {}
    for name, kwargs in [("exact", None), ("dropout", {"attention": "stored", "gelu_bits": None}),
                         ("attention", {"dropout": "stored", "gelu_bits": None}),
                         ("gelu", {"dropout": "stored", "attention": "stored"}), ("all", {})]:
        model = tiny_roberta(dropout=0.1)
        if kwargs is not None:
            patch_activations(model, **kwargs)
        sizes[name] = saved_bytes(model, b)
    assert all(sizes[k] < sizes["exact"] for k in ("dropout", "attention", "gelu"))
    assert sizes["all"] < min(sizes[k] for k in ("dropout", "attention", "gelu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_exact_parts_and_no_probabilities_kept():
    """On CUDA: masks reproduce from their seed, the exact parts give the unpatched gradients,
    and no tensor of the attention probabilities' size is saved (SDPA's kernels keep none)."""
    assert torch.equal(act.keep_mask((1000,), 0.1, 5, "cuda"), act.keep_mask((1000,), 0.1, 5, "cuda"))
    model = tiny_roberta(dropout=0.0).cuda()
    ref = copy.deepcopy(model)
    b = {k: v.cuda() for k, v in batch().items()}
    patch_activations(model, gelu_bits=None)
    assert_same_grads(grads(model, b), grads(ref, b), rtol=1e-4, atol=1e-5)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t,
                                                  lambda t: t):
        model(**b).loss.backward()
    heads, length = model.config.num_attention_heads, b["input_ids"].shape[1]
    assert not [s for s in shapes if tuple(s[-3:]) == (heads, length, length)]
