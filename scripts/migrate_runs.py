"""Bring the committed result files up to date: identities for old run files, portable paths for all.

    python scripts/migrate_runs.py            # results/ and docs/, in place
    python scripts/migrate_runs.py --check    # list what would change, change nothing

First, a run file named ``<sketch>-rho<rho>-seed<seed>.json`` without an ``identity`` key gets the
identity computed from its recorded config and moves to ``<sketch>-rho<rho>-seed<seed>-<recipe
hash>.json`` (the name a run of that config files today, so a sweep skips it). Then every JSON,
Markdown and CSV file loses the absolute paths of the machine that made it: see
:mod:`sketchprop.glue.migrate` for the rule. Both steps can be rerun: the second time they change
nothing. Refuses to overwrite an existing file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sketchprop.glue import migrate

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".json", ".md", ".csv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, default=[ROOT / "results", ROOT / "docs"],
                        help="folders to migrate (default: results/ and docs/); run files are those "
                             "under <folder>/runs, or the folder itself when it is a runs/ folder")
    parser.add_argument("--check", action="store_true", help="list the changes, make none")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.is_dir()]
    if missing:
        parser.error(f"no such folder: {', '.join(missing)}")
    moved = changed = 0
    for folder in args.folders:
        runs_dir = folder if folder.name == "runs" else folder / "runs"  # results/ or results/runs
        for path in sorted(runs_dir.rglob("*.json")) if runs_dir.is_dir() else []:
            try:
                target = migrate.add_identity(path, dry_run=args.check)
            except FileExistsError as e:
                raise SystemExit(str(e)) from None
            if target is not None:
                moved += 1
                print(f"{path.relative_to(folder)} -> {target.name}")
        for path in sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
            if migrate.portable_file(path, runs_dir, dry_run=args.check):
                changed += 1
                print(f"{path.relative_to(folder)}: paths made portable")
    verb = "to migrate" if args.check else "migrated"
    print(f"{moved} file(s) {verb} to identities, {changed} file(s) {verb} to portable paths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
