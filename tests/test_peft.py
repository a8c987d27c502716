"""patch_linear on a peft LoRA model: the adapters' down-projections (``lora_A``) are the layers
that still keep their input, and ``targets=r"lora_A"`` sketches just them."""

import copy
import math
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from scipy import stats
from test_decoder import MODELS
from test_decoder import batch as lm_batch
from test_layers import FALSE_ALARM, MIN_POWER, SCALE_ERROR, Scaled, hotelling
from test_patching import _labelled_records, _layer_records, batch, tiny_roberta
from torch import nn

from sketchprop import SKETCHES, RandomizedLinear, find_linear, patch_linear, unpatch_linear

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = "base_model.model.roberta.encoder.layer"
ADAPTED = [f"{PREFIX}.{i}.attention.self.{s}" for i in range(2) for s in ("query", "value")]
LORA_A = [f"{name}.lora_A.default" for name in ADAPTED]


def lora_roberta(dropout=0.0, r=2):
    """Tiny RoBERTa with LoRA on Q and V. Both LoRA matrices start random (peft starts B at zero,
    which would make A's gradient zero at the first step)."""
    config = LoraConfig(task_type="SEQ_CLS", r=r, lora_alpha=2 * r, lora_dropout=dropout,
                        target_modules=["query", "value"], init_lora_weights=False)
    return get_peft_model(tiny_roberta(), config)


def logits_and_grads(model, data):
    """Logits and the gradients of the trained parameters (the adapters and the head)."""
    model.zero_grad(set_to_none=True)
    out = model(**data)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.requires_grad}


@pytest.mark.stack("peft-lora", "sketch")
def test_adapters_store_one_shared_sketch_base_layers_nothing():
    model = lora_roberta()
    assert patch_linear(model, "blocksrht", 0.5, targets=r"lora_A") == LORA_A
    data = batch()
    labels = {}
    for name, module in model.named_modules():  # label what each module saves
        if name.endswith(("base_layer", "lora_A.default", "lora_B.default")):
            labels[name] = module
    records = _records_by_module(model, data, labels)
    real = int(data["attention_mask"].sum())
    for name in ADAPTED:
        assert records[f"{name}.base_layer"] == []  # frozen: keeps nothing, dX needs only W
        # lora_B keeps its r-wide input, all rows (not patched: r floats a row)
        assert records[f"{name}.lora_B.default"] == [data["input_ids"].numel() * 2 * 4]
    for i in range(2):  # Q and V read one tensor (no LoRA dropout): one sketch, its seed, the rows
        q, v = (f"{PREFIX}.{i}.attention.self.{s}.lora_A.default" for s in ("query", "value"))
        assert records[q] == records[v] == sorted([math.ceil(0.5 * real) * 32 * 4, 8, real * 8])
        shared = {frozenset(names) for _, names in _layer_records(model, data) if len(names) > 1}
        assert frozenset({q, v}) in shared


def test_lora_dropout_gives_each_adapter_its_own_sketch():
    model = lora_roberta(dropout=0.1)
    patch_linear(model, "blocksrht", 0.5, targets=r"lora_A")
    shared = [names for _, names in _layer_records(model, batch()) if len(names) > 1]
    assert shared and all(names == set(LORA_A) for names in shared)  # only the rows' indices


def _records_by_module(model, data, modules):
    """Sorted sizes of the storages saved while each of ``modules`` (name: module) runs."""
    records = _labelled_records(model, data, modules)
    return {n: sorted(nbytes for nbytes, labels in records if n in labels) for n in modules}


def test_exact_sketch_on_the_adapters_gives_the_lora_gradients():
    """Row selection (padding skipped) and the shared Q/V sketch leave the gradient exact when the
    sketch is the identity."""
    data = batch()
    ref = lora_roberta()
    _, expected = logits_and_grads(ref, data)
    model = lora_roberta()
    patch_linear(model, "exact", 1.0, targets=r"lora_A")
    _, grads = logits_and_grads(model, data)
    assert set(grads) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


# Unbiasedness through the whole model, by Hotelling's T^2 as in test_layers.py. Each adapter's
# draw is projected on its exact gradient g (p = 4 values, <dW, g> / |g|^2, expected 1): the
# direction a scale error moves. Under the model's row structure (the last layer's gradient sits
# on the [CLS] rows) the full 4 x 64 entries have a near-singular covariance; these four do not.
# At rho 0.9 (31 of 34 real rows) the per-draw signal-to-noise is about 195 (21 at rho 0.75, 9
# at 0.5): power about 1 at n = 400, in a few seconds; the layer tests cover low rates.
N_DRAWS = 400


