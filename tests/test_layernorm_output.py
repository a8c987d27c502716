"""LayerNorm from its output (``patch_activations(layernorm="output")``): backward makes the
normalised input again from the output and per-row ``1 / std``, with the gradients of the stored
path to float32 rounding, and saves the input's bytes where the output is kept anyway."""

import pytest
import torch
from test_activations import tiny_bert
from test_patching import batch, tiny_roberta
from torch import nn

from sketchprop import activations as act
from sketchprop import patch_activations, patch_linear
from sketchprop.measure import SavedTensorMeter

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5


def close(a, b, name=""):
    """Within RTOL of ``b``'s norm (a relative error on the tensor, not per element), or of 1e-9
    for a gradient that is zero but for rounding (a key bias's)."""
    err = (a.double() - b.double()).norm().item()
    scale = b.double().norm().item()
    assert err <= RTOL * scale + 1e-9, f"{name}: error {err:.2e}, norm {scale:.2e}"


def module_grads(norm, x, g):
    x = x.clone().requires_grad_(True)
    norm.zero_grad(set_to_none=True)
    y = norm(x)
    y.backward(g)
    params = [p.grad for p in (norm.weight, norm.bias) if p is not None]
    return y.detach(), x.grad, params


@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("gamma", ["random", "zeros", "tiny"])
def test_module_gradients_equal_the_stored_path(affine, bias, gamma):
    """``gamma`` entries at zero (or too small to divide by) take their input columns: the
    gradients stay those of nn.LayerNorm, gamma's and beta's included."""
    gen = torch.Generator().manual_seed(0)
    ref = nn.LayerNorm(48, elementwise_affine=affine, bias=bias)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(torch.randn(48, generator=gen))
            if gamma == "zeros":
                ref.weight[::7] = 0
            elif gamma == "tiny":
                ref.weight[3] = 1e-6
            if bias:
                ref.bias.copy_(torch.randn(48, generator=gen) * 3)
    new = act.OutputLayerNorm.from_layernorm(ref)
    assert new.weight is ref.weight and new.bias is ref.bias
    x = torch.randn(4, 10, 48, generator=gen) * 2 + 1
    g = torch.randn(4, 10, 48, generator=gen)
    want, got = module_grads(ref, x, g), module_grads(new, x, g)
    assert torch.equal(got[0], want[0])  # same forward
    close(got[1], want[1], "dx")
    for a, b in zip(got[2], want[2], strict=True):
        close(a, b, "param")
    if affine and gamma != "random":
        assert new._kept_columns() is not None


def test_kept_columns_follow_the_weights():
    norm = act.OutputLayerNorm.from_layernorm(nn.LayerNorm(8))
    assert norm._kept_columns() is None
    with torch.no_grad():
        norm.weight[2] = 0
    assert norm._kept_columns().tolist() == [2]


def model_grads(model, b, setup):
    model.train()
    model.zero_grad(set_to_none=True)
    if setup in ("reentrant", "non-reentrant"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": setup == "reentrant"})
    torch.manual_seed(4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup == "bf16"):
        out = model(**b)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["roberta", "bert"])
@pytest.mark.parametrize("setup", ["plain", "sketch", "reentrant", "non-reentrant", "bf16"])
def test_model_gradients_equal_the_stored_path(family, setup):
    """Every dropout on, trained-looking LayerNorm weights: the gradients of every parameter are
    within RTOL of the same model with stored LayerNorm inputs."""
    def build(layernorm):
        model = (tiny_roberta if family == "roberta" else tiny_bert)(dropout=0.1)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for m in model.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                    m.bias.normal_(0, 0.5, generator=gen)
        if setup == "sketch":
            patch_linear(model, "gaussian", rho=1.0, min_rows=1)
        patch_activations(model, gelu_code="optimal", layernorm=layernorm)
        return model

    b = batch()
    model, ref = build("output"), build("stored")
    assert sum(isinstance(m, act.OutputLayerNorm) for m in model.modules()) == 5
    got, want = model_grads(model, b, setup), model_grads(ref, b, setup)
    close(got[0], want[0], "logits")
    for name, g in want[1].items():
        close(got[1][name], g, name)


def saved_bytes(model, b):
    model.train()
    torch.manual_seed(0)
    with SavedTensorMeter(model.parameters()) as meter:
        loss = model(**b).loss
    loss.backward()
    return meter.bytes


@pytest.mark.parametrize("sketch", [False, True])
def test_saves_the_input_where_the_output_is_kept(sketch):
    """The output LayerNorm's input is no longer kept where its output is the next attention
    block's input (every layer but the last, whose output goes through the classifier's dropout),
    and, with exact linears, neither is the attention output LayerNorm's (its output is the
    first FFN layer's input); every LayerNorm keeps ``1 / std`` and not the row means. The
    LayerNorms whose output nothing else keeps (the embeddings', followed by dropout, the last
    layer's) keep their output in place of their input: no change there."""
    def build(layernorm):
        model = tiny_roberta(dropout=0.1)
        if sketch:
            patch_linear(model, "gaussian", rho=0.5)
        patch_activations(model, layernorm=layernorm)
        return model

    b = batch()
    cfg = build("stored").config
    tokens = b["input_ids"].numel()
    row, stat = tokens * cfg.hidden_size * 4, tokens * 4
    norms = 2 * cfg.num_hidden_layers + 1
    kept_anyway = cfg.num_hidden_layers * (1 if sketch else 2) - 1
    assert saved_bytes(build("stored"), b) - saved_bytes(build("output"), b) == \
        kept_anyway * row + norms * stat
