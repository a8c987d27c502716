"""The lean preset: one stored code per activation (sketchprop.codes), LayerNorm's backward from
it, attention recomputed from it, the linear layers sharing it; patching, Hydra and identity."""

import math

import pytest
import torch
from test_patching import batch, tiny_roberta
from torch import nn

from sketchprop import patch_activations, patch_linear, unpatch_activations
from sketchprop.activations import CodedLayerNorm, OutputLayerNorm
from sketchprop.codes import code_of
from sketchprop.glue.config import ConfigError, compose, validate
from sketchprop.glue.runs import identity
from sketchprop.tracking import collect


def lean_model(layers=2, exclude=None, skip_padding=True, sketch="exact", rho=1.0):
    model = tiny_roberta(layers).train()
    patch_linear(model, sketch=sketch, rho=rho, bits=4, exclude=exclude, skip_padding=skip_padding)
    patch_activations(model, preset="lean")
    return model


def full_batch(b=4, length=16):
    out = batch(b, length)
    out["attention_mask"] = torch.ones_like(out["attention_mask"])
    return out


def grads(model, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# Layer: LayerNorm's backward from a 4-bit code of its output.


def layernorm_draws(draws: int, width=64, rows=256, group=16):
    """``draws`` gradients of a CodedLayerNorm (independent roundings) and the exact ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g) * 2 + 1
    dy = torch.randn(rows, width, generator=g)
    norm = nn.LayerNorm(width)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(width, generator=g))
        norm.bias.copy_(torch.randn(width, generator=g))
    xr = x.clone().requires_grad_()
    norm(xr).backward(dy)
    exact = (xr.grad, norm.weight.grad.clone(), norm.bias.grad.clone())
    coded = CodedLayerNorm.from_layernorm(norm, bits=4, group=group, name="ln").train()
    out = []
    for _ in range(draws):
        norm.zero_grad()
        xr = x.clone().requires_grad_()
        coded(xr).backward(dy)
        out.append((xr.grad, norm.weight.grad.clone(), norm.bias.grad.clone()))
    return exact, [torch.stack(t) for t in zip(*out, strict=True)]


def z_scores(draws: torch.Tensor, exact: torch.Tensor, k: int = 8) -> torch.Tensor:
    """z-scores of the mean of ``draws`` against ``exact`` along ``k`` fixed random directions: a
    projection sums many elements, so its mean is normal (an element alone is not: one at its
    group's end rounds up rarely, and 200 draws may never see it)."""
    w = torch.randn(k, exact.numel(), generator=torch.Generator().manual_seed(1))
    s = draws.reshape(draws.shape[0], -1) @ w.T
    se = s.std(0) / math.sqrt(draws.shape[0])
    return (s.mean(0) - w @ exact.reshape(-1)) / se


def test_coded_layernorm_weight_gradient_is_unbiased_and_bias_gradient_exact():
    (_, dw, db), (_, dws, dbs) = layernorm_draws(200)
    assert torch.allclose(dbs, db.expand_as(dbs), rtol=1e-5, atol=1e-5)  # reads no code
    assert z_scores(dws, dw).abs().max() < 4  # 8 normal z-scores: |z| > 4 has p ~ 5e-4 in all
    assert (dws.std(0) > 0).all()  # the code is random: a saved output would give no spread


def test_coded_layernorm_input_gradient_bias_is_below_its_noise():
    """dX's last term is quadratic in the code: a bias of Var(e / gamma) / n of the element's
    first term (norms module docstring), here a 64th of a 4-bit rounding's variance: below the
    standard error of 200 draws, so the mean passes the unbiased z-test; a code read wrong (a
    shifted grid, a lost column) would not."""
    (dx, _, _), (dxs, _, _) = layernorm_draws(200)
    assert z_scores(dxs, dx).abs().max() < 4


def test_coded_layernorm_in_eval_mode_is_the_output_layernorm():
    norm = nn.LayerNorm(32)
    x = torch.randn(8, 32, requires_grad=True)
    coded = CodedLayerNorm.from_layernorm(norm).eval()
    out = OutputLayerNorm.from_layernorm(norm).eval()
    coded(x).sum().backward()
    a = x.grad.clone()
    x.grad = None
    out(x).sum().backward()
    assert torch.equal(a, x.grad)
    assert "bits=4, group=64" in repr(coded)


# Sharing: one code per LayerNorm output, read by the next layers.


def saved(t: torch.Tensor, index: int) -> torch.Tensor:
    """Saved tensor ``index`` of the autograd Function that made ``t`` (through a view)."""
    node = t.grad_fn
    while type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    return node.saved_tensors[index]


@pytest.mark.parametrize("padded", [False, True])
def test_lean_linear_layers_save_the_layernorm_code(padded):
    model = lean_model()
    seen = {}

    def keep(name):
        def hook(module, args, out):
            seen[name] = (code_of(args[0]), out)
        return hook

    for n, m in model.named_modules():
        if n.endswith(("query", "key", "value", "intermediate.dense", "LayerNorm")):
            m.register_forward_hook(keep(n))
    loss = model(**(batch() if padded else full_batch())).loss
    for i in range(2):
        layer = f"roberta.encoder.layer.{i}"
        ln_out = seen[f"{layer}.attention.output.LayerNorm"][1]
        code, out = seen[f"{layer}.intermediate.dense"]
        assert code is not None and code.payload is code_of(ln_out).payload
        assert saved(out, 1) is code.payload is saved(ln_out, 0)  # one tensor, saved twice
        q, k, v = (seen[f"{layer}.attention.self.{p}"] for p in ("query", "key", "value"))
        assert saved(q[1], 1) is saved(k[1], 1) is saved(v[1], 1) is q[0].payload
        if i:  # layer 1's input is layer 0's output LayerNorm's
            prev = seen[f"roberta.encoder.layer.{i - 1}.output.LayerNorm"][1]
            assert q[0].payload is code_of(prev).payload
    loss.backward()


def test_a_tensor_changed_in_place_is_coded_again():
    """ReLU(inplace=True) after a LayerNorm changes the tensor the code was made of: the next
    layer codes the ReLU output itself (its decoded rows are >= 0), and LayerNorm's backward still
    reads the code of its own output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(inplace=True),
                          nn.Linear(64, 8)).train()
    patch_linear(model, sketch="exact", bits=4, exclude=None)
    patch_activations(model, preset="lean")
    out = model(torch.randn(32, 16))
    last = out.grad_fn.saved_tensors[1]  # the LayerNorm's code decodes to negative values too
    from sketchprop.quantize import QuantSpec, dequantize

    assert dequantize(last, QuantSpec(4, 64, 32, 64, torch.float32)).min() >= 0
    out.sum().backward()


def relative_error(got: dict, exact: dict, names) -> float:
    return math.sqrt(sum(((got[n] - exact[n]) ** 2).sum() for n in names)
                     / sum((exact[n] ** 2).sum() for n in names))


def tracked_lean_model():
    """Lean, with key and intermediate.dense tracked: their variances want a code of their own."""
    model = tiny_roberta().train()
    patch_linear(model, sketch="exact", bits=4, skip_padding=True,
                 track_variance="attention.self.key|intermediate.dense")
    patch_activations(model, preset="lean")
    return model


def test_tracked_layers_beside_a_shared_code_on_a_padded_batch():
    """intermediate.dense, tracked, codes the real rows of its input itself; key, tracked too,
    shares query's sketch, the filed code of every row. Each gives the weight gradient of the
    real rows it decodes."""
    from sketchprop.quantize import QuantSpec, dequantize

    model = tracked_lean_model()
    inputs = batch()
    rows = inputs["attention_mask"].reshape(-1).nonzero().squeeze(1)
    seen = {}
    for part in ("attention.self.key", "intermediate.dense"):
        def hook(module, args, out, part=part):
            out.register_hook(lambda dy: seen[part].append(dy))
            seen[part] = [code_of(args[0]), saved(out, 1)]
        model.roberta.encoder.layer[0].get_submodule(part).register_forward_hook(hook)
    g = grads(model, inputs)
    key_code, key_payload, key_dy = seen["attention.self.key"]
    assert key_payload is key_code.payload  # every row, from the file
    _, payload, dense_dy = seen["intermediate.dense"]
    x = dequantize(payload, QuantSpec(4, 64, len(rows), 32, torch.float32))  # real rows only
    for part, x_rows, dy in (("attention.self.key", key_code.decode()[rows], key_dy),
                             ("intermediate.dense", x, dense_dy)):
        expected = dy.reshape(-1, dy.shape[-1])[rows].T @ x_rows
        assert torch.allclose(g[f"roberta.encoder.layer.0.{part}.weight"], expected,
                              rtol=1e-5, atol=1e-6)
    assert len(collect(model)) == 4


@pytest.mark.parametrize("reentrant", [False, True])
def test_tracked_lean_layers_under_checkpointing_on_a_padded_batch(reentrant):
    """The first pass of non-reentrant checkpointing finds the filed payloads gone: each layer
    must save the rows the recomputation saves (else torch raises)."""
    model = tracked_lean_model()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    exact = grads(tiny_roberta().train(), batch())
    got = grads(model, batch())
    assert relative_error(got, exact, exact) < 0.5
    records = collect(model)
    assert len(records) == 4
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))


def test_the_file_keeps_no_code_alive_under_checkpointing():
    """Checkpointing's first pass drops what the LayerNorms in the checkpointed layers save, while
    their outputs stay alive as the next layer's checkpointed input; the file, holding payloads
    weakly, keeps none of their codes either. Only the embeddings' LayerNorm, outside the
    checkpointed layers, keeps its code (saved by its own backward)."""
    from sketchprop import codes

    model = lean_model()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    before = {id(t) for t in codes._filed.keys()}  # other tests' tensors not yet collected
    loss = model(**full_batch()).loss
    new = [entry for t, entry in codes._filed.items() if id(t) not in before]
    assert len(new) >= 2  # the layers' outputs are alive, and their entries with them
    assert sum(ref() is not None for _, ref, _ in new) <= 1
    loss.backward()


@pytest.mark.parametrize("padded", [False, True])
def test_a_shared_code_gives_the_linear_weight_gradient_of_its_decoded_rows(padded):
    """dW of a layer reading a filed code is dY^T (decoded code), over the real rows only when
    padding rows are skipped."""
    model = lean_model()
    inputs = batch() if padded else full_batch()
    layer = model.roberta.encoder.layer[0].intermediate.dense
    got = {}
    # (a full backward hook would give the layer a new input tensor, which has no code filed)
    layer.register_forward_hook(lambda m, a, o: got.update(code=code_of(a[0]), hook=o.register_hook(
        lambda dy: got.update(dy=dy))))
    grads_ = grads(model, inputs)
    dy2 = got["dy"].reshape(-1, got["dy"].shape[-1])
    x = got["code"].decode()
    rows = inputs["attention_mask"].reshape(-1).nonzero().squeeze(1)
    expected = dy2[rows].T @ x[rows]
    assert torch.allclose(grads_["roberta.encoder.layer.0.intermediate.dense.weight"], expected,
                          rtol=1e-5, atol=1e-6)


def saved_bytes(model, inputs, preset: str, exclude=None) -> int:
    """Bytes one training step of ``model`` (4-bit linear layers, ``preset``) saves for backward."""
    from sketchprop.measure import SavedTensorMeter

    patch_linear(model.train(), sketch="exact", bits=4, exclude=exclude)
    patch_activations(model, preset=preset)
    with SavedTensorMeter(model) as meter:
        loss = model(**inputs).loss
    loss.backward()
    return meter.bytes


def test_lean_saves_fewer_bytes_than_compact_and_no_float_layernorm_output():
    compact, lean = (saved_bytes(tiny_roberta(), full_batch(), p) for p in ("compact", "lean"))
    # compact keeps 5 float32 LayerNorm outputs (4 x 16 x 32); lean keeps their 4-bit codes
    assert compact - lean >= 5 * 64 * 32 * 4 - 5 * 64 * 32


@pytest.mark.parametrize("sketch, rho", [("exact", 1.0), ("blocksrht", 0.5)])
def test_lean_gradient_is_close_to_exact_and_averages_towards_it(sketch, rho):
    """Every parameter's gradient, relative to exact: one draw is noisy, and the mean of 16 draws
    is about four times closer (the code's noise averages out; the second-order bias is far
    below it). With a sketch, the linear layers keep their sketched rows' own codes beside the
    shared ones, and the sketch's noise averages out as well."""
    inputs = full_batch()
    plain = tiny_roberta().train()
    exact = grads(plain, inputs)
    model = lean_model(sketch=sketch, rho=rho)

    def rel(g):
        return math.sqrt(sum(((g[n] - exact[n]) ** 2).sum() for n in exact)
                         / sum((exact[n] ** 2).sum() for n in exact))

    draws = [grads(model, inputs) for _ in range(16)]
    mean = {n: torch.stack([d[n] for d in draws]).mean(0) for n in exact}
    one = sum(rel(d) for d in draws) / len(draws)
    assert rel(mean) < one / 2.5, (rel(mean), one)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("reentrant", [False, True])
def test_lean_under_checkpointing_runs_and_stays_close(reentrant, padded):
    """Padded: the linear layers skip the padding rows and the first pass, which keeps no saved
    tensor, finds no filed payload: it must save what the recomputation saves."""
    model = lean_model()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    inputs = batch() if padded else full_batch()
    exact = grads(tiny_roberta().train(), inputs)
    got = grads(model, inputs)
    assert got.keys() == exact.keys()
    assert relative_error(got, exact, exact) < 0.5


# Patching.


def test_lean_patches_and_unpatches_to_the_same_model():
    model = tiny_roberta().train()
    plain = tiny_roberta().train()
    keys = model.state_dict().keys()
    names = patch_activations(model, preset="lean")
    assert all(isinstance(model.get_submodule(n), CodedLayerNorm) for n in names
               if n.endswith("LayerNorm"))
    assert model.state_dict().keys() == keys
    model(**batch()).loss.backward()
    unpatch_activations(model)
    assert all(type(m) is nn.LayerNorm for n, m in model.named_modules() if n.endswith("LayerNorm"))
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch()).logits, plain(**batch()).logits)
    from sketchprop.activations import attention

    assert not attention._inputs()


