"""The GLUE pipeline end to end on a tiny random RoBERTa and GLUE-format files the tests write:
result JSON contract, metrics, sweep skip, resume, NaN stop, fast failures, DDP on two CPUs."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from sketchprop.glue import data as glue
from sketchprop.glue import paths
from sketchprop.glue.config import compose, validate
from sketchprop.glue.train import RunError, _history_callback, run, run_files

CONTRACT = {"task", "model", "sketch", "rho", "seed", "epochs", "metrics", "best_metrics",
            "history", "train_samples_per_second", "tokens_per_second", "peak_memory_bytes",
            "saved_activation_bytes", "device", "torch_version", "git_commit", "wall_seconds",
            "config", "command"}


def overrides(tmp, glue_dir, *extra):
    """A few steps of the tiny model on the fixture data, all outputs under ``tmp``, the result
    filed under ``tmp/results`` (kept)."""
    return ["model=tiny-roberta", "logger=none", "train=cpu", f"data.glue_dir={glue_dir}",
            f"results_dir={tmp}/results", f"scratch_results_dir={tmp}/scratch", "keep=true",
            f"checkpoints_dir={tmp}/ckpt", "train.max_length=32",
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


def wandb_offline_run(folder):
    """(summary, history rows) of the one offline wandb run under ``folder``, read from its
    ``.wandb`` file: a LevelDB-style log (7-byte header, 32 KiB blocks, records of checksum,
    length and type) of protobuf ``Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = folder.glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts, summary, history = 32768, 7, b"", {}, []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # the padded end of a block
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (2, 3):  # FIRST, MIDDLE: the record continues in the next block
            continue
        record = pb.Record()
        record.ParseFromString(parts)
        parts = b""

        def items(entries):
            return {(e.key or "/".join(e.nested_key)): json.loads(e.value_json) for e in entries}

        if record.WhichOneof("record_type") == "summary":
            summary.update(items(record.summary.update))
        elif record.WhichOneof("record_type") == "history":
            history.append(items(record.history.item))
    return summary, history


def filed(root, pattern):
    """The one result file under ``root`` matching ``pattern`` (a glob)."""
    found = sorted(root.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def absolute_paths(value) -> list[str]:
    """Every word of every string in ``value`` (a result, walked) that is an absolute path inside
    the repository, also as the value of ``key=value``."""
    from sketchprop.glue.config import REPO_ROOT

    if isinstance(value, dict):
        return [p for v in value.values() for p in absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in absolute_paths(v)]
    if isinstance(value, str):
        return [w for w in value.replace("=", " ").split()
                if os.path.isabs(w) and Path(w).is_relative_to(REPO_ROOT)]
    return []


def check_result(result, task, metric_names):
    assert CONTRACT <= set(result), CONTRACT - set(result)
    assert not absolute_paths(result), absolute_paths(result)
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


@pytest.mark.parametrize("task, text, error", [
    ("cola", "gj04\t1\t\tGood.\ngj04\t1\n", r"cola.tsv:2: 2 tab-separated fields, expected 4"),
    ("cola", "gj04\t1\t\tGood.\textra\n", r"cola.tsv:1: 5 tab-separated fields"),
    ("cola", "gj04\t1\t\t \n", r"cola.tsv:1: empty sentence"),
    ("cola", "gj04\tyes\t\tGood.\n", r"cola.tsv:1: label 'yes'"),
    ("rte", "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n\n1\tC.\tD.\tno\n",
     r"rte.tsv:3: 1 tab-separated fields"),
    ("stsb", "index\tsentence1\tsentence2\tscore\n0\tA.\tB.\tfour\n",
     r"stsb.tsv:2: score 'four' is not a number"),
])
def test_read_tsv_refuses_malformed_rows_with_file_and_line(tmp_path, task, text, error):
    path = tmp_path / f"{task}.tsv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(glue.GlueDataError, match=error):
        glue.read_tsv(path, validate(compose([f"task={task}"])).task)


def test_read_tsv_skips_qqp_short_rows_and_says_how_many(tmp_path, capsys):
    path = tmp_path / "qqp.tsv"
    path.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n0\t1\t2\tA?\tB?\t1\n"
                    "1\t3\n2\t4\t5\n", encoding="utf-8")
    assert glue.read_tsv(path, validate(compose(["task=qqp"])).task)["label"] == [1]
    assert "skipped 2 malformed rows" in capsys.readouterr().out


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


