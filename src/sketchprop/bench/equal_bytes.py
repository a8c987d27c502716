"""Weight-gradient error against stored bits: sketches, b-bit codes of ``X``, and both together.

all-MiniLM-L6-v2 (pretrained, new classifier head, train mode) on ``--batches`` training batch(es)
of 32 examples per task (CoLA, SST-2, MRPC from ``data/glue``; fixed shuffle, at most 128 tokens,
dynamic padding). One exact backward captures every encoder linear layer's input ``X`` and output
gradient ``dY`` on the non-padding rows (as ``skip_padding=True`` stores them); the pooler and the
classifier head are left out. For each layer, with ``G = dY^T X``, the relative error
``E|G_hat - G|^2 / |G|^2`` of each way of storing less than ``X`` in float32 (32 bits per element):

- a sketch at rate ``rho`` (``k = max(16, ceil(rho n))`` of ``n`` rows, as ``patch_linear``):
  ``32 k / n`` bits per element of ``X``; exact closed forms
  (:func:`sketchprop.variance.expected_variance`). ``dct``/``dft`` cost ``O(n^3)`` each, so they
  are computed once per layer at the largest ``k`` and rescaled: every sampling kind's variance is
  ``n (n-k) / (k (n-1))`` times a term free of ``k`` (checked against a direct call on the first
  layer of each task). ``importance`` is not measured here: its probabilities come from a
  gradient-norm estimate learned over training steps, which one captured batch cannot give
  honestly (``importance_variance.md`` measures it against ``blocksrht`` after warm-up passes).
- ``X`` as ``b``-bit codes (``b`` = 8, 4, 2; groups of ``DEFAULT_GROUP`` columns with bfloat16
  ends): :func:`sketchprop.quantize.stored_bits` bits per element (counting the ends of the last,
  padded group where a row is not a whole number of groups); closed form
  :func:`sketchprop.variance.quantized_variance`.
- a sketch's rows ``S^T X`` as ``b``-bit codes (``--combo`` sketches, every rate and width):
  ``stored_bits * k / n`` bits. The rounding is independent of the sketch, so its variance adds to
  the sketch's closed form; given a draw of ``S`` it is ``sum_r |S^T dY|_r^2 row_var_r``
  (``quantize(..., variance=True)``), averaged over ``--draws`` draws.
- the minibatch gradient's own noise, ``D2_SGD / |G|^2`` (:func:`sketchprop.variance.d2_sgd`,
  paper eq. 9): the reference line.

Each number is the mean over the 36 encoder layers of the per-layer ratio (and of the per-layer
stored bits), per task.

**Group size.** A group of ``g`` columns costs ``32/g`` bits per element for its two ends; an extra
bit of code width divides the rounding variance by about 4. So at equal stored bits, group ``g``
is worth ``error x 4^(ends bits)``: the mean over layers (all tasks) of each layer's relative error
times 4 to the power of its ends' bits per element. The chosen group minimises the geometric mean of
that score over the code widths; the script fails (after writing its outputs) when the choice
differs from :data:`sketchprop.quantize.DEFAULT_GROUP`.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import torch

from sketchprop.glue.config import TaskConfig
from sketchprop.glue.data import read_tsv
from sketchprop.layers import DEFAULT_MIN_ROWS
from sketchprop.quantize import DEFAULT_GROUP, quantize
from sketchprop.sketches import SKETCHES, num_proj_rows
from sketchprop.variance import d2_sgd, expected_variance, quantized_variance

from . import sketch_variance as sv
from .common import ROOT, BadArgs, environment, fmt_table, parse_list, setup_device, write_outputs
from .models import build_model, minilm_path

TASKS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC"}
SKETCH_NAMES = ("gaussian", "rademacher", "dct", "dft", "blocksrht", "rowsample")
RESCALED = ("dct", "dft")  # O(n^3) closed forms: one call per layer, rescaled in k
CODE_BITS = (8, 4, 2)
FIGURE = ROOT / "results" / "figures" / "equal_bytes.png"
# Bits per element of budgets in the "best at" table.
BUDGETS = (0.5, 1.0, 2.0, 3.0, 5.0, 9.0)


def task_config(name: str) -> TaskConfig:
    """The task's fields from ``configs/task/<name>.yaml``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "task" / f"{name}.yaml"))
    cfg.pop("defaults", None)
    return TaskConfig(**cfg)


