"""Give result files written before run identities existed their identity and their new name.

    python scripts/migrate_runs.py            # results/runs/, in place
    python scripts/migrate_runs.py --check    # list what would change, change nothing

A file named ``<sketch>-rho<rho>-seed<seed>.json`` without an ``identity`` key gets the identity
that :func:`sketchprop.glue.runs.identity` computes from its recorded config, and moves to
``<sketch>-rho<rho>-seed<seed>-<recipe hash>.json`` (the name a run of that config files today, so
a sweep skips it). Nothing else in the file changes. The data hash needs the TSV files the run
read: the folder recorded in the config if it still exists, else the copy shipped in ``data/glue``
(the same files: ``data/glue/SHA256SUMS``). Refuses to overwrite an existing file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sketchprop.glue import data as glue
from sketchprop.glue import runs

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "data" / "glue"


def migrate(path: Path, dry_run: bool = False) -> Path | None:
    """Migrate one file; returns its new path (None: nothing to do)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "identity" in data or "config" not in data:
        return None
    config = data["config"]
    task = config["task"]
    glue_dir = config["data"].get("glue_dir")
    if glue_dir is not None and not (Path(glue_dir) / task["dir"]).is_dir():
        glue_dir = SHIPPED
    files = ["train.tsv", *[d["file"] for d in task["dev"]]]
    source = runs.data_source(None if glue_dir is None else Path(glue_dir), task["dir"], files,
                              glue.HUB_DATASET)
    ident = runs.identity(config, source, data.get("world_size") or 1)
    target = path.with_name(f"{runs.run_stem(ident)}.json")
    if target.exists():
        raise SystemExit(f"{path}: {target.name} exists already; not overwritten")
    if not dry_run:
        migrated = {**data, "identity": ident, "recipe": runs.recipe_hash(ident), "kept": True}
        runs.write_json(target, migrated)
        path.unlink()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", nargs="?", type=Path, default=ROOT / "results" / "runs")
    parser.add_argument("--check", action="store_true", help="list the changes, make none")
    args = parser.parse_args(argv)
    moved = 0
    for path in sorted(args.runs_dir.rglob("*.json")):
        target = migrate(path, dry_run=args.check)
        if target is not None:
            moved += 1
            print(f"{path.relative_to(args.runs_dir)} -> {target.name}")
    print(f"{moved} file(s) {'to migrate' if args.check else 'migrated'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
