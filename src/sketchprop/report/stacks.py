"""The training-stacks table of ``docs/training-stacks.md``, generated from the test suite.

A test that shows a patch working in a stack carries the marker

    @pytest.mark.stack("ddp", "sketch", "compact")        # the stack, then the patches it covers
    @pytest.mark.stack("fsdp2", "sketch", refused="must run before fully_shard")

(``refused=``: the test asserts that the patch call refuses, with a message matching those words).
:func:`stacks_table` reads the markers from the tests' source with ``ast`` (no test is imported or
run) and returns one row per stack, one column per patch: the tests that show it, the refusal (both
where one order works and another is refused), or "not tested" (no test shows it: not supported,
though it may work). An unknown stack or patch name raises, so a misspelt marker cannot drop a
row. ``make tables`` puts the table between
``<!-- BEGIN stacks -->`` and ``<!-- END stacks -->``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

#: Marker name -> what a row says. The order is the table's.
STACKS = {
    "plain-loop": "a plain PyTorch loop",
    "hf-trainer": "HF `Trainer`",
    "accelerate": "accelerate (`Accelerator.prepare`)",
    "ddp": "DDP (`torchrun`, `DistributedDataParallel`)",
    "fsdp2": "FSDP2 (`fully_shard`)",
    "fsdp1": "FSDP1 (`FullyShardedDataParallel`)",
    "compile": "`torch.compile`",
    "peft-lora": "peft LoRA",
    "peft-dora": "peft DoRA",
    "autocast-bf16": "bf16 autocast",
    "ckpt-reentrant": "activation checkpointing, reentrant",
    "ckpt-nonreentrant": "activation checkpointing, non-reentrant",
    "grad-accum": "gradient accumulation",
    "threads": "two threads training one model at once",
    "save-load": "`torch.save` / `torch.load`, `save_pretrained`",
    "second-order": "a second derivative (`create_graph=True`: gradient penalty, meta-learning)",
    "hub-kernels": "transformers' hub kernels (`use_kernels`, on after `from_pretrained` from 5.25)",
}
#: Marker name -> column title.
PATCHES = {
    "sketch": "sketch (`patch_linear`)",
    "bits": "b-bit rows (`bits=`)",
    "compact": "compact activations",
    "decoders": "decoder parts (Llama, GPT-2)",
    "floor": "the generic floor (`floor_bits=`)",
}
SHOWN = 2  # tests named per cell; the rest are counted


def _is_stack_marker(node: ast.AST) -> bool:
    """``pytest.mark.stack(...)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "stack" and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "mark")


def _read(call: ast.Call, where: str) -> tuple[str, list[str], str | None]:
    args = [ast.literal_eval(a) for a in call.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    if not args or set(kwargs) - {"refused"}:
        raise ValueError(f"{where}: pytest.mark.stack(stack, *patches, refused=...) expected")
    stack, patches = args[0], args[1:]
    if stack not in STACKS:
        raise ValueError(f"{where}: unknown stack {stack!r}; one of {', '.join(STACKS)}")
    unknown = [p for p in patches if p not in PATCHES]
    if unknown or not patches:
        raise ValueError(f"{where}: patches {unknown or '(none)'} not among {', '.join(PATCHES)}")
    return stack, patches, kwargs.get("refused")


def markers(tests: Path) -> list[tuple[str, str, str, str | None]]:
    """``(stack, patch, test id, refusal)`` for every stack marker of every test under ``tests``:
    on a test function (a decorator, or a ``pytest.param`` mark in its parametrization) or on a
    whole module (``pytestmark``)."""
    out = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marks = [n for stmt in tree.body if isinstance(stmt, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                for t in stmt.targets)
                        for n in ast.walk(stmt.value) if _is_stack_marker(n)]
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")):
                continue
            where = f"{path.name}::{fn.name}"
            calls = [n for d in fn.decorator_list for n in ast.walk(d) if _is_stack_marker(n)]
            for call in [*module_marks, *calls]:
                stack, patches, refused = _read(call, where)
                out += [(stack, patch, where, refused) for patch in patches]
    return out


def stacks_table(tests: Path) -> str:
    """The markdown table: stacks by patches, each cell the tests that show it (``tests/`` file
    and test name), the refusal, or 'not tested'."""
    shown, refused = defaultdict(list), {}
    for stack, patch, test, refusal in markers(tests):
        if refusal is None:
            shown[stack, patch].append(test)
        else:
            refused[stack, patch] = (refusal, test)

    def cell(stack: str, patch: str) -> str:
        parts = []
        if (stack, patch) in shown:
            names = sorted(set(shown[stack, patch]))
            more = f" (+{len(names) - SHOWN})" if len(names) > SHOWN else ""
            parts.append("tested: " + ", ".join(f"`{n}`" for n in names[:SHOWN]) + more)
        if (stack, patch) in refused:  # an order or option that cannot work, beside one that does
            refusal, test = refused[stack, patch]
            parts.append(f"refused: \"{refusal}\" (`{test}`)")
        return "; ".join(parts) or "not tested"

    lines = ["| stack | " + " | ".join(PATCHES.values()) + " |",
             "|---|" + "---|" * len(PATCHES)]
    lines += [f"| {label} | " + " | ".join(cell(stack, p) for p in PATCHES) + " |"
              for stack, label in STACKS.items()]
    return "\n".join(lines)
