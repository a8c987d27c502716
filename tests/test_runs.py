"""Run bookkeeping and the choice of setup: the committed runs keep their identity, the entry point
picks the CPU setup and the shipped data where the paper's cannot run, and asking for what is not
available fails fast with a command that works."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sketchprop.glue import data as glue
from sketchprop.glue import runs
from sketchprop.glue.config import REPO_ROOT, compose, validate
from sketchprop.glue.setup import choose_setup
from sketchprop.glue.train import run_files

RUNS = sorted((REPO_ROOT / "results" / "runs").rglob("*.json"))
PATH_KEYS = ("data.glue_dir=", "results_dir=", "scratch_results_dir=", "checkpoints_dir=")


def env(**extra):
    import os

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


def test_cpu_setup_runs_offline_on_the_shipped_data(tmp_path):
    """The entry point as `make glue` calls it, offline, no GLUE_DIR: the CPU setup on the files
    in data/glue (two steps on a few examples, not the whole recipe)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sketchprop.train", "task=cola", "logger=none",
         "train.max_steps=2", "data.max_train_samples=64", "data.max_eval_samples=32",
         f"scratch_results_dir={tmp_path}/scratch", f"checkpoints_dir={tmp_path}/ckpt",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("setup: cpu")
    result = json.loads((tmp_path / "run/result.json").read_text())
    assert result["model"] == "minilm" and result["kept"] is False
    assert result["config"]["data"]["glue_dir"] == str(glue.SHIPPED_GLUE_DIR)
    shipped = runs.data_source(glue.SHIPPED_GLUE_DIR, "CoLA", ["train.tsv", "dev.tsv"])
    assert result["identity"]["data"]["sha256"] == shipped["sha256"]
    assert result["torch_threads"] >= 1 and result["global_step"] == 2
    assert not (REPO_ROOT / "results" / "runs" / "default").exists()


def test_paper_setup_offline_falls_back_to_the_shipped_data(tmp_path):
    conf = validate(compose(["setup=paper", "model=tiny-roberta", "data.glue_dir=null"]))
    import os

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
