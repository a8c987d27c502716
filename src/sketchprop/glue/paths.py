"""Where the repository is, and paths and commands as a result file or a made-by line records
them: so that no record names the folders of the machine that made it, and every command can be
pasted in a fresh clone. Standard library only: the benchmarks record their commands with it on a
machine that has torch and transformers alone."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

#: The repository root (``src/sketchprop/glue`` is three levels below it in an editable install).
REPO_ROOT = Path(__file__).resolve().parents[3]


def portable(path: str | os.PathLike) -> str:
    """``path`` as a result file or a made-by line records it: an absolute path inside the
    repository relative to its root (``data/glue``, ``results/runs/...``, ``.venv/bin/python``),
    so that no record names the checkout's folder and a command pastes into any clone; anything
    else as given (a folder the user chose outside the repository, a hub id). Symlinks are not
    followed: ``.venv/bin/python`` stays inside."""
    if not os.path.isabs(path):
        return str(path)
    absolute = Path(os.path.abspath(path))
    return str(absolute.relative_to(REPO_ROOT)) if absolute.is_relative_to(REPO_ROOT) else str(path)


def portable_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides (``key=value``) with every path value :func:`portable`."""
    return [f"{key}{eq}{portable(value) if eq else value}"
            for key, eq, value in (o.partition("=") for o in overrides)]


def portable_command(argv: list[str]) -> str:
    """``argv`` as a command a user can paste in a fresh clone: every absolute path (also as the
    value of ``key=value`` or ``--opt=value``) :func:`portable`, and ``python`` for an interpreter
    outside the repository."""
    out = []
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=") if "=" in arg else ("", "", arg)
        value = portable(value)
        if i == 0 and os.path.isabs(value) and Path(value).name.startswith("python"):
            value = "python"
        out.append(f"{key}{eq}{value}")
    return shlex.join(out)
