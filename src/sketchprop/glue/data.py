"""GLUE tasks: loading (hub ``nyu-mll/glue`` or a local folder of the original TSV files),
tokenizing with dynamic padding, and the metrics as the paper reports them (x100).

A task is described by its config (``configs/task/*.yaml``, schema
:class:`sketchprop.glue.config.TaskConfig`); the quirks of each original TSV file are here, in
:data:`TSV_COLUMNS`. Both sources give the same columns: the task's ``text_columns`` and ``label``
(an int class index in hub order, or a float score for STS-B).
"""

from __future__ import annotations

import functools
import os
import random
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from .metric import glue_metrics

__all__ = [
    "GlueDataError",
    "IRREGULAR_ROWS",
    "TSV_COLUMNS",
    "compute_metrics",
    "glue_metrics",
    "hub_reachable",
    "load_glue",
    "read_tsv",
    "resolve_glue_dir",
    "shipped",
    "task_files",
    "tokenize",
    "use_hub_cache_only",
    "write_toy_glue",
]

HUB_DATASET = "nyu-mll/glue"
#: The original GLUE files of the small tasks, shipped with the repository (data/glue/SOURCES.md).
SHIPPED_GLUE_DIR = Path(__file__).resolve().parents[3] / "data" / "glue"

#: For each task: where the dataset's columns are in the original TSV files. A header name, or a
#: column index for CoLA, whose train/dev files have no header (source, label, mark, sentence).
TSV_COLUMNS: dict[str, dict[str, str | int]] = {
    "cola": {"sentence": 3, "label": 1},
    "sst2": {"sentence": "sentence", "label": "label"},
    "mrpc": {"sentence1": "#1 String", "sentence2": "#2 String", "label": "Quality"},
    "qqp": {"question1": "question1", "question2": "question2", "label": "is_duplicate"},
    "stsb": {"sentence1": "sentence1", "sentence2": "sentence2", "label": "score"},
    "mnli": {"premise": "sentence1", "hypothesis": "sentence2", "label": "gold_label"},
    "qnli": {"question": "question", "sentence": "sentence", "label": "label"},
    "rte": {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
    "wnli": {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
}


class GlueDataError(RuntimeError):
    """The task's data cannot be found or read; the message says how to fix it."""


def _how_to_fix(task) -> str:
    return (
        "Fix it either way: set data.glue_dir=/path/to/glue (or the environment variable GLUE_DIR) "
        f"to a folder in the classic GLUE layout with {task.dir}/train.tsv and "
        f"{task.dir}/{task.dev[0].file}; or run with network access so that the Hugging Face "
        f"dataset {HUB_DATASET} ({task.name}) can be downloaded (it is cached after that)."
    )


def resolve_glue_dir(glue_dir: str | os.PathLike | None) -> Path | None:
    """``data.glue_dir``, else the environment variable ``GLUE_DIR``, else None (the hub)."""
    value = glue_dir if glue_dir not in (None, "") else os.environ.get("GLUE_DIR") or None
    return None if value is None else Path(value).expanduser()


def task_files(task) -> list[str]:
    """The files a run of ``task`` reads from its folder: ``train.tsv`` and every dev file."""
    return ["train.tsv", *[d.file for d in task.dev]]


def shipped(task) -> bool:
    """Whether the task's files are among those shipped in :data:`SHIPPED_GLUE_DIR`."""
    return all((SHIPPED_GLUE_DIR / task.dir / f).is_file() for f in task_files(task))


def check_local(task, glue_dir: Path) -> None:
    """Raise :class:`GlueDataError` unless ``glue_dir`` holds the task's train and dev files."""
    if not glue_dir.is_dir():
        raise GlueDataError(f"GLUE folder {glue_dir} (data.glue_dir / GLUE_DIR) does not exist. "
                            + _how_to_fix(task))
    missing = [f"{task.dir}/{f}" for f in task_files(task)
               if not (glue_dir / task.dir / f).is_file()]
    if missing:
        raise GlueDataError(f"GLUE folder {glue_dir} lacks {', '.join(missing)} for task "
                            f"{task.name}. " + _how_to_fix(task))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``) accepts a TCP connection within ``timeout`` s.

    False at once when ``HF_HUB_OFFLINE`` is set. Checking first turns minutes of download retries
    into one clear error. The answer is remembered per endpoint for the life of the process, so
    the setup choice at launch and the run's own source check probe once between them.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    return _probe(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout)


@functools.cache
def _probe(endpoint: str, timeout: float) -> bool:
    url = urlparse(endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    ok = []

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    # A thread bounds name resolution too, which the socket timeout does not cover.
    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(ok)


def use_hub_cache_only() -> None:
    """Switch ``huggingface_hub``, ``datasets`` and ``transformers`` to their local caches."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    # Libraries read these variables at import; update any that are already imported.
    import sys

    for module, attr in (("huggingface_hub.constants", "HF_HUB_OFFLINE"),
                         ("datasets.config", "HF_HUB_OFFLINE"),
                         ("datasets.config", "HF_DATASETS_OFFLINE")):
        if module in sys.modules:
            setattr(sys.modules[module], attr, True)


def _label(raw: str, task, where: str):
    if task.regression:
        try:
            return float(raw)
        except ValueError:
            raise GlueDataError(f"{where}: score {raw!r} is not a number") from None
    if raw in task.labels:
        return list(task.labels).index(raw)
    if raw.isdigit() and int(raw) < len(task.labels):
        return int(raw)
    raise GlueDataError(f"{where}: label {raw!r} is neither one of {list(task.labels)} "
                        f"nor an index below {len(task.labels)}")


#: Tasks whose original files have known irregular rows, and the rule applied to them. The GLUE
#: reference processors skip QQP rows with missing fields; every other file is regular, so any
#: malformed row there is an error.
IRREGULAR_ROWS = {"qqp": "rows with fewer fields than the header are skipped, as the GLUE "
                         "reference processors do"}


def read_tsv(path: str | os.PathLike, task) -> dict[str, list]:
    """Read one original GLUE TSV file into columns ``task.text_columns + ['label']``.

    Lines are split on tabs only: quote characters are text (MRPC and others have unbalanced
    quotes, which a csv reader would join across lines). A UTF-8 byte-order mark is dropped (MRPC).
    A malformed row (another number of fields than the header, or than CoLA's four; an empty
    text; a label or score that does not parse) raises :class:`GlueDataError` with ``file:line``,
    except under a rule of :data:`IRREGULAR_ROWS`, which prints how many rows it skipped.
    Trailing empty lines are not rows.
    """
    path = Path(path)
    columns = TSV_COLUMNS[task.name]
    with open(path, encoding="utf-8-sig") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip("\r"):
        lines.pop()
    header = None
    if any(isinstance(c, str) for c in columns.values()):
        header = lines.pop(0).rstrip("\r").split("\t")
        missing = [c for c in columns.values() if c not in header]
        if missing:
            raise GlueDataError(f"{path}: header {header} lacks the columns {missing}")
    index = {key: (col if isinstance(col, int) else header.index(col))
             for key, col in columns.items()}
    width = 4 if header is None else len(header)  # CoLA: source, label, mark, sentence
    expected = ", ".join(header) if header else "source, label, mark, sentence"
    rule = IRREGULAR_ROWS.get(task.name)
    skipped = 0
    out: dict[str, list] = {key: [] for key in [*task.text_columns, "label"]}
    for number, line in enumerate(lines, start=2 if header else 1):
        where = f"{path}:{number}"
        fields = line.rstrip("\r").split("\t")
        if len(fields) != width:
            if rule and len(fields) < width:
                skipped += 1
                continue
            raise GlueDataError(f"{where}: {len(fields)} tab-separated fields, expected {width} "
                                f"({expected})")
        for key in task.text_columns:
            if not fields[index[key]].strip():
                raise GlueDataError(f"{where}: empty {key} (column {index[key] + 1})")
            out[key].append(fields[index[key]])
        out["label"].append(_label(fields[index["label"]], task, where))
    if skipped:
        print(f"{path}: skipped {skipped} malformed rows ({task.name}: {rule})", flush=True)
    if not out["label"]:
        raise GlueDataError(f"{path} has no data rows")
    return out


def load_glue(task, glue_dir: str | os.PathLike | None = None, max_train_samples: int | None = None,
              max_eval_samples: int | None = None):
    """The task's ``train`` split and its dev sets (keyed by ``dev[i].split``) as a DatasetDict.

    From ``glue_dir`` (see :func:`resolve_glue_dir`) when given, else from the hub. ``max_*``
    keep the first N examples, as HF ``run_glue.py`` does.
    """
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value, load_dataset

    root = resolve_glue_dir(glue_dir)
    if root is not None:
        check_local(task, root)
        label = Value("float32") if task.regression else ClassLabel(names=list(task.labels))
        features = Features({**{c: Value("string") for c in task.text_columns}, "label": label})
        files = {"train": "train.tsv", **{d.split: d.file for d in task.dev}}
        data = DatasetDict({split: Dataset.from_dict(read_tsv(root / task.dir / name, task),
                                                     features=features)
                            for split, name in files.items()})
    else:
        try:
            hub = load_dataset(HUB_DATASET, task.name)
        except Exception as err:
            raise GlueDataError(f"Could not load {HUB_DATASET} ({task.name}) from the Hugging Face "
                                f"hub or its cache ({type(err).__name__}: {err}). "
                                + _how_to_fix(task)) from None
        keep = [*task.text_columns, "label"]
        data = DatasetDict({split: hub[split].select_columns(keep)
                            for split in ["train", *[d.split for d in task.dev]]})
    for split, limit in [("train", max_train_samples),
                         *[(d.split, max_eval_samples) for d in task.dev]]:
        if limit is not None and limit < len(data[split]):
            data[split] = data[split].select(range(limit))
    return data


def tokenize(data, tokenizer, task, max_length: int):
    """Tokenize every split (truncated to ``max_length``, unpadded: the collator pads per batch)."""

    def encode(batch):
        texts = [batch[c] for c in task.text_columns]
        return tokenizer(*texts, truncation=True, max_length=max_length)

    return data.map(encode, batched=True, remove_columns=list(task.text_columns),
                    desc="tokenize")


def compute_metrics(task):
    """A ``compute_metrics`` function for the HF Trainer: :func:`glue_metrics` through the
    ``evaluate`` module :mod:`sketchprop.glue.hf_metric`, loaded once, by path (offline)."""
    import evaluate

    from .hf_metric import PATH

    metric = evaluate.load(PATH, task.name, keep_in_memory=True)

    def fn(eval_pred):
        predictions = eval_pred.predictions
        if isinstance(predictions, tuple):
            predictions = predictions[0]
        predictions = np.asarray(predictions)
        predictions = predictions.reshape(-1) if task.regression else predictions.argmax(-1)
        return metric.compute(predictions=predictions, references=eval_pred.label_ids)

    return fn


_TOY_WORDS = ("the a cat dog bird tree house river stone cloud sun moon red blue green old new "
              "big small runs sees eats finds likes near under over with").split()
_TOY_GOOD = ("good", "fine", "great")


def write_toy_glue(root: str | os.PathLike, n_train: int = 256, n_dev: int = 64,
                   seed: int = 0) -> Path:
    """Write a learnable toy CoLA and STS-B in the original GLUE layout (CoLA without a header,
    STS-B with its ten columns) under ``root``; for smoke runs. Returns ``root``.

    CoLA: label 1 iff the sentence contains one of a few marker words. STS-B: the score is five
    times the word overlap (Jaccard) of the two sentences.
    """
    rng = random.Random(seed)
    root = Path(root)

    def sentence():
        return rng.choices(_TOY_WORDS, k=rng.randint(4, 12))

    def cola_rows(n):
        for _ in range(n):
            words, label = sentence(), rng.random() < 0.5
            if label:
                words.insert(rng.randrange(len(words) + 1), rng.choice(_TOY_GOOD))
            mark = "" if label else "*"
            yield f"toy{rng.randint(0, 9)}\t{int(label)}\t{mark}\t{' '.join(words)}."

    def stsb_rows(n):
        yield ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
               "\tscore")
        for i in range(n):
            a = sentence()
            b = [w if rng.random() < rng.random() else rng.choice(_TOY_WORDS) for w in a]
            score = 5 * len(set(a) & set(b)) / len(set(a) | set(b))
            yield (f"{i}\tmain-captions\ttoy\t2012\t{i:04d}\tnone\tnone\t{' '.join(a)}."
                   f"\t{' '.join(b)}.\t{score:.3f}")

    for task, rows in (("CoLA", cola_rows), ("STS-B", stsb_rows)):
        (root / task).mkdir(parents=True, exist_ok=True)
        for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
            (root / task / name).write_text("\n".join(rows(n)) + "\n", encoding="utf-8")
    return root

