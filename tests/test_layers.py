"""Layer level: RandomizedLinear and the sketches it uses, made from an nn.Linear and from
transformers' Conv1D (GPT-2's linear layer, weight stored (in, out))."""

import dataclasses
import math
import weakref
from dataclasses import dataclass

import pytest
import torch
from scipy import stats
from torch import nn
from transformers.pytorch_utils import Conv1D

from sketchprop import SKETCHES, RandomizedLinear
from sketchprop.functional import sketched_linear
from sketchprop.measure import SavedTensorMeter
from sketchprop.sketches import Sketch, num_proj_rows

RANDOM = [name for name, sk in SKETCHES.items() if not sk.exact]
SEEDED = [name for name in RANDOM if not SKETCHES[name].data_dependent]


pytestmark = pytest.mark.usefixtures("one_thread")


KINDS = ["linear", "conv1d"]


def plain_layer(kind, n_in=8, n_out=6):
    return nn.Linear(n_in, n_out) if kind == "linear" else Conv1D(n_out, n_in)


def make_layer(sketch, rho=0.25, n_in=8, n_out=6, kind="linear", **kw):
    torch.manual_seed(0)
    return RandomizedLinear.from_linear(plain_layer(kind, n_in, n_out), sketch=sketch, rho=rho,
                                        **kw)


def grads(layer, x, g):
    """(dX, dW, db) of sum(layer(x) * g); dW as (out, in), whichever way the layer stores it."""
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    (layer(x) * g).sum().backward()
    dw = layer.weight.grad
    if isinstance(layer, Conv1D) or getattr(layer, "fan_in_fan_out", False):
        dw = dw.T
    return x.grad, dw.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sketch", list(SKETCHES))
@pytest.mark.parametrize("shape", [(37, 8), (3, 11, 8)])
def test_forward_dx_db_exact(sketch, shape, kind):
    layer = make_layer(sketch, min_rows=1, kind=kind)
    ref = plain_layer(kind)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(shape)
    g = torch.randn(*shape[:-1], 6)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
    dx, _, db = grads(layer, x, g)
    dx_ref, _, db_ref = grads(ref, x, g)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(db, db_ref)


def test_non_contiguous_input():
    x = torch.randn(8, 20).T  # (20, 8), not contiguous
    assert not x.is_contiguous()
    g = torch.randn(20, 6)
    layer = make_layer("gaussian", min_rows=1, seed=4)
    twin = make_layer("gaussian", min_rows=1, seed=4)  # the same seed stream: the same sketches
    dx, dw, _ = grads(layer, x, g)
    _, dw_contiguous, _ = grads(twin, x.contiguous(), g)
    torch.testing.assert_close(dx, g @ layer.weight.detach())
    torch.testing.assert_close(dw, dw_contiguous)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)


# Unbiasedness: Hotelling's T^2 of the mean of n sketched weight gradients against the exact one.
#
# The n draws of dW (p = 6 x 8 = 48 entries) are independent: a fresh seed per call. With m their
# mean and C their sample covariance, for an unbiased sketch
#     T^2 = n (m - dW)^T C^{-1} (m - dW),    T^2 (n - p) / (p (n - 1)) ~ F(p, n - p),
# exact for normal draws and close here: the mean of n = 2000 draws is nearly normal (300 simulated
# repetitions: gaussian mean 48.8 against 49.2, 0.7% beyond the 1% point; rowsample, the least
# normal draws, 49.5 and 2%). The bound is the F quantile of 1e-4 (T^2 < 96.6): a false alarm has
# probability 1e-4, below 1e-3 even if non-normal tails made it several times larger.
#
# A scale error E[S S^T] = c I moves the mean to c dW and the covariance to c^2 Sigma, so T^2 is
# noncentral F with lambda = n ((c - 1) / c)^2 dW^T Sigma^{-1} dW. Power 0.99 at c = 1.05 needs
# lambda >= 93, i.e. a per-draw signal-to-noise dW^T Sigma^{-1} dW >= 21 at n = 2000 (28.5 at
# n = 1500). On this data (dY correlated with X, |dW| well above the noise) the kinds range from 29
# (blocksrht) to 74 (rowsample): lambda >= 130 and power >= 0.9999. Each test recomputes its
# kind's power from its own draws, so a kind added to SKETCHES is held to the same standard, and
# runs the 5% biased control.
N_DRAWS = 2000
FALSE_ALARM = 1e-4
SCALE_ERROR = 1.05
MIN_POWER = 0.99


