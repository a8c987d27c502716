"""Speed: what each memory saving costs in step time, against the exact step it replaces, and what
each codec costs against the memory-bound limit of its bytes.

**Steps.** One training step (forward, backward, AdamW step) of roberta-base (random weights, as in
:mod:`sketchprop.bench.model_step`) per method, over a grid of batch shapes (``--shapes``, default
8x128 and 16x128), row kinds and thread counts (``--threads``, default one thread and every core
this process may use):

- ``full`` rows: every row full length, no padding, so skipping padding saves nothing and each
  method's ratio to ``exact`` is its own cost;
- ``real`` rows: lengths drawn from a GLUE dev set as :func:`~sketchprop.bench.models.make_batch`
  draws them (MRPC: about 40% real tokens), padding after them.

Every method runs in one process, interleaved round robin (:func:`~sketchprop.bench.common.
interleaved_times`: ``exact`` timed before, between and after the others, each ratio against the
mean of the two ``exact`` samples that bracket it) for ``--rounds`` rounds after ``--warmup``
rounds. Each method has its own copy of the model's modules, patched once, sharing the one set of
Parameters, gradients and optimizer: no patching inside the timed step, every method the same
weights. Reported: the median over rounds of the ratio to ``exact`` and of the ratio to
``exact-skip`` (its per-round ratio divided by exact-skip's in the same round), with the range over
rounds, and the geometric mean of the per-round ratios with its 95% t-interval (each round one
paired sample: the method against the baseline timed seconds apart; n = rounds).
``exact-skip`` (exact gradients, padding rows left out of the stored ``X`` and of ``dW``) is the
fair baseline on padded rows: the 4-bit codes (``int4``: exact-skip whose stored rows are
4-bit codes) and the compact activations should be judged by what they add to it, not credited
with the padding it skips. Hence the targets (:data:`TARGETS`): on full rows against ``exact``,
on real rows against ``exact-skip``; "holds": ``yes`` where the interval lies at or below the
limit, ``no`` where it lies above, ``unsettled`` where it contains the limit (more rounds, or a
quieter machine, would settle it).

**The allocator.** ``--allocator keep`` (the default) has the C allocator keep the pages it
faulted in, as PyTorch's caching allocator does on CUDA; ``--allocator default`` leaves glibc's
setting, under which each step faults in again what the step before freed
(:func:`~sketchprop.bench.common.set_allocator` says why that matters). Each cell's table gives
every method's page faults per step (the median over its calls).

``--compile-model``: every method again with ``torch.compile(model)`` on top, in the same rounds,
against compiled ``exact`` and compiled ``exact-skip``, after a warm-up that lasts until nothing
compiles any more (:func:`time_cell`; the tables say how long that took and whether anything
compiled during the timed rounds); a method whose compiled step fails is reported as
``failed: <reason>``.

**Codecs alone** (float32, or bfloat16 with ``--autocast bf16``), each group timed interleaved
with its baseline in rounds of its own, at each thread count:

- 4-bit stored rows on the ``--codec-rows x --codec-cols`` input of ``bits_cost`` (807 x 3072:
  the non-padding rows of a 16 x 128 MRPC batch into the intermediate layer): quantize,
  dequantize, both; beside a plain copy of the input's bytes (``torch.empty_like(a).copy_(a)``:
  the memory-bound limit of a pass over them), a copy of the code bytes, and the weight-gradient
  product ``dY^T X`` against a ``rows x 768`` output gradient that backward computes from the
  decoded rows. Target: quantize + dequantize at most 0.20x that product on one thread.
- The GELU code: encode (derivative, 2-bit stochastic code, packing) and decode (unpacking, levels)
  of ``CompactGELU``'s default code on a ``--gelu-shape`` (16*128 x 3072) input, beside a copy.
- The seeded dropout mask regenerated from its seed (``activations.seeds.keep_mask``, p 0.1) on a
  ``--mask-shape`` (16 x 12 x 128 x 128: roberta-base's attention probabilities) tensor, beside a
  copy of a float tensor of that shape.
- LayerNorm's backward from its output (``activations.norms._layer_norm_backward``: ``x^`` made
  from the output, then ``dx``, ``dw``, ``db``) on a ``--norm-shape`` (16*128 x 768) input,
  beside a copy of the output and the native backward from the input (the stored path's kernel).

Each codec is one fused function, compiled where a compiler works
(:func:`sketchprop.compiling.fused`); ``--eager-codecs`` also times each eagerly
(``eager <op>``, :func:`~sketchprop.compiling.eager_codecs`), in the same rounds.

``scripts/bench_speed.py`` runs it (``make bench-speed``); outputs ``speed_<device>[_quick]<tag>``.
``--tables-from <json>`` rebuilds a run's statistics, verdicts and tables from its per-round ratios
alone (:func:`retable`), timing nothing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from scipy import stats

from sketchprop import quantize as q
from sketchprop.activations import gelu, norms
from sketchprop.activations.gelu import GeluCode
from sketchprop.activations.seeds import keep_mask
from sketchprop.compiling import eager_codecs
from sketchprop.glue.paths import portable

from .common import (
    BadArgs,
    counting_faults,
    environment,
    fmt_table,
    git_commit,
    interleaved_times,
    parse_list,
    parse_shapes,
    parse_threads,
    pct,
    r3,
    set_allocator,
    setup_device,
    shape_of,
    write_outputs,
)
from .model_step import quiet_deprecations
from .models import (
    AUTOCAST,
    Configured,
    build_model,
    full_rows,
    make_batch,
    make_step,
    method_list,
    to_device,
)

# (row kind, method) -> (baseline, limit): the step-time targets the codecs are built towards.
TARGETS = {
    ("full", "int4"): ("exact", 1.02),
    ("full", "compact"): ("exact", 1.03),
    ("full", "int4+compact"): ("exact", 1.04),
    ("real", "int4"): ("exact-skip", 1.02),
    ("real", "int4+compact"): ("exact-skip", 1.06),
    ("full", "int4+lean"): ("exact", 1.05),
    ("real", "int4+lean"): ("exact-skip", 1.05),
}
# quantize + dequantize of 4-bit rows against the weight-gradient product, on one thread.
CODEC_TARGET = ("quantize+dequantize", "dW product", 0.20)
ROW_KINDS = ("full", "real")
COMPILED = "compiled "  # prefix of a compiled function's name
EAGER = "eager "  # prefix of a codec run eagerly
WARM_LIMIT = 10  # warm-up calls of a compiled function at most (dynamo's recompile limit is 8)


def run(args) -> None:
    """The benchmark as ``scripts/bench_speed.py`` runs it (its options in ``args``): measure, write
    ``speed_<device>[_quick]<tag>.{json,md}`` and print the tables."""
    shapes = parse_shapes(args.shapes, args.quick)
    rows = parse_list(args.rows)
    if not set(rows) <= set(ROW_KINDS) or not rows:
        raise BadArgs(f"--rows must name some of {', '.join(ROW_KINDS)}, got {args.rows!r}")
    threads = parse_threads(args.threads)
    args.rho_list = parse_list(args.rhos, float)
    methods = method_list(args)
    if not {"exact", "exact-skip"} <= {m["name"] for m in methods}:
        raise BadArgs("--methods must include exact and exact-skip (the baselines)")
    for text in (args.gelu_shape, args.mask_shape, args.norm_shape):
        shape_of(text)
    if len(shape_of(args.norm_shape)) != 2:
        raise BadArgs(f"--norm-shape is ROWSxCOLUMNS, got {args.norm_shape!r}")
    if min(args.rounds, args.codec_rounds, args.inner, args.every) < 1 or args.warmup < 0:
        raise BadArgs("--rounds, --codec-rounds, --inner and --every must be >= 1, --warmup >= 0")
    if args.quick:
        args.rounds, args.codec_rounds, args.inner = min(args.rounds, 2), min(args.codec_rounds, 3), 1
        args.codec_rows, args.codec_cols, args.out_features = 37, 256, 64
        args.gelu_shape, args.mask_shape, args.norm_shape = "64x256", "2x4x32x32", "64x96"
    allocator = set_allocator(args.allocator)
    quiet_deprecations()
    dev = setup_device(args.device, threads[0])
    env = {**environment(dev), "allocator": allocator}
    dtype = AUTOCAST[args.autocast]
    t0 = time.perf_counter()
    cells = step_grid(args, dev, dtype, methods, shapes, rows, threads)
    codecs = {str(n): codec_rounds(args, dev, dtype, n) for n in threads}
    payload = {"environment": env, "args": vars(args), "threads": threads, "cells": cells,
               "codecs": codecs, "wall_s": time.perf_counter() - t0}
    payload["targets"] = targets(cells, codecs)
    text = tables(payload)
    stem = f"speed_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    write_outputs(stem, payload, text, args.out_dir)
    print("\n" + text)


def retable(path: str) -> None:
    """``--tables-from``: rebuild a run's ratio statistics (:func:`summary`), targets and tables
    from the per-round ratios its JSON holds, timing nothing (a run made before the statistics
    changed gets today's); rewrite its JSON and markdown, which say so."""
    src = Path(path)
    try:
        payload = json.loads(src.read_text())
    except (OSError, ValueError) as err:
        raise BadArgs(f"--tables-from: cannot read {path}: {err}") from None
    if not isinstance(payload, dict) or not {"cells", "codecs", "args"} <= payload.keys():
        raise BadArgs(f"--tables-from: {path} is not the JSON of a speed run")

    def again(node):
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(value, dict) and str(key).startswith("vs_") and "ratios" in value:
                node[key] = summary(value["ratios"])
            elif isinstance(value, dict | list):
                again(value)
    again(payload["cells"])
    again(payload["codecs"])
    payload["targets"] = targets(payload["cells"], payload["codecs"])
    payload["tables_from"] = {"command": f"python scripts/bench_speed.py --tables-from "
                                         f"{portable(src)}", "commit": git_commit()}
    text = tables(payload)
    write_outputs(src.stem, payload, text, src.parent)
    print("\n" + text)


# ----------------------------------------------------------------------------------------- steps

def batch_for(model, kind: str, bsz: int, seq: int, args) -> tuple[dict, dict]:
    """The batch of one row kind: ``real`` as make_batch draws it; ``full``: the same tokens with
    every padding position given a random non-padding token, the attention mask all ones."""
    ns = SimpleNamespace(batch=bsz, seq=seq, task=args.task, glue_dir=args.glue_dir,
                         quick=args.quick)
    batch, info = make_batch(args.model, model, ns)
    if kind == "full":
        batch, info = full_rows(model, batch)
    return batch, info


def method_models(model, methods, stack: contextlib.ExitStack, compile_model: bool) -> dict:
    """``{name: module}``: per method a copy of ``model`` sharing its Parameters, patched for the
    life of ``stack``; with ``compile_model`` also ``compiled <name>``: ``torch.compile`` of it."""
    shared = {id(p): p for p in model.parameters()}
    out = {}
    for m in methods:
        out[m["name"]] = mod = copy.deepcopy(model, memo=dict(shared))
        stack.enter_context(Configured(mod, m))
    if compile_model:
        out.update({COMPILED + name: torch.compile(mod) for name, mod in list(out.items())})
    return out


def compiled_frames() -> int:
    """Frames dynamo has converted so far in this process (a compile or a recompile each)."""
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def warm_compiled(fn, limit: int = WARM_LIMIT) -> int:
    """Call a compiled function until a call compiles nothing new (dynamo recompiles on guards
    that fail on later calls, e.g. a Python number that changes), at most ``limit`` times: the
    timed calls then measure the compiled code, not compiling. Returns the calls made."""
    for calls in range(1, limit + 1):
        before = compiled_frames()
        fn()
        if compiled_frames() == before:
            return calls
    return limit


def failure(err: Exception) -> str:
    """A one-line reason for a failed call."""
    lines = str(err).strip().splitlines()
    return f"failed: {type(err).__name__}: {lines[0][:160] if lines else ''}".rstrip(": ")


def step_grid(args, dev, dtype, methods, shapes, rows, threads) -> list[dict]:
    """Every cell of the grid (shape, row kind, threads): its batch and each method's timing."""
    model = build_model(args.model, args.quick).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cells, dead = [], {}
    with contextlib.ExitStack() as stack:
        mods = method_models(model, methods, stack, args.compile_model)
        for bsz, seq in shapes:
            for kind in rows:
                batch, info = batch_for(model, kind, bsz, seq, args)
                batch = to_device(batch, dev)
                faults = {}
                fns = {name: counting_faults(make_step(mod, batch, opt, dtype),
                                             faults.setdefault(name, []))
                       for name, mod in mods.items()}
                for n in threads:
                    torch.set_num_threads(n)
                    print(f"\n=== {bsz}x{seq} {kind} rows ({pct(info['real_fraction'])} real), "
                          f"{n} thread(s) ===", flush=True)
                    cell = {"batch": bsz, "seq": seq, "rows": kind, "threads": n, "info": info}
                    for counts in faults.values():
                        counts.clear()
                    cell.update(time_cell(fns, dev, args, dead))
                    for name, rec in cell["methods"].items():
                        rec["page_faults"] = statistics.median(faults[name])
                    cells.append(cell)
    return cells


def time_cell(fns: dict, dev, args, dead: dict) -> dict:
    """One cell's rounds against ``exact``. Compiled functions are warmed up first, each alone
    (:func:`warm_compiled`; a failure is recorded in ``dead`` and the function left out of this
    cell and the later ones), then every function in turn until a pass compiles nothing new
    (copies of one model share dynamo's cache of its code, so one method's calls can make
    another's guards fail); the frames compiled during the timed rounds are counted."""
    t0 = time.perf_counter()
    failed, warm = {n: dead[n] for n in fns if n in dead}, {}
    for name in [n for n in fns if n.startswith(COMPILED) and n not in failed]:
        try:
            warm[name] = warm_compiled(fns[name])
        except Exception as err:  # noqa: BLE001 -- any compile failure is a result to report
            failed[name] = dead[name] = failure(err)
            print(f"  {name}: {failed[name]}", flush=True)
    live = {n: f for n, f in fns.items() if n not in failed}
    passes = 0
    while warm and passes < WARM_LIMIT:
        passes, before = passes + 1, compiled_frames()
        for fn in live.values():
            fn()
        if compiled_frames() == before:
            break

    def report(r, times):
        print(f"  round {r}: " + " ".join(f"{k}={v[-1]:.3f}" for k, v in times.items()), flush=True)

    t1, frames = time.perf_counter(), compiled_frames() if warm else 0
    measured = interleaved_times(live, dev, warmup=max(0, args.warmup - passes),
                                 repeats=args.rounds, base="exact", every=args.every,
                                 on_round=report)
    out = {"methods": {}, "failed": failed, "compile_s": t1 - t0, "warm_passes": passes,
           "frames_compiled_timed": compiled_frames() - frames if warm else 0,
           "wall_s": time.perf_counter() - t1}
    for name in live:
        ref = COMPILED if name.startswith(COMPILED) else ""
        rec = {"median_s": statistics.median(measured["times"][name]),
               "samples_s": measured["times"][name]}
        for key, base in (("vs_exact", ref + "exact"), ("vs_skip", ref + "exact-skip")):
            if base in live:
                rec[key] = summary(versus(measured, name, base, "exact"))
        if ref:
            rec["vs_eager_exact"] = summary(versus(measured, name, "exact", "exact"))
            rec["warm_calls"] = warm[name]
        out["methods"][name] = rec
    return out


def versus(measured: dict, name: str, ref: str, base: str) -> list[float]:
    """Per round, ``name``'s time over ``ref``'s: their bracketed ratios to ``base`` divided (each
    against ``base`` measured seconds apart)."""
    rounds = len(measured["ratios"][next(n for n in measured["ratios"] if n != base)])

    def ratios(n):
        return [1.0] * rounds if n == base else measured["ratios"][n]
    return [a / b for a, b in zip(ratios(name), ratios(ref), strict=True)]


def summary(rs: list[float]) -> dict:
    """The median of per-round ratios, their range, the ratios, their number ``n`` and (from two
    rounds) their geometric ``mean`` with its 95% Student-t interval ``low``-``high`` (the mean of
    the log-ratios, ``n - 1`` degrees of freedom): each round is one paired sample."""
    out = {"ratio": statistics.median(rs), "min": min(rs), "max": max(rs), "ratios": rs,
           "n": len(rs)}
    if len(rs) >= 2:
        logs = [math.log(r) for r in rs]
        mean = statistics.fmean(logs)
        half = stats.t.ppf(0.975, len(rs) - 1) * statistics.stdev(logs) / math.sqrt(len(rs))
        out.update(mean=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half))
    return out


