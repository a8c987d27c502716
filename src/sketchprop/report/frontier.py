"""The accuracy-memory-time frontier: every configuration the repository offers as one point.

- x: the bytes one training step keeps for backward, as a share of exact's (roberta-base, CoLA at
  batch 256 with the real CoLA lengths: ``results/memory/table3-cola-b256.json``, from
  ``make memory``);
- y: the CoLA dev score (MCC x100, best epoch) minus exact's, paired by seed (MiniLM, the CPU
  recipe: ``results/runs/minilm_cpu``), its standard error and n; LoRA's runs have their own
  learning rate (``results/runs/lora_cpu``), so they cannot pair with exact's: their difference is
  unpaired (difference of means, SE from both sides' spreads);
- label: the training step's time over exact's (roberta-base 16x128, the step benchmark of
  ``scripts/bench_model.py``: ``results/bench/model_*.json``), where it was timed, and over that of
  exact with padding rows skipped where a run timed the configuration beside it; on the task's
  real lengths, and on full-length rows where a run timed those.

Exact with padding rows skipped (``exact-skip``: the exact sketch with ``skip_padding``) is a point
of its own: exact's gradients (its score is exact's by construction), only the non-padding rows
stored and multiplied. It is the fair baseline of the configurations that skip padding rows too
(the sketches of our layout and the b-bit codes): against exact alone, part of their gain on padded rows
is padding that exact could skip as well.

Checkpointing computes the same gradients as the model without it (tested), so its score is
exact's by construction (y = 0, no runs needed). A configuration with no bytes measured is listed
and not drawn. The Pareto front: the points no other point beats on both axes (fewer or equal
bytes and a higher or equal mean score). Built by ``make tables``
(``scripts/make_tables.py``): ``results/tables/frontier.md|csv``, ``results/figures/frontier.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .common import (
    EXACT,
    EXACT_SKIP,
    FULL,
    REAL,
    bench_step_ratios,
    describe,
    key_of,
    load_runs,
    method_key,
    paired,
    pyplot,
    rerun_step,
    rows_text,
    save_figure,
    score,
    skip_note,
    write_table,
)
from .comparisons import IMPORTANCE_ALLOC
from .lora import LORA

MEMORY_POINT = "table3-cola-b256.json"
BENCH_MODEL = "roberta-base"
RERUN_MEMORY = ("python scripts/memory_table.py --points table3 --tasks CoLA --parts bytes "
                "--methods exact-skip --threads 1")
# Importance stores the same k rows as a seeded sketch at its rate plus an int32 index and a float32
# scale per row (8 bytes beside a 3072-byte roberta-base row), and allocation keeps the uniform
# rate's bytes: their bytes are read from ours at the same rate.
BYTES_AS_OURS = ("importance",)


@dataclass(frozen=True)
class Config:
    """One configuration: its label, its runs (experiment and method key), its record in the
    memory point (family and rate, None for a family without one) and its step-benchmark name."""

    label: str
    experiment: str | None
    key: tuple | None
    memory: tuple[str, str | None] | None
    bench: str | None
    by_construction: bool = False  # exact's gradients: exact's score, no runs


def configs() -> list[Config]:
    """Every configuration the frontier places, in table order before sorting."""
    out = [Config("exact", "minilm_cpu", EXACT, ("exact", None), "exact"),
           Config("checkpointing", None, None, ("ckpt", None), "ckpt", by_construction=True),
           Config("exact, padding skipped", None, None, ("exact-skip", None), EXACT_SKIP,
                  by_construction=True),
           Config("compact activations", "minilm_cpu", key_of("exact", "compact"),
                  ("compact", None), "compact")]
    for bits in (8, 4, 2):
        out.append(Config(f"int{bits}", "minilm_cpu", key_of("exact", f"int{bits}"),
                          (f"int{bits}", None), f"int{bits}"))
    out.append(Config("int4 + compact activations", "minilm_cpu",
                      key_of("exact", "int4+compact"), ("int4+compact", None), "int4+compact"))
    out.append(Config("int4 + lean", "minilm_cpu", key_of("exact", "int4+lean"),
                      ("int4+lean", None), "int4+lean"))
    out.append(Config("int4 + lean, scales over 128 columns", "minilm_cpu",
                      key_of("exact", "int4g128+lean"), ("int4g128+lean", None), "int4g128+lean"))
    for rho in ("0.5", "0.2", "0.1"):
        r = float(rho)
        out.append(Config(f"blocksrht (ours) {rho}", "minilm_cpu", key_of("blocksrht", "ours", r),
                          ("ours", rho), f"ours-blocksrht@{rho}"))
        for sketch in ("gaussian", "rademacher", "dct", "dft"):
            # The paper's layout stores k rows per layer whatever the sketch: the Gaussian's bytes.
            out.append(Config(f"{sketch} (paper) {rho}", "minilm_cpu",
                              key_of(sketch, "paper", r), ("paper", rho),
                              f"paper@{rho}" if sketch == "gaussian" else None))
    for rho in ("0.2", "0.1"):
        out.append(Config(f"blocksrht (ours) {rho} + compact activations", "minilm_cpu",
                          key_of("blocksrht", "ours+compact", float(rho)),
                          ("ours+compact", rho), f"ours-blocksrht+compact@{rho}"))
    out += [
        Config("blocksrht (ours) 0.1 + checkpointing", "minilm_cpu",
               key_of("blocksrht", "ours+ckpt", 0.1), ("ckpt+ours", "0.1"),
               "ckpt+ours-blocksrht@0.1"),
        Config("importance (ours) 0.1", "minilm_cpu", key_of("importance", "ours", 0.1),
               ("ours", "0.1"), None),
        Config("importance (ours) 0.1, allocated", "minilm_cpu", IMPORTANCE_ALLOC,
               ("ours", "0.1"), None),
        Config("LoRA", "lora_cpu", LORA, ("lora", None), None),
        Config("LoRA + blocksrht (ours) 0.1", "lora_cpu", key_of("blocksrht", "lora+ours", 0.1),
               ("lora+ours", "0.1"), None),
    ]
    return out


@dataclass
class Point:
    """A configuration's place: its bytes over exact's, its score minus exact's (± SE, n seeds,
    paired or not) and its step time over exact's on the task's real lengths; ``times``: the step
    time by (rows, baseline), rows :data:`REAL` or :data:`FULL`, baseline ``exact`` or
    :data:`EXACT_SKIP`. None (or absent) where not measured."""

    config: Config
    share: float | None
    diff: float | None
    se: float | None
    n: int
    paired: bool
    time: float | None
    times: dict[tuple[str, str], float] = field(default_factory=dict)


def _bytes(point: dict, family: str, rate: str | None) -> int | None:
    rec = point.get(family)
    if rec and rate is not None:
        rec = rec.get(rate)
    return (rec or {}).get("saved_activation_bytes")


def _unpaired(ours: list[float], base: list[float]) -> tuple[float, float | None, int]:
    mean = statistics.fmean(ours) - statistics.fmean(base)
    if len(ours) < 2 or len(base) < 2:
        return mean, None, min(len(ours), len(base))
    se = math.sqrt(statistics.variance(ours) / len(ours) + statistics.variance(base) / len(base))
    return mean, se, min(len(ours), len(base))


def _times(benches: dict[str, dict], name: str | None) -> dict[tuple[str, str], float]:
    """A configuration's step times by (rows, baseline) from the step ratios of each row kind."""
    out = {}
    for rows, bench in benches.items():
        timed = bench.get(name) if name else None
        if timed:
            out[(rows, "exact")] = timed["ratio"]
            if "skip" in timed:
                out[(rows, EXACT_SKIP)] = timed["skip"]["ratio"]
    return out