@dataclass(frozen=True)
class Scaled(Sketch):
    """``base`` times ``factor``: ``E[S S^T] = factor^2 I``."""

    name: str = "scaled"
    base: Sketch = SKETCHES["gaussian"]
    factor: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "data_dependent", self.base.data_dependent)

    def apply(self, a, k, seed, rows=None):
        return self.base.apply(a, k, seed, rows) * self.factor

    def plan(self, *args, **kwargs):
        plan = self.base.plan(*args, **kwargs)
        return dataclasses.replace(plan, scale=plan.scale * self.factor)


def unbiased_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g) * torch.linspace(0.2, 3, 64)[:, None]  # uneven row norms
    dy = x @ torch.randn(8, 6, generator=g) / 3 + torch.randn(64, 6, generator=g)
    return x, dy


def weight_draws(sketch, x, g, n, kind="linear"):
    layer = make_layer(sketch, rho=0.25, seed=3, kind=kind)  # 16 of 64 rows
    return torch.stack([grads(layer, x, g)[1] for _ in range(n)]).double().reshape(n, -1)


def hotelling(draws, target):
    """``(T^2, C)`` of ``draws`` (n x p) about ``target``."""
    n = draws.shape[0]
    cov = torch.cov(draws.T)
    # A sketch that does not vary (no randomness) has no covariance to test against.
    assert torch.linalg.eigvalsh(cov).min() > 1e-9 * cov.diagonal().mean()
    dev = draws.mean(0) - target
    return n * (dev @ torch.linalg.solve(cov, dev)).item(), cov


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sketch", RANDOM)
def test_weight_gradient_unbiased(sketch, kind):
    x, g = unbiased_data()
    exact = (g.T @ x).double().reshape(-1)
    n, p = N_DRAWS, exact.numel()
    f_bound = stats.f.isf(FALSE_ALARM, p, n - p)
    bound = f_bound * p * (n - 1) / (n - p)
    t2, cov = hotelling(weight_draws(SKETCHES[sketch], x, g, n, kind), exact)
    assert t2 < bound, f"{sketch}: T^2 = {t2:.1f}, bound {bound:.1f}"

    # Power against a 5% scale error, from this kind's covariance; (n - p - 2) / (n - 1) undoes
    # the upward bias of the inverse of a sample covariance.
    snr = (exact @ torch.linalg.solve(cov, exact)).item() * (n - p - 2) / (n - 1)
    lam = n * ((SCALE_ERROR - 1) / SCALE_ERROR) ** 2 * snr
    power = stats.ncf.sf(f_bound, p, n - p, lam)
    assert power >= MIN_POWER, f"{sketch}: power {power:.4f} against a 5% scale error"

    biased = Scaled(base=SKETCHES[sketch], factor=math.sqrt(SCALE_ERROR))
    t2_biased, _ = hotelling(weight_draws(biased, x, g, n, kind), exact)
    assert t2_biased > bound, f"{sketch}: the 5% control passes, T^2 = {t2_biased:.1f}"


