"""Patching level: patch_linear / unpatch_linear on a tiny RoBERTa built from a config."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import RobertaConfig, RobertaForSequenceClassification

from sketchprop import RandomizedLinear, patch_activations, patch_linear, unpatch_linear
from sketchprop.layers import CONTEXT_ATTRIBUTE, SketchContext
from sketchprop.measure import SavedTensorMeter

PER_LAYER = [
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
]
HEAD = ["classifier.dense", "classifier.out_proj"]


def tiny_roberta(layers=2, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    cfg = RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, num_labels=2, pad_token_id=1,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return RobertaForSequenceClassification(cfg)


def batch(b=4, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.long)
    for i in range(b):  # padded as real batches are: the longest row has no padding
        n = length - 5 * i
        mask[i, n:] = 0
        ids[i, n:] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(b) % 2}


def layer_names(layers=2):
    return [f"roberta.encoder.layer.{i}.{s}" for i in range(layers) for s in PER_LAYER]


def test_patches_every_linear_with_head_unless_excluded():
    model = tiny_roberta()
    assert patch_linear(model, "gaussian", 0.5) == layer_names() + HEAD
    assert all(isinstance(model.get_submodule(n), RandomizedLinear) for n in layer_names() + HEAD)

    model = tiny_roberta()
    assert patch_linear(model, "gaussian", 0.5, exclude=r"classifier") == layer_names()
    assert type(model.classifier.dense) is nn.Linear


def test_targets_regex():
    model = tiny_roberta()
    names = patch_linear(model, "dct", 0.2, targets=r"attention\.self\.(query|key|value)$")
    assert names == [n for n in layer_names() if n.split(".")[-1] in ("query", "key", "value")]


def test_exclude_regex_is_searched_anywhere_in_the_name():
    model = tiny_roberta()
    names = patch_linear(model, "gaussian", 0.5, exclude=r"attention")
    assert names == [n for n in layer_names() + HEAD if "attention" not in n]
    assert type(model.roberta.encoder.layer[0].attention.self.query) is nn.Linear


def test_state_dict_and_parameters_unchanged():
    model = tiny_roberta()
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    patch_linear(model, "gaussian", 0.1)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())


def logits_and_grads(model, data):
    """Logits and parameter gradients of one training step (grad enabled: the sketched path)."""
    model.zero_grad(set_to_none=True)
    out = model(**data)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_unpatch_round_trip():
    model = tiny_roberta()
    data = batch()
    before, grads_before = logits_and_grads(model, data)
    keys = list(model.state_dict())
    hooks = dict(model._forward_pre_hooks)
    patch_linear(model, "blocksrht", 0.1)
    assert len(model._forward_pre_hooks) == len(hooks) + 1  # the attention-mask hook
    patched, grads_patched = logits_and_grads(model, data)
    assert unpatch_linear(model) == layer_names() + HEAD
    assert not any(isinstance(m, RandomizedLinear) for m in model.modules())
    after, grads_after = logits_and_grads(model, data)
    torch.testing.assert_close(patched, before, rtol=0, atol=0)  # the forward stays exact
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    sketched = "roberta.encoder.layer.0.intermediate.dense.weight"  # 16 of 34 real rows
    assert not torch.allclose(grads_patched[sketched], grads_before[sketched], rtol=0.01)
    for name, grad in grads_before.items():  # exact gradients again once unpatched
        torch.testing.assert_close(grads_after[name], grad, msg=name)
    assert list(model.state_dict()) == keys
    assert dict(model._forward_pre_hooks) == hooks
    patch_linear(model, "dct", 0.2)  # can be patched again after unpatching


def test_training_forward_and_dropout_stream_unchanged():
    """Sketch seeds never come from the global RNG, so dropout masks match the exact model."""
    model = tiny_roberta(dropout=0.1)
    model.train()
    data = batch()
    torch.manual_seed(3)
    ref = model(**data).logits
    patch_linear(model, "gaussian", 0.2)
    torch.manual_seed(3)
    out = model(**data).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rho": 0.0}, "rho"),
        ({"rho": 1.01}, "rho"),
        ({"sketch": "gausian"}, "gausian"),
        ({"targets": r"nothing_here"}, "match no nn.Linear"),
        ({"exclude": r"."}, "match no nn.Linear"),
        ({"targets": r"("}, "not a valid regex"),
        ({"rho": {r"query": 0.1}}, "rho mapping"),
        ({"rho": {r"query": 0.1, r".": 2.0}}, "rho"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(kwargs, match):
    model = tiny_roberta()
    args = {"sketch": "gaussian", "rho": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        patch_linear(model, **args)
    assert not any(isinstance(m, RandomizedLinear) for m in model.modules())
    assert not hasattr(model, "_sketchprop_hooks")


def test_patching_twice_raises():
    model = tiny_roberta()
    patch_linear(model, "gaussian", 0.1)
    with pytest.raises(ValueError, match="already patched"):
        patch_linear(model, "gaussian", 0.1)


def test_rho_per_layer_mapping():
    model = tiny_roberta()
    patch_linear(model, "gaussian", {r"intermediate": 0.5, r".": 0.1})
    assert model.roberta.encoder.layer[0].intermediate.dense.rho == 0.5
    assert model.roberta.encoder.layer[0].output.dense.rho == 0.1


def _saved_bytes(model, data):
    with SavedTensorMeter(model) as meter:
        loss = model(**data).loss
    loss.backward()
    return meter.bytes


def test_share_inputs_stores_one_sketch_for_qkv():
    data = batch(length=32)
    sizes = {}
    for share in (False, True):
        model = tiny_roberta()
        patch_linear(model, "gaussian", 0.5, targets=r"self\.(query|key|value)",
                     share_inputs=share, skip_padding=False)
        sizes[share] = _saved_bytes(model, data)
    exact = _saved_bytes(tiny_roberta(), data)
    # Per layer, Q/K/V store 3 * 0.5 of their input unshared (more than the one exact copy, which
    # other ops in the exact model save too) and 0.5 of it shared; likewise 3 seeds against 1.
    rows = data["input_ids"].numel()
    per_copy = 2 * (rows // 2) * 32 * 4  # two layers, 0.5 * rows, hidden 32, float32
    seeds = 2 * 2 * 8  # two layers, two more 8-byte seeds each
    assert sizes[False] - sizes[True] == 2 * per_copy + seeds
    assert sizes[True] < sizes[False] and exact > 0


def test_padding_rows_get_zero_output_gradient():
    """The premise of skip_padding: in encoder classification, padding rows carry no gradient."""
    model = tiny_roberta()
    data = batch()
    outs = []

    def keep(module, args, out):
        out.retain_grad()
        outs.append(out)

    for layer in model.roberta.encoder.layer:
        for mod in (layer.attention.self.query, layer.intermediate.dense, layer.output.dense):
            mod.register_forward_hook(keep)
    model(**data).loss.backward()
    pad = data["attention_mask"] == 0
    assert pad.any()
    for out in outs:
        assert torch.all(out.grad[pad] == 0)
        assert out.grad[~pad].abs().sum() > 0


def test_skip_padding_exact_sketch_gives_exact_gradient_and_fewer_rows():
    data = batch()
    ref = tiny_roberta()
    ref(**data).loss.backward()
    model = tiny_roberta()
    patch_linear(model, "exact", 1.0, exclude="classifier", skip_padding=True)
    model(**data).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n, rtol=1e-5, atol=1e-6)
    plain = tiny_roberta()
    patch_linear(plain, "exact", 1.0, exclude="classifier", skip_padding=False)
    assert _saved_bytes(model, data) < _saved_bytes(plain, data)


@pytest.mark.parametrize("sketch", ["exact", "blocksrht"])
def test_skip_padding_on_full_rows_takes_the_path_without_it(sketch):
    """A batch with no padding row: skip_padding gathers nothing (no copy of X kept, none of dY
    made), so bytes and gradients are those of skip_padding=False, bit for bit."""
    data = batch()
    data["attention_mask"] = torch.ones_like(data["attention_mask"])
    data["input_ids"] = torch.randint(3, 64, data["input_ids"].shape,
                                      generator=torch.Generator().manual_seed(1))
    grads, nbytes = [], []
    for skip in (True, False):
        model = tiny_roberta()
        patch_linear(model, sketch, 0.5, exclude="classifier", skip_padding=skip, min_rows=1)
        nbytes.append(_saved_bytes(model, data))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert nbytes[0] == nbytes[1]
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_skip_padding_sketch_covers_only_real_rows():
    model = tiny_roberta()
    data = batch()
    patch_linear(model, "gaussian", 0.5, exclude="classifier", skip_padding=True, min_rows=1)
    layer = model.roberta.encoder.layer[0].intermediate.dense
    with SavedTensorMeter(model) as meter:
        hooks = [layer.register_forward_pre_hook(lambda *a: setattr(meter, "label", "layer")),
                 layer.register_forward_hook(lambda *a: setattr(meter, "label", None))]
        loss = model(**data).loss
    for h in hooks:
        h.remove()
    loss.backward()
    real = int(data["attention_mask"].sum())  # 34 of 64 rows
    own = [nbytes for nbytes, labels in meter.records if labels == {"layer"}]
    assert max(own) == math.ceil(0.5 * real) * 32 * 4  # S^T X: half the real rows, not of all 64


def test_deepcopy_of_a_patched_model_skips_its_own_padding():
    """A deep copy (an EMA model, a copy to compare against) keeps skipping padding: its hook
    hands the mask to the copy's context, so the copy's sketches and gradients are the
    original's, not those of every row."""
    model = tiny_roberta()
    patch_linear(model, "blocksrht", 0.5, skip_padding=True, min_rows=1)
    copy_ = copy.deepcopy(model)
    data = batch()
    grads = []
    for m in (model, copy_):
        m(**data).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name
    assert unpatch_linear(copy_) and not hasattr(copy_, "_sketchprop_context")


