"""The lean preset on a Llama-shaped decoder: RMSNorm's backward from a code of its output, the
attention's Q, K, V (rotated) and the gated MLP's gate and up outputs made again from that code,
the linear layers sharing it; exact where the code is the tensor itself, unbiased in the mean of
draws, reversible."""

import copy
import math

import pytest
import torch
from test_decoder import VOCAB, tiny_llama
from test_lean import saved_bytes, z_scores

from sketchprop import patch_activations, patch_linear, unpatch_activations
from sketchprop.activations import CodedRMSNorm, RMSNormFunction, attention, mlp, norms

pytestmark = pytest.mark.usefixtures("one_thread")


def full_batch(n=3, length=12):
    ids = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def grads(model, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(got: dict, exact: dict) -> float:
    return math.sqrt(sum(((got[n] - exact[n]) ** 2).sum() for n in exact)
                     / sum((exact[n] ** 2).sum() for n in exact))


def nodes(loss: torch.Tensor) -> set[str]:
    seen, todo = set(), [loss.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo += [g for g, _ in f.next_functions]
    return {type(f).__name__ for f in seen}


class IdentityCode:
    """A stand-in for SharedCode whose payload is the tensor itself: the code paths then compute
    with the very input, and must give the uncoded paths' gradients."""

    def __init__(self, payload, spec=None):
        self.payload, self.spec = payload, spec

    def decode(self, dtype=None):
        return self.payload


# Layer: RMSNorm's backward from a 4-bit code of its output.


def rmsnorm_draws(draws: int, width=64, rows=256, group=16):
    """``draws`` gradients of a coded RMSNorm (independent roundings) and the exact ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g) * 2 + 1
    dy = torch.randn(rows, width, generator=g)
    norm = tiny_llama().model.norm  # a transformers LlamaRMSNorm, its width changed below
    norm.weight = torch.nn.Parameter(0.5 + torch.rand(width, generator=g))
    xr = x.clone().requires_grad_()
    RMSNormFunction.apply(xr, norm.weight, norm.variance_epsilon).backward(dy)
    exact = (xr.grad, norm.weight.grad.clone())
    coded = CodedRMSNorm(norm.train(), bits=4, group=group, name="norm")
    out = []
    for _ in range(draws):
        norm.zero_grad()
        xr = x.clone().requires_grad_()
        coded(xr).backward(dy)
        out.append((xr.grad, norm.weight.grad.clone()))
    return exact, [torch.stack(t) for t in zip(*out, strict=True)]


def test_coded_rmsnorm_weight_gradient_is_unbiased_and_input_gradient_bias_below_noise():
    """The weight's gradient is linear in the code: unbiased. The input's last term is quadratic
    in it (as LayerNorm's: norms module docstring): its bias, a 64th of a 4-bit rounding's
    variance, is below the standard error of 200 draws; a code read wrong would not be."""
    (dx, dw), (dxs, dws) = rmsnorm_draws(200)
    assert z_scores(dws, dw).abs().max() < 4  # 8 normal z-scores: |z| > 4 has p ~ 5e-4 in all
    assert z_scores(dxs, dx).abs().max() < 4
    assert (dws.std(0) > 0).all()  # the code is random


@pytest.mark.parametrize("shape", [(2, 5, 32), (2, 5, 3, 32)])  # a hidden state, QK-norm heads
def test_coded_rmsnorm_backward_from_an_exact_code_is_rmsnormfunctions(monkeypatch, shape):
    """The backward's arithmetic alone: given its output itself as the code, the coded RMSNorm's
    gradients are RMSNormFunction's, to float32 rounding; a column with a tiny weight keeps its
    input column. Heads (a QK-norm's input) are coded a token's heads a row."""
    monkeypatch.setattr(norms, "SharedCode", IdentityCode)
    monkeypatch.setattr(norms, "quantize", lambda y, bits, group, seed: (y.clone(), None, None))
    norm = tiny_llama().model.norm.train()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.weight[3] = 1e-4
    x = torch.randn(*shape) * 2 + 1
    dy = torch.randn(*shape)
    got = []
    for f in (CodedRMSNorm(norm, bits=4, name="norm"),
              lambda t: RMSNormFunction.apply(t, norm.weight, norm.variance_epsilon)):
        norm.zero_grad()
        xr = x.clone().requires_grad_()
        f(xr).backward(dy)
        got.append((xr.grad, norm.weight.grad.clone()))
    for a, b in zip(*got, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_qk_norms_code_is_not_padded_head_by_head():
    """A QK-norm normalises each head (batch, tokens, heads, 16 columns here): its code's rows
    are a token's heads, so no row is padded to a whole group of 64 (four times the codes), and,
    as no linear layer reads it, it is not filed. A hidden state's code is filed, as before."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from sketchprop.codes import code_of
    norm = LlamaRMSNorm(16).train()
    coded = CodedRMSNorm(norm, bits=4, group=64, name="q_norm")
    x = torch.randn(2, 6, 4, 16, requires_grad=True)
    y = coded(x)
    payload = next(t for t in y.grad_fn.next_functions[0][0].saved_tensors
                   if t.dtype == torch.uint8)
    assert payload.numel() == x.numel() // 2 + x.numel() // 64 * 4  # 4 bits, 4 bytes a group
    assert code_of(y) is None
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and norm.weight.grad is not None
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    assert code_of(coded(hidden)) is not None


def test_coded_rmsnorm_keeps_the_input_of_a_column_with_a_small_weight():
    """Its output divided by a weight of 1e-4 would blow the code's rounding up ten
    thousandfold, and one of 0.05 in a group whose largest weight is 3 sixtyfold: those columns'
    normalised inputs come from their kept input columns, exact; the others from the code."""
    norm = tiny_llama().model.norm.train()
    with torch.no_grad():
        norm.weight[3], norm.weight[5], norm.weight[9] = 1e-4, 3.0, 0.05
    x, dy = torch.randn(40, 32), torch.randn(40, 32)
    RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon).backward(dy)
    want = norm.weight.grad.clone()
    norm.zero_grad()
    CodedRMSNorm(norm, bits=4, group=16, name="norm")(x).backward(dy)
    kept = torch.tensor([3, 9])
    assert torch.allclose(norm.weight.grad[kept], want[kept], rtol=1e-5)
    assert not torch.allclose(norm.weight.grad[16:], want[16:], rtol=1e-3)  # coded there


def test_coded_rmsnorm_forward_is_the_models_and_eval_is_compact():
    norm = tiny_llama().model.norm
    x = torch.randn(2, 5, 32)
    coded = CodedRMSNorm(norm.train(), bits=4, name="norm")
    with torch.no_grad():
        want = norm(x)
    assert torch.equal(coded(x.requires_grad_()), want)
    norm.eval()
    y = coded(x)
    assert y.grad_fn.name().startswith("RMSNormFunction")


# The rotated Q, K, V and the gated MLP made again from the code: exact when the code is exact.


def identity_codes(monkeypatch, module):
    monkeypatch.setattr(module, "SharedCode", IdentityCode)
    monkeypatch.setattr(module, "code_of", lambda x: None)
    monkeypatch.setattr(module, "make_code",
                        lambda x, bits, group, seed: IdentityCode(x.detach().reshape(-1, x.shape[-1])))


def test_rotary_attention_made_again_from_its_input_is_the_kept_qkv(monkeypatch):
    identity_codes(monkeypatch, attention)
    # the probabilities as the exact recompute computes them (not the fused kernels, whose
    # rounding differs: tested below), so that the rotated Q, K, V are checked bit for bit
    monkeypatch.setattr(attention, "fused_cpu", lambda *args: False)
    inputs = full_batch()
    kept = tiny_llama().train()
    patch_activations(kept, attention="recompute", mlp="stored", rmsnorm="stored",
                      lm_loss="stored", dropout="stored")
    want = grads(kept, inputs)
    model = tiny_llama().train()
    patch_activations(model, attention="coded", mlp="stored", rmsnorm="stored", lm_loss="stored",
                      dropout="stored")
    loss = model(**inputs).loss  # use_cache is on (the config's default): a fresh cache
    assert "_ProjectedAttentionBackward" in nodes(loss)
    assert "_RecomputedAttentionBackward" not in nodes(loss)
    model.zero_grad()
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def padded_batch(n=3, length=12, left=False):
    """Rows of ``length`` tokens, the later ones shorter, padded on the right (``left``: on the
    left, where a causal row's first queries attend to no key)."""
    ids = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(length)[None, :] < torch.tensor([length - 4 * i for i in range(n)])[:, None])
    mask = mask.flip(1) if left else mask
    return {"input_ids": ids.masked_fill(~mask, 0), "attention_mask": mask.long(),
            "labels": ids.masked_fill(~mask, -100)}


def coded_grads(inputs, fused: bool, monkeypatch, **config) -> tuple[dict, list]:
    """Gradients of a tiny Llama under ``attention="coded"`` from exact codes, through the fused
    CPU kernels or not (``fused``), and the ``is_causal`` of each fused kernel call."""
    calls = []
    kernel = attention._FLASH_CPU

    def spy(*args, **kwargs):
        calls.append(args[4])
        return kernel(*args, **kwargs)
    with monkeypatch.context() as m:
        identity_codes(m, attention)
        m.setattr(attention, "_FLASH_CPU", spy)
        if not fused:
            m.setattr(attention, "fused_cpu", lambda *args: False)
        model = tiny_llama(**config).train()
        patch_activations(model, attention="coded", mlp="stored", rmsnorm="stored",
                          lm_loss="stored", dropout="stored")
        return grads(model, inputs), calls


@pytest.mark.parametrize("batch", ["full", "right", "left"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_coded_attention_through_the_fused_kernels_is_the_unfused_to_rounding(
        batch, kv_heads, monkeypatch):
    inputs = {"full": full_batch, "right": padded_batch,
              "left": lambda: padded_batch(left=True)}[batch]()
    want, none = coded_grads(inputs, False, monkeypatch, kv_heads=kv_heads)
    got, calls = coded_grads(inputs, True, monkeypatch, kv_heads=kv_heads)
    assert not none
    # each layer: forward, and forward again in backward; the causal pattern alone as is_causal;
    # not where a query has no key to attend to (left padding): the kernels' backward is not its
    # gradient there
    assert calls == ([] if batch == "left" else [batch == "full"] * 4)
    assert got.keys() == want.keys()
    for n in want:  # float32 rounding of a different order of sums
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_fused_kernels_take_no_dropout_cap_learned_bias_or_blind_query():
    q, mask = torch.zeros(1, 2, 4, 8), torch.ones(1, 1, 4, 4, dtype=torch.bool)
    assert attention.fused_cpu(q, mask, 0.0, None, None)
    assert attention.fused_cpu(q, None, 0.0, None, None)
    blind = mask.clone()
    blind[..., 0, :] = False  # a query with no key
    assert not attention.fused_cpu(q, blind, 0.0, None, None)
    additive = torch.zeros(mask.shape).masked_fill(~blind, torch.finfo(torch.float32).min)
    assert not attention.fused_cpu(q, additive, 0.0, None, None)
    assert attention.fused_cpu(q, torch.zeros(mask.shape), 0.0, None, None)
    assert not attention.fused_cpu(q, mask, 0.1, None, None)  # the kernels draw no dropout
    assert not attention.fused_cpu(q, mask, 0.0, None, 50.0)  # Gemma 2's cap
    assert not attention.fused_cpu(q, mask, 0.0, torch.zeros(1, 2, 4, 4), None)  # T5's bias
    assert not attention.fused_cpu(q.double(), mask, 0.0, None, None)
    assert not attention.fused_cpu(q.to("meta"), None, 0.0, None, None)


def test_gated_mlp_made_again_from_its_code_is_mlp_input(monkeypatch):
    identity_codes(monkeypatch, mlp)
    inputs = full_batch()
    plain = tiny_llama().train()
    patch_activations(plain, mlp="input", rmsnorm="stored")
    want = grads(plain, inputs)
    model = tiny_llama().train()
    patch_activations(model, mlp="coded", rmsnorm="stored")
    got = grads(model, inputs)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_gpt2s_mlp_made_again_from_its_code_computes_gelu_new_fused(monkeypatch):
    """From a code, GPT-2's ``gelu_new`` is PyTorch's tanh GELU, forward and backward (one fused
    kernel each, where autograd through its eight ops made GPT-2's lean step 1.40x exact's):
    from an exact code, the gradients of ``mlp="input"``, which computes ``gelu_new`` by its own
    ops, to float rounding."""
    from test_decoder import tiny_gpt2
    identity_codes(monkeypatch, mlp)
    inputs = full_batch()
    results = []
    for kind in ("input", "coded"):
        model = tiny_gpt2().train()
        patch_activations(model, mlp=kind, gelu_bits=None, layernorm="stored")
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        seen, todo, fns = set(), [loss.grad_fn], []
        while todo:  # the MLPs' backward nodes (a custom Function's node is its ctx)
            f = todo.pop()
            if f is not None and f not in seen:
                seen.add(f)
                fns += [f.gate_fn] if type(f).__name__ == "GatedFromInputBackward" else []
                todo += [g for g, _ in f.next_functions]
        assert fns == ["gelu_new" if kind == "input" else "gelu_tanh"] * 2
        loss.backward()
        results.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    want, got = results
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


# Sharing: one code per RMSNorm output, read by the next layers.


def saved_payloads(loss) -> dict[str, list[int]]:
    """The data pointers of the uint8 tensors each Function kind keeps."""
    out: dict[str, list[int]] = {}
    seen, todo = set(), [loss.grad_fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        todo += [g for g, _ in f.next_functions]
        for t in getattr(f, "saved_tensors", ()) if "Backward" in type(f).__name__ and hasattr(
                f, "saved_tensors") else ():
            if isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
                out.setdefault(type(f).__name__, []).append(t.data_ptr())
    return out


def lean_llama():
    model = tiny_llama().train()
    patch_linear(model, sketch="exact", bits=4, exclude="lm_head")
    patch_activations(model, preset="lean")
    return model


def test_lean_llama_layers_share_the_rmsnorm_codes():
    model = lean_llama()
    loss = model(**full_batch()).loss
    payloads = saved_payloads(loss)
    norms = set(payloads.pop("_CodedRMSNormFunctionBackward"))
    assert len(norms) == 5  # two per layer and the final norm
    # attention and the gated MLP keep the codes of the norms before them, nothing of their own
    assert set(payloads["_ProjectedAttentionBackward"]) <= norms
    assert set(payloads["GatedFromInputBackward"]) <= norms
    # q, k, v, gate and up read a norm's code; o_proj and down_proj code their own input
    linear = payloads["SketchedLinearFunctionBackward"]
    assert sum(p in norms for p in linear) == 2 * 5
    assert len(set(linear) - norms) == 2 * 2
    loss.backward()


def test_lean_llama_saves_fewer_bytes_than_compact():
    compact, lean = (saved_bytes(tiny_llama(), full_batch(), p, exclude="lm_head")
                     for p in ("compact", "lean"))
    # compact keeps per layer two float32 RMSNorm inputs and the gate and up outputs (36 x 32 and
    # 36 x 48 each, twice); lean keeps none of them
    assert compact - lean >= 2 * (2 * 36 * 32 + 2 * 36 * 48) * 4 * 0.8


def test_lean_llama_gradient_is_close_to_exact_and_averages_towards_it():
    """Every parameter's gradient, relative to exact: the mean of 16 draws is closer than one
    draw by much more than a constant bias would allow."""
    inputs = full_batch()
    exact = grads(tiny_llama().train(), inputs)
    model = lean_llama()
    draws = [grads(model, inputs) for _ in range(16)]
    mean = {n: torch.stack([d[n] for d in draws]).mean(0) for n in exact}
    one = sum(rel(d, exact) for d in draws) / len(draws)
    assert rel(mean, exact) < one / 2.5, (rel(mean, exact), one)


def test_lean_llama_patches_unpatches_and_pickles(tmp_path):
    model = tiny_llama().train()
    plain = copy.deepcopy(model)
    keys = model.state_dict().keys()
    before = set(model.model.norm.__dict__)
    names = patch_activations(model, preset="lean")
    assert isinstance(model.model.norm.forward, CodedRMSNorm)
    assert isinstance(model.model.layers[0].mlp.forward, mlp.CodedGatedMLP)
    assert model.state_dict().keys() == keys
    model(**full_batch()).loss.backward()
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.isfinite(grads(loaded, full_batch())["model.norm.weight"]).all()
    assert unpatch_activations(model) == names
    assert set(model.model.norm.__dict__) == before  # no forward, no cached columns left
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(**full_batch()).logits, plain(**full_batch()).logits)
    assert not attention._inputs()


# Where the recompute from the code would not be the forward's, it keeps Q, K, V (or the MLP's
# input): checked with codes that are the tensors themselves, so any difference is not rounding.


@pytest.fixture
def exact_codes(monkeypatch):
    """Every code is its tensor itself: the coded paths must then give exact gradients."""
    from sketchprop import codes, functional, layers
    from sketchprop import quantize as q

    def same(x, bits, group, seed, want_qvar=False):
        rows = x.detach().reshape(-1, x.shape[-1])
        return rows.clone(), q.QuantSpec(bits, group, *rows.shape, x.dtype), None

    for module in (codes, layers, norms):
        monkeypatch.setattr(module, "quantize", same)
    for module in (codes, functional):
        monkeypatch.setattr(module, "dequantize", lambda payload, spec: payload.to(spec.dtype))


def eager_reference(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


KW = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
          pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_partial_rotary_keeps_qkv():
    """Phi rotates part of each head: Q, K, V are kept, as under attention="recompute"."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.PhiForCausalLM(tf.PhiConfig(partial_rotary_factor=0.5, resid_pdrop=0.0,
                                           embd_pdrop=0.0, **KW)).train()
    patch_activations(model, preset="lean")
    loss = model(**full_batch()).loss
    assert "_ProjectedAttentionBackward" not in nodes(loss)
    loss.backward()


def test_interleaved_rotary_first_met_on_one_token_is_not_trusted(exact_codes):
    """Cohere rotates interleaved pairs: a first call of one token (position 0: no rotation)
    proves nothing, so the check waits for a call that rotates, fails there, and keeps Q, K, V."""
    import transformers as tf

    torch.manual_seed(0)
    base = tf.CohereForCausalLM(tf.CohereConfig(**KW)).train()
    want = grads(eager_reference(base), full_batch())
    model = copy.deepcopy(base)
    patch_activations(model, preset="lean")
    grads(model, full_batch(length=1))
    with pytest.warns(UserWarning, match="not its projections"):
        got = grads(model, full_batch())
    assert rel(got, want) < 1e-5


def test_an_input_changed_in_place_after_coding_is_not_read_from_its_code(exact_codes):
    """A pre-hook added after patching scales the attention's and the MLP's input in place:
    their codes no longer stand for it, so attention and the MLP keep the changed input."""
    base = tiny_llama().train()

    def scale(module, args, kwargs):
        with torch.no_grad():
            (args[0] if args else kwargs["hidden_states"]).mul_(1.5)

    ref = eager_reference(base)
    model = copy.deepcopy(base)
    patch_activations(model, preset="lean")
    for m in (ref, model):
        for layer in m.model.layers:
            layer.self_attn.register_forward_pre_hook(scale, with_kwargs=True)
            layer.mlp.gate_proj.register_forward_pre_hook(scale, with_kwargs=True)
    assert rel(grads(model, full_batch()), grads(ref, full_batch())) < 1e-5


def test_autocast_keeps_the_rotated_qkv(exact_codes):
    """Under autocast the forward casts around the rotation: Q, K, V are kept, and the coded path
    stays on for the float32 calls before and after."""
    base = tiny_llama().train()
    ref = copy.deepcopy(base)
    patch_activations(ref, attention="recompute", mlp="stored", rmsnorm="stored",
                      lm_loss="stored", dropout="stored")  # keeps Q, K, V
    model = copy.deepcopy(base)
    patch_activations(model, attention="coded", mlp="stored", rmsnorm="stored",
                      lm_loss="stored", dropout="stored")
    for autocast in (False, True, False):
        got = []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = m(**full_batch()).loss
            if m is model:
                assert ("_ProjectedAttentionBackward" in nodes(loss)) is not autocast
            loss.backward()
            got.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        assert rel(got[1], got[0]) < 1e-5
