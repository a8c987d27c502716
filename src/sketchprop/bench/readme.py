"""Fill the generated blocks of ``results/bench/README.md`` from the benchmark JSON files.

The README's prose is written by hand; every number in it sits between markers
``<!-- BEGIN name -->`` and ``<!-- END name -->`` and is regenerated here from the JSON files the
benchmark scripts wrote (``results/bench/*.json``). Blocks:

- ``runs``: each run's command, hardware, torch threads, C allocator setting (``default`` for the
  runs made before a benchmark could set it), load average at start and end, commit;
- ``targets``: every speed and memory target of the benchmarks with the measured value and met /
  missed; a time target whose range crosses its limit is "unsettled" (met or missed by the median
  alone, within the run's noise): the interquartile range of the bracketed ratios for the
  roberta-base step benchmark, the whole range over rounds for the decoders, and for the speed
  benchmark the 95% interval of the geometric mean of its per-round ratios (met or missed by that
  mean);
- ``<stem>``: the markdown tables of one run (``results/bench/<stem>.md``).

``scripts/bench_report.py`` runs :func:`fill` on ``results/bench``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from sketchprop.patching import activation_defaults

from .common import fmt_table, pct, r3
from .layer_step import RECOMMENDED

LAYER = "layer_cpu"
# Model runs, in order of preference for the saved-bytes numbers (all runs measure them identically).
MODEL_FILES = ("model_cpu_roberta_bytes", "model_cpu_roberta_time", "model_cpu_roberta_gauss",
               "model_cpu_roberta_ckpt", "model_cpu_roberta_exactskip", "model_cpu_roberta_memory",
               "model_cpu_roberta_compact_bytes", "model_cpu_roberta_compact_time",
               "model_cpu_roberta_compact_alone_time", "model_cpu_roberta_bits_time",
               "model_cpu_roberta_lnout_time")
OVERHEAD = "overhead_cpu"
# Importance sampling against blocksrht: variance on real batches, one layer's time, a step's time.
IMPORTANCE = ("importance_variance", "layer_cpu_importance", "model_cpu_minilm_importance")
# Decoder LMs (scripts/decoders.py): the Llama shape's saved bytes, with LoRA, and step time.
DECODERS = ("decoders_llama", "decoders_llama_lora", "decoders_time", "decoders_llama_lean")
SPEED = "speed_cpu"  # scripts/bench_speed.py: its targets, each with its verdict


def load(d: Path, stem: str) -> dict | None:
    """``d/<stem>.json`` (None where there is none)."""
    p = d / f"{stem}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def runs_block(d: Path) -> str:
    """The ``runs`` block: one row per run (``--quick`` runs left out)."""
    rows = []
    for p in sorted(d.glob("*.json")):
        if "_quick" in p.stem:
            continue
        env = json.loads(p.read_text()).get("environment", {})
        rows.append([f"`{p.stem}`", f"`{env.get('command', '')}`", env.get("cpu", ""),
                     env.get("torch_threads", ""), env.get("allocator", "default").split()[0],
                     env.get("loadavg_start", ""),
                     env.get("loadavg_end", ""), env.get("time", ""), env.get("git_commit", "")])
    return fmt_table(["run", "command", "CPU", "threads", "allocator", "load at start (1/5/15 min)",
                      "load at end", "started", "commit"], rows)


def _model_runs(d: Path, model: str) -> list[tuple[str, dict]]:
    """``(stem, methods)`` of every model run of ``model``, in :data:`MODEL_FILES` order."""
    out = []
    for stem in MODEL_FILES:
        data = load(d, stem)
        for res in (data or {}).get("results", []):
            if res["model"] == model:
                out.append((stem, res["methods"]))
    return out


def _first(runs, *names, key):
    """The first run holding ``key`` for every one of ``names``: ``(stem, [records])``."""
    for stem, ms in runs:
        if all(n in ms and key in ms[n] for n in names):
            return stem, [ms[n] for n in names]
    return None, None


def targets_block(d: Path) -> str:
    """The ``targets`` block: every target with its measured value, met or missed."""
    rows = []

    def add(what, value, target, ok, where, unsettled=False):
        verdict = "met" if ok else "**missed**"
        rows.append([what, value, target, f"unsettled ({verdict})" if unsettled else verdict,
                     where])

    layer = load(d, LAYER)
    if layer:
        rec = RECOMMENDED["cpu"]
        for g in layer["groups"]:
            if g["shape"] == "768x3072" and g["rows"] == 4096:
                for rho, lim in ((0.1, 0.85), (0.5, 1.0)):
                    c = g["configs"].get(f"{rec}@{rho:g}")
                    if c:
                        add(f"768->3072 layer, 4096 rows, fwd+bwd, {rec} rho {rho:g} / nn.Linear",
                            r3(c["ratio"]), f"<= {lim}", c["ratio"] <= lim, LAYER)
    runs = _model_runs(d, "roberta-base")
    if runs:
        ours_name = f"ours-{RECOMMENDED['cpu']}"
        for rho, lim in ((0.1, 0.88), (0.2, None), (0.5, 0.97)):
            ours = f"{ours_name}@{rho:g}"
            stem, recs = _first(runs, ours, key="time")
            if recs and lim is not None:
                r = recs[0]["time"]["ratio"]
                add(f"roberta-base step 16x128, ours rho {rho:g} / exact", r3(r), f"<= {lim}",
                    r <= lim, stem)
            for other in (f"paper@{rho:g}", f"ours-gaussian@{rho:g}"):
                stem, recs = _first(runs, ours, other, key="time")
                if recs:
                    a, b = recs[0]["time"]["ratio"], recs[1]["time"]["ratio"]
                    add(f"roberta-base step, ours rho {rho:g} faster than dense Gaussian "
                        f"({other.split('@')[0]}), both / exact", f"{r3(a)} vs {r3(b)}",
                        "ours < Gaussian", a < b, stem)
            stem, recs = _first(runs, "exact", ours, key="saved_bytes")
            if recs:
                ex, o = recs
                gap = 100 * (o["saved_bytes"] - o["analytic_limit_bytes"]) / ex["saved_bytes"]
                add(f"saved bytes, ours rho {rho:g}: above the analytic limit by",
                    f"{gap:+.1f} pp", "<= +3 pp", gap <= 3.0, stem)
            stem, recs = _first(runs, "exact", ours, f"paper@{rho:g}", key="saved_bytes")
            if recs:
                ex, o, p = recs
                add(f"saved bytes, ours rho {rho:g} below the paper's scheme",
                    f"{pct(o['saved_bytes'] / ex['saved_bytes'])} vs "
                    f"{pct(p['saved_bytes'] / ex['saved_bytes'])} of exact", "ours < paper",
                    o["saved_bytes"] < p["saved_bytes"], stem)
        compact_targets(runs, f"{ours_name}+compact@0.1", add)
        bits_targets(runs, add)
        layernorm_targets(runs, ours_name, add)
    importance_targets(d, add)
    decoder_targets(d, add)
    speed = load(d, SPEED)
    for t in (speed or {}).get("targets", []):
        if "low" in t:  # the 95% interval of the geometric mean decides (holds None: it crosses)
            add(f"{t['what']}, {t['cell']}", f"{r3(t['mean'])} [{t['low']:.3f}-{t['high']:.3f}]",
                f"<= {t['limit']}", t["mean"] <= t["limit"] if t["holds"] is None else t["holds"],
                SPEED, t["holds"] is None)
        else:  # a run made before the intervals: its median and range
            add(f"{t['what']}, {t['cell']}", f"{r3(t['ratio'])} ({t['min']:.2f}-{t['max']:.2f})",
                f"<= {t['limit']}", t["holds"], SPEED, t["min"] <= t["limit"] < t["max"])
    ov = load(d, OVERHEAD)
    if ov:
        for shape, rec in ov["exact_path"].items():
            add(f"`exact` sketch path / nn.Linear, fwd+bwd, {shape} "
                f"(nn.Linear {rec['nn_ms']:.3g} ms)", r3(rec["ratio"]), "<= 1.05",
                rec["ratio"] <= 1.05, OVERHEAD)
        if "exact_model" in ov:
            r = ov["exact_model"]["ratio"]
            add(f"`exact` sketch path / nn.Linear, {ov['exact_model']['model']} training step",
                r3(r), "<= 1.05", r <= 1.05, OVERHEAD)
    return fmt_table(["what", "measured", "target", "", "run"], rows)


def compact_targets(runs, name: str, add) -> None:
    """Compact activations on top of ours at rho 0.1: a step at most 0.90x exact's time, saved
    bytes at most 0.27x exact's."""
    stem, recs = _first(runs, name, key="time")
    if recs:
        r = recs[0]["time"]["ratio"]
        add("roberta-base step 16x128, ours rho 0.1 + compact activations / exact", r3(r),
            "<= 0.9", r <= 0.9, stem)
    stem, recs = _first(runs, "exact", name, key="saved_bytes")
    if recs:
        r = recs[1]["saved_bytes"] / recs[0]["saved_bytes"]
        add("saved bytes, ours rho 0.1 + compact activations / exact", r3(r), "<= 0.27",
            r <= 0.27, stem)
        # LayerNorm from its output (in the compact set): from 0.150x to at most 0.12x.
        add("saved bytes, ours rho 0.1 + compact activations (LayerNorm from its output) / exact",
            r3(r), "<= 0.12", r <= 0.12, stem)
    lnstored = name.replace("+compact", "+lnstored")
    stem, recs = _first(runs, "exact", "compact", "lnstored", name, lnstored, key="saved_bytes")
    if recs:
        ex, on, off, ours_on, ours_off = (x["saved_bytes"] for x in recs)
        add("saved bytes, LayerNorm from its output against its stored input, share of exact: "
            "compact alone vs ours rho 0.1 + compact",
            f"{(off - on) / ex:.3f} vs {(ours_off - ours_on) / ex:.3f}", "at least the same",
            (off - on) >= (ours_off - ours_on), stem)


