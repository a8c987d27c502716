"""The tuning of the CPU recipe: the learning-rate (and batch-size, epoch) runs of
``experiment=tune_cpu`` and ``tune_cpu_lora`` per task, beside the table pool's own exact run, and
the setting with the highest dev score.

Writes ``results/tables/tuning.md|csv``.
"""

from __future__ import annotations

import math
from pathlib import Path

from .common import METRIC, TASK_ORDER, describe, scheme, score, write_table


def _recipe(r: dict) -> tuple[float, int, float]:
    """The (learning rate, batch size, epochs) a tuning run varied."""
    train = r["config"]["train"]
    return train["learning_rate"], train["batch_size"], train["epochs"]


def tuning(runs: list[dict], out: Path, pool: str = "minilm_cpu") -> None:
    """The learning-rate (and batch-size) runs of experiment=tune_cpu per task, beside the exact
    seed-1 run of the table pool (the recipe's own setting) for every task that was tuned."""
    tuned = [r for r in runs if r["_experiment"] == "tune_cpu"]
    if not tuned:
        return
    tasks = [t for t in TASK_ORDER if any(r["task"] == t for r in tuned)]
    tried = {(r["task"], *_recipe(r)) for r in tuned}
    table = [r for r in runs if r["_experiment"] == pool and r["sketch"] == "exact"
             and r["seed"] == 1 and r["task"] in tasks and (r["task"], *_recipe(r)) not in tried]
    rows, best = [], {}
    # Each model variant (full fine-tuning, LoRA) is tuned on its own.
    for t, variant in sorted({(r["task"], scheme(r)) for r in tuned},
                             key=lambda tv: (TASK_ORDER.index(tv[0]), tv[1])):
        these = sorted([r for r in tuned + table if r["task"] == t and scheme(r) == variant],
                       key=lambda r: _recipe(r)[::-1])
        lr, bs, ep = _recipe(max(these, key=lambda r: score(r) or -math.inf))
        name = "exact" if variant == "-" else f"exact ({variant})"
        best[t, variant] = (t if variant == "-" else f"{t} {name}") + (
            f" lr {lr:g} batch {bs} {ep:g} epochs")
        for r in these:
            per_epoch = ", ".join(f"{h.get(METRIC[t], math.nan):.2f}" for h in r["history"])
            lr, bs, ep = _recipe(r)
            rows.append([t, name, f"{lr:g}", str(bs), f"{ep:g}", f"{score(r):.2f}", per_epoch,
                         r["_experiment"]])
    write_table(out / "tuning", ["task", "method", "learning rate", "batch", "epochs", "best-epoch score",
                                 "score per epoch", "runs"], rows, (
        "# Tuning of the CPU recipe (experiment=tune_cpu, tune_cpu_lora)\n\n"
        "The exact MiniLM on dev at a few learning rates, batch sizes and epoch counts, with the CPU "
        "recipe otherwise (configs/train/cpu.yaml, configs/setup/cpu.yaml; rows from runs/" + pool
        + " are table2_cpu's own exact run). Highest dev score per task at: "
        + ", ".join(best.values()) + ". The rate in configs/train/cpu.yaml "
        "(chosen on CoLA) is fixed for every task, sketch and rate; results/README.md says why "
        "other tasks' checks did not change it. LoRA (adapter=lora) trains far fewer weights and "
        "was tuned on its own, once, on CoLA; its rate is fixed in "
        "configs/adapter/lora.yaml (adapter=lora brings it).\n\n" + describe(tuned)))
