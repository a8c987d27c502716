"""What ``patch_linear`` does to common architectures, with its defaults, on tiny random models.

BERT and RoBERTa (sequence classification), T5 (conditional generation), Llama and GPT-2 (causal
LM) and a plain two-layer MLP, each built in code from a small config with random weights (no
download), on one padded batch: right padding, as HF's collators make it, padding labels -100.
Each model is patched with ``patch_linear(model, sketch=..., rho=...)`` and every other argument
at its default (every ``nn.Linear`` and transformers ``Conv1D`` but a language model's
``lm_head``; Q/K/V and any other layers that read one tensor share one sketch; padding rows
skipped). Per architecture:

- the linear layers patched, and those left exact;
- the groups of layers that store one shared sketch, read off the saved tensors: a floating-point
  storage that several layers save for backward (each group is listed once, its block index as N);
- the bytes one training forward saves for backward (``SavedTensorMeter``: unique storages,
  parameters excluded), exact and patched;
- whether the patched forward is bitwise the exact one, and whether ``unpatch_linear`` round-trips
  exactly: the same module types, the same Parameter objects and state_dict keys, and a training
  step after unpatching bitwise equal (outputs and every gradient) to one before patching.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from torch import nn

from sketchprop import RandomizedLinear, patch_linear, unpatch_linear
from sketchprop.measure import SavedTensorMeter
from sketchprop.patching import _is_linear

from .common import environment, fmt_table, parse_list, r3, setup_device, write_outputs

ARCHITECTURES = ("bert", "roberta", "t5", "llama", "gpt2", "mlp")


@dataclass(frozen=True)
class Size:
    """The models' sizes and the batch's."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    batch: int
    length: int

    @property
    def intermediate(self) -> int:
        return 4 * self.hidden


FULL = Size(hidden=256, layers=4, heads=4, vocab=1000, batch=8, length=128)
QUICK = Size(hidden=32, layers=2, heads=2, vocab=64, batch=4, length=16)


def build(arch: str, s: Size) -> nn.Module:
    """A randomly initialised model of ``arch`` at size ``s`` (dropout as its config's default)."""
    import transformers as tf

    if arch == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, intermediate_size=s.intermediate,
            max_position_embeddings=s.length, num_labels=2))
    if arch == "roberta":
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, intermediate_size=s.intermediate,
            max_position_embeddings=s.length + 2, pad_token_id=1, num_labels=2))
    if arch == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=s.vocab, d_model=s.hidden, d_kv=s.hidden // s.heads, d_ff=s.intermediate,
            num_layers=s.layers, num_heads=s.heads, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0))
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
            num_hidden_layers=s.layers, num_attention_heads=s.heads,
            num_key_value_heads=max(1, s.heads // 2),  # grouped-query attention, as Llama 2/3
            max_position_embeddings=s.length, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if arch == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=s.vocab, n_positions=s.length, n_embd=s.hidden, n_layer=s.layers,
            n_head=s.heads, bos_token_id=0, eos_token_id=0))
    if arch == "mlp":
        return nn.Sequential(nn.Linear(s.hidden, s.intermediate), nn.GELU(),
                             nn.Linear(s.intermediate, s.hidden))
    raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")