# ---------------------------------------------------------------------------------------- codecs

def codec_groups(args, dev, dtype) -> dict[str, tuple[str, dict]]:
    """``{group: (baseline, {op: fn})}``: the codec functions of each group, each a call of no
    arguments on inputs made here."""
    dtype = dtype or torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    bits, group = args.bits, args.group
    a, dy = randn(args.codec_rows, args.codec_cols), randn(args.codec_rows, args.out_features)
    payload, spec, _ = q.quantize(a, bits, group, seed=1)
    rows = {
        "dW product": lambda: dy.T.mm(a),
        "quantize": lambda: q.quantize(a, bits, group, seed=1)[0],
        "dequantize": lambda: q.dequantize(payload, spec),
        "quantize+dequantize": lambda: q.dequantize(*q.quantize(a, bits, group, seed=1)[:2]),
        "copy input": lambda: torch.empty_like(a).copy_(a),
        "copy codes": lambda: torch.empty_like(payload).copy_(payload),
    }
    code = GeluCode.uniform(2)
    x = randn(*shape_of(args.gelu_shape))
    key = torch.tensor(1, device=dev)
    enc, dec = code.constants(dev, "encode"), code.constants(dev, "decode")
    packed = gelu._encode(x, key, *enc, "none")

    def encode():
        return gelu._encode(x, key, *enc, "none")

    def decode(p=packed):
        return gelu._backward(x, p, *dec)

    gelu_ops = {"copy input": lambda: torch.empty_like(x).copy_(x), "encode": encode,
            "decode": decode, "encode+decode": lambda: decode(encode())}
    mshape = shape_of(args.mask_shape)
    m = randn(*mshape).float()
    mask = {"copy input": lambda: torch.empty_like(m).copy_(m),
            "regenerate mask": lambda: keep_mask(mshape, 0.1, 1, dev)}
    n_rows, n = shape_of(args.norm_shape)
    xn, w, b = randn(n_rows, n), randn(n) + 1, randn(n)
    y, mean, rstd = torch.native_layer_norm(xn, (n,), w, b, 1e-5)
    dyn = randn(n_rows, n)
    norm = {"copy input": lambda: torch.empty_like(y).copy_(y),
            "backward from output": lambda: norms._layer_norm_backward(
                dyn, y, rstd, w, b, None, None, None, True, True, True),
            "native backward from input": lambda: torch.ops.aten.native_layer_norm_backward(
                dyn, xn, (n,), mean, rstd, w, b, [True] * 3)}
    return {
        f"int{bits} rows {args.codec_rows}x{args.codec_cols}": ("dW product", rows),
        f"GELU 2-bit code {args.gelu_shape}": ("copy input", gelu_ops),
        f"dropout mask {args.mask_shape} (float32 copy)": ("copy input", mask),
        f"LayerNorm backward {args.norm_shape}": ("copy input", norm),
    }


