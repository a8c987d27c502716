"""Per-layer gradient variance of importance sampling against the paper's sketches, on real batches.

all-MiniLM-L6-v2 on CoLA training batches (32 sentences, dynamic padding, at most 128 tokens, as the
CPU recipe trains). For each of two weight states, the pretrained model (step 0, new head) and the
model after ``--steps`` exact AdamW steps at the CPU recipe's learning rate, and for each rate:

1. the model is patched with ``importance`` (uniform rate, and ``allocate="variance"``) in the CPU
   recipe's layout (shared Q/K/V sketch, padding skipped, head exact);
2. ``--warmup`` forward/backward passes on other batches (no weight update) let each layer learn its
   gradient-norm estimate and the allocation its rates (it recomputes every 20 passes);
3. on ``--batches`` held-out batches each layer's input ``X`` and output gradient ``dY`` (exact:
   every ``dX`` is exact) are captured with the plan the layer drew from, and the exact variance of
   each estimate is computed in closed form: ``blocksrht`` and ``gaussian``
   (:func:`sketchprop.variance.expected_variance`) at the uniform ``k``; ``importance``
   (:func:`sketchprop.variance.importance_variance`) from the layer's own top set and
   probabilities at its ``k``.

The relative variance of a layer is ``sum_batches V / sum_batches |X^T dY|_F^2`` over the 36 encoder
linear layers (the pooler is listed apart). Saved bytes of one training step are measured with
``SavedTensorMeter`` for each configuration (after the allocation settled).
"""

from __future__ import annotations

import copy
import random
import statistics
from pathlib import Path

import torch
from torch import nn

from sketchprop import RandomizedLinear, patch_linear
from sketchprop.glue.config import TaskConfig
from sketchprop.glue.data import read_tsv
from sketchprop.measure import SavedTensorMeter
from sketchprop.variance import expected_variance, importance_variance

from .common import environment, fmt_table, parse_list, r3, setup_device, write_outputs
from .models import build_model, minilm_path

# CoLA as the CPU recipe trains it (configs/task/cola.yaml).
COLA = TaskConfig(name="cola", dir="CoLA", text_columns=["sentence"],
                  labels=["unacceptable", "acceptable"], metrics=["matthews"], batch_size=32,
                  learning_rate=1e-4)
# The estimates compared, and the layout every patched copy uses.
CONFIGS = ("blocksrht", "gaussian", "importance", "importance+allocate")
LAYOUT = dict(share_inputs=True, skip_padding=True, min_rows=16, exclude="classifier")


