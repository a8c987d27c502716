"""Is ``.backward()`` slow? The forum case timed like for like, and the overhead of our Function.

1. The forum case, a user's report that ``.backward()`` ran about 5x slower than a hand-written
   gradient: least squares ``min_w |X(w) - t|^2`` by gradient descent, ``X`` an
   ``nn.Linear(2048, 256)``, 100 rows. Three timings:

   - ``naive``: as posted: autograd first and cold (no warm-up), computing gradients of the
     weight and bias that nobody uses, against the hand-written update timed second;
   - ``fair``: warm-up, synchronize, the weight frozen and no bias (the hand-written update
     computes only ``dL/dw = (X(w) - t) W`` too), both sides interleaved in blocks of iterations;
   - ``fair+loss``: as ``fair``, but the hand-written side also evaluates the loss value, as the
     autograd side must.

2. Our autograd Function on its ``exact`` path (``RandomizedLinear(sketch="exact")``: ``S = I``,
   stores ``X``) against ``nn.Linear``, forward + backward, on the roberta-base shapes, the forum
   shape and a small shape where per-call Python overhead shows; and one training step of a whole
   model (MiniLM where available, else a small BERT) with every linear layer patched that way.
"""

from __future__ import annotations

import json
import time

import torch
from torch import nn

from sketchprop import RandomizedLinear, patch_linear, unpatch_linear

from .common import (
    default_glue_dir,
    environment,
    fmt_table,
    interleaved_times,
    r3,
    ratio_stats,
    setup_device,
    sync,
    write_outputs,
)
from .models import build_model, make_batch, make_step, minilm_path, to_device


def forum(dev, args) -> dict:
    """The forum case: the naive timing as posted, the fair one, and the fair one with the loss."""
    torch.manual_seed(0)
    d_in, d_out, bsz, eta = 2048, 256, 100, 0.01
    if args.quick:
        d_in, d_out = 64, 16
    iters = args.iters

    # naive, as posted: autograd first (cold), weight and bias gradients computed, then manual.
    lin = nn.Linear(d_in, d_out).to(dev)
    target = torch.randn(bsz, d_out, device=dev)
    w = torch.zeros(bsz, d_in, device=dev, requires_grad=True)
    t0 = time.perf_counter()
    for _ in range(iters):
        res = lin(w) - target
        loss = 0.5 * (res**2).sum()
        loss.backward()
        w.data = w.data.add(-eta * w.grad)
        lin.weight.grad.zero_()
        w.grad.zero_()
    sync(dev)
    naive_auto = time.perf_counter() - t0
    w = torch.zeros(bsz, d_in, device=dev, requires_grad=True)
    t0 = time.perf_counter()
    for _ in range(iters):
        res = lin(w) - target
        w.data = w.data.add(-eta * lin.weight.data.t().mm(res.T).T)
    sync(dev)
    naive_manual = time.perf_counter() - t0

    # fair: frozen weight, no bias, warm-up, synchronize, interleaved blocks of iterations.
    lin = nn.Linear(d_in, d_out, bias=False).to(dev)
    lin.weight.requires_grad_(False)
    weight = lin.weight
    w_a = torch.zeros(bsz, d_in, device=dev, requires_grad=True)
    w_m = torch.zeros(bsz, d_in, device=dev)
    w_l = torch.zeros(bsz, d_in, device=dev)

    def autograd_block():
        for _ in range(args.block):
            res = lin(w_a) - target
            loss = 0.5 * (res**2).sum()
            loss.backward()
            with torch.no_grad():
                w_a.sub_(eta * w_a.grad)
            w_a.grad = None

    def manual_block():
        with torch.no_grad():
            for _ in range(args.block):
                res = lin(w_m) - target
                w_m.sub_(eta * (res @ weight))

    def manual_loss_block():
        with torch.no_grad():
            for _ in range(args.block):
                res = lin(w_l) - target
                loss = 0.5 * (res**2).sum()  # noqa: F841  (the value autograd also computes)
                w_l.sub_(eta * (res @ weight))

    times = interleaved_times({"autograd": autograd_block, "manual": manual_block,
                               "manual+loss": manual_loss_block}, dev,
                              warmup=args.warmup, repeats=args.repeats, base="manual")
    stats = ratio_stats(times, "manual")
    # Same work on both sides: from the same start, one block of each gives the same iterate.
    with torch.no_grad():
        w_a.zero_()
    w_m.zero_()
    autograd_block()
    manual_block()
    agree = torch.allclose(w_a.detach(), w_m, rtol=1e-4, atol=1e-6)
    return {
        "shape": {"in": d_in, "out": d_out, "rows": bsz, "iters": iters, "block": args.block},
        "naive": {"autograd_s": naive_auto, "manual_s": naive_manual,
                  "ratio": naive_auto / naive_manual},
        "fair": {k: {"per_iter_ms": 1000 * v["median_s"] / args.block, "ratio": v["ratio"]}
                 for k, v in stats.items()},
        "same_iterates": bool(agree),
    }


