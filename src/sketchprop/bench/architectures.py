"""Every family, every setup: what backward keeps, and the gradient error it costs.

Each family of :mod:`sketchprop.bench.families` (BERT to ViT, seventeen), built in code from a
config with random weights (no download) at a width (``--width``: ``tiny``, hidden 64, or
``wide``, hidden 384 with 12 heads and MLP 1536: several code groups a row), 2 layers, dropout
off, on one batch padded on the right; and a small conv net, a model with no transformer in it,
that no part of the library was written for. Each is patched by every setup of :data:`SETUPS`
(``patch_linear(bits=4)``, the generic floor alone at 8/4/2 bits, the compact and lean presets,
their combinations) with every other argument at its default. Per family and setup:

- the bytes one training forward saves for backward over exact's (``SavedTensorMeter``: each
  storage once, parameters excluded; codes counted as they are kept);
- the gradient error: ``||g - g_exact||^2 / ||g_exact||^2`` over every parameter, the mean over
  ``--steps`` steps (each draws its own rounding), ``g_exact`` the unpatched model's gradient on
  the same batch;
- the bias: ``||mean of the steps' g - g_exact||^2 / ||g_exact||^2`` over what the mean of
  ``n`` unbiased draws gives on average (``error / n``): about 1 for an unbiased estimate (its
  spread with few steps is wide, chi-squared-like), well above 1 where a bias dominates, at
  most ``n`` (the error all bias); none where the steps agree (a deterministic error: an exact
  part's float rounding);
- every parameter that has a gradient unpatched has one patched (``lost``: the count that do not);
- the parts applied and those left, with their reasons (``patch_activations``' own log line;
  ``patch_linear``'s layers patched of the model's linear layers);
- that unpatching gives back the model: after ``unpatch_activations`` and ``unpatch_linear``, a
  training step bitwise equal (loss and every gradient) to the unpatched model's.

With ``--time``, each family's step time (forward and backward) on full-length rows of
``--time-length`` tokens (4 rows; ViT: 4 images of about as many patches; the conv net's batch
as above): exact, activation
checkpointing (transformers' ``gradient_checkpointing_enable``, non-reentrant; none for the conv
net) and the setups of ``--time-setups``, each model with the family's fastest exact attention
(SDPA where transformers has it for the family, else eager:
:func:`~sketchprop.bench.families.fastest_attention`), interleaved round-robin and each sample divided by the
exact steps that bracket it (:func:`~sketchprop.bench.common.interleaved_times`), so the ratios
hold under a drifting load; the saved bytes of the same batch beside them.

A setup's GELU code applies where the model has a GELU (elsewhere the setup is the same without
it). A setup a model has nothing for (``patch_activations`` raises "nothing to patch") shows as a
dash with its reason.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from sketchprop import patch_activations, patch_linear, unpatch_activations, unpatch_linear
from sketchprop.measure import SavedTensorMeter
from sketchprop.patching import PARTS_OFF
from sketchprop.patching.linear import _is_linear

from . import families as fam
from .common import (
    LEAN_PARTS,
    environment,
    fmt_table,
    for_model,
    interleaved_times,
    parse_list,
    ratio_stats,
    setup_device,
    write_outputs,
)

#: Every part of ``patch_activations`` off but the floor: the floor alone.
_FLOOR_ALONE = {k: v for k, v in PARTS_OFF.items() if k != "floor_bits"}

#: ``patch_linear(bits=4)``: the default (the paper's Gaussian) sketch, its rows as 4-bit codes.
_INT4 = {"bits": 4}
#: Setup name: (``patch_linear``'s arguments or None, ``patch_activations``' arguments or None).
SETUPS: dict[str, tuple[dict | None, dict | None]] = {
    "int4": (_INT4, None),
    "floor8": (None, {**_FLOOR_ALONE, "floor_bits": 8}),
    "floor4": (None, {**_FLOOR_ALONE, "floor_bits": 4}),
    "floor2": (None, {**_FLOOR_ALONE, "floor_bits": 2}),
    "compact": (None, {}),
    "int4+compact": (_INT4, {}),
    # lean, as the other tables name it: its structural parts, the 2-bit GELU code, no floor
    "lean": (None, LEAN_PARTS),
    "int4+lean": (_INT4, LEAN_PARTS),
    "int4+lean+floor8": (_INT4, {**LEAN_PARTS, "floor_bits": 8}),
    "int4+lean+floor4": (_INT4, {**LEAN_PARTS, "floor_bits": 4}),
    # lean less its GELU code: GELU's input left to the floor's 4-bit code, not lean's 2-bit
    # code of GELU's derivative
    "int4+lean-gelu+floor4": (_INT4, {**LEAN_PARTS, "floor_bits": 4, "gelu_bits": None}),
    # the lean preset as it is (patch_activations(preset="lean")): a 4-bit code of GELU's
    # derivative, as many bits as the floor's code of its input, and the floor at 4 bits
    "int4+lean(gelu4)+floor4": (_INT4, {"preset": "lean"}),
    # the same with the sketch recommended on a CPU (results/bench/README.md): the same rows
    # and bytes, the Hadamard transform within blocks of 8 rows in place of a dense Gaussian
    "int4(blocksrht)+lean(gelu4)+floor4": ({**_INT4, "sketch": "blocksrht"}, {"preset": "lean"}),
    # exact, its linear layers keeping their inputs' non-padding rows only: the saving of padded
    # rows that exact can take too, the baseline of a padded batch (--real)
    "exact-skip": ({"sketch": "exact", "rho": 1.0}, None),
}
#: Row lengths of a padded batch (``--real r``): ``r`` times these of the longest row, 4 rows;
#: their mean is ``r``.
REAL_SPREAD = (1.75, 1.25, 0.75, 0.25)
#: The setup the measurements picked for lean with the floor, the lean preset's defaults
#: (docs/library.md, "The generic floor").
LEAN_FLOOR = "int4+lean(gelu4)+floor4"
#: The same with the sketch recommended on a CPU.
LEAN_FLOOR_SRHT = "int4(blocksrht)+lean(gelu4)+floor4"
WIDTHS = {"tiny": fam.TINY, "wide": fam.WIDE}
#: The setups measured at the published widths (``--width published``), where each forward takes
#: up to a minute: int4 and the floor alone, lean without and with the floor, the preset.
PUBLISHED_SETUPS = ("int4", "floor4", "int4+lean", "int4+lean+floor4", LEAN_FLOOR)
CONV = "convnet"


class ConvNet(nn.Module):
    """A small image classifier with no transformer in it: convolutions, batch norm, ReLU, SiLU,
    max-pooling, GELU and a linear head; its forward returns its loss, as a transformers model's
    does."""

    def __init__(self, width: int):
        super().__init__()
        c = width // 4
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, 2 * c, 3, padding=1), nn.SiLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.GELU())
        self.head = nn.Linear(2 * c * 16 * 16, 10)

    def forward(self, pixel_values, labels):
        logits = self.head(self.body(pixel_values).flatten(1))
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits, labels), logits=logits)


def build(name: str, width: fam.Width, positions: int | None = None,
          overrides: dict | None = None, attention: str = "eager") -> tuple[nn.Module, dict]:
    """Family ``name`` (or the conv net) at ``width`` (config ``overrides`` on top) and its batch;
    ``positions``: room for rows of that many tokens where the config sets a maximum (RoBERTa's
    positions start after its padding index); ``attention``: the transformers model's attention
    implementation."""
    if name == CONV:
        torch.manual_seed(0)
        model = ConvNet(width.hidden).train()
        g = torch.Generator().manual_seed(0)
        return model, {"pixel_values": torch.randn(8, 3, 32, 32, generator=g),
                       "labels": torch.randint(0, 10, (8,), generator=g)}
    room = dict(overrides or {})
    if positions is not None:
        config = fam.config_of(name, width, **room)
        room.update({k: positions + 2 for k in ("max_position_embeddings", "n_positions")
                     if getattr(config, k, None) is not None})
        if fam.FAMILIES[name].kind == "image":  # images of about ``positions`` patches
            room["image_size"] = config.patch_size * math.isqrt(positions)
    model = fam.build(name, width, attention=attention, **room)
    return model, fam.make_batch(name, model)


def grads(model: nn.Module, batch: dict, meter: bool = False) -> tuple[dict, torch.Tensor, int]:
    """One training step's gradients, its loss and (``meter``) the bytes its forward saved."""
    model.zero_grad(set_to_none=True)
    saved = 0
    if meter:
        with SavedTensorMeter(model) as m:
            loss = model(**batch).loss
        saved = m.bytes
    else:
        loss = model(**batch).loss
    loss.backward()
    return ({n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}, loss.detach(), saved)


