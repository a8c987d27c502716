"""What one training forward saves for backward, by the autograd node that saves it.

A randomly initialised roberta-base (``bench_model.build_model``) on ``--batch x --seq`` tokens
(the padded batch of ``bench_model.make_batch``). For each method (``bench_model`` method names:
``exact``, ``compact``, ``ours+compact``, ...) the graph of the loss is walked and every tensor a
node keeps is listed under ``<node>.<attribute>`` (``MulBackward0._saved_other`` is a float
dropout mask on CPU, ``NativeDropoutBackward0._saved_result1`` a byte mask, a custom Function's
saved tensors are ``<Function>Backward.saved[i]``), each storage counted once, Parameters left out.

The check it makes visible: with ``attention="recompute"`` no tensor the size of the attention
probabilities (``B x H x L x L``) is saved (on CUDA the SDPA kernels keep Q, K, V, the output
and a ``B x H x L`` log-sum-exp), and with ``dropout="seeded"`` the dropout masks are 8-byte seeds,
never float or byte masks.

    PYTHONPATH=src python scripts/saved_tensors.py --device cuda
    PYTHONPATH=src python scripts/saved_tensors.py --quick        # tiny model, seconds
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402
import bench_model as bm  # noqa: E402
import torch  # noqa: E402


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--methods", default="exact,compact,ours+compact,ckpt+ours+compact")
    p.add_argument("--sketch", default="blocksrht")
    p.add_argument("--rhos", default="0.1")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--task", default="MRPC", choices=sorted(bm.TASKS))
    p.add_argument("--glue-dir", default=bm.default_glue_dir())
    bu.add_threads_arg(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.seq = min(args.batch, 4), min(args.seq, 32)
    args.rho_list = bu.parse_list(args.rhos, float)
    dev = bu.setup_device(args.device, args.threads)
    env = bu.environment(dev)
    model = bm.build_model("roberta-base", args.quick).to(dev).train()
    batch, info = bm.make_batch("roberta-base", model, args)
    batch = bm.to_device(batch, dev)
    heads = model.config.num_attention_heads
    results = {}
    for method in bm.method_list(args):
        torch.manual_seed(0)
        with bm.Configured(model, method):
            loss = model(**batch).loss
            entries = saved_by_node(loss, model.parameters())
            loss.backward()
        model.zero_grad(set_to_none=True)
        results[method["name"]] = summarize(entries, args.batch, heads, args.seq)
        print(f"{method['name']}: {results[method['name']]['total_bytes'] / 2**20:.1f} MiB",
              flush=True)
    payload = {"environment": env, "args": vars(args), "batch": info, "results": results}
    stem = f"saved_tensors_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    bu.write_outputs(stem, payload, tables(payload), args.out_dir)
    print(tables(payload))


def tables(payload: dict) -> str:
    a = payload["args"]
    parts = []
    for name, r in payload["results"].items():
        att = r["attention_sized"]
        rows = [[n, d, c, f"{b / 2**20:.2f}"] for n, d, c, b in r["groups"]]
        parts.append(bu.fmt_table(
            ["saved by", "dtype", "storages", "MiB"], rows,
            title=f"{name}: {r['total_bytes'] / 2**20:.1f} MiB saved at {a['batch']}x{a['seq']}; "
                  f"tensors of the attention probabilities' size (B x H x L x L): {att['count']} "
                  f"({att['bytes'] / 2**20:.1f} MiB)"))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
