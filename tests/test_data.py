"""The GLUE files shipped in data/glue/ are the ones SHA256SUMS and SOURCES.md describe, byte for byte."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLUE = ROOT / "data" / "glue"
TASKS = {"CoLA", "SST-2", "MRPC", "RTE", "STS-B", "WNLI"}


def sums() -> dict[str, str]:
    """``SHA256SUMS`` (``sha256sum`` format: hash, two spaces, path) as path -> hash."""
    out = {}
    for line in (GLUE / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert re.fullmatch(r"[0-9a-f]{64}", digest), line
        out[name] = digest
    return out


def sources_table() -> dict[str, dict]:
    """The file table of ``SOURCES.md``: path -> {sha256, bytes, rows}."""
    rows = {}
    for line in (GLUE / "SOURCES.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].endswith(".tsv"):
            rows[cells[0]] = {"bytes": int(cells[1]), "rows": int(cells[2].split()[0]),
                              "sha256": cells[3]}
    return rows


def data_rows(path: Path) -> int:
    lines = path.read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    header = not (path.parent.name == "CoLA" and path.name in ("train.tsv", "dev.tsv"))
    return len(lines) - header


def test_every_shipped_file_matches_sha256sums():
    listed = sums()
    shipped = sorted(str(p.relative_to(GLUE)) for p in GLUE.rglob("*.tsv"))
    assert shipped == sorted(listed), "data/glue and SHA256SUMS list different files"
    assert {name.split("/")[0] for name in listed} == TASKS
    for name, digest in listed.items():
        assert hashlib.sha256((GLUE / name).read_bytes()).hexdigest() == digest, name


def test_sources_md_lists_the_same_hashes_sizes_and_rows():
    table, listed = sources_table(), sums()
    assert sorted(table) == sorted(listed)
    for name, row in table.items():
        path = GLUE / name
        assert row["sha256"] == listed[name], name
        assert row["bytes"] == path.stat().st_size, name
        assert row["rows"] == data_rows(path), name


def test_sources_md_states_each_tasks_terms():
    text = (GLUE / "SOURCES.md").read_text()
    terms = text.split("## Terms of use", 1)[1]
    for task in TASKS:
        assert re.search(rf"^\| {re.escape(task)} \|", terms, re.M), f"no terms row for {task}"
    assert "MSR-SSLA" in terms and "non-commercial" in terms


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_data_is_not_git_ignored():
    files = [str(p.relative_to(ROOT)) for p in GLUE.rglob("*") if p.is_file()]
    proc = subprocess.run(["git", "check-ignore", *files], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip() == "", f"ignored by .gitignore: {proc.stdout}"