def points(runs: list[dict], memory: dict, benches: dict[str, dict]) -> list[Point]:
    """Each of :func:`configs` placed from the CoLA runs, the memory point and the step ratios of
    each row kind (``benches``: :data:`REAL` and :data:`FULL` to what
    :func:`~sketchprop.report.common.bench_step_ratios` gives for them)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["task"] == "cola":
            groups.setdefault((r["_experiment"], method_key(r)), []).append(r)
    exact_runs = groups.get(("minilm_cpu", EXACT), [])
    exact_bytes = _bytes(memory, "exact", None)
    out = []
    for c in configs():
        share = None
        if c.memory is not None and exact_bytes:
            b = _bytes(memory, *c.memory)
            share = None if b is None else b / exact_bytes
        diff = se = None
        n, is_paired = 0, True
        if c.by_construction:
            diff, se, n = 0.0, 0.0, 0
        elif c.key is not None:
            ours = groups.get((c.experiment, c.key), [])
            if c.key == EXACT and c.experiment == "minilm_cpu":
                diff, se, n = 0.0, 0.0, len(ours)
            elif ours and c.experiment == "minilm_cpu":
                p = paired(ours, exact_runs)
                n = p.n
                diff = p.mean if p.n else None
                se = p.se
            elif ours:
                is_paired = False
                diff, se, n = _unpaired([score(r) for r in ours],
                                        [score(r) for r in exact_runs])
        times = _times(benches, c.bench)
        out.append(Point(c, share, diff, se, n, is_paired, times.get((REAL, "exact")), times))
    return out


def _beats(q: Point, p: Point, axes) -> bool:
    """``q`` is at least as good as ``p`` on every axis and better on one (lower is better)."""
    pairs = [(a(q), a(p)) for a in axes]
    return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)


def _bytes_axis(p: Point) -> float:
    return p.share


def _score_axis(p: Point) -> float:
    return -p.diff


def _time_axis(p: Point) -> float:
    return p.time


def pareto(pts: list[Point], timed: bool = False) -> list[Point]:
    """The points that no other point beats on bytes and mean score (and, with ``timed``, step
    time: points never timed are left out), ordered by bytes. The score's standard error does not
    enter: a point off the front may be within noise of it."""
    axes = (_bytes_axis, _score_axis, _time_axis) if timed else (_bytes_axis, _score_axis)
    drawn = [p for p in pts if p.share is not None and p.diff is not None
             and (p.time is not None or not timed)]
    front = [p for p in drawn if not any(q is not p and _beats(q, p, axes) for q in drawn)]
    return sorted(front, key=lambda p: p.share)


def _fmt_diff(p: Point) -> str:
    if p.config.by_construction:
        return "0 (exact gradients)"
    if p.diff is None:
        return "not run"
    if p.n == 0:
        return "-"
    se = f" ± {p.se:.2f}" if p.se is not None else ""
    return f"{p.diff:+.2f}{se} (n={p.n}{'' if p.paired else ', unpaired'})"


ROWS_SHORT = {REAL: "real lengths", FULL: "full-length rows"}


def time_columns(infos: dict[str, dict]) -> list[tuple[str, str, str]]:
    """(rows, baseline, column title) of each step-time column: the task's real lengths always,
    full-length rows where a run timed them; against exact and against exact-skip."""
    cols = []
    for rows in (REAL, FULL):
        if rows == FULL and rows not in infos:
            continue
        info = infos.get(rows, {})
        short = ROWS_SHORT[rows]
        if rows == REAL and info.get("real_fraction") is not None:
            short += f", {100 * info['real_fraction']:.0f}% real tokens"
        cols += [(rows, "exact", f"step time / exact ({short})"),
                 (rows, EXACT_SKIP, f"step time / exact, padding skipped ({short})")]
    return cols


def _fmt_time(p: Point, rows: str, base: str) -> str:
    t = p.times.get((rows, base))
    return "-" if t is None else f"{t:.2f}x"


def bench_text(infos: dict[str, dict]) -> str:
    """The preamble's sentences on step time: which runs, which rows, which baselines, and the
    commands that would time what is missing."""
    out = []
    for rows in (REAL, FULL):
        info = infos.get(rows)
        if not info:
            out.append(f"{ROWS_SHORT[rows].capitalize()}: not timed "
                       f"(rerun: `{rerun_step(BENCH_MODEL, rows)}`).")
            continue
        out.append(
            f"{ROWS_SHORT[rows].capitalize()}: one training step of {BENCH_MODEL} at "
            f"{info['batch']}, {info['threads']} torch thread(s), interleaved with exact in the "
            f"same run (scripts/bench_model.py; {', '.join(info['runs'])}), '-' where not timed; "
            f"{rows_text(info)}. " + skip_note(info, rerun_step(BENCH_MODEL, rows)))
    return " ".join(out)


def write(pts: list[Point], memory: dict, infos: dict[str, dict], tables: Path, figures: Path,
          runs: list[dict]) -> None:
    """``tables``/frontier.md|csv and ``figures``/frontier.png from the points; ``infos``: the
    ``_info`` of the step ratios of each row kind timed."""
    front = {id(p) for p in pareto(pts)}
    front_timed = {id(p) for p in pareto(pts, timed=True)}
    cols = time_columns(infos)
    rows = []
    for p in sorted(pts, key=lambda p: (p.share is None, p.share or 0, p.config.label)):
        rows.append([p.config.label, "-" if p.share is None else f"{p.share:.3f}", _fmt_diff(p),
                     *[_fmt_time(p, r, b) for r, b, _ in cols],
                     "yes" if id(p) in front else "",
                     "yes" if id(p) in front_timed else ("" if p.time is not None else "-")])
    used = [r for r in runs if r["task"] == "cola" and r["_experiment"] in ("minilm_cpu",
                                                                            "lora_cpu")]
    unmeasured = [p.config.label for p in pts if p.share is None and p.config.bench == EXACT_SKIP]
    write_table(tables / "frontier", ["configuration", "saved bytes / exact (CoLA 256)",
                                      "CoLA MCC - exact", *[title for _, _, title in cols],
                                      "front: bytes, score", "front: bytes, score, time"],
                rows, (
        "# The accuracy-memory-time frontier\n\n"
        "Every configuration as one point. 'saved bytes / exact': the bytes one training step "
        f"keeps for backward over exact's, {memory.get('model', 'roberta-base')} on CoLA at batch "
        f"{memory.get('batch_size', 256)} with the real CoLA lengths (results/memory/"
        f"{MEMORY_POINT}, make memory)"
        + (f"; not measured for {', '.join(unmeasured)} (rerun: `{RERUN_MEMORY}`)"
           if unmeasured else "") + ". 'CoLA MCC - exact': the dev score at the best epoch minus "
        "exact's, paired by seed (mean ± its standard error, n seeds; MiniLM, the CPU recipe); "
        "LoRA trains at its own learning rate and is compared unpaired. 'step time': the step "
        "time over exact's, which multiplies its padding rows, and over that of exact with "
        "padding rows skipped, which does not: the sketches of our layout and the b-bit codes "
        "skip them, so against exact alone their time on padded rows is mostly padding that "
        "exact could skip too. " + bench_text(infos) + " Checkpointing and exact with padding "
        "skipped compute exact's gradients, so their score is exact's. Importance stores the "
        "rows of a seeded sketch at its rate plus 8 bytes per row, and allocation keeps the "
        "uniform rate's bytes: their bytes are ours' at 0.1. 'front: bytes, score': no other "
        "point keeps fewer or equal bytes with a higher or equal mean score (better in one); "
        "'front: bytes, score, time': no timed point is also as fast or faster (step time / "
        "exact on the task's real lengths; '-': not timed). The mean score decides; a point "
        "off a front may be within its standard error of it. The three measurements come from "
        "three settings (the bytes and time on roberta-base, the scores on MiniLM); they are "
        "put side by side, not combined. The compact points' bytes are those of "
        "patch_activations' defaults, LayerNorm from its output included; their runs kept "
        "LayerNorm's input (activations=compact in the pipeline), which gives the same "
        "gradients to float32 rounding.\n\n"
        + describe(used)))
    _figure(pts, infos, figures / "frontier.png")


def time_label(p: Point) -> str:
    """A point's step times for its label: ``0.81x (0.99x skip)`` on the real lengths, then
    ``full 1.05x (1.04x skip)`` where full-length rows were timed; empty where not timed."""
    parts = []
    for rows, prefix in ((REAL, ""), (FULL, "full ")):
        t, skip = p.times.get((rows, "exact")), p.times.get((rows, EXACT_SKIP))
        if t is not None:
            parts.append(f"{prefix}{t:.2f}x" + (f" ({skip:.2f}x skip)" if skip is not None
                                                else ""))
    return ", ".join(parts)


def _figure(pts: list[Point], infos: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    drawn = [p for p in pts if p.share is not None and p.diff is not None]
    if not drawn:
        return
    fig, ax = plt.subplots(figsize=(10, 6.5))
    front = pareto(pts)
    ax.step([p.share for p in front], [p.diff for p in front], where="post", color="0.6", lw=1,
            zorder=1, label="Pareto front (bytes, score)")
    timed = pareto(pts, timed=True)
    named = {id(p) for p in [*front, *timed]}
    ax.scatter([p.share for p in timed], [p.diff for p in timed], s=140, facecolors="none",
               edgecolors="tab:orange", zorder=3, label="on the front of bytes, score and time")
    for p in drawn:
        color = ("tab:red" if p.config.label.startswith("int") else
                 "tab:green" if "LoRA" in p.config.label else
                 "tab:blue" if "blocksrht" in p.config.label or "importance" in p.config.label else
                 "tab:purple" if "(paper)" in p.config.label else "black")
        ax.errorbar(p.share, p.diff, yerr=p.se or 0, fmt="o", color=color, ms=5, capsize=2,
                    zorder=2)
    ax.axhline(0, color="0.8", lw=0.8, zorder=0)
    ax.set_xscale("log")
    labels = []
    for p in drawn:
        if p.n == 1 and id(p) not in named:  # one seed, off the fronts: a dot without a name
            continue
        times = time_label(p)
        labels.append((p.share, p.diff, p.config.label + (f"  {times}" if times else "")))
    _place_labels(fig, ax, labels)
    ax.set_xlabel("bytes kept for backward / exact's (roberta-base, CoLA batch 256; log)")
    ax.set_ylabel("CoLA MCC x100 - exact's (MiniLM, paired by seed; ± SE)")
    rows = "; ".join(f"{'full: ' if r == FULL else ''}{rows_text(infos[r])}"
                     for r in (REAL, FULL) if r in infos)
    ax.set_title("What each byte buys: accuracy, memory and (labels) step time / exact, in brackets "
                 "/ exact with padding skipped\n"
                 f"({rows or 'not timed'}; full-length rows "
                 f"{'as full' if FULL in infos else 'not timed'})\n"
                 "(unnamed dots: one seed, off the fronts; see results/tables/frontier.md)",
                 fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


def _place_labels(fig, ax, labels: list[tuple[float, float, str]], size: float = 6.5) -> None:
    """Annotate each (x, y, text) to the upper right of its point, moved down a line at a time
    while its box (width estimated from the text's length) would overlap one placed before."""
    ax.autoscale_view()
    scale = fig.dpi / 72  # display pixels per point
    height, placed = 1.3 * size * scale, []
    for x, y, text in sorted(labels, key=lambda t: (-t[1], t[0])):
        px, py = ax.transData.transform((x, y))
        width, dy = 0.55 * size * scale * len(text), 0.0
        for _ in range(12):
            box = (px, px + width, py + dy, py + dy + height)
            if not any(b[0] < box[1] and box[0] < b[1] and b[2] < box[3] and box[2] < b[3]
                       for b in placed):
                break
            dy -= height
        placed.append((px, px + width, py + dy, py + dy + height))
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 3 + dy / scale),
                    fontsize=size)


def build(results: Path) -> None:
    """Write results/tables/frontier.{md,csv} and results/figures/frontier.png from ``results``."""
    runs = load_runs(results / "runs")
    memory_file = results / "memory" / MEMORY_POINT
    memory = json.loads(memory_file.read_text()) if memory_file.exists() else {}
    benches = {rows: bench_step_ratios(results / "bench", BENCH_MODEL, rows)
               for rows in (REAL, FULL)}
    infos = {rows: b.pop("_info") for rows, b in benches.items() if "_info" in b}
    write(points(runs, memory, benches), memory, infos, results / "tables", results / "figures",
          runs)
