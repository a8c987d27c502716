"""The training stacks users put a patched model into: in more than one process every rank draws
its own random bits (sketches, the GELU code's rounding), whatever ran before the process group
existed; a patched model survives ``torch.save`` and ``save_pretrained``."""

import io
import json
import math
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sketchprop import patch_activations, patch_linear, unpatch_activations, unpatch_linear

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from sketchprop import patch_activations, patch_linear

    rank, port, part, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.manual_seed(0)  # the same weights and input on both ranks
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    if part == "sketch":
        patch_linear(model, sketch="gaussian", rho=0.25, min_rows=1)
    elif part == "bits":
        patch_linear(model, sketch="exact", bits=4)
    elif part == "exact":
        patch_linear(model, sketch="exact")
    else:
        patch_activations(model, gelu_bits=2)
    x = torch.randn(64, 16)
    model(x).square().sum().backward()  # a sanity step before the process group exists
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model.zero_grad()
    model(x).square().sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    both = [torch.empty_like(grads) for _ in range(2)]
    dist.all_gather(both, grads)
    if rank == 0:
        json.dump({"equal": torch.equal(both[0], both[1])}, open(out, "w"))
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.stack("ddp", "sketch", "bits", "compact")
@pytest.mark.parametrize("part, equal", [("sketch", False), ("bits", False), ("gelu", False),
                                         ("exact", True)])
def test_each_rank_draws_its_own_bits_after_a_step_before_the_group(tmp_path, part, equal):
    """Two gloo processes, same weights and input, one step before ``init_process_group``: the
    gradients after it differ between the ranks where bits are drawn (a sketch, the stochastic
    GELU code, the stochastic rounding of b-bit rows) and are equal where none are (the exact
    sketch), so the difference is the bits."""
    port, out = str(_free_port()), tmp_path / "out.json"
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), port, part, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    assert json.loads(out.read_text())["equal"] is equal


# ---------------------------------------------------------------------------------------------
# Saving


def _tiny(arch: str, **config):
    import transformers as tf

    torch.manual_seed(0)
    if arch == "roberta":
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=40, num_labels=2, pad_token_id=1,
            **config))
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **config))
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
        eos_token_id=2, **config))


def _batch(arch: str, length: int = 12) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 6:] = 0
    if arch == "roberta":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 0])}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


PATCHES = {
    "sketch": lambda m: patch_linear(m, sketch="gaussian", rho=0.5, min_rows=1),
    "bits": lambda m: patch_linear(m, sketch="exact", bits=4),
    "sketch, no skip_padding": lambda m: patch_linear(m, sketch="blocksrht", rho=0.5,
                                                      skip_padding=False, min_rows=1),
    "compact": lambda m: patch_activations(m),
    "sketch + compact": lambda m: (patch_linear(m, sketch="gaussian", rho=0.5, bits=4, min_rows=1),
                                   patch_activations(m)),
}


def _grads(model, batch) -> list:
    torch.manual_seed(7)  # the dropout seeds the compact parts draw from the global generator
    model.zero_grad()
    model(**batch).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.stack("save-load", "sketch", "bits", "compact", "decoders")
@pytest.mark.parametrize("arch", ["roberta", "llama", "gpt2"])
@pytest.mark.parametrize("patch", sorted(PATCHES))
def test_torch_save_and_load_round_trip(arch, patch):
    """``torch.save(model)`` of a patched model loads back into one that computes the same
    gradients as the original from there on (its random streams are saved with it), and that
    unpatches back to the plain model."""
    model = _tiny(arch).train()
    PATCHES[patch](model)
    batch = _batch(arch)
    _grads(model, batch)  # a step before saving: the streams have moved
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for a, b in zip(_grads(model, batch), _grads(loaded, batch), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    unpatch_activations(loaded)
    unpatch_linear(loaded)
    plain = _tiny(arch).train()
    assert [type(m) for m in loaded.modules()] == [type(m) for m in plain.modules()]
    assert loaded.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.stack("save-load", "sketch", "compact", "decoders")
@pytest.mark.parametrize("arch", ["roberta", "llama", "gpt2"])
def test_save_pretrained_keeps_keys_and_patching_again_restores(tmp_path, arch):
    """``save_pretrained`` of a patched model writes the plain model's keys; ``from_pretrained``
    gives the plain model, and calling ``patch_linear`` / ``patch_activations`` again with the same
    arguments restores the patch (same forward, same patched modules)."""
    model = _tiny(arch).eval()
    patch_linear(model, sketch="gaussian", rho=0.5)
    patch_activations(model)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    plain = _tiny(arch)
    assert loaded.state_dict().keys() == plain.state_dict().keys()
    patch_linear(loaded, sketch="gaussian", rho=0.5)
    patch_activations(loaded)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    batch = _batch(arch)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)


