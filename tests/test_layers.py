"""Layer level: RandomizedLinear and the sketches it uses."""

import math
import weakref
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from sketchprop import SKETCHES, RandomizedLinear
from sketchprop.functional import sketched_linear
from sketchprop.measure import SavedTensorMeter
from sketchprop.sketches import DCT, Sketch, num_proj_rows

RANDOM = [name for name in SKETCHES if name != "exact"]


def make_layer(sketch, rho=0.25, n_in=8, n_out=6, **kw):
    torch.manual_seed(0)
    return RandomizedLinear.from_linear(nn.Linear(n_in, n_out), sketch=sketch, rho=rho, **kw)


def grads(layer, x, g):
    """(dX, dW, db) of sum(layer(x) * g)."""
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    (layer(x) * g).sum().backward()
    return x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("sketch", list(SKETCHES))
@pytest.mark.parametrize("shape", [(37, 8), (3, 11, 8)])
def test_forward_dx_db_exact(sketch, shape):
    layer = make_layer(sketch, min_rows=1)
    ref = nn.Linear(8, 6)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(shape)
    g = torch.randn(*shape[:-1], 6)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
    dx, _, db = grads(layer, x, g)
    dx_ref, _, db_ref = grads(ref, x, g)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(db, db_ref)


def test_non_contiguous_input():
    layer = make_layer("gaussian", min_rows=1)
    x = torch.randn(8, 20).T  # (20, 8), not contiguous
    assert not x.is_contiguous()
    g = torch.randn(20, 6)
    dx, dw, _ = grads(layer, x, g)
    assert dx.shape == x.shape and dw.shape == (6, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)


def _mean_and_trace_var(layer, x, g, n):
    draws = torch.stack([grads(layer, x, g)[1] for _ in range(n)]).double()
    return draws.mean(0), draws.var(0).sum()


def _unbiased_statistic(layer, x, g, n):
    """``|mean - dW|^2 / (tr Var / n)``: about 1 for an unbiased sketch, whatever its variance."""
    exact = (g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])).double()
    mean, trace_var = _mean_and_trace_var(layer, x, g, n)
    return ((mean - exact).square().sum() / (trace_var / n)).item()


# The statistic is a sum of 48 squared standardised errors over 48: mean 1 and, for independent
# entries, standard deviation sqrt(2/48) = 0.2. Correlation between entries widens it, so the bound
# allows a mean several times 1; a bias of a few percent of |dW| puts it in the hundreds.
UNBIASED_BOUND = 4.0


@pytest.mark.parametrize("sketch", RANDOM)
def test_weight_gradient_unbiased(sketch):
    torch.manual_seed(1)
    x = torch.randn(64, 8) * torch.linspace(0.2, 3, 64)[:, None]  # uneven row norms
    g = torch.randn(64, 6)
    layer = make_layer(sketch, rho=0.25, seed=3)
    assert _unbiased_statistic(layer, x, g, n=2000) < UNBIASED_BOUND


def test_unbiased_check_catches_a_biased_sketch():
    """Control: the same check fails for a sketch scaled by 1.1 (E[S S^T] = 1.21 I)."""

    @dataclass(frozen=True)
    class Scaled(Sketch):
        name: str = "scaled-dct"

        def apply(self, a, k, seed, rows=None):
            return DCT().apply(a, k, seed, rows) * 1.1

    torch.manual_seed(1)
    x = torch.randn(64, 8) * torch.linspace(0.2, 3, 64)[:, None]
    g = torch.randn(64, 6)
    layer = make_layer(Scaled(), rho=0.25, seed=3)
    assert _unbiased_statistic(layer, x, g, n=2000) > 2 * UNBIASED_BOUND


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
    k = num_proj_rows(64, 0.25, 1)
    torch.testing.assert_close(sk.apply(x, k, 123), sk.apply(x, k, 123), rtol=0, atol=0)
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


@pytest.mark.parametrize("sketch", list(SKETCHES))
@pytest.mark.parametrize("rho", [0.5, 0.2, 0.1])
def test_saved_bytes_scale_with_rho(sketch, rho):
    b, n_in = 512, 64
    layer = make_layer(sketch, rho=rho, n_in=n_in, n_out=32)
    x = torch.randn(4, b // 4, n_in)
    with SavedTensorMeter(layer) as meter:
        layer(x).sum().backward()
    expect = (b if sketch == "exact" else math.ceil(rho * b)) * n_in * 4
    assert meter.bytes == expect


def test_input_not_kept_alive():
    leaf = torch.randn(64, 8, requires_grad=True)
    for module, alive in [(make_layer("gaussian"), False), (nn.Linear(8, 6), True)]:
        x = leaf * 2  # MulBackward with a scalar keeps no reference to its output
        ref = weakref.ref(x)
        y = module(x)
        del x
        assert (ref() is not None) == alive
        y.sum().backward()


def test_frozen_weight_stores_nothing_frozen_input_no_dx():
    layer = make_layer("gaussian")
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = torch.randn(64, 8, requires_grad=True)
    with SavedTensorMeter(layer) as meter:
        y = layer(x)
    assert meter.bytes == 0
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is None

    layer = make_layer("gaussian")
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sketch", ["exact", "gaussian", "dct", "blocksrht"])
def test_autocast(dtype, sketch):
    layer = make_layer(sketch, rho=0.5, n_in=16, n_out=8, min_rows=1)
    ref = nn.Linear(16, 8)
    ref.load_state_dict(layer.state_dict())
    x, g = torch.randn(2, 32, 16), torch.randn(2, 32, 8)
    with torch.autocast("cpu", dtype=dtype):
        y, y_ref = layer(x), ref(x)
    assert y.dtype == y_ref.dtype == dtype
    torch.testing.assert_close(y, y_ref)
    (y.float() * g).sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    if sketch == "exact":
        (y_ref.float() * g).sum().backward()
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), "abc", None])
def test_bad_rho_raises(bad):
    with pytest.raises(ValueError, match="rho"):
        make_layer("gaussian", rho=bad)


def test_unknown_sketch_raises():
    with pytest.raises(ValueError, match="'gausian'"):
        make_layer("gausian")


def test_extra_repr_and_shared_parameters():
    lin = nn.Linear(8, 6)
    layer = RandomizedLinear.from_linear(lin, sketch="dct", rho=0.2)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert "sketch=dct" in repr(layer) and "rho=0.2" in repr(layer)
    assert list(layer.state_dict()) == list(lin.state_dict())