@pytest.mark.parametrize("sketch", ["gaussian", "dct", "blocksrht"])
def test_error_shrinks_at_sqrt_n_rate(sketch):
    """The mean of n draws approaches dW as 1/sqrt(n): 16x the draws, about 1/4 the error."""
    torch.manual_seed(2)
    x, g = torch.randn(64, 8), torch.randn(64, 6)
    exact = (g.T @ x).double()
    layer = make_layer(sketch, rho=0.25, seed=5)
    draws = torch.stack([grads(layer, x, g)[1] for _ in range(3200)]).double()
    # Average the error over independent groups so each side is a stable estimate.
    err_small = (draws.view(16, 200, 6, 8).mean(1) - exact).norm(dim=(1, 2)).mean()
    err_large = (draws.mean(0) - exact).norm()
    ratio = (err_small / err_large).item()
    # Expected ratio sqrt(16) = 4; err_large is a single draw of a chi-like variable, so allow a
    # factor of about 2 either way.
    assert 2.0 < ratio < 8.0, ratio


@pytest.mark.parametrize("sketch", RANDOM)
def test_fresh_sketch_per_call_same_sketch_per_seed(sketch):
    layer = make_layer(sketch, rho=0.25)
    x, g = torch.randn(64, 8), torch.randn(64, 6)
    _, dw1, _ = grads(layer, x, g)
    _, dw2, _ = grads(layer, x, g)
    assert not torch.allclose(dw1, dw2)  # a new seed per forward call

    sk = SKETCHES[sketch]
    if sk.data_dependent:  # the same seed and state give the same plan; another seed another
        w = torch.ones(64)
        k = num_proj_rows(64, 0.25, 1)
        p1, p2, p3 = (sk.plan(x, k, s, None, w) for s in (123, 123, 124))
        assert torch.equal(p1.index, p2.index) and not torch.equal(p1.index, p3.index)
        return
    k = num_proj_rows(64, 0.25, 1)
    assert not torch.allclose(sk.apply(x, k, 123), sk.apply(x, k, 124))  # the seed is used
    # Backward regenerates the forward's S: dW equals dY^T S S^T X with S read off the identity.
    st = sk.apply(torch.eye(64), k, 123)
    w = layer.weight.detach().clone().requires_grad_(True)
    y = sketched_linear(x, w, None, sk, k, 123)
    (y * g).sum().backward()
    torch.testing.assert_close(w.grad, g.T @ st.T @ st @ x, rtol=1e-4, atol=1e-4)


