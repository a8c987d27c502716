"""Bias and variance of the few-bit GELU codes against exact GELU, on real activations.

all-MiniLM-L6-v2 (pretrained, new classifier head) on CoLA training batches (32 sentences, dynamic
padding, at most 128 tokens, as the CPU recipe trains), in eval mode so that no dropout mask
differs between the runs compared. For each code of :mod:`sketchprop.activations` (``stochastic``,
``optimal``) and ``b = 1..4`` bits:

- **dX of each GELU** (the 6 ``intermediate_act_fn``): the exact ``dX = dY * GELU'(x)`` against the
  code's ``dY * level(code(x))``, with ``x`` and ``dY`` captured from an exact backward. The
  stochastic code's variance is computed in closed form (a two-point variable per element:
  ``step^2 f (1 - f)``, ``f`` the position of ``GELU'(x)`` between its two levels), its bias from
  ``--draws`` draws of the real ``CompactGELU`` (``|mean - dX|^2`` beside its expectation
  without bias, ``V / draws``). The optimal code is fit on the first batch (as in training:
  ``GeluCode.fit`` on the first batch a module sees) and measured on the others: its error is
  all bias.
- **The model's parameter gradient** (every parameter): the model patched with
  ``patch_activations(dropout="stored", attention="stored", gelu_bits=b, gelu_code=...)``
  against the unpatched model on the same batch; the error there is what training sees (dX's
  error propagated through every layer below). For the stochastic code, ``--draws`` backward
  passes per batch give the variance and the bias as above.

Values are sums over the held-out batches of the error divided by sums of ``|dX|^2`` (or
``|G|^2``), for two weight states: the pretrained model (step 0) and after ``--steps`` exact AdamW
steps at the CPU recipe's learning rate. The default code follows from these tables (the
docstring of ``sketchprop.activations``).
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from sketchprop import activations as act
from sketchprop import patch_activations

from . import importance_variance as iv
from .common import BadArgs, environment, fmt_table, parse_list, setup_device, write_outputs
from .models import build_model, minilm_path

# The GELU codes compared (sketchprop.activations.GeluCode).
CODES = ("stochastic", "optimal")


def gelu_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's exact GELU modules by name."""
    return {n: m for n, m in model.named_modules() if act.is_exact_gelu(m)}


def capture(model: nn.Module, batch: dict) -> tuple[dict, dict]:
    """``({gelu: (x, dY)}, {parameter: exact gradient})`` of one exact backward."""
    store: dict[str, list] = {}
    hooks = []
    for name, mod in gelu_modules(model).items():
        def fwd(m, inp, out, name=name):
            store[name] = [inp[0].detach().double()]
            out.register_hook(lambda g: store[name].append(g.detach().double()))
        hooks.append(mod.register_forward_hook(fwd))
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    for h in hooks:
        h.remove()
    return ({n: tuple(v) for n, v in store.items()},
            {n: p.grad.detach().double().clone() for n, p in model.named_parameters()})


def stochastic_moments(code: act.GeluCode, g: torch.Tensor) -> torch.Tensor:
    """Per-element variance of the stochastic code's level for derivative values ``g``."""
    lo, step = code.levels[0], code.levels[1] - code.levels[0]
    v = ((g - lo) / step).clamp(0, 2**code.bits - 1)
    frac = v - v.floor()
    return step**2 * frac * (1 - frac)


def code_draws(code: act.GeluCode, x: torch.Tensor, dy: torch.Tensor, draws: int) -> torch.Tensor:
    """``draws`` values of the code's ``dX`` through the real ``CompactGELU`` backward."""
    fn = act._CompactGeluFunction
    out = []
    for _ in range(draws):
        xx = x.float().requires_grad_(True)
        (dx,) = torch.autograd.grad(fn.apply(xx, code), xx, dy.float())
        out.append(dx.double())
    return torch.stack(out)


def grad_draws(model, batch, bits, code_name, calib, draws) -> list[dict]:
    """Parameter gradients of ``draws`` backward passes of the model with compact GELU."""
    patched = copy.deepcopy(model)
    patch_activations(patched, dropout="stored", attention="stored", gelu_bits=bits,
                      gelu_code=code_name)
    if code_name == "optimal":
        for name in gelu_modules(model):
            patched.get_submodule(name).fitted = act.GeluCode.fit(calib[name].float(), bits)
        draws = 1
    out = []
    for _ in range(draws):
        patched.zero_grad(set_to_none=True)
        patched(**batch).loss.backward()
        out.append({n: p.grad.detach().double().clone() for n, p in patched.named_parameters()})
    return out


