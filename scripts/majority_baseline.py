"""The majority-class baseline of each GLUE task's dev set, with the pipeline's own metric code.

A model that always predicts the most frequent label of the training split (for STS-B, the mean
training score: every correlation is then undefined and reported as None). Writes
``results/baselines/majority.json``; ``scripts/make_tables.py`` adds it to Table 2 as the floor an
exact baseline must clear to be credible.

    python scripts/majority_baseline.py     # make table2-cpu runs it; GLUE files: data/glue

``--glue-dir`` defaults to ``$GLUE_DIR``, else the GLUE files shipped in ``data/glue``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from sketchprop.glue.config import compose, validate
from sketchprop.glue.data import glue_metrics, load_glue
from sketchprop.glue.paths import portable_command

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["cola", "sst2", "mrpc", "stsb", "rte"]


def majority(task_name: str, glue_dir: str) -> dict:
    task = validate(compose([f"task={task_name}"])).task
    data = load_glue(task, glue_dir)
    train = np.asarray(data["train"]["label"])
    out = {}
    for dev in task.dev:
        labels = np.asarray(data[dev.split]["label"])
        if task.regression:
            preds = np.full(len(labels), float(train.mean()))
        else:
            top = Counter(train.tolist()).most_common(1)[0][0]
            preds = np.eye(len(task.labels))[np.full(len(labels), top)]
        out[dev.split] = glue_metrics(task, preds, labels)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--glue-dir", default=os.environ.get("GLUE_DIR") or str(ROOT / "data" / "glue"))
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--out", default=str(ROOT / "results" / "baselines" / "majority.json"))
    args = p.parse_args(argv)
    if not args.glue_dir or not Path(args.glue_dir).is_dir():
        p.error(f"no GLUE folder at {args.glue_dir!r}: pass --glue-dir or set GLUE_DIR")
    result = {"command": portable_command([Path(sys.executable).name, *sys.argv]),
              "rule": "most frequent training label (STS-B: mean training score)",
              "tasks": {t: majority(t, args.glue_dir) for t in args.tasks.split(",")}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps(result["tasks"], indent=1))


if __name__ == "__main__":
    main()