def exact_path(dev, args) -> dict:
    """Our Function's ``exact`` path against ``nn.Linear``, forward + backward, per layer shape."""
    shapes = [(768, 3072, 2048), (768, 768, 2048), (3072, 768, 2048), (2048, 256, 100),
              (64, 64, 32)]
    if args.quick:
        shapes = [(32, 64, 64), (64, 16, 8)]
    out = {}
    for n_in, n_out, rows in shapes:
        torch.manual_seed(0)
        lin = nn.Linear(n_in, n_out, device=dev)
        ours = RandomizedLinear.from_linear(lin, sketch="exact", rho=1.0)
        x = torch.randn(rows, n_in, device=dev, requires_grad=True)
        dy = torch.randn(rows, n_out, device=dev)

        def runner(layer, x=x, dy=dy, lin=lin):
            def fn():
                x.grad = lin.weight.grad = lin.bias.grad = None
                layer(x).backward(dy)
            return fn

        fn_nn, fn_ours = runner(lin), runner(ours)
        fn_nn()
        sync(dev)
        t0 = time.perf_counter()
        fn_nn()
        sync(dev)
        one = max(time.perf_counter() - t0, 1e-6)
        inner = max(1, int(args.min_sample_ms / 1000 / one))
        times = interleaved_times({"nn.Linear": fn_nn, "exact sketch": fn_ours}, dev,
                                  warmup=args.warmup, repeats=args.repeats, inner=inner,
                                  base="nn.Linear", every=1)
        st = ratio_stats(times, "nn.Linear")
        out[f"{n_in}x{n_out}, {rows} rows"] = {
            "nn_ms": 1000 * st["nn.Linear"]["median_s"],
            "ours_ms": 1000 * st["exact sketch"]["median_s"],
            "ratio": st["exact sketch"]["ratio"], "inner": inner}
        print(f"  exact path {n_in}x{n_out} rows={rows}: ratio {st['exact sketch']['ratio']:.3f}",
              flush=True)
    return out


def exact_model(dev, args) -> dict:
    """One training step of MiniLM (a tiny BERT with ``--quick``), every linear layer on the
    ``exact`` path, against the unpatched model."""
    name = "minilm"
    model = build_model(name, args.quick).to(dev).train()
    args.batch, args.seq, args.task = (4, 32, "MRPC") if args.quick else (16, 128, "MRPC")
    args.glue_dir = default_glue_dir()
    batch, info = make_batch(name, model, args)
    batch = to_device(batch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = make_step(model, batch, opt)

    def patched():
        # Like for like: every row kept (skip_padding would also drop padding rows from dW).
        patch_linear(model, sketch="exact", rho=1.0, share_inputs=False, skip_padding=False)
        try:
            step()
        finally:
            unpatch_linear(model)

    times = interleaved_times({"nn.Linear": step, "exact sketch": patched}, dev,
                              warmup=args.warmup, repeats=args.repeats, base="nn.Linear",
                              every=1)
    st = ratio_stats(times, "nn.Linear")
    return {"model": "all-MiniLM-L6-v2" if minilm_path() and not args.quick else "tiny BERT",
            "batch": f"{args.batch}x{args.seq}", "nn_s": st["nn.Linear"]["median_s"],
            "ours_s": st["exact sketch"]["median_s"], "ratio": st["exact sketch"]["ratio"]}


def run(args) -> None:
    """The study as ``scripts/backward_overhead.py`` runs it (its options in ``args``): write
    ``overhead_<device>[_quick]<tag>.{json,md}`` and print the tables."""
    if args.quick:
        args.iters, args.block, args.repeats, args.warmup, args.min_sample_ms = 5, 2, 2, 1, 0.0
    dev = setup_device(args.device, args.threads)
    env = environment(dev)
    print(json.dumps(env), flush=True)
    res = {"forum": forum(dev, args)}
    print(f"  forum: {json.dumps(res['forum']['fair'])}", flush=True)
    res["exact_path"] = exact_path(dev, args)
    if not args.skip_model:
        res["exact_model"] = exact_model(dev, args)

    f = res["forum"]
    t1 = fmt_table(
        ["timing", "autograd / hand-written"],
        [["naive (as posted: autograd first and cold, weight+bias grads)",
          r3(f["naive"]["ratio"])],
         ["fair (warm-up, sync, same gradients, interleaved)",
          r3(f["fair"]["autograd"]["ratio"])],
         ["fair, hand-written side also computes the loss",
          r3(f["fair"]["autograd"]["ratio"] / f["fair"]["manual+loss"]["ratio"])]],
        f"Forum case: least squares, Linear({f['shape']['in']}, {f['shape']['out']}), "
        f"{f['shape']['rows']} rows; per iteration: autograd "
        f"{f['fair']['autograd']['per_iter_ms']:.3f} ms, hand-written "
        f"{f['fair']['manual']['per_iter_ms']:.3f} ms; same iterates: {f['same_iterates']}")
    rows = [[k, f"{v['nn_ms']:.3f}", f"{v['ours_ms']:.3f}", r3(v["ratio"])]
            for k, v in res["exact_path"].items()]
    if "exact_model" in res:
        m = res["exact_model"]
        rows.append([f"{m['model']} training step {m['batch']}, all linears",
                     f"{1000 * m['nn_s']:.1f}", f"{1000 * m['ours_s']:.1f}", r3(m["ratio"])])
    t2 = fmt_table(["layer (fwd+bwd)", "nn.Linear ms", "exact sketch ms", "ratio"], rows,
                   "Our autograd Function on the exact path vs nn.Linear")
    text = t1 + "\n\n" + t2
    stem = f"overhead_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    write_outputs(stem, {"environment": env, "args": vars(args), **res}, text, args.out_dir)
    print("\n" + text)
