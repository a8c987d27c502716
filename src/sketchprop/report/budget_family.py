"""Pick by budget for a model family: the largest batch of full-length rows each setup fits in a
memory budget, for a family of the architecture matrix at its published shape and depth
(``python scripts/pick_budget.py --family llama``, ``make budget FAMILY=llama``).

Random weights from the family's config (no download: :data:`~sketchprop.bench.families.PUBLISHED`
gives each family's smallest published checkpoint's width and
:data:`~sketchprop.bench.families.PUBLISHED_LAYERS` its depth):

- **fixed part**, counted on the whole model built on the meta device (no memory): 16 bytes per
  trainable parameter, float32 weights, gradients and AdamW's two moments (mixed precision,
  sharding and 8-bit optimizers are not in it);
- **saved bytes per row**, measured: one training forward (``SavedTensorMeter``, no backward) of
  the family at its published width with 2 and with 3 layers, on ``--rows`` full-length rows of
  ``--length`` tokens (ViT: images of the published size). The difference is one layer's bytes,
  the rest the embeddings', the head's and the loss's; a model of ``L`` layers saves ``rest + L x
  layer`` (not from 1 layer: T5's first is not as the others);
- **recompute** (checkpointing only): backward recomputes one layer at a time and holds what
  that layer saves unpatched while it runs, on top;
- **largest batch** = ``(budget - fixed) / (bytes per row + recompute per row)``, rounded down.

Setups: exact, activation checkpointing (HF's, non-reentrant), and the matrix's ``int4``,
``floor4``, ``int4+compact`` and the lean preset with ``patch_linear(bits=4)``. Not in the
estimate: the framework's own memory, backward's short-lived buffers beyond one recomputed
layer, and the step time, which this script does not measure (the architecture matrix's
``--time`` runs time each family: ``scripts/make_tables.py --family``).
"""

from __future__ import annotations

import gc
import math

import torch

from ..bench import architectures as arch
from ..bench import families as fam
from ..bench.common import BadArgs, fmt_table, setup_device

GIB = 2**30
#: The setups of the matrix the budget measures, besides exact and checkpointing.
SETUPS = ("int4", "floor4", "int4+compact", arch.LEAN_FLOOR)
CKPT = "checkpointing"
#: The depths measured: the first layer of some models is not as the others (T5's computes the
#: position bias the others are given, and checkpointed saved less), so two later ones.
DEPTHS = (2, 3)
#: Bytes per trainable parameter: float32 weight, gradient and AdamW's two moments.
FIXED_PER_PARAM = 16


def check(name: str, width: str) -> None:
    """Raise BadArgs naming the choices, before any work."""
    if name not in fam.PUBLISHED:
        raise BadArgs(f"unknown family {name!r}; choose from {', '.join(fam.PUBLISHED)}")
    if width not in ("published", "tiny"):
        raise BadArgs(f"--family-width must be published or tiny, got {width!r}")


def _shape(name: str, width: str) -> tuple[fam.Width, dict, int]:
    """The width, config overrides and depth of ``name``: its published checkpoint's, or (tiny:
    a smoke test) the tiny width at its published depth."""
    _, published, overrides = fam.PUBLISHED[name]
    if width == "tiny":
        return fam.TINY, {}, fam.PUBLISHED_LAYERS[name]
    return published, overrides, fam.PUBLISHED_LAYERS[name]


def _build(name: str, w: fam.Width, overrides: dict, layers: int, length: int):
    return arch.build(name, fam.Width(w.hidden, w.heads, w.mlp, layers, w.vocab), length,
                      overrides)[0]


def parameters(name: str, w: fam.Width, overrides: dict, layers: int, length: int) -> int:
    """Trainable parameters of the whole model (tied weights once), built on the meta device."""
    with torch.device("meta"):
        model = _build(name, w, overrides, layers, length)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _batch(name: str, model, rows: int, length: int) -> dict:
    batch = arch.timing_batch(name, model, length)  # four rows (or images)
    return {k: v[:rows] for k, v in batch.items()}


