"""The generic floor (`patch_activations(model, floor_bits=b)`): what no part handles, as one b-bit
code per saved storage. Unbiased; parameters, buffers, small and non-finite tensors and custom
Functions' saves kept as they are; bool masks at one bit; one code for a storage saved twice;
counted by an outer meter; an in-place change raises; off in eval mode, after unpatching and
under torch.compile; on a model with no transformer in it, and under checkpointing, autocast and
gradient accumulation."""

import copy
import threading
import warnings

import pytest
import torch
from test_activation_settings import in_two_threads
from torch import nn
from torch.utils.checkpoint import checkpoint

from sketchprop import patch_activations, unpatch_activations
from sketchprop.activations import floor as fl
from sketchprop.measure import SavedTensorMeter

pytestmark = pytest.mark.usefixtures("one_thread")

# Every other part off: the floor alone.
ALONE = dict(dropout="stored", attention="stored", gelu_bits=None, layernorm="stored",
             mlp="stored", rmsnorm="stored", lm_loss="stored")


def floor_only(model, bits=4, **kwargs):
    patch_activations(model, **ALONE, floor_bits=bits, **kwargs)
    return model


class ConvNet(nn.Module):
    """A small conv net: no transformer, no part of the library applies but the floor."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.SiLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(32, 32, 3, padding=1), nn.GELU())
        self.head = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def conv_batch(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def conv_grads(model, x, y):
    model.zero_grad()
    with SavedTensorMeter(model) as meter:
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return meter.bytes, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_model_with_no_transformer_keeps_a_fifth_and_every_gradient():
    torch.manual_seed(0)
    exact_model = ConvNet()
    model = floor_only(copy.deepcopy(exact_model))
    x, y = conv_batch()
    exact_bytes, want = conv_grads(exact_model, x, y)
    coded_bytes, got = conv_grads(model, x, y)
    assert coded_bytes <= 0.20 * exact_bytes, coded_bytes / exact_bytes
    assert set(got) == set(want)
    err = sum((got[n] - want[n]).square().sum() for n in want) / sum(
        g.square().sum() for g in want.values())
    assert 0 < err < 0.05, err  # coded, and close: 4-bit codes of every activation


def test_parameters_are_kept_and_activations_coded_unbiased():
    """``y = x W^T``: dX reads W, a parameter, kept exactly; dW reads x, coded, unbiased: the
    mean of n draws is within its standard error of the exact gradient (z-scores of every
    element; the largest of 256 below the two-sided 1e-4 Bonferroni bound)."""
    layer = nn.Linear(128, 2)
    model = floor_only(nn.Sequential(layer))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 128, generator=g) * torch.linspace(0.1, 3, 128)).requires_grad_(True)
    dy = torch.randn(64, 2, generator=g)
    want = torch.autograd.grad(nn.functional.linear(x, layer.weight, layer.bias), (x, layer.weight),
                               dy)
    draws = []
    for seed in range(400):
        torch.manual_seed(seed)  # the floor's stream follows the run seed
        dx, dw = torch.autograd.grad(model(x), (x, layer.weight), dy)
        assert torch.equal(dx, want[0])
        draws.append(dw)
    draws = torch.stack(draws).double()
    assert (draws[0] != want[1]).any()
    z = (draws.mean(0) - want[1]) / (draws.std(0) / len(draws) ** 0.5)
    assert z.abs().max() < 4.9, z.abs().max()  # Phi^-1(1 - 1e-4 / 512)


class Save(torch.autograd.Function):
    """``2 x``, saving ``x``: a custom Function's save, which the floor keeps as it is."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 + 0 * x