def measure_state(model: nn.Module, data: list[dict], args) -> dict:
    calib_x, _ = capture(model, data[0])
    calib = {n: x for n, (x, _) in calib_x.items()}
    per_batch: list[dict] = []  # {key: {quantity: value}} of each held-out batch

    def add(key, **values):
        acc = per_batch[-1].setdefault(key, {})
        for k, v in values.items():
            acc[k] = acc.get(k, 0.0) + float(v)

    for j, batch in enumerate(data[1:]):
        per_batch.append({})
        torch.manual_seed(j)
        acts, exact = capture(model, batch)
        for bits in args.bit_list:
            for code_name in CODES:
                key = f"{code_name}:{bits}"
                for name, (x, dy) in acts.items():
                    g = act.gelu_derivative(x).double()
                    dx = dy * g
                    if code_name == "stochastic":
                        code = act.GeluCode.uniform(bits)
                        var = (dy.square() * stochastic_moments(code, g)).sum()
                        d = code_draws(code, x, dy, args.draws)
                        mean = d.mean(0)
                        add(key, dx_norm=dx.square().sum(), dx_var=var,
                            dx_var_mc=(d - mean).square().sum() / (args.draws - 1),
                            dx_mean_err=(mean - dx).square().sum(), dx_noise=var / args.draws)
                    else:
                        code = act.GeluCode.fit(calib[name].float(), bits)
                        (d,) = code_draws(code, x, dy, 1)
                        add(key, dx_norm=dx.square().sum(), dx_var=0.0, dx_var_mc=0.0,
                            dx_mean_err=(d - dx).square().sum(), dx_noise=0.0)
                gs = grad_draws(model, batch, bits, code_name, calib, args.draws)
                for n in exact:
                    mean = sum(g[n] for g in gs) / len(gs)
                    var = (sum((g[n] - mean).square().sum() for g in gs) / (len(gs) - 1)
                           if len(gs) > 1 else 0.0)
                    add(f"{key}/{n}", norm=exact[n].square().sum(), var=var,
                        mean_err=(mean - exact[n]).square().sum(), noise=var / len(gs))
        print(f"  batch {j + 1}/{len(data) - 1}", flush=True)
    linear = [n for n, p in model.named_parameters()
              if ".encoder." in n and n.endswith(".weight") and p.dim() == 2]
    sums = {key: {q: sum(b[key][q] for b in per_batch) for q in qs}
            for key, qs in per_batch[0].items()}

    def bias2(err: str, noise: str, norms: dict[str, float], keys: list[str]) -> tuple:
        """Relative bias^2 (mean error less its no-bias level, summed over batches and
        ``keys``, each key's share divided by its ``norms`` entry, averaged over the keys) and
        its standard error from the spread of the per-batch shares."""
        shares = [sum((b[k][err] - b[k][noise]) / norms[k] for k in keys) / len(keys)
                  for b in per_batch]
        n = len(shares)
        mean = sum(shares) / n
        spread = sum((x - mean) ** 2 for x in shares) / (n - 1) if n > 1 else float("nan")
        return sum(shares), (n * spread) ** 0.5

    out = {}
    for key, s in sums.items():
        if "/" in key:
            continue
        params = [f"{key}/{n}" for n, _ in model.named_parameters()]
        total = {f: sum(sums[p][f] for p in params) for f in ("norm", "var", "mean_err", "noise")}
        code_name, bits = key.split(":")
        dx_bias, dx_se = bias2("dx_mean_err", "dx_noise", {key: s["dx_norm"]}, [key])
        g_bias, g_se = bias2("mean_err", "noise", dict.fromkeys(params, total["norm"]),
                             params)
        g_bias, g_se = g_bias * len(params), g_se * len(params)  # a sum over parameters
        lin = [f"{key}/{n}" for n in linear]
        lin_bias, lin_se = bias2("mean_err", "noise", {k: sums[k]["norm"] for k in lin}, lin)
        out[key] = {
            "code": code_name, "bits": int(bits),
            "dx_rel_bias2": dx_bias, "dx_rel_bias2_se": dx_se,
            "dx_rel_var": s["dx_var"] / s["dx_norm"],
            "dx_rel_var_mc": s["dx_var_mc"] / s["dx_norm"],
            "dx_rel_mean_err": s["dx_mean_err"] / s["dx_norm"],
            "dx_rel_noise": s["dx_noise"] / s["dx_norm"],
            "g_rel_bias2": g_bias, "g_rel_bias2_se": g_se,
            "g_rel_var": total["var"] / total["norm"],
            "g_rel_mean_err": total["mean_err"] / total["norm"],
            "g_rel_noise": total["noise"] / total["norm"],
            # Per encoder linear weight, then averaged: comparable with the sketches' relative
            # variance V / |X^T dY|^2 (results/bench/importance_variance.md).
            "linear_rel_bias2": lin_bias, "linear_rel_bias2_se": lin_se,
            "linear_rel_var": sum(sums[k]["var"] / sums[k]["norm"] for k in lin) / len(lin),
            "per_batch": per_batch_summary(per_batch, key),
        }
    return out


