"""The README's short frontier table: the configurations on a front of results/tables/frontier.csv.

``frontier_summary(csv)`` keeps the rows whose 'front: bytes, score' or 'front: bytes, score, time'
column says 'yes' (no other configuration keeps fewer bytes at a higher score, or also steps faster)
and returns them, in the CSV's order, as a markdown table of saved bytes, score difference and every
step-time column of the CSV (against exact and against exact with padding skipped, each titled with
the rows it timed), then a line on the rows that were not timed. ``make tables`` puts it between
``<!-- BEGIN frontier_summary -->`` and ``<!-- END frontier_summary -->`` in README.md.
"""

import csv
from pathlib import Path

FRONTS = ("front: bytes, score", "front: bytes, score, time")
# (CSV column, column title in the summary); the step-time columns follow, titled as in the CSV.
COLUMNS = [
    ("configuration", "configuration"),
    ("saved bytes / exact (CoLA 256)", "saved bytes / exact"),
    ("CoLA MCC - exact", "CoLA MCC - exact (mean ± SE, n)"),
]


def frontier_summary(path: Path) -> str:
    """The markdown table of the configurations on a front in the frontier CSV at ``path``."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        times = [c for c in reader.fieldnames if c.startswith("step time")]
        rows = [r for r in reader if any(r[front] == "yes" for front in FRONTS)]
    columns = COLUMNS + [(c, c) for c in times]
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[col] for col, _ in columns) + " |" for r in rows]
    if not any("full-length" in c for c in times):
        lines += ["", "Full-length rows were not timed: every step time here is on batches with "
                  "the task's real lengths ([`results/tables/frontier.md`]"
                  "(results/tables/frontier.md) gives the command that times them)."]
    return "\n".join(lines)