def test_what_is_kept_as_it_is_and_what_is_coded():
    """Small tensors, non-finite ones, integer ones, custom Functions' saves and buffers pass
    through; a storage saved by two backward functions is one code; a bool mask is one bit a
    value."""
    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(64, 128) + 0.5)

        def forward(self, x, small, mask):
            h = x.exp()  # saves its output h: 8192 floats, coded
            a = h.sin() + h.cos()  # both save h: the same code
            b = Save.apply(x.tanh())  # a custom Function's save: as it is
            c = (x * self.scale).sum()  # saves the buffer (as it is) and x (coded)
            d = small.exp().sum()  # 16 values: as they are
            e = torch.where(mask, x, 0.0).pow(2).sum()  # the bool mask: one bit a value
            return a.sum() + b.sum() + c + d + e

    model = floor_only(Probe())
    x = torch.randn(64, 128, requires_grad=True)
    small = torch.randn(16, requires_grad=True)
    mask = torch.rand(64, 128) > 0.5
    with SavedTensorMeter() as meter:  # outside the model: it counts what the floor keeps
        model(x, small, mask)
    sizes = sorted(n for n, _ in meter.records)
    code = 8192 // 2 + 8192 // 64 * 4  # 4-bit codes and a bfloat16 pair per group of 64
    assert sizes.count(code) == 3, sizes  # h (once for three saves), x, where()'s output
    assert 8192 // 8 in sizes  # the mask
    assert sizes.count(8192 * 4) == 2  # the buffer and the custom Function's save
    assert 16 * 4 in sizes  # small


def test_what_a_part_offers_is_coded_and_only_under_a_floor():
    """A custom Function's saves that it hands to the floor (``offer``) are coded; without a
    floor open, offering does nothing. The attention that keeps Q, K and V (DistilBERT's, whose
    query projection a hook feeds another input, so that they cannot be made again) offers them:
    under lean with the floor none of them is kept in full, without the floor all six (two
    layers) are."""
    class Offered(Save):
        @staticmethod
        def forward(ctx, x):
            fl.offer(x)
            return Save.forward(ctx, x)

    class Probe(nn.Module):
        def forward(self, x):
            return Offered.apply(x).sum()

    code = 8192 // 2 + 8192 // 64 * 4
    for floored, size in ((True, code), (False, 8192 * 4)):
        model = floor_only(Probe()) if floored else Probe()
        with SavedTensorMeter() as meter:
            model(torch.randn(64, 128, requires_grad=True)).backward()
        assert [n for n, _ in meter.records] == [size]

    from sketchprop import patch_linear
    from sketchprop.bench import families as fam

    full = 4 * 48 * 64 * 4  # one of Q, K, V in float32: batch x tokens x hidden
    counts = {}
    for floor_bits in (None, 4):
        model = fam.build("distilbert")
        patch_linear(model, bits=4)
        for layer in model.distilbert.transformer.layer:
            layer.attention.q_lin.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        patch_activations(model, preset="lean", floor_bits=floor_bits)
        batch = fam.make_batch("distilbert", model)
        with SavedTensorMeter(model) as meter, pytest.warns(UserWarning, match="keeps Q, K"):
            loss = model(**batch).loss
        loss.backward()
        counts[floor_bits] = sum(n == full for n, _ in meter.records)
    assert counts == {None: 6, 4: 0}, counts


def test_the_recomputed_attention_keeps_its_block_input_once():
    """``attention="recompute"`` makes Q, K and V again from its block input; under the floor
    it hands that input to it, so that the one code the projections' saves have serves it too
    (it kept the input in full besides, one per layer, and its gradient error stays a code's)."""
    from sketchprop.bench import families as fam

    full = 4 * 48 * 64 * 4  # the block input in float32: batch x tokens x hidden
    exact = fam.build("bert")
    batch = fam.make_batch("bert", exact)
    exact(**batch).loss.backward()
    model = fam.build("bert")
    patch_activations(model, **{**ALONE, "attention": "recompute"}, floor_bits=4)
    with SavedTensorMeter(model) as meter:
        loss = model(**batch).loss
    loss.backward()
    assert sum(n == full for n, _ in meter.records) == 0
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), exact.parameters(), strict=True)
             if q.grad is not None]
    err = sum((g - w).square().sum() for g, w in pairs) / sum(w.square().sum() for _, w in pairs)
    assert 0 < err < 0.05, err  # every parameter together: 4-bit codes


class _Relu(nn.Module):
    """``nn.Linear(64, 128)`` then a ReLU as ``how`` applies it, then a kept weight."""

    def __init__(self, how):
        super().__init__()
        self.how, self.a = how, nn.Linear(64, 128)
        self.register_buffer("w", torch.randn(128, 8))

    def forward(self, x):
        h = self.a(x)
        if self.how == "module":
            h = nn.functional.relu(h)
        elif self.how == "view in place":  # its node: the view's, over CopySlices
            nn.functional.relu(h.view(-1, 2, 64), inplace=True)
        else:  # "slice in place": half the storage, the other half negative or positive
            h[:, :64].relu_()
        return h @ self.w


