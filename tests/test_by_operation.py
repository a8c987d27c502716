"""Parts found by what a module computes, not by its names: the gated MLP (SiLU or GELU gate, gate
and up separate or fused, either half the gate) and the RMSNorm (Llama's and Gemma's forms), on
modules written here with names no model uses and on the families that have them. Each part alone
gives the unpatched gradients; a module that computes something else is left."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.nn.utils import parametrize

from sketchprop import activations as act
from sketchprop import patch_activations, patch_linear, unpatch_activations, unpatch_linear
from sketchprop.bench import families as fam

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL, GTOL = 1e-5, 1e-7
H, FF = 64, 96


def activation(name: str) -> nn.Module:
    from transformers.activations import NewGELUActivation

    return {"relu": nn.ReLU(), "silu": nn.SiLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU("tanh"),
            "gelu_new": NewGELUActivation()}[name]


class Fused(nn.Module):
    """A fused gate-and-up MLP; ``first``: the first half is the gate (Phi-3), else the second."""

    def __init__(self, gate="silu", first=True, dropout=0.0):
        super().__init__()
        self.wide = nn.Linear(H, 2 * FF)
        self.narrow = nn.Linear(FF, H)
        self.f = activation(gate)
        self.p = nn.Dropout(dropout)
        self.first = first

    def forward(self, x):
        a, b = self.wide(x).chunk(2, dim=-1)
        if not self.first:
            a, b = b, a
        return self.narrow(self.p(b * self.f(a)))


class Separate(nn.Module):
    """Gemma's MLP under other names, the product written the other way round."""

    def __init__(self, gate="gelu_tanh", add=False):
        super().__init__()
        self.one, self.two = nn.Linear(H, FF, bias=False), nn.Linear(H, FF, bias=False)
        self.three = nn.Linear(FF, H, bias=False)
        self.nl = activation(gate)
        self.add = add

    def forward(self, x):
        if self.add:  # not a gated MLP
            return self.three(self.nl(self.two(x)) + self.one(x))
        return self.three(self.one(x) * self.nl(self.two(x)))


class Norm(nn.Module):
    """An RMSNorm with a name no model uses; ``offset``: Gemma's ``(1 + w)`` form."""

    def __init__(self, offset=False):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(H) * 0.1 + (0 if offset else 1))
        self.weight = self.scale
        self.eps, self.offset = 1e-6, offset

    def forward(self, x):
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (n * (1.0 + self.weight.float())).type_as(x)
        return self.weight * n.to(x.dtype)


class T5Like(Norm):
    """T5's RMSNorm: the cast goes to the weight's dtype, after the normalisation."""

    def forward(self, x):
        n = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            n = n.to(self.weight.dtype)
        return self.weight * n


class Block(nn.Module):
    def __init__(self, mlp, norm=None):
        super().__init__()
        self.norm = norm or nn.Identity()
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def grads(model, x, setup=None):
    torch.manual_seed(3)
    if setup is not None:
        setup(model)
    x = x.clone().requires_grad_(True)
    model(x).square().sum().backward()
    return {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()
                            if p.grad is not None}}


def assert_same(got, want):
    assert set(got) == set(want)
    scale = torch.stack([g.norm() for g in want.values()]).norm()
    for n, g in want.items():
        assert (got[n] - g).norm() <= RTOL * g.norm() + GTOL * scale, n


