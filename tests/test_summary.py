"""The generated blocks that have functions of their own: the README's frontier summary (the
configurations on a front of results/tables/frontier.csv) and the training-stacks table (read off
the tests' stack markers)."""

import re

import pytest

from sketchprop.glue.config import REPO_ROOT
from sketchprop.report.stacks import stacks_table
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
    assert lines[2:4] == ["| a | 0.1 | -1.00 ± 0.50 (n=3) | 0.90x |",
                          "| b | 0.2 | +0.10 ± 0.20 (n=5) | 1.10x |"]
    assert lines[4:] == ["", "Full-length rows were not timed: every step time here is on batches "
                         "with the task's real lengths ([`results/tables/frontier.md`]"
                         "(results/tables/frontier.md) gives the command that times them)."]


def test_every_step_time_column_is_kept_with_its_rows(tmp_path):
    """The summary shows each step-time column of the CSV (against exact and against exact with
    padding skipped, real lengths and full-length rows), titled with its rows."""
    csv = tmp_path / "frontier.csv"
    csv.write_text(
        "configuration,saved bytes / exact (CoLA 256),CoLA MCC - exact,"
        '"step time / exact (real lengths, 40% real tokens)",'
        '"step time / exact, padding skipped (real lengths, 40% real tokens)",'
        '"step time / exact (full-length rows)",'
        '"step time / exact, padding skipped (full-length rows)",'
        '"front: bytes, score","front: bytes, score, time"\n'
        "a,0.1,-1.00 ± 0.50 (n=3),0.70x,0.85x,0.95x,0.93x,yes,yes\n")
    lines = frontier_summary(csv).splitlines()
    assert lines[0].endswith("| step time / exact (real lengths, 40% real tokens) | step time / "
                             "exact, padding skipped (real lengths, 40% real tokens) | step time "
                             "/ exact (full-length rows) | step time / exact, padding skipped "
                             "(full-length rows) |")
    assert lines[2:] == ["| a | 0.1 | -1.00 ± 0.50 (n=3) | 0.70x | 0.85x | 0.95x | 0.93x |"]


def test_the_stacks_block_is_the_table_of_the_tests_markers():
    (body,) = re.findall(r"<!-- BEGIN stacks -->\n(.*?)\n<!-- END stacks -->",
                         (REPO_ROOT / "docs" / "training-stacks.md").read_text(), flags=re.S)
    assert body == stacks_table(REPO_ROOT / "tests"), "stale: make tables rebuilds it"


def test_stacks_table_reads_decorators_params_and_module_marks(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "pytestmark = [pytest.mark.stack('ddp', 'bits')]\n"
        "@pytest.mark.stack('ddp', 'sketch', 'compact')\n"
        "def test_one(): pass\n"
        "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.stack(\n"
        "    'fsdp2', 'sketch', refused='before fully_shard'))])\n"
        "def test_two(x): pass\n")
    rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in
            stacks_table(tmp_path).splitlines()[2:]}
    ddp = rows["| DDP (`torchrun`, `DistributedDataParallel`)"]
    assert ddp[0] == "tested: `test_a.py::test_one`"
    assert ddp[1] == "tested: `test_a.py::test_one`, `test_a.py::test_two`"  # the module's mark
    assert ddp[2] == "tested: `test_a.py::test_one`" and ddp[3:] == ["not tested", "not tested |"]
    assert rows["| FSDP2 (`fully_shard`)"][0] == ('refused: "before fully_shard" '
                                                 '(`test_a.py::test_two`)')


@pytest.mark.parametrize("marker", ["'dpp', 'sketch'", "'ddp', 'sketchy'", "'ddp'"])
def test_a_misspelt_stack_marker_raises(tmp_path, marker):
    (tmp_path / "test_a.py").write_text(f"import pytest\n@pytest.mark.stack({marker})\n"
                                        "def test_one(): pass\n")
    with pytest.raises(ValueError, match="test_a.py::test_one"):
        stacks_table(tmp_path)
