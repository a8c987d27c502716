"""What the report's tables and figures share: the run files and how they group, paired
statistics, the controlled benchmark's ratios, formatting, and writing tables and figures.

- loading: :func:`load_runs` (every run JSON under ``results/runs``), :func:`load_memory` (the point
  files of ``scripts/memory_table.py``), :func:`check_one_recipe_per_cell`;
- keys: :func:`scheme` (a run's layout: ``paper``, ``ours``, ``+ckpt``, ``+compact``...),
  :func:`method_key` / :func:`key_of` (a method's sort key, from a run or by name),
  :func:`method_label`, :func:`score` (the paper's metric per task);
- paired statistics: :func:`paired` (differences seed by seed), :class:`Paired`, :func:`verdict`;
- the controlled benchmark (``results/bench``): :func:`bench_step_ratios` (against exact, and
  against :data:`EXACT_SKIP` where a run timed it), :func:`rows_text`, :func:`skip_note`,
  :func:`rerun_step`, :func:`bench_layer_ratios`, :func:`fmt_ratio`;
- writing: :func:`write_table` (markdown and CSV), :func:`describe` (where and how runs were made),
  :func:`pyplot` and :func:`save_figure` (PNG files without timestamps: the same input gives the
  same bytes).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from omegaconf import OmegaConf
from scipy import stats

from ..quantize import DEFAULT_GROUP

# The checkout (src/sketchprop/report/ is three levels down), as sketchprop.glue.config.REPO_ROOT:
# read here so that the reports need no pipeline (hydra) to run.
ROOT = Path(__file__).resolve().parents[3]
# The paper's metric per task (results carry all of a task's metrics; this one is reported).
METRIC = {"cola": "matthews", "stsb": "pearson", "mrpc": "accuracy", "qqp": "accuracy",
          "sst2": "accuracy", "mnli": "accuracy", "qnli": "accuracy", "rte": "accuracy",
          "wnli": "accuracy"}
TASK_ORDER = ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"]
SKETCH_ORDER = ["exact", "gaussian", "rademacher", "dct", "dft", "blocksrht", "rowsample",
                "importance"]
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


def _activations_set(name: str) -> dict:
    """The settings ``activations=<name>`` gives (configs/activations/<name>.yaml, read as the
    pipeline composes it); a run with other settings is labelled with the ones that differ."""
    conf = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "activations" / f"{name}.yaml"))
    conf.pop("defaults", None)
    return conf


COMPACT = _activations_set("compact")
LEAN = _activations_set("lean")

EXACT = key_of("exact")


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
    ``+lean`` with the lean preset (``activations=lean``, named the same way), ``+int4`` for rows
    stored as 4-bit codes (``method.bits=4``; ``int4g128`` with scales over groups of 128
    columns, ``method.group=128``, where the default is 64), and ``lora+`` in front for a
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
    bits, group = (ident.get("method", {}).get(k) for k in ("bits", "group"))
    if bits is not None:  # stored rows as b-bit codes (method.bits), over groups of method.group
        parts.append(f"int{bits}" if group in (None, DEFAULT_GROUP) else f"int{bits}g{group}")
    if ident.get("train", {}).get("gradient_checkpointing", False):
        parts.append("ckpt")
    # runs.identity leaves the activations out at their neutral (stored) value.
    if "activations" in ident:
        acts = ident["activations"]
        name, base = ("lean", LEAN) if acts.get("preset") == "lean" else ("compact", COMPACT)
        other = [f"{k}={v}" for k, v in acts.items() if base.get(k) != v]
        parts.append(f"{name}({','.join(other)})" if other else name)
    return "+".join(parts) or "-"


def score(run: dict, best: bool = True) -> float | None:
    """The paper's metric of the run: at the best epoch (as the authors report) or the last."""
    metrics = run["best_metrics"] if best else run["metrics"]
    return metrics.get(METRIC.get(run["task"], "accuracy"))


def method_key(run: dict) -> tuple:
    """The run's method as a sort key: (sketch order, sketch, :func:`scheme`, -rho)."""
    return (SKETCH_ORDER.index(run["sketch"]) if run["sketch"] in SKETCH_ORDER else 99,
            run["sketch"], scheme(run), -float(run["rho"]))