def adapter_draws(sketch, data, exact, n):
    model = lora_roberta()
    patch_linear(model, sketch, 0.9, targets=r"lora_A", min_rows=1, seed=3)
    params = [model.get_parameter(f"{name}.weight") for name in LORA_A]
    out = torch.empty(n, len(params), dtype=torch.float64)
    for i in range(n):
        model.zero_grad(set_to_none=True)
        model(**data).loss.backward()
        out[i] = torch.stack([(p.grad.double() * g).sum() / (g * g).sum()
                              for p, g in zip(params, exact, strict=True)])
    return out


@pytest.mark.stack("peft-lora", "sketch")
def test_adapter_gradients_unbiased():
    data = batch()
    ref = lora_roberta()
    ref(**data).loss.backward()
    exact = [ref.get_parameter(f"{name}.weight").grad.double() for name in LORA_A]
    assert all(g.abs().sum() > 0 for g in exact)
    n, p = N_DRAWS, len(exact)
    target = torch.ones(p, dtype=torch.float64)
    f_bound = stats.f.isf(FALSE_ALARM, p, n - p)
    bound = f_bound * p * (n - 1) / (n - p)
    t2, cov = hotelling(adapter_draws(SKETCHES["blocksrht"], data, exact, n), target)
    assert t2 < bound, f"T^2 = {t2:.1f}, bound {bound:.1f}"

    snr = (target @ torch.linalg.solve(cov, target)).item() * (n - p - 2) / (n - 1)
    lam = n * ((SCALE_ERROR - 1) / SCALE_ERROR) ** 2 * snr
    power = stats.ncf.sf(f_bound, p, n - p, lam)
    assert power >= MIN_POWER, f"power {power:.4f} against a 5% scale error"

    biased = Scaled(base=SKETCHES["blocksrht"], factor=math.sqrt(SCALE_ERROR))
    t2_biased, _ = hotelling(adapter_draws(biased, data, exact, n), target)
    assert t2_biased > bound, f"the 5% control passes, T^2 = {t2_biased:.1f}"


def test_unpatch_round_trip():
    model = lora_roberta()
    data = batch()
    before, grads_before = logits_and_grads(model, data)
    keys = list(model.state_dict())
    assert patch_linear(model, "blocksrht", 0.1, targets=r"lora_A") == LORA_A
    assert list(model.state_dict()) == keys
    patched, _ = logits_and_grads(model, data)
    torch.testing.assert_close(patched, before, rtol=0, atol=0)
    assert unpatch_linear(model) == LORA_A
    assert not any(isinstance(m, RandomizedLinear) for m in model.modules())
    assert all(type(model.get_submodule(name)) is nn.Linear for name in LORA_A)
    after, grads_after = logits_and_grads(model, data)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    for name, grad in grads_before.items():
        torch.testing.assert_close(grads_after[name], grad, rtol=0, atol=0, msg=name)
    assert list(model.state_dict()) == keys
    merged = model.merge_and_unload()  # peft's own surgery still works on the unpatched model
    assert not any("lora" in name for name, _ in merged.named_modules())


@pytest.mark.stack("peft-lora", "compact")
def test_compact_activations_on_a_lora_model_are_exact_and_reversible():
    """patch_activations on a peft model switches the attention function of the model it wraps;
    with gelu_bits=None (and dropout 0, so both models use the same masks) the adapters' and the
    head's gradients equal those of the unpatched LoRA model, also with the adapters sketched."""
    import copy

    from sketchprop import activations as act
    from sketchprop import patch_activations, unpatch_activations

    model = lora_roberta()
    ref = copy.deepcopy(model)
    data = batch()
    assert patch_activations(model, gelu_bits=None)
    assert model.get_base_model().config._attn_implementation == act.ATTENTION_NAME
    logits, grads = logits_and_grads(model, data)
    ref_logits, ref_grads = logits_and_grads(ref, data)
    torch.testing.assert_close(logits, ref_logits)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    patch_linear(model, "exact", 1.0, targets=r"lora_A")  # the sketch's reference path composes
    _, grads = logits_and_grads(model, data)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    unpatch_linear(model)
    unpatch_activations(model)
    assert model.get_base_model().config._attn_implementation == \
        ref.get_base_model().config._attn_implementation


# ---------------------------------------------------------------------------------------------
# merge_and_unload, in either order, on Conv1D (GPT-2) and nn.Linear (Llama)

# Square and non-square layers in each: GPT-2's c_attn 32 -> 96, attn.c_proj 32 -> 32, mlp.c_proj
# 128 -> 32; Llama's q_proj 32 -> 32, k_proj 32 -> 16, down_proj 48 -> 32.
LORA_TARGETS = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "k_proj", "down_proj"]}
ORDERS = {
    "patch, peft": (lambda m: patch_linear(m, "gaussian", 0.5, min_rows=1), None),
    "peft, patch lora_A": (None, lambda m: patch_linear(m, "gaussian", 0.5, targets=r"lora_A",
                                                        min_rows=1)),
    "peft, patch all": (None, lambda m: patch_linear(m, "gaussian", 0.5, min_rows=1)),
}


