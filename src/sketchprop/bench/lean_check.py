"""What the lean preset costs in gradient accuracy, on real activations.

all-MiniLM-L6-v2 (pretrained, new classifier head) on CoLA training batches (32 sentences, dynamic
padding, at most 128 tokens, as the CPU recipe trains), in training mode with every dropout at 0,
so that the methods differ only in what backward keeps. Every method stores the linear layers'
input rows as 4-bit codes (``patch_linear(sketch="exact", bits=4)``, the head left exact, as
``method=exact method.bits=4``), and keeps the rest as:

- ``int4``: the model does (nothing else patched);
- ``int4+compact``: ``patch_activations()`` (LayerNorm from its float32 output, attention
  recomputed from its float32 block input, 2-bit GELU codes);
- ``int4+lean``: lean's structural parts (:data:`~sketchprop.bench.common.LEAN_PARTS`:
  ``patch_activations(preset="lean", gelu_bits=2, floor_bits=None)``): LayerNorm outputs and
  attention block inputs kept once, as the linear layers' 4-bit codes;
- ``int4+lean8``: the same with 8-bit codes (not shared with the 4-bit linear codes: more bytes);
- ``int4g128+lean``: lean with every code's scales over groups of 128 columns, not 64 (fewer
  bytes: a group's two bfloat16 ends over twice the columns);
- ``int4+compact+ln``, ``int4+compact+attn``: lean's two parts one at a time (``layernorm="coded"``,
  ``attention="coded"``), to tell their shares apart.

Measured per method:

- **The model's parameter gradient** (every parameter, and the LayerNorm parameters alone)
  against the exact model's on the same batch: ``--draws`` backward passes per batch give the
  error of one draw, ``E|G~ - G|^2 / |G|^2``, and the squared bias, ``|mean - G|^2`` less its
  no-bias level ``V / draws``, relative to ``|G|^2`` and summed over the batches (with its
  standard error from the spread of the batches): a bias far below the error of one draw is
  what averaging over steps removes.
- **LayerNorm's backward alone** (each LayerNorm's input and output gradient captured from an
  exact backward, then ``--draws`` backward passes of :class:`~sketchprop.activations.CodedLayerNorm`
  on them): the relative variance and squared bias of ``dX`` and of ``dgamma``; the bias of
  ``dX`` is of second order (``sketchprop.activations.norms``), that of ``dgamma`` zero.
- **The attention probabilities recomputed from a code** of the block input (4 and 8 bits):
  ``|P~ - P|_F / |P|_F`` over the real rows, P from the float32 input.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
from torch import nn

from sketchprop import patch_activations, patch_linear
from sketchprop.activations import CodedLayerNorm, has_projections
from sketchprop.codes import make_code
from sketchprop.quantize import DEFAULT_GROUP

from . import importance_variance as iv
from .common import LEAN_PARTS, environment, fmt_table, setup_device, write_outputs
from .models import build_model, minilm_path

#: Method -> ``patch_activations`` keywords (None: not patched).
METHODS = {
    "int4": None,
    "int4+compact": {},
    "int4+lean": dict(LEAN_PARTS),
    "int4+lean8": {**LEAN_PARTS, "code_bits": 8},
    "int4g128+lean": {**LEAN_PARTS, "code_group": 128},
    "int4+compact+ln": {"layernorm": "coded"},
    "int4+compact+attn": {"attention": "coded"},
}


def no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.train()


def patched(model: nn.Module, acts: dict | None) -> nn.Module:
    model = copy.deepcopy(model)
    patch_linear(model, sketch="exact", bits=4, exclude="classifier",
                 group=(acts or {}).get("code_group", DEFAULT_GROUP))
    if acts is not None:
        patch_activations(model, **acts)
    return model


def grads(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}


def moments(draws: list[dict], exact: dict, names: list[str]) -> dict[str, float]:
    """Sums over ``names`` of ``|G|^2``, the mean error of one draw, ``|mean - G|^2`` and the
    no-bias level of the latter (the sample variance over the number of draws)."""
    d = len(draws)
    out = dict.fromkeys(("norm", "one", "mean_err", "noise"), 0.0)
    for n in names:
        stack = torch.stack([g[n] for g in draws])
        mean = stack.mean(0)
        out["norm"] += float(exact[n].square().sum())
        out["one"] += float((stack - exact[n]).square().sum()) / d
        out["mean_err"] += float((mean - exact[n]).square().sum())
        out["noise"] += float((stack - mean).square().sum()) / (d - 1) / d
    return out


def relative(items: list[dict]) -> dict[str, float]:
    """Relative error of one draw and relative squared bias over ``items`` (batches, or batches
    times layers), each a sum of squares pooled over the items and divided by the pooled
    ``|G|^2``; the bias's standard error from the spread of the items' contributions."""
    norm = sum(b["norm"] for b in items)
    parts = [b["mean_err"] - b["noise"] for b in items]
    n = len(parts)
    mean = sum(parts) / n
    spread = sum((p - mean) ** 2 for p in parts) / (n - 1) if n > 1 else float("nan")
    return {"rel_err": sum(b["one"] for b in items) / norm, "rel_bias2": sum(parts) / norm,
            "rel_bias2_se": math.sqrt(n * spread) / norm}


def model_gradients(model: nn.Module, data: list[dict], draws: int) -> dict:
    names = [n for n, _ in model.named_parameters()]
    groups = {"all": names, "layernorm": [n for n in names if "LayerNorm" in n],
              "linear": [n for n in names if ".encoder." in n and n.endswith("dense.weight")
                         or n.endswith(("query.weight", "key.weight", "value.weight"))]}
    out = {}
    for method, acts in METHODS.items():
        m = patched(model, acts)
        per = {g: [] for g in groups}
        for batch in data:
            exact = grads(model, batch)
            gs = [grads(m, batch) for _ in range(draws)]
            for g, keys in groups.items():
                per[g].append(moments(gs, exact, keys))
        out[method] = {g: relative(v) for g, v in per.items()}
        print(f"  {method}: {out[method]['all']}", flush=True)
    return out


def capture(model: nn.Module, batch: dict, modules: dict[str, nn.Module]) -> dict[str, list]:
    """``{name: [input, output gradient]}`` of ``modules`` in one exact backward (the input alone
    where the output is not a tensor)."""
    store: dict[str, list] = {}

    def fwd(args, kwargs, out, name):
        store[name] = [(args[0] if args else kwargs["hidden_states"]).detach()]
        if isinstance(out, torch.Tensor):
            out.register_hook(lambda g: store[name].append(g.detach()))

    hooks = [mod.register_forward_hook(lambda m, a, k, o, name=name: fwd(a, k, o, name),
                                       with_kwargs=True)
             for name, mod in modules.items()]
    grads(model, batch)
    for h in hooks:
        h.remove()
    return store


def layernorm_alone(model: nn.Module, data: list[dict], draws: int) -> dict:
    """dX and dgamma of each LayerNorm from a 4-bit code of its output, on captured inputs."""
    norms = {n: m for n, m in model.named_modules() if type(m) is nn.LayerNorm}
    per = {"dx": [], "dgamma": []}
    for batch in data:
        for name, (x, dy) in capture(model, batch, norms).items():
            norm = copy.deepcopy(norms[name])
            coded = CodedLayerNorm.from_layernorm(norm, name=name).train()  # one seed stream
            runs = []
            for layer in [norm] + [coded] * draws:
                norm.zero_grad(set_to_none=True)
                xr = x.clone().requires_grad_()
                layer(xr).backward(dy)
                runs.append({"dx": xr.grad.double(), "dgamma": norm.weight.grad.double().clone()})
            for k in per:
                per[k].append(moments(runs[1:], runs[0], [k]))
    return {k: relative(v) for k, v in per.items()}


def probabilities(block: nn.Module, h: torch.Tensor, mask: torch.Tensor, heads: int) -> torch.Tensor:
    """A BERT self-attention's softmax probabilities on input ``h`` (padding keys masked)."""
    q, k = (getattr(block, p)(h).unflatten(-1, (heads, -1)).transpose(1, 2)
            for p in ("query", "key"))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)


