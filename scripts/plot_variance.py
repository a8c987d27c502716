"""Figure 4: the variance the sketch adds against SGD's own, over training steps.

Reads the ``variance`` records (``sketchprop.variance.collect``) from one or more run JSON files
(``result.json`` or ``results/runs/...json``: a dict with key ``variance``; a bare list of records
also works) and draws, per tracked layer,

- left: ``D2_SGD`` and ``D2_RMM`` (paper eqs. 9 and 11) on a log scale, and (dotted) the online
  estimate of the sketch's own variance ``E|X^T S S^T Y - X^T Y|^2`` where the records have it;
- right: the normalised ratio ``B_proj / (B-1) * D2_RMM / D2_SGD`` with a reference line at 1
  (the quantity the paper plots; it stays near 1 in the paper's CoLA run).

Per-step values are noisy (each is estimated from one batch and one sketch): thin lines show them,
thick lines a moving median over ``--window`` steps.

    python scripts/plot_variance.py results/runs/figure4/cola/gaussian-rho0.5-seed1.json
    python scripts/plot_variance.py RUN.json --out results/figures/figure4_variance.png --window 25
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LABELS = {"d2_sgd": "$D^2_{SGD}$", "d2_rmm": "$D^2_{RMM}$", "d2_sketch": "sketch's own variance"}
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "figures" / "figure4_variance.png"


def load_records(path: str | Path) -> tuple[list[dict], str]:
    """The records of one file and a label for it (task, sketch, rho when known)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return data, Path(path).stem
    records = data.get("variance")
    if not records:
        raise ValueError(f"{path}: no 'variance' records (was variance tracking on?)")
    bits = [str(data[k]) for k in ("task", "sketch") if data.get(k) is not None]
    if data.get("rho") is not None:
        bits.append(f"rho={data['rho']}")
    return records, " ".join(bits) or Path(path).stem


def per_step(records: list[dict], field: str) -> tuple[list[int], list[float]]:
    """Mean of ``field`` per step (micro-batches of one step averaged), None values skipped."""
    acc: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.get(field) is not None:
            acc[int(r["step"])].append(float(r[field]))
    steps = sorted(acc)
    return steps, [sum(acc[s]) / len(acc[s]) for s in steps]


def moving_median(values: list[float], window: int) -> list[float]:
    half = max(window, 1) // 2
    return [statistics.median(values[max(0, i - half): i + half + 1]) for i in range(len(values))]


def plot(sources: list[tuple[list[dict], str]], out: str | Path = DEFAULT_OUT, window: int = 25,
         title: str | None = None) -> Path:
    """Draw the figure from ``(records, label)`` pairs and save it to ``out``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d2, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10)
    summary, styles = [], {}
    for records, label in sources:
        by_layer: dict[str, list[dict]] = defaultdict(list)
        for r in records:
            by_layer[r["layer"]].append(r)
        for layer, recs in by_layer.items():
            name = f"{label} {layer}".strip() if len(sources) > 1 else layer
            color = next(colors)
            for field, style in (("d2_sgd", "-"), ("d2_rmm", "--"), ("d2_sketch", ":")):
                steps, vals = per_step(recs, field)
                pos = [(s, v) for s, v in zip(steps, vals, strict=True) if v > 0]
                if not pos:
                    continue
                s, v = zip(*pos, strict=True)
                ax_d2.plot(s, v, style, color=color, alpha=0.25, lw=0.8)
                ax_d2.plot(s, moving_median(list(v), window), style, color=color, lw=1.8)
                styles[field] = style
            steps, ratio = per_step(recs, "ratio")
            if steps:
                ax_ratio.plot(steps, ratio, color=color, alpha=0.25, lw=0.8)
                ax_ratio.plot(steps, moving_median(ratio, window), color=color, lw=1.8, label=name)
                tail = ratio[len(ratio) // 2:]
                summary.append(f"{name}: median ratio {statistics.median(ratio):.3f} "
                               f"(second half {statistics.median(tail):.3f}, {len(ratio)} steps)")
    ax_d2.set_yscale("log")
    ax_d2.set_xlabel("step")
    ax_d2.set_ylabel("variance estimate")
    ax_d2.set_title("$D^2_{SGD}$ (eq. 9), $D^2_{RMM}$ (eq. 11), sketch variance")
    for field, style in styles.items():  # line styles here, layer colours on the right
        ax_d2.plot([], [], style, color="gray", label=LABELS[field])
    ax_d2.legend(fontsize=8)
    ax_ratio.axhline(1.0, color="black", lw=1, ls=":", label="1")
    ax_ratio.set_xlabel("step")
    ax_ratio.set_ylabel(r"$\frac{B_{proj}}{B-1}\,D^2_{RMM} / D^2_{SGD}$")
    ax_ratio.set_title("normalised ratio")
    ax_ratio.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    for line in summary:
        print(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run JSON files with a 'variance' key")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output image (png, pdf, svg)")
    parser.add_argument("--window", type=int, default=25, help="moving-median window in steps")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        sources = [load_records(p) for p in args.runs]
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(plot(sources, args.out, args.window, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
