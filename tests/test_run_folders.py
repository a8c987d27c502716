"""One run, one run folder: two runs started in the same second write to two folders (their
logs and results never mix), and a run that does nothing (skipped: its result exists; refused:
another process runs it) leaves no folder behind and says why on its own output."""

import json
import subprocess
import sys

from test_claims import overrides
from test_pipeline import env

from sketchprop.glue import paths, runs
from sketchprop.glue.config import compose, validate
from sketchprop.glue.train import EXIT_CLAIMED, run_files

# `python -m sketchprop.train` with Hydra's clock stopped at one second (its ${now:...} resolver
# reads hydra.core.utils.datetime), so that two runs start "in the same second" however slow the
# machine is.
FROZEN_CLOCK = """
import datetime, runpy, sys
import hydra.core.utils

class Frozen(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2030, 1, 2, 3, 4, 5)

hydra.core.utils.datetime = Frozen
runpy.run_module("sketchprop.train", run_name="__main__", alter_sys=True)
"""


def train(args, cwd, frozen=False):
    command = ["-c", FROZEN_CLOCK] if frozen else ["-m", "sketchprop.train"]
    return subprocess.run([sys.executable, *command, *args], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=300)


def run_folders(root):
    return sorted(p for p in (root / "outputs/runs").glob("*/*") if p.is_dir())


def test_one_run_one_folder_and_runs_that_do_nothing_leave_none(tmp_path, glue_dir):
    base = overrides(tmp_path, glue_dir, "train.max_steps=2")
    # Two runs in the same second: two folders, each with its own result and its own log.
    for rho in ("0.5", "0.25"):
        proc = train([*base, f"method.rho={rho}"], tmp_path, frozen=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    folders = run_folders(tmp_path)
    assert len(folders) == 2, folders
    assert all(f.parent.name == "2030-01-02" and f.name.startswith("03-04-05_cola") for f in folders)
    stems = {}
    for folder in folders:
        result = json.loads((folder / "result.json").read_text())
        stems[result["rho"]] = runs.run_stem(result["identity"])
        assert result["run_dir"] == paths.portable(folder.resolve())
    assert set(stems) == {0.5, 0.25}
    for folder in folders:
        log = (folder / "train.log").read_text()
        rho = json.loads((folder / "result.json").read_text())["rho"]
        other = stems[0.25 if rho == 0.5 else 0.5]
        assert stems[rho] in log and other not in log

    # Skipped (its result exists): no folder left, the reason on its own output.
    skipped = train([*base, "method.rho=0.5"], tmp_path)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "skip:" in skipped.stdout
    assert run_folders(tmp_path) == folders
    # ... but a folder named with hydra.run.dir is the user's: it stays.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("mine")
    skipped = train([*base, "method.rho=0.5", f"hydra.run.dir={tmp_path}/mine"], tmp_path)
    assert skipped.returncode == 0 and "skip:" in skipped.stdout
    assert (tmp_path / "mine/notes.txt").exists() and (tmp_path / "mine/.hydra").is_dir()

    # Refused (another process holds its identity): no folder left, exit 75, the reason on its
    # own stderr and in no other run's log.
    held = [*base, "method.rho=0.125"]
    files = run_files(validate(compose(held)), compose(held), glue_dir)
    with runs.Claim(files.lock, "held by the test"):
        refused = train(held, tmp_path)
    assert refused.returncode == EXIT_CLAIMED, refused.stderr[-3000:]
    assert "already running" in refused.stderr
    assert run_folders(tmp_path) == folders
    assert not any("already running" in (f / "train.log").read_text() for f in folders)