def data():
    return torch.randn(4, 7, H, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("gate", list(act.GATES))
@pytest.mark.parametrize("kind", ["fused-first", "fused-second", "separate"])
def test_a_gated_mlp_is_found_by_what_it_computes(kind, gate):
    mlp = Separate(gate) if kind == "separate" else Fused(gate, first=kind == "fused-first")
    layout = act.gated_layout(mlp)
    assert layout is not None and layout.gate_fn == gate
    if kind == "separate":  # the product is one(x) * nl(two(x)): two is the gate
        assert (layout.gate, layout.up, layout.down, layout.half) == ("two", "one", "three", None)
    else:
        assert (layout.gate, layout.down, layout.half) == ("wide", "narrow",
                                                           0 if kind == "fused-first" else 1)


def test_what_is_not_a_gated_mlp_is_left():
    assert act.gated_layout(Separate(add=True)) is None
    assert act.gated_layout(Fused(dropout=0.1)) is None  # a dropout that draws
    mlp = Fused()
    mlp.f = nn.Tanh()  # no gate of GATES
    assert act.gated_layout(mlp) is None
    with pytest.raises(ValueError, match="gated MLP"):
        patch_activations(Block(Separate(add=True)), mlp="input", gelu_bits=None,
                          attention="stored", lm_loss="stored")


@pytest.mark.parametrize("mode", ["recompute", "input"])
@pytest.mark.parametrize("make", [lambda: Fused("silu"), lambda: Fused("gelu", first=False),
                                  lambda: Separate("gelu_tanh")], ids=["fused", "glu", "gemma"])
def test_each_gated_forward_alone_is_exact(make, mode):
    torch.manual_seed(0)
    model = Block(make())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = grads(model, data())
    model.load_state_dict(state)
    model.zero_grad()
    names = []
    got = grads(model, data(), lambda m: names.extend(patch_activations(
        m, mlp=mode, dropout="stored", gelu_bits=None, attention="stored", rmsnorm="stored",
        lm_loss="stored")))
    assert names == ["mlp"]
    assert_same(got, want)


def test_the_gated_mlps_gelu_is_not_the_gelu_parts():
    model = Block(Separate("gelu_tanh"))
    names = patch_activations(model, mlp="recompute", attention="stored", lm_loss="stored")
    assert names == ["mlp"] and type(model.mlp.nl) is nn.GELU
    unpatch_activations(model)
    names = patch_activations(model, mlp="stored", attention="stored", lm_loss="stored")
    assert names == ["mlp.nl"]


def test_a_dropout_turned_on_after_patching_runs_the_modules_own_forward():
    torch.manual_seed(0)
    model = Block(Fused())
    patch_activations(model, mlp="input", dropout="stored", gelu_bits=None, attention="stored",
                      lm_loss="stored")
    model.mlp.p.p = 0.5
    x = data()
    torch.manual_seed(5)
    got = model(x)
    torch.manual_seed(5)
    want = x + type(model.mlp).forward(model.mlp, x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("offset", [False, True])
def test_an_rmsnorm_is_found_by_what_it_computes(offset):
    assert act.rms_norm_form(Norm(offset)) == ("gemma" if offset else "llama")
    assert act.rms_norm_form(T5Like()) == "t5"
    assert act.rms_norm_form(nn.LayerNorm(H)) is None


@pytest.mark.parametrize("offset", [False, True])
def test_a_sharded_rmsnorms_form_is_found_from_its_computation_not_its_weight(offset):
    """FSDP1 (use_orig_params) leaves a rank an empty view of a weight outside forward: the form
    is found all the same (an empty probe would have called every norm Llama's)."""
    import transformers as tf

    norm = (tf.models.gemma.modeling_gemma.GemmaRMSNorm if offset else
            tf.models.llama.modeling_llama.LlamaRMSNorm)(H)
    norm.weight = nn.Parameter(torch.empty(0))
    assert act.rms_norm_form(norm) == ("gemma" if offset else "llama")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bf16 input"])
@pytest.mark.parametrize("form", ["llama", "gemma", "t5"])
def test_the_compact_rmsnorm_alone_is_exact_in_every_form(form, dtype):
    """Bit for bit in bfloat16, and with a bfloat16 input under a float32 weight (as autocast
    gives a QK-norm), where a fused backward rounds otherwise."""
    torch.manual_seed(0)
    norm = T5Like() if form == "t5" else Norm(form == "gemma")
    if dtype == "bf16 input":  # the norm's output dtype differs by form: nothing after it
        model, dtype = Block(nn.Identity(), norm), torch.bfloat16
    else:
        model = Block(Fused(), norm).to(dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = data().to(dtype)
    want = grads(model, x)
    model.load_state_dict(state)
    model.zero_grad()
    got = grads(model, x, lambda m: patch_activations(
        m, rmsnorm="compact", mlp="stored", dropout="stored", gelu_bits=None, attention="stored",
        lm_loss="stored"))
    if dtype == torch.float32:
        assert_same(got, want)
    elif form == "t5":  # T5's reads its input twice: its two gradients are summed before the
        # residual's is added, not after: one more bfloat16 rounding (2^-8) of a partial sum,
        # which may be as large as the terms (twice the total, say)
        assert all(torch.equal(got[n], want[n]) for n in want if n != "x")
        assert (got["x"] - want["x"]).float().norm() < 2 ** -7 * want["x"].float().norm()
    else:  # the same ops in the same order, on bfloat16: bit for bit
        assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("offset", [False, True])
def test_the_coded_rmsnorm_decodes_by_its_scale(offset):
    """Coded at 8 bits, the norm's gradients are within the code's rounding of the exact ones
    (a decode by ``w`` where the form is ``1 + w`` would be off by far more)."""
    torch.manual_seed(0)
    model = Block(nn.Linear(H, H), Norm(offset))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = grads(model, data())
    model.load_state_dict(state)
    model.zero_grad()
    got = grads(model, data(), lambda m: patch_activations(m, rmsnorm="coded", code_bits=8,
                                                           attention="stored", lm_loss="stored"))
    for n in ("norm.scale", "x"):
        assert (got[n] - want[n]).norm() < 0.02 * want[n].norm(), n


@pytest.mark.parametrize("name", ["gemma2", "phi3", "modernbert"])
def test_lora_on_a_fused_or_gelu_gated_mlp_keeps_its_input_exactly(name):
    """LoRA on the gate and up projections (their base frozen): ``mlp="auto"`` keeps the MLP's
    input and makes both again in backward, bit for bit the unpatched model's gradients."""
    targets = {"gemma2": ["gate_proj", "up_proj"], "phi3": ["gate_up_proj"],
               "modernbert": ["Wi"]}[name]

    def build():
        model = get_peft_model(fam.build(name), LoraConfig(r=4, target_modules=targets,
                                                           init_lora_weights=False))
        return model

    def lora_grads(model):
        batch = fam.make_batch(name, model)
        model(**batch).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want = lora_grads(build())
    model = build()
    patch_activations(model, mlp="auto", gelu_bits=None, attention="stored", lm_loss="stored")
    mlps = [m for m in model.modules() if act.is_gated_mlp(m)]
    assert mlps and all(act.keeps_input(m) for m in mlps)
    assert_same(lora_grads(model), want)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "modernbert"])
def test_the_families_parts_by_operation_apply_and_unpatch(name):
    model = fam.build(name)
    batch = fam.make_batch(name, model)
    want = model(**batch).loss
    names = patch_activations(model, preset="lean")
    assert len([n for n in names if act.is_gated_mlp(model.get_submodule(n))]) == 2
    if name != "modernbert":  # LayerNorms there
        assert any(act.is_rms_norm(model.get_submodule(n)) for n in names)
    unpatch_activations(model)
    assert not [n for n, m in model.named_modules() if any(k.startswith("_sketchprop")
                                                           for k in m.__dict__)]
    assert torch.equal(model(**batch).loss, want)


def test_gelu_derivatives_are_pytorchs():
    """The gates' backward functions are autograd's derivative of their forward."""
    z = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1000, dtype=torch.float64)
    for f, df in act.GATES.values():
        (want,) = torch.autograd.grad(f(z), z, dy)
        torch.testing.assert_close(df(dy, z.detach()), want)
    assert not torch.equal(act.GATES["gelu"][1](dy, z.detach()),
                           act.GATES["gelu_tanh"][1](dy, z.detach()))


