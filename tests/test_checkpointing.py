"""Activation checkpointing with sketched layers: a recomputed forward draws a new seed and a new
sketch, both saved tensors, so backward pairs them and the weight gradient stays unbiased
(sketchprop.functional's docstring); exact layers under checkpointing give exact gradients."""

import pytest
import torch
from scipy import stats
from test_layers import FALSE_ALARM, N_DRAWS, hotelling, make_layer, unbiased_data
from test_patching import batch, tiny_roberta
from torch import nn
from torch.utils.checkpoint import checkpoint

from sketchprop import SKETCHES, patch_activations, patch_linear
from sketchprop.measure import SavedTensorMeter
from sketchprop.tracking import collect

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    """A sketched layer followed by a nonlinearity and an exact layer: the layer's output
    gradient depends on its input, as in a transformer block."""

    def __init__(self, sketch):
        super().__init__()
        self.first = make_layer(sketch, rho=0.25, seed=3)
        torch.manual_seed(1)
        self.second = nn.Linear(6, 6)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def block_draws(block, x, g, n, checkpointed):
    out = []
    for _ in range(n):
        block.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        y = checkpoint(block, xx, use_reentrant=False) if checkpointed else block(xx)
        (y * g).sum().backward()
        out.append(block.first.weight.grad.detach().clone())
    return torch.stack(out).double().reshape(n, -1)


def exact_block_grad(block, x, g):
    block.zero_grad(set_to_none=True)
    w = block.first.weight
    y = block.second(torch.tanh(nn.functional.linear(x, w, block.first.bias)))
    (y * g).sum().backward()
    return w.grad.detach().clone().double().reshape(-1)


@pytest.mark.stack("ckpt-nonreentrant", "sketch")
@pytest.mark.parametrize("sketch", ["gaussian", "blocksrht", "rowsample", "importance"])
def test_weight_gradient_unbiased_under_checkpointing(sketch):
    """The layer-level statistic (Hotelling's T^2 against the exact gradient, the bound of
    test_layers) with the block checkpointed. A seed kept outside the saved tensors pairs two
    independent sketches: the mean gradient is then zero, T^2 in the tens of thousands."""
    x, _ = unbiased_data()
    g = torch.randn(64, 6, generator=torch.Generator().manual_seed(5))
    block = Block(SKETCHES[sketch])
    exact = exact_block_grad(block, x, g)
    n, p = N_DRAWS, exact.numel()
    bound = stats.f.isf(FALSE_ALARM, p, n - p) * p * (n - 1) / (n - p)
    calls = block.first.calls
    t2, _ = hotelling(block_draws(block, x, g, n, checkpointed=True), exact)
    assert block.first.calls - calls == 2 * n  # forward, then the recomputation in backward
    assert t2 < bound, f"{sketch}: T^2 = {t2:.1f}, bound {bound:.1f}"


def test_checkpointing_keeps_the_forward_and_dx_exact():
    x, _ = unbiased_data()
    g = torch.randn(64, 6)
    block = Block(SKETCHES["gaussian"])
    xx = x.clone().requires_grad_(True)
    y = checkpoint(block, xx, use_reentrant=False)
    (y * g).sum().backward()
    ref = x.clone().requires_grad_(True)
    y_ref = block.second(torch.tanh(nn.functional.linear(ref, block.first.weight,
                                                         block.first.bias)))
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(xx.grad, ref.grad)


def _grads(model, data):
    model.zero_grad(set_to_none=True)
    model(**data).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_exact_model_with_checkpointing_gives_the_exact_gradients(dropout):
    """HF gradient checkpointing (non-reentrant, as the training entry point enables it) on the
    unpatched model: the same loss and gradients as without, dropout included (checkpointing
    replays the global RNG state in the recomputation)."""
    data = batch()
    plain = tiny_roberta(dropout=dropout).train()
    ckpt = tiny_roberta(dropout=dropout).train()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(7)
    a = _grads(plain, data)
    torch.manual_seed(7)
    b = _grads(ckpt, data)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.stack("ckpt-nonreentrant", "sketch")