@pytest.mark.parametrize("how", ["module", "view in place", "slice in place"])
def test_a_relu_keeps_its_mask_exactly(how):
    """A ReLU's backward passes the gradient where its output is positive. The floor keeps which
    values are (a bit each, counted), so the input's gradient, which reads only that mask and
    kept weights, is the exact one: without the bit, small positive values rounded to 0 lost
    their gradient (a bias towards 0). In place on a view too; in place on part of a storage
    with negative values elsewhere, that storage is kept as it is."""
    torch.manual_seed(0)
    net = _Relu(how)
    model = floor_only(copy.deepcopy(net), bits=2)
    x = torch.randn(256, 64, requires_grad=True)
    (want,) = torch.autograd.grad(net(x).sum(), x)
    with SavedTensorMeter() as meter:
        out = model(x)
    (got,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    relu = 256 * 128
    sizes = [n for n, _ in meter.records]
    if how == "slice in place":
        assert relu * 4 in sizes
    else:
        assert relu // 4 + relu // 64 * 4 + relu // 8 in sizes  # 2-bit codes, ends, the bits


def test_a_floor_inside_a_floored_model_leaves_its_saves_to_the_outer_one():
    """A floored block called in a floored model's forward: the outer floor codes, once, and a
    custom Function's save inside the block is kept as it is (the inner hooks made the outer
    ones see them, not Function.apply, and code it)."""
    class Inner(nn.Module):
        def forward(self, x):
            return Save.apply(x.exp())

    model = floor_only(nn.Sequential(nn.Linear(128, 128), floor_only(Inner(), bits=8)))
    with SavedTensorMeter() as meter:
        model(torch.randn(64, 128)).sum().backward()
    sizes = sorted(n for n, _ in meter.records)
    code4 = 8192 // 2 + 8192 // 64 * 4
    # the Linear's input and exp's output, coded at the outer floor's 4 bits; Save's, as it is
    assert sizes == sorted([code4, code4, 8192 * 4]), sizes

    class Scaled(nn.Module):  # a buffer that mul saves for x's gradient
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.randn(64, 128))

        def forward(self, x):
            return x * self.scale

    class Outer(nn.Module):  # calls a floored model that is not its submodule
        def __init__(self, inner):
            super().__init__()
            self.a, self.inner = nn.Linear(128, 128), [inner]

        def forward(self, x):
            return self.inner[0](self.a(x)).sum()

    outer = floor_only(Outer(floor_only(Scaled())))
    with SavedTensorMeter() as meter:
        outer(torch.randn(64, 128)).backward()
    assert 8192 * 4 in [n for n, _ in meter.records]  # the inner model's buffer, as it is


@pytest.mark.stack("threads", "floor")
def test_two_threads_on_one_floored_model():
    """Two threads in one floored model's forward at once (a barrier inside it): each thread's
    hooks are its own (autograd's and the floor's are per thread), so each gets its own batch's
    gradients, close to exact, and its saves are coded."""
    torch.manual_seed(0)
    exact_model = ConvNet()
    model = floor_only(copy.deepcopy(exact_model))
    batches = [conv_batch(8), conv_batch(6)]
    want = [conv_grads(exact_model, x, y) for x, y in batches]
    barrier = threading.Barrier(2)

    def meet(*_):
        barrier.wait(timeout=20)

    model.body[3].register_forward_pre_hook(meet)
    params = dict(model.named_parameters())

    def work(i):
        x, y = batches[i]
        with SavedTensorMeter(model) as meter:
            loss = nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        return meter.bytes, dict(zip(params, grads, strict=True))

    results = in_two_threads(work, barrier)
    for (coded, got), (exact_bytes, ref) in zip(results, want, strict=True):
        assert coded <= 0.20 * exact_bytes
        err = sum((got[n] - ref[n]).square().sum() for n in ref) / sum(
            g.square().sum() for g in ref.values())
        assert 0 < err < 0.05, err


