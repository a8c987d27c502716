"""GLUE metrics: each against a hand computation on examples where a shifted, swapped or
thresholded prediction gives another value, and CoLA's reported MCC recomputed from the predictions
of the model a run trained."""

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from sketchprop.glue import data as glue
from sketchprop.glue.config import compose, validate
from sketchprop.glue.hf_metric import PATH as GLUE_METRIC
from sketchprop.glue.hf_metric import REGRESSION, TASK_METRICS
from sketchprop.glue.train import run


def task(name):
    return validate(compose([f"task={name}"])).task


# A wrong prediction must move a metric (in points, x100) by more than this: far outside the
# 1e-6 relative tolerance of the comparisons.
MARGIN = 0.1


# Twenty binary examples, classes interleaved (sorted ones keep their confusion matrix when shifted):
# TP 7, FN 3 (rows 3, 9, 15), FP 2 (rows 5, 12), TN 8.
LABELS = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0])
PREDS = np.array([1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 0])
# Logits whose argmax is PREDS. Rows 5, 9, 11, 15 have both logits positive; at 9 and 15
# (predicted 0) thresholding the class-1 logit at 0 disagrees with the argmax.
LOGITS = np.array([[-1.0, 2.0]] * 20)
LOGITS[PREDS == 0] = [2.0, -1.0]
LOGITS[[5, 11]] = [[0.5, 1.5], [1.0, 2.0]]     # predicted 1
LOGITS[[9, 15]] = [[2.0, 0.5], [1.5, 0.2]]     # predicted 0
MCC = 100 * (7 * 8 - 2 * 3) / np.sqrt((7 + 2) * (7 + 3) * (8 + 2) * (8 + 3))  # 50 / sqrt(9900)
ACCURACY = 100 * 15 / 20
F1 = 100 * 2 * 7 / (2 * 7 + 2 + 3)                                              # 14 / 19


def confusion(labels, preds):
    tp = int(((labels == 1) & (preds == 1)).sum())
    tn = int(((labels == 0) & (preds == 0)).sum())
    fp = int(((labels == 0) & (preds == 1)).sum())
    fn = int(((labels == 1) & (preds == 0)).sum())
    return tp, tn, fp, fn


def hand_binary(labels, preds):
    """The three metrics from the confusion counts, written out."""
    tp, tn, fp, fn = confusion(labels, preds)
    den = np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    return {"matthews": 100 * (tp * tn - fp * fn) / den if den else 0.0,
            "accuracy": 100 * (tp + tn) / len(labels),
            "f1": 100 * 2 * tp / (2 * tp + fp + fn)}


# The plausible mistakes: predictions shifted by one example, classes swapped (also as F1 of the
# negative class), the positive logit thresholded at 0 instead of the argmax.
WRONG_PREDS = {
    "shifted": np.roll(PREDS, 1),
    "classes swapped": 1 - PREDS,
    "thresholded": (LOGITS[:, 1] > 0).astype(int),
}


def test_binary_hand_values():
    assert confusion(LABELS, PREDS) == (7, 8, 2, 3)
    assert LOGITS.argmax(1).tolist() == PREDS.tolist()
    assert hand_binary(LABELS, PREDS) == pytest.approx(
        {"matthews": MCC, "accuracy": ACCURACY, "f1": F1})
    for what, wrong in WRONG_PREDS.items():
        values = hand_binary(LABELS, wrong)
        for metric, right in (("matthews", MCC), ("accuracy", ACCURACY), ("f1", F1)):
            assert abs(values[metric] - right) > MARGIN, f"{metric} misses {what} predictions"
    negative_f1 = 100 * 2 * 8 / (2 * 8 + 2 + 3)   # 16 / 21: F1 of class 0
    assert abs(negative_f1 - F1) > MARGIN


def test_matthews_cola():
    assert glue.glue_metrics(task("cola"), LOGITS, LABELS) == pytest.approx({"matthews": MCC})