# ---------------------------------------------------------------------------------------------
# torch.compile

DROPOUT = {"roberta": {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
           "llama": {"attention_dropout": 0.1}, "gpt2": {}}  # GPT-2's dropouts are on already


COMPILE_PATCHES = {**PATCHES, "compact, LM loss stored": lambda m: patch_activations(m, lm_loss="stored")}
# The chunked LM loss runs the whole training forward eagerly (sketchprop.activations.loss): the
# decoders are also compiled with their own loss, so that their compact parts meet a graph.
COMPILE_CASES = [("roberta", p) for p in sorted(PATCHES)] + [
    (arch, p) for arch in ("llama", "gpt2") for p in ("sketch", "sketch + compact",
                                                      "compact, LM loss stored")]


def _compiled_against_eager(arch: str, patch: str, backend: str, patch_after: bool = False,
                            **tolerance) -> None:
    """Two identical patched models with dropout on, one under ``torch.compile(backend=...)``
    (patched before compiling, or with ``patch_after`` through the compiled wrapper): four steps
    on two batch shapes give each step the same gradients in both (the same bits in the same
    order); the last two steps, on shapes already seen but with new seeds and call counts, must
    not recompile."""
    torch._dynamo.reset()
    eager, model = _tiny(arch, **DROPOUT[arch]).train(), _tiny(arch, **DROPOUT[arch]).train()
    names = COMPILE_PATCHES[patch](eager)
    if patch_after:
        compiled = torch.compile(model, backend=backend)
        assert COMPILE_PATCHES[patch](compiled) == names  # the plain model's names: its streams
    else:
        COMPILE_PATCHES[patch](model)
        compiled = torch.compile(model, backend=backend)
    for step, length in enumerate([12, 16, 12, 16]):
        batch = _batch(arch, length)
        with torch._dynamo.config.patch(error_on_recompile=step >= 2):
            grads = [_grads(m, batch) for m in (eager, compiled)]
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(b, a, **tolerance)


@pytest.mark.stack("compile", "sketch", "bits", "compact", "decoders")
@pytest.mark.parametrize("arch, patch", COMPILE_CASES)
def test_compiled_model_has_eager_gradients_and_no_recompiles(arch, patch):
    """``torch.compile(model)`` of a patched model, traced by Dynamo and AOTAutograd (the
    ``aot_eager`` backend: where the crashes, guards and recompiles of tracing arise) has the eager
    model's gradients at every step and recompiles for no new seed (sketchprop.compiling)."""
    _compiled_against_eager(arch, patch, "aot_eager")


@pytest.mark.stack("compile", "sketch", "bits", "compact")
def test_patching_through_the_compiled_wrapper_patches_the_model_inside():
    """``patch_linear`` and ``patch_activations`` called on ``torch.compile``'s wrapper change the
    model inside, under its own names (so with its random streams), and the compiled model then
    has the eager patched model's gradients."""
    _compiled_against_eager("roberta", "sketch + compact", "aot_eager", patch_after=True)


@pytest.mark.compile
@pytest.mark.stack("compile", "sketch", "bits", "compact")
def test_inductor_compiled_model_has_eager_gradients(monkeypatch):
    """The same under inductor, the default backend, with a sketch, 4-bit rows and the compact
    parts, and the codecs compiled too (in both models): inductor's own kernels between the eager
    parts reassociate float sums, nothing more (the b-bit codes are the same: no bias from folded
    bfloat16 round trips)."""
    monkeypatch.setenv("SKETCHPROP_CODECS", "compiled")
    _compiled_against_eager("roberta", "sketch + compact", "inductor", rtol=1e-4, atol=1e-5)


@pytest.mark.stack("compile", "compact", "decoders")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_decoder_with_the_chunked_loss_runs_its_own_forward_outside_training(arch):
    """With the chunked LM loss (the decoders' default), the forwards that are the model's own (in
    eval mode with labels, as ``Trainer.evaluate`` calls it, and in training without labels) are
    traced by the compiler and give the eager model's loss and logits (they once recursed without
    end: Dynamo took the class's forward bound to the model for the model's patched forward)."""
    torch._dynamo.reset()
    eager, model = _tiny(arch), _tiny(arch)
    patch_activations(eager)
    patch_activations(model)
    compiled = torch.compile(model, backend="aot_eager")
    batch = _batch(arch)
    for training, inputs in ((False, batch), (True, {k: batch[k] for k in ("input_ids",
                                                                          "attention_mask")})):
        eager.train(training)
        model.train(training)
        torch.manual_seed(7)  # GPT-2's dropouts draw their seeds from it
        want = eager(**inputs)
        torch.manual_seed(7)
        got = compiled(**inputs)
        torch.testing.assert_close(got.logits, want.logits)
        if not training:
            torch.testing.assert_close(got.loss, want.loss)


# ---------------------------------------------------------------------------------------------
# Resizing the vocabulary


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_resize_token_embeddings_keeps_a_patched_output_layer_patched(arch, tied):
    """``resize_token_embeddings`` replaces an untied output layer by a plain ``nn.Linear`` of the
    new size: patched (``exclude=None``), the layer stays the patched one, holding the new
    Parameters (tied where they were), its seed stream kept; it computes as the plain model
    resized alike, and unpatches to that model's head."""
    model = _tiny(arch, tie_word_embeddings=tied).train()
    plain = _tiny(arch, tie_word_embeddings=tied).train()
    patch_linear(model, sketch="gaussian", rho=0.5, exclude=None, min_rows=1)
    head = model.lm_head
    _grads(model, _batch(arch))
    model.zero_grad()  # a resize keeps the old gradients' shape on its Parameters
    calls, gen = head.calls, head._gen.get_state()
    for m in (model, plain):
        torch.manual_seed(3)  # the new rows' initialisation
        m.resize_token_embeddings(80)
    assert model.lm_head is head and (head.in_features, head.out_features) == (32, 80)
    assert head.weight.shape == (80, 32) and head.calls == calls
    assert torch.equal(head._gen.get_state(), gen)
    assert (head.weight is model.get_input_embeddings().weight) is tied
    assert model.state_dict().keys() == plain.state_dict().keys()
    batch = _batch(arch)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**batch).logits, plain.eval()(**batch).logits,
                                   rtol=0, atol=0)
    model.train()(**batch).loss.backward()
    assert head.weight.grad.shape == (80, 32) and head.calls == calls + 1
    unpatch_linear(model)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is head.weight
    assert "resize_token_embeddings" not in vars(model)