@pytest.mark.parametrize("sketch", ["gaussian", "dct", "blocksrht"])
def test_skip_padding_ignores_what_padding_rows_hold(sketch):
    """The weight gradient does not depend on the input at padding rows (whose output gradient is
    zero); without skip_padding the sketch mixes them in."""
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask.view(-1)[torch.tensor([2, 9, 13, 20])] = False
    context = SketchContext()
    context.set_mask(mask)
    g = torch.Generator().manual_seed(0)
    x, junk = torch.randn(3, 7, 8, generator=g), 100 * torch.randn(3, 7, 8, generator=g)
    dy = torch.randn(3, 7, 6, generator=g) * mask[..., None]
    grads = {}
    for skip in (True, False):
        for fill in ("zero", "junk"):
            torch.manual_seed(0)
            layer = RandomizedLinear(8, 6, sketch=sketch, rho=0.5, min_rows=1, seed=1,
                                     skip_padding=skip, context=context)
            xf = torch.where(mask[..., None], x, junk if fill == "junk" else torch.zeros_like(x))
            (layer(xf) * dy).sum().backward()
            grads[skip, fill] = layer.weight.grad
    torch.testing.assert_close(grads[True, "junk"], grads[True, "zero"])
    assert not torch.allclose(grads[False, "junk"], grads[False, "zero"], rtol=0.01)


