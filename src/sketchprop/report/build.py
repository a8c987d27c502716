"""``make tables``: every table and figure rebuilt from the files under ``results/`` alone, and the
embedded blocks of the docs refreshed from them.

The same JSON files give the same output files (sorted input, no timestamps in the images).
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import ROOT, check_one_recipe_per_cell, load_runs
from .comparisons import comparisons
from .embed import embed_all
from .figure3 import figure3
from .figure5 import figure5
from .figure6 import figure6
from .frontier import build as frontier
from .lora import lora
from .stream_check import stream_check
from .table2 import table2
from .table3 import table3, table3_runs
from .table4 import table4
from .tuning import tuning

RESULTS = ROOT / "results"


def build(results: Path = RESULTS, cpu_experiment: str = "minilm_cpu") -> list[Path]:
    """Write results/tables/*.md|csv and results/figures/figure3|5|6*.png and frontier.png from
    ``results``, embed the tables the docs show (when ``results`` lies in a checkout), and return
    the tables and Figures 3, 5 and 6, sorted."""
    runs = load_runs(results / "runs")
    check_one_recipe_per_cell(runs)
    tables, figures = results / "tables", results / "figures"
    # The CPU runs make table2/table4; paper-scale runs (experiment=table2 / table4), where
    # present, make table2_roberta / table4_roberta beside them.
    majority_file = results / "baselines" / "majority.json"
    majority = json.loads(majority_file.read_text()) if majority_file.exists() else None
    table2(runs, cpu_experiment, tables / "table2", majority)
    bench = results / "bench"
    table4(runs, cpu_experiment, tables / "table4", bench)
    comparisons(runs, cpu_experiment, tables / "comparisons")
    lora(runs, tables / "lora")
    stream_check(results, tables / "stream_check")
    table2(runs, "table2", tables / "table2_roberta")
    table4(runs, "table4", tables / "table4_roberta", bench)
    table3_runs(runs, "table3", tables / "table3_roberta")
    tuning(runs, tables)
    table3(results / "memory", tables, bench)
    figure3(results / "memory", figures)
    figure5(runs, cpu_experiment, figures)
    figure6(bench, figures)
    frontier(results)
    embed_all(results.parent, tables)
    return sorted([*tables.glob("*.md"), *figures.glob("figure[356]*.png")])
