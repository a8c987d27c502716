"""Pick by budget: the largest batch each memory-saving configuration fits in a memory budget, and
how fast it trains, for one model and one GLUE task.

For the exact model, exact with padding rows skipped (exact gradients), ours (``--sketch``, the
recommended layout: Q/K/V share one sketch, padding rows skipped, head exact) at each rate,
activation checkpointing, and checkpointing + ours; the exact model and each of the last two also
with compact activations (``patch_activations``' defaults); and the exact sketch with its stored
rows as 8-, 4- or 2-bit codes (``bits``), and 4-bit with compact activations:

- **fixed part**, measured on the model: the bytes of its weights, of their gradients and of AdamW's
  two moments, allocated for real (a step on zero gradients) and summed;
- **saved bytes per padded token**, measured: the bytes autograd saves in one forward pass
  (``SavedTensorMeter``, as ``sketchprop.bench.memory_table`` counts them) of a reference batch of
  ``--ref-batch`` training examples that includes the task's longest one, padded to it. With
  dynamic padding every epoch has such a batch: the example of greatest length sits in some batch,
  which pads every row to it, so the epoch's peak is that batch's. A batch of ``B`` examples then
  saves ``B x L_max x (bytes per padded token)``, ``L_max`` the longest training example
  (tokenized, capped at ``--max-length``);
- **recompute** (checkpointing only): backward recomputes one encoder layer at a time and holds its
  activations while it runs: ``(saved bytes without checkpointing - with) / layers`` on top;
- **largest batch** = ``(budget - fixed) / (L_max x bytes per padded token + recompute per
  example)``, rounded down;
- **step time / exact** from the controlled benchmark (``results/bench/model_*.json`` of
  ``scripts/bench_model.py``: one process, interleaved with the exact model, median of the
  bracketed ratios, pooled over runs; its batch shape and rows, which the output names, not this
  task's), and **/ exact, padding skipped** where a run timed the configuration beside it.

The configuration marked ``<- fastest that fits`` is the fastest of those whose largest batch
reaches ``--batch``. Not in the estimate: the framework's own memory (CUDA context, allocator
slack, the Python process), the backward pass's short-lived buffers beyond one recomputed layer,
and the eval pass. Where ``results/memory`` holds measured step peaks of the same model and task,
the output compares the estimate with them.

Run by ``scripts/pick_budget.py`` (``make budget``), whose options :func:`run` takes.
"""

from __future__ import annotations

import gc
import json
import math
import random
from pathlib import Path

import torch

from ..bench import memory_table as mt
from ..bench.common import BadArgs, setup_device
from ..bench.models import build_model, minilm_path
from .common import EXACT_SKIP, bench_step_ratios, fmt_ratio, rerun_step, rows_text, skip_note

RHOS = mt.RHOS
# GLUE folder of each task name (Hydra's names and the folder names both work).
TASK_DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "rte": "RTE", "stsb": "STS-B",
             "wnli": "WNLI", "qnli": "QNLI"}
GIB = 2**30


# ------------------------------------------------------------------------------------ lengths


def task_dir(name: str) -> str:
    """The GLUE folder of a task name (``cola``, ``CoLA``, ``sts-b``...)."""
    key = name.lower().replace("-", "")
    if key not in TASK_DIRS:
        raise BadArgs(f"unknown task {name!r}; choose from {', '.join(TASK_DIRS)}")
    return TASK_DIRS[key]


def token_lengths(examples: list[tuple[str, str | None]], max_length: int) -> tuple[list[int], str]:
    """Token counts (special tokens included, truncated at ``max_length``): MiniLM's WordPiece
    tokenizer stands in for roberta's BPE, which needs the hub; a word count + 3 without it."""
    path = minilm_path()
    if path is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        second = [e[1] for e in examples] if examples[0][1] is not None else None
        enc = tok([e[0] for e in examples], second, truncation=True, max_length=max_length)
        return [len(ids) for ids in enc["input_ids"]], "MiniLM WordPiece tokenizer"
    return ([min(max_length, 3 + sum(len(t.split()) for t in e if t)) for e in examples],
            "whitespace word count + 3")