def _discarded_bytes(model, data):
    """Forward-only count that drops what is saved, keeping what the randomized layers save."""
    with SavedTensorMeter(model, discard=True, keep_labels={"rl"}) as meter:
        hooks = [h for m in model.modules() if isinstance(m, RandomizedLinear) for h in (
            m.register_forward_pre_hook(lambda *a: setattr(meter, "label", "rl")),
            m.register_forward_hook(lambda *a: setattr(meter, "label", None)))]
        loss = model(**data).loss
    for h in hooks:
        h.remove()
    with pytest.raises(RuntimeError, match="discard=True"):
        loss.backward()
    return meter.bytes


@pytest.mark.parametrize("kwargs", [None, dict(share_inputs=True, skip_padding=True),
                                    dict(share_inputs=False, skip_padding=False), "lean"])
def test_meter_discard_counts_what_keeping_counts(kwargs):
    """Dropping what is saved counts what keeping it counts; with lean, whose norms and attention
    inputs share one code found again by weak reference (it counted each code twice: once where
    it was made and once where the next layers, finding it gone, made their own)."""
    data = batch(length=32)
    model = tiny_roberta()
    if kwargs == "lean":
        patch_linear(model, "exact", bits=4, group=16)
        patch_activations(model, preset="lean", code_group=16)
    elif kwargs:
        patch_linear(model, "blocksrht", 0.25, min_rows=1, **kwargs)
    assert _discarded_bytes(model, data) == _saved_bytes(model, data)


def test_meter_counts_a_freed_storage_whose_address_is_reused():
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorMeter(discard=True) as meter:
        for _ in range(3):  # each result is freed before the next one (likely) takes its address
            x.exp().sum()
    with SavedTensorMeter() as kept:
        ys = [x.exp() for _ in range(3)]
    assert meter.count == kept.count == 3 and meter.bytes == kept.bytes == 3 * 4000
    assert len(ys) == 3


