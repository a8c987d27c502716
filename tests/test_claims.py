"""One run per identity at a time: a run claims its identity with a lock file beside its result;
a second run of the same identity refuses in seconds, a claim left by a dead process is taken
over, and a sweep records a claimed job as skipped, not failed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_pipeline import cli, env
from test_pipeline import overrides as tiny

from sketchprop.glue import runs
from sketchprop.glue.config import REPO_ROOT, compose, validate
from sketchprop.glue.train import EXIT_CLAIMED, run, run_files


def overrides(tmp, glue_dir, *extra):
    """The pipeline tests' tiny run with the setup named, so that a run composed here and one
    started on the command line (which picks a setup when none is named) have one identity."""
    return ["setup=cpu", *tiny(tmp, glue_dir, *extra)]


def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant(path, host, pid, age=0.0):
    """A claim file as another process would have left it, its heartbeat ``age`` seconds old."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "token": "planted",
                                "started": "2026-01-01 00:00:00 UTC", "run": "x"}))
    then = time.time() - age
    os.utime(path, (then, then))


def test_a_claim_is_exclusive_and_released(tmp_path):
    lock = tmp_path / "runs/a.lock"
    with runs.Claim(lock, "run a") as first:
        info = json.loads(lock.read_text())
        assert (info["pid"], info["token"]) == (os.getpid(), first.token)
        with pytest.raises(runs.Claimed) as refused:
            runs.Claim(lock, "run a").acquire()
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and str(lock) in message and "delete" in message
        assert lock.exists()  # the refused claim leaves the holder's file alone
    assert not lock.exists()


def test_the_heartbeat_renews_the_claim(tmp_path):
    lock = tmp_path / "a.lock"
    with runs.Claim(lock, "run a", heartbeat=0.05):
        os.utime(lock, (time.time() - 1000, time.time() - 1000))
        time.sleep(0.5)
        assert time.time() - lock.stat().st_mtime < 1


def test_a_claim_of_a_dead_process_on_this_host_is_taken_over(tmp_path, capsys):
    import socket

    lock = tmp_path / "a.lock"
    pid = dead_pid()
    plant(lock, socket.gethostname(), pid)
    with runs.Claim(lock, "run a") as claim:
        assert json.loads(lock.read_text())["token"] == claim.token
    out = capsys.readouterr().out
    assert f"left by pid {pid}" in out and "is gone" in out and "taking it over" in out


@pytest.mark.parametrize("age, taken", [(10, False), (runs.STALE_SECONDS + 60, True)])
def test_a_claim_from_another_host_is_abandoned_by_its_heartbeat_age(tmp_path, age, taken):
    lock = tmp_path / "a.lock"
    plant(lock, "another-host", 12345, age=age)
    if taken:
        with runs.Claim(lock, "run a") as claim:
            assert json.loads(lock.read_text())["token"] == claim.token
    else:
        with pytest.raises(runs.Claimed, match="another-host"):
            runs.Claim(lock, "run a").acquire()
        assert json.loads(lock.read_text())["token"] == "planted"


def test_release_leaves_a_claim_that_is_no_longer_ours(tmp_path):
    lock = tmp_path / "a.lock"
    claim = runs.Claim(lock, "run a").acquire()
    plant(lock, "another-host", 1)  # taken over while this process was stalled
    claim.release()
    assert json.loads(lock.read_text())["token"] == "planted"


def test_overwrite_does_not_break_a_live_claim(tmp_path, glue_dir):
    args = overrides(tmp_path, glue_dir, "train.max_steps=2", "overwrite=true")
    files = run_files(validate(compose(args)), compose(args), glue_dir)
    with runs.Claim(files.lock, "held by the test"):
        start = time.time()
        with pytest.raises(runs.Claimed, match="already running"):
            run(compose(args), output_dir=tmp_path / "run")
        assert time.time() - start < 10
    assert not files.index.exists() and not (tmp_path / "run/result.json").exists()


def test_two_concurrent_runs_one_trains_the_other_refuses(tmp_path, glue_dir):
    def tracked_changes():
        return subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"],
                              capture_output=True, text=True).stdout

    before = tracked_changes()
    # More steps than the test waits for: the first run still trains when the second, which
    # takes a few seconds to start, is refused; it is then stopped with SIGTERM.
    args = overrides(tmp_path, glue_dir, "train.max_steps=100000", "train.logging_steps=1000",
                     "train.checkpoint=false", "method.rho=0.5")
    files = run_files(validate(compose(args)), compose(args), glue_dir)
    err = tmp_path / "first.err"
    first = subprocess.Popen([sys.executable, "-m", "sketchprop.train", *args,
                              f"hydra.run.dir={tmp_path}/first"], cwd=tmp_path, env=env(),
                             stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    try:
        deadline = time.time() + 120
        while not files.lock.exists():
            assert first.poll() is None, err.read_text()[-3000:]
            assert time.time() < deadline, "the first run never claimed its identity"
            time.sleep(0.1)
        start = time.time()
        second = cli([*args, f"hydra.run.dir={tmp_path}/second"], tmp_path)
        took = time.time() - start
        assert first.poll() is None, err.read_text()[-3000:]
        assert second.returncode == EXIT_CLAIMED, second.stderr[-3000:]
        said = second.stdout + second.stderr
        assert f"pid {first.pid}" in said and "already running" in said
        assert took < 60 and not (tmp_path / "second/result.json").exists()
        while "/100000" not in err.read_text():  # the first one goes on to train
            assert first.poll() is None and time.time() < deadline + 120, err.read_text()[-3000:]
            time.sleep(0.1)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 130
    finally:
        if first.poll() is None:
            first.kill()
    assert "Run the same command again" in err.read_text()
    assert not files.lock.exists()  # an interrupted run lets go of its claim
    assert not files.index.exists()
    assert tracked_changes() == before


def test_a_sweep_records_a_claimed_job_as_skipped(tmp_path, glue_dir):
    base = overrides(tmp_path, glue_dir, "train.max_steps=2")
    held = [*base, "method.rho=0.5"]
    files = run_files(validate(compose(held)), compose(held), glue_dir)
    with runs.Claim(files.lock, "held by the test"):
        sweep = cli(["-m", *base, "method.rho=0.5,0.25"], tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert "sweep: 1 job(s) skipped, held by another process" in sweep.stderr
    said = sweep.stdout + sweep.stderr
    assert "failed" not in sweep.stderr and "[ERROR]" not in said
    assert "skipped: run gaussian-rho0.5" in said
    assert not files.index.exists()
    assert list((tmp_path / "results/runs/default/cola").glob("gaussian-rho0.25-seed1-*.json"))
    (skipped,) = (tmp_path / "outputs/multiruns").rglob(runs.SKIPPED_FILE)
    assert "method.rho=0.5" in json.loads(skipped.read_text())["overrides"]
