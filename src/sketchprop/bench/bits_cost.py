"""Where the time of b-bit stored rows goes: each phase of ``sketchprop.quantize`` on one layer's
rows, against the weight-gradient product that backward computes from them.

For a ``rows x cols`` input (default 807 x 3072: the non-padding rows of a roberta-base batch of
16 x 128 at MRPC's lengths, into the intermediate layer's 3072 columns) and each code width, timed
interleaved with ``quantize`` as the baseline (:func:`sketchprop.bench.common.interleaved_times`):

- ``grid``: each group's bfloat16 ends and every value's position on its grid (``_grid``);
- ``dither``: the 16-bit uniform draws of the stochastic rounding (``sketchprop.rng.dither16``);
- ``round``: adding the dither, flooring and casting to uint8;
- ``pack``: ``8 / bits`` codes per byte (``sketchprop.packing.pack_codes``);
- ``quantize``: the whole call, one fused function (compiled where a compiler works: then less
  than the sum of the eager phases above);
- ``dequantize``: the decode backward does before its product;
- ``dW product``: ``dY^T X`` for a ``rows x 768`` output gradient, the full-size product backward
  computes from the decoded rows (as it does from ``X`` without codes).
"""

from __future__ import annotations

import torch

from sketchprop import quantize as q
from sketchprop.packing import pack_codes
from sketchprop.rng import dither16

from .common import (
    environment,
    fmt_table,
    interleaved_times,
    parse_list,
    r3,
    ratio_stats,
    setup_device,
    write_outputs,
)

PHASES = ("quantize", "grid", "dither", "round", "pack", "dequantize", "dW product")


def phases(a: torch.Tensor, dy: torch.Tensor, bits: int, group: int) -> dict:
    """One callable per phase, each on the same inputs (the phases eagerly; ``quantize`` and
    ``dequantize`` as the library runs them: fused, compiled where a compiler works)."""
    x = q._grouped(a, group)
    t, _, _ = q._grid(x, bits)
    key = torch.tensor(1, device=a.device)
    u = dither16(key, 0, t.numel()).view_as(t)
    codes = (t + u).floor().clamp(max=(1 << bits) - 1).to(torch.uint8)
    payload, spec, _ = q.quantize(a, bits, group, seed=1)
    return {
        "quantize": lambda: q.quantize(a, bits, group, seed=1),
        "grid": lambda: q._grid(x, bits),
        "dither": lambda: dither16(key, 0, t.numel()),
        "round": lambda: (t + u).floor().clamp(max=(1 << bits) - 1).to(torch.uint8),
        "pack": lambda: pack_codes(codes, bits),
        "dequantize": lambda: q.dequantize(payload, spec),
        "dW product": lambda: dy.T.mm(a),
    }


def run(args) -> None:
    """The study as ``scripts/bits_cost.py`` runs it (its options in ``args``): write
    ``bits_cost[_quick].{json,md}`` and print the table."""
    widths = parse_list(args.bits, int)
    for b in widths:
        q.check_bits(b)
    if args.quick:
        args.rows, args.cols, args.out_features, args.repeats = 37, 256, 64, 3
    dev = setup_device(args.device, args.threads)
    env = environment(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(args.rows, args.cols, generator=g, device=dev)
    dy = torch.randn(args.rows, args.out_features, generator=g, device=dev)
    results, rows = {}, []
    for bits in widths:
        fns = phases(a, dy, bits, args.group)
        stats = ratio_stats(interleaved_times(fns, dev, warmup=2, repeats=args.repeats,
                                              base="quantize", every=3), "quantize")
        results[f"int{bits}"] = stats
        product = stats["dW product"]["median_s"]
        for name in PHASES:
            s = stats[name]
            rows.append([f"int{bits}", name, f"{1e3 * s['median_s']:.2f}",
                         f"{r3(s['ratio'])} ({s['ratio_q1']:.2f}-{s['ratio_q3']:.2f})",
                         r3(s["median_s"] / product)])
        print(f"int{bits}: " + ", ".join(f"{n} {1e3 * stats[n]['median_s']:.2f} ms"
                                         for n in PHASES), flush=True)
    title = (f"b-bit stored rows, {args.rows} x {args.cols} input, group {args.group}, dW product "
             f"against a {args.rows} x {args.out_features} output gradient; median ms per call, "
             f"ratio to quantize's time in the same rounds (interquartile range), and to the dW "
             f"product's")
    tables = fmt_table(["code", "phase", "ms", "x quantize", "x dW product"], rows, title=title)
    payload = {"environment": env, "args": vars(args), "results": results}
    write_outputs("bits_cost" + ("_quick" if args.quick else ""), payload, tables, args.out_dir)
    print(tables)
