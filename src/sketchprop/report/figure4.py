"""Figure 4: the variance the sketch adds against SGD's own, over training steps.

Reads the ``variance`` records (``sketchprop.tracking.collect``) from one or more run JSON files
(``result.json`` or ``results/runs/...json``: a dict with key ``variance``; a bare list of records
also works) and draws, per tracked layer,

- left: ``D2_SGD`` and ``D2_RMM`` (the paper's estimators, its Section 2.3) on a log scale, and
  (dotted, with hollow markers) the online estimate of the sketch's own variance
  ``E|X^T S S^T Y - X^T Y|^2`` where the records have it;
- right: the normalised ratio ``B_proj / (B-1) * D2_RMM / D2_SGD`` with a reference line at 1
  (the quantity the paper plots; it stays near 1 in the paper's CoLA run).

Per-step values are noisy (each is estimated from one batch and one sketch): thin lines show them,
thick lines a moving median over ``--window`` steps. Both panels carry the layer colours in their
legend. Unless ``--title`` is given, the title names what the run file records: model, task, sketch,
rate and layout, batch, epochs and steps, seed, and the scale (the CPU recipe or a GPU run).

Drawn by ``scripts/plot_variance.py`` (``make figure4``, ``make figure4-cpu``), by default into
``results/figures/figure4_variance.png``.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from .common import MODEL_NAMES, ROOT, TASK_NAMES

LABELS = {"d2_sgd": "$D^2_{SGD}$", "d2_rmm": "$D^2_{RMM}$", "d2_sketch": "sketch's own variance"}
# Line style and marker of each field (the sketch's own variance lies on D2_RMM: markers keep it
# visible).
STYLES = {"d2_sgd": ("-", None), "d2_rmm": ("--", None), "d2_sketch": (":", "o")}
DEFAULT_OUT = ROOT / "results" / "figures" / "figure4_variance.png"


def load_run(path: str | Path) -> tuple[list[dict], str, dict]:
    """The records of one file, a short label and the whole run dict (``{}`` for a bare list)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return data, Path(path).stem, {}
    records = data.get("variance")
    if not records:
        raise ValueError(f"{path}: no 'variance' records (was variance tracking on?)")
    bits = [str(data[k]) for k in ("task", "sketch") if data.get(k) is not None]
    if data.get("rho") is not None:
        bits.append(f"rho={data['rho']}")
    return records, " ".join(bits) or Path(path).stem, data


def describe_run(run: dict, records: list[dict]) -> str:
    """A title naming what ``run`` records: model, task, sketch and rate, layout, batch, epochs and
    steps, seed, and the scale (CPU recipe or GPU). Unknown fields are left out."""
    cfg = run.get("config") or {}
    train, method = cfg.get("train") or {}, cfg.get("method") or {}
    parts = []
    model = run.get("model")
    if model:
        parts.append(MODEL_NAMES.get(model, model))
    if run.get("task"):
        parts.append(f"on {TASK_NAMES.get(run['task'], run['task'])}")
    if run.get("sketch"):
        layout = ""
        if method:
            layout = (" (our layout)" if method.get("share_inputs") and method.get("skip_padding")
                      else " (the paper's layout)")
        parts.append(f"{run['sketch'].capitalize()} sketch, rho={run.get('rho')}{layout}")
    steps = max((int(r["step"]) for r in records), default=0)
    epochs = run.get("epochs") or train.get("epochs")
    bits = []
    if train.get("batch_size"):
        bits.append(f"batch {train['batch_size']}")
    if epochs is not None:
        n = float(epochs)
        bits.append(f"{n:g} epoch{'s' if n != 1 else ''} ({steps} steps)")
    if run.get("seed") is not None:
        bits.append(f"seed {run['seed']} (one seed)")
    device = str(run.get("device") or "")
    if device:
        scale = ("CPU recipe, scaled down" if device.startswith("cpu") else "paper scale, GPU")
        bits.append(f"{scale}: {run.get('hardware') or device}")
    title = "Figure 4 analogue: " + ", ".join(parts) if parts else "Figure 4 analogue"
    return title + ("\n" + "; ".join(bits) if bits else "")


def short_layer(name: str) -> str:
    """``bert.encoder.layer.3.intermediate.dense`` -> ``layer 3 intermediate.dense``."""
    head, sep, rest = name.partition("layer.")
    if not sep:
        return name
    index, _, module = rest.partition(".")
    return f"layer {index} {module}".strip()


