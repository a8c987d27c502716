"""Importance sampling (sketchprop.sketches.Importance) and per-layer allocation
(sketchprop.allocation): unbiased whatever the gradient-norm estimate, learns where the gradient
is, O(B) state, exact variance formulas, byte total kept."""

import copy
import math

import pytest
import torch
from scipy import stats
from test_layers import (
    FALSE_ALARM,
    MIN_POWER,
    N_DRAWS,
    SCALE_ERROR,
    Scaled,
    grads,
    hotelling,
    make_layer,
)
from test_patching import batch, tiny_roberta
from torch import nn

from sketchprop import SKETCHES, RandomizedLinear, patch_linear, unpatch_linear
from sketchprop.allocation import VarianceAllocation
from sketchprop.measure import SavedTensorMeter
from sketchprop.sketches import GradNormEstimate, num_proj_rows
from sketchprop.variance import (
    VarianceTracker,
    batch_stats,
    expected_variance,
    importance_variance,
)

pytestmark = pytest.mark.usefixtures("one_thread")

Z = 4.5  # standard errors allowed for a mean (two-sided 7e-6 per comparison)


def positions_data(seed=1, b=4):
    """X (b x 16 positions x 8) with uneven row norms and dY correlated with it (6 outputs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 16, 8, generator=g) * torch.linspace(0.3, 2.5, 16)[None, :, None]
    dy = x @ torch.randn(8, 6, generator=g) / 3 + torch.randn(b, 16, 6, generator=g)
    return x, dy


def cls_only(dy):
    """The gradient a [CLS]-pooled classifier gives the last layer: nonzero at position 0 only."""
    out = torch.zeros_like(dy)
    out[:, 0] = dy[:, 0]
    return out


def train_estimate(layer, x, dy, steps=20):
    for _ in range(steps):
        grads(layer, x, dy)


def weight_draws(layer, x, g, n, state):
    """``n`` weight gradients, each drawn from a copy of the same estimate ``state``."""
    out = []
    for _ in range(n):
        layer.grad_norms = copy.deepcopy(state)
        out.append(grads(layer, x, g)[1])
    return torch.stack(out).double().reshape(n, -1)


def test_unbiased_with_an_estimate_learned_on_another_pattern():
    """Hotelling's T^2 (the bound and the 5% scale-error control of test_layers) when the
    estimate was trained on gradients 10x larger at positions 0-7 than at 8-15 and every draw
    faces the opposite pattern: the estimate ranks the rows backwards. A wrong estimate costs
    variance, so twice test_layers' draws keep the power against the 5% control above 0.99."""
    x, dy = positions_data(b=8)
    layer = make_layer("importance", rho=0.25, seed=3)  # 32 of 128 rows
    weights = torch.cat([torch.ones(8), torch.full((8,), 0.1)])[None, :, None]
    train_estimate(layer, x, dy * weights)
    state = copy.deepcopy(layer.grad_norms)
    w = state.weights(tuple(x.shape), None, x.device).reshape(8, 16)
    assert w[:, :8].mean() > 5 * w[:, 8:].mean()  # learned the first pattern
    g = dy * weights.flip(1)  # then faces the opposite one
    exact = (g.reshape(-1, 6).T @ x.reshape(-1, 8)).double().reshape(-1)
    n, p = 2 * N_DRAWS, exact.numel()
    f_bound = stats.f.isf(FALSE_ALARM, p, n - p)
    bound = f_bound * p * (n - 1) / (n - p)
    t2, cov = hotelling(weight_draws(layer, x, g, n, state), exact)
    assert t2 < bound, f"T^2 = {t2:.1f}, bound {bound:.1f}"
    snr = (exact @ torch.linalg.solve(cov, exact)).item() * (n - p - 2) / (n - 1)
    lam = n * ((SCALE_ERROR - 1) / SCALE_ERROR) ** 2 * snr
    assert stats.ncf.sf(f_bound, p, n - p, lam) >= MIN_POWER

    biased = make_layer(Scaled(base=SKETCHES["importance"], factor=math.sqrt(SCALE_ERROR)),
                        rho=0.25, seed=3)
    t2_biased, _ = hotelling(weight_draws(biased, x, g, n, state), exact)
    assert t2_biased > bound, f"the 5% control passes, T^2 = {t2_biased:.1f}"