def method_label(key: tuple) -> str:
    """``exact``, ``exact (compact)`` or ``blocksrht (ours) rho=0.1`` for a method key."""
    _, sketch, sch, neg_rho = key
    if sketch == "exact":
        return "exact" if sch == "-" else f"exact ({sch})"
    return f"{sketch} ({sch}) rho={-neg_rho:g}"


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample sd of the values that are not None (nan and None when none is, sd None
    for one)."""
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt_score(values: list[float]) -> str:
    """``52.00 ± 1.00 (n=3)``, ``52.00`` for one value, ``-`` for none."""
    mean, sd = mean_sd(values)
    if math.isnan(mean):
        return "-"
    return f"{mean:.2f}" if sd is None else f"{mean:.2f} ± {sd:.2f} (n={len(values)})"


def load_memory(memory_dir: Path) -> list[dict]:
    """Every point file of scripts/memory_table.py, in file-name order."""
    files = sorted(memory_dir.glob("*.json")) if memory_dir.exists() else []
    return [json.loads(f.read_text()) for f in files]


def peak(rec: dict) -> int | None:
    """The peak bytes of a memory record's step, None where not measured."""
    return (rec.get("peak_memory") or {}).get("peak_bytes")


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


def write_table(stem: Path, header: list[str], rows: list[list], preamble: str) -> None:
    """``stem``.csv (header and rows) and ``stem``.md (the preamble, then the rows as a table)."""
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


#: The step benchmark's name of the exact model with padding rows skipped (the ``exact`` sketch with
#: ``skip_padding``: exact gradients, only the non-padding rows stored and multiplied): the fair
#: baseline of a configuration that skips padding rows itself.
EXACT_SKIP = "exact-skip"
#: Row kinds of a step benchmark's batch: every row full length, or the task's real lengths.
FULL, REAL = "full", "real"


def rows_kind(batch: dict) -> str:
    """:data:`FULL` where every row of a benchmark batch is real tokens, else :data:`REAL`."""
    return FULL if batch.get("real_fraction", 0.0) >= 1.0 else REAL


def rows_text(info: dict) -> str:
    """Which rows a step benchmark timed, from its ``_info``: ``rows: full-length`` or ``rows: the
    task's real lengths (39.4% real tokens, MRPC dev, ...)``."""
    if info.get("rows") == FULL:
        return "rows: full-length (no padding)"
    frac = info.get("real_fraction")
    share = f"{100 * frac:.1f}% real tokens, " if frac is not None else ""
    return f"rows: the task's real lengths ({share}{info.get('source', '?')})"