def test_patched_model_with_checkpointing_is_unbiased_in_a_shared_layer():
    """Our layout (Q, K, V share one sketch; padding rows skipped) under HF checkpointing: the
    mean of the query weight's gradient over many steps, projected on the exact gradient, is the
    exact projection within 4 standard errors of the mean."""
    data = batch()
    model = tiny_roberta().train()
    exact = _grads(model, data)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patch_linear(model, sketch="gaussian", rho=0.25, exclude="classifier", share_inputs=True,
                 skip_padding=True, min_rows=1, seed=0)
    name = "roberta.encoder.layer.0.attention.self.query.weight"
    u = exact[name].reshape(-1) / exact[name].norm()
    proj = torch.tensor([(_grads(model, data)[name].reshape(-1) @ u).item() for _ in range(400)],
                        dtype=torch.float64)
    target = (exact[name].reshape(-1) @ u).item()
    se = proj.std().item() / len(proj) ** 0.5
    assert abs(proj.mean().item() - target) < 4 * se, (proj.mean().item(), target, se)
    # The projection's mean is far from zero, where unpaired sketches would put it.
    assert target > 8 * se


def test_checkpointing_with_sketches_saves_the_seed_beside_the_sketch():
    """What a sketched layer keeps: its sketch and an 8-byte seed, nothing else."""
    layer = make_layer("gaussian", rho=0.25, n_in=8, n_out=6)
    x = torch.randn(64, 8, requires_grad=True)
    with SavedTensorMeter(layer) as meter:
        layer(x).sum().backward()
    assert meter.bytes == 16 * 8 * 4 + 8


def test_a_shared_sketch_gone_in_the_first_pass_is_formed_again_the_same():
    """A non-reentrant checkpoint's first pass keeps no saved tensor: the sketch the query formed
    (4-bit codes here) is gone when key and value look it up. They form it again from the
    query's draw, the very same bits, as the recomputation, which finds it, will save it."""
    model = tiny_roberta().train()
    patch_linear(model, sketch="gaussian", rho=0.5, bits=4, share_inputs=True, min_rows=1)
    payloads = []

    def pack(t):  # keep a copy, not the tensor: the original goes, as in the first pass
        if t.dtype == torch.uint8:
            payloads.append(t.clone())
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        model(**batch())
    q, k, v = payloads[:3]  # layer 0's query, key and value, in that order
    assert torch.equal(q, k) and torch.equal(q, v)


@pytest.mark.parametrize("sketch, rho, tracked, preset", [
    ("exact", 1.0, "attention.self.query", "lean"),  # the owner of Q, K and V's sketch tracked
    ("gaussian", 0.5, "attention.self.key", None),  # a layer sharing it tracked
])
def test_tracked_layers_sharing_a_sketch_under_checkpointing(sketch, rho, tracked, preset):
    """A tracked layer saves its rounding variances; each layer sharing its sketch must save in
    the first pass what it saves in the recomputation (else torch raises)."""
    model = tiny_roberta().train()
    patch_linear(model, sketch=sketch, rho=rho, bits=4, share_inputs=True, skip_padding=True,
                 min_rows=1, track_variance=tracked)
    if preset:
        patch_activations(model, preset=preset)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grads = _grads(model, batch())
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert len(collect(model)) == 2


class SharedInput(nn.Module):
    """Q, K and V reading the model's input itself, checkpointed or not."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key, self.value = (nn.Linear(16, 16) for _ in range(3))
        self.checkpointed = checkpointed

    def block(self, x):
        return torch.softmax(self.query(x) @ self.key(x).T, -1) @ self.value(x)

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)


@pytest.mark.parametrize("skip_padding", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_step_never_forms_a_sketch_from_an_earlier_steps_draw(checkpointed, skip_padding):
    """The same input tensor every step, and the query, which formed the shared sketch, frozen
    after the first: key and value must draw a sketch of their own at every step, never form one
    again from the query's old draw (a model call forgets the sketches shared before it)."""
    model = SharedInput(checkpointed)
    patch_linear(model, "gaussian", rho=0.25, share_inputs=True, skip_padding=skip_padding,
                 min_rows=1)
    x = torch.randn(32, 16)
    steps = []
    for step in range(3):
        if step == 1:
            model.query.weight.requires_grad_(False)
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        steps.append(model.key.weight.grad.clone())
    assert not torch.equal(steps[1], steps[2])