def _time(rec: dict, lim: float) -> tuple[str, bool, bool]:
    """A time record against an upper limit: its median ratio with the interquartile range of the
    per-round ratios, whether the median meets the limit, and whether that range crosses it."""
    t = rec["time"]
    lo, hi = t.get("ratio_q1", t["ratio"]), t.get("ratio_q3", t["ratio"])
    return f"{r3(t['ratio'])} ({lo:.2f}-{hi:.2f})", t["ratio"] <= lim, lo <= lim < hi


def bits_targets(runs, add) -> None:
    """4-bit stored rows (the exact sketch, ``bits=4``): a step at most 1.10x exact's time, and
    at most 1.20x with compact activations."""
    for name, lim in (("int4", 1.10), ("int4+compact", 1.20)):
        stem, recs = _first(runs, name, key="time")
        if recs:
            value, ok, unsettled = _time(recs[0], lim)
            add(f"roberta-base step 16x128, exact + 4-bit rows{name[4:].replace('+', ' + ')} / exact",
                value, f"<= {lim}", ok, stem, unsettled)


def layernorm_targets(runs, ours_name: str, add) -> None:
    """LayerNorm from its output: the compact set's step at most 0.03x exact's time slower than
    the same set keeping LayerNorm's input (``+lnstored``), alone and on ours at rho 0.1."""
    for label, on, off in (("compact", "compact", "lnstored"),
                           ("ours rho 0.1 + compact", f"{ours_name}+compact@0.1",
                            f"{ours_name}+lnstored@0.1")):
        stem, recs = _first(runs, on, off, key="time")
        if recs:
            a, b = recs[0]["time"], recs[1]["time"]
            gap = a["ratio"] - b["ratio"]
            spread = max(t.get("ratio_q3", t["ratio"]) - t.get("ratio_q1", t["ratio"])
                         for t in (a, b))
            add(f"roberta-base step 16x128, {label}: LayerNorm from its output minus stored "
                f"input, in exact's time", f"{gap:+.3f} ({r3(a['ratio'])} vs "
                f"{r3(b['ratio'])})", "<= +0.03", gap <= 0.03, stem, abs(gap - 0.03) < spread)