def test_meter_lets_a_graph_never_backpropagated_go():
    """Dropping the loss of a metered forward frees what it saved, backward or not (the meter
    must not hold a saved output by its own grad_fn)."""
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = x.exp()  # exp saves its output
    kept = StorageWeakRef(y.untyped_storage())
    del y
    assert meter.bytes == 4000 and kept.expired()


def test_meter_keeps_gradients_and_double_backward():
    x = torch.randn(50, dtype=torch.double, requires_grad=True)
    with SavedTensorMeter():
        y = (x.exp() * x.sin()).sum()
    g, = torch.autograd.grad(y, x, create_graph=True)
    gg, = torch.autograd.grad(g.sum(), x)
    e = x.detach().exp()
    torch.testing.assert_close(g.detach(), e * (x.detach().sin() + x.detach().cos()))
    torch.testing.assert_close(gg, 2 * e * x.detach().cos())


# ---------------------------------------------------------------------------------------------
# GPT-2 (transformers' Conv1D, a causal LM) and T5 (an encoder-decoder)

GPT2_LAYERS = [f"transformer.h.{i}.{s}" for i in range(2)
               for s in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=40, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def lm_batch(b=4, length=16, seed=0):
    """Padded on the right, padding labels -100, as DataCollatorForLanguageModeling makes them."""
    data = batch(b, length, seed)
    data["labels"] = data["input_ids"].masked_fill(data["attention_mask"] == 0, -100)
    return data


def test_gpt2_conv1d_layers_patched_lm_head_left_exact_and_tied():
    from transformers.pytorch_utils import Conv1D

    model = tiny_gpt2()
    keys = list(model.state_dict())
    data = lm_batch()
    before, grads_before = logits_and_grads(model, data)
    assert patch_linear(model, "blocksrht", 0.1) == GPT2_LAYERS
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight
    assert list(model.state_dict()) == keys
    patched, _ = logits_and_grads(model, data)
    torch.testing.assert_close(patched, before, rtol=0, atol=0)
    assert unpatch_linear(model) == GPT2_LAYERS
    assert all(type(model.get_submodule(n)) is Conv1D for n in GPT2_LAYERS)
    after, grads_after = logits_and_grads(model, data)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    for name, grad in grads_before.items():
        torch.testing.assert_close(grads_after[name], grad, rtol=0, atol=0, msg=name)
    assert list(model.state_dict()) == keys


def test_gpt2_padding_rows_get_zero_output_gradient():
    """The premise of skip_padding in a causal LM padded on the right, padding labels -100."""
    model = tiny_gpt2()
    data = lm_batch()
    outs = []

    def keep(module, args, out):
        out.retain_grad()
        outs.append(out)

    for name in GPT2_LAYERS:
        model.get_submodule(name).register_forward_hook(keep)
    model(**data).loss.backward()
    pad = data["attention_mask"] == 0
    assert pad.any() and len(outs) == len(GPT2_LAYERS)
    for out in outs:
        assert torch.all(out.grad[pad] == 0)
        assert out.grad[~pad].abs().sum() > 0


def test_gpt2_skip_padding_exact_sketch_gives_exact_gradient_and_fewer_rows():
    data = lm_batch()
    ref = tiny_gpt2()
    ref(**data).loss.backward()
    model = tiny_gpt2()
    patch_linear(model, "exact", 1.0, skip_padding=True)
    model(**data).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n, rtol=1e-5, atol=1e-6)
    real = int(data["attention_mask"].sum())  # 34 of 64 rows
    for name, stored in _bytes_by_layer(model, data).items():
        # its input's real rows, and their int64 indices (one tensor that every layer saves)
        assert stored == sorted([real * model.get_submodule(name).in_features * 4, real * 8]), name


def _labelled_records(model, data, modules):
    """``(nbytes, labels)`` of each storage saved in one training forward (then run backward),
    labelled with the names of ``modules`` (name: module) that were running when it was saved."""
    with SavedTensorMeter(model) as meter:
        hooks = [h for n, m in modules.items() for h in (
            m.register_forward_pre_hook(lambda *a, n=n: setattr(meter, "label", n)),
            m.register_forward_hook(lambda *a: setattr(meter, "label", None)))]
        loss = model(**data).loss
    for h in hooks:
        h.remove()
    loss.backward()
    return meter.records


