"""Compact activations outside the setting of one forward per backward, one thread and
non-reentrant checkpointing: reentrant checkpointing, unpatching after a train/eval switch, two
forwards before one backward with skip_padding, two threads on one model, a hook added after the
first call, the global random stream, eval mode with gradients, and attention maps. Each either
gives the gradients of the reference (the unpatched model, or the same model without
checkpointing, given the same masks) or refuses with an error naming the setting."""

import copy
import threading

import pytest
import torch
from test_activations import assert_same_grads, tiny_bert
from test_patching import batch, tiny_roberta
from torch import nn
from torch.utils.checkpoint import checkpoint

from sketchprop import activations as act
from sketchprop import patch_activations, patch_linear, unpatch_activations

pytestmark = pytest.mark.usefixtures("one_thread")


def train_grads(model, b, reentrant=None, seed=3):
    """Logits and parameter gradients of one training step from generator state ``seed``;
    ``reentrant``: None (no checkpointing), True or False (the kind of checkpointing)."""
    model.train()
    model.zero_grad(set_to_none=True)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    torch.manual_seed(seed)
    out = model(**b)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# 1. Reentrant checkpointing: the recomputation makes the masks the first pass made.


def test_reentrant_checkpoint_gelu_then_dropout_keeps_the_mask():
    """The first pass of a reentrant checkpoint runs without gradients (no GELU code is made);
    the recomputation makes one. Were the code's rounding drawn from the stream the dropout seed
    comes from, the recomputed mask would differ from the one the output was made with."""
    x = torch.randn(64, 64)
    gy = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    out = []
    for reentrant in (True, None):
        block = nn.Sequential(act.CompactGELU(), act.SeededDropout(0.5))
        xx = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        y = block(xx) if reentrant is None else checkpoint(block, xx, use_reentrant=True)
        y.backward(gy)
        out.append((y.detach(), xx.grad))
    (y1, g1), (y2, g2) = out
    assert torch.equal(y1, y2)
    assert torch.equal(g1 == 0, y1 == 0)  # dX is dropped where the output was
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("code", ["stochastic", "optimal"])
def test_reentrant_checkpointing_gives_the_gradients_without_checkpointing(code):
    """Every dropout on, the default GELU code: a model checkpointed with use_reentrant=True has
    the gradients of the same model without checkpointing from the same generator state."""
    def build():
        model = tiny_roberta(dropout=0.3)
        patch_activations(model, gelu_code=code)
        return model

    b = batch()
    assert_same_grads(train_grads(build(), b, reentrant=True), train_grads(build(), b))


# ---------------------------------------------------------------------------------------------
# 2. Unpatching restores the train/eval flag the model has then.


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_unpatch_keeps_the_train_eval_mode(mode):
    model = tiny_roberta(dropout=0.1)
    model.train(mode == "eval")  # patched in the other mode
    patch_activations(model)
    model.train(mode == "train")
    unpatch_activations(model)
    assert all(m.training == (mode == "train") for m in model.modules())


# ---------------------------------------------------------------------------------------------
# 3. Two forwards before one backward, skip_padding, checkpointing.


def padded(b=4, length=16, seed=0, shift=0):
    """``batch`` with another padding pattern (``shift`` more padding per row, same shape)."""
    out = batch(b, length, seed)
    for i in range(b):
        n = length - 5 * i - shift * (i > 0)
        out["attention_mask"][i, n:] = 0
        out["input_ids"][i, n:] = 1
    return out