def batches(task: str, args, tokenizer, vocab: int) -> list[dict]:
    """``--batches`` training batches of ``--batch`` examples (random tokens for --quick)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(len(task))
        out = []
        for _ in range(args.batches):
            lengths = torch.randint(4, 24, (args.batch,), generator=g)
            mask = (torch.arange(24)[None, :] < lengths[:, None]).long()
            ids = torch.randint(3, vocab, (args.batch, 24), generator=g).masked_fill(mask == 0, 0)
            out.append({"input_ids": ids, "attention_mask": mask,
                        "labels": torch.randint(0, 2, (args.batch,), generator=g)})
        return out
    cfg = task_config(task)
    data = read_tsv(Path(args.glue_dir) / cfg.dir / "train.tsv", cfg)
    order = list(range(len(data["label"])))
    random.Random(0).shuffle(order)
    out = []
    for b in range(args.batches):
        idx = order[b * args.batch:(b + 1) * args.batch]
        texts = [[data[c][j] for j in idx] for c in cfg.text_columns]
        enc = tokenizer(*texts, truncation=True, max_length=args.max_length, padding=True,
                        return_tensors="pt")
        enc["labels"] = torch.tensor([data["label"][j] for j in idx])
        out.append(dict(enc))
    return out


def ends_bits(cols: int, group: int) -> float:
    """Bits per element the groups' two bfloat16 ends cost on rows of ``cols`` columns."""
    return 32 * math.ceil(cols / group) / cols


def sampling_factor(n: int, k: int) -> float:
    """``n (n-k) / (k (n-1))``: how a sampling kind's variance depends on ``k`` of ``n`` rows."""
    return n * (n - k) / (k * (n - 1))


def group_scores(rel: dict[int, list[float]], cols: list[int]) -> dict[int, float]:
    """``{group: mean over layers of relative error x 4^(ends bits)}`` (the error at equal stored
    bits: a bit of code width divides the rounding variance by about 4)."""
    return {g: statistics.mean(e * 4 ** ends_bits(c, g) for e, c in zip(errs, cols, strict=True))
            for g, errs in rel.items()}


def pick_group(scores: dict[int, dict[int, float]]) -> int:
    """The group with the least geometric mean of its score over the code widths."""
    groups = next(iter(scores.values())).keys()
    return min(groups, key=lambda g: sum(math.log(s[g]) for s in scores.values()))


def measure_layer(x: torch.Tensor, y: torch.Tensor, args, first: bool) -> dict:
    """``{config: {"err": E|G_hat - G|^2, "bits": stored bits per element}}`` of one layer, plus
    the group sweep (``int{b}/g{g}``) and ``minibatch``."""
    n, cols = x.shape
    xty = (y.T @ x).square().sum().item()
    out = {"float32": {"err": 0.0, "bits": 32.0}}
    ks = {rho: num_proj_rows(n, rho, DEFAULT_MIN_ROWS) for rho in args.rhos}
    for name in SKETCH_NAMES:
        if name in RESCALED:
            k0 = max(k for k in ks.values() if k < n)
            v0 = expected_variance(name, x, y, k0)
            vs = {rho: (v0 * sampling_factor(n, k) / sampling_factor(n, k0) if k < n else 0.0)
                  for rho, k in ks.items()}
            if first:  # the rescaling against a direct call
                rho, k = min(ks.items(), key=lambda kv: kv[1])
                direct = expected_variance(name, x, y, k)
                if not math.isclose(vs[rho], direct, rel_tol=1e-9, abs_tol=1e-12 * xty):
                    raise AssertionError(f"{name}: rescaled {vs[rho]} != direct {direct}")
        else:
            vs = {rho: expected_variance(name, x, y, k) for rho, k in ks.items()}
        for rho, k in ks.items():
            out[f"{name}@{rho:g}"] = {"err": vs[rho], "bits": 32 * k / n}
    x32, y32 = x.float(), y.float()  # the rows as the layer stores them
    for g in args.groups:
        for b in CODE_BITS:
            out[f"int{b}/g{g}"] = {"err": quantized_variance(x32, y32, b, g),
                                   "bits": b + ends_bits(cols, g)}
    for b in CODE_BITS:
        out[f"int{b}"] = dict(out[f"int{b}/g{DEFAULT_GROUP}"])
    for name in args.combo:
        sk = SKETCHES[name]
        for rho, k in ks.items():
            rounding = {b: [] for b in CODE_BITS}
            for d in range(args.draws):
                seed = 7919 * d + 17
                sx, sdy = sk.apply(x, k, seed), sk.apply(y, k, seed)
                sq = sdy.square().sum(1)
                for b in CODE_BITS:
                    _, _, row_var = quantize(sx, b, DEFAULT_GROUP, seed, variance=True)
                    rounding[b].append((sq * row_var.double()).sum().item())
            for b in CODE_BITS:
                r = rounding[b]
                out[f"{name}@{rho:g}+int{b}"] = {
                    "err": out[f"{name}@{rho:g}"]["err"] + statistics.mean(r),
                    "rounding": statistics.mean(r),
                    "rounding_se": statistics.stdev(r) / math.sqrt(len(r)) if len(r) > 1 else None,
                    "bits": (b + ends_bits(cols, DEFAULT_GROUP)) * k / n,
                }
    out["minibatch"] = {"err": d2_sgd(x, y), "bits": None}
    for v in out.values():
        v["rel_err"] = v["err"] / xty
    return out