@pytest.mark.stack("save-load", "sketch")
def test_a_patched_gpt2_loads_in_a_fresh_process(tmp_path):
    """GPT-2's patched layers are of a class made on first use (it subclasses transformers'
    Conv1D); a process that has made none finds it when it unpickles one."""
    model = _tiny("gpt2").eval()
    patch_linear(model, sketch="gaussian", rho=0.5)
    torch.save(model, tmp_path / "model.pt")
    batch = _batch("gpt2")
    with torch.no_grad():
        torch.save((batch, model(**batch).logits), tmp_path / "out.pt")
    script = textwrap.dedent(f"""
        import torch
        from sketchprop import RandomizedLinear
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        layer = model.transformer.h[0].attn.c_attn
        assert type(layer).__name__ == "RandomizedConv1D" and isinstance(layer, RandomizedLinear)
        batch, logits = torch.load({str(tmp_path / "out.pt")!r})
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, logits, rtol=0, atol=0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Training loops: plain, accelerate, gradient accumulation

#: (architecture, patch) per patch kind: the encoder for the linear patches and compact
#: activations, Llama for the decoder parts (gated MLP, RMSNorm, chunked loss).
LOOPS = {
    "sketch": ("roberta", lambda m: patch_linear(m, sketch="blocksrht", rho=0.5, min_rows=1)),
    "bits": ("roberta", lambda m: patch_linear(m, sketch="exact", bits=4)),
    "compact": ("roberta", lambda m: patch_activations(m)),
    "decoders": ("llama", lambda m: patch_activations(m)),
}


def _losses(model, batch, steps=8, accelerator=None, micro=1) -> list[float]:
    """Train on one batch (``micro`` micro-batches per step, gradients accumulated); the loss of
    every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    parts = [{k: v[i::micro] for k, v in batch.items()} for i in range(micro)]
    losses = []
    for _ in range(steps):
        total = 0.0
        for part in parts:
            loss = model(**part).loss / micro
            accelerator.backward(loss) if accelerator is not None else loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.stack("plain-loop", "sketch", "bits", "compact", "decoders")
@pytest.mark.parametrize("patch", sorted(LOOPS))
def test_a_plain_loop_trains(patch):
    arch, apply = LOOPS[patch]
    model = _tiny(arch).train()
    apply(model)
    losses = _losses(model, _batch(arch))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


@pytest.mark.stack("accelerate", "sketch", "bits", "compact", "decoders")
@pytest.mark.parametrize("patch", sorted(LOOPS))
def test_accelerate_prepares_and_trains_a_patched_model(patch):
    from accelerate import Accelerator

    arch, apply = LOOPS[patch]
    model = _tiny(arch).train()
    apply(model)
    losses = _losses(model, _batch(arch), accelerator=Accelerator(cpu=True))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


#: The exact configurations of each patch kind (no random bits): their accumulated gradients must
#: be the plain model's.
EXACT = {
    "sketch": ("roberta", lambda m: patch_linear(m, sketch="gaussian", rho=1.0, min_rows=1)),
    "compact": ("roberta", lambda m: patch_activations(m, gelu_bits=None)),
    "decoders": ("llama", lambda m: patch_activations(m)),
}


@pytest.mark.stack("grad-accum", "sketch", "compact", "decoders")
@pytest.mark.parametrize("patch", sorted(EXACT))
def test_gradient_accumulation_gives_the_plain_models_gradients(patch):
    """Three micro-batches, each its own forward and backward into the same ``.grad`` (padding
    differs between them): the exact configurations accumulate the plain model's gradients
    (without dropout, whose seeded masks are not ``nn.Dropout``'s)."""
    arch, apply = EXACT[patch]
    config = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0} \
        if arch == "roberta" else {}
    model, plain = _tiny(arch, **config).train(), _tiny(arch, **config).train()
    apply(model)
    batch = _batch(arch)
    grads = []
    for m in (model, plain):
        for i in range(3):
            torch.manual_seed(i)  # the same dropout draws for both models
            m(**{k: v[i:i + 1] for k, v in batch.items()}).loss.backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.stack("grad-accum", "bits")
