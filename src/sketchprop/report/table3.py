"""Table 3: the bytes autograd saves for backward (and, where measured, the peak of a training
step) per task and batch for roberta-base, for the paper's layout, ours, checkpointing, compact
activations, LoRA, b-bit stored rows and exact with padding rows skipped, with the step time
against exact and against exact with padding skipped from the controlled benchmark (and the rows it
timed: full-length or the task's real lengths), and the paper's Table 3 beside it. Read from the
point files of ``scripts/memory_table.py`` (``results/memory``).

Writes ``results/tables/table3.md|csv``, and ``table3_roberta.md|csv`` from training runs
(``experiment=table3``, GPU peaks) where present.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .common import (
    EXACT_SKIP,
    RATES,
    bench_step_ratios,
    describe,
    key_of,
    load_memory,
    method_label,
    peak,
    rerun_step,
    rows_text,
    scheme,
    skip_note,
    write_table,
)

RERUN_MEMORY = "python scripts/memory_table.py --points table3 --parts bytes --methods exact-skip"

# The paper's Table 3 (Bershatsky et al. 2022): peak GPU memory in GiB over one epoch, roberta-base,
# Gaussian sketch; MRPC's exact value from the authors' README, values marked "~" read off their
# saved figure (about +-0.1 GiB).
PAPER_TABLE3 = {
    ("mrpc", 128): ("11.30", "~10.64", "9.20", "~8.72"),
    ("sst2", 256): ("~13.36", "~12.56", "~10.56", "~9.92"),
    ("qnli", 16): ("~11.68", "~11.12", "~10.44", "~10.00"),
    ("cola", 256): ("~9.68", "~8.96", "~7.72", "~7.28"),
}


def _families(p: dict) -> list[tuple[str, str, dict, dict[str, dict], str | None, str | None]]:
    """A point's method families: (label, key, record without a sketch, records by rate, bench name
    without a sketch, bench name prefix at a rate). Each family beyond the paper's layout and ours
    only where the point has it; a family whose sketch-free variant was not measured has an empty
    record there, and LoRA has no bench names (not timed)."""
    sketch = next((rec.get("patch", {}).get("sketch") for rec in p.get("ours", {}).values()),
                  "blocksrht")
    fams = [("paper layout (Gaussian)", "paper", p["exact"], p["paper"], "exact", "paper"),
            (f"ours ({sketch})", "ours", p["exact"], p["ours"], "exact", f"ours-{sketch}")]
    # Exact with padding rows skipped (exact gradients): one record, in the 'none' column; a row
    # even where the point lacks it, so that the table says it was not measured.
    fams.append(("exact, padding skipped", EXACT_SKIP, p.get(EXACT_SKIP) or {}, {}, EXACT_SKIP,
                 None))
    optional = [
        (f"checkpointing + ours ({sketch})", "ckpt+ours", p.get("ckpt"), "ckpt",
         f"ckpt+ours-{sketch}"),
        (f"ours ({sketch}) + compact activations", "ours+compact", p.get("compact") or {},
         "compact", f"ours-{sketch}+compact"),
        (f"checkpointing + ours ({sketch}) + compact activations", "ckpt+ours+compact", {}, None,
         f"ckpt+ours-{sketch}+compact"),
        (f"LoRA + ours ({sketch})", "lora+ours", p.get("lora"), None, None),
        (f"LoRA + ours ({sketch}) + compact activations", "lora+ours+compact", {}, None, None),
    ]
    for label, key, base, base_name, prefix in optional:
        if p.get(key) and base is not None:
            fams.append((label, key, base, p[key], base_name, prefix))
    if p.get("lora+ckpt"):
        fams.append(("LoRA + checkpointing", "lora+ckpt", p["lora+ckpt"], {}, None, None))
    # b-bit stored rows (the exact sketch, bits=b on every linear layer but the head): one record
    # each, in the 'none' column; the step benchmark times int<b> and int<b>+compact by these names.
    for extra, before, after in (("", "", ""), ("+compact", "", " + compact activations"),
                                 ("+ckpt", "checkpointing + ", "")):
        for b in (8, 4, 2):
            key = f"int{b}{extra}"
            if p.get(key):
                fams.append((f"{before}exact, {b}-bit rows{after}", key, p[key], {},
                             None if extra == "+ckpt" else key, None))
    if p.get("int4+lean"):  # the lean preset on 4-bit rows
        fams.append(("exact, 4-bit rows + lean", "int4+lean", p["int4+lean"], {}, "int4+lean",
                     None))
    return fams


def table3(memory_dir: Path, out: Path, bench_dir: Path | None = None) -> None:
    """Table 3 from the ``table3`` points in ``memory_dir``: ``out``/table3.md|csv."""
    points = load_memory(memory_dir)
    points = [p for p in points if p.get("table") == "table3"]
    if not points:
        return
    step = bench_step_ratios(bench_dir, "roberta-base") if bench_dir else {}
    header = ["task (batch)", "tokens (real / padded)", "method",
              "saved MiB none / 0.5 / 0.2 / 0.1", "saving vs exact none / 0.5 / 0.2 / 0.1",
              "analytic limit saving 0.5 / 0.2 / 0.1", "peak MiB none / 0.5 / 0.2 / 0.1",
              "peak saving vs exact none / 0.5 / 0.2 / 0.1",
              "step time / exact none / 0.5 / 0.2 / 0.1 (bench)",
              "step time / exact, padding skipped none / 0.5 / 0.2 / 0.1 (bench)",
              "paper GPU GiB none / 0.5 / 0.2 / 0.1", "paper peak saving 0.5 / 0.2 / 0.1"]
    rows = []
    for p in sorted(points, key=lambda p: (p["task"], p["batch_size"])):
        exact = p["exact"]["saved_activation_bytes"]
        exact_peak = peak(p["exact"])
        paper = PAPER_TABLE3.get((p["task"], p["batch_size"]))
        paper_saving = "-"
        if paper:
            none = float(paper[0].lstrip("~"))
            paper_saving = " / ".join(f"{1 - float(v.lstrip('~')) / none:.0%}" for v in paper[1:])
        for label, key, base, by_rate, base_name, prefix in _families(p):
            recs = [base] + [by_rate.get(f"{r:g}", {}) for r in RATES]
            saved = [rec.get("saved_activation_bytes") for rec in recs]
            peaks = [peak(rec) for rec in recs]
            times = [step.get(base_name)] + [step.get(prefix and f"{prefix}@{r:g}") for r in RATES]
            rows.append([
                f"{p['task']} ({p['batch_size']})", f"{p['real_tokens']} / {p['padded_tokens']}",
                label,
                " / ".join("-" if v is None else f"{v / 2**20:.0f}" for v in saved),
                " / ".join("-" if v is None else f"{1 - v / exact:.0%}" for v in saved),
                " / ".join(f"{1 - p['limit'][f'{r:g}'] / exact:.0%}" for r in RATES)
                if key in ("paper", "ours") and "limit" in p else "-",
                " / ".join("-" if v is None else f"{v / 2**20:.0f}" for v in peaks)
                if any(peaks) else "-",
                " / ".join("-" if v is None or not exact_peak else f"{1 - v / exact_peak:.0%}"
                           for v in peaks) if any(peaks) else "-",
                " / ".join("-" if t is None else f"{t['ratio']:.2f}" for t in times)
                if any(times) else "-",
                " / ".join("-" if t is None or "skip" not in t else f"{t['skip']['ratio']:.2f}"
                           for t in times) if any(t and "skip" in t for t in times) else "-",
                " / ".join(paper) if paper else "-", paper_saving,
            ])
    kinds = sorted({p["exact"]["peak_memory"]["kind"] for p in points if peak(p["exact"])})
    peak_at = ", ".join(f"{p['task']} ({p['batch_size']})" for p in points
                        if peak(p["exact"])) or "no point"
    commands = []
    for p in points:
        for c in p.get("command", "?").split(" ; "):
            if c not in commands:
                commands.append(c)
    info = step.get("_info")
    bench_text = (
        f"'step time' is the controlled benchmark's training-step time against exact for "
        f"roberta-base (random weights) at {info['batch']} tokens ({info['source']}), "
        f"{info['threads']} torch thread(s), {info['device']}: one process, each configuration "
        "interleaved with the exact model, the median of the bracketed per-sample ratios pooled "
        f"over {', '.join(info['runs'])} (results/bench); {rows_text(info)}. It is one batch "
        "shape, not each point's; checkpointing there is the reentrant variant, which keeps the "
        "same bytes. Exact multiplies its padding rows; ours and the b-bit rows skip them. "
        + skip_note(info, rerun_step("roberta-base")) if info else "'step time': no benchmark file.")
    if not all(p.get(EXACT_SKIP) for p in points):
        bench_text += (" 'exact, padding skipped' has no bytes at the points marked '-' (rerun: "
                       f"`{RERUN_MEMORY}`).")
    write_table(out / "table3", header, rows, (
        "# Table 3 analogue: saved-activation memory of roberta-base\n\n"
        "Bytes autograd saves for backward in one training step (unique storages, parameters "
        "excluded; device-independent), for the real roberta-base architecture with random "
        "weights, on batches with the real tasks' token lengths (dynamic padding, max length 512). "
        "'none' is the method without a sketch: the exact model for the paper's layout and ours, "
        "activation checkpointing alone (HF gradient checkpointing, non-reentrant: each encoder "
        "layer keeps its input and recomputes the rest in backward) for 'checkpointing + ours', "
        "compact activations alone (the exact linear layers) for 'ours + compact activations', "
        "LoRA alone for 'LoRA + ours', not measured ('-') where the family's sketch-free variant "
        "is not a row of its own. 'compact activations': patch_activations' defaults (dropout "
        "masks from seeds, attention probabilities and Q, K, V recomputed in backward from each "
        "attention block's input, 2-bit GELU codes). "
        "'LoRA': peft LoRA as adapter=lora trains it (configs/adapter/lora.yaml, the weights "
        "frozen), with ours on the adapters' lora_A inputs; its peak holds gradients and AdamW "
        "state of the adapters and the head only. "
        "'exact, b-bit rows': the exact sketch on every linear layer but the head (padding rows "
        "skipped, Q/K/V sharing one stored X) with its stored rows kept as b-bit codes and "
        "bfloat16 group ends (patch_linear(bits=b), method=exact method.bits=b), alone, with "
        "compact activations and with checkpointing; one record each, in the 'none' column. "
        "'exact, padding skipped': the exact sketch alone (padding rows skipped, Q/K/V sharing "
        "one stored X, exact gradients), one record in the 'none' column. "
        "Savings are against the exact model; the analytic limit stores every patched linear "
        "input at exactly rho and nothing else changes. 'peak' is the peak memory of one "
        "steady-state training step in a fresh process "
        f"({', '.join(kinds) or 'not measured'}; measured at {peak_at}, '-' elsewhere): weights, "
        "gradients and AdamW state included, like the paper's whole-GPU peaks, whose savings are "
        "therefore smaller than the saved-activation savings by construction. The paper's "
        "columns are its Table 3 (peak GPU memory over one epoch, Gaussian sketch); its peak "
        "saving is computed from its GiB columns. " + bench_text + "\n\n"
        f"Made by: {' ; '.join(commands)} on {points[0].get('hardware', '?')}."))


def table3_runs(runs: list[dict], experiment: str, stem: Path) -> None:
    """Table 3 from training runs (``experiment=table3``, GPU): peak memory over one epoch."""
    runs = [r for r in runs if r["_experiment"] == experiment]
    if not runs:
        return
    points = defaultdict(dict)
    for r in runs:
        batch = r.get("config", {}).get("train", {}).get("batch_size")
        # The exact model is the baseline; with checkpointing or compact activations it is a
        # method of its own ("exact (compact)"), whose peak sits in the 'none' column.
        key = method_label(key_of("exact", scheme(r))) if r["sketch"] == "exact" \
            else f"{r['sketch']} ({scheme(r)})"
        points[(r["task"], batch)].setdefault(key, {})[float(r["rho"])] = r["peak_memory_bytes"]
    header = ["task (batch)", "method", "peak GiB none / 0.5 / 0.2 / 0.1",
              "saving none / 0.5 / 0.2 / 0.1", "exact GiB", "paper GPU GiB none / 0.5 / 0.2 / 0.1"]
    rows = []
    for (task, batch), methods in sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        exact = methods.get("exact", {}).get(1.0)
        paper = " / ".join(PAPER_TABLE3.get((task, batch), ("-",)))
        for key in sorted(k for k in methods if k != "exact"):
            peaks = [methods[key].get(r) for r in (1.0, 0.5, 0.2, 0.1)]
            rows.append([
                f"{task} ({batch})", key,
                " / ".join("-" if v is None else f"{v / 2**30:.2f}" for v in peaks),
                " / ".join("-" if v is None or not exact else f"{1 - v / exact:.0%}" for v in peaks),
                "-" if exact is None else f"{exact / 2**30:.2f}", paper])
    write_table(stem, header, rows, (
        "# Table 3 from training runs: peak memory over one epoch\n\n"
        "peak_memory_bytes of each run (the CUDA allocator's peak on a GPU, as the paper measured "
        f"it). {describe(runs)}"))