def decoder_targets(d: Path, add) -> None:
    """The Llama shape (hidden 768, 12 layers, GQA 12/4, MLP 2048, vocabulary 32000): compact
    activations keep at most 0.55x exact's saved bytes, LoRA + ours 0.1 + compact at most 0.30x,
    4 bits + lean at most 0.05x (checkpointing's share on roberta-base is 0.06x); compact's step at
    most 1.10x exact's time."""
    size, lora, timed, lean = (load(d, stem) for stem in DECODERS)
    for data, stem, name, lim in ((size, DECODERS[0], "compact", 0.55),
                                  (lora, DECODERS[1], "lora+ours+compact", 0.30),
                                  (lean, DECODERS[3], "int4+lean", 0.05)):
        rows = (data or {}).get("results", {}).get("llama", {})
        if name in rows:
            r = rows[name]["saved_bytes"] / rows["exact"]["saved_bytes"]
            label = name.replace("+", " + ").replace("(", " (")
            add(f"Llama shape, saved bytes, {label}{'' if '(' in name else ' (defaults)'} / exact",
                r3(r), f"<= {lim}", r <= lim, stem)
    rows = (timed or {}).get("results", {}).get("llama", {})
    mlp = activation_defaults()["mlp"]
    for name in ("compact", f"compact(mlp={mlp})"):  # the defaults, by either name
        if "time_ratios" in rows.get(name, {}):
            rs = sorted(rows[name]["time_ratios"])
            r = rows[name]["time_ratio"]
            shape = f"{timed['args']['batch']}x{timed['args']['length']}"
            add(f"Llama shape, step {shape}, compact (defaults: mlp={mlp}) / exact",
                f"{r3(r)} ({rs[0]:.2f}-{rs[-1]:.2f})", "<= 1.1", r <= 1.1, DECODERS[2],
                rs[0] <= 1.1 < rs[-1])
            break