@pytest.mark.stack("ckpt-reentrant", "sketch")
@pytest.mark.stack("ckpt-nonreentrant", "sketch")
@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("reentrant", [None, False, True])
def test_two_forwards_then_one_backward_with_skip_padding(reentrant, activations):
    """A paired loss over two batches of one shape and different padding: at rho 1 the sketch is
    the identity, so the gradients must be the unpatched model's, checkpointed or not. With the
    exact activation parts too: a reentrant checkpoint's first pass (no grad) computes attention
    as its recomputation does, bit for bit, by which the recomputation finds its call."""
    model = tiny_roberta(dropout=0.0)
    ref = copy.deepcopy(model)
    patch_linear(model, "gaussian", rho=1.0, skip_padding=True, min_rows=1)
    if activations:
        patch_activations(model, dropout="seeded", attention="recompute", gelu_bits=None,
                          layernorm="output")
    b1, b2 = padded(seed=0), padded(seed=1, shift=2)
    assert not torch.equal(b1["attention_mask"], b2["attention_mask"])
    got = []
    for m in (model, ref):
        m.train()
        m.zero_grad(set_to_none=True)
        if reentrant is not None:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        (m(**b1).loss + 0.5 * m(**b2).loss).backward()
        got.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name, g in got[1].items():
        torch.testing.assert_close(got[0][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputation_that_cannot_tell_the_calls_apart_raises(reentrant):
    """Same tokens, two paddings: BERT's first layer sees the same input in both calls, so its
    recomputation cannot tell which call's padding rows it needs: an error naming skip_padding,
    never the other call's rows."""
    model = tiny_bert()
    patch_linear(model, "gaussian", rho=1.0, skip_padding=True, min_rows=1)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    b1, b2 = batch(), batch()
    b2["attention_mask"] = torch.ones_like(b2["attention_mask"])
    loss = model(**b1).loss + model(**b2).loss
    with pytest.raises(RuntimeError, match="skip_padding"):
        loss.backward()


# ---------------------------------------------------------------------------------------------
# 4. Two threads on one model.


def in_two_threads(work, barrier: threading.Barrier) -> list:
    """``[work(0), work(1)]``, each in a thread of its own, at once (``barrier`` makes them meet
    inside); an error in one aborts the barrier, so that the other does not wait, and fails."""
    results, errors = [None, None], []

    def worker(i):
        try:
            results[i] = work(i)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("sketch", [
    pytest.param(False, marks=pytest.mark.stack("threads", "compact")),
    pytest.param(True, marks=pytest.mark.stack("threads", "sketch", "compact"))])
def test_two_threads_on_one_model(sketch):
    """Two threads run one model at once, forced to interleave inside every attention call (a
    barrier in the attention function): each gets the gradients it gets alone."""
    model = tiny_roberta(dropout=0.0)
    if sketch:  # padding rows are per call too
        patch_linear(model, "gaussian", rho=1.0, skip_padding=True, min_rows=1)
    patch_activations(model, gelu_bits=None)
    batches = [padded(seed=0), padded(seed=1, shift=2)]
    params = [p for p in model.parameters() if p.requires_grad]

    def run(b):
        model.zero_grad(set_to_none=True)
        return torch.autograd.grad(model(**b).loss, params)

    model.train()
    want = [run(b) for b in batches]
    barrier = threading.Barrier(2)
    real = act.recompute_attention

    def interleaved(*args, **kwargs):
        barrier.wait(timeout=20)
        return real(*args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(act.ATTENTION_NAME, interleaved)
    try:
        results = in_two_threads(lambda i: run(batches[i]), barrier)
    finally:
        act.register_attention()
    for got, ref in zip(results, want, strict=True):
        for g, w in zip(got, ref, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 5. A hook on a projection added after the first call.


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_hook_on_query_added_after_the_first_call(kind):
    """The first call checks that Q, K, V are the projections of the block input; a hook added
    later changes Q: the next call must see it (the gradients stay the unpatched model's)."""
    model = tiny_bert()
    ref = copy.deepcopy(model)
    patch_activations(model, dropout="stored", gelu_bits=None)
    b = batch()
    assert_same_grads(train_grads(model, b), train_grads(ref, b))
    for m in (model, ref):
        query = m.bert.encoder.layer[0].attention.self.query
        if kind == "pre":
            query.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
        else:
            query.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.warns(UserWarning, match="keeps Q, K and V"):
        got = train_grads(model, b)
    assert_same_grads(got, train_grads(ref, b))


def test_hook_on_the_attention_module_changing_its_input():
    """A pre-hook on the self-attention module registered after patching changes the input the
    projections see: Q, K, V are not the projections of what the patch kept."""
    model = tiny_bert()
    ref = copy.deepcopy(model)
    patch_activations(model, dropout="stored", gelu_bits=None)
    b = batch()
    assert_same_grads(train_grads(model, b), train_grads(ref, b))
    for m in (model, ref):
        m.bert.encoder.layer[1].attention.self.register_forward_pre_hook(
            lambda module, args, kwargs: ((args[0] * 3, *args[1:]), kwargs), with_kwargs=True)
    with pytest.warns(UserWarning, match="keeps Q, K and V"):
        got = train_grads(model, b)
    assert_same_grads(got, train_grads(ref, b))


# ---------------------------------------------------------------------------------------------
# 6. The global random stream, eval mode with gradients.


@pytest.mark.parametrize("linear", [False, True])
def test_global_random_stream_consumed_as_by_the_plain_model(linear):
    """Every dropout at 0 (so the plain model draws nothing): after a training step of each, the
    next draws from the global generator are the same (data shuffling comes from it)."""
    model = tiny_roberta(dropout=0.0)
    plain = copy.deepcopy(model)
    if linear:
        patch_linear(model, "blocksrht", rho=0.5)
    patch_activations(model)
    b = batch()
    draws = []
    for m in (model, plain):
        train_grads(m, b, seed=5)
        draws.append(torch.rand(8))
    assert torch.equal(*draws)


def test_global_random_stream_in_eval_mode():
    model = tiny_roberta(dropout=0.1)
    plain = copy.deepcopy(model)
    patch_activations(model)
    b = batch()
    draws = []
    for m in (model, plain):
        m.eval()
        torch.manual_seed(5)
        m(**b).loss.backward()
        draws.append(torch.rand(8))
    assert torch.equal(*draws)


def test_eval_mode_with_gradients_is_exact():
    """Saliency: gradients in eval mode. The GELU is exact there (no code), so two calls agree
    and equal the plain model's gradients."""
    model = tiny_roberta(dropout=0.1)
    plain = copy.deepcopy(model)
    patch_activations(model)
    b = batch()

    def eval_grads(m):
        m.eval()
        m.zero_grad(set_to_none=True)
        out = m(**b)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    first = eval_grads(model)
    assert_same_grads(eval_grads(model), first, rtol=0, atol=0)
    assert_same_grads(first, eval_grads(plain))


# ---------------------------------------------------------------------------------------------
# output_attentions.


@pytest.mark.parametrize("train", [False, True])
def test_output_attentions_returns_the_maps(train):
    """A patched model asked for attention maps returns those of the plain eager model (and its
    gradients stay the plain model's)."""
    model = tiny_roberta(dropout=0.0)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    patch_activations(model, gelu_bits=None)
    b = batch()
    outs = []
    for m in (model, ref):
        m.train(train)
        m.zero_grad(set_to_none=True)
        out = m(**b, output_attentions=True)
        out.loss.backward()
        outs.append((out.attentions, {n: p.grad.clone() for n, p in m.named_parameters()}))
    (got, g1), (want, g2) = outs
    assert len(got) == len(want) == model.config.num_hidden_layers
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
    for name in g2:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-6, msg=name)
