"""make test-lib: install the library alone, as a user adding it to their own project would, and use it.

Creates a fresh virtual environment in a temporary folder, installs torch (pinned by constraints.txt:
an unconstrained torch would pull a multi-GB CUDA build here) and sketchprop from a copy of this
folder's package files, not editable, so that only what the wheel declares ships. Then, from outside
the repository, it patches a small MLP with ``patch_linear`` and ``patch_activations``, trains a step,
unpatches, and checks that the pipeline's dependencies (transformers, hydra, ...) are not installed:
the library's required dependencies are torch alone. Prints the time of each part.

    python scripts/check_lib_install.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run by the fresh environment's python, in a folder outside the repository.
CHECK = r"""
import importlib.metadata
import importlib.util

import torch
import sketchprop
from sketchprop import patch_activations, patch_linear, unpatch_linear

absent = ["transformers", "hydra", "omegaconf", "datasets", "evaluate", "wandb", "matplotlib"]
present = [name for name in absent if importlib.util.find_spec(name) is not None]
assert not present, f"installed with the library alone: {present}"
required = [r for r in importlib.metadata.requires("sketchprop") if "extra ==" not in r]
assert [r.split(">")[0].strip() for r in required] == ["torch"], required
assert "site-packages" in sketchprop.__file__, sketchprop.__file__  # the installed copy

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(64, 8))
assert patch_linear(model, sketch="gaussian", rho=0.5) == ["0", "3"]
assert "1" in patch_activations(model)  # the GELU
model(torch.randn(4, 32, 16)).square().mean().backward()
assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
unpatch_linear(model)
assert type(model[0]) is torch.nn.Linear
print(f"sketchprop {sketchprop.__version__} on torch {torch.__version__}: patched, trained, unpatched")
"""


def copy_package(dest: Path) -> Path:
    """The files a wheel is built from, copied so the build leaves nothing in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "src", dest / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
    return dest


def run(cmd: list, cwd: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run([str(c) for c in cmd], cwd=cwd, check=True)
    return time.perf_counter() - start


def check(tmp: Path) -> None:
    start = time.perf_counter()
    venv.create(tmp / "venv", with_pip=True)
    made = time.perf_counter() - start
    python = tmp / "venv" / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    package = copy_package(tmp / "package")
    torch_s = run([*pip, "-c", ROOT / "constraints.txt", "torch"])
    lib_s = run([*pip, "-c", ROOT / "constraints.txt", package])
    (tmp / "work").mkdir()
    # torch without numpy warns once at import; numpy is no dependency of the library.
    check_s = run([python, "-W", "ignore:Failed to initialize NumPy", "-c", CHECK], cwd=tmp / "work")
    print(f"lib-only install: venv {made:.0f} s, torch {torch_s:.0f} s, sketchprop {lib_s:.0f} s, "
          f"check {check_s:.0f} s; total {time.perf_counter() - start:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, default=None,
                   help="make the environment in this new folder and keep it")
    args = p.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True)
        check(args.keep.resolve())
        return
    with tempfile.TemporaryDirectory(prefix="sketchprop-lib-") as tmp:
        check(Path(tmp))


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as e:
        sys.exit(f"check_lib_install: {e}")
