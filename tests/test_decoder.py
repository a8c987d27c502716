"""patch_activations on decoder language models (GPT-2, Llama with grouped K/V heads): defaults
that fit the model, errors that name the option, the decoder parts (sketchprop.activations) exact
against the unpatched model (checkpointing, autocast, LoRA), unbiased where coded, reversible."""

import contextlib
import copy
import importlib.util
import inspect
import logging
import threading

import pytest
import torch
import transformers as tf
from peft import LoraConfig, get_peft_model
from scipy import stats
from test_activation_settings import in_two_threads
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from sketchprop import activations as act
from sketchprop import chunked_lm_loss, patch_activations, patch_linear, unpatch_activations, unpatch_linear
from sketchprop.measure import SavedTensorMeter

pytestmark = pytest.mark.usefixtures("one_thread")

FALSE_ALARM = 1e-4
VOCAB = 96


def tiny_llama(layers=2, seed=0, kv_heads=2):
    """Llama with grouped-query attention: 4 query heads, ``kv_heads`` key/value heads."""
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def tiny_gpt2(layers=2, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=2, bos_token_id=1,
        eos_token_id=2, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def tiny_bert():
    torch.manual_seed(0)
    return tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, num_labels=2))


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def batch(n=3, length=12):
    """Right-padded token ids, padding labelled -100, as HF's collators make them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length * 2 // 3:] = 0
    mask[2, length // 2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.stack("second-order", "decoders", refused="differentiate twice")
@pytest.mark.parametrize("preset", ["compact", "lean"])
def test_a_second_derivative_of_a_decoder_is_refused_not_wrong(preset):
    """RMSNorm, the gated MLP, the chunked LM loss (compact) and the coded parts (lean) keep no
    graph of what backward reads: a gradient of a gradient raises (tests/test_activations.py says
    why)."""
    model = tiny_llama()
    if preset == "lean":
        patch_linear(model, sketch="exact", bits=4)
    patch_activations(model, preset=preset)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    first = torch.autograd.grad(model(**batch()).loss, params, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum(g.square().sum() for g in first).backward()


def loss_and_grads(model, b, checkpointing=None):
    model.train()
    model.zero_grad(set_to_none=True)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    torch.manual_seed(0)
    loss = model(**b).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=rtol, atol=atol, msg=name)


def module_types(model):
    return {n: type(m) for n, m in model.named_modules()}


def untouched(model, types, impl):
    return (module_types(model) == types and model.config._attn_implementation == impl
            and not hasattr(model, "_sketchprop_activations")
            and not any("forward" in vars(m) for m in model.modules()))


# ---------------------------------------------------------------------------------------------
# Defaults that fit the model; errors that name the option.


@pytest.mark.parametrize("family", MODELS)
def test_defaults_apply_what_the_model_has_and_say_what_they_left(family, caplog):
    model = MODELS[family]()
    with caplog.at_level(logging.INFO, logger="sketchprop.patching"):
        names = patch_activations(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "sketchprop.patching"]
    assert len(lines) == 1 and "applied" in lines[0] and "left" in lines[0]
    assert "lm_head" in names
    if family == "llama":
        # SDPA without attention dropout keeps no probabilities, and the exact recompute cannot
        # make rotated Q, K again: the default leaves attention.
        assert model.config._attn_implementation == "sdpa" and "attention (its sdpa" in lines[0]
        assert [n for n in names if n.endswith("mlp")] == ["model.layers.0.mlp", "model.layers.1.mlp"]
        assert sum(n.endswith("norm") for n in names) == 5  # 2 per layer and the final one
        assert "left dropout" in lines[0] and "gelu_bits" in lines[0]
    else:  # GPT-2's Q, K, V are its fused c_attn's columns: made again from the block's input
        assert model.config._attn_implementation == act.ATTENTION_NAME
        assert sum(isinstance(model.get_submodule(n), act.CompactTanhGELU) for n in names) == 2
        assert sum(isinstance(model.get_submodule(n), act.SeededDropout) for n in names) == 7
        assert "mlp" in lines[0].split("left")[1] and "rmsnorm" in lines[0].split("left")[1]
    model(**batch()).loss.backward()  # trains


def _with_module_dropout(model):
    """A model whose config says 0 but one attention module drops (a sub-model's own key)."""
    model.model.layers[0].self_attn.attention_dropout = 0.1
    return model


@pytest.mark.parametrize("build, applies", [
    (lambda: tiny_llama(), False),  # SDPA, no attention dropout, Q/K/V kept either way
    (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1)), True),
    (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")), True),
    (lambda: tiny_gpt2(dropout=0.1), True),  # GPT-2 as it ships: attention dropout 0.1
    (lambda: _with_module_dropout(tiny_llama()), True),  # one attention module's own rate
    (lambda: tiny_gpt2(), True),  # its Q, K, V (fused c_attn) are made again from its input
    (tiny_bert, True),  # BERT's Q, K, V are made again from the block's input
])
def test_default_attention_applies_where_it_saves(build, applies):
    """The default recompute applies where the model's attention keeps probabilities (eager, or
    attention dropout) or its Q, K, V can be made again; asked for, it applies anyway."""
    model = build()
    impl = model.config._attn_implementation
    names = patch_activations(model)
    assert (model.config._attn_implementation == act.ATTENTION_NAME) == applies, impl
    unpatch_activations(model)
    assert model.config._attn_implementation == impl
    patch_activations(model, attention="recompute")
    assert model.config._attn_implementation == act.ATTENTION_NAME
    unpatch_activations(model)
    assert names is not None