@pytest.mark.stack("hf-trainer", "sketch")
def test_cli_run_then_sweep_skips_finished_runs(tmp_path, glue_dir):
    base = overrides(tmp_path, glue_dir, "method.rho=0.5")
    first = cli([*base, "logger=wandb", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    copy = filed(tmp_path, "results/runs/default/cola/gaussian-rho0.5-seed1-*.json")
    result = json.loads((tmp_path / "run/result.json").read_text())
    assert copy.name == f"gaussian-rho0.5-seed1-{result['recipe']}.json"
    assert json.loads(copy.read_text()) == result
    check_result(result, "cola", ["matthews"])
    assert (result["sketch"], result["rho"], result["seed"]) == ("gaussian", 0.5, 1)
    assert result["patched_layers"] == 12  # 2 layers x 6; scheme=ours leaves the head exact
    assert "sketchprop.train" in result["command"] and "method.rho=0.5" in result["overrides"]
    # The wandb run carries the memory and speed figures and the identity, and memory per log step.
    summary, history = wandb_offline_run(tmp_path / "run/wandb")
    for key in ("peak_memory_bytes", "saved_activation_bytes", "tokens_per_second",
                "train_samples_per_second", "seconds_per_step", "torch_threads"):
        assert summary[key] == result[key], key
    assert summary["identity"] == result["identity"] and summary["recipe"] == result["recipe"]
    memory = [h["train/memory/peak_bytes"] for h in history if "train/memory/peak_bytes" in h]
    assert len(memory) == result["global_step"] and all(m > 0 for m in memory)
    before = copy.read_bytes()

    sweep = cli(["-m", *[o for o in base if o != "method.rho=0.5"], "method.rho=0.5,0.25"],
                tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert f"skip: {copy} exists" in sweep.stdout
    assert copy.read_bytes() == before  # never overwritten silently
    filed(tmp_path, "results/runs/default/cola/gaussian-rho0.25-seed1-*.json")
    runs = sorted((tmp_path / "outputs/multiruns").glob("*/*/*/seed=1"))
    assert [p.parent.name.split("method.rho=")[1].split(",")[0] for p in runs] == ["0.25", "0.5"]
    assert [(p / "result.json").exists() for p in runs] == [True, False]


def test_result_names_no_folder_of_the_machine(tmp_path, glue_dir):
    """A result records every path inside the repository relative to it (the interpreter, a
    results folder given as an absolute path inside it), folders outside it as given (the tests'
    data), and an interpreter outside it as `python`; the identity comes out the same from the
    recorded config."""
    from sketchprop.glue import migrate
    from sketchprop.glue.config import REPO_ROOT

    inside = REPO_ROOT / "outputs" / "test-portable" / tmp_path.name  # removed at the end
    try:
        result = run(compose(overrides(tmp_path, glue_dir, "train.max_steps=2",
                                       f"scratch_results_dir={inside}")),
                     output_dir=tmp_path / "run")
    finally:
        shutil.rmtree(inside, ignore_errors=True)
    assert not absolute_paths(result), absolute_paths(result)
    config = result["config"]
    assert config["data"]["glue_dir"] == str(glue_dir)  # outside the repository: as given
    assert config["scratch_results_dir"] == f"outputs/test-portable/{tmp_path.name}"
    assert result["run_dir"] == str((tmp_path / "run").resolve())
    assert result["command"].split()[0] in ("python", paths.portable(sys.executable))
    assert migrate.recorded_identity(result) == result["identity"]


def test_result_records_the_commit_the_run_started_from(tmp_path, glue_dir, monkeypatch):
    """A commit made while a long run trains is not the code that ran: the run records HEAD (and
    whether the tree was dirty) as it was before training."""
    head = {"commit": "a" * 40, "dirty": False}
    monkeypatch.setattr("sketchprop.glue.runs.git_commit", lambda repo: (head["commit"], head["dirty"]))
    monkeypatch.setattr("sketchprop.glue.train._CODE_COMMIT", None)  # as in a fresh process

    class CommitDuringTraining(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            head.update(commit="b" * 40, dirty=True)

    result = run(compose(overrides(tmp_path, glue_dir, "task=cola")), output_dir=tmp_path / "run",
                 callbacks=[CommitDuringTraining()])
    assert (result["git_commit"], result["git_dirty"]) == ("a" * 40, False)
    assert head["commit"] == "b" * 40  # the callback did run
    # The next job of a sweep runs in the same process, on the same loaded code.
    second = run(compose(overrides(tmp_path, glue_dir, "task=cola", "train.seed=2")),
                 output_dir=tmp_path / "run2")
    assert (second["git_commit"], second["git_dirty"]) == ("a" * 40, False)


def test_regression_run_in_process_metrics_match_predictions(tmp_path, glue_dir):
    class Keep(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, processing_class=None, **kw):
            self.model, self.tokenizer = model, processing_class

    keep = Keep()
    cfg = compose(overrides(tmp_path, glue_dir, "task=stsb", "method=dct", "method.rho=0.25",
                            "train.seed=3"))
    result = run(cfg, output_dir=tmp_path / "run", callbacks=[keep])
    check_result(result, "stsb", ["pearson", "spearman"])
    assert json.loads(filed(tmp_path, "results/runs/default/stsb/dct-rho0.25-seed3-*.json")
                      .read_text()) == json.loads((tmp_path / "run/result.json").read_text())

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
    filed(tmp_path, "results/runs/default/cola/exact-rho1.0-seed1-*.json")


@pytest.mark.stack("hf-trainer", "bits")
def test_exact_method_with_bits_patches_and_codes_its_rows(tmp_path, glue_dir):
    """method=exact method.bits=4 patches every linear layer but the head with the exact sketch
    and 4-bit rows: a run of its own (bits and group in its identity, the rate not), fewer saved
    bytes than exact; its group size and scheme count, and exact alone stays unpatched."""
    base = overrides(tmp_path, glue_dir, "method=exact", "scheme=ours", "train.max_steps=2")
    exact = run(compose(base), output_dir=tmp_path / "exact")
    coded = run(compose([*base, "method.bits=4"]), output_dir=tmp_path / "coded")
    assert (exact["patched_layers"], coded["patched_layers"]) == (0, 12)
    assert coded["bits"] == 4 and exact["bits"] is None
    assert coded["identity"]["method"]["bits"] == 4 and "rho" not in coded["identity"]["method"]
    assert exact["identity"]["method"] == {"sketch": "exact"}
    assert coded["saved_activation_bytes"] < 0.9 * exact["saved_activation_bytes"]
    assert len(list((tmp_path / "results/runs/default/cola").glob("exact-rho1.0-seed1-*"))) == 2
    files = [run_files(validate(compose(o)), compose(o), glue_dir).ident for o in (
        [*base, "method.bits=4"], [*base, "method.bits=4", "method.group=32"],
        [*base, "method.bits=4", "scheme=paper"], [*base, "method.bits=4", "method.rho=0.5"])]
    assert files[0] != files[1] and files[0] != files[2] and files[0] == files[3]


@pytest.mark.stack("hf-trainer", "compact")
def test_compact_activations_run_and_count_what_they_keep(tmp_path, glue_dir):
    """activations=compact patches the tiny model's 8 dropout and 2 GELU modules and switches its
    attention; the saved bytes in the result count the codes and seeds, not what they replace."""
    base = overrides(tmp_path, glue_dir, "train.max_steps=2")
    stored = run(compose(base), output_dir=tmp_path / "stored")
    compact = run(compose([*base, "activations=compact", f"results_dir={tmp_path}/compact"]),
                  output_dir=tmp_path / "compact")
    assert (stored["compact_modules"], compact["compact_modules"]) == (0, 10)
    assert compact["identity"]["activations"] == {
        "dropout": "seeded", "attention": "recompute", "gelu_bits": 2, "gelu_code": "stochastic"}
    assert "activations" not in stored["identity"]  # stored: neutral, no committed run renamed
    assert compact["saved_activation_bytes"] < 0.8 * stored["saved_activation_bytes"]
    assert all(v is not None for v in compact["metrics"].values())


def test_the_floor_runs_alone_and_on_compact_and_joins_the_identity(tmp_path, glue_dir):
    """activations.floor_bits=4: alone (on activations=stored) and on compact, a part of the run's
    identity (off: neutral), and the result's saved bytes count its codes (on this tiny model
    most tensors are below the floor's size: with compact, what is left is)."""
    base = overrides(tmp_path, glue_dir, "train.max_steps=2")
    runs_ = {}
    for name, extra in (("stored", []), ("compact", ["activations=compact"]),
                        ("floor", ["activations.floor_bits=4"]),
                        ("compact+floor", ["activations=compact", "activations.floor_bits=4"])):
        runs_[name] = run(compose([*base, *extra, f"results_dir={tmp_path}/{name}"]),
                          output_dir=tmp_path / name)
    assert runs_["floor"]["identity"]["activations"] == {"dropout": "stored",
                                                         "attention": "stored",
                                                         "gelu_bits": None, "floor_bits": 4}
    assert "floor_bits" not in runs_["compact"]["identity"]["activations"]
    saved = {k: r["saved_activation_bytes"] for k, r in runs_.items()}
    assert saved["floor"] < 0.9 * saved["stored"] and saved["compact+floor"] <= saved["compact"]
    with pytest.raises(Exception, match="activations.floor_bits"):
        validate(compose([*base, "activations.floor_bits=3"]))


def test_variance_tracking_lands_in_the_result(tmp_path, glue_dir):
    import math

    from sketchprop.variance import normalized_ratio

    class RealTokens(TrainerCallback):
        """The non-padding tokens of each training forward."""

        counts: list[int] = []

        def on_train_begin(self, args, state, control, model=None, **kw):
            model.register_forward_pre_hook(
                lambda m, a, k: self.counts.append(int(k["attention_mask"].sum()))
                if m.training else None, with_kwargs=True)

    layer = r"layer\.1\.intermediate\.dense$"
    tokens = RealTokens()
    result = run(compose(overrides(tmp_path, glue_dir, f"method.track_variance='{layer}'")),
                 output_dir=tmp_path / "run", callbacks=[tokens])
    records = result["variance"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {r["layer"] for r in records} == {"roberta.encoder.layer.1.intermediate.dense"}
    # skip_padding: each step's B is the batch's real tokens (the saved-bytes measurement after
    # training makes one more forward); B_proj and the ratio follow from it.
    assert [r["b"] for r in records] == tokens.counts[:len(records)]
    for r in records:
        assert r["sketch"] == "gaussian" and r["b_proj"] == max(16, math.ceil(0.1 * r["b"] - 1e-9))
        assert r["d2_sgd"] > 0 and r["d2_rmm"] > 0
        assert r["ratio"] == pytest.approx(
            normalized_ratio(r["d2_rmm"], r["d2_sgd"], r["b"], r["b_proj"]), rel=1e-9)
    saved = json.loads(filed(tmp_path, "results/runs/default/cola/gaussian-rho0.1-seed1-*.json")
                       .read_text())
    assert saved["variance"] == records


def test_lora_adapter_trains_the_adapters_and_sketches_their_lora_a(tmp_path, glue_dir):
    """adapter=lora: the model's weights stay as they were, the adapters and the head train, and
    the sketch goes to the adapters' down-projections only, which then store less than exact
    LoRA's."""
    from sketchprop import RandomizedLinear

    class Keep(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            self.model = model
            self.before = {k: v.clone() for k, v in model.state_dict().items()}

    keep = Keep()
    result = run(compose(overrides(tmp_path, glue_dir, "adapter=lora", "method=blocksrht")),
                 output_dir=tmp_path / "run", callbacks=[keep])
    check_result(result, "cola", ["matthews"])
    assert result["identity"]["adapter"] == {"name": "lora", "r": 8, "alpha": 16.0,
                                             "dropout": 0.0, "target_modules": ["query", "value"]}
    assert result["identity"]["method"]["targets"] == "lora_A"
    patched = sorted(n for n, m in keep.model.named_modules() if isinstance(m, RandomizedLinear))
    assert result["patched_layers"] == len(patched) == 4
    assert all(n.endswith(("query.lora_A.default", "value.lora_A.default")) for n in patched)
    after = keep.model.state_dict()
    changed = {k for k, v in keep.before.items() if not torch.equal(v, after[k])}
    assert changed and all("lora_" in k or "classifier.modules_to_save" in k for k in changed)
    assert any("lora_A" in k for k in changed) and any("modules_to_save" in k for k in changed)

    exact = run(compose(overrides(tmp_path, glue_dir, "adapter=lora", "method=exact")),
                output_dir=tmp_path / "exact")
    assert exact["patched_layers"] == 0
    assert result["saved_activation_bytes"] < exact["saved_activation_bytes"]


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
    files = run_files(validate(compose(base)), compose(base), glue_dir)
    ckpt = files.checkpoints
    assert ckpt.parent == tmp_path / "ckpt/default/cola/tiny-roberta"
    assert not files.index.exists() and (ckpt / "checkpoint-2").is_dir()

    # Started again, the run continues from its checkpoint (no flag needed).
    result = run(compose(base), output_dir=tmp_path / "c")
    assert result["resumed_from_checkpoint"].endswith("checkpoint-2")
    assert result["global_step"] == 4 and result["epochs"] == 2
    assert [h["epoch"] for h in result["history"]] == [1, 2]  # epoch 1 from the checkpoint's log
    assert files.index.exists() and not ckpt.exists() and not (tmp_path / "ckpt/default").exists()


def test_resume_passes_over_an_incomplete_checkpoint(tmp_path, glue_dir, capsys):
    """A run killed while writing its newest checkpoint resumes from the one before."""
    base = overrides(tmp_path, glue_dir, "train.max_steps=-1", "train.epochs=3",
                     "data.max_train_samples=16")

    class InterruptAfterSecondCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 4:
                raise Interrupt("killed after step 4")

    # save_total_limit=1 keeps only the newest checkpoint: keep a copy of the first one.
    class KeepFirst(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                import shutil
                src = f"{args.output_dir}/checkpoint-2"
                shutil.copytree(src, f"{args.output_dir}/.keep-2")

    with pytest.raises(Interrupt):
        run(compose(base), output_dir=tmp_path / "a",
            callbacks=[KeepFirst(), InterruptAfterSecondCheckpoint()])
    ckpt = run_files(validate(compose(base)), compose(base), glue_dir).checkpoints
    (ckpt / ".keep-2").rename(ckpt / "checkpoint-2")
    (ckpt / "checkpoint-4" / "trainer_state.json").unlink()  # killed before the last file
    capsys.readouterr()
    result = run(compose(base), output_dir=tmp_path / "b")
    out = capsys.readouterr().out
    assert f"{ckpt / 'checkpoint-4'} is incomplete" in out and "passed over" in out
    assert result["resumed_from_checkpoint"].endswith("checkpoint-2")
    assert result["global_step"] == 6


def test_resume_false_starts_afresh_and_says_so(tmp_path, glue_dir, capsys):
    base = overrides(tmp_path, glue_dir, "train.max_steps=-1", "train.epochs=2",
                     "data.max_train_samples=16")
    with pytest.raises(Interrupt):
        run(compose(base), output_dir=tmp_path / "a", callbacks=[InterruptAfterFirstCheckpoint()])
    capsys.readouterr()
    result = run(compose([*base, "train.resume=false"]), output_dir=tmp_path / "b")
    assert "train.resume=false: starting afresh" in capsys.readouterr().out
    assert result["resumed_from_checkpoint"] is None and result["global_step"] == 4


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


def test_a_short_run_never_stands_in_for_the_full_run(tmp_path, glue_dir, capsys):
    """Runs that differ only in max_steps (or any other setting of the recipe, the data limits,
    the method, the model) are two runs: both train, each has its own file."""
    short = run(compose(overrides(tmp_path, glue_dir, "train.max_steps=2")),
                output_dir=tmp_path / "a")
    full = run(compose(overrides(tmp_path, glue_dir, "train.max_steps=3")),
               output_dir=tmp_path / "b")
    assert full is not None and short["recipe"] != full["recipe"]
    assert (short["global_step"], full["global_step"]) == (2, 3)
    files = sorted((tmp_path / "results/runs/default/cola").glob("gaussian-rho0.1-seed1-*.json"))
    assert len(files) == 2
    assert run(compose(overrides(tmp_path, glue_dir, "train.max_steps=2")),
               output_dir=tmp_path / "c") is None  # the same identity: skipped
    assert "skip:" in capsys.readouterr().out


@pytest.mark.parametrize("change", [
    "train.max_steps=4", "train.learning_rate=2e-3", "train.max_length=24", "train.precision=bf16",
    "train.eval_batch_size=4", "data.max_train_samples=40", "data.max_eval_samples=8",
    "method.rho=0.2", "method.min_rows=4", "method.targets=query", "scheme=paper",
    "model.random.hidden_size=16", "train.gradient_checkpointing=true", "train.seed=2",
    "task=stsb", "method.allocate=variance", "method=importance", "adapter=lora",
    "activations=compact", "activations.gelu_bits=2", "activations.dropout=seeded",
    "method.bits=4"])
def test_identity_covers_every_setting_that_changes_the_result(tmp_path, glue_dir, change):
    base = overrides(tmp_path, glue_dir)
    a = run_files(validate(compose(base)), compose(base), glue_dir)
    b = run_files(validate(compose([*base, change])), compose([*base, change]), glue_dir)
    assert a.ident != b.ident and a.index != b.index and a.checkpoints != b.checkpoints


@pytest.mark.parametrize("change", ["adapter.r=4", "adapter.alpha=8", "adapter.dropout=0.1",
                                    "adapter.target_modules=[query]"])
def test_identity_covers_every_adapter_key(tmp_path, glue_dir, change):
    base = overrides(tmp_path, glue_dir, "adapter=lora")
    a = run_files(validate(compose(base)), compose(base), glue_dir)
    b = run_files(validate(compose([*base, change])), compose([*base, change]), glue_dir)
    assert a.ident != b.ident and a.index != b.index


@pytest.mark.parametrize("change", [
    "train.logging_steps=7", "train.checkpoint=false", "train.resume=false", "threads=1",
    "logger=wandb", "experiment_name=default", "results_dir=/elsewhere", "overwrite=true",
    "activations=stored", "activations.gelu_code=optimal", "method.group=32", "method.bits=null"])
def test_identity_leaves_out_what_cannot_change_the_result(tmp_path, glue_dir, change):
    base = overrides(tmp_path, glue_dir)
    a = run_files(validate(compose(base)), compose(base), glue_dir)
    b = run_files(validate(compose([*base, change])), compose([*base, change]), glue_dir)
    assert a.ident == b.ident and a.index.name == b.index.name


def test_identity_follows_the_data_files_not_their_folder(tmp_path, glue_dir):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(glue_dir, copy)
    base = overrides(tmp_path, glue_dir)
    moved = overrides(tmp_path, copy)
    ident = run_files(validate(compose(base)), compose(base), glue_dir).ident
    assert run_files(validate(compose(moved)), compose(moved), copy).ident == ident
    with open(copy / "CoLA/dev.tsv", "a") as f:
        f.write("gj04\t1\t\tone more row.\n")
    assert run_files(validate(compose(moved)), compose(moved), copy).ident != ident
    assert run_files(validate(compose(base)), compose(base), None).ident["data"]["source"] == "hub"


def test_a_file_of_another_run_under_the_same_name_is_refused(tmp_path, glue_dir):
    files = run_files(validate(compose(overrides(tmp_path, glue_dir))),
                      compose(overrides(tmp_path, glue_dir)), glue_dir)
    files.index.parent.mkdir(parents=True)
    files.index.write_text(json.dumps({"identity": {"task": "something else"}}))
    with pytest.raises(RunError, match="holds another run"):
        run(compose(overrides(tmp_path, glue_dir)), output_dir=tmp_path / "run")


def test_runs_not_kept_leave_the_tracked_results_alone(tmp_path, glue_dir, capsys):
    """Without keep=true the result lands in the run folder and the scratch index only."""
    args = [o for o in overrides(tmp_path, glue_dir) if o != "keep=true"]
    result = run(compose(args), output_dir=tmp_path / "run")
    assert result["kept"] is False
    assert not (tmp_path / "results").exists()
    assert (tmp_path / "run/result.json").exists()
    filed(tmp_path, "scratch/runs/default/cola/gaussian-rho0.1-seed1-*.json")
    out = capsys.readouterr().out
    assert f"result: {tmp_path / 'run/result.json'}" in out and "not kept" in out


def test_a_sweep_runs_past_a_failing_job_and_summarises(tmp_path, glue_dir):
    base = overrides(tmp_path, glue_dir, "train.max_steps=2")
    sweep = cli(["-m", *base, "method.rho=1.5,0.5"], tmp_path)
    assert sweep.returncode == 1
    filed(tmp_path, "results/runs/default/cola/gaussian-rho0.5-seed1-*.json")  # job 1 ran
    err = sweep.stderr
    assert "sweep: 1 job(s) failed" in err and "method.rho=1.5" in err and "(0, 1]" in err
    rerun = next(line for line in err.splitlines() if "rerun:" in line)
    assert "sketchprop.train -m" in rerun and "method.rho=1.5" in rerun
    assert "method.rho=0.5" not in rerun


def test_interrupt_says_how_to_continue(tmp_path, glue_dir):
    base = overrides(tmp_path, glue_dir, "train.max_steps=-1", "train.epochs=2",
                     "data.max_train_samples=16")

    class CtrlC(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        run(compose(base), output_dir=tmp_path / "a", callbacks=[CtrlC()])
    message = str(info.value)
    assert "interrupted at step 3" in message and "checkpoint-2" in message
    assert "Run the same command again" in message


def test_sigterm_on_the_command_line_prints_the_resume_command(tmp_path, glue_dir):
    import signal

    argv = [sys.executable, "-m", "sketchprop.train",
            *overrides(tmp_path, glue_dir, "train.max_steps=100000", "train.logging_steps=1")]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # the first training log line: the run is in its training loop
        if "'loss'" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    err = out
    assert proc.returncode == 130, err[-2000:]
    assert "the same command again" in err and "sketchprop.train" in err
    assert "Traceback" not in err


def test_a_malformed_data_row_is_refused_with_its_line(tmp_path, glue_dir):
    import shutil

    bad = tmp_path / "glue"
    shutil.copytree(glue_dir, bad)
    lines = (bad / "CoLA/train.tsv").read_text().splitlines()
    lines[6] = "gj04\t1"  # a row cut short
    (bad / "CoLA/train.tsv").write_text("\n".join(lines) + "\n")
    with pytest.raises(glue.GlueDataError, match=r"CoLA/train.tsv:7: 2 tab-separated fields"):
        run(compose(overrides(tmp_path, bad)), output_dir=tmp_path / "run")
    assert not list(tmp_path.glob("results/**/*.json"))


# ---------------------------------------------------------------------------------------------
# Bad inputs through the command line: each fails fast, names the problem, writes no result.

BAD = {
    "rho": (["method.rho=1.5"], ["method.rho=1.5", "(0, 1]"]),
    "task": (["task=nope"], ["Could not find 'task/nope'", "cola"]),
    "method": (["method=nope"], ["Could not find 'method/nope'", "gaussian"]),
    "sketch": (["method.sketch=nope"], ["Invalid value 'nope'", "method.sketch"]),
    "key": (["train.epochz=1"], ["train.epochz"]),
    "plus_key": (["+train.learing_rate=1e-4"], ["train.learing_rate", "train.learning_rate"]),
    "glue_dir": (["data.glue_dir={tmp}/nowhere"], ["data.glue_dir", "GLUE_DIR", "nyu-mll/glue"]),
    # QNLI's files are not shipped in data/glue: without GLUE_DIR it needs the hub.
    "hub_data": (["data.glue_dir=null", "task=qnli"], ["nyu-mll/glue", "data.glue_dir", "network"]),
    "hub_model": (["model=roberta-base"], ["'roberta-base'", "MODEL=minilm", "network"]),
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


@pytest.mark.stack("ddp", "sketch", "compact")
@pytest.mark.parametrize("method", [[], ["method=importance", "method.allocate=variance"],
                                    ["activations=compact"]])
def test_ddp_two_cpu_processes(tmp_path, glue_dir, method):
    """Each rank draws its own sketches; importance sampling learns its estimate and allocates
    its rows per rank; the compact activations train under DDP too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), "-m", "sketchprop.train",
           *overrides(tmp_path, glue_dir, "train.max_steps=2", f"hydra.run.dir={tmp_path}/run"),
           *method]
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
    name = f"{result['sketch']}-rho{result['rho']:g}-seed1-{result['recipe']}.json"
    assert (tmp_path / "results/runs" / experiment / "cola" / name).exists()
    if experiment == "figure4":
        assert result["config"]["train"]["batch_size"] == 8 and result["rho"] == 0.5
        assert {r["layer"] for r in result["variance"]} == {
            "roberta.encoder.layer.1.intermediate.dense"}
