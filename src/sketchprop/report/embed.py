"""Generated tables embedded in the docs: the block ``name`` is the text between
``<!-- BEGIN name -->`` and ``<!-- END name -->`` in whichever of ``README.md`` and ``docs/*.md``
holds those markers (exactly one file, each marker once). ``table4``, ``comparisons`` and
``stream_check`` get the table ``results/tables/<name>.md`` less its title, ``frontier_summary`` the rows of
``results/tables/frontier.csv`` on a front (:func:`sketchprop.report.summary.frontier_summary`),
``stacks`` the training-stacks table read off the tests' markers
(:func:`sketchprop.report.stacks.stacks_table`).
"""

from __future__ import annotations

from pathlib import Path

from .stacks import stacks_table
from .summary import frontier_summary

# The tables embedded whole (less their title), in the order they are written.
TABLES = ("table4", "comparisons", "stream_check")


class BlockError(SystemExit):
    """A block's markers are in no file, in several, or not once each."""


def block_file(root: Path, name: str) -> Path:
    """The one file among ``root``/README.md and ``root``/docs/*.md that holds the markers of block
    ``name``; raises :class:`BlockError` naming the files searched when none or several do."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found = {f: f.read_text() for f in files if f.is_file()}
    holders = [f for f, text in found.items() if begin in text or end in text]
    searched = ", ".join(str(f.relative_to(root)) for f in found)
    if not holders:
        raise BlockError(f"block {name!r}: no file holds {begin} ... {end} (searched {searched})")
    if len(holders) > 1:
        raise BlockError(f"block {name!r}: its markers are in several files: "
                         + ", ".join(str(f.relative_to(root)) for f in holders))
    (holder,) = holders
    text = found[holder]
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise BlockError(f"block {name!r}: {holder.relative_to(root)} must hold {begin} once, "
                         f"then {end} once")
    return holder


def embed(root: Path, name: str, body: str) -> None:
    """Put ``body`` into block ``name`` of the file that holds it."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    path = block_file(root, name)
    head, rest = path.read_text().split(begin, 1)
    path.write_text(f"{head}{begin}\n{body.strip()}\n{end}{rest.split(end, 1)[1]}")


def embed_all(root: Path, tables: Path) -> None:
    """Every block whose source ``tables`` holds, into the docs of the checkout at ``root``;
    nothing when ``root`` has no README.md (a results folder outside a checkout)."""
    if not (root / "README.md").is_file():
        return
    for name in TABLES:
        if (tables / f"{name}.md").exists():
            body = (tables / f"{name}.md").read_text().split("\n", 2)[2]  # without its own title
            embed(root, name, body)
    if (tables / "frontier.csv").exists():
        embed(root, "frontier_summary", frontier_summary(tables / "frontier.csv"))
    if (root / "tests").is_dir():
        embed(root, "stacks", stacks_table(root / "tests"))