def test_same_run_seed_same_stream_and_global_rng_untouched():
    x, g = torch.randn(64, 8), torch.randn(64, 6)
    a, b = make_layer("gaussian", seed=7, name="l"), make_layer("gaussian", seed=7, name="l")
    state = torch.get_rng_state()
    torch.testing.assert_close(grads(a, x, g)[1], grads(b, x, g)[1], rtol=0, atol=0)
    assert torch.equal(state, torch.get_rng_state())
    c = make_layer("gaussian", seed=7, name="other")
    assert not torch.allclose(grads(c, x, g)[1], grads(make_layer("gaussian", seed=7, name="l"),
                                                       x, g)[1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sketch", list(SKETCHES))
@pytest.mark.parametrize("rho", [0.5, 0.2, 0.1])
def test_saved_bytes_scale_with_rho(sketch, rho, kind):
    b, n_in = 512, 64
    layer = make_layer(sketch, rho=rho, n_in=n_in, n_out=32, kind=kind)
    x = torch.randn(4, b // 4, n_in)
    with SavedTensorMeter(layer) as meter:
        layer(x).sum().backward()
    # The sketch S^T X, and for a random sketch the 8-byte seed that regenerates S in backward;
    # importance sampling saves k int32 row indices, k float32 scales and its 8-byte top count.
    k = math.ceil(rho * b)
    expect = b * n_in * 4 if sketch == "exact" else k * n_in * 4 + 8
    if SKETCHES[sketch].data_dependent:
        expect += 8 * k
    assert meter.bytes == expect


@pytest.mark.parametrize("kind", KINDS)
def test_input_not_kept_alive(kind):
    leaf = torch.randn(64, 8, requires_grad=True)
    for module, alive in [(make_layer("gaussian", kind=kind), False), (plain_layer(kind), True)]:
        x = leaf * 2  # MulBackward with a scalar keeps no reference to its output
        ref = weakref.ref(x)
        y = module(x)
        del x
        assert (ref() is not None) == alive
        y.sum().backward()


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_weight_stores_nothing_frozen_input_no_dx(kind):
    layer = make_layer("gaussian", kind=kind)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = torch.randn(64, 8, requires_grad=True)
    with SavedTensorMeter(layer) as meter:
        y = layer(x)
    assert meter.bytes == 0
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is None

    layer = make_layer("gaussian", kind=kind)
    x = torch.randn(64, 8)  # no grad: no dX, still a weight gradient
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is None


def test_fewer_rows_than_min_rows_is_exact():
    layer = make_layer("gaussian", rho=0.1, min_rows=16)
    ref = nn.Linear(8, 6)
    ref.load_state_dict(layer.state_dict())
    x, g = torch.randn(5, 8), torch.randn(5, 6)
    torch.testing.assert_close(grads(layer, x, g)[1], grads(ref, x, g)[1])
    assert num_proj_rows(5, 0.1, 16) == 5
    assert num_proj_rows(4096, 0.1, 16) == 410
    assert num_proj_rows(100, 0.01, 3) == 3


@pytest.mark.stack("autocast-bf16", "sketch")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sketch", ["exact", "gaussian", "dct", "blocksrht", "importance"])
def test_autocast(dtype, sketch, kind):
    layer = make_layer(sketch, rho=0.5, n_in=16, n_out=8, min_rows=1, seed=4, kind=kind)
    ref = plain_layer(kind, 16, 8)
    ref.load_state_dict(layer.state_dict())
    x, g = torch.randn(2, 32, 16), torch.randn(2, 32, 8)
    with torch.autocast("cpu", dtype=dtype):
        y, y_ref = layer(x), ref(x)
    assert y.dtype == y_ref.dtype == dtype
    torch.testing.assert_close(y, y_ref)
    (y.float() * g).sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    # The same sketches in float32 (a twin with the same seed stream). Under autocast X, dY, S^T X,
    # S^T dY and dW are each rounded to the 16-bit type, a relative error of at most eps/2 each;
    # as random errors they add to about 0.6 eps (measured). The sketch of another seed is O(1) away.
    twin = make_layer(sketch, rho=0.5, n_in=16, n_out=8, min_rows=1, seed=4, kind=kind)
    (twin(x) * g).sum().backward()
    err = (layer.weight.grad - twin.weight.grad).norm() / twin.weight.grad.norm()
    assert err < 2 * torch.finfo(dtype).eps, err


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), "abc", None])
def test_bad_rho_raises(bad):
    with pytest.raises(ValueError, match="rho"):
        make_layer("gaussian", rho=bad)


def test_unknown_sketch_raises():
    with pytest.raises(ValueError, match="'gausian'"):
        make_layer("gausian")


@pytest.mark.parametrize("kind", KINDS)
def test_extra_repr_shared_parameters_and_back(kind):
    lin = plain_layer(kind)
    layer = RandomizedLinear.from_linear(lin, sketch="dct", rho=0.2)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert "sketch=dct" in repr(layer) and "rho=0.2" in repr(layer)
    assert list(layer.state_dict()) == list(lin.state_dict())
    assert (layer.in_features, layer.out_features) == (8, 6)
    back = layer.to_linear()
    assert type(back) is type(lin) and back.weight is lin.weight and back.bias is lin.bias
    x = torch.randn(5, 8)
    torch.testing.assert_close(back(x), lin(x), rtol=0, atol=0)


def test_other_layer_types_are_refused():
    with pytest.raises(TypeError, match="Conv1d"):
        RandomizedLinear.from_linear(nn.Conv1d(8, 6, 1))
