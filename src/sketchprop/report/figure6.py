"""Figure 6: throughput relative to exact from the controlled benchmark (``results/bench``), never
from the training runs: one linear layer per sketch and rate, and a training step of MiniLM and
roberta-base per method and rate, with exact with padding rows skipped (the fair baseline of our
layout on padded rows) as a line where the benchmark timed it, and the rows it timed in the title.

Writes ``results/figures/figure6_throughput.png``.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    BENCH_LAYER,
    MODEL_NAMES,
    RATES,
    SKETCH_ORDER,
    bench_layer_ratios,
    bench_step_ratios,
    pyplot,
    rows_text,
    save_figure,
)


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
    plt = pyplot()
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
    rows = rows_text(models[0][1]["_info"]) if models else ""
    fig.suptitle("Figure 6 analogue: throughput relative to exact, from the controlled CPU benchmark "
                 f"({device}; one process, interleaved with the baseline; median and "
                 f"interquartile range),\nnot from the training runs; {rows}; above 1 is faster; "
                 "exact multiplies its padding rows, exact with padding skipped does not",
                 fontsize=10)
    save_figure(fig, out / "figure6_throughput.png")
    plt.close(fig)