def reference_lengths(lengths: list[int], batch: int, seed: int = 0) -> list[int]:
    """The epoch's worst batch of size ``batch``: the longest example and ``batch - 1`` others
    drawn with a fixed seed (all of them padded to the longest)."""
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    rest = [n for i, n in enumerate(lengths) if i != longest]
    rng = random.Random(seed)
    others = rng.sample(rest, batch - 1) if batch - 1 <= len(rest) else \
        [rng.choice(rest) for _ in range(batch - 1)]
    return [lengths[longest], *others]


# ---------------------------------------------------------------------------------- measuring


# b-bit stored rows (the exact sketch, bits=b on every linear layer but the head): alone, and 4-bit
# with compact activations and with lean. Their memory_table and bench_model names are the same.
BITS = ("int8", "int4", "int2", "int4+compact", "int4+lean")


def configurations(sketch: str) -> dict[str, dict]:
    """Name -> memory_table method, in the order they are printed."""
    all_methods = mt.methods(sketch)
    names = ["exact", EXACT_SKIP, "compact",
             *[f"{kind}@{r:g}" for kind in ("ours", "ours+compact") for r in RHOS], "ckpt",
             *[f"{kind}@{r:g}" for kind in ("ckpt+ours", "ckpt+ours+compact") for r in RHOS],
             *BITS]
    return {n: all_methods[n] for n in names}