def family(config: str) -> str:
    """The curve a configuration belongs to (a sketch, ``int``, ``<sketch>+int<b>``...)."""
    if config in ("float32", "minibatch"):
        return config
    if "/g" in config:
        return "group sweep"
    if "+int" in config:
        return config.split("@")[0] + "+int" + config.split("+int")[1]
    if config.startswith("int"):
        return "int"
    return config.split("@")[0]


def summarize(layers: dict[str, dict]) -> dict:
    """Per configuration: its family and the means over layers of its error and stored bits."""
    configs = next(iter(layers.values())).keys()
    out = {}
    for c in configs:
        rel = [layers[n][c]["rel_err"] for n in layers]
        bits = [layers[n][c]["bits"] for n in layers]
        out[c] = {"family": family(c), "rel_err": statistics.mean(rel),
                  "bits": statistics.mean(bits) if bits[0] is not None else None}
    return out


def best_at(summary: dict, budget: float, fam: str) -> str | None:
    """The configuration of kind ``fam`` with the least error at or under ``budget`` bits."""
    def kind(c):
        f = summary[c]["family"]
        if f == "int":
            return "bits"
        if "+int" in f:
            return "sketch+bits"
        return "sketch" if f in SKETCH_NAMES else None

    pool = [c for c in summary if kind(c) == fam and summary[c]["bits"] <= budget + 1e-9]
    return min(pool, key=lambda c: summary[c]["rel_err"]) if pool else None


def tables(payload: dict) -> str:
    """The markdown tables: per task, then the group sweep and the chosen group."""
    out = []
    g = payload["default_group"]
    for task, res in payload["tasks"].items():
        s = res["summary"]
        head = f"{task} ({res['rows']} rows of {res['batches']} batch(es), {len(res['layers'])} layers)"
        rows = [["float32 X (exact)", "32", "0"]]
        rows += [[f"int{b} X (group {g})", f"{s[f'int{b}']['bits']:.3g}", f"{s[f'int{b}']['rel_err']:.3g}"]
                 for b in CODE_BITS]
        rows.append(["minibatch noise D2_SGD / |G|^2", "-", f"{s['minibatch']['rel_err']:.3g}"])
        out.append(fmt_table(["stored", "bits / element", "rel. error"], rows,
                             title=f"{head}: b-bit X and the minibatch's own noise"))
        rhos = payload["rhos"]
        rows = []
        for name in SKETCH_NAMES:
            rows.append([name] + [f"{s[f'{name}@{r:g}']['rel_err']:.3g}" for r in rhos])
        for name in payload["combo_sketches"]:
            for b in CODE_BITS:
                rows.append([f"{name} + int{b}"] + [f"{s[f'{name}@{r:g}+int{b}']['rel_err']:.3g}"
                                                    for r in rhos])
        bits_row = ["bits / element: sketch (+ intb)"] + [
            f"{s[f'blocksrht@{r:g}']['bits']:.3g} (" + ", ".join(
                f"{s[f'blocksrht@{r:g}+int{b}']['bits']:.2g}" for b in CODE_BITS) + ")"
            for r in rhos]
        out.append(fmt_table(["relative error"] + [f"rho {r:g}" for r in rhos],
                             rows + [bits_row],
                             title=f"{head}: sketches, alone and with b-bit rows"))
        rows = []
        for budget in BUDGETS:
            row = [f"<= {budget:g}"]
            for fam in ("sketch", "bits", "sketch+bits"):
                c = best_at(s, budget, fam)
                row.append("-" if c is None else
                           f"{c} ({s[c]['bits']:.3g} bits): {s[c]['rel_err']:.3g}")
            rows.append(row)
        out.append(fmt_table(["bits / element", "best sketch", "best b-bit X", "best sketch + b-bit"],
                             rows, title=f"{head}: the least error at or under a budget"))
    gs = payload["group_sweep"]
    rows = [[f"int{b}"] + [f"{gs['score'][str(b)][str(g)]:.4g}" for g in payload["groups"]]
            + [str(gs["best_by_bits"][str(b)])] for b in CODE_BITS]
    out.append(fmt_table(["code", *[f"group {g}" for g in payload["groups"]], "least"], rows,
                         title="Group size: mean relative error x 4^(ends bits per element), "
                                  "all layers of all tasks (lower is better at equal stored bits)"))
    out.append(f"Chosen group (least geometric mean over code widths): **{gs['chosen']}**; "
               f"`sketchprop.quantize.DEFAULT_GROUP` = {DEFAULT_GROUP}.")
    return "\n\n".join(out) + "\n"


