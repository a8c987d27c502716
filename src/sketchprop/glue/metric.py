"""The GLUE metrics, x100 and named as in the paper: the definitions that the ``evaluate`` module
:mod:`sketchprop.glue.hf_metric`, the training pipeline and the baselines all use."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["glue_metrics"]


def _value(x):
    """An enum member's value (config enums), or ``x`` itself."""
    return getattr(x, "value", x)


def glue_metrics(task, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float | None]:
    """The task's metrics, x100, named as in the paper (``matthews``, ``accuracy``, ``f1``,
    ``pearson``, ``spearman``). ``predictions`` are logits (or scores for regression).

    A correlation of constant predictions is undefined: reported as None.
    """
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    predictions = np.asarray(predictions)
    labels = np.asarray(labels)
    if task.regression:
        preds = predictions.reshape(-1).astype(np.float64)
    else:
        preds = predictions.argmax(-1) if predictions.ndim > 1 else predictions
    scores = {
        "matthews": lambda: matthews_corrcoef(labels, preds),
        "accuracy": lambda: accuracy_score(labels, preds),
        "f1": lambda: f1_score(labels, preds),
        "pearson": lambda: pearsonr(preds, labels)[0],
        "spearman": lambda: spearmanr(preds, labels)[0],
    }
    out = {}
    for metric in task.metrics:
        name = _value(metric)
        if name in ("pearson", "spearman") and (np.ptp(preds) == 0 or np.ptp(labels) == 0):
            out[name] = None
            continue
        value = float(scores[name]()) * 100
        out[name] = value if math.isfinite(value) else None
    return out
