"""The Makefile as a newcomer meets it: `make help` names every target, with how to pass compact
activations and LoRA to `make glue`; `make clean` removes what runs leave and never results/;
`make bench` runs the CPU benchmark suite."""

import shutil
import subprocess

import pytest

from sketchprop.glue.config import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def make(*args, cwd=REPO_ROOT):
    proc = subprocess.run(["make", "--no-print-directory", "-f", str(REPO_ROOT / "Makefile"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_help_names_clean_bench_and_the_glue_options():
    text = make("help")
    # "  <target>  <what it does>"; a line indented further continues the one above
    targets = {line.split()[0] for line in text.splitlines() if not line.startswith("   ")}
    assert {"clean", "bench", "glue", "test", "smoke", "tables"} <= targets
    assert "ARGS=activations=" in text and "ARGS=adapter=" in text


def test_clean_removes_outputs_and_checkpoints_and_never_results(tmp_path):
    for folder in ("outputs/runs/x", "checkpoints/y", "results/runs/z"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "file.json").write_text("{}")
    make("clean", cwd=tmp_path)
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "results/runs/z/file.json").exists()


def test_bench_runs_the_cpu_benchmark_suite():
    dry = make("-n", "bench", "ARGS=layer variance")
    assert "scripts/bench_all_cpu.sh layer variance" in dry


def test_bench_suite_remakes_every_committed_benchmark():
    """Each results/bench/*.json was written by a command that `make bench` (or `make
    architectures`, `make architectures-published`, `make decoder-finetune`) runs again: the same
    script with the same --tag."""
    import json
    import re
    import shlex

    suite = (REPO_ROOT / "scripts" / "bench_all_cpu.sh").read_text()
    runs = set()
    for body in re.findall(r'^\s+\[\w+\]="(.*)"$', suite, flags=re.M):
        words = shlex.split(body)
        tag = words[words.index("--tag") + 1] if "--tag" in words else ""
        runs.add((words[0].removeprefix("scripts/"), tag))
    runs.update({("architectures.py", ""), ("architectures.py", "wide")})  # make architectures
    runs.update({("architectures.py", "published"),  # make architectures-published
                 ("architectures.py", "published_real40")})
    runs.add(("decoder_finetune.py", ""))  # make decoder-finetune
    for path in sorted((REPO_ROOT / "results" / "bench").glob("*.json")):
        words = shlex.split(json.loads(path.read_text())["environment"]["command"])
        script = next(w.rsplit("/", 1)[-1] for w in words if w.endswith(".py"))
        tag = words[words.index("--tag") + 1] if "--tag" in words else ""
        assert (script, tag) in runs, f"{path.name}: no run of {script} --tag {tag!r} in make bench"
