"""Variance estimators: the paper's formulas, each sketch's exact variance, the online estimator.

Statistical tests use fixed seeds and compare a Monte-Carlo mean over many sketches with the exact
value, within ``Z`` Monte-Carlo standard errors (a false failure has probability ~1e-5 per check).
Each also checks its own power: the likely mistakes (a flipped sign, a wrong scale, a wrong sampling
model) lie at least ``2 Z`` standard errors away, so the test fails if one of them were implemented.
"""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.fft
import scipy.linalg
import torch
from torch import nn

from sketchprop import SKETCHES, RandomizedLinear, patch_linear, unpatch_linear
from sketchprop.layers import SketchContext
from sketchprop.measure import SavedTensorMeter
from sketchprop.tracking import collect, track_variance, trackers
from sketchprop.variance import (
    VarianceTracker,
    alpha,
    batch_stats,
    d2_rmm,
    d2_sgd,
    estimator_design,
    expected_variance,
    normalized_ratio,
    online_estimate,
    sketch_samples,
)

Z = 4.5
B, N_IN, N_OUT, K = 21, 6, 5, 8  # B odd and not a multiple of the SRHT block: padding is exercised
# I.i.d. sketches have heavier-tailed errors and cheaper draws: more samples for them.
SAMPLES = {"gaussian": 20000, "rademacher": 20000}
# Kinds whose S a seed regenerates (``importance`` depends on X: its own tests are further down).
KINDS = [k for k, sk in SKETCHES.items() if not sk.exact and not sk.data_dependent]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_data(b=B, seed=0, dtype=torch.float64):
    """Correlated X, Y (alpha ~ 0.25) with uneven row norms, so that every term of every formula
    matters: xty (sign checks), per_row (Rademacher, sampling), row mixing (transforms)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.8 * torch.randn(b, 1, generator=g, dtype=torch.float64))
    x = torch.randn(b, N_IN, generator=g, dtype=torch.float64) * scale
    y = x @ torch.randn(N_IN, N_OUT, generator=g, dtype=torch.float64)
    y = y + 0.5 * torch.randn(b, N_OUT, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def samples(data):
    """``S^T X``, ``S^T Y`` for SAMPLES seeds of each kind, computed once."""
    x, y = data
    return {kind: sketch_samples(kind, x, y, K, range(SAMPLES.get(kind, 3000))) for kind in KINDS}


def mean_se(v: torch.Tensor) -> tuple[float, float]:
    return v.mean().item(), (v.std() / math.sqrt(v.numel())).item()


# ----------------------------------------------------------------------------------------------
# The paper's estimators against definitions written out independently.


def test_d2_sgd_is_the_sample_variance_of_per_example_gradients(data):
    x, y = data
    g = [torch.outer(x[i], y[i]) for i in range(B)]  # per-row weight gradients (transposed)
    gbar = sum(g) / B
    want = B / (B - 1) * sum((gi - gbar).square().sum() for gi in g).item()
    assert d2_sgd(x, y) == pytest.approx(want, rel=1e-10)
    # The paper's form, term by term.
    per_row = sum(x[i].square().sum() * y[i].square().sum() for i in range(B)).item()
    xty = (x.T @ y).square().sum().item()
    assert d2_sgd(x, y) == pytest.approx(B / (B - 1) * per_row - xty / (B - 1), rel=1e-10)
    # 3-D inputs are flattened to rows.
    assert d2_sgd(x.reshape(3, 7, N_IN), y.reshape(3, 7, N_OUT)) == pytest.approx(d2_sgd(x, y))


def test_d2_rmm_alpha_and_ratio_on_a_hand_example():
    x = torch.tensor([[1.0, 2.0], [0.0, 1.0], [1.0, 0.0]])
    y = torch.tensor([[2.0], [1.0], [-1.0]])
    # |X|^2 = 7, |Y|^2 = 6, X^T Y = (1, 5) -> 26, per_row = 5*4 + 1*1 + 1*1 = 22.
    assert batch_stats(x, y) == pytest.approx(
        {"b": 3, "sq_x": 7, "sq_y": 6, "per_row": 22, "xty": 26})
    assert d2_rmm(x, y, 2) == pytest.approx((7 * 6 - 26) / 2)      # 8
    assert alpha(x, y) == pytest.approx(26 / 42)
    assert d2_sgd(x, y) == pytest.approx((3 * 22 - 26) / 2)        # 20
    # B_proj/(B-1) * D2_RMM/D2_SGD = 2/2 * 8/20, and (|X|^2 |Y|^2 - xty) / (B per_row - xty) = 16/40;
    # with the two variances swapped it would be 2.5.
    assert normalized_ratio(8.0, 20.0, 3, 2) == pytest.approx(0.4)
    assert normalized_ratio(d2_rmm(x, y, 2), d2_sgd(x, y), 3, 2) == pytest.approx(0.4)
    assert normalized_ratio(d2_rmm(x, y, 1), d2_sgd(x, y), 3, 1) == pytest.approx(0.4)  # any B_proj


def test_alpha_extremes():
    u = torch.randn(10, 1, dtype=torch.float64)
    x = u @ torch.randn(1, 4, dtype=torch.float64)
    y = u @ torch.randn(1, 3, dtype=torch.float64)
    assert alpha(x, y) == pytest.approx(1.0)                       # rank one: X^T Y carries it all
    y0 = torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    x0 = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    assert alpha(x0, y0) == 0.0 and d2_rmm(x0, y0, 1) == pytest.approx(2 * 2)  # X^T Y = 0
    with pytest.raises(ValueError, match="b_proj"):
        d2_rmm(x0, y0, 0)


# ----------------------------------------------------------------------------------------------
# Exact variance of each sketch kind against Monte Carlo.


def _wrong_variances(kind, s, v):
    """Closed forms one could plausibly get wrong, for the power check."""
    b, k = s["b"], K
    sxy, xty = s["sq_x"] * s["sq_y"], s["xty"]
    if kind in ("gaussian", "rademacher"):
        wrong = {"minus sign (paper's D2_RMM)": (sxy - xty) / k, "1/(k-1)": v * k / (k - 1)}
        if kind == "rademacher":
            wrong["gaussian form"] = (sxy + xty) / k
        return wrong
    n = -(-b // 8) * 8 if kind == "blocksrht" else b
    return {
        "with replacement": v * (n - 1) / (n - K),
        "xty sign": v + 2 * n * (n - k) / (k * (n - 1)) * xty / n,
        "gaussian form": (sxy + xty) / k,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_expected_variance_matches_monte_carlo(kind, data, samples):
    x, y = data
    sx, sy = samples[kind]
    err = (sx.transpose(1, 2) @ sy - x.T @ y).square().sum((1, 2))
    mc, se = mean_se(err)
    v = expected_variance(kind, x, y, K)
    assert abs(mc - v) < Z * se, f"{kind}: Monte Carlo {mc:.5g} +- {se:.2g}, closed form {v:.5g}"
    for what, w in _wrong_variances(kind, batch_stats(x, y), v).items():
        assert abs(w - v) > 2 * Z * se, f"test has no power against {what}"


# The closed forms against their definition, independently of the sketch code: for a few rows the
# expectation over every sign vector and every sample of k rows is a finite average. The transforms
# are written out from their definitions (and checked against scipy's).


def dct_matrix(n):
    """Orthonormal DCT-II: row m is c_m cos(pi (2i + 1) m / 2n), c_0 = sqrt(1/n), else sqrt(2/n)."""
    m, i = np.arange(n)[:, None], np.arange(n)[None, :]
    t = np.sqrt(2 / n) * np.cos(np.pi * (2 * i + 1) * m / (2 * n))
    t[0] /= np.sqrt(2)
    return t


def dft_matrix(n):
    """Real orthonormal DFT basis: Re of e^{-2 pi i j t / n} for j = 0 .. n//2, then Im for
    j = 1 .. ceil(n/2) - 1; scaled sqrt(2/n), the DC and Nyquist rows sqrt(1/n)."""
    t = np.arange(n)[None, :]
    re, im = np.arange(n // 2 + 1)[:, None], np.arange(1, (n + 1) // 2)[:, None]
    rows = np.concatenate([np.cos(2 * np.pi * re * t / n), -np.sin(2 * np.pi * im * t / n)])
    w = np.full(n, np.sqrt(2 / n))
    w[0] = np.sqrt(1 / n)
    if n % 2 == 0:
        w[n // 2] = np.sqrt(1 / n)
    return rows * w[:, None]


def block_hadamard(n, block=8):
    """Orthonormal Sylvester-Hadamard blocks on the rows padded to whole blocks."""
    blocks = -(-n // block)
    return scipy.linalg.block_diag(*[scipy.linalg.hadamard(block) / np.sqrt(block)] * blocks)


TRANSFORMS = {"dct": dct_matrix, "dft": dft_matrix, "blocksrht": block_hadamard,
              "rowsample": np.eye}


@pytest.mark.parametrize("n", [6, 7, 16])
def test_transform_definitions(n):
    np.testing.assert_allclose(dct_matrix(n), scipy.fft.dct(np.eye(n), norm="ortho", axis=0),
                               atol=1e-12)
    spec = scipy.fft.rfft(np.eye(n), axis=0)
    dft = dft_matrix(n) / np.sqrt(2 / n)
    np.testing.assert_allclose(dft[1: (n + 1) // 2], spec.real[1: (n + 1) // 2], atol=1e-12)
    np.testing.assert_allclose(dft[n // 2 + 1:], spec.imag[1: (n + 1) // 2], atol=1e-12)
    for make in TRANSFORMS.values():
        t = make(n)
        np.testing.assert_allclose(t @ t.T, np.eye(t.shape[0]), atol=1e-12)


def enumerated_variance(t, x, y, k):
    """``E |X^T S S^T Y - X^T Y|^2`` for ``S^T = sqrt(n/k) P T D``, averaged over all ``2^n`` sign
    vectors ``D`` and all ``C(n, k)`` row samples ``P`` (``n`` = rows of ``t``; ``x``, ``y`` padded
    with zero rows to ``n``)."""
    n = t.shape[0]
    x = np.concatenate([x, np.zeros((n - x.shape[0], x.shape[1]))])
    y = np.concatenate([y, np.zeros((n - y.shape[0], y.shape[1]))])
    signs = np.array(list(itertools.product([-1.0, 1.0], repeat=n)))
    tx = np.einsum("ri,si,ic->src", t, signs, x)  # (signs, transformed rows, N_in)
    ty = np.einsum("ri,si,ic->src", t, signs, y)
    per_row = np.einsum("sri,sro->srio", tx, ty)
    g = x.T @ y
    errors = [((n / k * per_row[:, list(rows)].sum(1) - g) ** 2).sum((1, 2)).mean()
              for rows in itertools.combinations(range(n), k)]
    return float(np.mean(errors))


@pytest.mark.parametrize("kind", sorted(TRANSFORMS))
@pytest.mark.parametrize("b", [6, 7])  # even and odd; blocksrht pads both to 8 rows
def test_expected_variance_by_enumeration(kind, b):
    x, y = make_data(b=b, seed=4)
    t = TRANSFORMS[kind](b)
    for k in (2, 3, 5):
        want = enumerated_variance(t, x.numpy(), y.numpy(), k)
        # The library forms the dct/dft matrix in float32: fourth powers of entries with relative
        # rounding 6e-8 each.
        assert expected_variance(kind, x, y, k) == pytest.approx(want, rel=1e-5), (kind, b, k)


# The randomness the closed forms assume, read off each sketch directly: with every row kept,
# ``S^T = T D`` (sign kinds), so ``T^T S^T`` built from the definition must be the diagonal ``D``; with
# ``k < n`` rows, ``rowsample``'s ``S^T`` is ``sqrt(n/k)`` times ``k`` distinct rows of the identity.
# Each sign vector, each row's inclusion, is checked over RANDOM_SEEDS seeds within Z_FAMILY standard
# errors; Z_FAMILY = 4.5 bounds a false alarm of all ~140 comparisons of a test together by 1e-3
# (two-sided normal tail 6.8e-6 each).
RANDOM_SEEDS = 400
Z_FAMILY = 4.5


@pytest.mark.parametrize("kind, n", [("dct", 13), ("dct", 16), ("dft", 13), ("dft", 16),
                                     ("blocksrht", 13), ("blocksrht", 16)])
def test_transform_and_random_signs(kind, n):
    t = torch.from_numpy(TRANSFORMS[kind](n))  # n_pop x n_pop (blocksrht: padded to 16)
    n_pop = t.shape[0]
    signs = []
    for seed in range(RANDOM_SEEDS):
        st = SKETCHES[kind].apply(torch.eye(n, dtype=torch.float64), n_pop, seed)  # all rows
        d = t.T @ st  # D on the real rows, zero on the padding rows
        torch.testing.assert_close(d[:n], torch.diag(d.diagonal()), rtol=0, atol=1e-6)
        torch.testing.assert_close(d[n:], torch.zeros(n_pop - n, n, dtype=torch.float64))
        torch.testing.assert_close(d.diagonal().abs(), torch.ones(n, dtype=torch.float64))
        signs.append(d.diagonal())
    d = torch.stack(signs)
    se = 1 / math.sqrt(RANDOM_SEEDS)  # of the mean of RANDOM_SEEDS independent +-1 values
    assert d.mean(0).abs().max() < Z_FAMILY * se, "a sign is not +-1 with probability 1/2"
    pairs = (d.T @ d / RANDOM_SEEDS)[tuple(torch.triu_indices(n, n, 1))]
    assert pairs.abs().max() < Z_FAMILY * se, "signs are not independent of each other"
    assert not torch.equal(d[0], d[1])


def test_row_sampling_is_uniform_without_replacement():
    n, k = 16, 5
    counts = torch.zeros(n, dtype=torch.float64)
    for seed in range(RANDOM_SEEDS):
        sel = SKETCHES["rowsample"].apply(torch.eye(n, dtype=torch.float64), k, seed)
        sel = sel / math.sqrt(n / k)
        assert set(sel.unique().tolist()) == {0.0, 1.0} and (sel.sum(1) == 1).all()
        rows = sel.argmax(1)
        assert rows.unique().numel() == k  # without replacement
        counts[rows] += 1
    p = k / n
    se = math.sqrt(p * (1 - p) / RANDOM_SEEDS)
    assert (counts / RANDOM_SEEDS - p).abs().max() < Z_FAMILY * se, counts


def test_expected_variance_edge_cases(data):
    x, y = data
    assert expected_variance("exact", x, y, K) == 0.0
    for kind in ("rowsample", "dct", "dft"):
        assert expected_variance(kind, x, y, B) == 0.0          # every row kept: no variance
    assert expected_variance("blocksrht", x, y, 24) == 0.0      # every padded row kept
    # Sampling without replacement is (B-k)/k times D2_SGD.
    assert expected_variance("rowsample", x, y, K) == pytest.approx((B - K) / K * d2_sgd(x, y))


@pytest.mark.parametrize("kind", ["rowsample", "blocksrht"])
def test_blocksrht_variance_memory_is_rows_times_width(kind):
    """The block closed form needs O(B (N_in + N_out)) memory, never a N_in x N_out matrix per
    block: on 1024 rows of 256 x 256, per-block products would allocate 1024 * 256^2 doubles
    (537 MB) for rowsample, 67 MB for blocksrht; the inputs themselves are 2 MB each."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 256, dtype=torch.float64, generator=g)
    y = torch.randn(1024, 256, dtype=torch.float64, generator=g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v = expected_variance(kind, x, y, 100)
    assert max(e.cpu_memory_usage for e in prof.events()) < 20e6
    if kind == "rowsample":
        assert v == pytest.approx((1024 - 100) / 100 * d2_sgd(x, y))


# ----------------------------------------------------------------------------------------------
# The online estimator: unbiased for |X^T Y|^2, the sketch's variance, D2_SGD, D2_RMM and alpha.


def _online(kind, x, y, sx, sy, design=None):
    s = batch_stats(x, y)
    total = (sx.transpose(1, 2) @ sy).square().sum((1, 2))
    diag = (sx.square().sum(2) * sy.square().sum(2)).sum(1)
    d, n_pop = design or estimator_design(SKETCHES[kind], B, K)
    return online_estimate(s["sq_x"], s["sq_y"], s["per_row"], total, diag, B, K, d, n_pop)


@pytest.mark.parametrize("kind", KINDS)
def test_online_estimator_is_unbiased(kind, data, samples):
    x, y = data
    sx, sy = samples[kind]
    est = _online(kind, x, y, sx, sy)
    truth = {
        "xty": batch_stats(x, y)["xty"],
        "d2_sketch": expected_variance(kind, x, y, K),
        "d2_sgd": d2_sgd(x, y),
        "d2_rmm": d2_rmm(x, y, K),
        "alpha": alpha(x, y),
    }
    for key, want in truth.items():
        m, se = mean_se(est[key])
        assert abs(m - want) < Z * se, f"{kind} {key}: {m:.5g} +- {se:.2g}, exact {want:.5g}"

    # Power: the naive |dW|^2 for |X^T Y|^2, and the other sampling model, are both rejected.
    xty, se = truth["xty"], mean_se(est["xty"])[1]
    total = (sx.transpose(1, 2) @ sy).square().sum((1, 2))
    assert abs(total.mean().item() - xty) > 2 * Z * se
    design, n_pop = estimator_design(SKETCHES[kind], B, K)
    other = ("sampling", B) if design == "iid" else ("iid", B)
    m_other = _online(kind, x, y, sx, sy, design=other)["xty"].mean().item()
    assert abs(m_other - xty) > 2 * Z * se, f"{kind}: the {other[0]} formula is not rejected"


def test_online_estimator_exact_cases(data):
    x, y = data
    s = batch_stats(x, y)
    # Exact layer: |dW|^2 is |X^T Y|^2 and there is no sketch variance.
    est = online_estimate(s["sq_x"], s["sq_y"], s["per_row"], s["xty"], 0.0, B, B, "exact")
    assert est["xty"] == s["xty"] and est["d2_sketch"] == 0.0
    assert est["d2_sgd"] == pytest.approx(d2_sgd(x, y))
    assert est["ratio"] == pytest.approx(
        normalized_ratio(d2_rmm(x, y, B), d2_sgd(x, y), B, B))
    # Sampling every row is exact too, whatever the diagonal.
    est = online_estimate(s["sq_x"], s["sq_y"], s["per_row"], s["xty"], 123.0, B, B, "sampling", B)
    assert est["xty"] == s["xty"]
    # Fewer than two rows: no estimate.
    assert math.isnan(online_estimate(1.0, 1.0, 1.0, 1.0, 1.0, B, 1, "iid")["xty"])


def test_unsupported_kind_is_refused():
    from sketchprop.sketches import Sketch

    with pytest.raises(ValueError, match="no unbiased online estimator"):
        estimator_design(Sketch(name="mystery"), 10, 3)


# ----------------------------------------------------------------------------------------------
# Through the layer: hooks, padding rows, records.


@pytest.mark.parametrize("kind", KINDS)
def test_layer_tracker_is_unbiased_with_padding(kind):
    x_real, y_real = make_data(b=17, seed=1, dtype=torch.float32)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask.view(-1)[torch.tensor([2, 9, 13, 20])] = False      # 4 padding rows out of 21
    rows = mask.view(-1).nonzero().squeeze(1)
    x = 10 * torch.randn(21, N_IN, generator=torch.Generator().manual_seed(2))  # junk on padding
    x[rows] = x_real
    dy = torch.zeros(21, N_OUT)                              # padding rows get no gradient
    dy[rows] = y_real
    x, dy = x.reshape(3, 7, N_IN), dy.reshape(3, 7, N_OUT)

    ctx = SketchContext()
    ctx.set_mask(mask)
    layer = RandomizedLinear(N_IN, N_OUT, sketch=kind, rho=K / 17, min_rows=1, skip_padding=True,
                             context=ctx)
    layer.tracker = VarianceTracker("layer")
    n = 1200
    for _ in range(n):
        (layer(x) * dy).sum().backward()
    recs = layer.tracker.records
    assert len(recs) == n and {r["b"] for r in recs} == {17} and {r["b_proj"] for r in recs} == {K}
    assert [r["step"] for r in recs] == list(range(1, n + 1))

    xr, yr = x_real.double(), y_real.double()
    truth = {"d2_sketch": expected_variance(kind, xr, yr, K), "d2_sgd": d2_sgd(xr, yr),
             "d2_rmm": d2_rmm(xr, yr, K), "xty": batch_stats(xr, yr)["xty"]}
    for key, want in truth.items():
        m, se = mean_se(torch.tensor([r[key] for r in recs], dtype=torch.float64))
        msg = f"{kind} {key}: {m:.5g} +- {se:.2g}, exact {want:.5g}"
        assert abs(m - want) < Z * se + 1e-5 * abs(want), msg  # float32 layer: 1e-5 rounding
    for r in recs:
        assert r["ratio"] == pytest.approx(
            normalized_ratio(r["d2_rmm"], r["d2_sgd"], r["b"], r["b_proj"]), rel=1e-9)


def test_exact_layer_records_equal_the_paper_functions():
    x, y = make_data(b=12, seed=3, dtype=torch.float32)
    layer = RandomizedLinear(N_IN, N_OUT, sketch="gaussian", rho=1.0)  # k = B: stores X, exact
    layer.tracker = VarianceTracker("l")
    (layer(x) * y).sum().backward()
    (r,) = layer.tracker.records
    xd, yd = x.double(), y.double()
    assert r["sketch"] == "exact" and r["d2_sketch"] == pytest.approx(0.0, abs=1e-3)
    assert r["d2_sgd"] == pytest.approx(d2_sgd(xd, yd), rel=1e-5)
    assert r["d2_rmm"] == pytest.approx(d2_rmm(xd, yd, 12), rel=1e-5)
    assert r["alpha"] == pytest.approx(alpha(xd, yd), rel=1e-5)
    assert r["ratio"] == pytest.approx(12 / 11 * r["d2_rmm"] / r["d2_sgd"], rel=1e-9)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def test_tracking_adds_only_b_floats_of_saved_memory():
    x = torch.randn(4, 16, 32)                 # B = 64 rows
    saved = {}
    for track in (None, r"^0$"):
        model = _mlp()
        patch_linear(model, sketch="gaussian", rho=0.25, skip_padding=False, track_variance=track)
        with SavedTensorMeter(model) as meter:
            out = model(x)
        saved[track] = meter.bytes
        out.square().sum().backward()
    overhead = saved[r"^0$"] - saved[None]
    assert overhead == 64 * 4                  # the B row norms in float32, nothing else
    sketch_bytes = 16 * 32 * 4                 # S^T X of the tracked layer: k=16 rows of 32
    assert overhead <= sketch_bytes / 8


def test_tracker_keeps_no_tensor_after_backward():
    model = _mlp()
    patch_linear(model, sketch="dct", rho=0.25, skip_padding=False, track_variance=True)
    model(torch.randn(64, 32)).sum().backward()
    for tracker in trackers(model).values():
        (pending,) = tracker._pending
        assert pending[-1].numel() == 7       # seven scalars per step, not X, not the row norms
    tracker = trackers(model)["0"]
    tracker.FLUSH_EVERY = 3                   # long runs: pending statistics move to the CPU
    for _ in range(3):
        model(torch.randn(64, 32)).sum().backward()
    assert len(tracker._pending) == 1 and len(tracker._records) == 3
    assert len(tracker.records) == 4


def test_patch_linear_track_variance_selection_and_errors():
    model = _mlp()
    assert patch_linear(model, rho=0.5, track_variance=["2"], skip_padding=False) == ["0", "2"]
    assert list(trackers(model)) == ["2"]
    unpatch_linear(model)
    for bad, match in [("(", "not a valid regex"), ("^9$", "matches none"),
                       (["0", "nope"], "not patched"), ([], "empty")]:
        with pytest.raises(ValueError, match=match):
            patch_linear(model, rho=0.5, track_variance=bad)
        assert not any(isinstance(m, RandomizedLinear) for m in model.modules())  # untouched
    patch_linear(model, rho=0.5, skip_padding=False)
    assert track_variance(model, r"^0$") == ["0"] and list(trackers(model)) == ["0"]


def test_collect_records_and_callback():
    from sketchprop.tracking import VarianceCallback

    model = _mlp()
    patch_linear(model, sketch="rademacher", rho=0.5, skip_padding=False, track_variance=True)
    logged = []
    cb = VarianceCallback(log_fn=logged.append)
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    for step in range(4):
        cb.on_step_begin(None, state, None, model=model)
        for _ in range(2):                     # two micro-batches share a step
            model(torch.randn(40, 32)).square().sum().backward()
        state.global_step += 1
        if step % 2 == 1:
            cb.on_log(None, state, None, model=model, logs={"loss": 1.0})

    recs = collect(model)
    assert len(recs) == 16 and [r["step"] for r in recs] == sorted([1, 2, 3, 4] * 4)
    assert {"step", "layer", "d2_sgd", "d2_rmm", "ratio"} <= set(recs[0])
    assert cb.records == recs
    json.dumps(recs)                           # JSON-ready for result.json
    fields = ("d2_sgd", "d2_rmm", "ratio", "alpha")
    assert len(logged) == 2
    assert set(logged[1]) == {f"variance/{layer}/{f}" for layer in ("0", "2") for f in fields}
    window = [r["ratio"] for r in recs if r["layer"] == "2" and r["step"] in (3, 4)]
    assert logged[1]["variance/2/ratio"] == pytest.approx(sum(window) / len(window))
    cb.on_log(None, state, None, model=model, logs={})   # nothing new: nothing logged
    assert len(logged) == 2


def test_callback_in_a_real_trainer(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from sketchprop.tracking import VarianceCallback

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp()

        def forward(self, x, labels):
            return {"loss": (self.body(x).sum(-1) - labels).square().mean()}

    model = Toy()
    patch_linear(model, rho=0.5, skip_padding=False, track_variance=r"body\.0")
    data = [{"x": torch.randn(8, 32), "labels": torch.randn(8)} for _ in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    logged = []
    cb = VarianceCallback(log_fn=logged.append)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    assert [r["step"] for r in cb.records] == [1, 2, 3, 4]
    assert {r["layer"] for r in cb.records} == {"body.0"} and len(logged) == 2


def test_callback_attaches_trackers_itself():
    from sketchprop.tracking import VarianceCallback

    model = _mlp()
    patch_linear(model, rho=0.5, skip_padding=False)
    cb = VarianceCallback(track=r"^2$")
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    cb.on_train_begin(None, state, None, model=model)
    assert list(trackers(model)) == ["2"]
    with pytest.raises(ValueError, match="matches none"):
        VarianceCallback(track="nope").on_train_begin(None, state, None, model=model)


def test_plot_script_on_synthetic_records(tmp_path):
    import importlib.util
    from pathlib import Path

    from sketchprop.report.figure4 import per_step

    spec = importlib.util.spec_from_file_location(
        "plot_variance", Path(__file__).resolve().parents[1] / "scripts" / "plot_variance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(0)
    recs = []
    for step in range(1, 61):
        for layer in ("enc.6.dense", "enc.2.dense"):
            sgd = float(1 + step / 30 + 0.1 * torch.rand((), generator=g))
            rmm = sgd * 63 / 32 * float(1 + 0.2 * torch.randn((), generator=g))
            recs.append({"step": step, "layer": layer, "d2_sgd": sgd, "d2_rmm": rmm,
                         "ratio": 32 / 63 * rmm / sgd, "b": 64, "b_proj": 32})
    recs[5]["ratio"] = None                      # a step without an estimate is skipped
    run = tmp_path / "result.json"
    run.write_text(json.dumps({"task": "cola", "sketch": "gaussian", "rho": 0.5, "variance": recs}))
    out = tmp_path / "fig" / "figure4.png"
    assert mod.main([str(run), "--out", str(out), "--window", "9"]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    steps, ratio = per_step(recs, "ratio")
    assert steps == list(range(1, 61))
    assert ratio[0] == pytest.approx((recs[0]["ratio"] + recs[1]["ratio"]) / 2)  # layers averaged
    assert ratio[2] == recs[4]["ratio"]                                         # None skipped
    (tmp_path / "empty.json").write_text(json.dumps({"task": "cola"}))
    assert mod.main([str(tmp_path / "empty.json"), "--out", str(out)]) == 1