@pytest.mark.parametrize("name", ["mrpc", "qqp"])
def test_accuracy_and_f1(name):
    assert glue.glue_metrics(task(name), LOGITS, LABELS) == pytest.approx(
        {"accuracy": ACCURACY, "f1": F1})


@pytest.mark.parametrize("name", ["sst2", "rte", "qnli", "wnli"])
def test_accuracy_binary_tasks(name):
    assert glue.glue_metrics(task(name), LOGITS, LABELS) == pytest.approx({"accuracy": ACCURACY})


def test_accuracy_three_classes_mnli():
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2])
    preds = np.array([0, 1, 2, 1, 1, 0, 0, 2, 2, 0, 1, 1])  # 8 of 12 right
    logits = np.full((12, 3), -1.0)
    logits[np.arange(12), preds] = 2.0
    logits[1, 2] = 1.0  # a second positive logit: only the argmax decides
    assert glue.glue_metrics(task("mnli"), logits, labels) == pytest.approx({"accuracy": 800 / 12})
    assert (np.roll(preds, 1) == labels).sum() != 8


# Twelve scores against gold values, monotone but not linear (Spearman above Pearson), no ties.
SCORES = np.array([0.2, 0.9, 1.4, 1.1, 2.6, 2.2, 3.3, 3.8, 3.1, 4.6, 4.4, 9.0])
GOLD = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.2, 4.5, 5.0])


def pearson(a, b):
    a, b = a - a.mean(), b - b.mean()
    return 100 * (a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum())


def spearman(a, b):
    """``1 - 6 sum d^2 / (n (n^2 - 1))`` of the rank differences ``d`` (no ties)."""
    rank_a, rank_b = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    n = len(a)
    return 100 * (1 - 6 * ((rank_a - rank_b) ** 2).sum() / (n * (n * n - 1)))


def test_regression_hand_values():
    # Ranks of SCORES: 0 1 3 2 5 4 7 8 6 10 9 11 against GOLD's 0 .. 11: sum d^2 = 8 * 1 + 4 = 12.
    assert spearman(SCORES, GOLD) == pytest.approx(100 * (1 - 6 * 12 / (12 * 143)))
    got = glue.glue_metrics(task("stsb"), SCORES[:, None], GOLD)
    assert got == pytest.approx({"pearson": pearson(SCORES, GOLD),
                                 "spearman": spearman(SCORES, GOLD)})
    assert got["spearman"] - got["pearson"] > MARGIN  # telling the two correlations apart
    swapped = SCORES.copy()
    swapped[[0, 11]] = swapped[[11, 0]]
    for what, wrong in (("shifted", np.roll(SCORES, 1)), ("swapped", swapped),
                        ("thresholded", np.round(SCORES))):
        assert abs(pearson(wrong, GOLD) - got["pearson"]) > MARGIN, what
    for what, wrong in (("shifted", np.roll(SCORES, 1)), ("swapped", swapped)):
        assert abs(spearman(wrong, GOLD) - got["spearman"]) > MARGIN, what


def test_constant_predictions_have_no_correlation():
    assert glue.glue_metrics(task("stsb"), np.ones((12, 1)), GOLD) == {"pearson": None,
                                                                      "spearman": None}


# ---------------------------------------------------------------------------------------------
# A CoLA run: the reported MCC is the MCC of the trained model's dev predictions.


