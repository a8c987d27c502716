"""Compact activations on decoder LMs: what one training step saves for backward, by op, and its
time, for a GPT-2-small-shaped and a Llama-shaped model with grouped-query attention.

Random weights built from a config (no download), full sequences of random tokens (every row full
length, no padding: exact skips nothing, so it is also the baseline with padding skipped), labels
the inputs (transformers shifts them), CPU, SDPA attention as transformers picks it. Methods:

- ``exact``: the model as it is;
- ``compact``: ``patch_activations(model)`` with its defaults (what applies to the model);
- ``ours+compact``: ``patch_linear(model, sketch, rho)`` (lm_head left exact, the default) and
  ``patch_activations(model)``;
- ``int4+compact``, ``int4+lean``: ``patch_linear(model, sketch="exact", bits=4)`` (every linear
  input kept as a 4-bit code) and ``patch_activations(model)``, or with lean's structural parts
  (:func:`~sketchprop.bench.common.lean_parts`: ``preset="lean"`` without its floor; each
  RMSNorm output kept once, as the 4-bit code that the next linear layers, the attention's
  rotated Q, K, V and the gated MLP's gate and up outputs are made again from in backward);
- ``lora``: peft LoRA (r 8, alpha 16, no dropout) on every linear layer of the blocks, the rest
  frozen;
- ``lora+ours+compact``: the same with ``patch_linear(targets="lora_A")`` (the adapters'
  down-projections, the only layers that keep inputs) and ``patch_activations(model)`` (whose
  default ``mlp="auto"`` keeps the gated MLP's input here, its gate and up weights being frozen);
- ``...compact(key=value,...)``: ``patch_activations(model, key=value, ...)``, options changed from
  the defaults (every method is first applied to a tiny model, so a bad one fails at once):
  ``mlp=input`` (the gated MLP keeps its input, backward makes the gate and up outputs again),
  ``mlp=recompute`` (it keeps the gate and up outputs), ``attention=recompute`` (applied even
  where the default leaves it), ``lm_loss=stored``.

Saved bytes: ``SavedTensorMeter`` around the forward (unique storages, parameters excluded); by op:
the graph of the loss walked (``saved_tensors.saved_by_node``), each storage under the first node
that keeps it, grouped by node type. Time (``--time-steps N``): a warm-up step of each method, then N
rounds in which every method takes one forward+backward step in turn (all in one process); a
method's ratio is the median over rounds of its step time over exact's in the same round, with
the range; 0 skips timing.
"""

from __future__ import annotations

import copy
import gc
import json
import re
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sketchprop import patch_activations, patch_linear
from sketchprop.measure import SavedTensorMeter

from .common import (
    BadArgs,
    environment,
    fmt_table,
    lean_parts,
    parse_list,
    r3,
    setup_device,
    write_outputs,
)
from .saved_tensors import saved_by_node

# The methods measured by default.
METHODS = ("exact", "compact", "compact(mlp=input)", "ours+compact", "lora", "lora+ours+compact",
           "lora+ours+compact(mlp=recompute)")