def make_batch(arch: str, s: Size) -> dict:
    """One batch: lengths from the full ``s.length`` down to about half, padded on the right."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([s.length - (s.length * i) // (2 * s.batch) for i in range(s.batch)])
    mask = (torch.arange(s.length)[None, :] < lengths[:, None]).long()
    if arch == "mlp":
        return {"x": torch.randn(s.batch, s.length, s.hidden, generator=g),
                "y": torch.randn(s.batch, s.length, s.hidden, generator=g)}
    pad = 1 if arch == "roberta" else 0
    ids = torch.randint(3, s.vocab, (s.batch, s.length), generator=g).masked_fill(mask == 0, pad)
    data = {"input_ids": ids, "attention_mask": mask}
    if arch in ("bert", "roberta"):
        data["labels"] = torch.randint(0, 2, (s.batch,), generator=g)
    elif arch == "t5":  # targets half as long as the inputs, padded with -100
        out_len = s.length // 2
        labels = torch.randint(3, s.vocab, (s.batch, out_len), generator=g)
        data["labels"] = labels.masked_fill(torch.arange(out_len)[None, :] >= lengths[:, None] // 2,
                                            -100)
    else:
        data["labels"] = ids.masked_fill(mask == 0, -100)
    return data


def loss_and_output(model: nn.Module, data: dict):
    """The training loss and the output (logits, or the MLP's output) of one forward pass."""
    if "x" in data:
        out = model(data["x"])
        return nn.functional.mse_loss(out, data["y"]), out
    out = model(**data)
    return out.loss, out.logits


def step(model: nn.Module, data: dict):
    """Output and parameter gradients of one training step; dropout reseeded, so steps compare."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss, out = loss_and_output(model, data)
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def saved_bytes(model: nn.Module, data: dict) -> int:
    """Bytes one training forward saves for backward."""
    torch.manual_seed(0)
    with SavedTensorMeter(model) as meter:
        loss, _ = loss_and_output(model, data)
    loss.backward()
    return meter.bytes


def shared_groups(model: nn.Module, data: dict) -> list[list[str]]:
    """Groups of patched layers that save one floating-point storage (a shared sketch)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, RandomizedLinear)}
    current: list[str | None] = [None]
    savers: dict[tuple, set] = {}

    def pack(t):
        if current[0] is not None and t.is_floating_point():
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            savers.setdefault(key, set()).add(current[0])
        return t

    hooks = [h for n, m in layers.items() for h in (
        m.register_forward_pre_hook(lambda *a, n=n: current.__setitem__(0, n)),
        m.register_forward_hook(lambda *a: current.__setitem__(0, None)))]
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = loss_and_output(model, data)
    for h in hooks:
        h.remove()
    loss.backward()
    order = list(layers)
    groups = {tuple(sorted(names, key=order.index)) for names in savers.values() if len(names) > 1}
    return sorted(map(list, groups), key=lambda g: order.index(g[0]))


def describe(groups: list[list[str]]) -> list[str]:
    """Each distinct group once: its members' common prefix with the block index (the first
    number in a name) as N, the members after it, and how many such groups (or 'all N blocks'
    for one group that spans blocks)."""
    seen: Counter = Counter()
    spans: dict[str, int] = {}
    for group in groups:
        blockless = [re.sub(r"\.\d+\.", ".N.", n, count=1) for n in group]
        pattern = sorted(set(blockless), key=blockless.index)
        parts = [p.split(".") for p in pattern]
        common = 0
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
        text = ".".join(parts[0][:common]) + ".{" + ", ".join(
            ".".join(p[common:]) for p in parts) + "}"
        seen[text] += 1
        spans[text] = len(group) // len(pattern)
    return [f"{text} " + (f"(one sketch for all {spans[text]} blocks)" if spans[text] > 1
                          else f"(x{n})")
            for text, n in seen.items()]


@dataclass
class Row:
    """What one architecture gives (a row of the table, a record of the JSON)."""

    architecture: str
    model: str
    linear_layers: int
    patched: int
    patched_types: dict
    left_exact: list
    shared_groups: list
    shared: list
    real_rows: int
    rows: int
    saved_bytes_exact: int
    saved_bytes_patched: int
    saved_ratio: float
    forward_exact: bool
    round_trip_exact: bool


