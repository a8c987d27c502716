"""The README's frontier summary: the configurations on a front of results/tables/frontier.csv."""

import re

from sketchprop.glue.config import REPO_ROOT
from sketchprop.report.summary import frontier_summary

CSV = REPO_ROOT / "results" / "tables" / "frontier.csv"


def test_the_readme_block_is_the_summary_of_the_committed_csv():
    (body,) = re.findall(r"<!-- BEGIN frontier_summary -->\n(.*?)\n<!-- END frontier_summary -->",
                         (REPO_ROOT / "README.md").read_text(), flags=re.S)
    assert body == frontier_summary(CSV)


def test_keeps_the_rows_on_either_front_in_order(tmp_path):
    csv = tmp_path / "frontier.csv"
    csv.write_text(
        "configuration,saved bytes / exact (CoLA 256),CoLA MCC - exact,step time / exact,"
        '"front: bytes, score","front: bytes, score, time"\n'
        "a,0.1,-1.00 ± 0.50 (n=3),0.90x,,yes\n"
        "b,0.2,+0.10 ± 0.20 (n=5),1.10x,yes,\n"
        "c,0.3,-2.00 (n=1),-,,-\n"
        "exact,1.000,+0.00 ± 0.00 (n=5),1.00x,,\n")
    lines = frontier_summary(csv).splitlines()
    assert lines[0] == ("| configuration | saved bytes / exact | CoLA MCC - exact (mean ± SE, n) "
                        "| step time / exact |")
    assert lines[2:] == ["| a | 0.1 | -1.00 ± 0.50 (n=3) | 0.90x |",
                         "| b | 0.2 | +0.10 ± 0.20 (n=5) | 1.10x |"]