def figure(payload: dict, path: Path) -> None:
    """Error against stored bits, one panel per task, drawn to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = payload["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.6), sharey=True,
                             squeeze=False)
    colors = dict(zip(SKETCH_NAMES, plt.get_cmap("tab10").colors, strict=False))
    styles = {8: (":", "^"), 4: ("--", "s"), 2: ("-.", "v")}
    handles = {}
    for ax, (task, res) in zip(axes[0], tasks.items(), strict=True):
        s = res["summary"]
        rhos = payload["rhos"]
        for i, name in enumerate(SKETCH_NAMES):
            pts = [s[f"{name}@{r:g}"] for r in rhos]
            # Wide to narrow, so that sketches whose curves coincide all stay visible.
            (h,) = ax.plot([p["bits"] for p in pts], [p["rel_err"] for p in pts], "o-",
                           color=colors[name], ms=7 - i, lw=4.5 - 0.6 * i, alpha=0.85,
                           label=f"{name}")
            handles.setdefault(h.get_label(), h)
        for name in payload["combo_sketches"]:
            for b in CODE_BITS:
                ls, mk = styles[b]
                pts = [s[f"{name}@{r:g}+int{b}"] for r in rhos]
                (h,) = ax.plot([p["bits"] for p in pts], [p["rel_err"] for p in pts], ls,
                               marker=mk, color=colors[name], ms=4, lw=1.1,
                               label=f"{name} + int{b} rows")
                handles.setdefault(h.get_label(), h)
        pts = [s[f"int{b}"] for b in CODE_BITS]
        (h,) = ax.plot([p["bits"] for p in pts], [p["rel_err"] for p in pts], "D-", color="black",
                       ms=6, lw=2, label=f"int8/4/2 X alone (group {payload['default_group']})")
        handles.setdefault(h.get_label(), h)
        for p, b in zip(pts, CODE_BITS, strict=True):
            ax.annotate(f"int{b}", (p["bits"], p["rel_err"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        h = ax.axhline(s["minibatch"]["rel_err"], color="gray", lw=1.5,
                       label="minibatch noise D2_SGD / |G|^2")
        handles.setdefault(h.get_label(), h)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per element of X (float32 = 32)")
        ax.set_title(f"{task} ({res['rows']} rows)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("E|G_hat - G|^2 / |G|^2 (mean over layers)")
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=4,
               fontsize=8.5, frameon=False, bbox_to_anchor=(0.5, -0.02),
               title="sketches at rho " + ", ".join(f"{r:g}" for r in payload["rhos"])
               + " (left to right); gaussian ~ rademacher and dct ~ dft ~ blocksrht overlap",
               title_fontsize=8.5)
    model = "tiny random BERT (--quick)" if payload["args"]["quick"] else "all-MiniLM-L6-v2"
    n = payload["args"]["batches"]
    fig.suptitle(f"Weight-gradient error against stored bits, {model}, {n} training batch"
                 f"{'es' if n > 1 else ''} of {payload['args']['batch']} per task", fontsize=11)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path}")


def run(args) -> None:
    """The study as ``scripts/equal_bytes.py`` runs it (its options in ``args``): write
    ``equal_bytes[_quick].{json,md}`` and the figure, print the tables; or, with ``args.replot``,
    only draw the figure from an earlier run's JSON file. Bad options raise :class:`BadArgs`
    before any work."""
    if args.replot:
        figure(json.loads(Path(args.replot).read_text()), Path(args.figure or FIGURE))
        return
    tasks = parse_list(args.tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise BadArgs(f"unknown task(s) {bad}; choose from {list(TASKS)}")
    args.rhos = parse_list(args.rhos, float)
    if not args.rhos or not all(0 < r <= 1 for r in args.rhos):
        raise BadArgs(f"--rhos must be rates in (0, 1], got {args.rhos}")
    args.groups = parse_list(args.groups, int)
    args.combo = parse_list(args.combo)
    bad = [s for s in args.combo if s not in SKETCH_NAMES]
    if bad:
        raise BadArgs(f"--combo: unknown sketch(es) {bad}; choose from {list(SKETCH_NAMES)}")
    if DEFAULT_GROUP not in args.groups:
        raise BadArgs(f"--groups must include DEFAULT_GROUP={DEFAULT_GROUP}, got {args.groups}")
    if args.quick:
        args.batch, args.draws = 4, 3
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    print(env, flush=True)
    model = build_model("minilm", args.quick).train()
    tokenizer = None
    if not args.quick:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    results = {}
    sweep_rel = {b: {g: [] for g in args.groups} for b in CODE_BITS}
    sweep_cols = []
    for task in tasks:
        layers, rows = {}, 0
        for j, batch in enumerate(batches(task, args, tokenizer, model.config.vocab_size)):
            torch.manual_seed(j)  # dropout
            for i, (name, x, y) in enumerate(sv.capture(model, batch)):
                layer = f"batch{j}/{name}"
                layers[layer] = measure_layer(x, y, args, first=(i == 0 and j == 0))
                rows += x.shape[0] if i == 0 else 0
                sweep_cols.append(x.shape[1])
                for b in CODE_BITS:
                    for g in args.groups:
                        sweep_rel[b][g].append(layers[layer][f"int{b}/g{g}"]["rel_err"])
            print(f"{task} batch {j}: {len(layers)} layers", flush=True)
        summary = summarize(layers)
        results[TASKS[task]] = {"batches": args.batches, "rows": rows, "summary": summary,
                                "layers": layers}
        print(f"{task}: int8/4/2 " + ", ".join(f"{summary[f'int{b}']['rel_err']:.3g}"
                                               for b in CODE_BITS)
              + f"; minibatch {summary['minibatch']['rel_err']:.3g}", flush=True)
    scores = {b: group_scores(sweep_rel[b], sweep_cols) for b in CODE_BITS}
    chosen = pick_group(scores)
    payload = {
        "environment": env, "args": vars(args), "rhos": args.rhos, "groups": args.groups,
        "combo_sketches": args.combo, "default_group": DEFAULT_GROUP,
        "averaging": "mean over layers of the per-layer ratio E|G_hat - G|^2 / |G|^2 (and of the "
                     "per-layer stored bits per element)",
        "importance": "not measured: its sampling probabilities need a gradient-norm estimate "
                      "learned over training steps (see importance_variance.md)",
        "tasks": results, "chosen_group": chosen,
        "group_sweep": {
            "score": {str(b): {str(g): v for g, v in s.items()} for b, s in scores.items()},
            "best_by_bits": {str(b): min(s, key=s.get) for b, s in scores.items()},
            "chosen": chosen,
        },
    }
    text = tables(payload)
    write_outputs("equal_bytes" + ("_quick" if args.quick else ""), payload, text, args.out_dir)
    print(text)
    fig_path = args.figure or (None if args.quick else str(FIGURE))
    if fig_path:
        figure(payload, Path(fig_path))
    print(f"group: chosen {chosen}, DEFAULT_GROUP {DEFAULT_GROUP}")
    if not args.quick and chosen != DEFAULT_GROUP:
        raise SystemExit(f"the measured group {chosen} differs from sketchprop.quantize."
                         f"DEFAULT_GROUP = {DEFAULT_GROUP}: change the default or the rule")