def test_the_preset_has_the_floor_and_a_4_bit_gelu_code():
    """``preset="lean"`` alone: the structural parts, the 4-bit code of GELU's derivative and the
    floor at 4 bits (the measured choice); ``floor_bits=None`` leaves the floor off, and the
    benchmark tables' lean (``LEAN_PARTS``) is the structural parts with the 2-bit GELU code."""
    from sketchprop.activations import CompactGELU, Floor
    from sketchprop.bench.common import LEAN_PARTS

    def parts(**kwargs):
        model = tiny_roberta().train()
        patch_activations(model, **kwargs)
        floors = [h.__self__ for h in model._forward_pre_hooks.values()
                  if isinstance(getattr(h, "__self__", None), Floor)]
        return {m.bits for m in model.modules() if isinstance(m, CompactGELU)}, \
            [f.bits for f in floors]

    assert parts(preset="lean") == ({4}, [4])
    assert parts(preset="lean", floor_bits=None) == ({4}, [])
    assert parts(**LEAN_PARTS) == ({2}, [])
    assert parts(preset="compact") == ({2}, [])


def test_explicit_parts_override_the_preset_and_bad_values_change_nothing():
    model = tiny_roberta().train()
    names = patch_activations(model, preset="lean", layernorm="output")
    assert not any(isinstance(m, CodedLayerNorm) for m in model.modules())
    assert any(isinstance(model.get_submodule(n), OutputLayerNorm) for n in names)
    model = tiny_roberta()
    for kwargs, match in (({"preset": "leaner"}, "unknown preset 'leaner'"),
                          ({"preset": "lean", "code_bits": 3},
                           r"code_bits must be one of \[8, 4, 2\], got 3"),
                          ({"layernorm": "code"}, "unknown layernorm")):
        with pytest.raises(ValueError, match=match):
            patch_activations(model, **kwargs)
        assert all(type(m) is nn.LayerNorm for n, m in model.named_modules()
                   if n.endswith("LayerNorm"))