def flat(g: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([g[n].double().flatten() for n in names])


class _Lines(logging.Handler):
    """The log lines of ``sketchprop.patching`` while a setup is patched."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@dataclass
class Cell:
    """One family under one setup."""

    setup: str
    saved_ratio: float | None = None
    error: float | None = None
    bias_ratio: float | None = None
    lost: int = 0
    linear_patched: str = ""
    parts: str = ""
    refused: str = ""
    round_trip_exact: bool | None = None
    seconds: float = 0.0


@dataclass
class Row:
    """One family under every setup."""

    family: str
    model: str
    saved_bytes_exact: int
    cells: list = field(default_factory=list)


def apply_setup(model: nn.Module, setup: str) -> tuple[str, str]:
    """Patch ``model`` by ``setup`` (its GELU code only where the model has a GELU): the linear
    layers patched of the model's (``"k of n"``, or ``""``), and ``patch_activations``' refusal
    where nothing of it applies (else ``""``)."""
    linear_args, activations = SETUPS[setup]
    linear = ""
    if linear_args is not None:
        count = sum(_is_linear(m) for m in model.modules())
        linear = f"{len(patch_linear(model, **linear_args))} of {count}"
    if activations is not None:
        try:
            patch_activations(model, **for_model(model, activations))
        except ValueError as err:
            if "nothing to patch" not in str(err):
                raise
            return linear, str(err)
    return linear, ""


def undo_setup(model: nn.Module, setup: str, refused: str) -> None:
    """Put back what :func:`apply_setup` of ``setup`` patched (``refused``: its refusal)."""
    if SETUPS[setup][1] is not None and not refused:
        unpatch_activations(model)
    if SETUPS[setup][0] is not None:
        unpatch_linear(model)


def patch_logged(model: nn.Module, cell: Cell) -> None:
    """:func:`apply_setup` of ``cell.setup`` on ``model``, its outcome and ``patch_activations``'
    log line (the parts applied and left) into ``cell``."""
    handler, log = _Lines(), logging.getLogger("sketchprop.patching")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        cell.linear_patched, cell.refused = apply_setup(model, cell.setup)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    cell.parts = "; ".join(line.split("): ", 1)[-1] for line in handler.lines
                           if line.startswith("patch_activations("))


def measure_setup(name: str, width: fam.Width, setup: str, steps: int, exact: tuple) -> Cell:
    """Family ``name`` patched by ``setup``: its cell (module docstring)."""
    ref, ref_loss, exact_bytes = exact
    cell = Cell(setup)
    start = time.perf_counter()
    model, batch = build(name, width)
    patch_logged(model, cell)
    if cell.refused:
        return cell
    names = list(ref)
    exact_flat = flat(ref, names)
    norm = float(exact_flat.pow(2).sum())
    total, errors = torch.zeros_like(exact_flat), []
    for step in range(steps):
        g, _, saved = grads(model, batch, meter=step == 0)
        if step == 0:
            cell.saved_ratio = saved / exact_bytes
            cell.lost = sum(n not in g for n in names)
        g = {n: g.get(n, torch.zeros_like(ref[n])) for n in names}
        gf = flat(g, names)
        total += gf
        errors.append(float((gf - exact_flat).pow(2).sum()) / norm)
    cell.error = sum(errors) / steps
    bias = float((total / steps - exact_flat).pow(2).sum()) / norm
    # error = bias + spread: where the steps agree (spread under a thousandth of the error: an
    # exact part's float rounding, the same every step), the ratio is its cap, steps, and says
    # nothing about a draw: none
    spread = cell.error - bias
    cell.bias_ratio = (bias / (cell.error / steps) if cell.error > 0 and spread > 1e-3 * cell.error
                       else None)
    undo_setup(model, setup, cell.refused)
    back, loss, _ = grads(model, batch)
    cell.round_trip_exact = torch.equal(loss, ref_loss) and back.keys() == ref.keys() and all(
        torch.equal(back[n], ref[n]) for n in ref)
    cell.seconds = time.perf_counter() - start
    return cell


def measure(name: str, width: fam.Width, setups: list[str], steps: int) -> Row:
    """One family under ``setups``: its row."""
    model, batch = build(name, width)
    ref, loss, _ = grads(model, batch)
    _, _, exact_bytes = grads(model, batch, meter=True)
    row = Row(name, type(model).__name__, exact_bytes)
    for setup in setups:
        row.cells.append(asdict(measure_setup(name, width, setup, steps, (ref, loss, exact_bytes))))
    return row


def forward_bytes(model: nn.Module, batch: dict) -> int:
    """The bytes one training forward saves for backward (no backward: the graph is dropped)."""
    with SavedTensorMeter(model) as meter:
        loss = model(**batch).loss
    del loss
    return meter.bytes


def measure_published(name: str, setups: list[str], length: int, real: float = 1.0) -> Row:
    """Family ``name`` at its published width (:data:`~sketchprop.bench.families.PUBLISHED`) on
    four rows of ``length`` tokens, full-length or (``real`` below 1) that share of them real,
    padded on the right (:func:`timing_batch`): each setup's saved bytes over exact's and its
    parts, from one training forward each (no backward: at these widths a step takes minutes on
    a CPU, and a Mixtral slice's weights and gradients would not fit its memory). One model,
    patched and unpatched in turn."""
    _, width, overrides = fam.PUBLISHED[name]
    model, _ = build(name, width, length, overrides)
    batch = timing_batch(name, model, length, real)
    row = Row(name, type(model).__name__, forward_bytes(model, batch))
    for setup in setups:
        cell, start = Cell(setup), time.perf_counter()
        patch_logged(model, cell)
        if not cell.refused:
            cell.saved_ratio = forward_bytes(model, batch) / row.saved_bytes_exact
        undo_setup(model, setup, cell.refused)
        cell.seconds = time.perf_counter() - start
        row.cells.append(asdict(cell))
    return row


def timing_batch(name: str, model: nn.Module, length: int, real: float = 1.0) -> dict:
    """Four full-length rows of ``length`` tokens (no padding: exact skips nothing that a saving
    could), with the family's target; with ``real`` below 1, rows of ``real`` times
    :data:`REAL_SPREAD` of ``length`` tokens (0.4: 70%, 50%, 30% and 10% of it; ``real`` of the
    tokens in all), padded on the right, the padding's targets ignored. Four images of about
    ``length`` patches for ViT (the model built for them; no padding), the conv net's batch as
    for the matrix."""
    if name == CONV or fam.FAMILIES[name].kind == "image":
        return build(name, fam.TINY)[1] if name == CONV else fam.make_batch(name, model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, length), generator=g)
    lengths = torch.tensor([length if real == 1 else max(1, round(length * real * f))
                            for f in REAL_SPREAD])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = ids.masked_fill(mask == 0, pad)
    data = {"input_ids": ids, "attention_mask": mask}
    kind = fam.FAMILIES[name].kind
    if kind == "classify":
        data["labels"] = torch.randint(0, model.config.num_labels, (4,), generator=g)
    elif kind == "seq2seq":
        labels = torch.randint(3, model.config.vocab_size, (4, length // 2), generator=g)
        data["labels"] = labels.masked_fill(
            torch.arange(length // 2)[None, :] >= (lengths[:, None] + 1) // 2, -100)
    else:
        data["labels"] = ids.masked_fill(mask == 0, -100)
    return data


def time_family(name: str, width: fam.Width, setups: list[str], length: int, repeats: int,
                dev: torch.device) -> dict:
    """Family ``name``'s step time under exact, checkpointing and ``setups`` (module docstring):
    ``{method: {"median_s", "ratio", ..., "saved_ratio"}}``."""
    models = {}
    # Every model with the family's fastest exact attention (SDPA where it has it): the speed of
    # fused attention kernels is not a saving of the setups, exact and checkpointing take it too.
    attention = "eager" if name == CONV else fam.fastest_attention(name)
    exact, _ = build(name, width, length, attention=attention)
    models["exact"] = exact
    if getattr(exact, "supports_gradient_checkpointing", False):
        ckpt, _ = build(name, width, length, attention=attention)
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        models["checkpointing"] = ckpt
    for setup in setups:
        model, _ = build(name, width, length, attention=attention)
        if apply_setup(model, setup)[1]:  # refused as in the matrix: not timed
            continue
        models[setup] = model
    batch = timing_batch(name, exact, length)

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
        return run

    saved = {m: grads(model, batch, meter=True)[2] for m, model in models.items()}
    stats = ratio_stats(interleaved_times({m: step(model) for m, model in models.items()}, dev,
                                          warmup=1, repeats=repeats), "exact")
    for m in stats:
        stats[m]["saved_ratio"] = saved[m] / saved["exact"]
    stats["exact"]["attention"] = attention
    return stats


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def tables(payload: dict) -> str:
    """The markdown tables: saved bytes, gradient error, bias, and each family's parts."""
    a, rows = payload["args"], payload["results"]
    setups = [c["setup"] for c in rows[0]["cells"]]
    w = payload["width"]
    published = payload.get("published")  # family: its checkpoint and shape (--width published)
    real = a.get("real", 1.0)
    if published:
        rows_are = (f"4 x {a['time_length']} full-length tokens" if real == 1 else
                    f"4 rows of {a['time_length']} tokens, {real:.0%} of them real (rows of "
                    + ", ".join(f"{real * f:.0%}" for f in REAL_SPREAD)
                    + ", padded on the right)")
        where = (f"each family at its published width (below), random weights, {w['layers']} "
                 f"layers, {rows_are} (ViT: 4 images of about as many patches, no padding); one "
                 f"training forward per setup")
    else:
        where = (f"random weights, hidden {w['hidden']}, {w['heads']} heads, MLP {w['mlp']}, "
                 f"{w['layers']} layers, batch 4 x 48 tokens padded on the right (the conv net: "
                 f"8 images 32 x 32); {a['steps']} steps per setup")
    out = []

    def cell_table(title, value):
        lines = [[r["family"], *(("-" if c["refused"] else value(c)) for c in r["cells"])]
                 for r in rows]
        out.append(fmt_table(["family", *setups], lines, title=f"{title}; {where}"))

    cell_table("Saved bytes over exact's", lambda c: _fmt(c["saved_ratio"], ".3f"))
    if "exact-skip" in setups:  # over the baseline that skips the padding's rows too
        lines = []
        for r in rows:
            cells = {c["setup"]: c for c in r["cells"]}
            skip = cells["exact-skip"]["saved_ratio"]
            lines.append([r["family"], *("-" if c["refused"] or skip is None or
                                         c["saved_ratio"] is None else
                                         f"{c['saved_ratio'] / skip:.3f}"
                                         for c in r["cells"] if c["setup"] != "exact-skip")])
        out.append(fmt_table(
            ["family", *(s for s in setups if s != "exact-skip")], lines,
            title=f"Saved bytes over exact-skip's (exact, its linear layers keeping their "
                  f"inputs' non-padding rows only); {where}"))
    if not published:
        cell_table("Gradient error ||g - g_exact||^2 / ||g_exact||^2 (mean over the steps)",
                   lambda c: _fmt(c["error"], ".1e"))
        cell_table("Bias: ||mean g - g_exact||^2 over error / steps (about 1: unbiased; well "
                   "above: a bias dominates; at most the steps, where the error is all bias; a "
                   "dash where the steps agree, a deterministic error)",
                   lambda c: _fmt(c["bias_ratio"], ".1f"))
    lines = []
    for r in rows:
        cells = {c["setup"]: c for c in r["cells"]}
        lean, int4 = cells.get(LEAN_FLOOR) or r["cells"][-1], cells.get("int4")
        first = [r["family"], r["model"]]
        if published:
            first.append(published[r["family"]])
        last = [] if published else [
            str(sum(c["lost"] for c in r["cells"])),
            "yes" if all(c["round_trip_exact"] in (True, None) for c in r["cells"]) else "NO"]
        lines.append([*first, f"{r['saved_bytes_exact'] / 1e6:.2f}",
                      int4["linear_patched"] if int4 else "-",
                      lean["parts"] or lean["refused"] or "-", *last])
    out.append(fmt_table(
        ["family", "model", *(["published shape"] if published else []), "saved MB, exact",
         "linear layers patched (int4)", f"patch_activations ({lean['setup']}): applied; left (why)",
         *([] if published else ["parameters without a gradient (all setups)",
                                 "unpatch round trip exact"])],
        lines, title="What applies to each family"))
    if payload.get("times"):
        methods = ["checkpointing"]
        for stats in payload["times"].values():  # in order; a family may lack a setup
            methods += [m for m in stats if m not in ("exact", *methods)]
        lines = []
        for family, stats in payload["times"].items():
            row = [family, stats["exact"].get("attention", "eager"),
                   f"{stats['exact']['median_s']:.3f}"]
            for m in methods:
                st = stats.get(m)
                row.append("-" if st is None else f"{st['ratio']:.2f} [{st['ratio_q1']:.2f}, "
                           f"{st['ratio_q3']:.2f}] / {st['saved_ratio']:.3f}")
            ck = stats.get("checkpointing")
            row.append("-" if ck is None else ", ".join(
                f"{m}: {'yes' if stats[m]['ratio'] < ck['ratio'] else 'NO'}" for m in methods[1:]
                if m in stats))
            lines.append(row)
        out.append(fmt_table(
            ["family", "exact's attention", "exact s/step",
             *[f"{m}: time / exact [quartiles] / saved bytes / exact"
                                         for m in methods], "faster than checkpointing"], lines,
            title=f"Step time on {a['time_length']} full-length tokens x 4 rows (hidden "
                  f"{w['hidden']}, {w['layers']} layers; {a['repeats']} interleaved rounds, each "
                  f"ratio to the exact steps around it), {payload['environment'].get('cpu')}, "
                  f"{payload['environment'].get('torch_threads')} threads"))
    refused = [f"- {r['family']}, {c['setup']}: {c['refused']}" for r in rows for c in r["cells"]
               if c["refused"]]
    return "\n\n".join(out) + "\n" + ("\nRefused:\n\n" + "\n".join(refused) + "\n"
                                      if refused else "")


def shape_of(name: str) -> str:
    """Family ``name``'s published checkpoint and shape, as the table names it."""
    checkpoint, width, overrides = fam.PUBLISHED[name]
    config = fam.config_of(name, width, **overrides)
    kv = getattr(config, "num_key_value_heads", None)
    experts = next((getattr(config, k) for k in ("num_local_experts", "num_experts")
                    if getattr(config, k, None)), None)
    return (f"{checkpoint}: hidden {width.hidden}, {width.heads} heads"
            + (f" ({kv} key/value)" if kv not in (None, width.heads) else "")
            + f", MLP {width.mlp}" + (f" x {experts} experts" if experts else "")
            + (f", vocabulary {width.vocab}" if fam.FAMILIES[name].keys[4] else ""))


def run(args) -> None:
    """The matrix as ``scripts/architectures.py`` runs it (its options in ``args``): write
    ``architectures[_<tag>].{json,md}`` and print the tables."""
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    published = args.width == "published"
    width = fam.TINY if published else WIDTHS[args.width]  # (published: its layers only)
    setups = parse_list(args.setups)
    time_setups = parse_list(args.time_setups)  # (checked without --time too)
    unknown = [s for s in (*setups, *time_setups) if s not in SETUPS]
    names = parse_list(args.families)
    unknown += [n for n in names if n not in fam.FAMILIES and n != CONV]
    if published:  # (no published conv net)
        unknown += [n for n in names if n == CONV]
    if unknown:
        raise SystemExit(f"unknown setup or family {unknown}; setups: {list(SETUPS)}; families: "
                         f"{[*fam.FAMILIES, *([] if published else [CONV])]}")
    if published and args.time:
        raise SystemExit("--width published measures saved bytes only: no --time")
    if args.real != 1 and not (published and 0 < args.real <= 1 / REAL_SPREAD[0]):
        raise SystemExit(f"--real is a share of real tokens in (0, {1 / REAL_SPREAD[0]:.2f}] "
                         f"(its longest row {REAL_SPREAD[0]} times it), with --width published; "
                         f"got {args.real}")
    results = []
    for name in names:
        row = (measure_published(name, setups, args.time_length, args.real) if published
               else measure(name, width, setups, args.steps))
        results.append(asdict(row))
        print(f"{name}: " + ", ".join(f"{c['setup']} {_fmt(c['saved_ratio'], '.3f')}"
                                      for c in row.cells), flush=True)
    times = {}
    if args.time:
        for name in names:
            times[name] = time_family(name, width, time_setups, args.time_length,
                                      args.repeats, dev)
            print(f"{name}: " + ", ".join(f"{m} {st['ratio']:.2f}" for m, st in
                                          times[name].items()), flush=True)
    payload = {"environment": env, "args": vars(args), "width": asdict(width),
               "results": results, "times": times}
    if published:
        payload["published"] = {name: shape_of(name) for name in names}
    text = tables(payload)
    write_outputs("architectures" + (f"_{args.tag}" if args.tag else ""), payload, text,
                  args.out_dir)
    print(text)
