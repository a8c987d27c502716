"""The random-stream check: runs made again after the codecs (the stochastic rounding of b-bit rows,
the dropout masks, the GELU code) moved from torch generators to the counter-based Philox stream
of :mod:`sketchprop.rng`, paired by seed with the committed runs of the same identity.

The committed runs stay as they were made (their JSON names their commit); this table says
whether the new stream moves the score. The runs repeated live under
``results/checks/philox_stream/runs/``, apart from ``results/runs/`` so that no table mixes the two
streams; writes ``results/tables/stream_check.md|csv`` when they exist.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .common import (
    TASK_NAMES,
    describe,
    fmt_score,
    load_runs,
    method_key,
    method_label,
    paired,
    score,
    verdict,
    write_table,
)

CHECK_DIR = Path("checks") / "philox_stream" / "runs"  # under results/


def _recipe(run: dict) -> str:
    """The run's identity less its seed, as text: runs of one configuration share it."""
    ident = json.loads(json.dumps(run["identity"]))
    ident.pop("seed", None)
    return json.dumps(ident, sort_keys=True)


def stream_check(results: Path, stem: Path) -> None:
    """Each configuration repeated on the new stream against the committed runs of the same
    identity: both scores, the differences seed by seed, their mean, SE, 95% interval, verdict,
    and the mean training time of each side."""
    new = load_runs(results / CHECK_DIR)
    if not new:
        return
    old = load_runs(results / "runs")
    groups: dict[tuple, list[dict]] = {}
    for r in new:
        groups.setdefault((r["_experiment"], r["task"], _recipe(r)), []).append(r)
    header = ["task", "method", "Philox stream", "torch generators (committed)", "n pairs", "seeds",
              "difference per seed", "mean difference", "SE", "95% interval", "verdict",
              "train s (Philox / committed)", "peak MiB (Philox / committed)"]
    rows, used = [], []
    for (experiment, task, recipe), ours in sorted(groups.items()):
        base = [r for r in old if r["_experiment"] == experiment and r["task"] == task
                and _recipe(r) == recipe]
        if not base:
            continue
        p = paired(ours, base)
        used += ours + [r for r in base if r["seed"] in p.seeds]
        interval = "-"
        if p.n > 1:
            low, high = p.interval()
            interval = f"[{low:+.2f}, {high:+.2f}]"
        runtime, peak = ([statistics.fmean(r[k] for r in side if r["seed"] in p.seeds)
                          for side in (ours, base)] for k in ("train_runtime", "peak_memory_bytes"))
        rows.append([
            TASK_NAMES.get(task, task), method_label(method_key(ours[0])),
            fmt_score([score(r) for r in ours if r["seed"] in p.seeds]),
            fmt_score([score(r) for r in base if r["seed"] in p.seeds]), p.n,
            ", ".join(map(str, p.seeds)) or "-", " / ".join(f"{d:+.2f}" for d in p.diffs) or "-",
            f"{p.mean:+.2f}" if p.n > 1 else "-", f"{p.se:.2f}" if p.n > 1 else "-", interval,
            verdict(p), " / ".join(f"{t:.0f}" for t in runtime),
            " / ".join(f"{m / 2**20:.0f}" for m in peak)])
    if not rows:
        return
    write_table(stem, header, rows, (
        "# The codecs' random stream: Philox against the torch generators\n\n"
        "The same configuration, recipe and seeds, run once with the codecs drawing from torch "
        "generators (the committed runs, before the fused codecs) and once from the Philox stream "
        "of sketchprop.rng (`results/checks/philox_stream/`): dev score x100 at the best epoch, "
        "paired by seed (same initialisation and data order; only the codes' rounding, the "
        "dropout masks and the GELU code's rounding differ). 'mean difference' is Philox minus "
        "committed, SE the sample sd of the differences / sqrt(n), the interval mean ± t(0.975, "
        "n-1) SE. 'no difference measured' is not a finding of equality. Training time is each "
        "side's mean over the paired seeds, on machines whose other load was not controlled: "
        "a hint, not a benchmark (`make bench-speed` times the codecs). Peak is the process's "
        "(on CPU its resident memory), which now holds the compiler that builds the codecs' "
        "kernels.\n\n"
        + describe(list({r["_path"]: r for r in used}.values()))))
