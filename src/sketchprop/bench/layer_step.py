"""One linear layer, forward + backward: every sketch at every rate against ``nn.Linear``.

For each layer shape (roberta-base: 768->768, 768->3072, 3072->768) and row count (2048, 4096),
an input ``X`` (requiring grad, as inside a network) and an output gradient ``dY`` are fixed, and
``y = layer(X); y.backward(dY)`` is timed for ``nn.Linear`` and for ``RandomizedLinear`` with each
sketch and rate, all sharing one weight. Configurations run interleaved round-robin after a
warm-up, with the device synchronized around each sample; the ratio is the median over rounds of
(time / nn.Linear's time in the same round). Saved bytes come from ``SavedTensorMeter``
(activation storages saved for backward, the weight excluded).
"""

from __future__ import annotations

import json
import math
import time

import torch
from torch import nn

from sketchprop import RandomizedLinear
from sketchprop.measure import SavedTensorMeter

from .common import (
    environment,
    fmt_table,
    interleaved_times,
    parse_list,
    r3,
    ratio_stats,
    setup_device,
    sketch_from_spec,
    sync,
    write_outputs,
)

# The recommended sketch per device type: the summary table sets it beside the dense Gaussian.
RECOMMENDED = {"cpu": "blocksrht", "cuda": "blocksrht"}


def bench_group(n_in, n_out, rows, specs, rhos, args, dev, dtype) -> dict:
    """One shape and row count: every sketch at every rate timed against ``nn.Linear`` (its
    ratios per round) and its saved bytes."""
    torch.manual_seed(0)
    lin = nn.Linear(n_in, n_out, device=dev, dtype=dtype)
    x = torch.randn(rows, n_in, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, n_out, device=dev, dtype=dtype)
    layers: dict[str, tuple[nn.Module, str, float | None]] = {"nn.Linear": (lin, "nn.Linear", None)}
    for spec in specs:
        sk = sketch_from_spec(spec)
        for rho in ([1.0] if sk.exact else rhos):
            layer = RandomizedLinear.from_linear(lin, sketch=sk, rho=rho, name=f"{spec}@{rho:g}")
            layers[f"{spec}@{rho:g}"] = (layer, spec, rho)

    def runner(layer):
        def fn():
            x.grad = None
            lin.weight.grad = None
            lin.bias.grad = None
            layer(x).backward(dy)
        return fn

    fns = {name: runner(layer) for name, (layer, _, _) in layers.items()}
    saved = {}
    for name, (layer, _, _) in layers.items():
        with SavedTensorMeter(layer) as meter:
            out = layer(x)
        out.backward(dy)  # frees the graph (and whatever the meter's hooks saw)
        saved[name] = meter.bytes
    # Enough calls per sample that one sample lasts >= --min-sample-ms (GPU kernels are short).
    fns["nn.Linear"]()
    sync(dev)
    t0 = time.perf_counter()
    fns["nn.Linear"]()
    sync(dev)
    inner = max(1, math.ceil(args.min_sample_ms / 1000 / max(time.perf_counter() - t0, 1e-6)))
    times = interleaved_times(fns, dev, warmup=args.warmup, repeats=args.repeats, inner=inner,
                              base="nn.Linear", every=args.every)
    stats = ratio_stats(times, "nn.Linear")
    configs = {}
    for name, (_, spec, rho) in layers.items():
        configs[name] = {"sketch": spec, "rho": rho, "saved_bytes": saved[name],
                         "saved_ratio": saved[name] / saved["nn.Linear"], **stats[name]}
    return {"shape": f"{n_in}x{n_out}", "rows": rows, "inner": inner, "configs": configs}


def group_table(g: dict, specs, rhos) -> str:
    """The markdown table of one group: time and saved bytes over ``nn.Linear``'s, per rate."""
    c = g["configs"]
    headers = ["sketch"] + [f"time @{r:g}" for r in rhos] + [f"bytes @{r:g}" for r in rhos]
    rows = [["nn.Linear"] + [r3(1.0)] * len(rhos) + [r3(1.0)] * len(rhos)]
    for spec in specs:
        if f"{spec}@1" in c:  # exact: one rate
            e = c[f"{spec}@1"]
            rows.append([spec] + [r3(e["ratio"])] * len(rhos) + [r3(e["saved_ratio"])] *
                        len(rhos))
            continue
        rows.append([spec] + [r3(c[f"{spec}@{r:g}"]["ratio"]) for r in rhos]
                    + [r3(c[f"{spec}@{r:g}"]["saved_ratio"]) for r in rhos])
    base_ms = 1000 * c["nn.Linear"]["median_s"]
    title = (f"{g['shape']} layer, {g['rows']} rows: fwd+bwd time and saved bytes / nn.Linear "
             f"(nn.Linear {base_ms:.2f} ms)")
    return fmt_table(headers, rows, title)


def run(args) -> None:
    """The benchmark as ``scripts/bench_layer.py`` runs it (its options in ``args``): write
    ``layer_<device>[_quick]<tag>.{json,md}`` and print the summary table last."""
    if args.quick:
        args.shapes, args.rows = "32x64,64x32", "64"
        args.warmup, args.repeats, args.min_sample_ms = 1, 2, 0.0
    dev = setup_device(args.device, args.threads)
    dtype = getattr(torch, args.dtype)
    env = environment(dev)
    print(json.dumps(env), flush=True)
    specs = parse_list(args.sketches)
    rhos = parse_list(args.rhos, float)
    groups = []
    for rows in parse_list(args.rows, int):
        for shape in parse_list(args.shapes):
            n_in, n_out = (int(v) for v in shape.split("x"))
            t0 = time.perf_counter()
            g = bench_group(n_in, n_out, rows, specs, rhos, args, dev, dtype)
            g["wall_s"] = time.perf_counter() - t0
            groups.append(g)
            print(group_table(g, specs, rhos) + "\n", flush=True)

    rec = RECOMMENDED.get(dev.type, "blocksrht")
    summary_rows = []
    for g in groups:
        c = g["configs"]
        cells = []
        for r in rhos:
            for spec in (rec, "gaussian"):
                cfg = c.get(f"{spec}@{r:g}")
                cells.append(r3(cfg["ratio"]) if cfg else "")
        summary_rows.append([g["shape"], g["rows"]] + cells)
    heads = ["shape", "rows"] + [f"{s} @{r:g}" for r in rhos for s in (rec, "gaussian")]
    summary = fmt_table(heads, summary_rows,
                        f"Summary: fwd+bwd time / nn.Linear, recommended sketch ({rec}) and "
                        "dense Gaussian")
    text = "\n\n".join([group_table(g, specs, rhos) for g in groups] + [summary])
    stem = f"layer_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    write_outputs(stem, {"environment": env, "args": vars(args), "groups": groups}, text,
                  args.out_dir)
    print("\n" + summary)