def importance_targets(d: Path, add) -> None:
    """The targets of importance sampling (and with allocation), each against blocksrht."""
    var_stem, layer_stem, model_stem = IMPORTANCE
    var = load(d, var_stem)
    for row in (var or {}).get("results", []):
        s, b = row["summary"], row["saved_bytes"]
        where = f"{row['state']}, rho {row['rho']:g}"
        for c in ("importance", "importance+allocate"):
            r = s[c]["mean"] / s["blocksrht"]["mean"]
            add(f"{c}: mean relative variance over layers / blocksrht's, {where}", r3(r),
                "<= 0.6", r <= 0.6, var_stem)
            r = s[c]["last_layer_mean"] / s["blocksrht"]["last_layer_mean"]
            add(f"{c}: last layer's relative variance / blocksrht's, {where}", r3(r),
                "<= 0.2", r <= 0.2, var_stem)
            r = b[c] / b["blocksrht"]
            add(f"{c}: saved bytes / blocksrht's, {where}", r3(r), "<= 1.02", r <= 1.02,
                var_stem)
    layer = load(d, layer_stem)
    for g in (layer or {}).get("groups", []):
        for rho in (0.2, 0.1):
            imp, blk = g["configs"].get(f"importance@{rho:g}"), g["configs"].get(f"blocksrht@{rho:g}")
            if imp and blk:
                r = imp["ratio"] / blk["ratio"]
                add(f"{g['shape']} layer, {g['rows']} rows, importance / blocksrht time, rho "
                    f"{rho:g}", r3(r), "<= 1.05", r <= 1.05, layer_stem)
    model = load(d, model_stem)
    for res in (model or {}).get("results", []):
        ms = res["methods"]
        for rho in (0.2, 0.1):
            for c in ("ours-importance", "ours-importance+alloc"):
                imp, blk = ms.get(f"{c}@{rho:g}"), ms.get(f"ours-blocksrht@{rho:g}")
                if imp and blk and imp.get("time") and blk.get("time"):
                    r = imp["time"]["ratio"] / blk["time"]["ratio"]
                    add(f"{res['model']} step, {c} / ours-blocksrht time, rho {rho:g}", r3(r),
                        "<= 1.05", r <= 1.05, model_stem)


def table_block(d: Path, stem: str) -> str:
    """The tables of one run (its ``.md`` file less the generated-by line)."""
    p = d / f"{stem}.md"
    if not p.is_file():
        return f"(no run yet: `{stem}`)"
    return "\n".join(line for line in p.read_text().splitlines()
                     if not line.startswith("<!-- generated"))


def fill(d: Path) -> None:
    """Rewrite the generated blocks of ``d/README.md`` in place from the JSON files in ``d``."""
    readme = d / "README.md"
    text = readme.read_text()

    def block(m: re.Match) -> str:
        name = m.group(1)
        if name == "runs":
            body = runs_block(d)
        elif name == "targets":
            body = targets_block(d)
        else:
            body = table_block(d, name)
        return f"<!-- BEGIN {name} -->\n{body}\n<!-- END {name} -->"

    new = re.sub(r"<!-- BEGIN (\S+) -->.*?<!-- END \1 -->", block, text, flags=re.S)
    readme.write_text(new)
    print(f"updated {readme}")