@pytest.mark.parametrize("name", sorted(TASK_METRICS))
def test_the_evaluate_module_equals_glue_metrics(name):
    """The shipped evaluate module, loaded by path as the pipeline loads it, gives exactly what
    glue_metrics gives on random predictions (float32 scores, as the trainer passes them), and
    the pipeline's compute_metrics does too."""
    import evaluate
    from transformers import EvalPrediction

    conf = task(name)
    assert TASK_METRICS[name] == tuple(m.value for m in conf.metrics)
    assert (name in REGRESSION) == conf.regression
    rng = np.random.default_rng(sum(map(ord, name)))
    n = 500
    if conf.regression:
        logits = rng.normal(2.5, 1.0, size=(n, 1)).astype(np.float32)
        labels = rng.uniform(0, 5, size=n).astype(np.float32)
        predictions = logits.reshape(-1)
    else:
        logits = rng.normal(size=(n, len(conf.labels))).astype(np.float32)
        # Labels that agree with the argmax 70% of the time: metrics far from their chance value.
        labels = np.where(rng.random(n) < 0.7, logits.argmax(-1),
                          rng.integers(0, len(conf.labels), n))
        predictions = logits.argmax(-1)
    expected = glue.glue_metrics(conf, logits, labels)
    assert set(expected) == set(TASK_METRICS[name]) and None not in expected.values()
    metric = evaluate.load(GLUE_METRIC, name, keep_in_memory=True)
    assert metric.compute(predictions=predictions, references=labels) == expected
    assert glue.compute_metrics(conf)(EvalPrediction(logits, labels)) == expected


def test_the_evaluate_module_refuses_an_unknown_task():
    import evaluate

    with pytest.raises(KeyError, match="unknown GLUE task 'colaa'"):
        evaluate.load(GLUE_METRIC, "colaa", keep_in_memory=True)


def run_overrides(tmp, glue_dir, *extra):
    """A few steps of the tiny model on the fixture data, all outputs under ``tmp``."""
    base = ["model=tiny-roberta", "logger=none", "train=cpu", f"data.glue_dir={glue_dir}",
            f"results_dir={tmp}/results", f"checkpoints_dir={tmp}/ckpt", "train.max_length=32",
            "train.batch_size=8", "train.max_steps=3", "train.logging_steps=1",
            "train.learning_rate=1e-3", "data.max_eval_samples=16"]
    if "keep" in compose([]):  # file the result under results_dir (in tmp), where the key exists
        base.append("keep=true")
    return [*base, *extra]


def dev_margins(model, tokenizer, sentences):
    """Class-1 minus class-0 logit of each dev sentence, as the evaluation batches them."""
    model.eval()
    with torch.no_grad():
        enc = tokenizer(sentences, truncation=True, max_length=32, padding=True,
                        return_tensors="pt")
        logits = model(**enc).logits
    return logits[:, 1] - logits[:, 0]


def test_cola_run_reports_the_mcc_of_its_predictions(tmp_path, glue_dir):
    cfg = compose(run_overrides(tmp_path, glue_dir, "task=cola", "method=gaussian",
                                "method.rho=0.5", "train.seed=1"))
    dev = glue.load_glue(validate(cfg).task, glue_dir, max_eval_samples=16)["validation"]
    sentences, labels = list(dev["sentence"]), np.array(list(dev["label"]))

    class CentreAndKeep(TrainerCallback):
        """Three steps teach the random model little: its margins vary with the input but all
        favour one class, so every MCC would be 0. After the last step, before the final
        evaluation, the class-1 bias moves by the median dev margin: half the dev set is
        predicted 1. The model is kept for the check."""

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            if state.global_step == state.max_steps:
                median = dev_margins(model, processing_class, sentences).median()
                with torch.no_grad():
                    model.classifier.out_proj.bias[1] -= median
                model.train()
            self.model, self.tokenizer = model, processing_class

    keep = CentreAndKeep()
    result = run(cfg, output_dir=tmp_path / "run", callbacks=[keep])

    preds = (dev_margins(keep.model, keep.tokenizer, sentences) > 0).long().numpy()
    mcc = hand_binary(labels, preds)["matthews"]
    assert result["metrics"]["matthews"] == pytest.approx(mcc, abs=1e-6)
    # The check has power: both classes are predicted, and a shift by one example changes the MCC.
    assert 0 < preds.sum() < len(preds)
    assert abs(hand_binary(labels, np.roll(preds, 1))["matthews"] - mcc) > MARGIN
