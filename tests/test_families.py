"""Every family of `sketchprop.bench.families`, at one code group a row and at several: no
parameter loses its gradient under `patch_activations` (compact and lean, with and without
`patch_linear(bits=4)`), and with every part exact the gradients are the unpatched model's to float
rounding. Batches padded on the right; dropout off, so both models draw nothing."""

import functools

import pytest
import torch

from sketchprop import activations as act
from sketchprop import patch_activations, patch_linear
from sketchprop.bench import families as fam
from sketchprop.patching import PARTS_OFF

pytestmark = pytest.mark.usefixtures("one_thread")

SETUPS = {
    "compact": lambda m: patch_activations(m),
    "lean": lambda m: patch_activations(m, preset="lean"),
    "int4+compact": lambda m: (patch_linear(m, sketch="exact", bits=4), patch_activations(m)),
    "int4+lean": lambda m: (patch_linear(m, sketch="exact", bits=4),
                            patch_activations(m, preset="lean")),
}
WIDTHS = {"tiny": fam.TINY, "wide": fam.WIDE}
# Float32 reassociation over a 2-layer model: observed below 1e-6 of a gradient's norm; a
# gradient that is zero in exact arithmetic (a key bias: softmax ignores it) is rounding alone,
# measured against the whole model's gradient.
RTOL, GTOL = 1e-5, 1e-7


@functools.cache
def reference(name: str, width: str) -> dict[str, torch.Tensor]:
    """The unpatched model's gradients on the family's padded batch."""
    model = fam.build(name, WIDTHS[width])
    model(**fam.make_batch(name, model)).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def patched_grads(name: str, width: str, setup) -> dict[str, torch.Tensor]:
    model = fam.build(name, WIDTHS[width])
    setup(model)
    loss = model(**fam.make_batch(name, model)).loss
    assert torch.isfinite(loss)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("name", list(fam.FAMILIES))
def test_no_parameter_loses_its_gradient(name, setup, width):
    want = reference(name, width)
    got = patched_grads(name, width, SETUPS[setup])
    assert sorted(set(want) - set(got)) == [], "parameters without a gradient"
    assert all(torch.isfinite(g).all() for g in got.values())


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("name", list(fam.FAMILIES))
def test_exact_parts_give_the_unpatched_gradients(name, width):
    want = reference(name, width)

    def exact(model):
        patch_linear(model, sketch="exact")
        experts = any(map(act.is_experts, model.modules()))
        patch_activations(model, gelu_bits=None, **({"experts": "recompute"} if experts else {}))

    got = patched_grads(name, width, exact)
    assert set(got) == set(want)
    scale = torch.stack([g.norm() for g in want.values()]).norm()
    for n, g in want.items():
        err = (got[n] - g).norm()
        assert err <= RTOL * g.norm() + GTOL * scale, (n, err.item(), g.norm().item())


#: Each exact part of patch_activations, alone: every other part off.
PARTS_ALONE = {"dropout": {"dropout": "seeded"}, "attention": {"attention": "recompute"},
               "layernorm": {"layernorm": "output"}, "mlp-input": {"mlp": "input"},
               "mlp-recompute": {"mlp": "recompute"}, "rmsnorm": {"rmsnorm": "compact"},
               "lm_loss": {"lm_loss": "chunked"}, "experts": {"experts": "recompute"}}


@pytest.mark.parametrize("part", list(PARTS_ALONE))
@pytest.mark.parametrize("name", list(fam.FAMILIES))
def test_each_exact_part_alone_gives_the_unpatched_gradients(name, part):
    """Each structural part found by what the model computes, alone, on every family where it
    applies (found nowhere: nothing to check): the unpatched gradients to float rounding."""
    want = reference(name, "tiny")
    model = fam.build(name)
    try:
        patch_activations(model, **{**PARTS_OFF, **PARTS_ALONE[part]})
    except ValueError as err:
        assert "the model has no" in str(err) or "not a transformers causal LM" in str(err) \
            or "does not call its attention" in str(err), err
        return
    loss = model(**fam.make_batch(name, model)).loss
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    scale = torch.stack([g.norm() for g in want.values()]).norm()
    for n, g in want.items():
        assert (got[n] - g).norm() <= RTOL * g.norm() + GTOL * scale, (n, part)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dropout_at_width_seeded_and_packed_masks_agree(name):
    """With dropout on (the families' configs turn it off) at several code groups a row: seeded
    masks (made again from a seed) and packed ones (kept at one bit) are the same masks, so the
    gradients agree bit for bit; lean with bits=4 keeps every gradient."""
    keys = {"bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
            "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop")}[name]

    def grads(setup):
        model = fam.build(name, fam.WIDE, **dict.fromkeys(keys, 0.1))
        setup(model)
        assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in model.modules())
        model(**fam.make_batch(name, model)).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    seeded = grads(lambda m: patch_activations(m, dropout="seeded"))
    packed = grads(lambda m: patch_activations(m, dropout="packed"))
    assert set(seeded) == set(packed) and all(torch.equal(seeded[n], packed[n]) for n in seeded)
    lean = grads(SETUPS["int4+lean"])
    assert set(lean) == set(seeded) and all(torch.isfinite(g).all() for g in lean.values())


@pytest.mark.parametrize("grad", [True, False])
def test_a_learned_float_mask_is_the_models_own_on_either_path(grad):
    """A float attention mask that requires a gradient (a learned one, bidirectional here): with
    gradients it joins the recompute's bias; without them (SDPA's path, CUDA's always) it stays
    the mask, with no causal mask added on top (one was, when the mask went into the bias)."""
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = (0.1 * torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)))
    mask.requires_grad_(True)

    def logits(patch):
        model = fam.build("llama").eval()
        if patch:
            patch_activations(model, attention="recompute", gelu_bits=None, lm_loss="stored")
        with torch.set_grad_enabled(grad):
            return model(input_ids=ids, attention_mask=mask).logits.detach()

    torch.testing.assert_close(logits(True), logits(False))


@pytest.mark.parametrize("name", ["llama", "qwen3", "bert", "t5"])
def test_output_attentions_are_the_models_own(name):
    """``output_attentions=True`` returns the probabilities eager attention returns, grouped K/V
    heads included (they crashed) and T5's position bias in them."""
    model = fam.build(name)
    data = fam.make_batch(name, model)
    want = model(**data, output_attentions=True)
    patch_activations(model, attention="recompute", gelu_bits=None)
    got = model(**data, output_attentions=True)
    key = "encoder_attentions" if name == "t5" else "attentions"
    for a, b in zip(got[key], want[key], strict=True):
        torch.testing.assert_close(a, b)