# ---------------------------------------------------------------------------------------------
# Linear layers by what they compute.


class Clipped(nn.Linear):
    """An nn.Linear subclass whose forward is not the linear map."""

    def forward(self, x):
        return super().forward(x).clamp(min=0)


def tiny_falcon():
    import transformers as tf

    torch.manual_seed(0)
    return tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=False, pad_token_id=0, bias=True))


def test_falcons_linear_subclass_is_patched_exactly_and_put_back():
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def falcon_grads(model):
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want = falcon_grads(tiny_falcon())
    model = tiny_falcon()
    names = patch_linear(model, sketch="exact")
    assert len(names) == 8  # the query_key_value, dense and both MLP layers of each block
    assert_same(falcon_grads(model), want)
    unpatch_linear(model)
    assert {type(model.get_submodule(n)).__name__ for n in names} == {"FalconLinear"}


def test_a_linear_subclass_that_computes_something_else_is_left_and_named(caplog):
    model = nn.Sequential(nn.Linear(H, H), Clipped(H, H))
    mha = nn.MultiheadAttention(H, 4)
    with caplog.at_level("INFO", logger="sketchprop.patching"):
        assert patch_linear(model, sketch="exact") == ["0"]
    assert "left 1 (Clipped" in caplog.text
    with pytest.raises(ValueError, match="MultiheadAttention|NonDynamicallyQuantizableLinear"):
        patch_linear(nn.Sequential(mha), sketch="exact")


