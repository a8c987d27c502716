"""Variance of each sketch's weight gradient on real activations and gradients, against Gaussian.

For every ``nn.Linear`` of the pretrained all-MiniLM-L6-v2 encoder (classifier and pooler excluded)
on real GLUE dev batches, the layer input ``X`` and output gradient ``dY`` of one training step are
captured, restricted to the non-padding rows (as ``skip_padding`` does), and each sketch's estimate
``(S^T dY)^T (S^T X)`` is drawn for ``--seeds`` seeds. The table gives the Monte-Carlo
``E |dW_hat - dW|_F^2`` relative to the Gaussian sketch's exact expected error at the same ``k``
(closed form ``(|X|^2 |Y|^2 + |X^T Y|^2) / k``):

- ``aggregate``: sum over layers of the error / sum of the Gaussian errors (total gradient noise);
- ``median`` / ``worst``: over layers of the per-layer ratio.

Besides the library's sketches (and ``blocksrht:B`` block sizes) it evaluates one research candidate
that is not in the library, ``normsys``: row sampling with inclusion probabilities proportional to
the row norms of ``X`` (known in forward), systematic sampling of exactly ``k`` rows, weights
``1/sqrt(pi_i)``; unbiased, but it needs ``O(k)`` data-dependent state in backward.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import torch
from torch import nn

from sketchprop.variance import expected_variance

from .common import environment, fmt_table, parse_list, pct, r3, setup_device, sketch_from_spec, write_outputs
from .models import build_model, make_batch

# Kinds of layers the tables break the errors down by.
KINDS = ["query", "key", "value", "attention.output", "intermediate", "output.dense"]


def kind_of(name: str) -> str:
    """The kind of a layer (one of :data:`KINDS`, else ``other``) from its qualified name."""
    for k in KINDS:
        if k in name and not (k == "output.dense" and "attention" in name):
            return k
    return "other"


def capture(model: nn.Module, batch: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, X, dY)`` on the non-padding rows, for each linear layer but the head."""
    store: dict[str, list] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and "classifier" not in name and "pooler" not in name:
            def hook(m, inp, out, name=name):
                store[name] = [inp[0].detach().reshape(-1, inp[0].shape[-1])]
                out.register_hook(lambda g: store[name].append(g.detach().reshape(-1, g.shape[-1])))
            hooks.append(mod.register_forward_hook(hook))
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    for h in hooks:
        h.remove()
    rows = batch["attention_mask"].reshape(-1).nonzero().squeeze(1)
    return [(n, x.index_select(0, rows).double().contiguous(), y.index_select(0, rows).double()
             .contiguous()) for n, (x, y) in store.items()]


def _cap_probs(w: torch.Tensor, k: int) -> torch.Tensor:
    """Inclusion probabilities ``min(1, c w_i)`` summing to ``k``."""
    w = w.double().clamp_min(1e-300)
    fixed = torch.zeros_like(w, dtype=torch.bool)
    pi = w
    for _ in range(64):
        c = (k - fixed.sum()) / w[~fixed].sum()
        pi = torch.where(fixed, torch.ones_like(w), c * w)
        new = pi >= 1
        if torch.equal(new, fixed):
            break
        fixed = new
    return pi.clamp_max(1.0)


def normsys_estimate(x, y, k, seed):
    """``normsys``: ``k`` rows drawn by systematic sampling with probabilities proportional to
    the row norms of ``x``, each weighted ``1/sqrt(pi_i)``."""
    pi = _cap_probs(x.norm(dim=1), k)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand((), generator=g, dtype=torch.float64)
    c = torch.cumsum(pi, 0)
    idx = torch.searchsorted(c, u + torch.arange(k, dtype=torch.float64), right=True)
    idx = idx.clamp_max(x.shape[0] - 1)
    w = pi[idx].rsqrt()[:, None]
    return (y[idx] * w).T @ (x[idx] * w)


def estimator(spec: str):
    """``(x, y, k, seed) -> dW estimate`` of a sketch spec (or ``normsys``)."""
    if spec == "normsys":
        return normsys_estimate
    sk = sketch_from_spec(spec)
    return lambda x, y, k, seed: sk.apply(y, k, seed).T @ sk.apply(x, k, seed)


def run(args) -> None:
    """The study as ``scripts/sketch_variance.py`` runs it (its options in ``args``): write
    ``variance[_quick].{json,md}`` and print the tables."""
    if args.quick:
        args.seeds, args.batch, args.seq = min(args.seeds, 4), 4, 32
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    print(env, flush=True)
    specs = parse_list(args.sketches)
    rhos = parse_list(args.rhos, float)
    ests = {s: estimator(s) for s in specs}
    err = defaultdict(dict)  # (rho, spec) -> {layer: mse}
    ref = defaultdict(dict)  # rho -> {layer: gaussian closed form}
    layer_info = {}
    model = build_model(args.model, args.quick).train()
    for task in parse_list(args.tasks):
        args.task = task
        batch, info = make_batch(args.model, model, args)
        print(f"{task}: {info['source']}, real tokens {pct(info['real_fraction'])}", flush=True)
        torch.manual_seed(0)  # dropout
        for name, x, y in capture(model, batch):
            layer = f"{task}/{name}"
            layer_info[layer] = {"kind": kind_of(name), "rows": x.shape[0]}
            exact = y.T @ x
            for rho in rhos:
                k = max(1, math.ceil(rho * x.shape[0] - 1e-9))
                ref[rho][layer] = expected_variance("gaussian", x, y, k)
                for s, fn in ests.items():
                    tot = 0.0
                    for i in range(args.seeds):
                        tot += (fn(x, y, k, 7919 * i + 17) - exact).square().sum().item()
                    err[(rho, s)][layer] = tot / args.seeds
            print(f"  {layer} rows={x.shape[0]} " + " ".join(
                f"{s}={err[(rhos[-1], s)][layer] / ref[rhos[-1]][layer]:.2f}" for s in specs),
                flush=True)

    summary = {}
    blocks = []
    for rho in rhos:
        rows = []
        for s in specs:
            e, g = err[(rho, s)], ref[rho]
            per = [e[layer] / g[layer] for layer in e]
            kinds = {}
            for kd in KINDS:
                ls = [layer for layer in e if layer_info[layer]["kind"] == kd]
                if ls:
                    kinds[kd] = sum(e[la] for la in ls) / sum(g[la] for la in ls)
            agg = sum(e.values()) / sum(g.values())
            summary[f"{s}@{rho:g}"] = {"aggregate": agg, "median": statistics.median(per),
                                       "worst": max(per), "best": min(per), "by_kind": kinds}
            rows.append([s, r3(agg), r3(statistics.median(per)), r3(max(per))]
                        + [r3(kinds.get(kd, float("nan"))) for kd in KINDS])
        blocks.append(fmt_table(
            ["sketch", "aggregate", "median", "worst"] + KINDS, rows,
            f"rho = {rho:g}: E|dW_hat - dW|^2 / Gaussian's, {len(layer_info)} layers, "
            f"{args.seeds} seeds"))
    text = "\n\n".join(blocks)
    stem = "variance" + ("_quick" if args.quick else "")
    write_outputs(stem, {"environment": env, "args": vars(args), "summary": summary,
                         "layers": layer_info,
                         "errors": {f"{r}|{s}": v for (r, s), v in err.items()},
                         "gaussian": {str(r): v for r, v in ref.items()}}, text, args.out_dir)
    print("\n" + text)
