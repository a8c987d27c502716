"""The GLUE metrics as an ``evaluate`` module, loaded by path, so it works offline:

    import evaluate
    from sketchprop.glue.hf_metric import PATH

    metric = evaluate.load(PATH, "cola", keep_in_memory=True)
    metric.compute(predictions=logits.argmax(-1), references=labels)   # {"matthews": 12.3}

The configuration is the task (``cola``, ``sst2``, ``mrpc``, ``qqp``, ``stsb``, ``mnli``, ``qnli``,
``rte``, ``wnli``). Predictions are class ids, or scores for ``stsb``. The definitions are those of
:func:`sketchprop.glue.metric.glue_metrics`: scikit-learn's Matthews correlation, accuracy and binary F1,
scipy's Pearson and Spearman correlations, all x100 and named as in the paper (the hub's ``glue``
metric, which needs the hub, reports fractions under other names). A correlation of constant
predictions is undefined and reported as None.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import datasets
import evaluate
import numpy as np

from sketchprop.glue.metric import glue_metrics

#: This file: what ``evaluate.load`` is given.
PATH = str(Path(__file__).resolve())

#: Each task's metrics, in the order the paper reports them (the first is the table's).
TASK_METRICS = {
    "cola": ("matthews",), "sst2": ("accuracy",), "mrpc": ("accuracy", "f1"),
    "qqp": ("accuracy", "f1"), "stsb": ("pearson", "spearman"), "mnli": ("accuracy",),
    "qnli": ("accuracy",), "rte": ("accuracy",), "wnli": ("accuracy",),
}
REGRESSION = ("stsb",)

_DESCRIPTION = "GLUE dev-set metrics x100, named as in Bershatsky et al. (2022), offline."
_CITATION = """@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and
          Bowman, Samuel R.},
  booktitle={ICLR}, year={2019}}"""
_INPUTS = """predictions: class ids (float scores for stsb). references: gold labels (scores for stsb).
Returns the task's metrics x100, e.g. {"accuracy": 84.1, "f1": 88.9} for mrpc."""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class GlueX100(evaluate.Metric):
    """GLUE metrics x100 for one task (the configuration name)."""

    def _info(self):
        if self.config_name not in TASK_METRICS:
            raise KeyError(f"unknown GLUE task {self.config_name!r}: give one of "
                           f"{', '.join(TASK_METRICS)} as the configuration name")
        # float32 for scores: the trainer's predictions and labels are float32, so the values
        # reach the formulas unchanged.
        kind = "float32" if self.config_name in REGRESSION else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value(kind),
                                        "references": datasets.Value(kind)}),
            format="numpy")

    def _compute(self, predictions, references):
        task = SimpleNamespace(metrics=TASK_METRICS[self.config_name],
                               regression=self.config_name in REGRESSION)
        return glue_metrics(task, np.asarray(predictions), np.asarray(references))