@dataclass(frozen=True)
class Shape:
    """A decoder's architecture and sizes."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


# GPT-2 small, and a Llama of about its size with grouped-query attention; tiny ones for --quick.
SHAPES = {
    "gpt2": Shape("gpt2", 768, 12, 12, 12, 3072, 50257),
    "llama": Shape("llama", 768, 12, 12, 4, 2048, 32000),
}
QUICK = {
    "gpt2": Shape("gpt2", 32, 2, 2, 2, 128, 128),
    "llama": Shape("llama", 32, 2, 4, 2, 48, 128),
}


def build(s: Shape, length: int):
    """A randomly initialised model of shape ``s`` for sequences of ``length`` tokens."""
    import transformers as tf

    if s.arch == "gpt2":  # GPT-2's own dropout (0.1) kept: a fine-tuning run has it
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=s.vocab, n_positions=max(1024, length), n_embd=s.hidden, n_layer=s.layers,
            n_head=s.heads, n_inner=s.intermediate, bos_token_id=0, eos_token_id=0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=max(2048, length), pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
                "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"]}


def split_methods(text: str) -> list[str]:
    """``--methods``: comma-separated methods; a comma inside ``compact(...)`` separates options."""
    return [m.strip() for m in re.split(r",(?![^()]*\))", text) if m.strip()]


def parse_method(method: str) -> tuple[list[str], dict[str, str]]:
    """A method's parts (``+``-joined: ``exact``, ``compact``, ``lean``, ``ours``, ``int4``,
    ``lora``) and the options of its ``compact(key=value,...)`` or ``lean(...)`` part; ValueError
    naming what is wrong."""
    parts, options = [], {}
    for part in method.split("+"):
        m = re.fullmatch(r"(exact|compact|lean|ours|int4|lora)(?:\((.*)\))?", part)
        if m is None:
            raise ValueError(f"unknown method {method!r}: join exact, compact, lean, ours, int4 "
                             f"and lora with '+', options in compact(key=value,...), e.g. "
                             f"lora+ours+compact(mlp=recompute)")
        name, opts = m.groups()
        if opts is not None:
            if name not in ("compact", "lean"):
                raise ValueError(f"method {method!r}: only compact and lean take options, not "
                                 f"{name}")
            for kv in opts.split(","):
                key, eq, value = kv.partition("=")
                if not (key and eq and value):
                    raise ValueError(f"method {method!r}: {kv!r} is not key=value")
                options[key] = value
        parts.append(name)
    return parts, options


def check_methods(methods: list[str], archs: list[str], sketch: str, rho: float) -> None:
    """Raise ValueError for the first method that cannot be set up: each is parsed and applied to a
    tiny model of each architecture, before any real model is built or fetched."""
    for method in methods:
        parse_method(method)
        for arch in archs:
            if not applies(method, arch):
                continue
            try:
                configure(build(QUICK[arch], 16), arch, method, sketch, rho)
            except (ValueError, TypeError) as err:
                raise ValueError(f"method {method!r} on {arch}: {err}") from None


def applies(method: str, arch: str) -> bool:
    """Whether ``method`` can be measured on ``arch``: an ``mlp=`` option needs Llama's gated
    MLP (GPT-2 has none)."""
    return "mlp=" not in method or arch == "llama"


def configure(base, arch: str, method: str, sketch: str, rho: float):
    """A copy of ``base`` set up as ``method`` says (``base`` itself is left as it is)."""
    parts, options = parse_method(method)
    model = copy.deepcopy(base)
    if "lora" in parts:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=LORA_TARGETS[arch], fan_in_fan_out=arch == "gpt2"))
    where = {"targets": "lora_A"} if "lora" in parts else {}
    if "ours" in parts:
        patch_linear(model, sketch=sketch, rho=rho, **where)
    if "int4" in parts:
        patch_linear(model, sketch="exact", bits=4, **where)
    if "compact" in parts or "lean" in parts:
        patch_activations(model, **({**lean_parts(model), **options} if "lean" in parts
                                    else options))
    return model


#: Node types grouped as the op that keeps the tensor.
OPS = [("elementwise product", ("MulBackward",)),
       ("linear input", ("MmBackward", "AddmmBackward", "BmmBackward", "LinearBackward",
                         "_RandomizedLinear", "SketchedLinear", "Sketch")),
       ("log-probabilities (loss)", ("LogSoftmaxBackward", "NllLoss")),
       ("chunked loss", ("_ChunkedCrossEntropy",)),
       ("SiLU input", ("SiluBackward",)),
       ("gated MLP", ("GateProduct", "GatedDown", "GatedFromInput")),
       ("RMSNorm", ("RMSNormFunction",)),
       ("attention", ("ScaledDotProduct", "Recomputed", "ProjectedAttention",
                      "SoftmaxBackward")),
       ("GELU", ("Gelu", "TanhBackward", "PowBackward")),
       ("LayerNorm", ("NativeLayerNorm", "LayerNorm")),
       ("dropout", ("Dropout", "NativeDropout")),
       ("token ids", ("EmbeddingBackward", "IndexSelectBackward")),
       ]


def op_of(node: str) -> str:
    """The op (one of :data:`OPS`) whose node keeps a tensor."""
    for op, keys in OPS:
        if any(k in node for k in keys):
            return op
    return "other: " + node.split(".")[0]


def by_op(entries: list[dict]) -> dict[str, int]:
    """Saved bytes per op, largest first."""
    out: dict[str, int] = defaultdict(int)
    for e in entries:
        out[op_of(e["node"])] += e["bytes"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def step(model, data):
    """One forward and backward pass."""
    model.zero_grad(set_to_none=True)
    model(**data).loss.backward()


def measure(shape: Shape, batch: int, length: int, methods, sketch: str, rho: float,
            time_steps: int) -> dict:
    """Each method's saved bytes (in all and by op) and, with ``time_steps``, its step time
    against exact's in the same rounds."""
    torch.manual_seed(0)
    base = build(shape, length).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, shape.vocab, (batch, length), generator=g)
    data = {"input_ids": ids, "labels": ids}
    rows, models = {}, {}
    for method in methods:
        if not applies(method, shape.arch):
            continue
        model = configure(base, shape.arch, method, sketch, rho)
        model.train()
        torch.manual_seed(0)
        with SavedTensorMeter(model) as meter:
            loss = model(**data).loss
        entries = saved_by_node(loss, model.parameters())
        del loss
        gc.collect()  # the graph's Python-level cycles (custom Functions' contexts) go now
        rows[method] = {"saved_bytes": meter.bytes, "by_op": by_op(entries)}
        print(f"{shape.arch} {method}: saved {meter.bytes / 2**20:.1f} MiB", flush=True)
        if time_steps:
            models[method] = model
        del model
    if time_steps:
        # Round-robin: each round steps every method once, so a change of machine load falls on
        # all of them alike; a method's ratio is the median of its per-round ratios to exact's.
        for model in models.values():
            step(model, data)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in models}
        for _ in range(time_steps):
            for method, model in models.items():
                t0 = time.perf_counter()
                step(model, data)
                times[method].append(time.perf_counter() - t0)
        base_times = times.get("exact")
        for method, ts in times.items():
            row = rows[method]
            row["step_samples_s"] = ts
            row["step_seconds"] = statistics.median(ts)
            if base_times:
                ratios = [t / b for t, b in zip(ts, base_times, strict=True)]
                row["time_ratios"] = ratios
                row["time_ratio"] = statistics.median(ratios)
            print(f"{shape.arch} {method}: step {row['step_seconds']:.2f} s"
                  + (f", {row['time_ratio']:.3f}x exact" if base_times else ""), flush=True)
    return rows