def eager(fn):
    """``fn`` with every fused codec in it run eagerly."""
    def call():
        with eager_codecs():
            return fn()
    return call


def codec_rounds(args, dev, dtype, threads: int) -> dict:
    """Every codec group timed at ``threads`` threads: ``{group: {op: record}}`` with each op's
    median time and its ratios to the group's copy of the input and (rows) to the dW product."""
    torch.set_num_threads(threads)
    print(f"\n=== codecs, {threads} thread(s) ===", flush=True)
    out = {}
    for gname, (base, fns) in codec_groups(args, dev, dtype).items():
        failed = {}
        for name, fn in list(fns.items()):
            if name.startswith(("copy", "native")) or name == "dW product":
                continue
            try:
                warm_compiled(fn)  # the fused functions compile at their first calls
            except Exception as err:  # noqa: BLE001 -- reported, not raised
                failed[name] = failure(err)
                del fns[name]
                continue
            if args.eager_codecs:
                fns[EAGER + name] = eager(fn)
        measured = interleaved_times(fns, dev, warmup=2, repeats=args.codec_rounds,
                                     inner=args.inner, base=base, every=2)
        recs = {}
        for name in fns:
            rec = {"median_s": statistics.median(measured["times"][name]),
                   "samples_s": measured["times"][name],
                   "vs_copy": summary(versus(measured, name, "copy input", base))}
            if base == "dW product":
                rec["vs_dw"] = summary(versus(measured, name, base, base))
            recs[name] = rec
        out[gname] = {"base": base, "ops": recs, "failed": failed}
        print(f"  {gname}: " + ", ".join(f"{n} {1e3 * r['median_s']:.3f} ms"
                                         for n, r in recs.items()), flush=True)
    return out