@pytest.mark.parametrize("family, kwargs, option", [
    ("llama", {"dropout": "seeded"}, "dropout='stored'"),
    ("llama", {"dropout": "packed"}, "dropout='stored'"),
    ("llama", {"gelu_bits": 2}, "gelu_bits=None"),
    ("gpt2", {"mlp": "recompute"}, "mlp='stored'"),
    ("gpt2", {"rmsnorm": "compact"}, "rmsnorm='stored'"),
    ("bert", {"lm_loss": "chunked"}, "lm_loss='stored'"),
    ("llama", {"targets": "nothing"}, "targets='nothing'"),
    ("llama", {"targets": "nothing", "mlp": "recompute"}, "mlp='stored'"),
])
def test_an_explicit_option_that_matches_nothing_raises_naming_it(family, kwargs, option):
    model = tiny_bert() if family == "bert" else MODELS[family]()
    types, impl = module_types(model), model.config._attn_implementation
    with pytest.raises(ValueError, match=option) as err:
        patch_activations(model, **kwargs)
    assert "Linear" not in str(err.value)  # names the option, not unrelated modules
    assert untouched(model, types, impl)


def test_nothing_applies_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="nothing to patch") as err:
        patch_activations(model)
    assert "dropout" in str(err.value) and "attention" in str(err.value)
    assert "forward" not in vars(model[0])


def test_attention_checked_before_any_change():
    """A model whose attention recompute_attention cannot stand for (attention sinks: gpt-oss) is
    refused before anything changes when attention is asked for, and left by the defaults."""
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    types, impl = module_types(model), model.config._attn_implementation
    with pytest.raises(ValueError, match="attention sinks.*attention='stored'"):
        patch_activations(model, attention="recompute")
    assert untouched(model, types, impl)
    patch_activations(model)
    assert model.config._attn_implementation == impl  # the attention left as it is


def tiny_gemma2():
    torch.manual_seed(0)
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
        initializer_range=0.3, pad_token_id=0))  # weights large enough for scores beyond the cap


@pytest.mark.parametrize("output_attentions", [False, True])
def test_capped_scores_and_logits_give_the_unpatched_gradients(output_attentions):
    """Gemma 2 caps its attention scores and its logits (softcap * tanh(x / softcap); caps small
    enough that tanh bends): the recomputed attention gives the unpatched loss bit for bit and its
    gradients to float rounding, as does the chunked loss; with output_attentions, the same
    weights."""
    ref = tiny_gemma2()
    b = batch()
    assert b["attention_mask"].eq(0).any()  # padded, and longer than the sliding window
    model = copy.deepcopy(ref)
    assert patch_activations(model, attention="recompute", rmsnorm="stored", mlp="stored",
                             gelu_bits=None, lm_loss="stored") == []
    kwargs = {"output_attentions": True} if output_attentions else {}
    want = loss_and_grads(ref, {**b, **kwargs})
    got = loss_and_grads(model, {**b, **kwargs})
    assert torch.equal(got[0], want[0])
    assert_same(got, want)
    if output_attentions:
        weights = [model(**b, **kwargs).attentions, ref(**b, **kwargs).attentions]
        assert all(torch.equal(x, y) for x, y in zip(*weights, strict=True))
    lossy = copy.deepcopy(ref)
    assert patch_activations(lossy, attention="stored", rmsnorm="stored", mlp="stored",
                             gelu_bits=None, lm_loss="chunked") == ["lm_head"]
    got = loss_and_grads(lossy, b)
    assert got[0].isfinite() and lossy(**b).logits is None  # (training with labels: chunked)
    assert_same(got, loss_and_grads(ref, b))