def test_lean_model_pickles_and_trains_after_loading(tmp_path):
    model = lean_model()
    model(**batch()).loss.backward()
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.isfinite(grads(loaded, batch())["roberta.embeddings.LayerNorm.weight"]).all()


# Hydra and identity.


def test_hydra_lean_composes_and_carries_its_preset_in_the_identity():
    conf = validate(compose(["activations=lean", "method=exact", "method.bits=4"]))
    a = conf.activations
    assert (a.preset.value, a.layernorm.value, a.attention.value, a.code_bits) == (
        "lean", "coded", "coded", 4)
    assert not a.stored
    from omegaconf import OmegaConf

    cfg = compose(["activations=lean", "method=exact", "method.bits=4"])
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    ident = identity(config, {"source": "tsv", "sha256": "x"})
    assert ident["activations"]["preset"] == "lean" and ident["activations"]["code_bits"] == 4
    cfg = compose(["activations=compact", "method=exact", "method.bits=4"])
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    ident = identity(config, {"source": "tsv", "sha256": "x"})
    assert "preset" not in ident["activations"] and "code_bits" not in ident["activations"]


@pytest.mark.parametrize("override, key", [("activations.code_bits=3", "activations.code_bits"),
                                           ("activations.preset=leaner", "preset")])
def test_hydra_bad_lean_values_name_the_key(override, key):
    with pytest.raises((ConfigError, Exception), match=key):
        validate(compose(["activations=lean", override]))