# ---------------------------------------------------------------------------------------- tables

def verdict(s: dict, limit: float) -> tuple[bool | None, str]:
    """Whether a ratio meets ``limit``: True where its 95% interval lies at or below it, False
    where above, None where the interval contains it (or one round measured no spread); and the
    verdict as the tables write it."""
    if "low" not in s:
        return None, "unsettled (one round)"
    if s["high"] <= limit:
        return True, "yes"
    if s["low"] > limit:
        return False, "no"
    return None, "unsettled (interval holds the limit)"


def targets(cells: list[dict], codecs: dict) -> list[dict]:
    """Every target with its measured median ratio, range and verdict."""
    out = []
    for c in cells:
        for (kind, name), (base, limit) in TARGETS.items():
            rec = c["methods"].get(name, {})
            s = rec.get("vs_exact" if base == "exact" else "vs_skip")
            if c["rows"] != kind or s is None:
                continue
            ok, text = verdict(s, limit)
            out.append({"what": f"{name} / {base}", "cell": cell_label(c), "rows": kind,
                        **stats_of(s), "limit": limit, "holds": ok, "verdict": text})
    op, base, limit = CODEC_TARGET
    for threads, groups in codecs.items():
        if threads != "1":
            continue
        for gname, grp in groups.items():
            s = grp["ops"].get(op, {}).get("vs_dw")
            if s is not None:
                ok, text = verdict(s, limit)
                out.append({"what": f"{op} / {base}", "cell": f"{gname}, 1 thread",
                            **stats_of(s), "limit": limit, "holds": ok, "verdict": text})
    return out