@pytest.mark.parametrize("decoder_input", [False, True])
def test_the_chunked_loss_of_t5_is_its_own(decoder_input):
    """An encoder-decoder LM (T5): its labels are not shifted, its decoder reads the input its
    labels make (or the one given), and the loss is its CrossEntropyLoss, gradients to float
    rounding; the logits never formed."""
    torch.manual_seed(0)
    ref = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    model = copy.deepcopy(ref)
    assert patch_activations(model, attention="stored", dropout="stored", rmsnorm="stored",
                             mlp="stored", lm_loss="chunked") == ["lm_head"]
    b = batch()
    if decoder_input:  # a decoder input other than the labels' (shorter, its own tokens)
        b["decoder_input_ids"] = torch.randint(3, VOCAB, (3, 7))
        b["labels"] = b["labels"][:, :7].contiguous()
    assert_same(loss_and_grads(model, b), loss_and_grads(ref, b))
    assert model(**b).logits is None


def test_t5_by_position_is_its_own_call():
    """Arguments by position (T5's decoder input as None, labels too) bind as the model's own
    forward binds them: the chunked loss is the unpatched model's."""
    torch.manual_seed(0)
    ref = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    model = copy.deepcopy(ref)
    patch_activations(model, attention="stored", dropout="stored", rmsnorm="stored",
                      mlp="stored", lm_loss="chunked")
    b = batch()
    names = list(inspect.signature(type(ref).forward).parameters)[1:]
    at = names.index("labels")
    args = [b["input_ids"], b["attention_mask"], *[None] * (at - 2), b["labels"]]
    assert names[2] == "decoder_input_ids"
    ref.train(), model.train()
    want, got = ref(*args).loss, model(*args).loss
    torch.testing.assert_close(got, want)
    assert model(*args).logits is None  # (chunked: labels found by position)


def test_a_cap_under_another_name_is_applied():
    """RecurrentGemma caps its logits under config.logits_soft_cap: the chunked loss caps them
    as well, and gives the unpatched loss and gradients."""
    torch.manual_seed(0)
    ref = tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=8,
        logits_soft_cap=1.5, pad_token_id=0, block_types=["recurrent", "attention"]))
    model = copy.deepcopy(ref)
    assert patch_activations(model, lm_loss="chunked", rmsnorm="stored", mlp="stored",
                             gelu_bits=None, attention="stored") == ["lm_head"]
    assert_same(loss_and_grads(model, batch()), loss_and_grads(ref, batch()))


def test_a_multiplier_after_the_output_layer_is_refused():
    """FalconH1 multiplies its logits (config.lm_head_multiplier): the chunked loss would leave
    the multiplier out, so it is refused by name."""
    model = tf.FalconH1ForCausalLM(tf.FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32,
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, lm_head_multiplier=3.0,
        pad_token_id=0))
    with pytest.raises(ValueError, match="lm_head_multiplier"):
        patch_activations(model, lm_loss="chunked")


def test_an_encoder_decoder_lm_with_a_logits_bias_keeps_its_loss():
    """BART adds final_logits_bias after its output layer: the chunked loss would leave it out,
    so the default leaves the loss, and asked for, it raises naming why."""
    model = tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=48,
        decoder_ffn_dim=48, encoder_attention_heads=4, decoder_attention_heads=4))
    types, impl = module_types(model), model.config._attn_implementation
    with pytest.raises(ValueError, match="SEQ2SEQ_LMS.*lm_loss='stored'"):
        patch_activations(model, lm_loss="chunked")
    assert untouched(model, types, impl)


def test_grouped_heads_patch_and_train():
    """The call that trained a Llama before the decoder parts; its first forward raised (after
    patching) while grouped K/V heads were not supported."""
    model = tiny_llama(kv_heads=1)
    ref = copy.deepcopy(model)
    patch_activations(model, dropout="stored", gelu_bits=None, attention="recompute")
    assert_same(loss_and_grads(model, batch()), loss_and_grads(ref, batch()))


# ---------------------------------------------------------------------------------------------
# Exact parts give the unpatched model's gradients.


@pytest.mark.stack("ckpt-reentrant", "decoders")
@pytest.mark.stack("ckpt-nonreentrant", "decoders")
@pytest.mark.parametrize("family, mlp", [("llama", "recompute"), ("llama", "input"),
                                         ("gpt2", "recompute")])
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_exact_parts_give_the_unpatched_gradients(family, mlp, checkpointing):
    model = MODELS[family]()
    ref = copy.deepcopy(model)
    patch_activations(model, gelu_bits=None, attention="recompute",
                      **({"mlp": mlp} if family == "llama" else {}))
    assert_same(loss_and_grads(model, batch(), checkpointing),
                loss_and_grads(ref, batch(), checkpointing))


