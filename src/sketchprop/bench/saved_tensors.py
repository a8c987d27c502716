"""What one training forward saves for backward, by the autograd node that saves it.

A randomly initialised roberta-base (``models.build_model``) on ``--batch x --seq`` tokens
(the padded batch of ``models.make_batch``; with ``--rows full``, every row full length). For
each method (``scripts/bench_model.py``'s names:
``exact``, ``compact``, ``ours+compact``, ...) the graph of the loss is walked and every tensor a
node keeps is listed under ``<node>.<attribute>`` (``MulBackward0._saved_other`` is a float
dropout mask on CPU, ``NativeDropoutBackward0._saved_result1`` a byte mask, a custom Function's
saved tensors are ``<Function>Backward.saved[i]``), each storage counted once, Parameters left out.

The check it makes visible: with ``attention="recompute"`` no tensor the size of the attention
probabilities (``B x H x L x L``) is saved (on CUDA the SDPA kernels keep Q, K, V, the output
and a ``B x H x L`` log-sum-exp), and with ``dropout="seeded"`` the dropout masks are 8-byte seeds,
never float or byte masks.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .common import environment, fmt_table, parse_list, setup_device, write_outputs
from .models import Configured, build_model, full_rows, make_batch, method_list, to_device


def saved_by_node(loss: torch.Tensor, params) -> list[dict]:
    """Every tensor the graph of ``loss`` keeps: ``{"node", "dtype", "shape", "bytes"}``, one
    entry per storage (the first node found keeps it), Parameters excluded."""
    exclude = {p.untyped_storage().data_ptr() for p in params}
    seen, out, stack, visited = set(), [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        name = type(node).__name__
        items = [(f"{name}.{a}", getattr(node, a)) for a in dir(node) if a.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):  # a custom autograd.Function
            items += [(f"{name}.saved[{i}]", t) for i, t in enumerate(node.saved_tensors)]
        for label, t in items:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key[0] in exclude or key[0] == 0 or key in seen:
                continue
            seen.add(key)
            out.append({"node": label, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "bytes": st.nbytes()})
        stack.extend(fn for fn, _ in node.next_functions)
    return out


def summarize(entries: list[dict], batch: int, heads: int, seq: int) -> dict:
    """The total, the bytes per (node, dtype), and the tensors of the attention probabilities' size."""
    groups: dict[tuple, list] = defaultdict(lambda: [0, 0])
    for e in entries:
        g = groups[(e["node"], e["dtype"])]
        g[0] += 1
        g[1] += e["bytes"]
    probs = [e for e in entries if e["shape"][-3:] == [heads, seq, seq]
             and e["shape"][0] == batch]
    return {
        "total_bytes": sum(e["bytes"] for e in entries),
        "groups": sorted(([n, d, c, b] for (n, d), (c, b) in groups.items()),
                         key=lambda r: -r[3]),
        "attention_sized": {"count": len(probs), "bytes": sum(e["bytes"] for e in probs)},
    }


def run(args) -> None:
    """The listing as ``scripts/saved_tensors.py`` runs it (its options in ``args``): write
    ``saved_tensors_<device>[_quick]<tag>.{json,md}`` and print the tables."""
    if args.quick:
        args.batch, args.seq = min(args.batch, 4), min(args.seq, 32)
    args.rho_list = parse_list(args.rhos, float)
    dev = setup_device(args.device, args.threads)
    env = environment(dev)
    model = build_model("roberta-base", args.quick).to(dev).train()
    batch, info = make_batch("roberta-base", model, args)
    if args.rows == "full":
        batch, info = full_rows(model, batch)
    batch = to_device(batch, dev)
    heads = model.config.num_attention_heads
    results = {}
    for method in method_list(args):
        torch.manual_seed(0)
        with Configured(model, method):
            loss = model(**batch).loss
            entries = saved_by_node(loss, model.parameters())
            loss.backward()
        model.zero_grad(set_to_none=True)
        results[method["name"]] = summarize(entries, args.batch, heads, args.seq)
        print(f"{method['name']}: {results[method['name']]['total_bytes'] / 2**20:.1f} MiB",
              flush=True)
    payload = {"environment": env, "args": vars(args), "batch": info, "results": results}
    rows = "_full" if args.rows == "full" else ""
    stem = f"saved_tensors_{dev.type}{rows}{'_quick' if args.quick else ''}{args.tag}"
    write_outputs(stem, payload, tables(payload), args.out_dir)
    print(tables(payload))


def tables(payload: dict) -> str:
    """One markdown table per method."""
    a = payload["args"]
    exact = payload["results"].get("exact", {}).get("total_bytes")
    parts = []
    for name, r in payload["results"].items():
        att = r["attention_sized"]
        rows = [[n, d, c, f"{b / 2**20:.2f}"] for n, d, c, b in r["groups"]]
        share = f" ({r['total_bytes'] / exact:.4f}x exact)" if exact else ""
        parts.append(fmt_table(
            ["saved by", "dtype", "storages", "MiB"], rows,
            title=f"{name}: {r['total_bytes'] / 2**20:.1f} MiB saved{share} at "
                  f"{a['batch']}x{a['seq']}{' (every row full length)' * (a.get('rows') == 'full')}; "
                  f"tensors of the attention probabilities' size (B x H x L x L): {att['count']} "
                  f"({att['bytes'] / 2**20:.1f} MiB)"))
    return "\n\n".join(parts)
