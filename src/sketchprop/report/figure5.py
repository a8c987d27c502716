"""Figure 5: the training loss (every logging step) and dev loss (every epoch) on CoLA, one line per
rate, for the exact model and the Gaussian sketch in the paper's layout (seed 1).

Writes ``results/figures/figure5_loss.png``.
"""

from __future__ import annotations

from pathlib import Path

from .common import MODEL_NAMES, pyplot, save_figure, scheme


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
    plt = pyplot()
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
    save_figure(fig, out / "figure5_loss.png")
    plt.close(fig)