def measure(arch: str, s: Size, sketch: str, rho: float) -> Row:
    """One architecture patched, measured and unpatched: its row of the table."""
    torch.manual_seed(0)
    model = build(arch, s).train()
    data = make_batch(arch, s)
    linear = [n for n, m in model.named_modules() if _is_linear(m)]
    types = {n: type(m) for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    exact_bytes = saved_bytes(model, data)
    out_before, grads_before = step(model, data)

    names = patch_linear(model, sketch=sketch, rho=rho)
    patched_types = Counter(types[n].__name__ for n in names)
    groups = shared_groups(model, data)
    patched_bytes = saved_bytes(model, data)
    out_patched, _ = step(model, data)
    unpatch_linear(model)
    out_after, grads_after = step(model, data)
    round_trip = (
        {n: type(m) for n, m in model.named_modules()} == types
        and all(p is params[n] for n, p in model.named_parameters())
        and list(model.state_dict()) == keys
        and torch.equal(out_after, out_before)
        and grads_after.keys() == grads_before.keys()
        and all(torch.equal(grads_after[n], g) for n, g in grads_before.items()))
    mask = data.get("attention_mask")
    rows = s.batch * s.length
    return Row(
        architecture=arch, model=type(model).__name__, linear_layers=len(linear),
        patched=len(names), patched_types=dict(patched_types),
        left_exact=[n for n in linear if n not in names], shared_groups=groups,
        shared=describe(groups), real_rows=int(mask.sum()) if mask is not None else rows,
        rows=rows, saved_bytes_exact=exact_bytes, saved_bytes_patched=patched_bytes,
        saved_ratio=patched_bytes / exact_bytes, forward_exact=torch.equal(out_patched, out_before),
        round_trip_exact=round_trip)


def tables(payload: dict) -> str:
    """The markdown table and its notes."""
    a = payload["args"]
    s = payload["size"]
    lines = [[r["architecture"], r["model"],
              f"{r['patched']} of {r['linear_layers']} ("
              + ", ".join(f"{n} {t}" for t, n in r["patched_types"].items()) + ")",
              ", ".join(f"`{n}`" for n in r["left_exact"]) or "-",
              "<br>".join(f"`{g}`" for g in r["shared"]) or "none",
              f"{r['saved_bytes_exact'] / 1e6:.2f}", f"{r['saved_bytes_patched'] / 1e6:.2f}",
              r3(r["saved_ratio"]), "yes" if r["forward_exact"] else "NO",
              "yes" if r["round_trip_exact"] else "NO"]
             for r in payload["results"]]
    title = (f"patch_linear(model, sketch={a['sketch']!r}, rho={a['rho']:g}), other arguments "
             f"at their defaults; random weights, hidden {s['hidden']}, {s['layers']} layers, "
             f"{s['heads']} heads, batch {s['batch']} x {s['length']} tokens padded on the right "
             f"({payload['results'][0]['real_rows']} real rows of {payload['results'][0]['rows']})")
    notes = [
        "",
        "- Only the linear layers' inputs shrink. Attention probabilities, dropout masks and the "
        "inputs of normalisations and activations are saved as before, and a language model's "
        "logits (its lm_head is left exact), so the ratio stays well above rho.",
        "- GPT-2's `c_attn` computes Q, K and V as one layer (transformers' `Conv1D`, its weight "
        "kept as stored): one input, one sketch, nothing left to share.",
        "- T5's cross-attention keys and values of every decoder block read the encoder's output: "
        "one sketch serves them all. The encoder's padding rows are skipped (the targets are half "
        "as long as the inputs; a decoder sequence as long as the encoder's would skip none).",
        "- The plain MLP has no attention mask: all its rows are sketched.",
    ]
    return fmt_table(
        ["architecture", "model", "linear layers patched", "left exact", "one sketch shared by",
         "saved MB, exact", f"saved MB, rho {a['rho']:g}", "ratio", "forward bitwise exact",
         "unpatch round trip exact"], lines, title=title) + "\n" + "\n".join(notes) + "\n"


def run(args) -> None:
    """The matrix as ``scripts/architectures.py`` runs it (its options in ``args``): write
    ``architectures[_quick].{json,md}`` and print the table with its notes."""
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    size = QUICK if args.quick else FULL
    results = []
    for arch in parse_list(args.architectures):
        row = measure(arch, size, args.sketch, args.rho)
        print(f"{arch}: {row.patched} patched, saved {row.saved_ratio:.3f} of exact, round trip "
              f"{'exact' if row.round_trip_exact else 'NOT exact'}", flush=True)
        results.append(asdict(row))
    payload = {"environment": env, "args": vars(args), "size": asdict(size),
               "results": results}
    write_outputs("architectures" + ("_quick" if args.quick else ""), payload, tables(payload),
                  args.out_dir)
    print(tables(payload))