def per_batch_summary(per_batch: list[dict], key: str) -> list[dict]:
    """The dX quantities of ``key`` in each batch (for the JSON)."""
    return [dict(b[key]) for b in per_batch]


def sig(x: float) -> str:
    """``x`` to three significant digits."""
    return f"{x:.3g}"


def pm(row: dict, key: str) -> str:
    """``value +- standard error`` for the stochastic code, the exact value for the optimal one."""
    if row["code"] != "stochastic":
        return sig(row[key])
    return f"{sig(row[key])} +- {sig(row[key + '_se'])}"


def tables(payload: dict) -> str:
    out = []
    for state, rows in payload["results"].items():
        lines = []
        for r in rows.values():
            lines.append([
                r["code"], str(r["bits"]), f"{r['bits'] / 32:.4f}",
                pm(r, "dx_rel_bias2"), sig(r["dx_rel_var"]),
                f"{sig(r['dx_rel_mean_err'])} / {sig(r['dx_rel_noise'])}",
                pm(r, "g_rel_bias2"), sig(r["g_rel_var"]),
                f"{sig(r['g_rel_mean_err'])} / {sig(r['g_rel_noise'])}",
                pm(r, "linear_rel_bias2"), sig(r["linear_rel_var"]),
            ])
        out.append(fmt_table(
            ["code", "bits", "bytes / float", "dX bias^2", "dX var",
             "dX mean err / no-bias level", "G bias^2", "G var", "G mean err / no-bias level",
             "linear W bias^2", "linear W var"], lines,
            title=f"{state}: errors relative to the exact |dX|^2 (6 GELU layers), |G|^2 (every "
                  f"parameter) and each encoder linear weight's |dW|^2 (mean over the 36), "
                  f"summed over {payload['args']['batches']} held-out batches; "
                  f"{payload['args']['draws']} draws per batch for the stochastic code"))
    return "\n\n".join(out) + (
        "\n\nbias^2 = |E[estimate] - exact|^2. For the stochastic code E is the mean of the draws:"
        " its bias^2 is |mean - exact|^2 less the draws' own noise V / draws (the 'no-bias"
        " level'), +- its standard error from the spread over the batches: within two or three"
        " of it of 0 is no measurable bias. Its dX var is the closed form (the draws' sample"
        " variance is in the JSON, dx_rel_var_mc). The optimal code is"
        " deterministic: all its error is bias. Parameter-gradient errors include the propagation"
        " of dX's error through every layer below.\n")


def run(args) -> None:
    """The study as ``scripts/gelu_bits.py`` runs it (its options in ``args``): write
    ``gelu_bits[_quick].{json,md}`` and print the tables. Bad options raise :class:`BadArgs`
    before any work."""
    args.bit_list = parse_list(args.bits, int)
    if not args.bit_list or not all(1 <= b <= 8 for b in args.bit_list):
        raise BadArgs(f"--bits must be integers in 1..8, got {args.bits}")
    if args.quick:
        args.steps, args.batches, args.draws, args.batch = 3, 2, 4, 8
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    print(env, flush=True)
    model = build_model("minilm", args.quick)
    tokenizer = None
    if not args.quick:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    # importance_variance's batches: the same CoLA order; its "warmup" slot is the calibration.
    data = iv.batches(argparse.Namespace(steps=args.steps, warmup=1, batches=args.batches,
                                         batch=args.batch, max_length=args.max_length,
                                         glue_dir=args.glue_dir),
                      tokenizer, model.config.vocab_size)
    train, held_out = data[:args.steps], data[args.steps:]
    results = {}
    for state in ("step 0", f"step {args.steps}"):
        if state != "step 0":
            model.train()
            iv.train_exact(model, train, args.steps, args.lr)
        model.eval()
        print(state, flush=True)
        results[state] = measure_state(model, held_out, args)
    payload = {"environment": env, "args": {k: v for k, v in vars(args).items()},
               "results": results}
    write_outputs("gelu_bits" + ("_quick" if args.quick else ""), payload, tables(payload),
                  args.out_dir)
    print(tables(payload))