def test_a_compile_in_another_thread_leaves_the_floor_on(monkeypatch):
    """``torch.compiler.is_compiling()`` is process-wide: a compile in another thread set it, and
    the floor turned itself off (and warned) in this one."""
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what that compile sets
    model = floor_only(nn.Sequential(nn.Linear(128, 128), nn.Tanh()))
    with SavedTensorMeter() as meter, warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(64, 128)).sum().backward()
    assert max(n for n, _ in meter.records) < 8192 * 4  # coded


def test_a_save_after_an_in_place_change_is_coded_anew():
    """A storage saved, changed in place, then saved again: the second save codes the new values
    (reusing the first code gave half the true gradient, silently)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(128, 128)

        def forward(self, x):
            h = self.lin(x)
            h.view(-1).sin()  # saves h, unused
            h.mul_(2)
            return h.square().sum()

    torch.manual_seed(0)
    plain = Net()
    floored = floor_only(copy.deepcopy(plain), bits=8)
    x = torch.randn(64, 128)
    plain(x).backward()
    floored(x).backward()
    g, ref = floored.lin.weight.grad, plain.lin.weight.grad
    assert ((g - ref).pow(2).sum() / ref.pow(2).sum()) < 1e-3


def test_a_non_finite_activation_is_kept_and_its_gradient_exact():
    x = torch.randn(64, 128)
    x[3, 5] = float("inf")
    x.requires_grad_(True)
    model = floor_only(nn.Sequential(nn.Softplus()))
    (got,) = torch.autograd.grad(model(x).sum(), x)
    (want,) = torch.autograd.grad(nn.functional.softplus(x).sum(), x)
    assert torch.equal(got, want)


def test_an_in_place_change_after_saving_raises():
    model = floor_only(nn.Sequential(nn.Linear(128, 128), nn.Sigmoid()))
    x = torch.randn(64, 128)
    h = model[0](x)  # outside the model: no floor
    out = model(x)  # sigmoid saves its output, coded
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    assert h.requires_grad


def test_off_in_eval_mode_without_grad_and_after_unpatching():
    torch.manual_seed(0)
    exact_model = ConvNet()
    model = floor_only(copy.deepcopy(exact_model))
    x, y = conv_batch()
    _, want = conv_grads(exact_model.eval(), x, y)
    _, got = conv_grads(model.eval(), x, y)
    assert all(torch.equal(got[n], want[n]) for n in want)
    with torch.no_grad():
        model.train()(x)
    assert not fl._stack()  # every context closed
    unpatch_activations(model)
    _, want = conv_grads(exact_model.train(), x, y)
    _, got = conv_grads(model, x, y)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_an_exception_in_forward_closes_the_hooks():
    class Boom(nn.Module):
        def forward(self, x):
            x.exp()
            raise KeyError("boom")

    model = floor_only(Boom())
    with pytest.raises(KeyError):
        model(torch.randn(64, 128, requires_grad=True))
    assert not fl._stack()
    y = torch.randn(64, 128, requires_grad=True)
    with SavedTensorMeter() as meter:
        y.exp()
    assert meter.bytes == 64 * 128 * 4  # no floor outside the model


@pytest.mark.parametrize("reentrant", [
    pytest.param(False, marks=pytest.mark.stack("ckpt-nonreentrant", "floor")),
    pytest.param(True, marks=pytest.mark.stack("ckpt-reentrant", "floor"))])
@pytest.mark.stack("grad-accum", "floor")
def test_under_checkpointing_and_gradient_accumulation(reentrant):
    """A checkpointed block is recomputed in backward from its input: the reentrant checkpoint
    keeps it as a custom Function's save, as it is; the non-reentrant one saves it as autograd
    saves, and the floor codes it (its own hooks take the block's saves). What the rest saves is
    coded. Two forwards before one backward accumulate. Every gradient is there, close to exact
    (the squared error a few percent of the squared norm at most: 4-bit codes)."""
    torch.manual_seed(0)

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(128, 256), nn.Linear(256, 128)

        def forward(self, x):
            h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=reentrant)
            return self.b(h).square().mean()

    exact_model = Blocks()
    model = floor_only(copy.deepcopy(exact_model))
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(64, 128, generator=g, requires_grad=True) for _ in range(2)]
    exact_model(xs[0]).backward()
    with SavedTensorMeter() as meter:
        loss = model(xs[0])
    loss.backward()
    exact_model.zero_grad()
    model.zero_grad()
    # the block input, 64 x 128 floats: as it is with the reentrant checkpoint only
    assert (64 * 128 * 4 in [n for n, _ in meter.records]) == reentrant
    for m in (exact_model, model):
        sum(m(x) for x in xs).backward()
    for p, q in zip(model.parameters(), exact_model.parameters(), strict=True):
        assert 0 < (p.grad - q.grad).square().sum() / q.grad.square().sum() < 0.05


@pytest.mark.stack("autocast-bf16", "floor")
def test_autocast_codes_activations_not_frozen_weight_casts():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64))
    base[0].weight.requires_grad_(False)
    model = floor_only(base)
    x = torch.randn(64, 128, requires_grad=True)
    with SavedTensorMeter(model) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()
    sizes = [n for n, _ in meter.records]
    assert 128 * 128 * 2 in sizes  # the frozen weight's bfloat16 cast, as it is
    assert x.grad is not None and base[2].weight.grad is not None


def test_compiled_the_floor_is_off_and_says_so_once():
    torch.manual_seed(0)
    model = floor_only(nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8)))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(64, 128)
    with pytest.warns(UserWarning, match="activation floor is off under torch.compile"):
        compiled(x).sum().backward()
    assert model[0].weight.grad is not None


def test_bad_floor_bits_change_nothing():
    model = ConvNet()
    for bad in (3, True, "4"):
        with pytest.raises(ValueError, match="floor_bits must be one of"):
            patch_activations(model, **ALONE, floor_bits=bad)
    assert not hasattr(model, "_sketchprop_activations") and not model._forward_pre_hooks


@pytest.mark.stack("peft-lora", "floor")
def test_peft_lora_base_weights_kept_and_adapters_trained():
    """Under peft LoRA the frozen base weights are parameters, kept as they are; what the
    adapters' gradients read is coded: a fraction of the bytes, the gradients close."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    base = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, num_labels=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    exact = get_peft_model(base, LoraConfig(r=4, target_modules=["query", "value"]))
    model = floor_only(copy.deepcopy(exact))
    ids = torch.randint(3, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    saved, grads = {}, {}
    for name, m in (("exact", exact), ("floor", model)):
        with SavedTensorMeter(m) as meter:
            loss = m(input_ids=ids, labels=torch.tensor([0, 1, 0, 1])).loss
        loss.backward()
        saved[name] = meter.bytes
        grads[name] = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert saved["floor"] <= 0.25 * saved["exact"], saved
    assert all(g is not None for g in grads["floor"].values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    err = sum((grads["floor"][n] - g).square().sum() for n, g in grads["exact"].items())
    assert 0 < err / sum(g.square().sum() for g in grads["exact"].values()) < 0.05


@pytest.mark.stack("save-load", "floor")
def test_a_floored_model_saves_loads_and_trains(tmp_path):
    torch.manual_seed(0)
    exact_model = ConvNet()
    torch.save(floor_only(copy.deepcopy(exact_model)), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    x, y = conv_batch()
    exact_bytes, _ = conv_grads(exact_model, x, y)
    coded_bytes, grads = conv_grads(loaded, x, y)
    assert coded_bytes <= 0.20 * exact_bytes and all(g is not None for g in grads.values())
    unpatch_activations(loaded)
    assert conv_grads(loaded, x, y)[0] == exact_bytes


def test_the_chunked_loss_hands_its_hidden_states_to_the_floor():
    """The chunked loss keeps the final hidden states: under the floor, as its code (one storage
    of hidden size per token kept in full without it, none with it), and without the floor
    exactly the unpatched loss's gradients."""
    from sketchprop.bench import families as fam

    counts = {}
    for floor_bits in (None, 4):
        model = fam.build("llama")
        patch_activations(model, **{**ALONE, "lm_loss": "chunked"}, floor_bits=floor_bits)
        batch = fam.make_batch("llama", model)
        rows = int(batch["labels"][:, 1:].ne(-100).sum())  # the labelled tokens' rows
        with SavedTensorMeter(model) as meter:
            loss = model(**batch).loss
        loss.backward()
        counts[floor_bits] = sum(n == rows * 64 * 4 for n, _ in meter.records)  # float32, hidden 64
    assert counts == {None: 1, 4: 0}, counts