def fixed_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Weights, gradients and AdamW state of ``model``, each allocated and its bytes summed (the
    model's own parameters and ``.grad`` are left as they were)."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-5)
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    for p, g in zip(params, saved_grads, strict=True):
        p.grad = g
    del opt
    gc.collect()
    return {"weights": weights, "grads": grads, "adamw_state": state,
            "total": weights + grads + state}


def encoder_layers(model: torch.nn.Module) -> int:
    return int(getattr(model.config, "num_hidden_layers", 1))


def measure(model, lengths: list[int], sketch: str) -> dict[str, int]:
    """Saved bytes of one forward pass of the batch with ``lengths`` per configuration."""
    batch = mt.make_batch(model, lengths)
    return {name: mt.saved_bytes(model, batch, method)
            for name, method in configurations(sketch).items()}


# ----------------------------------------------------------------------------------- planning


def plan(saved: dict[str, int], padded_tokens: int, fixed: int, layers: int, l_max: int,
         budget: int, batch: int, ratios: dict[str, dict], sketch: str) -> list[dict]:
    """One row per configuration: bytes per padded token, recompute bytes per example, the largest
    batch within ``budget`` and the benchmark's step-time ratio; ``fastest`` marks the quickest
    configuration whose largest batch reaches ``batch``."""
    rows = []
    for name, nbytes in saved.items():
        kind, _, rho = name.partition("@")
        per_token = nbytes / padded_tokens
        recompute = 0.0
        if kind.startswith("ckpt"):
            # What one checkpointed layer holds while backward recomputes it: the same
            # configuration without checkpointing, per layer.
            plain = saved["exact"] if kind == "ckpt" else saved[f"{kind[len('ckpt+'):]}@{rho}"]
            recompute = max(0.0, plain - nbytes) / padded_tokens * l_max / layers
        per_example = per_token * l_max + recompute
        room = budget - fixed
        largest = max(0, math.floor(room / per_example)) if room > 0 else 0
        bench = {"exact": "exact", EXACT_SKIP: EXACT_SKIP, "compact": "compact", "ckpt": "ckpt",
                 "ours": f"ours-{sketch}", "ckpt+ours": f"ckpt+ours-{sketch}",
                 "ours+compact": f"ours-{sketch}+compact",
                 "ckpt+ours+compact": f"ckpt+ours-{sketch}+compact", **{b: b for b in BITS}}[kind]
        bench = bench if not rho else f"{bench}@{rho}"
        rows.append({"name": name, "kind": kind, "rho": float(rho) if rho else None,
                     "per_token": per_token, "recompute_per_example": recompute,
                     "per_example": per_example, "largest_batch": largest,
                     "memory_at_batch": fixed + batch * per_example,
                     "fits": largest >= batch, "time": ratios.get(bench), "fastest": False})
    fitting = [r for r in rows if r["fits"] and r["time"]]
    if fitting:
        min(fitting, key=lambda r: r["time"]["ratio"])["fastest"] = True
    return rows


LABELS = {"exact": "exact", EXACT_SKIP: "exact, padding skipped",
          "compact": "compact activations", "ours": "ours", "ckpt": "checkpointing",
          "ckpt+ours": "checkpointing + ours", "ours+compact": "ours + compact activations",
          "ckpt+ours+compact": "checkpointing + ours + compact activations",
          "int8": "exact, 8-bit rows", "int4": "exact, 4-bit rows", "int2": "exact, 2-bit rows",
          "int4+compact": "exact, 4-bit rows + compact activations",
          "int4+lean": "exact, 4-bit rows + lean"}


def render(rows: list[dict], meta: dict) -> str:
    mib = 2**20
    lines = [f"<!-- generated by: {meta['command']} -->",
             f"# Pick by budget: {meta['model']} on {meta['task']}, "
             f"{meta['budget_gib']:g} GiB, batch {meta['batch']}", "",
             f"Command: `{meta['command']}`", "",
             f"Model: {meta['model_desc']}. Task lengths: {meta['n_examples']} {meta['task']} "
             f"training examples ({meta['lengths_source']}, truncated at {meta['max_length']}); the "
             f"longest has {meta['l_max']} tokens, so with dynamic padding each epoch has a batch "
             f"padded to {meta['l_max']}: every batch below is sized for it. Saved bytes measured "
             f"on a reference batch of {meta['ref_batch']} examples (the longest and "
             f"{meta['ref_batch'] - 1} drawn with seed 0), {meta['padded_tokens']} padded / "
             f"{meta['real_tokens']} real tokens. Fixed part, measured: weights "
             f"{meta['fixed']['weights'] / mib:.0f} MiB + gradients "
             f"{meta['fixed']['grads'] / mib:.0f} MiB + AdamW state "
             f"{meta['fixed']['adamw_state'] / mib:.0f} MiB = "
             f"{meta['fixed']['total'] / mib:.0f} MiB. Step time / exact: {meta['bench_desc']}",
             "", "| configuration | rho | saved KiB per padded token | recompute MiB per example "
             f"| largest batch in {meta['budget_gib']:g} GiB | GiB at batch {meta['batch']} "
             "| step time / exact (bench) | step time / exact, padding skipped (bench) | |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        time = fmt_ratio(r["time"])
        skip = fmt_ratio((r["time"] or {}).get("skip"))
        mark = ("**<- fastest that fits**" if r["fastest"] else
                ("fits" if r["fits"] else f"does not fit batch {meta['batch']}"))
        rho = "-" if r["rho"] is None else f"{r['rho']:g}"
        recompute = ("-" if not r["recompute_per_example"]
                     else f"{r['recompute_per_example'] / mib:.2f}")
        lines.append(
            f"| {LABELS[r['kind']]} | {rho} | {r['per_token'] / 1024:.1f} | {recompute} | "
            f"{r['largest_batch']} | {r['memory_at_batch'] / 2**30:.2f} | {time} | {skip} | "
            f"{mark} |")
    if not any(r["fastest"] for r in rows):
        lines += ["", f"No configuration fits batch {meta['batch']} in {meta['budget_gib']:g} GiB."]
    lines += ["", "Not in the estimate: the framework's own memory (CUDA context, allocator slack, "
              "the Python process), short-lived buffers of the backward pass beyond one "
              "recomputed layer, and the evaluation pass; leave headroom for them. The step-time "
              "ratios come from the benchmark's batch shape and device, not this task's."]
    if meta.get("check"):
        lines += ["", "Check against measured step peaks (`results/memory`, "
                  f"{meta['check_kind']}): the estimate at each point's own padded tokens, "
                  "against the measured peak minus the process's memory before the step plus "
                  "the weights and AdamW state (what the estimate counts).", "",
                  "| point | configuration | rho | estimated MiB | measured MiB | estimate / "
                  "measured |", "|---|---|---|---|---|---|"]
        for c in meta["check"]:
            rho = "-" if c["rho"] is None else f"{c['rho']:g}"
            lines.append(f"| {c['point']} | {LABELS[c['kind']]} | {rho} | "
                         f"{c['estimate'] / mib:.0f} | {c['measured'] / mib:.0f} | "
                         f"{c['estimate'] / c['measured']:.2f} |")
    return "\n".join(lines) + "\n"


def check_against_peaks(rows: list[dict], fixed: dict, memory_dir: Path, task: str,
                        l_max: int) -> tuple[list[dict], str]:
    """Estimate vs measured step memory at the points of ``scripts/memory_table.py`` for this task
    (roberta-base) that measured a peak."""
    out, kinds = [], set()
    by_name = {r["name"]: r for r in rows}
    points = [json.loads(f.read_text()) for f in memory_dir.glob("*.json")] \
        if memory_dir.exists() else []
    for p in sorted(points, key=lambda p: (p.get("padded_tokens", 0), p.get("table", ""))):
        if p.get("task") != task.lower().replace("-", "") or "--quick" in p.get("model", ""):
            continue
        for name, row in by_name.items():
            rec = mt.record(p, name)
            pm = rec.get("peak_memory")
            if not pm:
                continue
            kinds.add(pm.get("kind", "?"))
            measured = (pm["peak_bytes"] - pm["before_step_bytes"] + fixed["weights"]
                        + fixed["adamw_state"])
            estimate = (fixed["total"] + row["per_token"] * p["padded_tokens"]
                        + row["recompute_per_example"] / l_max * p["padded_tokens"])
            out.append({"point": f"{p['task']} batch {p['batch_size']} ({p['padded_tokens']} "
                                 "padded tokens)", "kind": row["kind"], "rho": row["rho"],
                        "estimate": estimate, "measured": measured})
    return out, ", ".join(sorted(kinds))


def run(args, command: str) -> str:
    """The pick-by-budget table for ``scripts/pick_budget.py``'s options ``args`` (the script
    prints it and writes ``--out``); ``command`` is recorded in it. Bad options raise
    :class:`~sketchprop.bench.common.BadArgs` before any work."""
    task = task_dir(args.task)
    glue = Path(args.glue_dir)
    if not (glue / task / "train.tsv").is_file():
        raise BadArgs(f"{glue} lacks {task}/train.tsv")
    if not (math.isfinite(args.budget_gib) and args.budget_gib > 0) or args.batch < 1 \
            or args.ref_batch < 1:
        raise BadArgs("--budget-gib, --batch and --ref-batch must be positive")
    dev = setup_device(args.device, args.threads)
    examples = mt.read_split(glue, task, "train")
    lengths, source = token_lengths(examples, args.max_length)
    ref = reference_lengths(lengths, args.ref_batch)
    l_max = max(lengths)
    model = build_model(args.model, args.quick).to(dev).train()
    fixed = fixed_bytes(model)
    saved = measure(model, ref, args.sketch)
    padded = len(ref) * max(ref)

    ratios = bench_step_ratios(Path(args.bench_dir), args.model)
    info = ratios.get("_info")
    bench_desc = (f"{args.model} training step at {info['batch']} tokens ({info['source']}), "
                  f"{info['threads']} torch thread(s), {info['device']}, median (interquartile "
                  f"range) of the bracketed ratios pooled over {', '.join(info['runs'])}; "
                  f"{rows_text(info)}. Exact multiplies its padding rows; ours and the b-bit rows "
                  "skip them. " + skip_note(info, rerun_step(args.model))
                  if info else "no benchmark file for this model.")
    rows = plan(saved, padded, fixed["total"], encoder_layers(model), l_max,
                int(args.budget_gib * GIB), args.batch, ratios, args.sketch)
    meta = {"command": command, "model": args.model, "task": task, "budget_gib": args.budget_gib,
            "batch": args.batch,
            "model_desc": (f"{args.model}" + (" (random weights from its config, no download)"
                                             if args.model == "roberta-base" else "")
                           + (", --quick: a tiny stand-in" if args.quick else "")
                           + f", {encoder_layers(model)} encoder layers"),
            "n_examples": len(lengths), "lengths_source": source, "max_length": args.max_length,
            "l_max": l_max, "ref_batch": args.ref_batch, "padded_tokens": padded,
            "real_tokens": sum(ref), "fixed": fixed, "bench_desc": bench_desc}
    if args.model == "roberta-base" and not args.quick:
        meta["check"], meta["check_kind"] = check_against_peaks(rows, fixed, Path(args.memory_dir),
                                                                task, l_max)
    text = render(rows, meta)
    return text