def per_step(records: list[dict], field: str) -> tuple[list[int], list[float]]:
    """Mean of ``field`` per step (micro-batches of one step averaged), None values skipped."""
    acc: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.get(field) is not None:
            acc[int(r["step"])].append(float(r[field]))
    steps = sorted(acc)
    return steps, [sum(acc[s]) / len(acc[s]) for s in steps]


def moving_median(values: list[float], window: int) -> list[float]:
    """The median of each value's window (centred, shorter at the ends)."""
    half = max(window, 1) // 2
    return [statistics.median(values[max(0, i - half): i + half + 1]) for i in range(len(values))]


def plot(sources: list[tuple[list[dict], str]], out: str | Path = DEFAULT_OUT, window: int = 25,
         title: str | None = None) -> Path:
    """Draw the figure from ``(records, label)`` pairs and save it to ``out``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d2, ax_ratio) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10)
    summary, styles, layer_handles = [], {}, []
    for records, label in sources:
        by_layer: dict[str, list[dict]] = defaultdict(list)
        for r in records:
            by_layer[r["layer"]].append(r)
        for layer, recs in by_layer.items():
            name = short_layer(layer)
            name = f"{label} {name}".strip() if len(sources) > 1 else name
            color = next(colors)
            for field, (style, marker) in STYLES.items():
                steps, vals = per_step(recs, field)
                pos = [(s, v) for s, v in zip(steps, vals, strict=True) if v > 0]
                if not pos:
                    continue
                s, v = zip(*pos, strict=True)
                ax_d2.plot(s, v, style, color=color, alpha=0.3, lw=0.8)
                ax_d2.plot(s, moving_median(list(v), window), style, color=color,
                           lw=2.4 if marker else 1.8, marker=marker, markevery=max(1, len(s) // 12),
                           markersize=5, markerfacecolor="white", zorder=3 if marker else 2)
                styles[field] = (style, marker)
            steps, ratio = per_step(recs, "ratio")
            if steps:
                ax_ratio.plot(steps, ratio, color=color, alpha=0.3, lw=0.8)
                ax_ratio.plot(steps, moving_median(ratio, window), color=color, lw=1.8, label=name)
                tail = ratio[len(ratio) // 2:]
                summary.append(f"{name}: median ratio {statistics.median(ratio):.3f} "
                               f"(second half {statistics.median(tail):.3f}, {len(ratio)} steps)")
            layer_handles.append(matplotlib.lines.Line2D([], [], color=color, lw=2, label=name))
    ax_d2.set_yscale("log")
    ax_d2.set_xlabel("training step")
    ax_d2.set_ylabel("variance of the weight gradient\n(squared Frobenius norm, log scale)")
    ax_d2.set_title("$D^2_{SGD}$, $D^2_{RMM}$ and the sketch's own variance")
    style_handles = [matplotlib.lines.Line2D([], [], ls=style, marker=marker, color="dimgray", lw=2,
                                             markerfacecolor="white", label=LABELS[field])
                     for field, (style, marker) in styles.items()]
    ax_d2.legend(handles=style_handles + layer_handles, fontsize=8, ncol=2, loc="upper center",
                 bbox_to_anchor=(0.5, -0.13), title=f"thick: moving median over {window} steps; "
                 "thin: every step", title_fontsize=8)
    ax_ratio.axhline(1.0, color="black", lw=1.2, ls="--",
                     label="1 (the paper's Figure 4 stays near it)")
    ax_ratio.set_xlabel("training step")
    ax_ratio.set_ylabel(r"$\frac{B_{proj}}{B-1}\,D^2_{RMM} / D^2_{SGD}$ (dimensionless)")
    ax_ratio.set_title("normalised ratio (the quantity the paper plots)")
    ax_ratio.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    if title:
        fig.suptitle(title, fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150, metadata={"Software": None})
    plt.close(fig)
    for line in summary:
        print(line)
    return out


def draw(paths: list[str | Path], out: str | Path = DEFAULT_OUT, window: int = 25,
         title: str | None = None) -> Path:
    """The figure from the run files ``paths``, saved to ``out``; the title, unless given, names
    what the first file records (and how many more were drawn). Raises ``OSError`` or
    ``ValueError`` for a file that cannot be read or has no records."""
    runs = [load_run(p) for p in paths]
    if not title:
        title = describe_run(runs[0][2], runs[0][0])
        if len(runs) > 1:
            title += f" (and {len(runs) - 1} more run{'s' if len(runs) > 2 else ''})"
    return plot([(records, label) for records, label, _ in runs], out, window, title)