def _layer_records(model, data):
    """``(nbytes, names)`` of each storage the RandomizedLinear layers save in one training
    forward, with the names of the layers that save it (several for a shared one)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, RandomizedLinear)}
    return [(nbytes, labels - {None}) for nbytes, labels in _labelled_records(model, data, layers)
            if labels - {None}]


def _bytes_by_layer(model, data):
    """The sizes of the storages each layer saves, seeds (8 bytes) left out, by layer name."""
    records = _layer_records(model, data)
    names = [n for n, m in model.named_modules() if isinstance(m, RandomizedLinear)]
    return {n: sorted(nbytes for nbytes, labels in records if n in labels and nbytes > 8)
            for n in names}


def test_gpt2_share_inputs_has_nothing_to_share():
    """GPT-2's c_attn computes Q, K and V as one layer, and no two of its linear layers read one
    tensor: with share_inputs every layer still stores a sketch of its own."""
    model = tiny_gpt2()
    patch_linear(model, "blocksrht", 0.5, share_inputs=True)
    data = lm_batch(length=32)
    real = int(data["attention_mask"].sum())
    shared = [(nbytes, labels) for nbytes, labels in _layer_records(model, data)
              if len(labels) > 1]
    assert shared == [(real * 8, set(GPT2_LAYERS))]  # only the real rows' indices
    for name, sizes in _bytes_by_layer(model, data).items():
        sketch = math.ceil(0.5 * real) * model.get_submodule(name).in_features * 4
        assert sizes == sorted([sketch, real * 8]), name


def test_roberta_share_inputs_shares_qkv():
    """The control for the test above: in RoBERTa, Q, K and V share one stored sketch."""
    model = tiny_roberta()
    patch_linear(model, "blocksrht", 0.5, share_inputs=True, skip_padding=False)
    shared = [labels for _, labels in _layer_records(model, batch(length=32)) if len(labels) > 1]
    assert len(shared) == 4  # per encoder layer, the sketch and its seed
    assert {frozenset(labels) for labels in shared} == {
        frozenset(f"roberta.encoder.layer.{i}.attention.self.{s}" for s in ("query", "key", "value"))
        for i in range(2)}


def tiny_t5(seed=0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=1)
    return T5ForConditionalGeneration(cfg)


@pytest.mark.parametrize("decoder_length", [16, 9])
def test_t5_skip_padding_exact_sketch_gives_exact_gradient(decoder_length):
    """The encoder's mask matches rows by shape: a decoder sequence as long as the encoder's must
    not be masked by it (16), one of another length is not (9)."""
    data = batch(length=16)
    data["labels"] = torch.randint(3, 64, (4, decoder_length), generator=torch.Generator()
                                   .manual_seed(1))
    ref = tiny_t5()
    ref(**data).loss.backward()
    model = tiny_t5()
    assert len(patch_linear(model, "exact", 1.0, skip_padding=True)) == 32  # lm_head left exact
    with SavedTensorMeter(model) as meter:
        loss = model(**data).loss
    loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n, rtol=1e-5, atol=1e-6)
    plain = tiny_t5()
    patch_linear(plain, "exact", 1.0, skip_padding=False)
    if decoder_length == 16:
        assert meter.bytes == _saved_bytes(plain, data)
    else:  # the encoder's padding rows are skipped
        assert meter.bytes < _saved_bytes(plain, data)


def test_no_match_names_the_types_it_found():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match=r"match no nn.Linear or Conv1D \(the model has 0\); .*"
                                         r"Conv1d \(1\), Embedding \(1\)"):
        patch_linear(model, "gaussian", 0.1)


@pytest.mark.parametrize("skip_padding", [False, True])
def test_shared_sketches_alone_look_for_no_padding_rows(skip_padding):
    """With share_inputs alone the hook only tells the layers that a call begins: it looks for no
    padding rows (mask.nonzero() would make the CPU wait for a GPU at every call)."""
    model = tiny_roberta().train()
    patch_linear(model, "gaussian", rho=0.5, share_inputs=True, skip_padding=skip_padding)
    data = batch()
    model(**data).loss.backward()
    shape = getattr(model, CONTEXT_ATTRIBUTE).mask_shape
    assert shape == (tuple(data["attention_mask"].shape) if skip_padding else None)
