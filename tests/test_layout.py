"""The repository's layout rules, read off the files with ``ast``: no module under src/ over 600
lines, every file in scripts/ at most 200 lines, every module and script opening with a docstring,
no script that imports another script or puts scripts/ on ``sys.path``, and no import circle among
the sketchprop modules (imports inside functions count)."""

import ast
from pathlib import Path

import pytest
from test_imports import find_cycle

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
SCRIPTS = ROOT / "scripts"
MAX_MODULE_LINES = 600
MAX_SCRIPT_LINES = 200


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The sketchprop modules that module ``name`` (file ``path``) imports anywhere: for
    ``from X import y`` the submodule ``X.y`` where it is one, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return out & known


def test_no_module_under_src_over_600_lines():
    long = {rel(p): lines(p) for p in SRC.rglob("*.py") if lines(p) > MAX_MODULE_LINES}
    assert not long, long


def test_every_script_at_most_200_lines():
    long = {rel(p): lines(p) for p in SCRIPTS.iterdir() if p.is_file()
            and lines(p) > MAX_SCRIPT_LINES}
    assert not long, long


def test_every_module_and_script_opens_with_a_docstring():
    files = [*SRC.rglob("*.py"), *SCRIPTS.glob("*.py")]
    bare = [rel(p) for p in files if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, bare


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_no_script_imports_another_or_touches_sys_path(script):
    others = {p.stem for p in SCRIPTS.glob("*.py")}
    tree = ast.parse((SCRIPTS / script).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]] if not node.level else ["<relative>"]
        else:
            names = []
        assert not set(names) & (others | {"<relative>"}), f"{script} imports {names}"
        if isinstance(node, ast.Attribute) and node.attr == "path" and \
                isinstance(node.value, ast.Name) and node.value.id == "sys":
            pytest.fail(f"{script}:{node.lineno} touches sys.path")


def test_no_import_circle_among_sketchprop_modules():
    mods = modules()
    graph = {name: imported(path, name, set(mods)) - {name} for name, path in mods.items()}
    assert "sketchprop.bench.common" in graph["sketchprop.bench.model_step"]  # the scan sees them
    assert "sketchprop.layers" in graph["sketchprop"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_import_scan_resolves_relative_and_submodule_imports(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("from . import common\nfrom .models import build_model\nimport sketchprop\n"
                    "def f():\n    from sketchprop import activations, patch_linear\n")
    known = {"sketchprop", "sketchprop.activations", "sketchprop.bench.common",
             "sketchprop.bench.models"}
    assert imported(path, "sketchprop.bench.x", known) == known


def test_every_mutant_snippet_occurs_once():
    """``make mutants`` plants each bug by replacing an exact snippet: a file moved or edited
    leaves a stale mutant, which this catches without running the (long) check."""
    from sketchprop.bench.mutants import MUTANTS

    stale = []
    for mutant in MUTANTS:
        text = (ROOT / mutant.file).read_text() if (ROOT / mutant.file).is_file() else ""
        olds = mutant.old if isinstance(mutant.old, tuple) else (mutant.old,)
        stale += [(mutant.id, mutant.file) for old in olds if text.count(old) != 1]
    assert not stale, stale