# ---------------------------------------------------------------------------------------------
# Experts held as stacked parameters.


class Bank(nn.Module):
    """Experts under names no model uses: a per-expert bias, the tokens gathered by a mask."""

    def __init__(self, experts=4):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, 2 * FF, H) / H ** 0.5)
        self.b_in = nn.Parameter(torch.randn(experts, 2 * FF) * 0.1)
        self.w_out = nn.Parameter(torch.randn(experts, H, FF) / FF ** 0.5)
        self.nl = nn.SiLU()

    def forward(self, x, choice, weight):
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            rows, slot = torch.where(choice == e)
            a, b = F.linear(x[rows], self.w_in[e], self.b_in[e]).chunk(2, dim=-1)
            y = F.linear(self.nl(a) * b, self.w_out[e]) * weight[rows, slot, None]
            out = out.index_add(0, rows, y.to(out.dtype))
        return out


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, 4, bias=False)
        self.bank = Bank()

    def forward(self, x):
        x = x.reshape(-1, H)
        weight, choice = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.bank(x, choice, weight=weight)


def test_experts_are_found_by_what_they_hold():
    assert act.is_experts(Bank())
    assert not act.is_experts(Routed()) and not act.is_experts(nn.Linear(H, H))
    odd = Bank()
    odd.extra = nn.Linear(H, H)  # a child with weights of its own: not a bank of experts
    assert not act.is_experts(odd)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_experts_made_again_are_exact(dtype):
    torch.manual_seed(0)
    model = Routed()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def run(setup=None):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return grads(model, data(), setup)

    want = run()
    model.load_state_dict(state)
    model.zero_grad()
    names = []
    got = run(lambda m: names.extend(patch_activations(m, experts="recompute", mlp="stored",
                                                       attention="stored", lm_loss="stored")))
    assert names == ["bank"]
    assert all(torch.equal(got[n], want[n]) for n in want) and set(got) == set(want)


