"""One linear layer, forward + backward: every sketch at every rate against ``nn.Linear``.

For each layer shape (roberta-base: 768->768, 768->3072, 3072->768) and row count (2048, 4096),
an input ``X`` (requiring grad, as inside a network) and an output gradient ``dY`` are fixed, and
``y = layer(X); y.backward(dY)`` is timed for ``nn.Linear`` and for ``RandomizedLinear`` with each
sketch and rate, all sharing one weight. Configurations run interleaved round-robin after a
warm-up, with the device synchronized around each sample; the ratio is the median over rounds of
(time / nn.Linear's time in the same round). Saved bytes come from ``SavedTensorMeter``
(activation storages saved for backward, the weight excluded).

    PYTHONPATH=src python scripts/bench_layer.py --device cpu
    PYTHONPATH=src python scripts/bench_layer.py --quick          # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from sketchprop import RandomizedLinear  # noqa: E402
from sketchprop.measure import SavedTensorMeter  # noqa: E402

RECOMMENDED = {"cpu": "blocksrht", "cuda": "blocksrht"}


def bench_group(n_in, n_out, rows, specs, rhos, args, dev, dtype) -> dict:
    torch.manual_seed(0)
    lin = nn.Linear(n_in, n_out, device=dev, dtype=dtype)
    x = torch.randn(rows, n_in, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, n_out, device=dev, dtype=dtype)
    layers: dict[str, tuple[nn.Module, str, float | None]] = {"nn.Linear": (lin, "nn.Linear", None)}
    for spec in specs:
        sk = bu.sketch_from_spec(spec)
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
    bu.sync(dev)
    t0 = time.perf_counter()
    fns["nn.Linear"]()
    bu.sync(dev)
    inner = max(1, math.ceil(args.min_sample_ms / 1000 / max(time.perf_counter() - t0, 1e-6)))
    times = bu.interleaved_times(fns, dev, warmup=args.warmup, repeats=args.repeats, inner=inner,
                                 base="nn.Linear", every=args.every)
    stats = bu.ratio_stats(times, "nn.Linear")
    configs = {}
    for name, (_, spec, rho) in layers.items():
        configs[name] = {"sketch": spec, "rho": rho, "saved_bytes": saved[name],
                         "saved_ratio": saved[name] / saved["nn.Linear"], **stats[name]}
    return {"shape": f"{n_in}x{n_out}", "rows": rows, "inner": inner, "configs": configs}


def group_table(g: dict, specs, rhos) -> str:
    c = g["configs"]
    headers = ["sketch"] + [f"time @{r:g}" for r in rhos] + [f"bytes @{r:g}" for r in rhos]
    rows = [["nn.Linear"] + [bu.r3(1.0)] * len(rhos) + [bu.r3(1.0)] * len(rhos)]
    for spec in specs:
        if f"{spec}@1" in c:  # exact: one rate
            e = c[f"{spec}@1"]
            rows.append([spec] + [bu.r3(e["ratio"])] * len(rhos) + [bu.r3(e["saved_ratio"])] *
                        len(rhos))
            continue
        rows.append([spec] + [bu.r3(c[f"{spec}@{r:g}"]["ratio"]) for r in rhos]
                    + [bu.r3(c[f"{spec}@{r:g}"]["saved_ratio"]) for r in rhos])
    base_ms = 1000 * c["nn.Linear"]["median_s"]
    title = (f"{g['shape']} layer, {g['rows']} rows: fwd+bwd time and saved bytes / nn.Linear "
             f"(nn.Linear {base_ms:.2f} ms)")
    return bu.fmt_table(headers, rows, title)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="768x768,768x3072,3072x768")
    p.add_argument("--rows", default="2048,4096")
    p.add_argument("--sketches", default="exact,gaussian,rademacher,dct,dft,blocksrht,rowsample,importance",
                   help="names in SKETCHES, or blocksrht:B for block size B")
    p.add_argument("--rhos", default="0.5,0.2,0.1")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-sample-ms", type=float, default=20.0)
    p.add_argument("--every", type=int, default=2, help="configurations between baseline samples")
    bu.add_threads_arg(p)
    p.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat: a smoke test")
    p.add_argument("--out-dir", default=None, help="default results/bench")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.rows = "32x64,64x32", "64"
        args.warmup, args.repeats, args.min_sample_ms = 1, 2, 0.0
    dev = bu.setup_device(args.device, args.threads)
    dtype = getattr(torch, args.dtype)
    env = bu.environment(dev)
    print(json.dumps(env), flush=True)
    specs = bu.parse_list(args.sketches)
    rhos = bu.parse_list(args.rhos, float)
    groups = []
    for rows in bu.parse_list(args.rows, int):
        for shape in bu.parse_list(args.shapes):
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
                cells.append(bu.r3(cfg["ratio"]) if cfg else "")
        summary_rows.append([g["shape"], g["rows"]] + cells)
    heads = ["shape", "rows"] + [f"{s} @{r:g}" for r in rhos for s in (rec, "gaussian")]
    summary = bu.fmt_table(heads, summary_rows,
                           f"Summary: fwd+bwd time / nn.Linear, recommended sketch ({rec}) and "
                           "dense Gaussian")
    text = "\n\n".join([group_table(g, specs, rhos) for g in groups] + [summary])
    stem = f"layer_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    bu.write_outputs(stem, {"environment": env, "args": vars(args), "groups": groups}, text,
                     args.out_dir)
    print("\n" + summary)


if __name__ == "__main__":
    main()
