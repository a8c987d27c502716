"""The paired comparisons: the recommended configurations against named baselines
(:data:`COMPARISONS`), paired by seed, each with both scores, the differences, their mean and
standard error, a 95% t-interval and a verdict.

Writes ``results/tables/comparisons.md|csv`` (embedded in the docs as the block ``comparisons``);
:mod:`sketchprop.report.lora` writes its LoRA comparisons with :func:`comparisons` too.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .common import (
    EXACT,
    TASK_NAMES,
    describe,
    fmt_score,
    key_of,
    method_key,
    method_label,
    paired,
    score,
    verdict,
    write_table,
)

REC = key_of("blocksrht", "ours", 0.1)  # the recommended sketch at the recommended rate
IMPORTANCE = key_of("importance", "ours", 0.1)
IMPORTANCE_ALLOC = key_of("importance", "ours+alloc", 0.1)
# The recommended configurations against named baselines, (task, method, baseline), paired by seed
# in results/tables/comparisons.md. A comparison whose runs are not there yet is listed as such.
COMPARISONS = [
    ("cola", REC, EXACT),
    ("cola", key_of("blocksrht", "ours", 0.2), EXACT),
    ("cola", IMPORTANCE_ALLOC, EXACT),
    ("cola", IMPORTANCE_ALLOC, REC),
    ("cola", key_of("blocksrht", "ours+ckpt", 0.1), REC),
    # Compact activations: their own cost at 0.1 and 0.2, and 0.2 with them (fewer bytes than 0.1
    # alone) against exact.
    ("cola", key_of("blocksrht", "ours+compact", 0.1), REC),
    ("cola", key_of("blocksrht", "ours+compact", 0.2), key_of("blocksrht", "ours", 0.2)),
    ("cola", key_of("blocksrht", "ours+compact", 0.2), EXACT),
    # Compact activations on the exact linear layers, which keep fewer bytes than the sketch alone
    # at 0.1: against exact, and against the sketch at 0.1.
    ("cola", key_of("exact", "compact"), EXACT),
    ("cola", key_of("exact", "compact"), REC),
    # The authors' deterministic 3-bit GELU code in place of the 2-bit stochastic one.
    ("cola", key_of("blocksrht", "ours+compact(gelu_bits=3,gelu_code=optimal)", 0.1), REC),
    ("cola", key_of("blocksrht", "ours+compact(gelu_bits=3,gelu_code=optimal)", 0.1),
     key_of("blocksrht", "ours+compact", 0.1)),
    *[(task, method, baseline) for task in ("mrpc", "stsb", "sst2")
      for method, baseline in ((IMPORTANCE, REC), (IMPORTANCE, EXACT), (REC, EXACT))],
    *[(task, key_of("blocksrht", "ours+compact", 0.2), EXACT) for task in ("mrpc", "stsb")],
    *[(task, key_of("exact", "compact"), EXACT) for task in ("mrpc", "stsb", "sst2")],
    # b-bit stored rows on the exact linear layers (method=exact method.bits=b): each against
    # exact; 2 bits (fewer bytes than the sketch at 0.1) against the sketch at 0.1; 4 bits with
    # compact activations against exact and against compact activations alone.
    *[("cola", key_of("exact", f"int{b}"), EXACT) for b in (8, 4, 2)],
    ("cola", key_of("exact", "int2"), REC),
    ("cola", key_of("exact", "int4"), REC),
    *[(task, key_of("exact", layout), EXACT) for task in ("cola", "sst2", "stsb")
      for layout in ("int4+compact",)],
    ("cola", key_of("exact", "int4+compact"), key_of("exact", "compact")),
    *[(task, key_of("exact", "int4"), EXACT) for task in ("sst2", "stsb")],
    # The lean preset on 4-bit rows (activations=lean method.bits=4): against exact and against
    # 4 bits + compact, whose float LayerNorm outputs it keeps as the linear layers' codes.
    *[(task, key_of("exact", "int4+lean"), EXACT) for task in ("cola", "sst2", "stsb")],
    ("cola", key_of("exact", "int4+lean"), key_of("exact", "int4+compact")),
    # Scales over groups of 128 columns (method.group=128): fewer bytes on full-length rows.
    ("cola", key_of("exact", "int4g128+lean"), EXACT),
    ("cola", key_of("exact", "int4g128+lean"), key_of("exact", "int4+lean")),
]


def comparisons(runs: list[dict], experiment: str, stem: Path,
                wanted: list[tuple] = COMPARISONS,
                title: str = "Paired comparisons of the recommended configurations") -> None:
    """Each of ``wanted`` (task, method, baseline) paired by seed: both scores, the differences,
    their mean and standard error, the 95% t-interval and a verdict (:func:`verdict`)."""
    runs = [r for r in runs if r["_experiment"] == experiment]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["task"], method_key(r))].append(r)
    header = ["task", "method", "baseline", "method score", "baseline score", "n pairs", "seeds",
              "difference per seed", "mean difference", "SE", "95% interval", "verdict"]
    rows, used, absent = [], [], []
    for task, method, baseline in wanted:
        ours, base = groups.get((task, method), []), groups.get((task, baseline), [])
        name = f"{TASK_NAMES.get(task, task)} {method_label(method)} vs {method_label(baseline)}"
        if not ours or not base:
            absent.append(name)
            continue
        used += ours + base
        p = paired(ours, base)
        interval = "-"
        if p.n > 1:
            low, high = p.interval()
            interval = f"[{low:+.2f}, {high:+.2f}]"
        rows.append([
            TASK_NAMES.get(task, task), method_label(method), method_label(baseline),
            fmt_score([score(r) for r in ours]), fmt_score([score(r) for r in base]), p.n,
            ", ".join(map(str, p.seeds)) or "-", " / ".join(f"{d:+.2f}" for d in p.diffs) or "-",
            f"{p.mean:+.2f}" if p.n > 1 else "-", f"{p.se:.2f}" if p.n > 1 else "-", interval,
            verdict(p)])
    if not rows:
        return
    unique = list({r["_path"]: r for r in used}.values())
    write_table(stem, header, rows, (
        f"# {title} ({experiment})\n\n"
        "Dev score x100 at the best epoch (the tables' score); 'method score' and 'baseline "
        "score' are each side's mean ± sample sd over all its seeds, paired or not. Runs are "
        "paired by seed: seed s gives a method and its baseline the same classifier "
        "initialisation and the same data order, so the difference of their two runs is free of"
        " that part of the seed-to-seed spread; only seeds both have pair. Paired runs share "
        "task, model, training recipe and data (activation checkpointing and compact "
        "activations may differ: they change what is kept for backward, not the model, data or "
        "recipe). 'mean difference' is method minus baseline, 'SE' the sample sd of the "
        "differences / sqrt(n), the interval the mean ± t(0.975, n-1) SE (Student t with n-1 "
        "degrees of freedom, which takes the differences as roughly normal). Verdict: 'higher' "
        "or 'lower' when the interval excludes 0; 'no difference measured' when it includes 0, "
        "which is not a finding of equality (a few seeds give a wide interval); 'n<2: no claim'"
        " with fewer than two pairs."
        + (" Declared in src/sketchprop/report but without runs here: " + "; ".join(absent) + "."
           if absent else "")
        + "\n\n" + describe(unique)))