def stats_of(s: dict) -> dict:
    """A ratio summary's statistics, without the ratios."""
    return {k: s[k] for k in ("ratio", "min", "max", "n", "mean", "low", "high") if k in s}


def mean_text(s: dict) -> str:
    """``geometric mean [low-high]`` of a ratio summary, or its one ratio."""
    return f"{r3(s['mean'])} [{s['low']:.3f}-{s['high']:.3f}]" if "low" in s else r3(s["ratio"])


def cell_label(c: dict) -> str:
    return (f"{c['batch']}x{c['seq']} {c['rows']} rows ({pct(c['info']['real_fraction'])} real), "
            f"{c['threads']} thread{'s' if c['threads'] > 1 else ''}")


def ratio_text(s: dict | None) -> str:
    """``median (min-max)`` of a ratio summary; empty where there is none."""
    return f"{r3(s['ratio'])} ({s['min']:.3f}-{s['max']:.3f})" if s else ""


def cell_table(c: dict) -> str:
    """One cell: every method's step time and ratios, its target and verdict."""
    rows = []
    for name, rec in c["methods"].items():
        base, limit = TARGETS.get((c["rows"], name), (None, None))
        s = rec.get("vs_exact" if base == "exact" else "vs_skip") if base else None
        faults = rec.get("page_faults")  # runs before it was counted have none
        rows.append([name, f"{rec['median_s']:.3f}", ratio_text(rec.get("vs_exact")),
                     ratio_text(rec.get("vs_skip")), "" if faults is None else f"{faults:.0f}",
                     f"<= {limit} x {base}" if base else "", verdict(s, limit)[1] if s else ""])
    rows += [[name, reason.replace("|", "/"), "", "", "", "", ""]
             for name, reason in c["failed"].items()]
    title = (f"{cell_label(c)}: one training step, median s over rounds; median ratio over rounds "
             f"(min-max); page faults, median per step")
    text = fmt_table(["method", "step s", "x exact", "x exact-skip", "page faults", "target",
                      "holds"], rows, title)
    ce = c["methods"].get(COMPILED + "exact", {}).get("vs_eager_exact")
    if ce:
        warm = ", ".join(f"{n.removeprefix(COMPILED)} {r['warm_calls']}"
                         for n, r in c["methods"].items() if "warm_calls" in r)
        timed = c["frames_compiled_timed"]
        text += (f"\n\nCompiled rows: x compiled exact and x compiled exact-skip; compiled exact "
                 f"x eager exact: {ratio_text(ce)}. Warm-up, calls of each alone until one "
                 f"compiled nothing new (at most {WARM_LIMIT}; {WARM_LIMIT}: it still recompiled): "
                 f"{warm}; then passes over all methods: {c['warm_passes']}. Frames compiled "
                 f"during the timed rounds: {timed}"
                 f"{' (their times include compiling)' if timed else ''}.")
    return text


