"""The GLUE pipeline end to end on a tiny random RoBERTa and GLUE-format files the tests write:
result JSON contract, metrics, sweep skip, resume, NaN stop, fast failures, DDP on two CPUs."""

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import TrainerCallback

from sketchprop import glue
from sketchprop.config import compose, validate
from sketchprop.train import RunError, _history_callback, result_path, run

CONTRACT = {"task", "model", "sketch", "rho", "seed", "epochs", "metrics", "best_metrics",
            "history", "train_samples_per_second", "tokens_per_second", "peak_memory_bytes",
            "saved_activation_bytes", "device", "torch_version", "git_commit", "wall_seconds",
            "config", "command"}


def overrides(tmp, glue_dir, *extra):
    """A few steps of the tiny model on the fixture data, all outputs under ``tmp``."""
    return ["model=tiny-roberta", "logger=none", "train=cpu", f"data.glue_dir={glue_dir}",
            f"results_dir={tmp}/results", f"checkpoints_dir={tmp}/ckpt", "train.max_length=32",
            "train.batch_size=8", "train.max_steps=3", "train.logging_steps=1",
            "train.learning_rate=1e-3", "data.max_eval_samples=16", *extra]


def env(**extra):
    """This environment without GLUE_DIR, offline; ``extra`` values of None unset a variable."""
    out = {k: v for k, v in os.environ.items() if k != "GLUE_DIR"}
    out.update({"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", **extra})
    return {k: v for k, v in out.items() if v is not None}


def cli(args, cwd, **extra_env):
    return subprocess.run([sys.executable, "-m", "sketchprop.train", *args], cwd=cwd, env=env(
        **extra_env), capture_output=True, text=True, timeout=300)


def check_result(result, task, metric_names):
    assert CONTRACT <= set(result), CONTRACT - set(result)
    assert result["task"] == task and result["model"] == "tiny-roberta"
    assert set(result["metrics"]) == set(metric_names)
    assert result["metrics"] == {k: result["history"][-1][k] for k in metric_names}
    assert result["history"] and all("train_loss" in h and "epoch" in h for h in result["history"])
    assert result["best_metrics"]["epoch"] in [h["epoch"] for h in result["history"]]
    assert result["saved_activation_bytes"] > 0 and result["peak_memory_bytes"] > 0
    assert result["train_samples_per_second"] > 0 and result["tokens_per_second"] > 0
    assert result["device"] == "cpu" and result["torch_version"] == torch.__version__
    assert result["config"]["task"]["name"] == task
    assert result["loss_curve"] and all({"step", "loss"} <= set(e) for e in result["loss_curve"])


# ---------------------------------------------------------------------------------------------
# Data and metrics


def test_read_tsv_quirks(tmp_path):
    """The original files' quirks: no CoLA header, MRPC's byte-order mark and stray quotes,
    string labels, a short QQP row, MNLI's gold_label column."""
    files = {
        "cola": "gj04\t1\t\tThe sailors rode the breeze.\ngj04\t0\t*\tThe more does Bill.",
        "mrpc": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                '1\t1\t2\tHe said " the witness .\t" The pie business .\n'
                "0\t3\t4\tA b .\tC d .\n",
        "rte": "index\tsentence1\tsentence2\tlabel\n0\tA dog.\tAn animal.\tentailment\n"
               "1\tA cat.\tA dog.\tnot_entailment\n",
        "qqp": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n0\t1\t2\tWhy?\tHow?\t1\n"
               "1\t3\t4\tbroken row\n2\t5\t6\tWhat?\tWho?\t0\n",
        "mnli": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
                "0\t1\t1e\tgov\t(\t(\t(\t(\tP one.\tH one.\tneutral\tneutral\n"
                "1\t2\t2c\tgov\t(\t(\t(\t(\tP two.\tH two.\tcontradiction\tcontradiction\n",
        "sst2": "sentence\tlabel\nit 's a charming journey . \t1\n",
    }
    expected = {
        "cola": {"sentence": ["The sailors rode the breeze.", "The more does Bill."],
                 "label": [1, 0]},
        "mrpc": {"sentence1": ['He said " the witness .', "A b ."],
                 "sentence2": ['" The pie business .', "C d ."], "label": [1, 0]},
        "rte": {"sentence1": ["A dog.", "A cat."], "sentence2": ["An animal.", "A dog."],
                "label": [0, 1]},
        "qqp": {"question1": ["Why?", "What?"], "question2": ["How?", "Who?"], "label": [1, 0]},
        "mnli": {"premise": ["P one.", "P two."], "hypothesis": ["H one.", "H two."],
                 "label": [1, 2]},
        "sst2": {"sentence": ["it 's a charming journey . "], "label": [1]},
    }
    for name, text in files.items():
        path = tmp_path / f"{name}.tsv"
        path.write_text(text, encoding="utf-8")
        task = validate(compose([f"task={name}"])).task
        assert glue.read_tsv(path, task) == expected[name], name


