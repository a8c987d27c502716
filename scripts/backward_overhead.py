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

    PYTHONPATH=src python scripts/backward_overhead.py --device cpu
    PYTHONPATH=src python scripts/backward_overhead.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from sketchprop import RandomizedLinear, patch_linear, unpatch_linear  # noqa: E402


def forum(dev, args) -> dict:
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
    bu.sync(dev)
    naive_auto = time.perf_counter() - t0
    w = torch.zeros(bsz, d_in, device=dev, requires_grad=True)
    t0 = time.perf_counter()
    for _ in range(iters):
        res = lin(w) - target
        w.data = w.data.add(-eta * lin.weight.data.t().mm(res.T).T)
    bu.sync(dev)
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

    times = bu.interleaved_times({"autograd": autograd_block, "manual": manual_block,
                                  "manual+loss": manual_loss_block}, dev,
                                 warmup=args.warmup, repeats=args.repeats, base="manual")
    stats = bu.ratio_stats(times, "manual")
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
        bu.sync(dev)
        t0 = time.perf_counter()
        fn_nn()
        bu.sync(dev)
        one = max(time.perf_counter() - t0, 1e-6)
        inner = max(1, int(args.min_sample_ms / 1000 / one))
        times = bu.interleaved_times({"nn.Linear": fn_nn, "exact sketch": fn_ours}, dev,
                                     warmup=args.warmup, repeats=args.repeats, inner=inner,
                                     base="nn.Linear", every=1)
        st = bu.ratio_stats(times, "nn.Linear")
        out[f"{n_in}x{n_out}, {rows} rows"] = {
            "nn_ms": 1000 * st["nn.Linear"]["median_s"],
            "ours_ms": 1000 * st["exact sketch"]["median_s"],
            "ratio": st["exact sketch"]["ratio"], "inner": inner}
        print(f"  exact path {n_in}x{n_out} rows={rows}: ratio {st['exact sketch']['ratio']:.3f}",
              flush=True)
    return out


def exact_model(dev, args) -> dict:
    import bench_model as bm

    name = "minilm"
    model = bm.build_model(name, args.quick).to(dev).train()
    args.batch, args.seq, args.task = (4, 32, "MRPC") if args.quick else (16, 128, "MRPC")
    args.glue_dir = bm.default_glue_dir()
    batch, info = bm.make_batch(name, model, args)
    batch = bm.to_device(batch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = bm.make_step(model, batch, opt)

    def patched():
        # Like for like: every row kept (skip_padding would also drop padding rows from dW).
        patch_linear(model, sketch="exact", rho=1.0, share_inputs=False, skip_padding=False)
        try:
            step()
        finally:
            unpatch_linear(model)

    times = bu.interleaved_times({"nn.Linear": step, "exact sketch": patched}, dev,
                                 warmup=args.warmup, repeats=args.repeats, base="nn.Linear",
                                 every=1)
    st = bu.ratio_stats(times, "nn.Linear")
    return {"model": "all-MiniLM-L6-v2" if bm.minilm_path() and not args.quick else "tiny BERT",
            "batch": f"{args.batch}x{args.seq}", "nn_s": st["nn.Linear"]["median_s"],
            "ours_s": st["exact sketch"]["median_s"], "ratio": st["exact sketch"]["ratio"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=200, help="iterations of the naive forum timing")
    p.add_argument("--block", type=int, default=50, help="iterations per fair timing sample")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--min-sample-ms", type=float, default=30.0)
    bu.add_threads_arg(p)
    p.add_argument("--skip-model", action="store_true", help="leave out the whole-model step")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.block, args.repeats, args.warmup, args.min_sample_ms = 5, 2, 2, 1, 0.0
    dev = bu.setup_device(args.device, args.threads)
    env = bu.environment(dev)
    print(json.dumps(env), flush=True)
    res = {"forum": forum(dev, args)}
    print(f"  forum: {json.dumps(res['forum']['fair'])}", flush=True)
    res["exact_path"] = exact_path(dev, args)
    if not args.skip_model:
        res["exact_model"] = exact_model(dev, args)

    f = res["forum"]
    t1 = bu.fmt_table(
        ["timing", "autograd / hand-written"],
        [["naive (as posted: autograd first and cold, weight+bias grads)",
          bu.r3(f["naive"]["ratio"])],
         ["fair (warm-up, sync, same gradients, interleaved)",
          bu.r3(f["fair"]["autograd"]["ratio"])],
         ["fair, hand-written side also computes the loss",
          bu.r3(f["fair"]["autograd"]["ratio"] / f["fair"]["manual+loss"]["ratio"])]],
        f"Forum case: least squares, Linear({f['shape']['in']}, {f['shape']['out']}), "
        f"{f['shape']['rows']} rows; per iteration: autograd "
        f"{f['fair']['autograd']['per_iter_ms']:.3f} ms, hand-written "
        f"{f['fair']['manual']['per_iter_ms']:.3f} ms; same iterates: {f['same_iterates']}")
    rows = [[k, f"{v['nn_ms']:.3f}", f"{v['ours_ms']:.3f}", bu.r3(v["ratio"])]
            for k, v in res["exact_path"].items()]
    if "exact_model" in res:
        m = res["exact_model"]
        rows.append([f"{m['model']} training step {m['batch']}, all linears",
                     f"{1000 * m['nn_s']:.1f}", f"{1000 * m['ours_s']:.1f}", bu.r3(m["ratio"])])
    t2 = bu.fmt_table(["layer (fwd+bwd)", "nn.Linear ms", "exact sketch ms", "ratio"], rows,
                      "Our autograd Function on the exact path vs nn.Linear")
    text = t1 + "\n\n" + t2
    stem = f"overhead_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    bu.write_outputs(stem, {"environment": env, "args": vars(args), **res}, text, args.out_dir)
    print("\n" + text)


if __name__ == "__main__":
    main()