def train_lora(arch, order, fan_in_fan_out, dora, steps=3):
    """A tiny causal LM, patched and given LoRA (or DoRA) in ``order``, after a few Adam steps (so
    that B, zero at the start, is not)."""
    before, after = ORDERS[order]
    model = MODELS[arch]()
    if before:
        before(model)
    config = LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, use_dora=dora,
                        fan_in_fan_out=fan_in_fan_out, target_modules=LORA_TARGETS[arch])
    with warnings.catch_warnings():  # peft corrects fan_in_fan_out to the layer's kind, and says so
        warnings.simplefilter("ignore")
        model = get_peft_model(model, config)
    if after:
        after(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(**lm_batch()).loss.backward()
        optimizer.step()
    assert all(m.weight.abs().sum() > 0 for n, m in model.named_modules()
               if n.endswith("lora_B.default"))
    return model.eval()


@pytest.mark.stack("peft-lora", "sketch")
@pytest.mark.stack("peft-dora", "sketch")
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("fan_in_fan_out", [False, True], ids=["fifo=False", "fifo=True"])
@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_merge_and_unload_gives_the_adapted_outputs(arch, order, fan_in_fan_out, dora):
    """The merged model computes what the trained adapters did, and keeps the patched layers
    patched (those of the base model: peft's own layers go with the merge); they unpatch to the
    model's own layer types."""
    model = train_lora(arch, order, fan_in_fan_out, dora)
    data = lm_batch()
    with torch.no_grad():
        adapted = model(**data).logits
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(**data).logits, adapted, rtol=1e-4, atol=1e-5)
    plain = MODELS[arch]()
    patched = [n for n, m in merged.named_modules() if isinstance(m, RandomizedLinear)]
    expected = [] if order == "peft, patch lora_A" else find_linear(plain)
    assert patched == expected
    unpatch_linear(merged)
    assert [type(m) for m in merged.modules()] == [type(m) for m in plain.modules()]


def test_a_model_merged_after_patching_reads_its_own_padding():
    """Patched under peft, merged: the patched layers, now the merged model's, take each call's
    padding rows from that call, not from the last call of the peft model (a stale mask would drop
    real rows from the weight gradient)."""
    model = get_peft_model(MODELS["llama"](), LoraConfig(task_type="CAUSAL_LM", r=2,
                                                         target_modules=["q_proj"]))
    patch_linear(model, "exact", 1.0)
    model(**lm_batch()).loss.backward()  # padded
    merged = model.merge_and_unload().requires_grad_(True)
    ref = copy.deepcopy(merged)
    unpatch_linear(ref)
    ids = lm_batch()["input_ids"]
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    for m in (merged, ref):
        m.zero_grad()
        m(**full).loss.backward()
    for (name, p), q in zip(merged.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_a_square_conv1d_merges_the_right_way_round(fan_in_fan_out):
    """GPT-2's attention output projection is square: merged with its weight read as (out, in), it
    would compute wrong numbers without an error. peft sees the patched layer as the Conv1D it
    replaced and merges it as one."""
    model = MODELS["gpt2"]()
    patch_linear(model, "gaussian", 0.5, min_rows=1)
    config = LoraConfig(r=2, target_modules=r".*attn\.c_proj", fan_in_fan_out=fan_in_fan_out,
                        init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(model, config).eval()
    assert all(m.fan_in_fan_out for n, m in model.named_modules() if n.endswith("attn.c_proj"))
    data = lm_batch()
    with torch.no_grad():
        adapted = model(**data).logits
        torch.testing.assert_close(model.merge_and_unload()(**data).logits, adapted)


def test_unpatch_a_model_patched_before_peft():
    """unpatch_linear of the peft model puts the Conv1D layers back under the adapters, removes
    the hooks from the base model that holds them, and leaves the adapted outputs as they were."""
    from transformers.pytorch_utils import Conv1D

    base = MODELS["gpt2"]()
    names = patch_linear(base, "gaussian", 0.5)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["c_attn"],
                                            init_lora_weights=False)).eval()
    data = lm_batch()
    with torch.no_grad():
        adapted = model(**data).logits
    assert len(unpatch_linear(model)) == len(names)
    assert all(type(m) is Conv1D for n, m in model.named_modules() if n.endswith(".c_attn.base_layer"))
    assert not any(vars(m).keys() & {"_sketchprop_hooks", "_sketchprop_context",
                                     "resize_token_embeddings"} for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(**data).logits, adapted, rtol=0, atol=0)
        torch.testing.assert_close(model.merge_and_unload()(**data).logits, adapted)