def _versus_skip(ratios: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each method's per-round time over :data:`EXACT_SKIP`'s in the same round of one run (both
    bracketed by the same exact baseline, one sample each per round), or nothing where the run
    did not time it."""
    skip = ratios.get(EXACT_SKIP)
    if not skip:
        return {}
    out = {name: [a / b for a, b in zip(rs, skip, strict=True)]
           for name, rs in ratios.items() if name != "exact"}
    out["exact"] = [1 / b for b in skip]
    return out


def bench_step_ratios(bench_dir: Path, model: str, rows: str = REAL) -> dict[str, dict]:
    """Training-step time / exact per method for ``model`` on ``rows`` (:data:`REAL` or
    :data:`FULL`), pooled over the committed runs of scripts/bench_model.py (``model_*.json``, not
    ``--quick``) that timed it in the same setting (batch, its lengths, device, torch threads; the
    setting with the most runs wins): ``{method: {ratio, q1, q3, n}}`` (median and quartiles of the
    bracketed per-sample ratios) and ``"_info"`` (the setting, its ``rows`` and the ``runs``).
    A method timed in a run that also timed :data:`EXACT_SKIP` has ``"skip"`` too: the same
    statistics of its per-round time over exact-skip's, pooled over those runs (``skip_runs``)."""
    by_setting: dict[tuple, dict] = {}
    for path in sorted(bench_dir.glob("model_*.json")) if bench_dir.exists() else []:
        if "_quick" in path.stem:
            continue
        data = json.loads(path.read_text())
        args, env = data.get("args", {}), data.get("environment", {})
        for res in data.get("results", []):
            timed = {n: m["time"]["ratios"] for n, m in res.get("methods", {}).items()
                     if m.get("time")}
            batch = res.get("batch", {})
            if res.get("model") != model or not timed or rows_kind(batch) != rows:
                continue
            setting = (args.get("batch"), args.get("seq"), args.get("task"),
                       env.get("torch_threads"), env.get("device"), batch.get("source"),
                       batch.get("real_fraction"))
            entry = by_setting.setdefault(setting, {
                "pooled": defaultdict(list), "skip": defaultdict(list),
                "info": {"batch": f"{setting[0]}x{setting[1]}", "threads": setting[3],
                         "source": batch.get("source", "?"), "rows": rows,
                         "real_fraction": batch.get("real_fraction"),
                         "device": env.get("cpu") or setting[4], "runs": [], "skip_runs": []}})
            entry["info"]["runs"].append(path.stem)
            for name, ratios in timed.items():
                entry["pooled"][name] += ratios
            versus = _versus_skip(timed)
            if versus:
                entry["info"]["skip_runs"].append(path.stem)
            for name, ratios in versus.items():
                entry["skip"][name] += ratios
    if not by_setting:
        return {}
    best = max(by_setting.values(), key=lambda e: (len(e["info"]["runs"]),
                                                   sum(map(len, e["pooled"].values()))))
    out = {name: _ratio_stats(r) for name, r in best["pooled"].items() if r}
    for name, r in best["skip"].items():
        out[name]["skip"] = _ratio_stats(r)
    out["_info"] = best["info"]
    return out


# Every configuration a step-time table shows, for a run that times them all beside exact-skip.
RERUN_METHODS = ("exact,exact-skip,ckpt,paper,ours,ckpt+ours,compact,ours+compact,"
                 "ckpt+ours+compact,int8,int4,int2,int4+compact")


def rerun_step(model: str, rows: str = REAL, extra: str = "") -> str:
    """The scripts/bench_model.py command that times every configuration of the tables (and the
    ``extra`` methods) beside exact-skip on ``rows``, in one run."""
    full = rows == FULL
    return (f"python scripts/bench_model.py --models {model} --methods {RERUN_METHODS}{extra} "
            f"--parts time --threads 1{' --rows full' if full else ''} "
            f"--tag _{model.split('-')[0]}_fair{'_full' if full else ''}")


def skip_note(info: dict, rerun: str) -> str:
    """What a table says about its exact-with-padding-skipped baseline: the runs that timed it
    beside the configurations, or that none did and the command that would."""
    full = ("On full-length rows there is no padding to skip: exact, padding skipped does the same "
            "work as exact. " if info.get("rows") == FULL else "")
    if info.get("skip_runs"):
        return (full + "'/ exact, padding skipped': the per-round time over that of exact with "
                "padding rows skipped (exact gradients, only the non-padding rows stored and "
                f"multiplied) in the same round, pooled over {', '.join(info['skip_runs'])}; '-' "
                "where no run timed the configuration beside it (rerun: `" + rerun + "`).")
    if full:
        return full.rstrip()
    return ("Exact with padding rows skipped was not timed in these runs: the ratios are against "
            "exact, which multiplies the padding rows too (rerun: `" + rerun + "`).")


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
    """``0.80 (0.75-0.85)`` (median and quartiles of a ratio), ``-`` where not timed."""
    if not st:
        return "-"
    if st["n"] < 2 or st["ratio"] == st["q1"] == st["q3"]:
        return f"{st['ratio']:.2f}"
    return f"{st['ratio']:.2f} ({st['q1']:.2f}-{st['q3']:.2f})"


# ---------------------------------------------------------------------------------------------
# Figures


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported here: only the figures need it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Save ``fig`` as ``path`` (folders made), without the timestamp or version matplotlib writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": None})