def test_load_glue_local_with_limits(glue_dir):
    task = validate(compose(["task=stsb"])).task
    data = glue.load_glue(task, glue_dir, max_train_samples=10, max_eval_samples=5)
    assert (len(data["train"]), len(data["validation"])) == (10, 5)
    assert set(data["train"].column_names) == {"sentence1", "sentence2", "label"}
    assert isinstance(data["train"][0]["label"], float)
    cola = glue.load_glue(validate(compose(["task=cola"])).task, glue_dir)
    assert len(cola["train"]) == 48 and set(cola["train"]["label"]) == {0, 1}


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_missing_data_says_both_fixes(tmp_path, folder):
    (tmp_path / "empty").mkdir()
    task = validate(compose(["task=rte"])).task
    with pytest.raises(glue.GlueDataError) as err:
        glue.load_glue(task, tmp_path / folder)
    text = str(err.value)
    assert all(s in text for s in ("data.glue_dir", "GLUE_DIR", "RTE/train.tsv", "nyu-mll/glue"))


def test_metrics_match_hand_computed_values():
    cola = validate(compose(["task=cola"])).task
    mrpc = validate(compose(["task=mrpc"])).task
    labels = np.array([1, 1, 0, 0, 1, 0, 1, 1])
    preds = np.array([1, 0, 0, 1, 1, 0, 1, 1])  # TP 4, FN 1, FP 1, TN 2
    logits = np.eye(2)[preds] * 3.0 - 1.0
    # MCC = (TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = 7 / 15
    assert glue.glue_metrics(cola, logits, labels) == pytest.approx({"matthews": 700 / 15})
    assert glue.glue_metrics(mrpc, logits, labels) == pytest.approx({"accuracy": 75.0, "f1": 80.0})
    stsb = validate(compose(["task=stsb"])).task
    scores = np.array([[1.0], [2.0], [3.0], [10.0]])
    gold = np.array([1.0, 3.0, 2.0, 4.0])
    # Pearson: cov 13 over sqrt(50 * 5); Spearman: ranks (1,2,3,4) against (1,3,2,4), 0.8.
    assert glue.glue_metrics(stsb, scores, gold) == pytest.approx(
        {"pearson": 100 * 13 / 250**0.5, "spearman": 80.0})
    assert glue.glue_metrics(stsb, np.ones((4, 1)), gold) == {"pearson": None, "spearman": None}


# ---------------------------------------------------------------------------------------------
# Runs


