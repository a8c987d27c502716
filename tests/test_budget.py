"""Pick by budget (sketchprop.report.budget, scripts/pick_budget.py): the fixed part, the
largest-batch arithmetic and the choice of the fastest configuration, on a tiny model; and the
checkpointing byte count it relies on."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from sketchprop.bench.memory_table import saved_bytes
from sketchprop.bench.models import Configured, build_model
from sketchprop.report.budget import fixed_bytes, plan, reference_lengths

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def tiny():
    return build_model("roberta-base", quick=True).train()


def test_fixed_part_is_weights_grads_and_two_adam_moments(tiny):
    n_bytes = sum(p.numel() * p.element_size() for p in tiny.parameters())
    fixed = fixed_bytes(tiny)
    assert fixed["weights"] == fixed["grads"] == n_bytes
    assert fixed["adamw_state"] == 2 * n_bytes
    assert fixed["total"] == 4 * n_bytes
    assert all(p.grad is None for p in tiny.parameters())  # the model is left as it was


def test_reference_batch_holds_the_longest_example():
    lengths = [5, 9, 3, 40, 7, 8, 6]
    ref = reference_lengths(lengths, 4)
    assert len(ref) == 4 and ref[0] == 40 and max(ref) == 40
    assert reference_lengths(lengths, 4) == ref  # fixed seed
    assert len(reference_lengths(lengths, 20)) == 20  # drawn with replacement past the set


def test_plan_arithmetic():
    mib = 2**20
    # Saved bytes of a reference batch of 100 padded tokens, two encoder layers, L_max 10.
    saved = {"exact": 100 * mib, "ours@0.5": 80 * mib, "ours@0.2": 70 * mib, "ours@0.1": 60 * mib,
             "ckpt": 10 * mib, "ckpt+ours@0.5": 10 * mib, "ckpt+ours@0.2": 10 * mib,
             "ckpt+ours@0.1": 10 * mib}

    def t(r):
        return {"ratio": r, "q1": r, "q3": r, "n": 3}

    ratios = {"exact": t(1.0), "ours-blocksrht@0.5": t(0.8), "ours-blocksrht@0.2": t(0.75),
              "ours-blocksrht@0.1": t(0.7), "ckpt": t(1.2), "ckpt+ours-blocksrht@0.5": t(0.95),
              "ckpt+ours-blocksrht@0.2": t(0.94), "ckpt+ours-blocksrht@0.1": t(0.93)}
    fixed, budget = 50 * mib, 150 * mib
    rows = {r["name"]: r for r in plan(saved, 100, fixed, 2, 10, budget, 12, ratios,
                                          "blocksrht")}
    # exact: 1 MiB per padded token, 10 MiB per example: (150 - 50) / 10 = 10 examples.
    assert rows["exact"]["per_token"] == mib and rows["exact"]["largest_batch"] == 10
    assert not rows["exact"]["fits"]
    # ours 0.1: 0.6 MiB per token, 6 MiB per example: floor(100 / 6) = 16.
    assert rows["ours@0.1"]["largest_batch"] == 16 and rows["ours@0.1"]["fits"]
    # checkpointing: 0.1 MiB per token (1 MiB per example) + one recomputed layer of the exact
    # model's other bytes: (100 - 10) MiB / 100 tokens * 10 tokens / 2 layers = 4.5 MiB per example.
    assert rows["ckpt"]["recompute_per_example"] == pytest.approx(4.5 * mib)
    assert rows["ckpt"]["largest_batch"] == math.floor(100 / 5.5)
    # checkpointing + ours 0.1 recomputes an ours-sized layer: (60 - 10) / 100 * 10 / 2 = 2.5 MiB.
    assert rows["ckpt+ours@0.1"]["recompute_per_example"] == pytest.approx(2.5 * mib)
    assert rows["ckpt+ours@0.1"]["largest_batch"] == math.floor(100 / 3.5)
    assert rows["ckpt+ours@0.1"]["memory_at_batch"] == pytest.approx(fixed + 12 * 3.5 * mib)
    # The fastest configuration that reaches batch 12 is ours at 0.1 (0.70), not exact (no room).
    assert [n for n, r in rows.items() if r["fastest"]] == ["ours@0.1"]
    # At batch 20 only checkpointing fits; the fastest of those is checkpointing + ours at 0.1.
    rows = {r["name"]: r for r in plan(saved, 100, fixed, 2, 10, budget, 20, ratios,
                                          "blocksrht")}
    assert [n for n, r in rows.items() if r["fastest"]] == ["ckpt+ours@0.1"]
    # No room at all: nothing fits, nothing is marked.
    rows = plan(saved, 100, fixed, 2, 10, fixed // 2, 1, ratios, "blocksrht")
    assert all(r["largest_batch"] == 0 and not r["fastest"] for r in rows)


@pytest.mark.parametrize("patch", [None, dict(sketch="blocksrht", rho=0.1, exclude="classifier")])
def test_checkpointing_bytes_same_for_reentrant_and_not(tiny, patch):
    """Both HF checkpointing variants save each layer's input through autograd's saved-tensor
    hooks: SavedTensorMeter counts the same bytes for either, far fewer than without."""
    from sketchprop.measure import SavedTensorMeter

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (4, 24), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.zeros(4, dtype=torch.long)}
    counts = {}
    for label, ckpt, kwargs in (("plain", False, None), ("reentrant", True, {"use_reentrant": True}),
                                ("non-reentrant", True, {"use_reentrant": False})):
        method = {"patch": patch, "ckpt": ckpt, "ckpt_kwargs": kwargs}
        with Configured(tiny, method):
            with SavedTensorMeter(tiny) as meter:
                loss = tiny(**batch).loss
            loss.backward()  # recomputes through the same patched layers
        tiny.zero_grad(set_to_none=True)
        counts[label] = meter.bytes
    assert counts["reentrant"] == counts["non-reentrant"] < counts["plain"] / 3
    # memory_table's discarding count (the one pick_budget uses) agrees.
    discard = saved_bytes(tiny, batch, {"patch": patch, "ckpt": True})
    assert discard == counts["non-reentrant"]


def test_cli_on_toy_glue(glue_dir, tmp_path):
    """End to end on the tiny model: one row per configuration, written where asked."""
    bench = tmp_path / "bench"
    bench.mkdir()
    methods = {"exact": [1.0, 1.0], "ours-blocksrht@0.1": [0.7, 0.8], "ckpt": [1.2, 1.3],
               "int4": [1.05, 1.07], "exact-skip": [0.8, 1.0]}
    (bench / "model_cpu_x.json").write_text(json.dumps({
        "args": {"batch": 4, "seq": 32, "task": "MRPC"},
        "environment": {"torch_threads": 1, "device": "cpu", "cpu": "test CPU"},
        "results": [{"model": "roberta-base", "batch": {"source": "toy", "real_fraction": 0.5},
                     "methods": {n: {"time": {"ratios": r}} for n, r in methods.items()}}]}))
    out = tmp_path / "budget.md"
    spec = importlib.util.spec_from_file_location("pick_budget", SCRIPTS / "pick_budget.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--quick", "--task", "cola", "--budget-gib", "1", "--batch", "4",
                    "--glue-dir", str(glue_dir), "--bench-dir", str(bench), "--threads", "1",
                    "--ref-batch", "8", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<!-- generated by: python scripts/pick_budget.py --quick")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # exact, exact with padding skipped, compact activations, checkpointing; ours, +compact,
    # ckpt+ours, +compact at 3 rates; 8-, 4- and 2-bit rows, 4-bit + compact activations, and
    # 4-bit + lean
    assert len(rows) == 21
    per_token = {tuple(c.strip() for c in r.strip("|").split("|")[:2]): float(r.split("|")[3])
                 for r in rows}
    assert per_token[("exact, 4-bit rows + lean", "-")] < \
        per_token[("exact, 4-bit rows + compact activations", "-")]
    for rho in ("0.5", "0.2", "0.1"):
        assert per_token[("ours + compact activations", rho)] < per_token[("ours", rho)]
        assert per_token[("ours + compact activations", rho)] < \
            per_token[("compact activations", "-")] < per_token[("exact", "-")]
    bits = [per_token[(f"exact, {b}-bit rows", "-")] for b in (8, 4, 2)]
    assert per_token[("exact", "-")] > bits[0] > bits[1] > bits[2]
    assert per_token[("exact, 4-bit rows + compact activations", "-")] < bits[1]
    assert "| 1.06 (" in next(r for r in rows if r.startswith("| exact, 4-bit rows | - |"))
    # Exact with padding skipped: its own bytes (fewer than exact's: the toy rows are padded) and
    # time; every configuration timed in its run also against it, round by round.
    assert per_token[("exact", "-")] > per_token[("exact, padding skipped", "-")]
    skip = next(r for r in rows if r.startswith("| exact, padding skipped | - |"))
    assert "| 0.90 (0.85-0.95) | 1.00 |" in skip
    # ours / exact-skip: 0.7 / 0.8, 0.8 / 1.0: median 0.84, quartiles 0.82 and 0.86
    assert "| 0.75 (0.72-0.78) | 0.84 (0.82-0.86) |" in next(
        r for r in rows if r.startswith("| ours | 0.1 |"))
    assert "rows: the task's real lengths (50.0% real tokens, toy)" in text
    assert "pooled over model_cpu_x" in text
    fastest = [r for r in rows if "fastest that fits" in r]
    assert len(fastest) == 1 and fastest[0].startswith("| ours | 0.1 |")
    assert "| 0.75 (0.72-0.78) |" in fastest[0]


# ---------------------------------------------------------------------------------------------
# --family: a family at its published shape and depth (tiny width here).


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_familys_bytes_per_layer_extrapolate_to_a_deeper_model(name):
    """Rest plus one layer's bytes times the depth, from 2- and 3-layer models, is what a
    5-layer model saves, for exact, checkpointing and the lean preset (bytes are deterministic);
    the meta-device parameter count is a real model's."""
    from sketchprop.bench import architectures as arch
    from sketchprop.bench import families as fam
    from sketchprop.report import budget_family as bf

    saved = bf.saved_per_row(name, fam.TINY, {}, 32, 2)
    assert {"exact", bf.CKPT, arch.LEAN_FLOOR} <= set(saved)
    for setup in ("exact", bf.CKPT, arch.LEAN_FLOOR):
        model = bf._build(name, fam.TINY, {}, 5, 32)
        if setup == bf.CKPT:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif setup != "exact":
            arch.apply_setup(model, setup)
        direct = arch.forward_bytes(model, bf._batch(name, model, 2, 32)) / 2
        rest, layer = saved[setup]
        assert rest + 5 * layer == pytest.approx(direct, rel=1e-9), setup
    real = bf._build(name, fam.TINY, {}, 5, 32)
    assert bf.parameters(name, fam.TINY, {}, 5, 32) == sum(p.numel() for p in real.parameters())