def attention_probabilities(model: nn.Module, data: list[dict], bits_list=(4, 8)) -> dict:
    """|P~ - P|_F / |P|_F of the probabilities recomputed from a code of the block input."""
    heads = model.config.num_attention_heads
    blocks = {str(i): m for i, m in enumerate(m for m in model.modules() if has_projections(m))}
    err = {b: [0.0, 0.0] for b in bits_list}
    for j, batch in enumerate(data):
        mask = batch["attention_mask"].bool()
        for name, (x, *_) in capture(model, batch, blocks).items():
            block = blocks[name]
            with torch.no_grad():
                p = probabilities(block, x, mask, heads)
                real = mask[:, None, :, None].expand_as(p)
                for b in bits_list:
                    code = make_code(x, b, 64, seed=1000 * j + int(name))
                    pc = probabilities(block, code.decode().view_as(x), mask, heads)
                    err[b][0] += float((pc - p)[real].square().sum())
                    err[b][1] += float(p[real].square().sum())
    return {f"{b} bits": math.sqrt(e / n) for b, (e, n) in err.items()}


def sig(x: float) -> str:
    return f"{x:.3g}"


def tables(payload: dict) -> str:
    r = payload["results"]
    rows = [[m] + [sig(v[g][k]) for g in ("all", "layernorm", "linear")
                   for k in ("rel_err",)] +
            [f"{sig(v['all']['rel_bias2'])} ± {sig(v['all']['rel_bias2_se'])}",
             f"{sig(v['layernorm']['rel_bias2'])} ± {sig(v['layernorm']['rel_bias2_se'])}"]
            for m, v in r["model"].items()]
    a = payload["args"]
    text = [f"Lean's gradient error, MiniLM on {a['batches']} CoLA training batches of "
            f"{a['batch']}, dropout off, {a['draws']} draws per batch; relative to the exact "
            "model's gradient (squared norms)\n",
            fmt_table(["method", "one draw: all", "LayerNorm params", "encoder linear weights",
                       "bias²: all", "bias²: LayerNorm params"], rows),
            "\nLayerNorm's backward from a 4-bit code of its output alone (each LayerNorm's "
            "captured input and output gradient)\n",
            fmt_table(["gradient", "one draw", "bias²"],
                      [[k, sig(v["rel_err"]), f"{sig(v['rel_bias2'])} ± {sig(v['rel_bias2_se'])}"]
                       for k, v in r["layernorm"].items()]),
            "\nAttention probabilities recomputed from a code of the block input, "
            "|P~ - P|_F / |P|_F over real rows\n",
            fmt_table(["code", "relative error"],
                      [[k, sig(v)] for k, v in r["attention"].items()])]
    return "\n".join(text) + "\n"


def run(args) -> None:
    """The study as ``scripts/lean_check.py`` runs it: write ``lean_check[_quick].{json,md}``."""
    if args.quick:
        args.batches, args.draws, args.batch = 2, 3, 8
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    print(env, flush=True)
    model = no_dropout(build_model("minilm", args.quick))
    tokenizer = None
    if not args.quick and minilm_path() is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    data = iv.batches(argparse.Namespace(steps=0, warmup=0, batches=args.batches,
                                         batch=args.batch, max_length=args.max_length,
                                         glue_dir=args.glue_dir),
                      tokenizer, model.config.vocab_size)
    torch.manual_seed(0)
    results = {"model": model_gradients(model, data, args.draws),
               "layernorm": layernorm_alone(model, data, args.draws),
               "attention": attention_probabilities(model, data)}
    payload = {"environment": env, "args": dict(vars(args)), "results": results}
    write_outputs("lean_check" + ("_quick" if args.quick else ""), payload, tables(payload),
                  args.out_dir)
    print(tables(payload))
