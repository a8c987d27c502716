"""Figure 3: saved-activation memory (and, where measured, the peak of a training step) against
batch size per rate for roberta-base at real CoLA lengths: the paper's layout, ours, ours with
compact activations (and compact activations alone), and checkpointing. Read from the ``figure3``
point files of ``scripts/memory_table.py`` (``results/memory``), Table 3's point of the same task
extending the curve.

Writes ``results/figures/figure3_memory.png``.
"""

from __future__ import annotations

from pathlib import Path

from .common import TASK_NAMES, load_memory, peak, pyplot, save_figure


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
    kinds = sorted({p["exact"]["peak_memory"]["kind"] for p in pts if peak(p["exact"])})
    cpu = any("RSS" in k for k in kinds)
    rows = [("saved activations (GiB, log scale)\ndevice-independent", pts,
             lambda rec: rec.get("saved_activation_bytes"), "log")]
    peak_pts = [p for p in pts if peak(p["exact"]) is not None]
    if peak_pts:
        rows.append((("peak RSS of one training step (GiB)\nCPU process: weights, grads, AdamW "
                      "incl." if cpu else "peak CUDA memory of one training step (GiB)"),
                     peak_pts, peak, "linear"))
    with_ckpt = all(p.get("ckpt") and p.get("ckpt+ours") for p in pts)
    columns = [("paper", "paper's layout (Gaussian)"), ("ours", "our layout (blocksrht)")]
    if all(p.get("ours+compact") for p in pts):
        columns.append(("ours+compact", "ours + compact activations"))
    if with_ckpt:
        columns.append(("ckpt+ours", "activation checkpointing (+ ours)"))
    with_compact_ckpt = with_ckpt and all(p.get("ckpt+ours+compact") for p in pts)
    plt = pyplot()
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
    save_figure(fig, out / "figure3_memory.png")
    plt.close(fig)
