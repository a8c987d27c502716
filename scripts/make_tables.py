"""Rebuild the paper's tables and figures from the run files alone.

    python scripts/make_tables.py            # make tables

Reads every ``results/runs/<experiment>/<task>/<sketch>-rho<rho>-seed<seed>.json`` (and the memory
files of ``scripts/memory_table.py`` under ``results/memory/``) and writes

- ``results/tables/table2.md|csv``: score per task and method (mean and spread over seeds, the drop
  against the exact run), the paper's numbers beside ours where they exist;
- ``results/tables/table4.md|csv``: CoLA per sketch and rate: score, and speed from the controlled
  benchmark (``results/bench``), never from the training runs' wall times;
- ``results/tables/comparisons.md|csv``: the recommended configurations against named baselines
  (:data:`COMPARISONS`), paired by seed, with a t-interval and a verdict;
- ``results/tables/table3.md|csv``: saved-activation bytes and peak memory per task and batch, for
  the paper's layout, ours, and activation checkpointing (alone and with ours), with the step time
  against exact from the controlled benchmark;
- ``results/tables/tuning.md``: the learning-rate choice of the CPU recipe;
- ``results/figures/figure3_memory.png``, ``figure5_loss.png``, ``figure6_throughput.png``.

Speed comes only from ``scripts/bench_*.py`` (``results/bench/*.json``): each configuration timed
in one process, interleaved with the exact baseline, every sample divided by the baseline samples
around it. The training runs' own times were taken on cores shared with other jobs and are not
shown as speed anywhere.

Methods are compared by seed: seed s gives every method the same classifier initialisation and the
same data order, so Table 2, Table 4 and the comparisons show the mean paired difference (with its
standard error and the number of pairs) beside the unpaired mean ± sd.

Nothing else goes in: no number is typed here except the paper's own, which are labelled as such.
The same JSON files give the same output files (sorted input, no timestamps in the images).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from omegaconf import OmegaConf
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]

# The paper's metric per task (results carry all of a task's metrics; this one is reported).
METRIC = {"cola": "matthews", "stsb": "pearson", "mrpc": "accuracy", "qqp": "accuracy",
          "sst2": "accuracy", "mnli": "accuracy", "qnli": "accuracy", "rte": "accuracy",
          "wnli": "accuracy"}
TASK_ORDER = ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"]
SKETCH_ORDER = ["exact", "gaussian", "rademacher", "dct", "dft", "blocksrht", "rowsample",
                "importance"]
# Table 2's methods: the paper's Gaussian, the recommended sketch and importance sampling (the
# others are Table 4's).
TABLE2_SKETCHES = ("exact", "gaussian", "blocksrht", "importance")
MODEL_NAMES = {"minilm": "all-MiniLM-L6-v2 (pretrained)", "roberta-base": "roberta-base",
               "tiny-roberta": "tiny random RoBERTa"}
TASK_NAMES = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "rte": "RTE",
              "wnli": "WNLI", "qnli": "QNLI", "qqp": "QQP", "mnli": "MNLI"}
# The layer the Table 4 speed column quotes from scripts/bench_layer.py (roberta-base's FFN input).
BENCH_LAYER = ("768x3072", 4096)
RATES = (0.5, 0.2, 0.1)


def key_of(sketch: str, layout: str = "-", rho: float = 1.0) -> tuple:
    """A method's key as :func:`method_key` gives it, by name: ``key_of("blocksrht", "ours", 0.1)``
    (layouts as :func:`scheme` names them)."""
    return (SKETCH_ORDER.index(sketch), sketch, layout, -float(rho))


def _compact_set() -> dict:
    """The settings ``activations=compact`` gives (configs/activations/compact.yaml, read as the
    pipeline composes it); a run with other compact settings is labelled with the ones that
    differ."""
    conf = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "activations" / "compact.yaml"))
    conf.pop("defaults", None)
    return conf


COMPACT = _compact_set()

EXACT = key_of("exact")
REC = key_of("blocksrht", "ours", 0.1)  # the recommended sketch at the recommended rate
IMPORTANCE = key_of("importance", "ours", 0.1)
IMPORTANCE_ALLOC = key_of("importance", "ours+alloc", 0.1)
# The recommended configurations against named baselines, (task, method, baseline), paired by seed
# in results/tables/comparisons.md. A comparison whose runs are not there yet is listed as such.
COMPARISONS = [
    ("cola", REC, EXACT),
    ("cola", key_of("blocksrht", "ours", 0.2), EXACT),
    ("cola", IMPORTANCE_ALLOC, EXACT),
    ("cola", IMPORTANCE_ALLOC, REC),
    ("cola", key_of("blocksrht", "ours+ckpt", 0.1), REC),
    # Compact activations: their own cost at 0.1 and 0.2, and 0.2 with them (fewer bytes than 0.1
    # alone) against exact.
    ("cola", key_of("blocksrht", "ours+compact", 0.1), REC),
    ("cola", key_of("blocksrht", "ours+compact", 0.2), key_of("blocksrht", "ours", 0.2)),
    ("cola", key_of("blocksrht", "ours+compact", 0.2), EXACT),
    # Compact activations on the exact linear layers, which keep fewer bytes than the sketch alone
    # at 0.1: against exact, and against the sketch at 0.1.
    ("cola", key_of("exact", "compact"), EXACT),
    ("cola", key_of("exact", "compact"), REC),
    # The authors' deterministic 3-bit GELU code in place of the 2-bit stochastic one.
    ("cola", key_of("blocksrht", "ours+compact(gelu_bits=3,gelu_code=optimal)", 0.1), REC),
    ("cola", key_of("blocksrht", "ours+compact(gelu_bits=3,gelu_code=optimal)", 0.1),
     key_of("blocksrht", "ours+compact", 0.1)),
    *[(task, method, baseline) for task in ("mrpc", "stsb", "sst2")
      for method, baseline in ((IMPORTANCE, REC), (IMPORTANCE, EXACT), (REC, EXACT))],
    *[(task, key_of("blocksrht", "ours+compact", 0.2), EXACT) for task in ("mrpc", "stsb")],
    *[(task, key_of("exact", "compact"), EXACT) for task in ("mrpc", "stsb", "sst2")],
    # b-bit stored rows on the exact linear layers (method=exact method.bits=b): each against
    # exact; 2 bits (fewer bytes than the sketch at 0.1) against the sketch at 0.1; 4 bits with
    # compact activations against exact and against compact activations alone.
    *[("cola", key_of("exact", f"int{b}"), EXACT) for b in (8, 4, 2)],
    ("cola", key_of("exact", "int2"), REC),
    ("cola", key_of("exact", "int4"), REC),
    *[(task, key_of("exact", layout), EXACT) for task in ("cola", "sst2", "stsb")
      for layout in ("int4+compact",)],
    ("cola", key_of("exact", "int4+compact"), key_of("exact", "compact")),
    *[(task, key_of("exact", "int4"), EXACT) for task in ("sst2", "stsb")],
]
# LoRA (experiment=lora_cpu, its own learning rate): the sketch on the adapters against LoRA alone.
LORA = key_of("exact", "lora")
LORA_COMPARISONS = [("cola", key_of("blocksrht", "lora+ours", 0.1), LORA)]

# The paper's Table 4 (Bershatsky et al. 2022), as the authors' saved notebook output gives it:
# CoLA, roberta-base, Matthews corr. x100 at the best of 10 epochs, and the 10-epoch training time
# on one GPU.
PAPER_TABLE4 = {
    ("exact", 1.0): (60.90, "08:44"),
    ("gaussian", 0.5): (58.60, "10:36"), ("gaussian", 0.2): (57.79, "10:02"),
    ("gaussian", 0.1): (56.52, "10:03"),
    ("rademacher", 0.5): (62.38, "15:27"), ("rademacher", 0.2): (59.11, "15:38"),
    ("rademacher", 0.1): (55.50, "15:43"),
    ("dct", 0.5): (59.17, "16:26"), ("dct", 0.2): (58.81, "16:37"), ("dct", 0.1): (53.38, "17:24"),
    ("dft", 0.5): (59.05, "12:20"), ("dft", 0.2): (60.60, "11:42"), ("dft", 0.1): (47.62, "12:25"),
}
# The paper's Table 3 (Bershatsky et al. 2022): peak GPU memory in GiB over one epoch, roberta-base,
# Gaussian sketch; MRPC's exact value from the authors' README, values marked "~" read off their
# saved figure (about +-0.1 GiB).
PAPER_TABLE3 = {
    ("mrpc", 128): ("11.30", "~10.64", "9.20", "~8.72"),
    ("sst2", 256): ("~13.36", "~12.56", "~10.56", "~9.92"),
    ("qnli", 16): ("~11.68", "~11.12", "~10.44", "~10.00"),
    ("cola", 256): ("~9.68", "~8.96", "~7.72", "~7.28"),
}


# ---------------------------------------------------------------------------------------------
# Loading


def load_runs(runs_dir: Path) -> list[dict]:
    """Every run JSON under ``runs_dir``, each with ``_experiment`` (its first folder below
    runs/) and ``_folder`` (every folder below runs/ but the task's)."""
    runs = []
    for path in sorted(runs_dir.rglob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "metrics" not in data:
            continue
        parts = path.relative_to(runs_dir).parts
        data["_experiment"] = parts[0]
        data["_folder"] = "/".join(parts[:-2])
        data["_path"] = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        runs.append(data)
    return runs


class MixedRecipes(SystemExit):
    """Two recipes in one table cell."""


def check_one_recipe_per_cell(runs: list[dict]) -> None:
    """Refuse to build tables when a cell (result folder, task, method row) holds runs of more
    than one recipe (identity less the seed): their mean would mix two experiments. Says which
    files and which settings differ. Runs without an identity are refused too (migrate them with
    scripts/migrate_runs.py)."""
    missing = [r["_path"] for r in runs if "identity" not in r]
    if missing:
        raise MixedRecipes("run files without an identity (scripts/migrate_runs.py adds it): "
                           + ", ".join(missing))
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        cells[(r["_folder"], r["task"], method_key(r))].append(r)
    problems = []
    for (folder, task, key), rs in sorted(cells.items(), key=lambda c: str(c[0])):
        recipes = {r["recipe"]: r for r in rs}
        if len(recipes) < 2:
            continue
        first, *others = recipes.values()
        diffs = sorted({d for o in others for d in _differences(first["identity"], o["identity"])
                        if d != "seed"})
        problems.append(f"{folder}/{task} {method_label(key)}: {len(recipes)} recipes "
                        f"(differing in {', '.join(diffs)}): "
                        + ", ".join(r["_path"] for r in rs))
    if problems:
        raise MixedRecipes("one table cell would mix runs of different recipes; move one recipe "
                           "to its own experiment_name, or remove the files that should not be "
                           "there:\n  " + "\n  ".join(problems))


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def scheme(run: dict) -> str:
    """``paper`` (per-layer sketches, padding included) or ``ours``, from the run's config;
    ``+alloc`` when rows were allocated by variance, ``+ckpt`` when the run used activation
    checkpointing, ``+compact`` with compact activations (``activations=compact``; other
    settings than :data:`COMPACT` are named: ``+compact(gelu_bits=3,gelu_code=optimal)``),
    ``+int4`` for rows stored as 4-bit codes (``method.bits=4``), and ``lora+`` in front for a
    LoRA adapter. The exact model's layout is ``-`` alone, else these
    parts joined: ``lora+ckpt``."""
    ident = run.get("identity", {})
    parts = ["lora"] if ident.get("adapter", {}).get("name", "none") != "none" else []
    if run["sketch"] != "exact":
        method = run.get("config", {}).get("method", {})
        parts.append("ours" if method.get("share_inputs") and method.get("skip_padding")
                     else "paper")
        if method.get("allocate", "uniform") == "variance":
            parts.append("alloc")
    bits = ident.get("method", {}).get("bits")
    if bits is not None:  # stored rows as b-bit codes (method.bits)
        parts.append(f"int{bits}")
    if ident.get("train", {}).get("gradient_checkpointing", False):
        parts.append("ckpt")
    # runs.identity leaves the activations out at their neutral (stored) value.
    if "activations" in ident:
        other = [f"{k}={v}" for k, v in ident["activations"].items() if COMPACT.get(k) != v]
        parts.append(f"compact({','.join(other)})" if other else "compact")
    return "+".join(parts) or "-"


def score(run: dict, best: bool = True) -> float | None:
    """The paper's metric of the run: at the best epoch (as the authors report) or the last."""
    metrics = run["best_metrics"] if best else run["metrics"]
    return metrics.get(METRIC.get(run["task"], "accuracy"))


def method_key(run: dict) -> tuple:
    return (SKETCH_ORDER.index(run["sketch"]) if run["sketch"] in SKETCH_ORDER else 99,
            run["sketch"], scheme(run), -float(run["rho"]))


def method_label(key: tuple) -> str:
    _, sketch, sch, neg_rho = key
    if sketch == "exact":
        return "exact" if sch == "-" else f"exact ({sch})"
    return f"{sketch} ({sch}) rho={-neg_rho:g}"


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt_score(values: list[float]) -> str:
    mean, sd = mean_sd(values)
    if math.isnan(mean):
        return "-"
    return f"{mean:.2f}" if sd is None else f"{mean:.2f} ± {sd:.2f} (n={len(values)})"


# ---------------------------------------------------------------------------------------------
# Paired differences

#: What a paired comparison lets differ; everything else in two runs' identities (task, model,
#: training recipe, data) must match. The method is what is compared, the seed is what pairs, and
#: activation checkpointing and compact activations change what is kept for backward, not the
#: model, data or recipe.
NOT_PAIRING = ("method", "seed", "train.gradient_checkpointing", "activations")


def pairing_recipe(run: dict) -> dict:
    """The run's identity less :data:`NOT_PAIRING`."""
    ident = json.loads(json.dumps(run["identity"]))
    for dotted in NOT_PAIRING:
        *parents, key = dotted.split(".")
        node = ident
        for part in parents:
            node = node.get(part, {})
        node.pop(key, None)
    return ident


class Paired(NamedTuple):
    """Score differences method - baseline of the seeds both have, in seed order."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.diffs) if self.diffs else math.nan

    @property
    def se(self) -> float | None:
        """Standard error of the mean difference: sample sd of the differences / sqrt(n)."""
        return statistics.stdev(self.diffs) / math.sqrt(self.n) if self.n > 1 else None

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        """Student-t interval of the mean difference, n - 1 degrees of freedom (n >= 2)."""
        half = stats.t.ppf(0.5 + level / 2, self.n - 1) * self.se
        return self.mean - half, self.mean + half


def paired(runs: list[dict], baseline: list[dict]) -> Paired:
    """The differences ``score(run) - score(baseline run)`` seed by seed.

    Seed s gives every method the same classifier initialisation and data order, so a difference
    within a seed is free of that part of the seed-to-seed spread. Only seeds both sides have pair;
    a seed whose score is missing on either side (an undefined correlation) does not. Raises
    :class:`MixedRecipes` naming the setting and the files when two of the runs differ in anything
    but :data:`NOT_PAIRING`, or when one side has a seed twice.
    """
    everyone = [(r, pairing_recipe(r)) for r in [*baseline, *runs]]
    if not everyone:
        return Paired((), ())
    (first, recipe), *others = everyone
    problems = [f"{r['_path']} differs from {first['_path']} in "
                + ", ".join(_differences(recipe, other)) for r, other in others if other != recipe]
    if problems:
        raise MixedRecipes("paired runs must share task, model, training recipe and data (all of "
                           f"the identity but {', '.join(NOT_PAIRING)}):\n  "
                           + "\n  ".join(problems))

    def by_seed(side: list[dict]) -> dict[int, float | None]:
        found: dict[int, dict] = {}
        for r in side:
            if r["seed"] in found:
                raise MixedRecipes(f"two runs of seed {r['seed']} to pair: "
                                   f"{found[r['seed']]['_path']} and {r['_path']}")
            found[r["seed"]] = r
        return {seed: score(r) for seed, r in found.items()}

    ours, base = by_seed(runs), by_seed(baseline)
    seeds = sorted(s for s in ours.keys() & base.keys()
                   if ours[s] is not None and base[s] is not None)
    return Paired(tuple(seeds), tuple(ours[s] - base[s] for s in seeds))


def fmt_paired(p: Paired) -> str:
    """``-7.19 ± 0.49 (n=3)`` (mean difference ± standard error), or why there is none."""
    if p.n < 2:
        return "one seed" if p.n == 1 else "no seed in common"
    return f"{p.mean:+.2f} ± {p.se:.2f} (n={p.n})"


def verdict(p: Paired) -> str:
    """``higher`` or ``lower`` when the 95% interval excludes 0, else ``no difference measured``
    (not a finding of equality: with few seeds the interval is wide)."""
    if p.n < 2:
        return "n<2: no claim"
    low, high = p.interval()
    if low <= 0 <= high:
        return "no difference measured"
    return "higher" if low > 0 else "lower"


PAIRED_TEXT = (
    "'paired to exact': the mean over seeds of this method's score minus the exact run's of the "
    "same seed (seed s gives every method the same classifier initialisation and data order), ± "
    "its standard error (sd of the differences / sqrt(n)), n = seeds both have; 'one seed' where "
    "only one pairs, which measures no spread.")


def mmss(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{int(round(seconds % 60)):02d}"


def write_table(stem: Path, header: list[str], rows: list[list], preamble: str) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    lines = [preamble.rstrip(), "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def describe(runs: list[dict]) -> str:
    """Where and how the runs were made: models, hardware, commits, epochs, training subset.
    A setting that differs between the runs lists every value, e.g. ``3.0/10.0 epochs``."""
    hardware = sorted({r.get("hardware") or r.get("device", "?") for r in runs})
    models = sorted({r["model"] for r in runs})
    commits = sorted({(r.get("git_commit") or "?")[:8] for r in runs})

    def values(group: str, key: str, unset: str = "None") -> str:
        found = {r.get("config", {}).get(group, {}).get(key) for r in runs}
        return "/".join(unset if v is None else str(v)
                        for v in sorted(found, key=lambda v: (v is None, v or 0)))

    models = [f"{m} = {MODEL_NAMES[m]}" if m in MODEL_NAMES else m for m in models]
    return (f"Model: {', '.join(models)}. Hardware: {'; '.join(hardware)}. Commits: "
            f"{', '.join(commits)}. Recipe: {values('train', 'epochs')} epochs, batch "
            f"{values('train', 'batch_size')}, lr {values('train', 'learning_rate')}, max length "
            f"{values('train', 'max_length')}, first {values('data', 'max_train_samples', 'all')} "
            "training examples per task, full dev sets.")


# ---------------------------------------------------------------------------------------------
# The controlled benchmark (scripts/bench_model.py, scripts/bench_layer.py: results/bench/*.json)


def _ratio_stats(ratios: list[float]) -> dict:
    q = (statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) >= 2
         else [ratios[0]] * 3)
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2], "n": len(ratios)}


def bench_step_ratios(bench_dir: Path, model: str) -> dict[str, dict]:
    """Training-step time / exact per method for ``model``, pooled over the committed runs of
    scripts/bench_model.py (``model_*.json``, not ``--quick``) that timed it in the same setting
    (batch, device, torch threads; the setting with the most runs wins): ``{method: {ratio, q1,
    q3, n}}`` (median and quartiles of the bracketed per-sample ratios) and ``"_info"``."""
    by_setting: dict[tuple, dict] = {}
    for path in sorted(bench_dir.glob("model_*.json")) if bench_dir.exists() else []:
        if "_quick" in path.stem:
            continue
        data = json.loads(path.read_text())
        args, env = data.get("args", {}), data.get("environment", {})
        setting = (args.get("batch"), args.get("seq"), args.get("task"),
                   env.get("torch_threads"), env.get("device"))
        for res in data.get("results", []):
            timed = {n: m["time"]["ratios"] for n, m in res.get("methods", {}).items()
                     if m.get("time")}
            if res.get("model") != model or not timed:
                continue
            entry = by_setting.setdefault(setting, {
                "pooled": defaultdict(list),
                "info": {"batch": f"{setting[0]}x{setting[1]}", "threads": setting[3],
                         "source": res.get("batch", {}).get("source", "?"),
                         "device": env.get("cpu") or setting[4], "runs": []}})
            entry["info"]["runs"].append(path.stem)
            for name, ratios in timed.items():
                entry["pooled"][name] += ratios
    if not by_setting:
        return {}
    best = max(by_setting.values(), key=lambda e: (len(e["info"]["runs"]),
                                                   sum(map(len, e["pooled"].values()))))
    out = {name: _ratio_stats(r) for name, r in best["pooled"].items() if r}
    out["_info"] = best["info"]
    return out


def bench_layer_ratios(bench_dir: Path, shape: tuple[str, int] = BENCH_LAYER,
                       threads: int = 1) -> dict[str, dict]:
    """Forward+backward time / nn.Linear of one layer per ``sketch@rho`` from scripts/bench_layer.py
    runs at ``threads`` torch threads, pooled over runs: ``{name: {ratio, q1, q3, n}}``."""
    pooled: dict[str, list[float]] = defaultdict(list)
    runs = []
    for path in sorted(bench_dir.glob("layer_*.json")) if bench_dir.exists() else []:
        if "_quick" in path.stem:
            continue
        data = json.loads(path.read_text())
        if data.get("environment", {}).get("torch_threads") != threads:
            continue
        for g in data.get("groups", []):
            if (g["shape"], g["rows"]) == shape:
                runs.append(path.stem)
                for name, c in g["configs"].items():
                    pooled[name] += c["ratios"]
    out = {name: _ratio_stats(r) for name, r in pooled.items() if r}
    if runs:
        out["_info"] = {"runs": sorted(set(runs)), "threads": threads}
    return out


def fmt_ratio(st: dict | None) -> str:
    if not st:
        return "-"
    if st["n"] < 2 or st["ratio"] == st["q1"] == st["q3"]:
        return f"{st['ratio']:.2f}"
    return f"{st['ratio']:.2f} ({st['q1']:.2f}-{st['q3']:.2f})"


# ---------------------------------------------------------------------------------------------
# Tables


def table2(runs: list[dict], experiment: str, stem: Path, majority: dict | None = None) -> None:
    # The paper's Gaussian and the recommended sketch, without checkpointing (that is Table 4's).
    runs = [r for r in runs if r["_experiment"] == experiment and r["sketch"] in TABLE2_SKETCHES
            and "ckpt" not in scheme(r).split("+")]
    if not runs:
        return
    tasks = [t for t in TASK_ORDER if any(r["task"] == t for r in runs)]
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        cells[method_key(r)][r["task"]].append(r)
    exact_runs = cells.get(EXACT, {})
    exact = {t: mean_sd([score(r) for r in rs])[0] for t, rs in exact_runs.items()}
    header = (["method"] + [c for t in tasks for c in (f"{t} ({METRIC[t]})", f"{t} paired to exact")]
              + ["mean drop"])
    if "cola" in tasks:
        header.append("paper CoLA (roberta-base)")
    rows = []
    for key in sorted(cells):
        row, drops = [method_label(key)], []
        for t in tasks:
            rs = cells[key].get(t, [])
            values = [score(r) for r in rs]
            text, pair = fmt_score(values), "-"
            if rs and key != EXACT and t in exact:
                drop = mean_sd(values)[0] - exact[t]
                drops.append(drop)
                text += f" [{drop:+.2f}]"
                pair = fmt_paired(paired(rs, exact_runs[t]))
            row += [text, pair]
        row.append(f"{statistics.fmean(drops):+.2f}" if drops else "-")
        if "cola" in tasks:
            paper = (PAPER_TABLE4.get((key[1], -key[3]))
                     if key[1] in ("exact", "gaussian") and key[2] in ("-", "paper") else None)
            row.append(f"{paper[0]:.2f}" if paper else "-")
        rows.append(row)
    if majority:
        row = ["majority class"]
        for t in tasks:
            value = majority["tasks"].get(t, {}).get("validation", {}).get(METRIC[t])
            row += ["-" if value is None else f"{value:.2f}", ""]
        rows.insert(1, row + [""] * (len(header) - len(row)))
    write_table(stem, header, rows, (
        f"# Table 2 analogue ({experiment})\n\n"
        "Dev score x100 at the best epoch (as the paper reports), mean ± sample sd over seeds where "
        "there are several; [difference to the exact run's mean]. " + PAIRED_TEXT
        + " 'paper' = the authors' layout (a sketch per layer, padding rows sketched, head "
        "patched); 'ours' = shared Q/K/V sketch, padding rows skipped, head exact. The paper's "
        "Table 2 numbers other than CoLA were not retrievable; its CoLA column equals its Table 4 "
        "Gaussian rows."
        + (" 'majority class': always the most frequent training label (STS-B: the mean score, "
           "whose correlation is undefined), from " + majority["command"] if majority else "")
        + "\n\n" + describe(runs)))


def table4(runs: list[dict], experiment: str, stem: Path, bench_dir: Path | None = None) -> None:
    runs = [r for r in runs if r["_experiment"] == experiment and r["task"] == "cola"]
    if not runs:
        return
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[method_key(r)].append(r)
    base = groups.get(EXACT, [])
    base_score = mean_sd([score(r) for r in base])[0] if base else None
    model = runs[0]["model"]
    step = bench_step_ratios(bench_dir, model) if bench_dir else {}
    layer = bench_layer_ratios(bench_dir) if bench_dir else {}
    header = ["sketch", "layout", "rho", "CoLA (matthews)", "vs exact", "paired to exact",
              f"{model} step time / exact (bench)",
              f"{BENCH_LAYER[0]} layer time / nn.Linear (bench)", "paper score", "paper time (GPU)"]
    rows = []
    for key in sorted(groups):
        rs = groups[key]
        s = mean_sd([score(r) for r in rs])[0]
        sketch, layout, rho = key[1], key[2], -key[3]
        # The paper's numbers belong to its own layouts only: exact alone, the sketch in its layout.
        paper = PAPER_TABLE4.get((sketch, rho)) if layout in ("-", "paper") else None
        if key == EXACT:
            step_name, layer_name = "exact", "nn.Linear"
        elif sketch == "exact":  # the exact layers with checkpointing or compact activations
            step_name, layer_name = {"compact": "compact", "ckpt": "ckpt"}.get(layout), None
        else:
            # The benchmark times MiniLM steps without checkpointing, and one layer alone: no
            # ratio of either stands for a checkpointed row, nor the layer for a compact one.
            step_name = {"paper": f"paper@{rho:g}" if sketch == "gaussian" else None,
                         "ours": f"ours-{sketch}@{rho:g}",
                         "ours+alloc": f"ours-{sketch}+alloc@{rho:g}",
                         "ours+compact": f"ours-{sketch}+compact@{rho:g}"}.get(layout)
            layer_name = (f"{sketch}@{rho:g}" if layout in ("paper", "ours", "ours+alloc")
                          else None)
        rows.append([
            sketch, layout, f"{rho:g}" if sketch != "exact" else "-",
            fmt_score([score(r) for r in rs]),
            f"{s - base_score:+.2f}" if base_score is not None and key != EXACT else "-",
            fmt_paired(paired(rs, base)) if base and key != EXACT else "-",
            fmt_ratio(step.get(step_name)), fmt_ratio(layer.get(layer_name)),
            f"{paper[0]:.2f}" if paper else "-", paper[1] if paper else "-",
        ])
    info = step.get("_info", {})
    linfo = layer.get("_info", {})
    write_table(stem, header, rows, (
        f"# Table 4 analogue ({experiment}, CoLA)\n\n"
        "Matthews corr. x100 at the best epoch, mean ± sample sd over seeds where there are "
        "several; 'vs exact': difference to the exact run's mean. " + PAIRED_TEXT
        + " The paper's columns are roberta-base, 10 epochs, "
        "one GPU (its Table 4, as the authors' saved notebook output gives it; its time is the "
        "whole 10-epoch training). No training time of these runs is shown: they shared two CPU "
        "cores with other jobs, and their wall times vary by tens of percent between runs. Speed "
        "comes from the controlled CPU benchmark instead, each configuration timed in one process "
        "interleaved with the exact baseline (median of the bracketed ratios, interquartile "
        "range in brackets; below 1 is faster): "
        + (f"'step' is one training step of {model} at {info.get('batch', '?')} "
           f"({info.get('source', '?')}), {info.get('threads', '?')} torch thread(s), "
           f"{info.get('device', '?')} ({', '.join(info.get('runs', []))}; the benchmark times the "
           "Gaussian only in the paper's layout and blocksrht only in ours); "
           if info else "'step': no benchmark file; ")
        + (f"'layer' is one {BENCH_LAYER[0]} linear layer, {BENCH_LAYER[1]} rows, forward and "
           f"backward against nn.Linear, {linfo.get('threads', '?')} torch thread(s) "
           f"({', '.join(linfo.get('runs', []))})."
           if linfo else "'layer': no benchmark file.")
        + "\n\n" + describe(runs)))


def comparisons(runs: list[dict], experiment: str, stem: Path,
                wanted: list[tuple] = COMPARISONS,
                title: str = "Paired comparisons of the recommended configurations") -> None:
    """Each of ``wanted`` (task, method, baseline) paired by seed: both scores, the differences,
    their mean and standard error, the 95% t-interval and a verdict (:func:`verdict`)."""
    runs = [r for r in runs if r["_experiment"] == experiment]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["task"], method_key(r))].append(r)
    header = ["task", "method", "baseline", "method score", "baseline score", "n pairs", "seeds",
              "difference per seed", "mean difference", "SE", "95% interval", "verdict"]
    rows, used, absent = [], [], []
    for task, method, baseline in wanted:
        ours, base = groups.get((task, method), []), groups.get((task, baseline), [])
        name = f"{TASK_NAMES.get(task, task)} {method_label(method)} vs {method_label(baseline)}"
        if not ours or not base:
            absent.append(name)
            continue
        used += ours + base
        p = paired(ours, base)
        interval = "-"
        if p.n > 1:
            low, high = p.interval()
            interval = f"[{low:+.2f}, {high:+.2f}]"
        rows.append([
            TASK_NAMES.get(task, task), method_label(method), method_label(baseline),
            fmt_score([score(r) for r in ours]), fmt_score([score(r) for r in base]), p.n,
            ", ".join(map(str, p.seeds)) or "-", " / ".join(f"{d:+.2f}" for d in p.diffs) or "-",
            f"{p.mean:+.2f}" if p.n > 1 else "-", f"{p.se:.2f}" if p.n > 1 else "-", interval,
            verdict(p)])
    if not rows:
        return
    unique = list({r["_path"]: r for r in used}.values())
    write_table(stem, header, rows, (
        f"# {title} ({experiment})\n\n"
        "Dev score x100 at the best epoch (the tables' score); 'method score' and 'baseline "
        "score' are each side's mean ± sample sd over all its seeds, paired or not. Runs are "
        "paired by seed: seed s gives a method and its baseline the same classifier "
        "initialisation and the same data order, so the difference of their two runs is free of"
        " that part of the seed-to-seed spread; only seeds both have pair. Paired runs share "
        "task, model, training recipe and data (activation checkpointing and compact "
        "activations may differ: they change what is kept for backward, not the model, data or "
        "recipe). 'mean difference' is method minus baseline, 'SE' the sample sd of the "
        "differences / sqrt(n), the interval the mean ± t(0.975, n-1) SE (Student t with n-1 "
        "degrees of freedom, which takes the differences as roughly normal). Verdict: 'higher' "
        "or 'lower' when the interval excludes 0; 'no difference measured' when it includes 0, "
        "which is not a finding of equality (a few seeds give a wide interval); 'n<2: no claim'"
        " with fewer than two pairs."
        + (" Declared in scripts/make_tables.py but without runs here: " + "; ".join(absent) + "."
           if absent else "")
        + "\n\n" + describe(unique)))


def _recipe(r: dict) -> tuple[float, int, float]:
    """The (learning rate, batch size, epochs) a tuning run varied."""
    train = r["config"]["train"]
    return train["learning_rate"], train["batch_size"], train["epochs"]


def tuning(runs: list[dict], out: Path, pool: str = "minilm_cpu") -> None:
    """The learning-rate (and batch-size) runs of experiment=tune_cpu per task, beside the exact
    seed-1 run of the table pool (the recipe's own setting) for every task that was tuned."""
    tuned = [r for r in runs if r["_experiment"] == "tune_cpu"]
    if not tuned:
        return
    tasks = [t for t in TASK_ORDER if any(r["task"] == t for r in tuned)]
    tried = {(r["task"], *_recipe(r)) for r in tuned}
    table = [r for r in runs if r["_experiment"] == pool and r["sketch"] == "exact"
             and r["seed"] == 1 and r["task"] in tasks and (r["task"], *_recipe(r)) not in tried]
    rows, best = [], {}
    # Each model variant (full fine-tuning, LoRA) is tuned on its own.
    for t, variant in sorted({(r["task"], scheme(r)) for r in tuned},
                             key=lambda tv: (TASK_ORDER.index(tv[0]), tv[1])):
        these = sorted([r for r in tuned + table if r["task"] == t and scheme(r) == variant],
                       key=lambda r: _recipe(r)[::-1])
        lr, bs, ep = _recipe(max(these, key=lambda r: score(r) or -math.inf))
        name = "exact" if variant == "-" else f"exact ({variant})"
        best[t, variant] = (t if variant == "-" else f"{t} {name}") + (
            f" lr {lr:g} batch {bs} {ep:g} epochs")
        for r in these:
            per_epoch = ", ".join(f"{h.get(METRIC[t], math.nan):.2f}" for h in r["history"])
            lr, bs, ep = _recipe(r)
            rows.append([t, name, f"{lr:g}", str(bs), f"{ep:g}", f"{score(r):.2f}", per_epoch,
                         r["_experiment"]])
    write_table(out / "tuning", ["task", "method", "learning rate", "batch", "epochs", "best-epoch score",
                                 "score per epoch", "runs"], rows, (
        "# Tuning of the CPU recipe (experiment=tune_cpu, tune_cpu_lora)\n\n"
        "The exact MiniLM on dev at a few learning rates, batch sizes and epoch counts, with the CPU "
        "recipe otherwise (configs/train/cpu.yaml, configs/setup/cpu.yaml; rows from runs/" + pool
        + " are table2_cpu's own exact run). Highest dev score per task at: "
        + ", ".join(best.values()) + ". The rate in configs/train/cpu.yaml "
        "(chosen on CoLA) is fixed for every task, sketch and rate; results/README.md says why "
        "other tasks' checks did not change it. LoRA (adapter=lora) trains far fewer weights and "
        "was tuned on its own, once, on CoLA; its rate is fixed in "
        "configs/adapter/lora.yaml (adapter=lora brings it).\n\n" + describe(tuned)))


def load_memory(memory_dir: Path) -> list[dict]:
    """Every point file of scripts/memory_table.py, in file-name order."""
    files = sorted(memory_dir.glob("*.json")) if memory_dir.exists() else []
    return [json.loads(f.read_text()) for f in files]


def _peak(rec: dict) -> int | None:
    return (rec.get("peak_memory") or {}).get("peak_bytes")


def _families(p: dict) -> list[tuple[str, str, dict, dict[str, dict], str | None, str | None]]:
    """A point's method families: (label, key, record without a sketch, records by rate, bench name
    without a sketch, bench name prefix at a rate). Each family beyond the paper's layout and ours
    only where the point has it; a family whose sketch-free variant was not measured has an empty
    record there, and LoRA has no bench names (not timed)."""
    sketch = next((rec.get("patch", {}).get("sketch") for rec in p.get("ours", {}).values()),
                  "blocksrht")
    fams = [("paper layout (Gaussian)", "paper", p["exact"], p["paper"], "exact", "paper"),
            (f"ours ({sketch})", "ours", p["exact"], p["ours"], "exact", f"ours-{sketch}")]
    optional = [
        (f"checkpointing + ours ({sketch})", "ckpt+ours", p.get("ckpt"), "ckpt",
         f"ckpt+ours-{sketch}"),
        (f"ours ({sketch}) + compact activations", "ours+compact", p.get("compact") or {},
         "compact", f"ours-{sketch}+compact"),
        (f"checkpointing + ours ({sketch}) + compact activations", "ckpt+ours+compact", {}, None,
         f"ckpt+ours-{sketch}+compact"),
        (f"LoRA + ours ({sketch})", "lora+ours", p.get("lora"), None, None),
        (f"LoRA + ours ({sketch}) + compact activations", "lora+ours+compact", {}, None, None),
    ]
    for label, key, base, base_name, prefix in optional:
        if p.get(key) and base is not None:
            fams.append((label, key, base, p[key], base_name, prefix))
    if p.get("lora+ckpt"):
        fams.append(("LoRA + checkpointing", "lora+ckpt", p["lora+ckpt"], {}, None, None))
    # b-bit stored rows (the exact sketch, bits=b on every linear layer but the head): one record
    # each, in the 'none' column; the step benchmark times int<b> and int<b>+compact by these names.
    for extra, before, after in (("", "", ""), ("+compact", "", " + compact activations"),
                                 ("+ckpt", "checkpointing + ", "")):
        for b in (8, 4, 2):
            key = f"int{b}{extra}"
            if p.get(key):
                fams.append((f"{before}exact, {b}-bit rows{after}", key, p[key], {},
                             None if extra == "+ckpt" else key, None))
    return fams


def table3(memory_dir: Path, out: Path, bench_dir: Path | None = None) -> None:
    points = load_memory(memory_dir)
    points = [p for p in points if p.get("table") == "table3"]
    if not points:
        return
    step = bench_step_ratios(bench_dir, "roberta-base") if bench_dir else {}
    header = ["task (batch)", "tokens (real / padded)", "method",
              "saved MiB none / 0.5 / 0.2 / 0.1", "saving vs exact none / 0.5 / 0.2 / 0.1",
              "analytic limit saving 0.5 / 0.2 / 0.1", "peak MiB none / 0.5 / 0.2 / 0.1",
              "peak saving vs exact none / 0.5 / 0.2 / 0.1",
              "step time / exact none / 0.5 / 0.2 / 0.1 (bench)",
              "paper GPU GiB none / 0.5 / 0.2 / 0.1", "paper peak saving 0.5 / 0.2 / 0.1"]
    rows = []
    for p in sorted(points, key=lambda p: (p["task"], p["batch_size"])):
        exact = p["exact"]["saved_activation_bytes"]
        exact_peak = _peak(p["exact"])
        paper = PAPER_TABLE3.get((p["task"], p["batch_size"]))
        paper_saving = "-"
        if paper:
            none = float(paper[0].lstrip("~"))
            paper_saving = " / ".join(f"{1 - float(v.lstrip('~')) / none:.0%}" for v in paper[1:])
        for label, key, base, by_rate, base_name, prefix in _families(p):
            recs = [base] + [by_rate.get(f"{r:g}", {}) for r in RATES]
            saved = [rec.get("saved_activation_bytes") for rec in recs]
            peaks = [_peak(rec) for rec in recs]
            times = [step.get(base_name)] + [step.get(prefix and f"{prefix}@{r:g}") for r in RATES]
            rows.append([
                f"{p['task']} ({p['batch_size']})", f"{p['real_tokens']} / {p['padded_tokens']}",
                label,
                " / ".join("-" if v is None else f"{v / 2**20:.0f}" for v in saved),
                " / ".join("-" if v is None else f"{1 - v / exact:.0%}" for v in saved),
                " / ".join(f"{1 - p['limit'][f'{r:g}'] / exact:.0%}" for r in RATES)
                if key in ("paper", "ours") and "limit" in p else "-",
                " / ".join("-" if v is None else f"{v / 2**20:.0f}" for v in peaks)
                if any(peaks) else "-",
                " / ".join("-" if v is None or not exact_peak else f"{1 - v / exact_peak:.0%}"
                           for v in peaks) if any(peaks) else "-",
                " / ".join("-" if t is None else f"{t['ratio']:.2f}" for t in times)
                if any(times) else "-",
                " / ".join(paper) if paper else "-", paper_saving,
            ])
    kinds = sorted({p["exact"]["peak_memory"]["kind"] for p in points if _peak(p["exact"])})
    peak_at = ", ".join(f"{p['task']} ({p['batch_size']})" for p in points
                        if _peak(p["exact"])) or "no point"
    commands = []
    for p in points:
        for c in p.get("command", "?").split(" ; "):
            if c not in commands:
                commands.append(c)
    info = step.get("_info")
    bench_text = (
        f"'step time' is the controlled benchmark's training-step time against exact for "
        f"roberta-base (random weights) at {info['batch']} tokens ({info['source']}), "
        f"{info['threads']} torch thread(s), {info['device']}: one process, each configuration "
        "interleaved with the exact model, the median of the bracketed per-sample ratios pooled "
        f"over {', '.join(info['runs'])} (results/bench). It is one batch shape, not each "
        "point's; checkpointing there is the reentrant variant, which keeps the same bytes."
        if info else "'step time': no benchmark file.")
    write_table(out / "table3", header, rows, (
        "# Table 3 analogue: saved-activation memory of roberta-base\n\n"
        "Bytes autograd saves for backward in one training step (unique storages, parameters "
        "excluded; device-independent), for the real roberta-base architecture with random "
        "weights, on batches with the real tasks' token lengths (dynamic padding, max length 512). "
        "'none' is the method without a sketch: the exact model for the paper's layout and ours, "
        "activation checkpointing alone (HF gradient checkpointing, non-reentrant: each encoder "
        "layer keeps its input and recomputes the rest in backward) for 'checkpointing + ours', "
        "compact activations alone (the exact linear layers) for 'ours + compact activations', "
        "LoRA alone for 'LoRA + ours', not measured ('-') where the family's sketch-free variant "
        "is not a row of its own. 'compact activations': patch_activations' defaults (dropout "
        "masks from seeds, attention probabilities and Q, K, V recomputed in backward from each "
        "attention block's input, 2-bit GELU codes). "
        "'LoRA': peft LoRA as adapter=lora trains it (configs/adapter/lora.yaml, the weights "
        "frozen), with ours on the adapters' lora_A inputs; its peak holds gradients and AdamW "
        "state of the adapters and the head only. "
        "'exact, b-bit rows': the exact sketch on every linear layer but the head (padding rows "
        "skipped, Q/K/V sharing one stored X) with its stored rows kept as b-bit codes and "
        "bfloat16 group ends (patch_linear(bits=b), method=exact method.bits=b), alone, with "
        "compact activations and with checkpointing; one record each, in the 'none' column. "
        "Savings are against the exact model; the analytic limit stores every patched linear "
        "input at exactly rho and nothing else changes. 'peak' is the peak memory of one "
        "steady-state training step in a fresh process "
        f"({', '.join(kinds) or 'not measured'}; measured at {peak_at}, '-' elsewhere): weights, "
        "gradients and AdamW state included, like the paper's whole-GPU peaks, whose savings are "
        "therefore smaller than the saved-activation savings by construction. The paper's "
        "columns are its Table 3 (peak GPU memory over one epoch, Gaussian sketch); its peak "
        "saving is computed from its GiB columns. " + bench_text + "\n\n"
        f"Made by: {' ; '.join(commands)} on {points[0].get('hardware', '?')}."))


def table3_runs(runs: list[dict], experiment: str, stem: Path) -> None:
    """Table 3 from training runs (``experiment=table3``, GPU): peak memory over one epoch."""
    runs = [r for r in runs if r["_experiment"] == experiment]
    if not runs:
        return
    points = defaultdict(dict)
    for r in runs:
        batch = r.get("config", {}).get("train", {}).get("batch_size")
        # The exact model is the baseline; with checkpointing or compact activations it is a
        # method of its own ("exact (compact)"), whose peak sits in the 'none' column.
        key = method_label(key_of("exact", scheme(r))) if r["sketch"] == "exact" \
            else f"{r['sketch']} ({scheme(r)})"
        points[(r["task"], batch)].setdefault(key, {})[float(r["rho"])] = r["peak_memory_bytes"]
    header = ["task (batch)", "method", "peak GiB none / 0.5 / 0.2 / 0.1",
              "saving none / 0.5 / 0.2 / 0.1", "exact GiB", "paper GPU GiB none / 0.5 / 0.2 / 0.1"]
    rows = []
    for (task, batch), methods in sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        exact = methods.get("exact", {}).get(1.0)
        paper = " / ".join(PAPER_TABLE3.get((task, batch), ("-",)))
        for key in sorted(k for k in methods if k != "exact"):
            peaks = [methods[key].get(r) for r in (1.0, 0.5, 0.2, 0.1)]
            rows.append([
                f"{task} ({batch})", key,
                " / ".join("-" if v is None else f"{v / 2**30:.2f}" for v in peaks),
                " / ".join("-" if v is None or not exact else f"{1 - v / exact:.0%}" for v in peaks),
                "-" if exact is None else f"{exact / 2**30:.2f}", paper])
    write_table(stem, header, rows, (
        "# Table 3 from training runs: peak memory over one epoch\n\n"
        "peak_memory_bytes of each run (the CUDA allocator's peak on a GPU, as the paper measured "
        f"it). {describe(runs)}"))


# ---------------------------------------------------------------------------------------------
# Figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": None})


def _scale(runs: list[dict]) -> str:
    """'CPU recipe' or 'paper scale' with the hardware the runs name."""
    hardware = sorted({r.get("hardware") or r.get("device", "?") for r in runs})
    cpu = all(str(r.get("device", "cpu")).startswith("cpu") for r in runs)
    return f"{'CPU recipe, scaled down' if cpu else 'paper scale, GPU'} ({'; '.join(hardware)})"


def _recipe_text(runs: list[dict]) -> str:
    cfg = runs[0].get("config", {})
    train, data = cfg.get("train", {}), cfg.get("data", {})
    bits = []
    if data.get("max_train_samples"):
        bits.append(f"first {data['max_train_samples']} training examples")
    if train.get("epochs") is not None:
        bits.append(f"{train['epochs']:g} epochs")
    if train.get("batch_size"):
        bits.append(f"batch {train['batch_size']}")
    return ", ".join(bits)


def figure5_runs(runs: list[dict], experiment: str) -> list[dict]:
    """The runs Figure 5 draws: CoLA, seed 1, the exact model and the Gaussian sketch in the
    paper's layout (not with checkpointing or compact activations), with a loss curve."""
    return [r for r in runs if r["_experiment"] == experiment and r["task"] == "cola"
            and r["seed"] == 1 and (r["sketch"], scheme(r)) in (("exact", "-"), ("gaussian", "paper"))
            and r.get("loss_curve")]


def figure5(runs: list[dict], experiment: str, out: Path) -> None:
    """Train loss (every logging step) and dev loss (every epoch) on CoLA, one line per rate."""
    runs = figure5_runs(runs, experiment)
    if not runs:
        return
    plt = _pyplot()
    fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    for r in sorted(runs, key=lambda r: -float(r["rho"])):
        label = "exact" if r["sketch"] == "exact" else f"Gaussian rho={r['rho']:g}"
        curve = [(e["epoch"], e["loss"]) for e in r["loss_curve"] if e["loss"] is not None]
        ax_t.plot(*zip(*curve, strict=True), label=label)
        dev = [(h["epoch"], h["eval_loss"]) for h in r["history"] if h.get("eval_loss") is not None]
        ax_d.plot(*zip(*dev, strict=True), marker="o", label=label)
    ax_t.set(title="training loss (every logging step)", xlabel="epoch",
             ylabel="mean cross-entropy per example (nats)")
    ax_d.set(title="dev loss (end of each epoch)", xlabel="epoch",
             ylabel="mean cross-entropy per dev example (nats)")
    epochs = sorted({h["epoch"] for r in runs for h in r["history"]})
    ax_d.set_xticks(epochs, [f"{e:g}" for e in epochs])
    ax_t.legend(fontsize=8)
    ax_d.legend(fontsize=8)
    model = MODEL_NAMES.get(runs[0]["model"], runs[0]["model"])
    fig.suptitle(f"Figure 5 analogue: {model} on CoLA, Gaussian sketch in the paper's layout, "
                 f"seed 1 only (one seed per line)\n{_recipe_text(runs)}; {_scale(runs)}",
                 fontsize=10)
    _save(fig, out / "figure5_loss.png")
    plt.close(fig)


def _threads(n) -> str:
    return f"{n} torch thread{'s' if n != 1 else ''}"


def _throughput(st: dict) -> tuple[float, float, float]:
    """(relative throughput, lower error, upper error) from a time-ratio record: 1 / ratio, with
    the interquartile range of the ratios inverted."""
    y = 1 / st["ratio"]
    return y, y - 1 / st["q3"], 1 / st["q1"] - y


def figure6(bench_dir: Path, out: Path) -> None:
    """Throughput relative to exact from the controlled benchmark (not from the training runs):
    one linear layer per sketch and rate, and a training step of MiniLM and roberta-base per
    method and rate."""
    layer = bench_layer_ratios(bench_dir) if bench_dir else {}
    models = [(m, bench_step_ratios(bench_dir, m)) for m in ("minilm", "roberta-base")]
    models = [(m, st) for m, st in models if st]
    if not layer and not models:
        return
    plt = _pyplot()
    panels = (1 if layer else 0) + len(models)
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 5.0), layout="constrained",
                             squeeze=False)
    axes = list(axes[0])
    markers = iter("osD^vP<>X*" * 3)
    if layer:
        ax = axes.pop(0)
        for sketch in [k for k in SKETCH_ORDER if k != "exact"]:
            pts = [(r, layer[f"{sketch}@{r:g}"]) for r in RATES if f"{sketch}@{r:g}" in layer]
            if not pts:
                continue
            ys = [_throughput(st) for _, st in pts]
            ax.errorbar([r for r, _ in pts], [y[0] for y in ys],
                        yerr=[[y[1] for y in ys], [y[2] for y in ys]], marker=next(markers),
                        capsize=3, label=sketch)
        ax.axhline(1.0, color="k", lw=1, ls="--", label="nn.Linear")
        ax.set(xscale="log", xlabel="rho (compression rate, log scale)",
               ylabel="throughput relative to nn.Linear\n(nn.Linear time / layer time)",
               title=f"one {BENCH_LAYER[0].replace('x', '->')} linear layer, {BENCH_LAYER[1]} rows, "
                     f"forward + backward\n{_threads(layer['_info']['threads'])}, "
                     f"run {', '.join(layer['_info']['runs'])}")
        ax.set_xticks(RATES, [f"{r:g}" for r in RATES])
        ax.minorticks_off()
        ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    series = [("paper", "Gaussian, paper's layout"), ("ours-gaussian", "Gaussian, our layout"),
              ("ours-blocksrht", "blocksrht, our layout"),
              ("ckpt+ours-blocksrht", "checkpointing + blocksrht (ours)")]
    flat = [("ckpt", "checkpointing, exact", ":"), ("exact-skip", "exact, padding skipped", "-.")]
    for (model, st), ax in zip(models, axes, strict=True):
        markers = iter("osD^vP<>X*" * 3)
        for prefix, label in series:
            pts = [(r, st[f"{prefix}@{r:g}"]) for r in RATES if f"{prefix}@{r:g}" in st]
            if not pts:
                continue
            ys = [_throughput(v) for _, v in pts]
            ax.errorbar([r for r, _ in pts], [y[0] for y in ys],
                        yerr=[[y[1] for y in ys], [y[2] for y in ys]], marker=next(markers),
                        capsize=3, label=label)
        for name, label, ls in flat:
            if name in st:
                ax.axhline(1 / st[name]["ratio"], color="gray", lw=1.5, ls=ls, label=label)
        ax.axhline(1.0, color="k", lw=1, ls="--", label="exact")
        info = st["_info"]
        ax.set(xscale="log", xlabel="rho (compression rate, log scale)",
               ylabel="training-step throughput relative to exact\n(exact step time / step time)",
               title=f"{MODEL_NAMES.get(model, model)}"
                     f"{' (random weights)' if model != 'minilm' else ''}: training step, "
                     f"{info['batch']} tokens\n{_threads(info['threads'])}, "
                     f"{len(info['runs'])} run{'s' if len(info['runs']) > 1 else ''} pooled")
        ax.set_xticks(RATES, [f"{r:g}" for r in RATES])
        ax.minorticks_off()
        ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    device = (models[0][1]["_info"]["device"] if models else "CPU")
    source = models[0][1]["_info"]["source"] if models else ""
    fig.suptitle("Figure 6 analogue: throughput relative to exact, from the controlled CPU benchmark "
                 f"({device}; one process, interleaved with the baseline; median and "
                 f"interquartile range),\nnot from the training runs; batch lengths: {source}; "
                 "above 1 is faster", fontsize=10)
    _save(fig, out / "figure6_throughput.png")
    plt.close(fig)


def figure3(memory_dir: Path, out: Path) -> None:
    """Saved-activation memory (and, where measured, the peak of a training step) against batch
    size per rate (roberta-base, real lengths): the paper's layout, ours, ours with compact
    activations (and compact activations alone), and checkpointing."""
    points = load_memory(memory_dir)
    curve = [p for p in points if p.get("table") == "figure3"]
    if not curve:
        return
    # Table 3's point of the same task extends the curve (memory_table.py does not measure it twice).
    task = curve[0]["task"]
    sizes = {p["batch_size"] for p in curve}
    pts = sorted(curve + [p for p in points if p.get("table") == "table3" and p["task"] == task
                          and p["batch_size"] not in sizes], key=lambda p: p["batch_size"])
    kinds = sorted({p["exact"]["peak_memory"]["kind"] for p in pts if _peak(p["exact"])})
    cpu = any("RSS" in k for k in kinds)
    rows = [("saved activations (GiB, log scale)\ndevice-independent", pts,
             lambda rec: rec.get("saved_activation_bytes"), "log")]
    peak_pts = [p for p in pts if _peak(p["exact"]) is not None]
    if peak_pts:
        rows.append((("peak RSS of one training step (GiB)\nCPU process: weights, grads, AdamW "
                      "incl." if cpu else "peak CUDA memory of one training step (GiB)"),
                     peak_pts, _peak, "linear"))
    with_ckpt = all(p.get("ckpt") and p.get("ckpt+ours") for p in pts)
    columns = [("paper", "paper's layout (Gaussian)"), ("ours", "our layout (blocksrht)")]
    if all(p.get("ours+compact") for p in pts):
        columns.append(("ours+compact", "ours + compact activations"))
    if with_ckpt:
        columns.append(("ckpt+ours", "activation checkpointing (+ ours)"))
    with_compact_ckpt = with_ckpt and all(p.get("ckpt+ours+compact") for p in pts)
    plt = _pyplot()
    fig, axes = plt.subplots(len(rows), len(columns), figsize=(4.6 * len(columns), 3.9 * len(rows)),
                             sharey="row", sharex=True, squeeze=False, layout="constrained")
    markers = {"0.5": "^", "0.2": "v", "0.1": "D"}
    for i, ((ylabel, row_pts, value, yscale), ax_row) in enumerate(zip(rows, axes, strict=True)):
        xs = [p["batch_size"] for p in row_pts]
        for ax, (sch, title) in zip(ax_row, columns, strict=True):
            ax.plot(xs, [value(p["exact"]) / 2**30 for p in row_pts], marker="o", color="k",
                    lw=2, label="exact")
            if sch == "ours+compact":
                ys = [value(p.get("compact") or {}) for p in row_pts]
                if None not in ys:
                    ax.plot(xs, [v / 2**30 for v in ys], color="gray", ls="--", marker="s",
                            lw=1.5, label="compact activations alone")
            if sch == "ckpt+ours":
                ys = [value(p["ckpt"]) for p in row_pts]
                if None not in ys:
                    ax.plot(xs, [v / 2**30 for v in ys], color="gray", ls="--", marker="s",
                            lw=2.5, ms=12, markerfacecolor="none", markeredgewidth=1.5,
                            label="checkpointing alone")
                ys = [value(p["ckpt+ours+compact"].get("0.1", {})) for p in row_pts] \
                    if with_compact_ckpt else [None]
                if None not in ys:
                    ax.plot(xs, [v / 2**30 for v in ys], color="tab:purple", ls=":", marker="x",
                            lw=1.5, label="rho=0.1 (+ checkpointing + compact)")
            for rho in ("0.5", "0.2", "0.1"):
                ys = [value(p[sch].get(rho, {})) for p in row_pts]
                if None in ys:
                    continue
                # Checkpointing's lines lie on one another: hollow markers of falling size keep
                # each visible.
                size = {"0.5": 9, "0.2": 6.5, "0.1": 4}[rho] if sch == "ckpt+ours" else 5
                ax.plot(xs, [v / 2**30 for v in ys], marker=markers[rho], ms=size, lw=1.2,
                        markerfacecolor="none" if sch == "ckpt+ours" and rho != "0.1" else None,
                        markeredgewidth=1.5,
                        label=f"rho={rho}" + (" (+ checkpointing)" if sch == "ckpt+ours" else ""))
            ax.set(xscale="log", yscale=yscale)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(title)
            if i == len(rows) - 1:
                ax.set_xlabel("batch size (examples, log scale)")
            ax.legend(fontsize=7)
        ax_row[0].set_ylabel(ylabel)
    seeds = "one batch per point, drawn with a fixed seed"
    hardware = pts[0].get("hardware", "?")
    fig.suptitle(f"Figure 3 analogue: roberta-base architecture (random weights), "
                 f"{TASK_NAMES.get(task, task)} dev lengths, dynamic padding; {seeds}\n"
                 f"CPU measurement ({hardware}); the saved bytes are what a GPU would hold too"
                 + ("; checkpointing's lines coincide: it keeps only layer inputs, which the sketch "
                    "does not touch" if with_ckpt else ""), fontsize=9)
    _save(fig, out / "figure3_memory.png")
    plt.close(fig)


def embed_in_readme(readme: Path, table: Path, name: str) -> None:
    """Copy ``table`` between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in ``readme``."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    if not (readme.exists() and table.exists()):
        return
    text = readme.read_text()
    if begin not in text or end not in text:
        return
    head, rest = text.split(begin, 1)
    body = table.read_text().split("\n", 2)[2]  # without the table's own title
    readme.write_text(f"{head}{begin}\n{body.strip()}\n{end}{rest.split(end, 1)[1]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(ROOT / "results"))
    parser.add_argument("--cpu-experiment", default="minilm_cpu")
    args = parser.parse_args(argv)
    results = Path(args.results)
    runs = load_runs(results / "runs")
    check_one_recipe_per_cell(runs)
    tables, figures = results / "tables", results / "figures"
    # The CPU runs make table2/table4; paper-scale runs (experiment=table2 / table4), where
    # present, make table2_roberta / table4_roberta beside them.
    majority_file = results / "baselines" / "majority.json"
    majority = json.loads(majority_file.read_text()) if majority_file.exists() else None
    table2(runs, args.cpu_experiment, tables / "table2", majority)
    bench = results / "bench"
    table4(runs, args.cpu_experiment, tables / "table4", bench)
    comparisons(runs, args.cpu_experiment, tables / "comparisons")
    comparisons(runs, "lora_cpu", tables / "lora", LORA_COMPARISONS,
                "LoRA with and without the sketch on its adapters")
    table2(runs, "table2", tables / "table2_roberta")
    table4(runs, "table4", tables / "table4_roberta", bench)
    table3_runs(runs, "table3", tables / "table3_roberta")
    tuning(runs, tables)
    table3(results / "memory", tables, bench)
    figure3(results / "memory", figures)
    figure5(runs, args.cpu_experiment, figures)
    figure6(bench, figures)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import frontier  # the accuracy-memory-time frontier (scripts/frontier.py)

    frontier.build(results)
    for name in ("table4", "comparisons"):
        embed_in_readme(results.parent / "README.md", tables / f"{name}.md", name)
    for path in sorted([*tables.glob("*.md"), *figures.glob("figure[356]*.png")]):
        print(path.relative_to(results.parent) if path.is_relative_to(results.parent) else path)


if __name__ == "__main__":
    main()