def test_cli_run_then_sweep_skips_finished_runs(tmp_path, glue_dir):
    base = overrides(tmp_path, glue_dir, "method.rho=0.5")
    first = cli([*base, "logger=wandb", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    copy = tmp_path / "results/runs/default/cola/gaussian-rho0.5-seed1.json"
    result = json.loads((tmp_path / "run/result.json").read_text())
    assert json.loads(copy.read_text()) == result
    check_result(result, "cola", ["matthews"])
    assert (result["sketch"], result["rho"], result["seed"]) == ("gaussian", 0.5, 1)
    assert result["patched_layers"] == 12  # 2 layers x 6; scheme=ours leaves the head exact
    assert "sketchprop.train" in result["command"] and "method.rho=0.5" in result["overrides"]
    assert list((tmp_path / "run/wandb").glob("offline-run-*")), "wandb offline run missing"
    before = copy.read_bytes()

    sweep = cli(["-m", *[o for o in base if o != "method.rho=0.5"], "method.rho=0.5,0.25"],
                tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert f"skip: {copy} exists" in sweep.stdout
    assert copy.read_bytes() == before  # never overwritten silently
    assert (tmp_path / "results/runs/default/cola/gaussian-rho0.25-seed1.json").exists()
    runs = sorted((tmp_path / "outputs/multiruns").glob("*/*/*/seed=1"))
    assert [p.parent.name.split("method.rho=")[1].split(",")[0] for p in runs] == ["0.25", "0.5"]
    assert [(p / "result.json").exists() for p in runs] == [True, False]


def test_result_records_the_commit_the_run_started_from(tmp_path, glue_dir, monkeypatch):
    """A commit made while a long run trains is not the code that ran: the run records HEAD (and
    whether the tree was dirty) as it was before training."""
    head = {"commit": "a" * 40, "dirty": False}
    monkeypatch.setattr("sketchprop.train._git_commit", lambda: (head["commit"], head["dirty"]))

    class CommitDuringTraining(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            head.update(commit="b" * 40, dirty=True)

    result = run(compose(overrides(tmp_path, glue_dir, "task=cola")), output_dir=tmp_path / "run",
                 callbacks=[CommitDuringTraining()])
    assert (result["git_commit"], result["git_dirty"]) == ("a" * 40, False)
    assert head["commit"] == "b" * 40  # the callback did run


def test_regression_run_in_process_metrics_match_predictions(tmp_path, glue_dir):
    class Keep(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, processing_class=None, **kw):
            self.model, self.tokenizer = model, processing_class

    keep = Keep()
    cfg = compose(overrides(tmp_path, glue_dir, "task=stsb", "method=dct", "method.rho=0.25",
                            "train.seed=3"))
    result = run(cfg, output_dir=tmp_path / "run", callbacks=[keep])
    check_result(result, "stsb", ["pearson", "spearman"])
    assert json.loads((tmp_path / "results/runs/default/stsb/dct-rho0.25-seed3.json").read_text()
                      ) == json.loads((tmp_path / "run/result.json").read_text())

    # Recompute the final dev metrics by hand from the trained model's predictions.
    task = validate(cfg).task
    dev = glue.load_glue(task, glue_dir, max_eval_samples=16)["validation"]
    keep.model.eval()
    with torch.no_grad():
        enc = keep.tokenizer(list(dev["sentence1"]), list(dev["sentence2"]), truncation=True,
                             max_length=32,
                             padding=True, return_tensors="pt")
        pred = keep.model(**enc).logits.squeeze(-1).double().numpy()
    gold = np.array(list(dev["label"]), dtype=np.float64)
    pearson = np.corrcoef(pred, gold)[0, 1] * 100
    rank = lambda a: np.argsort(np.argsort(a))  # noqa: E731 (no ties in random data)
    spearman = np.corrcoef(rank(pred), rank(gold))[0, 1] * 100
    assert result["metrics"]["pearson"] == pytest.approx(pearson, abs=1e-3)
    assert result["metrics"]["spearman"] == pytest.approx(spearman, abs=1e-3)


def test_exact_method_is_unpatched_and_named_rho_1(tmp_path, glue_dir):
    result = run(compose(overrides(tmp_path, glue_dir, "method=exact", "train.max_steps=2")),
                 output_dir=tmp_path / "run")
    assert (result["sketch"], result["rho"], result["patched_layers"]) == ("exact", 1.0, 0)
    assert (tmp_path / "results/runs/default/cola/exact-rho1.0-seed1.json").exists()


def test_variance_tracking_lands_in_the_result(tmp_path, glue_dir):
    layer = r"layer\.1\.intermediate\.dense$"
    result = run(compose(overrides(tmp_path, glue_dir, f"method.track_variance='{layer}'")),
                 output_dir=tmp_path / "run")
    records = result["variance"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {r["layer"] for r in records} == {"roberta.encoder.layer.1.intermediate.dense"}
    assert all(r["d2_sgd"] > 0 and r["d2_rmm"] > 0 and r["ratio"] > 0 for r in records)
    saved = json.loads((tmp_path / "results/runs/default/cola/gaussian-rho0.1-seed1.json")
                       .read_text())
    assert saved["variance"] == records


class Interrupt(Exception):
    pass


class InterruptAfterFirstCheckpoint(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        raise Interrupt(f"killed after step {state.global_step}")


def test_resume_from_last_checkpoint(tmp_path, glue_dir):
    # 16 examples, batch 8: two steps an epoch, a checkpoint at every epoch end.
    base = overrides(tmp_path, glue_dir, "train.max_steps=-1", "train.epochs=2",
                     "data.max_train_samples=16")
    with pytest.raises(Interrupt):
        run(compose(base), output_dir=tmp_path / "a", callbacks=[InterruptAfterFirstCheckpoint()])
    path = result_path(validate(compose(base)))
    ckpt = tmp_path / "ckpt/default/cola/tiny-roberta/gaussian-rho0.1-seed1"
    assert not path.exists() and (ckpt / "checkpoint-2").is_dir()

    with pytest.raises(RunError, match="train.resume=true"):  # no silent restart
        run(compose(base), output_dir=tmp_path / "b")
    result = run(compose([*base, "train.resume=true"]), output_dir=tmp_path / "c")
    assert result["resumed_from_checkpoint"].endswith("checkpoint-2")
    assert result["global_step"] == 4 and result["epochs"] == 2
    assert [h["epoch"] for h in result["history"]] == [1, 2]  # epoch 1 from the checkpoint's log
    assert path.exists() and not ckpt.exists() and not (tmp_path / "ckpt/default").exists()


def test_nan_loss_stops_with_a_message(tmp_path, glue_dir):
    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))

    with pytest.raises(FloatingPointError, match="training loss is nan at step 2"):
        run(compose(overrides(tmp_path, glue_dir)), output_dir=tmp_path / "run",
            callbacks=[Poison()])
    assert not list(tmp_path.glob("**/*.json"))
    callback = _history_callback()
    with pytest.raises(FloatingPointError, match="inf"):
        callback.on_log(None, SimpleNamespace(global_step=5, epoch=0.5), None, {"loss": np.inf})


def test_existing_result_of_another_model_is_not_skipped_silently(tmp_path, glue_dir):
    conf = validate(compose(overrides(tmp_path, glue_dir)))
    path = result_path(conf)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"model": "roberta-base"}))
    with pytest.raises(RunError, match="experiment_name"):
        run(compose(overrides(tmp_path, glue_dir)), output_dir=tmp_path / "run")


def test_existing_result_of_another_scheme_is_not_skipped_silently(tmp_path, glue_dir):
    """Same file name (sketch, rho, seed), other patching layout: a different run."""
    ours = compose(overrides(tmp_path, glue_dir))
    path = result_path(validate(ours))
    path.parent.mkdir(parents=True)
    config = OmegaConf.to_container(ours, resolve=True, enum_to_str=True)
    path.write_text(json.dumps({"model": "tiny-roberta", "config": config}))
    assert run(compose(overrides(tmp_path, glue_dir)), output_dir=tmp_path / "run") is None
    with pytest.raises(RunError, match="experiment_name"):
        run(compose(overrides(tmp_path, glue_dir, "scheme=paper")), output_dir=tmp_path / "run")


# ---------------------------------------------------------------------------------------------
# Bad inputs through the command line: each fails fast, names the problem, writes no result.

BAD = {
    "rho": (["method.rho=1.5"], ["method.rho=1.5", "(0, 1]"]),
    "task": (["task=nope"], ["Could not find 'task/nope'", "cola"]),
    "method": (["method=nope"], ["Could not find 'method/nope'", "gaussian"]),
    "sketch": (["method.sketch=nope"], ["Invalid value 'nope'", "method.sketch"]),
    "key": (["train.epochz=1"], ["train.epochz"]),
    "glue_dir": (["data.glue_dir={tmp}/nowhere"], ["data.glue_dir", "GLUE_DIR", "nyu-mll/glue"]),
    "hub_data": (["data.glue_dir=null"], ["nyu-mll/glue", "data.glue_dir", "network"]),
    "hub_model": (["model=roberta-base"], ["'roberta-base'", "model=minilm", "network"]),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, glue_dir):
    """Start every bad run at once (they only import and check), then collect them."""
    tmp = tmp_path_factory.mktemp("bad")
    hub = {"HF_HUB_OFFLINE": None, "HF_HOME": str(tmp / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    procs = {}
    for name, (args, _) in BAD.items():
        folder = tmp / name
        folder.mkdir()
        argv = [*overrides(folder, glue_dir), *[a.format(tmp=folder) for a in args],
                f"hydra.run.dir={folder}/run"]
        procs[name] = (folder, time.time(), subprocess.Popen(
            [sys.executable, "-m", "sketchprop.train", *argv], cwd=folder, env=env(**hub),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = {}
    for name, (folder, start, proc) in procs.items():
        text = proc.communicate(timeout=300)[0]
        out[name] = (proc.returncode, text, time.time() - start, folder)
    return out


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_fails_fast_with_the_fix(bad_runs, name):
    returncode, text, seconds, folder = bad_runs[name]
    assert returncode != 0
    for needle in BAD[name][1]:
        assert needle in text, f"{needle!r} not in:\n{text[-2000:]}"
    assert "Traceback" not in text  # a message, not a crash
    assert not list(folder.glob("**/*.json"))
    assert seconds < 90  # all eight start together on two cores; alone each takes seconds


# ---------------------------------------------------------------------------------------------
# Two processes


def test_ddp_two_cpu_processes(tmp_path, glue_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), "-m", "sketchprop.train",
           *overrides(tmp_path, glue_dir, "train.max_steps=2", f"hydra.run.dir={tmp_path}/run")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.glob("results/**/*.json"))
    assert len(files) == 1  # rank 0 writes, once
    result = json.loads(files[0].read_text())
    check_result(result, "cola", ["matthews"])
    assert result["world_size"] == 2 and result["global_step"] == 2
    # Two ranks of batch 8 for two steps: 32 examples, a third of the 48 training examples.
    assert result["epochs"] == pytest.approx(32 / 48, abs=1e-3)


@pytest.mark.parametrize("experiment, extra, scheme_shared, epochs", [
    ("table2", ["method=gaussian", "method.rho=0.5"], False, 10),
    ("table3", ["method=gaussian", "method.rho=0.2"], False, 1),
    ("table4", ["method=dct", "method.rho=0.1"], False, 10),
    ("table4", ["method=blocksrht", "scheme=ours", "method.rho=0.1"], True, 10),
    # The tiny model has two layers: the tracked layer 6 becomes layer 1 (a wrong name raises).
    ("figure4", [r"method.track_variance='layer\.1\.intermediate\.dense$'"], False, 10),
])
def test_paper_scale_experiments_smoke_run_on_the_tiny_model(tmp_path, glue_dir, experiment, extra,
                                                             scheme_shared, epochs):
    """The paper-scale experiments with the authors' recipe, only the model swapped for the tiny
    one and the run cut to three steps of batch 8."""
    cfg = compose([f"experiment={experiment}", "model=tiny-roberta", "logger=none",
                   f"data.glue_dir={glue_dir}", f"results_dir={tmp_path}/results",
                   f"checkpoints_dir={tmp_path}/ckpt", "train.max_length=32", "train.batch_size=8",
                   "train.max_steps=3", "data.max_eval_samples=16", *extra])
    conf = validate(cfg)
    assert conf.train.epochs == epochs and conf.train.lr_scheduler == "polynomial"
    assert conf.train.precision == "fp32" and conf.method.share_inputs == scheme_shared
    result = run(cfg, output_dir=tmp_path / "run")
    check_result(result, "cola", ["matthews"])
    name = f"{result['sketch']}-rho{result['rho']:g}-seed1.json"
    assert (tmp_path / "results/runs" / experiment / "cola" / name).exists()
    if experiment == "figure4":
        assert result["config"]["train"]["batch_size"] == 8 and result["rho"] == 0.5
        assert {r["layer"] for r in result["variance"]} == {
            "roberta.encoder.layer.1.intermediate.dense"}