def test_a_familys_plan_arithmetic():
    from sketchprop.report import budget_family as bf

    saved = {"exact": (100.0, 50.0), bf.CKPT: (20.0, 5.0), "int4": (40.0, 10.0)}
    rows = {r["setup"]: r for r in bf.plan(saved, layers=4, fixed=1000, budget=10_000, batch=40)}
    assert rows["exact"]["per_row"] == 300 and rows["exact"]["largest_batch"] == 30
    assert rows[bf.CKPT]["per_row"] == 20 + 4 * 5 + 50  # plus one exact layer, recomputed
    assert rows["int4"]["largest_batch"] == math.floor(9000 / 80) and rows["int4"]["fits"]
    assert not rows["exact"]["fits"] and rows["exact"]["saved_ratio"] == 1.0


def test_a_family_budget_end_to_end_and_bad_input(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("pick_budget", SCRIPTS / "pick_budget.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "family.md"
    assert script.main(["--family", "gpt2", "--family-width", "tiny", "--length", "32",
                        "--budget-gib", "1", "--batch", "4", "--threads", "1",
                        "--out", str(out)]) == 0
    text = out.read_text()
    assert "--family gpt2" in text.splitlines()[0] and "12 layers" in text
    setups = [line.split("|")[1].strip() for line in text.splitlines()
              if line.startswith("| ") and "---" not in line][1:]
    assert setups == ["exact", "checkpointing", "int4", "floor4", "int4+compact",
                      "int4+lean(gelu4)+floor4"]
    for bad, says in ((["--family", "llama3"], "unknown family 'llama3'"),
                      (["--family", "llama", "--family-width", "wide"], "--family-width"),
                      (["--family", "llama", "--length", "0"], "must be positive"),
                      (["--family", "llama", "--budget-gib", "nan"], "finite"),
                      (["--family", "llama", "--budget-gib", "inf"], "finite"),
                      (["--family", "llama", "--rows", "8"], "--rows must be 1 to 4")):
        with pytest.raises(SystemExit):
            script.main(bad)
        assert says in capsys.readouterr().err