def tables(payload: dict) -> str:
    """One markdown table per architecture."""
    a = payload["args"]
    parts = []
    for arch, rows in payload["results"].items():
        s = payload["shapes"][arch]
        exact = rows["exact"]
        ops = list(dict.fromkeys(op for r in rows.values() for op in r["by_op"]))
        head = ["method", "saved MiB", "x exact"]
        if "step_seconds" in exact:
            head += ["step s", "time x exact (range over rounds)"]
        head += [f"{op} (MiB)" for op in ops]
        lines = []
        for method, r in rows.items():
            line = [method, f"{r['saved_bytes'] / 2**20:.1f}",
                    r3(r["saved_bytes"] / exact["saved_bytes"])]
            if "step_seconds" in exact:
                ratios = r.get("time_ratios") or [r["step_seconds"] / exact["step_seconds"]]
                line += [f"{r['step_seconds']:.2f}", f"{r3(r.get('time_ratio', ratios[0]))} "
                         f"({min(ratios):.2f}-{max(ratios):.2f})"]
            line += [f"{r['by_op'].get(op, 0) / 2**20:.1f}" for op in ops]
            lines.append(line)
        title = (f"{arch}: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} query / "
                 f"{s['kv_heads']} key-value heads, MLP {s['intermediate']}, vocabulary "
                 f"{s['vocab']}; random weights, batch {a['batch']} x {a['length']} tokens, "
                 "rows: full-length (no padding: exact, padding skipped, does exact's work), CPU "
                 f"({payload['environment']['torch_threads']} threads); ours: {a['sketch']} "
                 f"rho {a['rho']:g}")
        parts.append(fmt_table(head, lines, title=title))
    return "\n\n".join(parts) + "\n"


def run(args) -> None:
    """The measurement as ``scripts/decoders.py`` runs it (its options in ``args``): write
    ``decoders[_quick]<tag>.{json,md}`` and print the tables; or, with ``args.retable``, rewrite an
    earlier run's tables from its JSON file. Bad options (an unknown architecture, a method that
    cannot be set up, no ``exact``) raise :class:`BadArgs` before any model is built."""
    if args.retable:
        path = Path(args.retable)
        payload = json.loads(path.read_text())
        write_outputs(path.stem, payload, tables(payload), path.parent)
        return
    args.methods = split_methods(args.methods)
    if "exact" not in args.methods:
        raise BadArgs("--methods must include exact: every ratio is to it")
    archs = parse_list(args.architectures)
    unknown = [a for a in archs if a not in SHAPES]
    if unknown:
        raise BadArgs(f"unknown architecture(s) {unknown}; choose from {list(SHAPES)}")
    try:
        check_methods(args.methods, archs, args.sketch, args.rho)
    except ValueError as err:
        raise BadArgs(str(err)) from None
    if args.quick:
        args.batch, args.length = 2, 16
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    shapes = QUICK if args.quick else SHAPES
    results = {arch: measure(shapes[arch], args.batch, args.length, args.methods,
                             args.sketch, args.rho, args.time_steps) for arch in archs}
    payload = {"environment": env, "args": vars(args),
               "shapes": {a: asdict(shapes[a]) for a in archs}, "results": results}
    write_outputs("decoders" + ("_quick" if args.quick else "") + args.tag, payload,
                  tables(payload), args.out_dir)
    print(tables(payload))