@pytest.mark.stack("autocast-bf16", "decoders")
@pytest.mark.parametrize("family, mlp", [("llama", "recompute"), ("llama", "input"),
                                         ("gpt2", "recompute")])
def test_autocast_bf16(family, mlp):
    """Under bf16 autocast the patched model computes in the dtypes the unpatched one does: its
    loss and gradients agree to bf16 rounding."""
    model = MODELS[family]()
    ref = copy.deepcopy(model)
    patch_activations(model, gelu_bits=None, attention="recompute",
                      **({"mlp": mlp} if family == "llama" else {}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = loss_and_grads(model, batch()), loss_and_grads(ref, batch())
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    for name, g in want[1].items():
        err = (got[1][name] - g).norm() / g.norm()
        assert err < 0.05, (name, err.item())


def test_gpt2_with_the_gelu_code_keeps_the_forward():
    """The coded GELU changes backward only (its unbiasedness: the tests of the pieces below)."""
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    patch_activations(model)
    (loss, got), (want_loss, want) = loss_and_grads(model, batch()), loss_and_grads(ref, batch())
    torch.testing.assert_close(loss, want_loss)
    assert got.keys() == want.keys() and all(torch.isfinite(g).all() for g in got.values())


def _mlp_saved_shapes(model) -> set:
    """The shapes of what one forward saves for backward (then runs the backward)."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        loss = model(**batch()).loss
    loss.backward()
    return set(shapes)


@pytest.mark.parametrize("mlp", ["recompute", "input", "auto"])
def test_lora_llama_exact_and_reversible(mlp):
    """peft LoRA on every projection, patch_linear's exact sketch on the adapters: their gradients
    are the unpatched model's; both undo. With ``mlp="input"`` the MLP keeps its input only."""
    config = LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    model = get_peft_model(tiny_llama(), config)
    ref = copy.deepcopy(model)
    types = module_types(model)
    names = patch_activations(model, gelu_bits=None, mlp=mlp, attention="recompute")
    patch_linear(model, "exact", rho=1.0, targets="lora_A")
    assert "base_model.model.lm_head" in names
    assert_same(loss_and_grads(model, batch()), loss_and_grads(ref, batch()))
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    if mlp != "recompute":  # the check passed: the gate and up outputs are made again from x
        assert all(vars(m).get(act.mlp._INPUT_CHECKED) is True for m in mlps)
        shapes = _mlp_saved_shapes(model)
        assert (3, 12, 32) in shapes and (3, 12, 48) not in shapes  # x kept, not g or u
    unpatch_linear(model)
    assert unpatch_activations(model) == names
    assert module_types(model) == types and not any(
        vars(m).keys() & {"forward", act.mlp._INPUT_CHECKED} for m in model.modules())


def test_auto_mlp_keeps_the_input_where_gate_and_up_are_frozen(caplog):
    """The default ``mlp="auto"`` keeps the gate and up outputs while their weights train, the
    MLP's input once they are frozen (decided per call: freezing after patching counts), with the
    unpatched model's gradients either way."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="sketchprop.patching"):
        patch_activations(model, gelu_bits=None)
    assert "mlp='auto' (2 modules; its input kept where the gate and up weights are frozen: 0 " \
           "now)" in caplog.text
    assert (3, 12, 48) in _mlp_saved_shapes(model)  # trainable: g and u kept
    for m in (model, ref):
        for layer in m.model.layers:
            layer.mlp.gate_proj.weight.requires_grad_(False)
            layer.mlp.up_proj.weight.requires_grad_(False)
    assert (3, 12, 48) not in _mlp_saved_shapes(model)  # frozen: x kept, g and u made again
    assert all(vars(layer.mlp).get(act.mlp._INPUT_CHECKED) is True for layer in model.model.layers)
    assert_same(loss_and_grads(model, batch()), loss_and_grads(ref, batch()))
    for m in (model, ref):  # one trains again: that MLP keeps g and u again
        m.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    assert (3, 12, 48) in _mlp_saved_shapes(model)
    assert_same(loss_and_grads(model, batch()), loss_and_grads(ref, batch()))


def _lora_gate_up(**extra):
    """A tiny Llama with LoRA on the gate and up projections, and trainable embeddings, so that
    what reaches the MLP needs a gradient."""
    model = get_peft_model(tiny_llama(), LoraConfig(
        task_type="CAUSAL_LM", r=2, lora_alpha=4, init_lora_weights=False,
        target_modules=["gate_proj", "up_proj"], **extra))
    model.get_input_embeddings().weight.requires_grad_(True)
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_input_mlp_recomputes_what_forward_computed_whatever_changes_before_backward():
    """Backward makes the gate and up outputs again as forward computed them: a forward with the
    adapters disabled whose backward runs after they are on again, adapters merged, another
    adapter (with LoRA dropout, which is not recomputed) made active, a hook added after the
    first call: the unpatched model's gradients each time."""
    model = _lora_gate_up()
    model.add_adapter("dropping", LoraConfig(r=2, lora_alpha=4, lora_dropout=0.5,
                                             target_modules=["gate_proj", "up_proj"]))
    ref = copy.deepcopy(model)
    patch_activations(model, dropout="stored", gelu_bits=None)
    b = batch()

    def step(m, disabled=False):
        m.train()
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with m.disable_adapter() if disabled else contextlib.nullcontext():
            loss = m(**b).loss
        loss.backward()
        return loss.detach(), _grads(m)

    assert_same(step(model), step(ref))  # the first call checks the plans
    assert_same(step(model, disabled=True), step(ref, disabled=True))
    for m in (model, ref):
        m.merge_adapter()
    assert_same(step(model), step(ref))
    for m in (model, ref):
        m.unmerge_adapter()
        m.set_adapter("dropping")
    assert_same(step(model), step(ref))
    for m in (model, ref):
        m.set_adapter("default")
        m.base_model.model.model.layers[0].mlp.gate_proj.register_forward_hook(
            lambda mod, args, out: 2 * out)
    with pytest.warns(UserWarning, match="mlp='input' keeps them"):
        got = step(model)
    assert_same(got, step(ref))


def test_input_mlp_raises_when_a_weight_changes_in_place_before_backward():
    model = _lora_gate_up()
    patch_activations(model, gelu_bits=None)
    loss = model(**batch()).loss
    with torch.no_grad():
        model.base_model.model.model.layers[0].mlp.up_proj.lora_B["default"].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_auto_mlp_says_where_it_cannot_keep_the_input(caplog):
    """LoRA dropout on the gate and up projections: their outputs are kept, and the log says so."""
    with caplog.at_level(logging.INFO, logger="sketchprop.patching"):
        patch_activations(_lora_gate_up(lora_dropout=0.1), gelu_bits=None)
    assert "frozen: 0 now" in caplog.text


@pytest.mark.parametrize("family", MODELS)
def test_round_trip(family):
    model = MODELS[family]()
    b = batch()
    types, keys = module_types(model), list(model.state_dict())
    impl = model.config._attn_implementation
    before = loss_and_grads(model, b)
    names = patch_activations(model)
    assert list(model.state_dict()) == keys
    loss_and_grads(model, b)
    assert unpatch_activations(model) == names
    assert untouched(model, types, impl)
    after = loss_and_grads(model, b)
    assert torch.equal(before[0], after[0])
    assert all(torch.equal(before[1][n], after[1][n]) for n in before[1])
    assert patch_activations(model) == names  # patchable again


def saved_by_one_step(model, b):
    with SavedTensorMeter(model) as meter:
        loss = model(**b).loss
    loss.backward()
    return meter.bytes


@pytest.mark.stack("hub-kernels", "bits", "decoders")
def test_hub_kernels_never_silently_unpatch():
    """transformers' hub kernels (from_pretrained turns them on from transformers 5.25) kernelize
    again at each train()/eval() that changes mode, which puts each RMSNorm's own forward back over
    the patched one. Patching turns them off, unpatching on again, and kernels turned on in
    between are refused at the next forward. Linear layers, replaced as modules, are untouched."""
    model = tiny_llama()
    if not hasattr(model, "set_use_kernels") or importlib.util.find_spec("kernels") is None:
        pytest.skip("this transformers has no hub kernels")
    b = batch()
    reference = tiny_llama()
    patch_linear(reference, bits=4)
    patch_activations(reference)
    model.set_use_kernels(True)
    model.eval()  # as from_pretrained returns it
    before = model(**b).logits
    patch_linear(model, bits=4)
    patch_activations(model)
    model.train()  # a new mode: kernelized again were the kernels still on
    assert not model.use_kernels
    assert saved_by_one_step(model, b) == saved_by_one_step(reference, b)
    assert saved_by_one_step(model, b) < saved_by_one_step(tiny_llama(), b)
    unpatch_activations(model)
    unpatch_linear(model)
    assert model.use_kernels
    assert torch.equal(model.eval()(**b).logits, before)
    patch_activations(model)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(**b)
    model.set_use_kernels(True)
    for run in (model, compiled):  # compiled too: the guard is traced, a replaced forward retraces
        with pytest.raises(RuntimeError, match="model.layers.0.input_layernorm was replaced .*hub kernels"):
            run(**b)


def test_deepcopy_of_a_patched_model_computes_with_its_own_modules():
    model = tiny_llama()
    patch_activations(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert not torch.equal(loss_and_grads(twin, batch())[0], loss_and_grads(model, batch())[0])
    assert vars(twin)["forward"].owner is twin
    assert vars(twin.model.norm)["forward"].args[0] is twin.model.norm  # bound to its own norm


# ---------------------------------------------------------------------------------------------
# The pieces.


@pytest.mark.parametrize("chunk", [None, 1, 7, 1000])
@pytest.mark.parametrize("bias, items", [(False, None), (True, None), (False, 17)])
def test_chunked_loss_is_transformers_loss(chunk, bias, items):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    lin = nn.Linear(16, VOCAB, bias=bias)
    labels = torch.randint(0, VOCAB, (3, 10), generator=g)
    labels[0, :4] = -100
    kwargs = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    want = ForCausalLMLoss(lin(h), labels, VOCAB, **kwargs)
    want_grads = torch.autograd.grad(want, [h, *lin.parameters()])
    got = chunked_lm_loss(h, lin.weight, labels, lin.bias, chunk_size=chunk, **kwargs)
    got_grads = torch.autograd.grad(got, [h, *lin.parameters()])
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_loss_never_keeps_logits():
    """Backward keeps the hidden states and one log-sum-exp per token: nothing of the
    vocabulary's size per token."""
    h = torch.randn(4, 50, 16, requires_grad=True)
    w = torch.randn(VOCAB * 10, 16, requires_grad=True)
    labels = torch.randint(0, VOCAB * 10, (4, 50))
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                  lambda t: t):
        loss = act.chunked_lm_loss(h, w, labels)
    loss.backward()
    assert shapes and all(VOCAB * 10 not in s[:1] and (len(s) < 2 or s[-1] != VOCAB * 10)
                          or s == tuple(w.shape) for s in shapes)


@pytest.mark.stack("threads", "decoders")
def test_two_threads_train_one_model_with_the_chunked_loss():
    """The chunked loss swaps the output layer's forward during the model's forward. Two threads
    in one model's forward at once (a barrier in its first block) each get the loss and
    gradients they get alone; the layer's own forward is back afterwards (the second thread's
    swap took the first one's hidden states and its restore raised)."""
    model = tiny_gpt2()
    patch_activations(model, dropout="stored", attention="stored", gelu_bits=None,
                      layernorm="stored", lm_loss="chunked")
    model.train()
    batches = [batch(), batch(length=10)]
    params = [p for p in model.parameters() if p.requires_grad]

    def run(b):
        loss = model(**b).loss
        return loss.detach(), torch.autograd.grad(loss, params)

    want = [run(b) for b in batches]
    barrier = threading.Barrier(2)

    def meet(*_):
        barrier.wait(timeout=20)

    handle = model.transformer.h[0].register_forward_pre_hook(meet)
    results = in_two_threads(lambda i: run(batches[i]), barrier)
    handle.remove()
    assert "forward" not in vars(model.lm_head)
    for (loss, grads), (ref_loss, ref_grads) in zip(results, want, strict=True):
        torch.testing.assert_close(loss, ref_loss)
        for g, w in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_chunked_loss_gives_back_an_output_layers_own_forward():
    """An output layer with a forward of its own (another library's wrapper) has it back after a
    chunked step (it was deleted), and other calls during the step go through it."""
    model = tiny_gpt2()
    patch_activations(model, dropout="stored", attention="stored", gelu_bits=None,
                      layernorm="stored", lm_loss="chunked")
    head, calls = model.lm_head, []

    def wrapper(x):
        calls.append(x.shape)
        return nn.Linear.forward(head, x)

    head.forward = wrapper
    model.train()
    model(**batch()).loss.backward()
    assert vars(head)["forward"] is wrapper and not calls  # the chunked step took the input
    model.eval()
    with torch.no_grad():
        model(**batch())
    assert calls


def test_tanh_gelu_derivative_and_range():
    x = torch.linspace(-6, 6, 10001, dtype=torch.float64).requires_grad_(True)
    (want,) = torch.autograd.grad(nn.functional.gelu(x, approximate="tanh").sum(), x)
    torch.testing.assert_close(act.gelu_tanh_derivative(x), want.float())
    assert act.gelu._TANH_G_MIN < want.min().item() < act.gelu._TANH_G_MIN + 1e-5
    assert act.gelu._TANH_G_MAX - 1e-5 < want.max().item() < act.gelu._TANH_G_MAX
    assert act.is_tanh_gelu(tf.activations.NewGELUActivation())
    assert not act.is_tanh_gelu(nn.GELU()) and not act.is_exact_gelu(nn.GELU("tanh"))


@pytest.mark.parametrize("bits", [1, 2])
def test_stochastic_tanh_gelu_code_is_unbiased(bits):
    """As for the erf form: the chi^2 of the mean of N draws of dX against the tanh form's own
    derivative, and power against a tenth of a step of bias."""
    x = torch.linspace(-3, 3, 100)
    module = act.CompactTanhGELU(bits)
    code = module.fitted
    step = code.levels[1] - code.levels[0]
    g = act.gelu_tanh_derivative(x).double()
    frac = ((g - code.levels[0]) / step) % 1
    var = step**2 * frac * (1 - frac)
    use = (frac > 0.05) & (frac < 0.95)
    n = 4000
    xx = x.expand(n, -1).clone().requires_grad_(True)
    y = module(xx)
    torch.testing.assert_close(y, nn.functional.gelu(xx, approximate="tanh"), rtol=0, atol=0)
    y.backward(torch.ones_like(y))
    mean = xx.grad.double().mean(0)
    bound = stats.chi2.isf(FALSE_ALARM, int(use.sum()))

    def chi2(target):
        return ((mean - target)[use].square() / (var[use] / n)).sum().item()

    assert chi2(g) < bound
    assert chi2(g + 0.1 * step) > bound


def test_optimal_tanh_gelu_code_is_fit_on_its_own_derivative():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    module = act.CompactTanhGELU(2, "optimal")
    module(x)
    want = act.GeluCode.fit(x, 2, derivative=act.gelu_tanh_derivative)
    assert module.fitted == want and want != act.GeluCode.fit(x, 2)


def test_rms_norm_check_tells_the_forms_apart():
    llama = tiny_llama(layers=1)
    assert act.rms_norm_form(llama.model.norm) == "llama"
    assert act.rms_norm_form(tf.models.gemma.modeling_gemma.GemmaRMSNorm(32)) == "gemma"  # 1 + w
    assert act.rms_norm_form(tf.models.t5.modeling_t5.T5LayerNorm(32)) == "t5"  # its own cast
    assert act.rms_norm_form(torch.nn.LayerNorm(32)) is None
    assert act.is_gated_mlp(llama.model.layers[0].mlp)
    assert not act.is_gated_mlp(tiny_gpt2(layers=1).transformer.h[0].mlp)


# ---------------------------------------------------------------------------------------------
# What backward keeps.


def saved(model, b):
    torch.manual_seed(0)
    with SavedTensorMeter(model) as meter:
        loss = model(**b).loss
    loss.backward()
    return meter.bytes


def test_each_decoder_part_saves_less():
    b = batch(n=4, length=24)
    off = {"attention": "stored", "mlp": "stored", "rmsnorm": "stored", "lm_loss": "stored"}
    sizes = {"exact": saved(tiny_llama(), b)}
    for part in off:
        model = tiny_llama()
        patch_activations(model, **{**off, part: {"attention": "recompute", "mlp": "recompute",
                                                  "rmsnorm": "compact", "lm_loss": "chunked"}[part]})
        sizes[part] = saved(model, b)
    model = tiny_llama()
    patch_activations(model)
    sizes["all"] = saved(model, b)
    assert all(sizes[k] < sizes["exact"] for k in off), sizes
    assert sizes["all"] < min(sizes[k] for k in off), sizes


def test_decoders_script_quick(tmp_path):
    """scripts/decoders.py on tiny shapes: every method measured, compact below exact."""
    import json

    from test_bench_scripts import py, run_script

    run_script(py("decoders.py", "--quick", "--threads", "1", "--time-steps", "1", "--out-dir",
                  str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "decoders_quick.json").read_text())
    for arch in ("gpt2", "llama"):
        rows = data["results"][arch]
        want = ["exact", "compact", "compact(mlp=input)", "ours+compact", "lora",
                "lora+ours+compact", "lora+ours+compact(mlp=recompute)"]
        assert list(rows) == [m for m in want if arch == "llama" or "mlp=" not in m]
        assert rows["compact"]["saved_bytes"] < rows["exact"]["saved_bytes"]
        assert "chunked loss" in rows["compact"]["by_op"]
        assert "log-probabilities (loss)" in rows["exact"]["by_op"]
        assert all(r["step_seconds"] > 0 for r in rows.values())
        # Timed round-robin: one sample per round, ratios paired with exact's in the same round.
        for r in rows.values():
            assert len(r["step_samples_s"]) == len(r["time_ratios"]) == 1
            assert r["time_ratio"] == r["step_samples_s"][0] / rows["exact"]["step_samples_s"][0]
    # The tables say which rows were timed, and are rewritten from the JSON file alone.
    md = tmp_path / "decoders_quick.md"
    table = md.read_text()
    assert table.count("rows: full-length (no padding") == 2
    md.unlink()
    run_script(py("decoders.py", "--retable", str(tmp_path / "decoders_quick.json")), tmp_path)
    assert md.read_text() == table


def _toy_sst2(root):
    text = ["the film is a charming , funny ride", "a dull and lifeless story",
            "one of the year 's best", "it never finds its footing", "warm , witty and wise"]
    for split, n in (("train", 40), ("dev", 10)):
        folder = root / "SST-2"
        folder.mkdir(parents=True, exist_ok=True)
        rows = [f"{text[i % len(text)]} {i}\t{i % 2}" for i in range(n)]
        (folder / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return root


def test_decoder_finetune_quick(tmp_path):
    """scripts/decoder_finetune.py on a tiny random Llama: every method trains on the same batches
    from the same weights; compact, being exact, follows exact's loss curve."""
    import json

    from test_bench_scripts import py, run_script

    glue = _toy_sst2(tmp_path / "glue")
    run_script(py("decoder_finetune.py", "--quick", "--threads", "1", "--glue-dir", str(glue),
                  "--methods", "exact,compact,int4+lean,lora+ours+compact", "--out-dir", str(tmp_path),
                  "--figure", str(tmp_path / "curves.png")), tmp_path)
    data = json.loads((tmp_path / "decoder_finetune_quick.json").read_text())
    rows = data["results"]
    assert list(rows) == ["exact", "compact", "int4+lean", "lora+ours+compact"]
    assert (tmp_path / "curves.png").stat().st_size > 0
    exact, compact, lora = rows["exact"], rows["compact"], rows["lora+ours+compact"]
    assert len(exact["train_loss"]) == len(compact["train_loss"]) == 3
    assert list(exact["dev_loss"]) == ["0", "2", "3"]
    assert rows["int4+lean"]["saved_bytes"] < compact["saved_bytes"] < exact["saved_bytes"]
    assert lora["trainable"] < exact["trainable"] == compact["trainable"]
    assert compact["max_abs_loss_diff"] < 1e-4  # float rounding only
    assert compact["train_loss"][0] == pytest.approx(exact["train_loss"][0], abs=1e-5)
    # Training moves the weights: the held-out loss changes from step 0.
    assert exact["dev_loss"]["3"] != exact["dev_loss"]["0"]
    # The figure and the table are remade from the JSON file alone; the table names its rows.
    md = tmp_path / "decoder_finetune_quick.md"
    table = md.read_text()
    assert "rows: full-length blocks, no padding" in table
    md.unlink()
    out = run_script(py("decoder_finetune.py", "--replot", str(tmp_path / "decoder_finetune_quick.json"),
                        "--figure", str(tmp_path / "again.png")), tmp_path)
    assert (tmp_path / "again.png").stat().st_size > 0 and "| lora+ours+compact |" in out
    assert md.read_text() == table


def test_decoder_finetune_refuses_bad_input(tmp_path):
    import subprocess

    from test_bench_scripts import ROOT, py

    from sketchprop.bench import decoder_finetune

    for args, message in ((["--methods", "exact,compactt"], "unknown method 'compactt'"),
                          (["--methods", "exact,compact(mlp=bogus)"], "unknown mlp 'bogus'"),
                          (["--methods", "exact,ours(rho=0.5)"], "only compact and lean take options"),
                          (["--glue-dir", str(tmp_path)], "lacks SST-2/train.tsv, SST-2/dev.tsv"),
                          (["--steps", "0"], "--steps must be at least 1")):
        proc = subprocess.run(py("decoder_finetune.py", "--quick", *args), capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-500:])
    with pytest.raises(decoder_finetune.WeightsError, match="no such file"):
        decoder_finetune.gguf_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="SST-2/train.tsv"):
        decoder_finetune.sentences(str(tmp_path), "train")


def test_decoders_method_names_parse():
    from sketchprop.bench import decoders

    assert decoders.split_methods("exact, compact(mlp=recompute,attention=stored),lora+ours") == [
        "exact", "compact(mlp=recompute,attention=stored)", "lora+ours"]
    assert decoders.parse_method("lora+ours+compact(mlp=input,lm_loss=stored)") == (
        ["lora", "ours", "compact"], {"mlp": "input", "lm_loss": "stored"})
    assert decoders.parse_method("int4+lean(mlp=input)") == (["int4", "lean"], {"mlp": "input"})
    for bad, message in (("ours(rho=0.5)", "only compact and lean take options"),
                         ("compact(mlp)", "is not key=value"), ("ours+", "unknown method"),
                         ("compact(mlp=input", "unknown method")):
        with pytest.raises(ValueError, match=message):
            decoders.parse_method(bad)
