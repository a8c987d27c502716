"""Migrations of the committed result files (``scripts/migrate_runs.py``); each can be rerun and
changes nothing the second time.

**Identities** (:func:`add_identity`): a run file written before identities existed gets the
identity that :func:`sketchprop.glue.runs.identity` computes from its recorded config, and the
name a run of that config files today.

**Portable paths** (:func:`portable_file`): the committed files were made on machines where every
checkout of this repository lay at ``/work/<name>`` beside the shared folder ``/work/shared``, and
they named those folders. The rule that removes them:

- a path inside a checkout, ``/work/<checkout>/<rest>``, becomes ``<rest>``: relative to the
  checkout it lay in, as :func:`~sketchprop.glue.paths.portable` records paths today
  (``.venv/bin/python``, ``results``, ``outputs/runs/...``, ``data/glue``);
- the shared GLUE folder, ``/work/shared/data/glue``, becomes ``data/glue``: for every task the
  repository ships, its files were byte-identical to ``data/glue``'s (compared when the files were
  migrated; its one extra file, QNLI's dev set, is not shipped, and no file naming the folder read
  it). For a run file this is also checked: the sha256 in its identity must be the shipped copy's;
- any other path in the shared folder, ``/work/shared/<rest>``, becomes ``../shared/<rest>`` (none
  is left in the committed files);
- a run's model folder from a PyPI package (``.../site-packages/<pkg>/...``) becomes the reference
  the model config holds, ``${sp.package_model:<pkg>}``.

A run file's identity, recipe hash and name do not change: none holds a path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import data as glue
from . import runs
from .config import REPO_ROOT

#: Where the committed files were made: the folder holding the checkouts, and the shared folder in it.
MACHINE = "/work"
SHARED = "shared"
SHARED_GLUE = "/data/glue"  # in the shared folder: the same files as data/glue (module docstring)

# A path that starts there (not the middle of a URL or a longer path).
_PATH = re.compile(r"(?<![\w./:-])" + re.escape(MACHINE) + r"/([^/\s\"'`,;:)]+)(/[^\s\"'`,;)]*)?")
_PACKAGE = re.compile(r"/site-packages/(\w+)/")


def portable_text(text: str) -> str:
    """``text`` with every path of the machine made portable (the first two rules above)."""
    def repl(m: re.Match) -> str:
        name, rest = m.group(1), m.group(2) or ""
        if name == SHARED:
            if rest == SHARED_GLUE or rest.startswith(SHARED_GLUE + "/"):
                return "data/glue" + rest.removeprefix(SHARED_GLUE)
            return f"../{SHARED}{rest}"
        return rest.lstrip("/") or "."

    return _PATH.sub(repl, text)


def _strings(value, change):
    """``value`` (parsed JSON) with ``change`` applied to every string in it."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {k: _strings(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_strings(v, change) for v in value]
    return value


def _task_files(task: dict) -> list[str]:
    return ["train.tsv", *[d["file"] for d in task["dev"]]]


def _shipped_data(config: dict) -> dict | None:
    """The data source of the run's task read from the shipped copy (None: not shipped)."""
    task = config["task"]
    if not all((glue.SHIPPED_GLUE_DIR / task["dir"] / f).is_file() for f in _task_files(task)):
        return None
    return runs.data_source(glue.SHIPPED_GLUE_DIR, task["dir"], _task_files(task))


def portable_run(result: dict) -> dict:
    """A run file's contents with the machine's paths made portable (all three rules)."""
    config = result["config"]
    replace = {}
    glue_dir = config["data"].get("glue_dir")
    if glue_dir and glue_dir.startswith(f"{MACHINE}/{SHARED}/"):
        shipped, read = _shipped_data(config), result["identity"]["data"]
        if shipped is None or shipped["sha256"] != read.get("sha256"):
            raise ValueError(f"{glue_dir}: the run read other data than data/glue's; its folder "
                             "cannot be recorded as data/glue")
        replace[glue_dir] = "data/glue"
    model = config["model"].get("name_or_path")
    package = _PACKAGE.search(model or "")
    if package and model.startswith("/"):
        replace[model] = f"{runs.PACKAGE_MODEL}{package.group(1)}}}"

    def change(text: str) -> str:
        for old, new in replace.items():  # whole paths first, then the rest by the general rules
            text = re.sub(re.escape(old) + r"(?![^\s\"'`,;)])", new, text)
        return portable_text(text)

    return _strings(result, change)


def portable_file(path: Path, runs_dir: Path, dry_run: bool = False) -> bool:
    """Make one committed file portable: a run file under ``runs_dir`` with all three rules, any
    other file (JSON, Markdown, CSV) with the first two on its text, which keeps its layout. True
    when it changed."""
    text = path.read_text()
    if runs_dir in path.parents and path.suffix == ".json":
        data = json.loads(text)
        if isinstance(data, dict) and "identity" in data:  # written by runs.write_json: same layout
            new = json.dumps(runs.finite(portable_run(data)), indent=2, allow_nan=False) + "\n"
        else:
            new = text
    else:
        new = portable_text(text)
    if new == text:
        return False
    if not dry_run:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new)
        tmp.replace(path)
    return True


def recorded_identity(result: dict) -> dict:
    """The identity computed again from a run file's recorded config: the data hash from the
    recorded GLUE folder (relative to the repository) if it is there, else from the shipped copy
    (the same files: ``data/glue/SHA256SUMS``)."""
    config = result["config"]
    task = config["task"]
    glue_dir = config["data"].get("glue_dir")
    if glue_dir is not None:
        folder = REPO_ROOT / glue_dir  # an absolute glue_dir stays itself
        glue_dir = folder if (folder / task["dir"]).is_dir() else glue.SHIPPED_GLUE_DIR
    source = runs.data_source(glue_dir, task["dir"], _task_files(task), glue.HUB_DATASET)
    return runs.identity(config, source, result.get("world_size") or 1)


def add_identity(path: Path, dry_run: bool = False) -> Path | None:
    """Give a run file without an identity its identity and its name today; returns its new path
    (None: nothing to do). Nothing else in the file changes. Refuses to overwrite a file."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "identity" in data or "config" not in data:
        return None
    ident = recorded_identity(data)
    target = path.with_name(f"{runs.run_stem(ident)}.json")
    if target.exists():
        raise FileExistsError(f"{path}: {target.name} exists already; not overwritten")
    if not dry_run:
        migrated = {**data, "identity": ident, "recipe": runs.recipe_hash(ident), "kept": True}
        runs.write_json(target, migrated)
        path.unlink()
    return target