def saved_per_row(name: str, w: fam.Width, overrides: dict, length: int,
                  rows: int) -> dict[str, tuple[float, float]]:
    """``{setup: (rest, per layer)}``: bytes a training forward saves per row, from models of
    :data:`DEPTHS` layers (module docstring); checkpointing included, where the model supports
    it."""
    out: dict[str, list[float]] = {}
    for layers in DEPTHS:
        model = _build(name, w, overrides, layers, length)
        batch = _batch(name, model, rows, length)
        out.setdefault("exact", []).append(arch.forward_bytes(model, batch) / rows)
        if getattr(model, "supports_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            out.setdefault(CKPT, []).append(arch.forward_bytes(model, batch) / rows)
            model.gradient_checkpointing_disable()
        for setup in SETUPS:
            _, refused = arch.apply_setup(model, setup)
            if not refused:
                out.setdefault(setup, []).append(arch.forward_bytes(model, batch) / rows)
            arch.undo_setup(model, setup, refused)
        del model
        gc.collect()
    return {s: (v[0] - DEPTHS[0] * (v[1] - v[0]), v[1] - v[0]) for s, v in out.items()
            if len(v) == 2}


def plan(saved: dict[str, tuple[float, float]], layers: int, fixed: int, budget: int,
         batch: int) -> list[dict]:
    """One row per setup: bytes per row at ``layers`` layers, the largest batch within
    ``budget`` and whether it reaches ``batch``."""
    rows = []
    exact_layer = saved["exact"][1]
    for setup, (rest, layer) in saved.items():
        per_row = rest + layers * layer + (exact_layer if setup == CKPT else 0.0)
        room = budget - fixed
        largest = max(0, math.floor(room / per_row)) if room > 0 and per_row > 0 else 0
        rows.append({"setup": setup, "per_row": per_row, "largest_batch": largest,
                     "saved_ratio": per_row / (saved["exact"][0] + layers * exact_layer),
                     "memory_at_batch": fixed + batch * per_row, "fits": largest >= batch})
    return rows


def run(args, command: str) -> str:
    """The table for ``scripts/pick_budget.py --family`` (which prints it and writes
    ``--out``)."""
    check(args.family, args.family_width)
    if not (math.isfinite(args.budget_gib) and args.budget_gib > 0) or args.batch < 1 \
            or args.length < 1:
        raise BadArgs("--budget-gib (finite), --batch and --length must be positive")
    if not 1 <= args.rows <= 4:
        raise BadArgs(f"--rows must be 1 to 4 (the matrix's batch has four), got {args.rows}")
    setup_device("cpu", args.threads)
    w, overrides, layers = _shape(args.family, args.family_width)
    params = parameters(args.family, w, overrides, layers, args.length)
    fixed = FIXED_PER_PARAM * params
    saved = saved_per_row(args.family, w, overrides, args.length, args.rows)
    rows = plan(saved, layers, fixed, int(args.budget_gib * GIB), args.batch)
    checkpoint = fam.PUBLISHED[args.family][0]
    shape = arch.shape_of(args.family) if args.family_width == "published" else \
        f"tiny width (hidden {w.hidden}: a smoke test)"
    mib = 2**20
    table = fmt_table(
        ["setup", "per row / exact's", "MiB saved per row", f"largest batch in {args.budget_gib:g} GiB",
         f"GiB at batch {args.batch}", f"fits {args.batch}"],
        [[r["setup"], f"{r['saved_ratio']:.3f}", f"{r['per_row'] / mib:.1f}",
          r["largest_batch"], f"{r['memory_at_batch'] / GIB:.2f}", "yes" if r["fits"] else "no"]
         for r in rows])
    text = "\n".join([
        f"<!-- generated by: {command} -->",
        f"# Pick by budget: {args.family} ({checkpoint}), {args.budget_gib:g} GiB, "
        f"batch {args.batch} x {args.length} tokens", "",
        f"Command: `{command}`", "",
        f"Model: {shape}, {layers} layers, random weights; {params / 1e6:.1f} M trainable "
        f"parameters, so {fixed / GIB:.2f} GiB fixed (float32 weights, gradients and AdamW's two "
        f"moments). Saved bytes measured on {args.rows} full-length row(s) of {args.length} tokens "
        f"with 2 and 3 layers, extrapolated to {layers} (sketchprop.report.budget_family's "
        "docstring); checkpointing adds what one layer saves while backward recomputes it. Step "
        "time is not measured here.", "", table, ""])
    return text