def batches(args, tokenizer, vocab: int) -> list[dict]:
    """Batches of CoLA training sentences (or random tokens for --quick), in a fixed order."""
    rng = random.Random(0)
    if tokenizer is None:
        out = []
        g = torch.Generator().manual_seed(0)
        for _ in range(args.steps + args.warmup + args.batches):
            lengths = torch.randint(4, 24, (args.batch,), generator=g)
            mask = (torch.arange(24)[None, :] < lengths[:, None]).long()
            ids = torch.randint(3, vocab, (args.batch, 24), generator=g).masked_fill(mask == 0, 0)
            out.append({"input_ids": ids, "attention_mask": mask,
                        "labels": torch.randint(0, 2, (args.batch,), generator=g)})
        return out
    data = read_tsv(Path(args.glue_dir) / "CoLA" / "train.tsv", COLA)
    order = list(range(len(data["label"])))
    rng.shuffle(order)
    out = []
    for i in range(0, len(order) - args.batch + 1, args.batch):
        idx = order[i:i + args.batch]
        enc = tokenizer([data["sentence"][j] for j in idx], truncation=True,
                        max_length=args.max_length, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor([data["label"][j] for j in idx])
        out.append(dict(enc))
    need = args.steps + args.warmup + args.batches
    return (out * (need // len(out) + 1))[:need]


def train_exact(model: nn.Module, data: list[dict], steps: int, lr: float) -> None:
    """``steps`` exact AdamW steps on the first batches of ``data`` (the later weight state)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for i, batch in enumerate(data[:steps]):
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()
        if (i + 1) % 50 == 0:
            print(f"  exact step {i + 1}/{steps}", flush=True)


def encoder_layers(model: nn.Module) -> list[str]:
    """The linear layers measured: all but the classifier head."""
    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, RandomizedLinear)) and "classifier" not in n]


def measure(model: nn.Module, rho: float, allocate: str, warm: list[dict], evals: list[dict],
            seed: int) -> tuple[dict, dict, int]:
    """``({config: {layer: [sum V, sum xty]}}, {layer: k}, saved bytes)`` for one patched copy."""
    model = copy.deepcopy(model)
    patch_linear(model, sketch="importance", rho=rho, allocate=allocate, seed=seed, **LAYOUT)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, RandomizedLinear)}
    for batch in warm:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    sums = {c: {} for c in CONFIGS}
    ks: dict[str, list[int]] = {}
    for j, batch in enumerate(evals):
        store: dict[str, list] = {}
        hooks = []
        for name, layer in layers.items():
            def pre(mod, inp, name=name, store=store):
                x = inp[0]
                rows = mod.context.rows_for(x)
                n = rows.shape[0] if rows is not None else x.numel() // x.shape[-1]
                k, uniform_k, _ = mod.num_rows(n)
                weights = mod.grad_norms.weights(tuple(x.shape), rows, x.device)
                x2 = x.detach().reshape(-1, x.shape[-1])
                design = mod.sketch.design(mod.sketch.scores(x2, rows, weights), k) if k < n \
                    else None
                store[name] = [x2, rows, k, uniform_k, design]

            def post(mod, inp, out, name=name, store=store):
                out.register_hook(lambda g: store[name].append(g.detach().reshape(-1, g.shape[-1])))
            hooks += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
        torch.manual_seed(1000 + j)  # the same dropout masks for every configuration
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        for h in hooks:
            h.remove()
        for name, (x2, rows, k, uk, design, dy) in store.items():
            if rows is not None:
                x2, dy = x2.index_select(0, rows), dy.index_select(0, rows)
            x2, dy = x2.double(), dy.double()
            xty = (x2.T @ dy).square().sum().item()
            n = x2.shape[0]
            values = {
                "blocksrht": expected_variance("blocksrht", x2, dy, uk) if uk < n else 0.0,
                "gaussian": expected_variance("gaussian", x2, dy, uk) if uk < n else 0.0,
                "importance": (importance_variance(x2, dy, design[0], design[1], design[2])
                               if design is not None else 0.0),
            }
            key = "importance+allocate" if allocate == "variance" else "importance"
            for c, v in values.items():
                if c.startswith("importance"):
                    c = key
                acc = sums[c].setdefault(name, [0.0, 0.0])
                acc[0] += v
                acc[1] += xty
            ks.setdefault(name, []).append(k)
    with SavedTensorMeter(model.parameters()) as meter:
        loss = model(**evals[0]).loss
    loss.backward()
    return sums, {n: statistics.mean(v) for n, v in ks.items()}, meter.bytes


def saved_bytes(model: nn.Module, sketch: str, rho: float, batch: dict) -> int:
    """Saved bytes of one training step of a copy patched with ``sketch`` at ``rho``."""
    model = copy.deepcopy(model)
    patch_linear(model, sketch=sketch, rho=rho, **LAYOUT)
    with SavedTensorMeter(model.parameters()) as meter:
        loss = model(**batch).loss
    loss.backward()
    return meter.bytes


def summarize(rel: dict[str, float], layers: list[str]) -> dict:
    """Mean and median over the encoder layers, the last block's mean, and the pooler."""
    enc = [n for n in layers if "pooler" not in n]
    last = sorted({n.split(".")[3] for n in enc if n.startswith("bert.encoder.layer.")},
                  key=int)[-1:] if any("encoder.layer." in n for n in enc) else []
    last_layers = [n for n in enc if last and f"encoder.layer.{last[0]}." in n]
    return {
        "mean": statistics.mean(rel[n] for n in enc),
        "median": statistics.median(rel[n] for n in enc),
        "last_layer_mean": statistics.mean(rel[n] for n in last_layers) if last_layers else None,
        "pooler": next((rel[n] for n in layers if "pooler" in n), None),
    }


def run(args) -> None:
    """The study as ``scripts/importance_variance.py`` runs it (its options in ``args``): write
    ``importance_variance[_quick].{json,md}`` and print the tables."""
    if args.quick:
        args.steps, args.warmup, args.batches, args.batch = 4, 3, 2, 8
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    print(env, flush=True)
    rhos = parse_list(args.rhos, float)
    model = build_model("minilm", args.quick).train()
    tokenizer = None
    if not args.quick:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    data = batches(args, tokenizer, model.config.vocab_size)
    train, warm, evals = (data[:args.steps], data[args.steps:args.steps + args.warmup],
                          data[args.steps + args.warmup:])
    layers = encoder_layers(model)
    results = []
    for state in ("step 0", f"step {args.steps}"):
        if state != "step 0":
            train_exact(model, train, args.steps, args.lr)
        for rho in rhos:
            sums, ks, nbytes = measure(model, rho, "uniform", warm, evals, seed=1)
            sums_a, ks_a, nbytes_a = measure(model, rho, "variance", warm, evals, seed=1)
            sums["importance+allocate"] = sums_a["importance+allocate"]
            rel = {c: {n: (v / x if x > 0 else 0.0) for n, (v, x) in sums[c].items()}
                   for c in CONFIGS}
            row = {
                "state": state, "rho": rho, "layers": rel,
                "k_uniform": ks, "k_allocate": ks_a,
                "summary": {c: summarize(rel[c], layers) for c in CONFIGS},
                "saved_bytes": {
                    "blocksrht": saved_bytes(model, "blocksrht", rho, evals[0]),
                    "gaussian": saved_bytes(model, "gaussian", rho, evals[0]),
                    "importance": nbytes, "importance+allocate": nbytes_a,
                },
            }
            results.append(row)
            s = row["summary"]
            print(f"{state} rho={rho:g}: mean rel. variance "
                  + ", ".join(f"{c} {s[c]['mean']:.3g}" for c in CONFIGS), flush=True)
    payload = {"environment": env, "args": vars(args), "results": results}
    write_outputs("importance_variance" + ("_quick" if args.quick else ""), payload,
                  tables(payload), args.out_dir)
    print(tables(payload))


def tables(payload: dict) -> str:
    """One markdown table per weight state and rate."""
    out = []
    for row in payload["results"]:
        s, b = row["summary"], row["saved_bytes"]
        base = s["blocksrht"]
        lines = [
            [c, r3(s[c]["mean"]), r3(s[c]["mean"] / base["mean"]),
             r3(s[c]["median"]),
             r3(s[c]["last_layer_mean"]) if s[c]["last_layer_mean"] is not None else "-",
             r3(s[c]["last_layer_mean"] / base["last_layer_mean"])
             if s[c]["last_layer_mean"] and base["last_layer_mean"] else "-",
             f"{b[c] / 1e6:.2f}", r3(b[c] / b["blocksrht"])]
            for c in CONFIGS
        ]
        out.append(fmt_table(
            ["estimate", "mean rel. var", "/ blocksrht", "median", "last layer", "/ blocksrht",
             "saved MB", "/ blocksrht"], lines,
            title=f"{row['state']}, rho = {row['rho']:g}: relative variance "
                  "V / |X^T dY|^2 over the 36 encoder linear layers"))
    return "\n\n".join(out) + "\n"
