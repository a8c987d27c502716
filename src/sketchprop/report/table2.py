"""Table 2: the dev score per GLUE task and method (mean and spread over seeds, the drop against the
exact run, the difference paired by seed), the paper's CoLA numbers beside ours and, where
``results/baselines/majority.json`` exists, the majority-class baseline.

Writes ``results/tables/table2.md|csv`` (the CPU runs) and ``table2_roberta.md|csv`` (paper-scale
runs, ``experiment=table2``, where present).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from .common import (
    EXACT,
    METRIC,
    PAIRED_TEXT,
    TASK_ORDER,
    describe,
    fmt_paired,
    fmt_score,
    mean_sd,
    method_key,
    method_label,
    paired,
    scheme,
    score,
    write_table,
)
from .table4 import PAPER_TABLE4

# Table 2's methods: the paper's Gaussian, the recommended sketch and importance sampling (the
# others are Table 4's).
TABLE2_SKETCHES = ("exact", "gaussian", "blocksrht", "importance")


def table2(runs: list[dict], experiment: str, stem: Path, majority: dict | None = None) -> None:
    """Table 2 of ``experiment``'s runs as ``stem``.md|csv, with the majority-class row when
    ``majority`` (results/baselines/majority.json) is given."""
    # The paper's Gaussian and the recommended sketch, without checkpointing (that is Table 4's).
    runs = [r for r in runs if r["_experiment"] == experiment and r["sketch"] in TABLE2_SKETCHES
            and "ckpt" not in scheme(r).split("+")]
    if not runs:
        return
    tasks = [t for t in TASK_ORDER if any(r["task"] == t for r in runs)]
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        cells[method_key(r)][r["task"]].append(r)
    exact_runs = cells.get(EXACT, {})
    exact = {t: mean_sd([score(r) for r in rs])[0] for t, rs in exact_runs.items()}
    header = (["method"] + [c for t in tasks for c in (f"{t} ({METRIC[t]})", f"{t} paired to exact")]
              + ["mean drop"])
    if "cola" in tasks:
        header.append("paper CoLA (roberta-base)")
    rows = []
    for key in sorted(cells):
        row, drops = [method_label(key)], []
        for t in tasks:
            rs = cells[key].get(t, [])
            values = [score(r) for r in rs]
            text, pair = fmt_score(values), "-"
            if rs and key != EXACT and t in exact:
                drop = mean_sd(values)[0] - exact[t]
                drops.append(drop)
                text += f" [{drop:+.2f}]"
                pair = fmt_paired(paired(rs, exact_runs[t]))
            row += [text, pair]
        row.append(f"{statistics.fmean(drops):+.2f}" if drops else "-")
        if "cola" in tasks:
            paper = (PAPER_TABLE4.get((key[1], -key[3]))
                     if key[1] in ("exact", "gaussian") and key[2] in ("-", "paper") else None)
            row.append(f"{paper[0]:.2f}" if paper else "-")
        rows.append(row)
    if majority:
        row = ["majority class"]
        for t in tasks:
            value = majority["tasks"].get(t, {}).get("validation", {}).get(METRIC[t])
            row += ["-" if value is None else f"{value:.2f}", ""]
        rows.insert(1, row + [""] * (len(header) - len(row)))
    write_table(stem, header, rows, (
        f"# Table 2 analogue ({experiment})\n\n"
        "Dev score x100 at the best epoch (as the paper reports), mean ± sample sd over seeds where "
        "there are several; [difference to the exact run's mean]. " + PAIRED_TEXT
        + " 'paper' = the authors' layout (a sketch per layer, padding rows sketched, head "
        "patched); 'ours' = shared Q/K/V sketch, padding rows skipped, head exact. The paper's "
        "Table 2 numbers other than CoLA were not retrievable; its CoLA column equals its Table 4 "
        "Gaussian rows."
        + (" 'majority class': always the most frequent training label (STS-B: the mean score, "
           "whose correlation is undefined), from " + majority["command"] if majority else "")
        + "\n\n" + describe(runs)))