def codec_table(threads: str, groups: dict, dtype: str) -> str:
    """The codecs at one thread count: median ms per call, ratios to the copy and dW product."""
    rows = []
    op, base, limit = CODEC_TARGET
    for gname, grp in groups.items():
        for name, rec in grp["ops"].items():
            s = rec.get("vs_dw")
            target = holds = ""
            if name == op and s is not None and threads == "1":
                target, holds = f"<= {limit} x {base}", verdict(s, limit)[1]
            rows.append([gname, name, f"{1e3 * rec['median_s']:.3f}", ratio_text(rec["vs_copy"]),
                         ratio_text(s), target, holds])
        rows += [[gname, n, r.replace("|", "/"), "", "", "", ""] for n, r in grp["failed"].items()]
    title = (f"Codecs alone, {dtype} inputs, {threads} thread{'s' if threads != '1' else ''}: "
             f"median ms per call; median ratio over rounds (min-max) to a copy of the group's "
             f"input and to the dW product")
    return fmt_table(["input", "op", "ms", "x copy input", "x dW product", "target", "holds"],
                     rows, title)


def tables(payload: dict) -> str:
    """The run's markdown: the targets, then each cell's table, then the codec tables."""
    a = payload["args"]
    rows = [[t["what"], t["cell"], mean_text(t), f"{r3(t['ratio'])} ({t['min']:.3f}-{t['max']:.3f})",
             f"<= {t['limit']}", t["verdict"]] for t in payload["targets"]]
    parts = [fmt_table(["target", "where", "geometric mean [95% interval]", "median (range)",
                        "limit", "holds"], rows,
                       f"Speed targets ({a['model']}, autocast {a['autocast']}): per-round ratios "
                       f"over {a['rounds']} rounds (codecs: {a['codec_rounds']}), each round one "
                       f"paired sample; holds: yes where the 95% interval lies at or below the "
                       f"limit, no where above it, unsettled where it holds the limit")]
    parts += [cell_table(c) for c in payload["cells"]]
    dtype = "float32" if a["autocast"] == "none" else str(AUTOCAST[a["autocast"]]).split(".")[1]
    parts += [codec_table(t, groups, dtype) for t, groups in payload["codecs"].items()]
    again = payload.get("tables_from")
    if again:
        parts.append(f"Statistics, verdicts and tables rebuilt from this run's per-round ratios by "
                     f"`{again['command']}` at commit {again['commit']}.")
    return "\n\n".join(parts)
