"""The README's short frontier table: the configurations on a front of results/tables/frontier.csv.

``frontier_summary(csv)`` keeps the rows whose 'front: bytes, score' or 'front: bytes, score, time'
column says 'yes' (no other configuration keeps fewer bytes at a higher score, or also steps faster)
and returns them, in the CSV's order, as a markdown table of saved bytes, score difference and step
time, each against exact. ``make tables`` puts it between ``<!-- BEGIN frontier_summary -->`` and
``<!-- END frontier_summary -->`` in README.md.
"""

import csv
from pathlib import Path

FRONTS = ("front: bytes, score", "front: bytes, score, time")
# (CSV column, column title in the summary)
COLUMNS = [
    ("configuration", "configuration"),
    ("saved bytes / exact (CoLA 256)", "saved bytes / exact"),
    ("CoLA MCC - exact", "CoLA MCC - exact (mean ± SE, n)"),
    ("step time / exact", "step time / exact"),
]


def frontier_summary(path: Path) -> str:
    """The markdown table of the configurations on a front in the frontier CSV at ``path``."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if any(r[front] == "yes" for front in FRONTS)]
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[col] for col, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)