@pytest.mark.parametrize("width", ["tiny", "wide"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_the_families_experts_made_again_are_exact_and_coded_close(name, width):
    w = {"tiny": fam.TINY, "wide": fam.WIDE}[width]

    def moe_grads(setup=None, checkpointing=False):
        model = fam.build(name, w)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        if setup:
            setup(model)
        model(**fam.make_batch(name, model)).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want = moe_grads()
    for checkpointing in (False, "reentrant", "non-reentrant"):
        got = moe_grads(lambda m: patch_activations(m, experts="recompute", mlp="stored",
                                                    attention="stored", rmsnorm="stored",
                                                    lm_loss="stored"), checkpointing)
        assert_same(got, want)
    coded = moe_grads(lambda m: patch_activations(m, experts="coded", code_bits=8, mlp="stored",
                                                  attention="stored", rmsnorm="stored",
                                                  lm_loss="stored"))
    experts = [n for n in want if ".experts." in n]
    assert experts and set(coded) == set(want)
    for n in experts + [n for n in want if n.endswith("gate.weight")]:
        # 8 bits: 1/255 of a group's range per value, far below a gradient's own size
        assert (coded[n] - want[n]).norm() < 0.05 * want[n].norm(), n


# ---------------------------------------------------------------------------------------------
# Attention: Q, K, V made again through whatever projections make them.


def backward_nodes(t) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    return names


@pytest.mark.parametrize("name", ["distilbert", "gpt2", "t5", "vit", "bert"])
def test_the_exact_recompute_finds_fused_and_renamed_projections(name):
    """DistilBERT's q_lin, GPT-2's fused Conv1D c_attn, T5's q/k/v (with its position bias), ViT's
    and BERT's: the self-attention keeps its block input in place of Q, K, V, exactly."""
    def run(setup=None):
        model = fam.build(name)
        if setup:
            setup(model)
        loss = model(**fam.make_batch(name, model)).loss
        nodes = backward_nodes(loss)
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, nodes

    want, _ = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, nodes = run(lambda m: patch_activations(
            m, attention="recompute", dropout="stored", gelu_bits=None, layernorm="stored",
            mlp="stored", rmsnorm="stored", lm_loss="stored"))
    assert "_ProjectedAttentionBackward" in nodes
    # T5's cross-attention projects the encoder's states, not its input: it keeps Q, K, V
    assert ("_RecomputedAttentionBackward" in nodes) == (name == "t5")
    assert_same(got, want)


@pytest.mark.parametrize("name", ["phi3", "modernbert", "qwen3", "gemma3", "gpt2", "distilbert"])
def test_coded_attention_is_made_from_the_input_code_through_any_layout(name):
    """Fused QKV (Phi-3, ModernBERT, GPT-2), QK-norms (Qwen3, Gemma 3), renamed (DistilBERT):
    under the lean preset every attention block makes Q, K, V again from its input's code, with no
    warning (a block whose Q, K, V it cannot make keeps them, and warns)."""
    model = fam.build(name)
    patch_linear(model, bits=4)
    patch_activations(model, preset="lean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = model(**fam.make_batch(name, model)).loss
    nodes = backward_nodes(loss)
    assert "_ProjectedAttentionBackward" in nodes and "_RecomputedAttentionBackward" not in nodes
    loss.backward()


# ---------------------------------------------------------------------------------------------
# Where the parts step aside: what they cannot make again, they leave to the module's own forward.


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(2.0))

    def forward(self, w):
        return w * self.s


class Dropped(Bank):
    """Experts that drop inside their forward (functional dropout: no module to see)."""

    def forward(self, x, choice, weight):
        return F.dropout(super().forward(x, choice, weight), 0.3, self.training)


@pytest.mark.parametrize("case", ["parametrized", "dropout"])
def test_experts_made_again_see_what_their_forward_sees(case):
    """A parametrization on an expert parameter (as peft's LoRA on experts puts on for its call)
    is computed by the module's own forward, its parameters get their gradients; a dropout inside
    the experts draws in backward the numbers forward drew."""
    torch.manual_seed(0)
    model = Routed()
    if case == "dropout":
        model.bank = Dropped()
    ref = copy.deepcopy(model)
    patch_activations(model, experts="recompute", mlp="stored", attention="stored",
                      lm_loss="stored")
    for m in (model, ref):
        if case == "parametrized":
            parametrize.register_parametrization(m.bank, "w_out", Scale())
    assert_same(grads(model, data()), grads(ref, data()))


def test_experts_returning_several_tensors_are_made_again_and_other_outputs_said():
    class Pair(Bank):
        def forward(self, x, choice, weight):
            return super().forward(x, choice, weight), choice

    class Labelled(Bank):
        def forward(self, x, choice, weight):
            return super().forward(x, choice, weight), "a label"

    torch.manual_seed(0)
    model = Routed()
    model.bank = Pair()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.forward = lambda x, m=m: Routed.forward(m, x)[0]
    patch_activations(model.bank, experts="recompute")
    assert_same(grads(model, data()), grads(ref, data()))
    model.bank = Labelled()
    patch_activations(model.bank, experts="recompute")
    with pytest.raises(TypeError, match="other things than tensors.*experts='stored'"):
        model(data())
    assert not act.is_experts(nn.Conv1d(4, 8, 3, bias=False))  # a 3-D weight, not experts


def test_hooks_on_the_gate_or_down_projection_run_the_modules_own_forward():
    """The parts compute the gate and call the down projection's weight: with a hook on either
    (added after patching), the MLP's own forward runs, hooks and all."""
    torch.manual_seed(0)
    for mode in ("recompute", "input"):
        model = Block(Separate("silu"))
        ref = copy.deepcopy(model)
        patch_activations(model, mlp=mode, attention="stored", lm_loss="stored")
        for m in (model, ref):
            m.mlp.three.register_forward_hook(lambda mod, args, out: out * 2)
            m.mlp.nl.register_forward_hook(lambda mod, args, out: out * 0.5)
        assert_same(grads(model, data()), grads(ref, data()))


def test_a_dropout_of_the_mlps_own_in_training_is_not_a_gated_mlp():
    class Drops(Separate):
        def forward(self, x):
            return self.three(F.dropout(self.one(x) * self.nl(self.two(x)), 0.1, self.training))

    assert act.gated_layout(Drops("silu")) is None


class WithAdapter(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o)
        self.a = nn.Parameter(torch.zeros(o, i))  # zero at first: the same map, until trained

    def forward(self, x):
        return super().forward(x) + F.linear(x, self.a)


class DropConnect(nn.Linear):
    def forward(self, x):
        return F.linear(x, F.dropout(self.weight, 0.5, self.training), self.bias)


def test_linear_subclasses_holding_or_doing_more_are_left():
    """A subclass with a parameter of its own, one whose weight drops out in training (patched in
    eval mode, as from_pretrained returns models) and a weight-normed layer: each left as it is,
    its parameters kept."""
    from torch.nn.utils.parametrizations import weight_norm

    for layer in (WithAdapter(H, H), DropConnect(H, H).eval(), weight_norm(nn.Linear(H, H))):
        model = nn.Sequential(layer, nn.Linear(H, H))
        keys = set(model.state_dict())
        assert patch_linear(model, sketch="exact") == ["1"]
        assert set(model.state_dict()) == keys and model[0] is layer


class Plain(nn.Module):
    """A plain MLP under names no model uses."""

    def __init__(self, gate="relu"):
        super().__init__()
        self.wide, self.narrow = nn.Linear(H, FF), nn.Linear(FF, H)
        self.nl = activation(gate)

    def forward(self, x):
        return self.narrow(self.nl(self.wide(x)))


@pytest.mark.parametrize("gate", ["relu", "gelu", "silu", "gelu_new"])
def test_a_plain_mlp_is_made_again_from_its_input_under_input_and_coded_only(gate):
    torch.manual_seed(0)
    model = Block(Plain(gate))
    assert act.is_plain_mlp(model.mlp) and not act.is_gated_mlp(model.mlp)
    ref = copy.deepcopy(model)
    names = patch_activations(model, mlp="input", dropout="stored", gelu_bits=None,
                              attention="stored", lm_loss="stored")
    assert names == ["mlp"]
    assert_same(grads(model, data()), grads(ref, data()))
    unpatch_activations(model)
    if gate == "gelu":  # left to the GELU part where the MLP part does not make it again
        assert patch_activations(Block(Plain(gate)), attention="stored",
                                 lm_loss="stored") == ["mlp.nl"]


def test_gpt2s_gelu_new_is_told_from_the_tanh_gelu_and_made_again_exactly():
    import transformers as tf

    assert act.gate_of(tf.activations.NewGELUActivation()) == "gelu_new"
    assert act.gate_of(nn.GELU("tanh")) == "gelu_tanh"


@pytest.mark.parametrize("width", ["tiny", "wide"])
def test_an_attention_of_its_own_is_made_again_whole_from_its_input_code(width):
    """DeBERTa's disentangled attention calls no attention interface: under attention="coded"
    the whole block runs again in backward from its input's code (at 8 bits, within the code's
    rounding of the exact gradients), and an explicit attention="coded" no longer refuses."""
    w = {"tiny": fam.TINY, "wide": fam.WIDE}[width]

    def run(setup=None):
        model = fam.build("deberta-v2", w)
        if setup:
            setup(model)
        loss = model(**fam.make_batch("deberta-v2", model)).loss
        nodes = backward_nodes(loss)
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, nodes

    want, _ = run()
    got, nodes = run(lambda m: patch_activations(m, attention="coded", code_bits=8,
                                                 dropout="stored", gelu_bits=None,
                                                 layernorm="stored"))
    assert "_FromInputBackward" in nodes and set(got) == set(want)
    num = torch.stack([(got[n] - want[n]).norm() ** 2 for n in want]).sum()
    den = torch.stack([want[n].norm() ** 2 for n in want]).sum()
    assert num < 1e-3 * den  # 8 bits: 1/255 of a group's range per value
    with pytest.raises(ValueError, match="does not call its attention"):
        patch_activations(fam.build("deberta-v2"), attention="recompute")


EXACT_ATTENTION = dict(dropout="stored", gelu_bits=None, layernorm="stored", mlp="stored",
                       rmsnorm="stored", lm_loss="stored")


def family_grads(model, batch):
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_layout_that_candidates_match_alike_is_not_kept():
    """Qwen3's q_norm and k_norm are equal at initialisation: K matches with either, so the layout
    is found again on the next call, and once they differ, each has its own."""
    model = fam.build("qwen3")
    batch = fam.make_batch("qwen3", model)
    patch_activations(model, attention="coded", **EXACT_ATTENTION)
    attn = model.model.layers[0].self_attn
    family_grads(model, batch)
    assert attn.__dict__.get(act.attention._CHECKED) is None
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.uniform_(0, 2)
    family_grads(model, batch)
    assert attn.__dict__[act.attention._CHECKED][1] == ("q_norm", "k_norm")


def test_tied_q_and_k_at_first_then_apart_stay_exact():
    """GPT-2 with K's columns of c_attn equal to Q's on the first call (a tied initialisation):
    K is not read from Q's columns after they part."""
    ref = fam.build("gpt2")
    batch = fam.make_batch("gpt2", ref)
    untied = copy.deepcopy(ref.state_dict())
    with torch.no_grad():
        for block in ref.transformer.h:
            block.attn.c_attn.weight[:, 64:128] = block.attn.c_attn.weight[:, :64]
            block.attn.c_attn.bias[64:128] = block.attn.c_attn.bias[:64]
    model = copy.deepcopy(ref)
    patch_activations(model, attention="recompute", **EXACT_ATTENTION)
    family_grads(model, batch)
    ref.load_state_dict(untied)
    model.load_state_dict(untied)
    assert_same(family_grads(model, batch), family_grads(ref, batch))


def test_q_k_v_that_stop_being_the_inputs_projections_are_found_again_or_kept():
    """A block that scales its input by a learned factor (1 on the first call, 2 after), and a
    hook on a QK-norm added after the first call: the next call's Q, K, V are not the layout's,
    so the block keeps them (with a warning); its gradients stay the unpatched model's."""
    from transformers.models.distilbert import modeling_distilbert as md

    class Scaled(md.DistilBertSelfAttention):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            hidden_states = hidden_states * self.alpha
            shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
            q, k, v = (lin(hidden_states).view(shape).transpose(1, 2)
                       for lin in (self.q_lin, self.k_lin, self.v_lin))
            fn = md.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          md.eager_attention_forward)
            out, w = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                        **kwargs)
            return self.out_lin(out.reshape(*hidden_states.shape[:-1], -1)), w

    ref = fam.build("distilbert")
    batch = fam.make_batch("distilbert", ref)
    for m in ref.modules():
        if type(m) is md.DistilBertSelfAttention:
            m.__class__, m.alpha = Scaled, nn.Parameter(torch.ones(()))
    model = copy.deepcopy(ref)
    patch_activations(model, attention="recompute", **EXACT_ATTENTION)
    family_grads(model, batch)
    for m in (ref, model):
        for layer in m.distilbert.transformer.layer:
            layer.attention.alpha.data.fill_(2.0)
    with pytest.warns(UserWarning, match="keeps Q, K and V"):
        got = family_grads(model, batch)
    assert_same(got, family_grads(ref, batch))

    ref = fam.build("qwen3")
    batch = fam.make_batch("qwen3", ref)
    model = copy.deepcopy(ref)
    patch_activations(model, attention="coded", **EXACT_ATTENTION)
    family_grads(model, batch)
    for m in (ref, model):
        for layer in m.model.layers:
            layer.self_attn.q_norm.register_forward_hook(lambda mod, args, out: out * 2.0)
    with pytest.warns(UserWarning, match="keeps Q, K and V"):
        got = family_grads(model, batch)
    assert_same(got, family_grads(ref, batch))


def test_an_output_projection_wider_than_the_input_is_not_a_candidate():
    """Heads of 32 over a hidden 64 (Qwen3-30B-A3B's layout, 4096 head columns over 2048): the
    output projection reads 128 columns, not the block's input; Q, K, V are still found."""
    model = fam.build("qwen3", head_dim=32)
    assert model.model.layers[0].self_attn.o_proj.in_features != model.config.hidden_size
    patch_activations(model, preset="lean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = model(**fam.make_batch("qwen3", model)).loss
    assert "_ProjectedAttentionBackward" in backward_nodes(loss)
