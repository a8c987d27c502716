"""b-bit stored rows (``patch_linear(..., bits=b)``): packing, unbiasedness at the layer level,
the closed-form variance, and composition with sharing, padding, checkpointing and autocast."""

import math

import pytest
import torch
from scipy import stats
from test_layers import FALSE_ALARM, N_DRAWS, grads, hotelling, make_layer, unbiased_data
from test_patching import batch, tiny_roberta
from torch import nn
from torch.utils.checkpoint import checkpoint

from sketchprop import RandomizedLinear, patch_linear, unpatch_linear
from sketchprop.measure import SavedTensorMeter
from sketchprop.quantize import BITS, dequantize, quantize, stored_bits
from sketchprop.variance import quantized_variance

pytestmark = pytest.mark.usefixtures("one_thread")


def t2_bound(p: int, n: int = N_DRAWS) -> float:
    return stats.f.isf(FALSE_ALARM, p, n - p) * p * (n - 1) / (n - p)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("cols", [64, 100])  # a whole number of groups, and a padded last group
def test_codes_round_trip_and_bytes(bits, cols):
    a = torch.randn(37, cols) * torch.linspace(0.1, 5, cols) + 1.0
    payload, spec, _ = quantize(a, bits, 32, seed=7)
    assert payload.dtype == torch.uint8
    groups = -(-cols // 32)
    assert payload.numel() == 37 * groups * (32 * bits // 8 + 4)  # codes, then two bf16 ends
    back = dequantize(payload, spec)
    assert back.shape == a.shape and back.dtype == a.dtype
    # Each value lands on one of the two levels around it: within one step of its group.
    step = (a.view(37, -1)).abs().max() * 2 / ((1 << bits) - 1) * (1 + 2**-6)
    assert (back - a).abs().max() <= step
    assert stored_bits(bits, 64) == bits + 0.5


def test_constant_groups_and_zeros_are_exact():
    a = torch.zeros(5, 64)
    a[1] = 3.25
    a[2, :32] = -1.5
    payload, spec, var = quantize(a, 2, 32, seed=1, variance=True)
    back = dequantize(payload, spec)
    torch.testing.assert_close(back, a, rtol=0, atol=0)
    assert var.abs().max() == 0


@pytest.mark.parametrize("bits", BITS)
def test_rounding_is_unbiased_and_its_variance_is_the_closed_form(bits):
    """Per element, the mean of n draws is within its standard error of the value (a z-test over
    all elements), and the summed per-row variance is the one quantize reports."""
    a = torch.randn(12, 48, generator=torch.Generator().manual_seed(0)) * 2 - 0.3
    n = 4000
    draws = torch.stack([dequantize(*quantize(a, bits, 16, seed=s)[:2]) for s in range(n)]).double()
    _, _, row_var = quantize(a, bits, 16, seed=0, variance=True)
    var = draws.var(0)
    z = (draws.mean(0) - a.double()) / (var / n).sqrt().clamp_min(1e-12)
    # Chi-square of the z-scores over the 576 elements (their variance is estimated from 4000 draws).
    chi2 = (z[var > 0] ** 2).sum().item()
    dof = int((var > 0).sum())
    assert chi2 < stats.chi2.isf(FALSE_ALARM, dof), chi2
    # Sum of 48 per-element sample variances of n draws: relative error about sqrt(2/n).
    torch.testing.assert_close(var.sum(1), row_var.double(), rtol=6 * math.sqrt(2 / n) + 1e-3,
                               atol=1e-9)


def quant_draws(layer, x, g, n):
    return torch.stack([grads(layer, x, g)[1] for _ in range(n)]).double().reshape(n, -1)


@pytest.mark.parametrize("sketch,bits", [("exact", 2), ("exact", 4), ("exact", 8),
                                         ("blocksrht", 4), ("gaussian", 2), ("importance", 4)])
def test_weight_gradient_unbiased(sketch, bits):
    """Hotelling's T^2 of the weight gradient against the exact one, as for the sketches alone,
    and dX, db exact; a 5% biased rounding (codes scaled) fails the same test."""
    x, g = unbiased_data()
    exact = (g.T @ x).double().reshape(-1)
    layer = make_layer(sketch, rho=0.25, seed=3, bits=bits, group=8, min_rows=1)
    dx, _, db = grads(layer, x, g)
    ref = nn.Linear(8, 6)
    ref.load_state_dict(layer.state_dict())
    dx_ref, _, db_ref = grads(ref, x, g)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    torch.testing.assert_close(db, db_ref, rtol=0, atol=0)
    t2, _ = hotelling(quant_draws(layer, x, g, N_DRAWS), exact)
    assert t2 < t2_bound(exact.numel()), t2


def test_a_biased_rounding_is_caught(monkeypatch):
    """The control for the test above: rounding that lands 5% of a step high on average."""
    import sketchprop.quantize as q

    real = q.dither_of
    monkeypatch.setenv("SKETCHPROP_CODECS", "eager")  # a patched module global, read at each call
    monkeypatch.setattr(q, "dither_of", lambda r: real(r) + 0.05)
    x, g = unbiased_data()
    exact = (g.T @ x).double().reshape(-1)
    layer = make_layer("exact", bits=2, group=8)
    t2, _ = hotelling(quant_draws(layer, x, g, N_DRAWS), exact)
    assert t2 > t2_bound(exact.numel()), t2


@pytest.mark.parametrize("sketch", ["exact", "blocksrht"])
def test_error_shrinks_as_one_over_sqrt_n_without_a_floor(sketch):
    """n |mean_n - dW|^2 stays at the one-draw variance as n grows from 50 to 3200: the error
    falls as 1/sqrt(n), and no bias floor appears."""
    x, g = unbiased_data()
    exact = (g.T @ x).double().reshape(-1)
    layer = make_layer(sketch, rho=0.25, seed=9, bits=2, group=8)
    draws = quant_draws(layer, x, g, 6400)
    one = (draws - exact).square().sum(1).mean().item()  # the one-draw variance, E|dW^ - dW|^2
    for n in (50, 200, 800, 3200):
        groups = draws[: (6400 // n) * n].view(-1, n, draws.shape[1]).mean(1)
        scaled = n * (groups - exact).square().sum(1).mean().item() / one
        # An average over 6400 / n groups of a sum of 48 squared errors: its spread is well under
        # 0.5 at 2 groups (n = 3200) for these 48 near-independent elements.
        assert 0.5 < scaled < 1.6, (n, scaled)


@pytest.mark.parametrize("bits", BITS)
def test_closed_form_variance_matches_monte_carlo(bits):
    x, g = unbiased_data()
    exact = (g.T @ x).double().reshape(-1)
    layer = make_layer("exact", bits=bits, group=8)
    draws = quant_draws(layer, x, g, N_DRAWS)
    sq = (draws - exact).square().sum(1)
    mc, se = sq.mean().item(), sq.std().item() / math.sqrt(N_DRAWS)
    closed = quantized_variance(x, g, bits, group=8)
    assert abs(mc - closed) < 4.5 * se, (mc, closed, se)


def test_closed_form_variance_takes_float64():
    """float64 rows (as the variance module's other closed forms take them) give the float32 value."""
    x, g = unbiased_data()
    single = quantized_variance(x, g, 4, group=8)
    assert quantized_variance(x.double(), g.double(), 4, group=8) == pytest.approx(single, rel=1e-5)


@pytest.mark.parametrize("sketch", ["exact", "blocksrht"])
def test_saved_bytes_count_the_packed_codes(sketch):
    x = torch.randn(256, 64, requires_grad=True)
    plain = make_layer(sketch, rho=0.25, n_in=64, n_out=32)
    coded = make_layer(sketch, rho=0.25, n_in=64, n_out=32, bits=4, group=64)
    sizes = []
    for layer in (plain, coded):
        with SavedTensorMeter(layer) as meter:
            layer(x).sum()
        sizes.append(meter.bytes)
    rows = 256 if sketch == "exact" else 64
    seed = 0 if sketch == "exact" else 8
    assert sizes[0] == rows * 64 * 4 + seed
    assert sizes[1] == rows * (64 // 2 + 4) + seed  # 4-bit codes, one group's two bf16 ends


def test_shared_inputs_are_coded_once():
    model = nn.ModuleDict({"q": nn.Linear(64, 64), "k": nn.Linear(64, 64), "v": nn.Linear(64, 64)})
    patch_linear(model, sketch="blocksrht", rho=0.25, bits=4, skip_padding=False)
    x = torch.randn(128, 64, requires_grad=True)
    with SavedTensorMeter(model) as meter:
        out = model["q"](x) + model["k"](x) + model["v"](x)
    assert meter.bytes == 32 * (32 + 4) + 8  # one payload and one seed for three layers
    out.sum().backward()
    assert all(m.weight.grad is not None for m in model.values())


def test_patch_linear_checks_bits_before_changing_anything():
    model = nn.Sequential(nn.Linear(8, 8))
    for bad in (5, 3, 0, "4", True):
        with pytest.raises(ValueError, match="bits"):
            patch_linear(model, bits=bad)
    with pytest.raises(ValueError, match="group"):
        patch_linear(model, bits=4, group=12)
    assert type(model[0]) is nn.Linear
    names = patch_linear(model, sketch="exact", bits=4)
    assert names == ["0"] and "bits=4, group=64" in repr(model[0])
    unpatch_linear(model)
    assert type(model[0]) is nn.Linear


@pytest.mark.stack("ckpt-reentrant", "bits")
@pytest.mark.stack("ckpt-nonreentrant", "bits")
@pytest.mark.parametrize("reentrant", [False, True])
def test_unbiased_under_checkpointing(reentrant):
    """The recomputed forward codes its own rows (a new seed), and backward decodes those."""
    x, g = unbiased_data()
    torch.manual_seed(0)
    first = make_layer("blocksrht", rho=0.25, seed=3, bits=2, group=8)
    second = nn.Linear(6, 6)

    def block(inp):
        return second(torch.tanh(first(inp)))

    w = first.weight
    y = second(torch.tanh(nn.functional.linear(x, w, first.bias)))
    exact = torch.autograd.grad((y * g).sum(), w)[0].double().reshape(-1)
    draws = []
    for _ in range(N_DRAWS):  # reentrant checkpointing only supports .backward()
        w.grad = None
        xx = x.detach().requires_grad_(True)
        (checkpoint(block, xx, use_reentrant=reentrant) * g).sum().backward()
        draws.append(w.grad.double().reshape(-1))
    t2, _ = hotelling(torch.stack(draws), exact)
    assert t2 < t2_bound(exact.numel()), t2


@pytest.mark.stack("autocast-bf16", "bits")
def test_bf16_autocast_decodes_to_the_compute_dtype():
    layer = make_layer("exact", n_in=64, n_out=16, bits=4)
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    xb, dy = x.detach().bfloat16().float(), torch.ones(32, 16)
    exact = dy.T @ xb
    # One draw's squared error against the closed form: a sum over 16 x 64 near-independent
    # elements, within +-50% of its mean (bfloat16's own rounding adds about 2^-16 relative).
    ratio = (layer.weight.grad - exact).square().sum() / quantized_variance(xb, dy, 4)
    assert 0.5 < ratio < 1.5, ratio


def test_tiny_roberta_with_padding_and_tracking():
    """Every part together on a model: skip_padding, shared Q/K/V, the variance tracker (whose
    estimate includes the rounding) and unpatching back to the same outputs."""
    model = tiny_roberta()
    inputs = batch()
    model.eval()
    with torch.no_grad():
        before = model(**inputs).logits
    model.train()
    names = patch_linear(model, sketch="exact", bits=2, exclude="classifier", track_variance=True)
    assert all(isinstance(model.get_submodule(n), RandomizedLinear) for n in names)
    model(**inputs).loss.backward()
    from sketchprop.tracking import collect

    records = collect(model)
    assert records and all(r["d2_quant"] > 0 for r in records)
    # The exact sketch has no sketch variance: its whole variance is the rounding's.
    assert all(math.isclose(r["d2_sketch"], r["d2_quant"], rel_tol=1e-3) for r in records)
    unpatch_linear(model)
    model.eval()
    with torch.no_grad():
        after = model(**inputs).logits
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_variance_allocation_moves_rows_with_coded_rows():
    """allocate="variance" learns from the rounding's variance too, and still moves rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    patch_linear(model, sketch="blocksrht", rho=0.25, bits=2, group=8, allocate="variance",
                 skip_padding=False)
    allocation = model[0].allocation
    for _ in range(3 * allocation.every):
        x = torch.randn(256, 16)
        x[:, :8] *= 10  # the first layer's input carries most of the gradient's noise
        model(x).square().sum().backward()
    assert allocation.updates > 0
    assert allocation.factors["0"] != pytest.approx(allocation.factors["2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_codes_decode_and_stay_unbiased():
    x, g = (t.cuda() for t in unbiased_data())
    layer = make_layer("exact", bits=4, group=8).cuda()
    exact = (g.T @ x).double()
    n = 1000
    mean = sum(grads(layer, x, g)[1].double() for _ in range(n)) / n
    # The mean of n draws: its squared error has expectation V / n, V the closed form.
    err = (mean - exact).square().sum().item()
    assert err < 4 * quantized_variance(x.cpu(), g.cpu(), 4, group=8) / n


# sha256 of the payloads below, from the first implementation of the fused quantize (its dither from
# sketchprop.rng's Philox stream; the committed runs before it drew from torch generators, and
# their commits name that code): runs made with it must stay reproducible, so a faster quantize
# has to write the same bytes for a seed, compiled or eager.
PAYLOAD_SHA256 = "28025baa535817a604757723c98f4a70778d1240b695a55c53421ae05a5a89ef"


@pytest.mark.parametrize("codecs", ["eager", "compiled"])
def test_payload_bytes_are_pinned_for_a_seed(codecs, monkeypatch):
    import hashlib

    monkeypatch.setenv("SKETCHPROP_CODECS", codecs)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(37, 200, generator=g) * torch.linspace(0.01, 30, 200)
    x[3, :64] = 0.5  # a constant group
    x[5] = 0.0
    h = hashlib.sha256()
    for dtype in (torch.float32, torch.bfloat16):
        for bits in BITS:
            for group in (64, 16):
                payload, _, _ = quantize(x.to(dtype), bits, group, seed=987654321 + bits,
                                         variance=True)
                h.update(payload.numpy().tobytes())
    assert h.hexdigest() == PAYLOAD_SHA256


# Inputs as a model hands them to a layer: BERT's pooler reads hidden_states[:, 0], a strided
# slice; transposes, expanded views, column strides, one row, no rows; a 3-D transpose.
LAYOUTS = {
    "slice": lambda x: x[:, 0],
    "transposed": lambda x: x[:, 0].t().contiguous().t(),
    "expanded": lambda x: x[:1, 0].expand(5, -1),
    "column-stride": lambda x: torch.cat([x, x], -1)[:, 0, ::2],
    "one-row": lambda x: x[:1, 0],
    "no-rows": lambda x: x[:0, 0],
    "3-d transposed": lambda x: x.transpose(0, 1),
}


@pytest.mark.parametrize("cols", [64, 128, 200])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("sketch", ["exact", "gaussian"])
def test_coded_layers_take_any_input_layout_as_its_contiguous_copy(sketch, layout, cols):
    """The same dX, dW, db whether the input is strided or its contiguous copy (the same seed:
    twin layers), at one code group a row, two, and a padded last group."""
    x = LAYOUTS[layout](torch.randn(6, 3, cols, generator=torch.Generator().manual_seed(0)))
    g = torch.randn(*x.shape[:-1], 5, generator=torch.Generator().manual_seed(1))
    for bits in BITS:
        got = grads(make_layer(sketch, 0.5, n_in=cols, n_out=5, bits=bits), x, g)
        want = grads(make_layer(sketch, 0.5, n_in=cols, n_out=5, bits=bits), x.contiguous(), g)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (bits, layout)