def test_every_row_can_be_drawn_whatever_the_estimate():
    """The condition for unbiasedness: every row outside the top set has probability at least
    floor / |R| however wrong the scores are (zeros where the gradient is, all zeros, one huge
    score), the top set is never drawn, and the probabilities sum to one."""
    sk = SKETCHES["importance"]
    g = torch.Generator().manual_seed(0)
    cases = [torch.rand(100, generator=g), torch.zeros(100),
             torch.cat([torch.zeros(50), torch.rand(50, generator=g)]),
             torch.cat([torch.full((1,), 1e30), torch.rand(99, generator=g)])]
    for scores in cases:
        for k in (3, 10, 40):
            top, p, m = sk.design(scores, k)
            rest = torch.ones(100, dtype=torch.bool)
            rest[top] = False
            assert m == k - top.numel() >= 2
            assert p.sum().item() == pytest.approx(1.0)
            assert (p[~rest] == 0).all()
            assert p[rest].min().item() >= sk.floor / rest.sum().item() * (1 - 1e-12)


def test_skip_padding_never_draws_padding_and_stays_unbiased():
    """Padding rows (junk inputs, zero gradient) are left out: no plan index falls on them, the
    estimate learns from the real rows only, and dW is unbiased (Hotelling's T^2 as above)."""
    from sketchprop.layers import SketchContext

    x, dy = positions_data(b=8)
    mask = torch.ones(8, 16, dtype=torch.bool)
    for i in range(8):
        mask[i, 16 - 2 * i:] = False  # examples of 16, 14, ..., 2 tokens
    x = torch.where(mask[..., None], x, 50 * torch.randn(8, 16, 8))  # large junk on padding
    dy = dy * mask[..., None]
    ctx = SketchContext()
    ctx.set_mask(mask)
    layer = RandomizedLinear(8, 6, sketch="importance", rho=0.25, seed=2, skip_padding=True,
                             context=ctx)
    real = set(mask.reshape(-1).nonzero().squeeze(1).tolist())
    seen = set()
    real_plan = layer.sketch.plan

    def spy(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        seen.update(plan.index.tolist())
        return plan

    object.__setattr__(layer, "sketch", copy.copy(layer.sketch))
    object.__setattr__(layer.sketch, "plan", spy)
    exact = (dy.reshape(-1, 6).T @ x.reshape(-1, 8)).double().reshape(-1)
    n, p = N_DRAWS, exact.numel()
    bound = stats.f.isf(FALSE_ALARM, p, n - p) * p * (n - 1) / (n - p)
    draws = torch.stack([grads(layer, x, dy)[1] for _ in range(n)]).double().reshape(n, -1)
    assert seen and seen <= real
    t2, _ = hotelling(draws, exact)
    assert t2 < bound, f"T^2 = {t2:.1f}, bound {bound:.1f}"


def test_a_non_finite_gradient_leaves_the_estimate_usable():
    """An fp16 step whose gradient overflowed (the loss scaler skips it) reaches backward with
    inf/NaN rows: the estimate ignores them and the next plan is still drawn."""
    layer = make_layer("importance", rho=0.25)
    x, dy = torch.randn(2, 16, 8), torch.randn(2, 16, 6)
    train_estimate(layer, x, dy, steps=2)
    bad = dy.clone()
    bad[0, 3] = float("inf")
    bad[1, 5] = float("nan")
    grads(layer, x, bad)
    w = layer.grad_norms.weights(tuple(x.shape), None, x.device)
    assert torch.isfinite(w).all()
    assert torch.isfinite(grads(layer, x, dy)[1]).all()


def test_cls_only_gradient_is_learned():
    """A 3-D input whose output gradient is nonzero at position 0 only: after a few steps the
    estimate puts the [CLS] rows in the top set and the weight gradient is exact up to rounding,
    where blocksrht at the same k keeps its full variance."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 32, 16, generator=g)
    dy = cls_only(torch.randn(8, 32, 12, generator=g))
    layer = make_layer("importance", rho=0.1, n_in=16, n_out=12, seed=1)
    k = num_proj_rows(256, 0.1, layer.min_rows)
    assert k < 256
    first = [grads(layer, x, dy)[1] for _ in range(1)]  # the untrained estimate: uniform
    train_estimate(layer, x, dy, steps=5)
    exact = (dy.reshape(-1, 12).T @ x.reshape(-1, 16)).double()
    err = torch.stack([(grads(layer, x, dy)[1].double() - exact).square().sum()
                       for _ in range(50)]).mean().item()
    blocksrht = expected_variance("blocksrht", x.reshape(-1, 16), dy.reshape(-1, 12), k)
    assert err < 1e-6 * blocksrht, (err, blocksrht)
    assert (first[0].double() - exact).square().sum().item() > 1e-3 * blocksrht  # it had to learn


def test_estimate_memory_is_o_b_and_measured():
    """The state is three float32 vectors of the sequence length: it does not grow with the batch,
    the steps or the examples seen, and the layer saves only the k rows, indices and scales."""
    layer = make_layer("importance", rho=0.25, n_in=8, n_out=6)
    for b in (2, 16, 64):  # more examples, same sequence length
        x, dy = torch.randn(b, 24, 8), torch.randn(b, 24, 6)
        train_estimate(layer, x, dy, steps=3)
        assert layer.grad_norms.nbytes() == 3 * 4 * 24
    x, dy = torch.randn(2, 40, 8), torch.randn(2, 40, 6)  # a longer batch grows it to 40
    train_estimate(layer, x, dy, steps=1)
    assert layer.grad_norms.nbytes() == 3 * 4 * 40 <= 12 * x.numel() // 8
    flat = make_layer("importance", rho=0.25)
    train_estimate(flat, torch.randn(64, 8), torch.randn(64, 6), steps=2)
    assert flat.grad_norms.nbytes() == 12  # 2-D input: one position

    x = torch.randn(4, 128, 8)
    with SavedTensorMeter(layer) as meter:
        out = layer(x)
    k = num_proj_rows(512, 0.25, layer.min_rows)
    assert meter.bytes == k * 8 * 4 + k * 4 + k * 4 + 8  # rows, int32 indices, scales, top count
    out.sum().backward()


def test_state_is_not_in_the_state_dict_and_round_trips():
    lin = nn.Linear(8, 6)
    layer = RandomizedLinear.from_linear(lin, sketch="importance", rho=0.2)
    assert "sketch=importance" in repr(layer)
    train_estimate(layer, torch.randn(2, 10, 8), torch.randn(2, 10, 6), steps=2)
    assert list(layer.state_dict()) == list(lin.state_dict())
    model = tiny_roberta()
    keys = list(model.state_dict())
    data = batch()
    ref = model(**data).logits
    patch_linear(model, sketch="importance", rho=0.3, exclude="classifier")
    model(**data).loss.backward()
    unpatch_linear(model)
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(**data).logits, ref)


def test_shared_inputs_share_one_plan_and_one_estimate():
    model = tiny_roberta().train()
    data = batch()
    saved = {}
    for share in (False, True):
        m = copy.deepcopy(model)
        patch_linear(m, sketch="importance", rho=0.25, exclude="classifier",
                     share_inputs=share, min_rows=1)
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            with SavedTensorMeter(m.parameters()) as meter:
                loss = m(**data).loss
            loss.backward()
        saved[share] = meter.bytes
        attn = m.roberta.encoder.layer[0].attention.self
        same = attn.query.grad_norms is attn.key.grad_norms is attn.value.grad_norms
        assert same == share
    assert saved[True] < saved[False]


# ----------------------------------------------------------------------------- variance formulas

def importance_design(layer, x):
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[0]
    k = num_proj_rows(n, layer.rho, layer.min_rows)
    w = layer.grad_norms.weights(tuple(x.shape), None, x.device)
    top, p, m = layer.sketch.design(torch.linalg.vector_norm(x2, dim=1) * w, k)
    return top, p, m, k


def test_variance_formula_and_online_estimator():
    """With a fixed estimate (a copy per draw) whose top set is not empty: the Monte-Carlo error
    of dW matches importance_variance, and the tracker's online estimates of |X^T Y|^2 and of the
    sketch's variance are unbiased (all within Z standard errors)."""
    x, dy = positions_data(seed=2)
    dy = dy * torch.linspace(3.0, 0.2, 16)[None, :, None]  # early positions carry more gradient
    layer = make_layer("importance", rho=0.25, seed=5)
    train_estimate(layer, x, dy)
    state = copy.deepcopy(layer.grad_norms)
    top, p, m, k = importance_design(layer, x)
    assert 0 < top.numel() < k - 1
    x2, y2 = x.reshape(-1, 8).double(), dy.reshape(-1, 6).double()
    exact = y2.T @ x2
    want = importance_variance(x2, y2, top, p, m)
    xty = batch_stats(x2, y2)["xty"]

    layer.tracker = VarianceTracker("l")
    n = 3000
    dws = []
    for _ in range(n):
        layer.grad_norms = copy.deepcopy(state)
        dws.append(grads(layer, x, dy)[1].double())
    dws = torch.stack(dws)
    errs = (dws - exact).square().sum((1, 2))
    recs = layer.tracker.records
    assert len(recs) == n
    xty_hat = torch.tensor([r["xty"] for r in recs], dtype=torch.float64)
    for name, values, target in [
        ("|dW - G|^2", errs, want),
        ("d2_sketch", torch.tensor([r["d2_sketch"] for r in recs], dtype=torch.float64), want),
        ("xty", xty_hat, xty),
    ]:
        mean, se = values.mean().item(), values.std().item() / math.sqrt(n)
        assert abs(mean - target) < Z * se + 1e-5 * abs(target), (name, mean, se, target)
    # Power: the naive |dW|^2 for |X^T Y|^2 is off by far more than the estimator's noise.
    se = xty_hat.std().item() / math.sqrt(n)
    assert abs(dws.square().sum((1, 2)).mean().item() - xty) > 2 * Z * se


def test_plan_is_what_forward_saved():
    """Backward applies the forward's plan to dY: dW = (S^T dY)^T (S^T X) for that plan."""
    x, dy = positions_data(seed=3)
    sk = SKETCHES["importance"]
    x2, y2 = x.reshape(-1, 8), dy.reshape(-1, 6)
    plan = sk.plan(x2, 16, 123, None, torch.rand(64, generator=torch.Generator().manual_seed(0)))
    st = torch.zeros(16, 64)
    st[torch.arange(16), plan.index.long()] = plan.scale
    torch.testing.assert_close(plan.apply(x2), st @ x2)
    torch.testing.assert_close(plan.apply(y2), st @ y2)  # backward's S^T dY: the same S
    assert int(plan.ntop) + 2 <= 16 and (plan.scale[: int(plan.ntop)] == 1).all()
    with pytest.raises(TypeError, match="plan"):
        sk.apply(x2, 16, 0)


# ------------------------------------------------------------------------------------ allocation

class Bend(nn.Module):
    """A nonlinearity that saves nothing for backward, so a meter sees only the linear layers."""

    def forward(self, x):
        return x + 0.1 * x.detach().square()


class TwoHeads(nn.Module):
    """A shared layer, then one head read at every position and one read at position 0 only (as
    a [CLS] classifier reads the last layer): the heads' gradients differ in structure, so the
    allocation has rows to move, and importance makes the [CLS] head's variance nearly zero."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.shared, self.every, self.first = nn.Linear(32, 64), nn.Linear(64, 48), nn.Linear(64, 8)
        self.bend = Bend()

    def forward(self, x):
        h = self.bend(self.shared(x))
        return self.every(h).sum(-1) + self.first(h)[:, :1].sum(-1)


def step(model, x, g):
    model.zero_grad(set_to_none=True)
    (model(x) * g).sum().backward()


@pytest.mark.parametrize("sketch, tokens", [("importance", 256), ("blocksrht", 256),
                                            ("importance", 48)])
def test_allocation_keeps_the_byte_total_and_moves_rows(sketch, tokens):
    """2048 rows (k about 205 per layer), and 384 rows (k = 39, near min_rows = 16, as MiniLM's
    CoLA batches at rho 0.1): the bytes the sketched layers store (nothing else is saved) stay
    within 1% of the uniform rates'."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, tokens, 32, generator=g) * torch.rand(8, tokens, 1, generator=g) * 3
    out_grad = torch.randn(8, tokens, generator=g) * torch.linspace(2, 0.1, tokens)[None, :]
    uniform, alloc = TwoHeads(), TwoHeads()
    # The heads read one tensor: sharing its sketch would move them together.
    patch_linear(uniform, sketch=sketch, rho=0.1, skip_padding=False, share_inputs=False)
    patch_linear(alloc, sketch=sketch, rho=0.1, skip_padding=False, share_inputs=False,
                 allocate="variance")
    allocation = alloc.shared.allocation
    assert isinstance(allocation, VarianceAllocation) and allocation is alloc.first.allocation
    for _ in range(3 * allocation.every):
        step(alloc, x, out_grad)
    assert allocation.updates >= 2
    names = ("shared", "every", "first")
    factors = [allocation.factor(n) for n in names]
    assert max(abs(f - 1) for f in factors) > 0.05, factors  # rows did move
    saved = {}
    for name, model in (("uniform", uniform), ("variance", alloc)):
        with SavedTensorMeter(model.parameters()) as meter:
            out = model(x)
        (out * out_grad).sum().backward()
        saved[name] = meter.bytes
    assert saved["variance"] == pytest.approx(saved["uniform"], rel=0.01)
    # The optimum's stationarity condition: (f - tau) / sqrt(C / w) is the multiplier mu for
    # every layer strictly inside its bounds, and the layers at a bound would want to pass it.
    mu, inside = allocation.last_mu, 0
    for name in names:
        r = allocation.last[name]
        free = r["tau"] + mu * math.sqrt(r["c"] / r["w"])
        if r["lower"] + 1e-9 < r["f"] < r["cap"] - 1e-9:
            inside += 1
            assert r["f"] == pytest.approx(free, rel=1e-9)
        else:
            assert (r["f"] == r["lower"] and free <= r["lower"]) or (
                r["f"] == r["cap"] and free >= r["cap"])
    assert inside >= 1


def test_allocation_moves_shared_sketches_together():
    model = tiny_roberta().train()
    patch_linear(model, sketch="importance", rho=0.25, exclude="classifier", min_rows=1,
                 allocate="variance")
    data = batch(b=8, length=32)
    attn = model.roberta.encoder.layer[0].attention.self
    allocation = attn.query.allocation
    for _ in range(2 * allocation.every + 1):
        model.zero_grad(set_to_none=True)
        model(**data).loss.backward()
    assert allocation.updates >= 1
    f = {allocation.factor(n) for n in ("roberta.encoder.layer.0.attention.self.query",
                                        "roberta.encoder.layer.0.attention.self.key",
                                        "roberta.encoder.layer.0.attention.self.value")}
    assert len(f) == 1
    assert attn.query.grad_norms is attn.key.grad_norms  # still one sketch for the three


def test_bad_allocate_is_refused_before_any_change():
    model = TwoHeads()
    with pytest.raises(ValueError, match="'varaince'"):
        patch_linear(model, sketch="importance", allocate="varaince")
    assert not any(isinstance(m, RandomizedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="floor"):
        VarianceAllocation(floor=0)
    with pytest.raises(ValueError, match="decay"):
        GradNormEstimate(decay=1.0)