def test_gradient_accumulation_trains_with_coded_rows():
    model = _tiny("roberta").train()
    LOOPS["bits"][1](model)
    losses = _losses(model, _batch("roberta"), micro=3)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


# ---------------------------------------------------------------------------------------------
# Sharded and replicated training: FSDP2, FSDP1, DDP, in two gloo processes
#
# A case is (stack, order, model, patch), run by ``tests/sharded_ranks.py`` (which see). ``fsdp1``
# is FullyShardedDataParallel with ``use_orig_params=True`` (as accelerate makes it), ``fsdp1-flat``
# with its default flat parameters (whose gradients cannot be gathered: its parameters are
# compared). DDP before wrapping is shown by the tests above and ``test_pipeline.py``.

SHARDED = ("stack", "order", "arch", "patch")


@pytest.fixture(scope="module")
def sharded_runs(request, tmp_path_factory):
    """The cases of the selected tests that use this fixture, run by one pair of gloo processes:
    what rank 0 found, by case."""
    cases = sorted({tuple(item.callspec.params[k] for k in SHARDED)
                    for item in request.session.items if "sharded_runs" in item.fixturenames})
    port, out = str(_free_port()), tmp_path_factory.mktemp("sharded") / "out.json"
    script = str(Path(__file__).with_name("sharded_ranks.py"))
    procs = [subprocess.Popen([sys.executable, script, str(rank), port, str(out), json.dumps(cases)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return dict(zip(cases, json.loads(out.read_text()), strict=True))


@pytest.mark.parametrize(", ".join(SHARDED), [
    pytest.param("fsdp2", "before", "roberta", "linear-exact", marks=pytest.mark.stack("fsdp2", "sketch")),
    pytest.param("fsdp2", "before", "roberta", "compact-exact", marks=pytest.mark.stack("fsdp2", "compact")),
    pytest.param("fsdp2", "before", "llama", "decoders", marks=pytest.mark.stack("fsdp2", "decoders")),
    pytest.param("fsdp2", "after", "llama", "decoders", marks=pytest.mark.stack("fsdp2", "decoders")),
    pytest.param("fsdp2", "after", "roberta", "compact-exact-stored-layernorm",
                 marks=pytest.mark.stack("fsdp2", "compact")),
    pytest.param("fsdp1", "before", "roberta", "linear-exact", marks=pytest.mark.stack("fsdp1", "sketch")),
    pytest.param("fsdp1-flat", "before", "roberta", "linear-exact",
                 marks=pytest.mark.stack("fsdp1", "sketch")),
    pytest.param("fsdp1", "before", "roberta", "compact-exact", marks=pytest.mark.stack("fsdp1", "compact")),
    pytest.param("fsdp1", "after", "llama", "decoders", marks=pytest.mark.stack("fsdp1", "decoders")),
    pytest.param("ddp", "after", "roberta", "linear-exact", marks=pytest.mark.stack("ddp", "sketch")),
    pytest.param("ddp", "after", "roberta", "compact-exact", marks=pytest.mark.stack("ddp", "compact")),
    pytest.param("ddp", "after", "llama", "decoders", marks=pytest.mark.stack("ddp", "decoders")),
])
def test_sharded_exact_configurations_give_one_process_gradients(sharded_runs, stack, order, arch,
                                                                   patch):
    """Exact configurations (the exact sketch without codes, compact activations without the
    stochastic GELU code, the decoder parts), patched before or after wrapping where that order
    works: each step's gradients and the parameters after it are one process's on the global
    batch (to float rounding), the same on both ranks, and the patch names the plain model's
    modules (after DDP or FSDP1 it patches the model inside)."""
    run = sharded_runs[(stack, order, arch, patch)]
    assert run["refused"] is None
    assert run["grads"] <= 1 and run["params"] <= 1, run
    assert run["synced"] and run["changed"] and run["names"], run


@pytest.mark.parametrize(", ".join(SHARDED), [
    pytest.param("fsdp2", "before", "roberta", "sketch", marks=pytest.mark.stack("fsdp2", "sketch")),
    pytest.param("fsdp2", "before", "roberta", "bits", marks=pytest.mark.stack("fsdp2", "bits")),
    pytest.param("fsdp2", "before", "roberta", "compact", marks=pytest.mark.stack("fsdp2", "compact")),
    pytest.param("fsdp2", "before", "llama", "sketch-bits-compact",
                 marks=pytest.mark.stack("fsdp2", "sketch", "bits", "compact", "decoders")),
    pytest.param("fsdp1-flat", "before", "roberta", "sketch-bits-compact",
                 marks=pytest.mark.stack("fsdp1", "sketch", "bits", "compact")),
    pytest.param("fsdp1", "before", "llama", "sketch-bits-compact",
                 marks=pytest.mark.stack("fsdp1", "sketch", "bits", "compact", "decoders")),
    pytest.param("ddp", "after", "roberta", "sketch-bits-compact",
                 marks=pytest.mark.stack("ddp", "sketch", "bits", "compact")),
    pytest.param("ddp", "after", "llama", "sketch-bits-compact",
                 marks=pytest.mark.stack("ddp", "sketch", "bits", "compact", "decoders")),
    pytest.param("fsdp2", "before", "roberta", "floor", marks=pytest.mark.stack("fsdp2", "floor")),
    pytest.param("fsdp2", "before", "llama", "bits-lean-floor",
                 marks=pytest.mark.stack("fsdp2", "bits", "floor")),
    pytest.param("ddp", "after", "roberta", "floor", marks=pytest.mark.stack("ddp", "floor")),
    pytest.param("ddp", "after", "llama", "bits-lean-floor",
                 marks=pytest.mark.stack("ddp", "bits", "floor")),
])
def test_sharded_stochastic_configurations_train(sharded_runs, stack, order, arch, patch):
    """A sketch, b-bit rows and the compact defaults (each rank draws its own bits): finite
    losses, the parameters change and stay the same on both ranks."""
    run = sharded_runs[(stack, order, arch, patch)]
    assert run["refused"] is None
    assert run["finite"] and run["changed"] and run["synced"] and run["names"], run


@pytest.mark.parametrize(", ".join(SHARDED) + ", message", [
    pytest.param("fsdp2", "after", "roberta", "sketch", "patch_linear must run before fully_shard",
                 marks=pytest.mark.stack("fsdp2", "sketch", refused="must run before fully_shard")),
    pytest.param("fsdp2", "after", "llama", "bits", "patch_linear must run before fully_shard",
                 marks=pytest.mark.stack("fsdp2", "bits", refused="must run before fully_shard")),
    pytest.param("fsdp2", "after", "roberta", "compact",
                 "patch_activations must run before fully_shard.*layernorm='stored'",
                 marks=pytest.mark.stack("fsdp2", "compact", refused="must run before fully_shard")),
    pytest.param("fsdp2", "unpatch", "roberta", "sketch", "unpatch_linear must run before fully_shard",
                 marks=pytest.mark.stack("fsdp2", "sketch", refused="must run before fully_shard")),
    pytest.param("fsdp1", "after", "roberta", "sketch",
                 "patch_linear must run before FullyShardedDataParallel",
                 marks=pytest.mark.stack("fsdp1", "sketch",
                                         refused="must run before FullyShardedDataParallel")),
    pytest.param("fsdp1-flat", "after", "llama", "linear-exact",
                 "patch_linear must run before FullyShardedDataParallel",
                 marks=pytest.mark.stack("fsdp1", "sketch",
                                         refused="must run before FullyShardedDataParallel")),
    pytest.param("fsdp1-flat", "after", "roberta", "compact-exact",
                 "patch_activations must run before FullyShardedDataParallel",
                 marks=pytest.mark.stack("fsdp1", "compact",
                                         refused="must run before FullyShardedDataParallel")),
    pytest.param("fsdp1-flat", "unpatch", "roberta", "compact-exact",
                 "unpatch_activations must run before FullyShardedDataParallel",
                 marks=pytest.mark.stack("fsdp1", "compact",
                                         refused="must run before FullyShardedDataParallel")),
])
def test_patching_a_sharded_model_refuses_before_changing_it(sharded_runs, stack, order, arch,
                                                             patch, message):
    """After ``fully_shard`` or ``FullyShardedDataParallel``, a call that would replace modules
    holding parameters (the linear layers, ``layernorm="output"``, and the inverses) refuses,
    naming the order to use, and leaves the model as it was: the wrapper would go on handing the
    parameters to the old modules."""
    run = sharded_runs[(stack, order, arch, patch)]
    assert re.search(message, run["refused"] or ""), run
    assert run["untouched"], run
