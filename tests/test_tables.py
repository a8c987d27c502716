"""make tables (sketchprop.report) rebuilds tables and figures from run JSON files, deterministically."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from sketchprop.glue import runs as sp_runs
from sketchprop.report import common, frontier
from sketchprop.report.build import build
from sketchprop.report.figure3 import figure3
from sketchprop.report.figure5 import figure5_runs
from sketchprop.report.table3 import table3

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def yaml_values(path):
    """A config file's own values (its ``defaults`` list left out)."""
    from omegaconf import OmegaConf

    conf = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[1] / path))
    conf.pop("defaults", None)
    return conf


def fake_run(task, sketch, rho, seed, score, runtime, share=False, **train):
    """A result file as the pipeline writes it; ``train`` settings enter its identity."""
    metric = "matthews" if task == "cola" else "accuracy"
    ident = {"task": task, "model": {"name": "minilm"},
             "method": {"sketch": sketch} if sketch == "exact" else
             {"sketch": sketch, "rho": rho, "share_inputs": share, "skip_padding": share},
             "train": {"epochs": 3.0, "batch_size": 32, "learning_rate": 1e-4, **train},
             "data": {"source": "tsv", "sha256": "0" * 16, "max_train_samples": 4000},
             "seed": seed}
    history = [{"epoch": e, "step": 10 * e, metric: score - 3 + e, "eval_loss": 0.7 - 0.05 * e,
                "train_loss": 0.8 - 0.1 * e} for e in (1, 2, 3)]
    return {
        "task": task, "model": "minilm", "sketch": sketch, "rho": rho, "seed": seed, "epochs": 3,
        "metrics": {metric: score}, "best_metrics": {"epoch": 3, metric: score},
        "history": history, "loss_curve": [{"step": s, "epoch": s / 10, "loss": 1 / s}
                                           for s in range(1, 31)],
        "train_samples_per_second": 1000 / runtime, "tokens_per_second": 1.0,
        "train_runtime": runtime, "peak_memory_bytes": 1, "saved_activation_bytes": 1,
        "device": "cpu", "hardware": "test CPU", "git_commit": "abc", "wall_seconds": runtime,
        "identity": ident, "recipe": sp_runs.recipe_hash(ident),
        "config": {"method": {"share_inputs": share, "skip_padding": share},
                   "train": {"epochs": 3, "batch_size": 32, "learning_rate": 1e-4,
                             "max_length": 128}, "data": {"max_train_samples": 4000}},
    }


def write_runs(results: Path):
    runs = [fake_run("cola", "exact", 1.0, s, 50 + s, 100) for s in (1, 2, 3)]
    runs += [fake_run("cola", "gaussian", r, 1, 45 + 10 * r, 120) for r in (0.5, 0.2, 0.1)]
    runs += [fake_run("cola", "blocksrht", 0.1, 1, 48, 80, share=True)]
    runs += [fake_run("mrpc", "exact", 1.0, 1, 80, 100), fake_run("mrpc", "gaussian", 0.1, 1, 78, 110)]
    for r in runs:
        name = f"{sp_runs.run_stem(r['identity'])}.json"
        path = results / "runs" / "minilm_cpu" / r["task"] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))


def write_bench(results: Path):
    """Controlled-benchmark files as scripts/bench_model.py and bench_layer.py write them."""
    bench = results / "bench"
    bench.mkdir(parents=True, exist_ok=True)

    def timed(ratios):
        return {"time": {"ratios": ratios, "median_s": 1.0}}

    env = {"torch_threads": 1, "device": "cpu", "cpu": "test CPU"}
    model = {"environment": env, "args": {"batch": 16, "seq": 128, "task": "MRPC"},
             "results": [{"model": "minilm", "batch": {"source": "MRPC dev, test tokenizer"},
                          "methods": {"exact": timed([1.0, 1.0, 1.0]),
                                      "paper@0.1": timed([1.0, 1.1, 1.2]),
                                      "ours-blocksrht@0.1": timed([0.7, 0.8, 0.9]),
                                      "ckpt": timed([1.2, 1.3, 1.4]),
                                      "ckpt+ours-blocksrht@0.1": timed([0.9, 1.0, 1.1])}}]}
    (bench / "model_cpu_test.json").write_text(json.dumps(model))
    # A second run of the same setting is pooled; a --quick run and another thread count are not.
    model["results"][0]["methods"] = {"exact": timed([1.0]), "ours-blocksrht@0.1": timed([0.6])}
    (bench / "model_cpu_test2.json").write_text(json.dumps(model))
    (bench / "model_cpu_quick.json").write_text(json.dumps(
        {**model, "results": [{**model["results"][0], "methods": {"ours-blocksrht@0.1":
                                                                 timed([9.0])}}]}))
    other = {**model, "environment": {**env, "torch_threads": 2}}
    other["results"] = [{**model["results"][0], "methods": {"ours-blocksrht@0.1": timed([9.0])}}]
    (bench / "model_cpu_t2.json").write_text(json.dumps(other))
    layer = {"environment": env, "groups": [{"shape": "768x3072", "rows": 4096, "configs": {
        "nn.Linear": {"ratios": [1.0, 1.0]}, "gaussian@0.1": {"ratios": [0.9, 0.95]},
        "blocksrht@0.1": {"ratios": [0.75, 0.8, 0.85]}}},
        {"shape": "768x768", "rows": 4096, "configs": {"blocksrht@0.1": {"ratios": [5.0]}}}]}
    (bench / "layer_cpu.json").write_text(json.dumps(layer))


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.*"))}


def test_tables_and_figures_from_json_only_and_deterministic(tmp_path):
    write_runs(tmp_path)
    write_bench(tmp_path)
    build(tmp_path)
    table2 = (tmp_path / "tables" / "table2.md").read_text()
    table4 = (tmp_path / "tables" / "table4.md").read_text()
    # exact CoLA: seeds 1, 2, 3 -> 51, 52, 53: mean 52.00, sample sd 1.00
    assert "52.00 ± 1.00 (n=3)" in table2
    # gaussian rho=0.1 on CoLA: 46.00, 6.00 below the exact mean; the paper's 56.52 beside it
    row = next(line for line in table2.splitlines() if "gaussian (paper) rho=0.1" in line)
    assert "46.00 [-6.00]" in row and "56.52" in row and "78.00 [-2.00]" in row
    row = next(line for line in table4.splitlines() if line.startswith("| blocksrht"))
    # Speed from the controlled benchmark only: the step ratios of both same-setting runs pooled
    # (0.7, 0.8, 0.9, 0.6: median 0.75), the layer's 768x3072 group; no wall time of the runs.
    assert "| ours |" in row and "| 0.75 (0.67-0.83) |" in row and "| 0.80 (0.78-0.82) |" in row
    assert "01:20" not in table4 and "0.80x" not in table4 and "samples/s" not in table4
    row = next(line for line in table4.splitlines() if "| gaussian | paper | 0.1 |" in line)
    assert "| 1.10 (1.05-1.15) |" in row and "| 0.93 (0.91-0.94) |" in row
    assert "test CPU" in table4 and "model_cpu_test, model_cpu_test2" in table4
    for name in ("figure5_loss.png", "figure6_throughput.png"):
        assert (tmp_path / "figures" / name).stat().st_size > 0
    first = digest(tmp_path / "tables") | digest(tmp_path / "figures")
    build(tmp_path)
    assert digest(tmp_path / "tables") | digest(tmp_path / "figures") == first


def test_no_benchmark_no_speed(tmp_path):
    """Without results/bench no speed is shown anywhere: Table 4 has '-' and Figure 6 is not drawn
    (the runs' own times are never used)."""
    write_runs(tmp_path)
    build(tmp_path)
    row = next(line for line in (tmp_path / "tables" / "table4.md").read_text().splitlines()
               if line.startswith("| blocksrht"))
    assert row.count("| - |") >= 2 and "01:20" not in row
    assert not (tmp_path / "figures" / "figure6_throughput.png").exists()


def memory_point(table, task, batch, exact, ckpt=True, peak=False):
    """A point file of scripts/memory_table.py (bytes in MiB for readability)."""
    mib = 2**20

    def rec(v, p=None):
        out = {"saved_activation_bytes": v * mib}
        if peak and p is not None:
            out["peak_memory"] = {"peak_bytes": p * mib, "kind": "peak RSS of the step"}
        return out

    point = {"table": table, "task": task, "batch_size": batch, "real_tokens": 10 * batch,
             "padded_tokens": 20 * batch, "command": "python scripts/memory_table.py --test",
             "hardware": "test CPU", "parts": ["bytes"], "exact": rec(exact, 2 * exact),
             "limit": {"0.5": 0.9 * exact * mib, "0.2": 0.8 * exact * mib, "0.1": 0.7 * exact * mib},
             "paper": {r: rec(exact * f, 2 * exact * f) for r, f in (("0.5", 0.9), ("0.2", 0.8),
                                                                      ("0.1", 0.75))},
             "ours": {r: {**rec(exact * f, 2 * exact * f), "patch": {"sketch": "blocksrht"}}
                      for r, f in (("0.5", 0.7), ("0.2", 0.65), ("0.1", 0.6))}}
    if ckpt:
        point["ckpt"] = rec(exact // 20, exact)
        point["ckpt+ours"] = {r: rec(exact // 20, exact - 1) for r in ("0.5", "0.2", "0.1")}
    return point


def test_table3_and_figure3_with_checkpointing(tmp_path):
    """Checkpointing rows ('none' = checkpointing alone) with the benchmark's step ratios; Figure 3
    gains a checkpointing column when every point has it."""
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "table3-cola-b8.json").write_text(json.dumps(memory_point("table3", "cola", 8, 400,
                                                                        peak=True)))
    for b in (2, 4):
        (memory / f"figure3-cola-b{b}.json").write_text(json.dumps(
            memory_point("figure3", "cola", b, 100 * b, peak=True)))
    write_bench(tmp_path)
    (tmp_path / "bench" / "model_cpu_test.json").write_text(
        (tmp_path / "bench" / "model_cpu_test.json").read_text().replace('"minilm"',
                                                                          '"roberta-base"'))
    (tmp_path / "bench" / "model_cpu_test2.json").unlink()
    table3(memory, tmp_path / "tables", tmp_path / "bench")
    lines = (tmp_path / "tables" / "table3.md").read_text().splitlines()
    rows = {line.split(" | ")[2]: line for line in lines if line.startswith("| cola (8) |")}
    assert set(rows) == {"paper layout (Gaussian)", "ours (blocksrht)",
                         "checkpointing + ours (blocksrht)", "exact, padding skipped"}
    # exact with padding skipped: a row even where the point has no bytes for it, saying so
    assert "| - / - / - / - | - / - / - / - |" in rows["exact, padding skipped"]
    assert "'exact, padding skipped' has no bytes at the points marked '-' (rerun: " \
           "`python scripts/memory_table.py" in lines[2]
    # the benchmark file times no exact-skip: the table says so, and how to time it
    assert "Exact with padding rows skipped was not timed in these runs" in lines[2]
    assert "--methods exact,exact-skip," in lines[2]
    ck = rows["checkpointing + ours (blocksrht)"]
    assert "| 20 / 20 / 20 / 20 | 95% / 95% / 95% / 95% | - |" in ck
    assert "| 1.30 / - / - / 1.00 |" in ck  # ckpt 1.2-1.4, ckpt+ours@0.1 0.9-1.1; 0.5/0.2 unmeasured
    assert "| 400 / 360 / 320 / 300 | 0% / 10% / 20% / 25% | 10% / 20% / 30% |" in rows[
        "paper layout (Gaussian)"]
    assert "| 1.00 / - / - / 1.10 |" in rows["paper layout (Gaussian)"]
    assert "| 400 / 399 / 399 / 399 | 50% / 50% / 50% / 50% |" in ck  # vs exact peak 800 MiB
    figure3(memory, tmp_path / "figures")
    assert (tmp_path / "figures" / "figure3_memory.png").stat().st_size > 0


def test_table3_rows_of_bits(tmp_path):
    """b-bit stored rows (memory_table's int<b>, int<b>+compact, int<b>+ckpt) are rows of their
    own, in the 'none' column, with the benchmark's step ratio where it timed them."""
    memory = tmp_path / "memory"
    memory.mkdir()
    point = memory_point("table3", "cola", 8, 400, peak=True)
    mib = 2**20
    for kind, v in (("int8", 250), ("int4", 160), ("int4+compact", 60), ("int2+ckpt", 18)):
        point[kind] = {"saved_activation_bytes": v * mib,
                       "patch": {"sketch": "exact", "rho": 1.0, "bits": int(kind[3])}}
    point["int4"]["peak_memory"] = {"peak_bytes": 600 * mib, "kind": "peak RSS of the step"}
    (memory / "table3-cola-b8.json").write_text(json.dumps(point))
    write_bench(tmp_path)
    bench = json.loads((tmp_path / "bench" / "model_cpu_test.json").read_text())
    bench["results"][0]["model"] = "roberta-base"
    bench["results"][0]["methods"]["int4"] = {"time": {"ratios": [1.04, 1.05, 1.06],
                                                       "median_s": 1.0}}
    (tmp_path / "bench" / "model_cpu_test.json").write_text(json.dumps(bench))
    (tmp_path / "bench" / "model_cpu_test2.json").unlink()
    table3(memory, tmp_path / "tables", tmp_path / "bench")
    lines = (tmp_path / "tables" / "table3.md").read_text().splitlines()
    rows = {line.split(" | ")[2]: line for line in lines if line.startswith("| cola (8) |")}
    assert "| 250 / - / - / - | 38% / - / - / - |" in rows["exact, 8-bit rows"]
    four = rows["exact, 4-bit rows"]
    assert "| 160 / - / - / - | 60% / - / - / - | - | 600 / - / - / - | 25% / - / - / - |" in four
    assert "| 1.05 / - / - / - |" in four
    assert "| 60 / - / - / - | 85% / - / - / - |" in rows[
        "exact, 4-bit rows + compact activations"]
    assert "| 18 / - / - / - | 96% / - / - / - |" in rows["checkpointing + exact, 2-bit rows"]
    assert not any("int2" in label or "2-bit rows +" in label for label in rows)


def test_table3_from_training_runs(tmp_path):
    """experiment=table3 runs (GPU) give table3_roberta: peak memory per point and rate."""
    compact = {"dropout": "seeded", "attention": "recompute", "gelu_bits": 2,
               "gelu_code": "stochastic"}
    for sketch, rho, peak, acts in (("exact", 1.0, 8, None), ("gaussian", 0.5, 6, None),
                                    ("gaussian", 0.1, 4, None), ("exact", 1.0, 6, compact)):
        run = fake_run("mrpc", sketch, rho, 1, 80, 100)
        run["config"]["train"]["batch_size"] = 128
        run["peak_memory_bytes"] = peak * 2**30
        if acts:
            run["identity"]["activations"] = acts
        name = f"{sketch}-rho{rho}-seed1{'-compact' if acts else ''}.json"
        path = tmp_path / "runs" / "table3" / "mrpc" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))
    build(tmp_path)
    table = (tmp_path / "tables" / "table3_roberta.md").read_text()
    rows = {line.split(" | ")[1]: line for line in table.splitlines()
            if line.startswith("| mrpc (128)")}
    row = rows["gaussian (paper)"]
    assert "- / 6.00 / - / 4.00" in row and "- / 25% / - / 50%" in row and "| 8.00 |" in row
    assert "11.30 / ~10.64 / 9.20 / ~8.72" in row
    # An exact run with compact activations is a method of its own, not exact's peak.
    assert "| 6.00 / - / - / - | 25% / - / - / - | 8.00 |" in rows["exact (compact)"]


def test_majority_baseline_row(tmp_path, glue_dir):
    """scripts/majority_baseline.py scores the constant prediction with the pipeline's metrics;
    Table 2 shows it under the exact row."""
    import subprocess
    import sys

    out = tmp_path / "baselines" / "majority.json"
    subprocess.run([sys.executable, str(SCRIPTS / "majority_baseline.py"), "--glue-dir",
                    str(glue_dir), "--tasks", "cola,stsb", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    tasks = json.loads(out.read_text())["tasks"]
    assert tasks["cola"]["validation"] == {"matthews": 0.0}
    assert tasks["stsb"]["validation"] == {"pearson": None, "spearman": None}
    write_runs(tmp_path)
    build(tmp_path)
    lines = (tmp_path / "tables" / "table2.md").read_text().splitlines()
    exact = next(i for i, line in enumerate(lines) if line.startswith("| exact |"))
    # cola, its paired column empty; mrpc not scored
    assert lines[exact + 1].startswith("| majority class | 0.00 |  | - |  |")


def test_tuning_table_per_task_with_the_pool_run(tmp_path):
    for experiment, lr, batch, epochs, score in (("tune_cpu/lr3e-05", 3e-5, 32, 3, 55.0),
                                                 ("tune_cpu/bs16-lr3e-05", 3e-5, 16, 3, 56.0),
                                                 ("tune_cpu/ep10-lr3e-05", 3e-5, 32, 10, 56.5),
                                                 ("minilm_cpu", 1e-4, 32, 3, 57.0)):
        run = fake_run("rte", "exact", 1.0, 1, score, 100)
        run["config"]["train"].update(learning_rate=lr, batch_size=batch, epochs=epochs)
        path = tmp_path / "runs" / experiment / "rte" / "exact-rho1.0-seed1.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))
    build(tmp_path)
    text = (tmp_path / "tables" / "tuning.md").read_text()
    assert "Highest dev score per task at: rte lr 0.0001 batch 32 3 epochs." in text
    assert "Recipe: 3/10 epochs, batch 16/32, lr 3e-05, max length 128" in text  # tuned runs only
    rows = [line for line in text.splitlines() if line.startswith("| rte |")]
    assert [row.split(" | ")[2:6] for row in rows] == [["3e-05", "16", "3", "56.00"],
                                                       ["3e-05", "32", "3", "55.00"],
                                                       ["0.0001", "32", "3", "57.00"],
                                                       ["3e-05", "32", "10", "56.50"]]


def test_two_recipes_in_one_cell_are_refused(tmp_path):
    """A short check run filed beside the full run of the same method (another max_steps): the
    tables refuse to average them and name the setting that differs and both files."""
    write_runs(tmp_path)
    odd = fake_run("cola", "gaussian", 0.1, 2, 30, 10, max_steps=30)
    path = tmp_path / "runs/minilm_cpu/cola" / f"{sp_runs.run_stem(odd['identity'])}.json"
    path.write_text(json.dumps(odd))
    with pytest.raises(common.MixedRecipes, match=r"differing in train\.max_steps") as info:
        build(tmp_path)
    assert path.name in str(info.value)


def test_checkpointing_runs_get_their_own_row(tmp_path):
    write_runs(tmp_path)
    ckpt = fake_run("cola", "blocksrht", 0.1, 1, 47, 80, share=True, gradient_checkpointing=True)
    path = tmp_path / "runs/minilm_cpu/cola" / f"{sp_runs.run_stem(ckpt['identity'])}.json"
    path.write_text(json.dumps(ckpt))
    build(tmp_path)
    table4 = (tmp_path / "tables/table4.md").read_text()
    assert "| blocksrht | ours+ckpt | 0.1 | 47.00 |" in table4
    assert "| blocksrht | ours | 0.1 | 48.00 |" in table4
    assert "ckpt" not in (tmp_path / "tables/table2.md").read_text()


def test_run_files_without_identity_are_refused(tmp_path):
    write_runs(tmp_path)
    old = fake_run("cola", "dct", 0.1, 1, 40, 90)
    del old["identity"], old["recipe"]
    (tmp_path / "runs/minilm_cpu/cola/dct-rho0.1-seed1.json").write_text(json.dumps(old))
    with pytest.raises(common.MixedRecipes, match="migrate_runs.py"):
        build(tmp_path)


def write_paired_runs(results: Path, edit=None) -> None:
    """CoLA runs for the paired comparisons, seeds missing on purpose: exact has seeds 1-4,
    blocksrht 0.1 seeds 1-3, importance+alloc seeds 1, 2, 3, 5, blocksrht 0.2 seed 1 only.
    ``edit(identity)`` changes the blocksrht 0.1 runs' identity (all seeds alike)."""
    scores = {("exact", 1.0, "", False): {1: 50, 2: 52, 3: 57, 4: 60},
              ("blocksrht", 0.1, "", False): {1: 45, 2: 48, 3: 50},
              ("blocksrht", 0.1, "", True): {1: 49, 2: 44, 3: 53},
              ("blocksrht", 0.2, "", False): {1: 49},
              ("importance", 0.1, "variance", False): {1: 47, 2: 47, 3: 54, 5: 99}}
    for (sketch, rho, allocate, ckpt), by_seed in scores.items():
        for seed, value in by_seed.items():
            run = fake_run("cola", sketch, rho, seed, value, 100, share=sketch != "exact",
                           **({"gradient_checkpointing": True} if ckpt else {}))
            if allocate:
                run["identity"]["method"]["allocate"] = allocate
                run["config"]["method"]["allocate"] = allocate
            if edit and (sketch, rho, ckpt) == ("blocksrht", 0.1, False):
                edit(run["identity"])
            run["recipe"] = sp_runs.recipe_hash(run["identity"])
            path = results / "runs/minilm_cpu/cola" / f"{sp_runs.run_stem(run['identity'])}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(run))


def comparison_rows(results: Path, scores: bool = False) -> dict[tuple[str, str], list[str]]:
    """CoLA's comparison rows by (method, baseline): from 'n pairs' on, or both scores."""
    lines = (results / "tables/comparisons.md").read_text().splitlines()
    cells = [line.strip("| ").split(" | ") for line in lines if line.startswith("| CoLA |")]
    return {(c[1], c[2]): c[3:5] if scores else c[5:] for c in cells}


def test_paired_differences_by_seed(tmp_path):
    """Only seeds both runs have pair; the mean difference, its SE (sd / sqrt(n)) and n, beside the
    unpaired mean ± sd, in Table 2, Table 4 and the comparisons (md and csv)."""
    write_paired_runs(tmp_path)
    build(tmp_path)
    # blocksrht 0.1 - exact, seeds 1-3 (exact's seed 4 has no pair): -5, -4, -7. Mean -16/3 = -5.33;
    # sd sqrt((1/9 + 16/9 + 25/9) / 2) = sqrt(7/3) = 1.528, SE 1.528 / sqrt(3) = 0.88.
    # Unpaired: 47.67 ± 2.52 against exact's mean over four seeds 54.75: -7.08.
    row = next(line for line in (tmp_path / "tables/table2.md").read_text().splitlines()
               if line.startswith("| blocksrht (ours) rho=0.1 |"))
    assert "| 47.67 ± 2.52 (n=3) [-7.08] | -5.33 ± 0.88 (n=3) |" in row
    table4 = (tmp_path / "tables/table4.md").read_text()
    assert "| blocksrht | ours | 0.1 | 47.67 ± 2.52 (n=3) | -7.08 | -5.33 ± 0.88 (n=3) |" in table4
    # One seed in common: said, no number.
    assert "| blocksrht | ours | 0.2 | 49.00 | -5.75 | one seed |" in table4
    row = next(line for line in (tmp_path / "tables/table2.md").read_text().splitlines()
               if line.startswith("| blocksrht (ours) rho=0.2 |"))
    assert "| 49.00 [-5.75] | one seed |" in row
    # Checkpointing does not enter the pairing recipe: 49, 44, 53 against exact: -1, -8, -4, mean
    # -13/3 = -4.33, sd sqrt((100/9 + 121/9 + 1/9) / 2) = sqrt(37/3) = 3.51, SE 2.03.
    assert "| ours+ckpt | 0.1 | 48.67 ± 4.51 (n=3) | -6.08 | -4.33 ± 2.03 (n=3) |" in table4
    assert "-5.33 ± 0.88 (n=3)" in (tmp_path / "tables/table2.csv").read_text()

    rows = comparison_rows(tmp_path)
    rec, alloc = "blocksrht (ours) rho=0.1", "importance (ours+alloc) rho=0.1"
    # t(0.975, 2) = 4.303: -5.33 ± 4.303 * 0.882 = [-9.13, -1.54], below 0.
    assert rows[(rec, "exact")] == ["3", "1, 2, 3", "-5.00 / -4.00 / -7.00", "-5.33", "0.88",
                                    "[-9.13, -1.54]", "lower"]
    # importance+alloc has seed 5 and no seed 4: seeds 1-3 pair, +2, -1, +4 against blocksrht.
    # Mean 5/3 = 1.67, sd sqrt(19/3) = 2.517, SE 1.45; 1.67 ± 4.303 * 1.453 = [-4.58, +7.92].
    assert rows[(alloc, rec)] == ["3", "1, 2, 3", "+2.00 / -1.00 / +4.00", "+1.67", "1.45",
                                  "[-4.58, +7.92]", "no difference measured"]
    # Against exact: -3, -5, -3: mean -3.67, SE sqrt(4/3) / sqrt(3) = 0.67, [-6.54, -0.80].
    assert rows[(alloc, "exact")][3:] == ["-3.67", "0.67", "[-6.54, -0.80]", "lower"]
    assert rows[("blocksrht (ours) rho=0.2", "exact")] == ["1", "1", "-1.00", "-", "-", "-",
                                                            "n<2: no claim"]
    assert rows[("blocksrht (ours+ckpt) rho=0.1", rec)][-1] == "no difference measured"
    # Both sides' unpaired scores stand beside the paired difference (all their seeds).
    assert comparison_rows(tmp_path, scores=True)[(rec, "exact")][0] == "47.67 ± 2.52 (n=3)"
    # Declared comparisons without runs (MRPC, STS-B, SST-2 here) are named, not rows.
    text = (tmp_path / "tables/comparisons.md").read_text()
    missing = text.split("without runs here: ")[1].split(".\n")[0].split("; ")
    assert "MRPC importance (ours) rho=0.1 vs blocksrht (ours) rho=0.1" in missing
    assert "| MRPC |" not in text
    assert "n<2: no claim" in (tmp_path / "tables/comparisons.csv").read_text()


@pytest.mark.parametrize(("edit", "setting"), [
    (lambda ident: ident["train"].update(learning_rate=3e-5), "train.learning_rate"),
    (lambda ident: ident["train"].update(max_length=64), "train.max_length"),
    (lambda ident: ident["data"].update(sha256="1" * 16), "data.sha256"),
    (lambda ident: ident["model"].update(name="roberta-base"), "model.name"),
])
def test_paired_runs_of_different_recipes_are_refused(tmp_path, edit, setting):
    """blocksrht 0.1 trained with another setting than exact: one recipe per cell, so only the
    pairing can catch it; it names the setting and the files."""
    write_paired_runs(tmp_path, edit)
    with pytest.raises(common.MixedRecipes, match=rf"in {setting.replace('.', '[.]')}$") as info:
        build(tmp_path)
    assert "blocksrht-rho0.1-seed1-" in str(info.value) and "exact-rho1.0-seed1-" in str(info.value)


def test_verdict_wording():
    """'higher'/'lower' only when the 95% t-interval excludes 0."""
    paired = common.Paired
    # +1.0, +1.1, +0.9: SE 0.058, interval 1.0 ± 0.25, above 0.
    assert common.verdict(paired((1, 2, 3), (1.0, 1.1, 0.9))) == "higher"
    assert common.verdict(paired((1, 2, 3), (-1.0, -1.1, -0.9))) == "lower"
    # +3, -1: mean 1, SE 2, t(0.975, 1) = 12.7: the interval spans 0.
    assert common.verdict(paired((1, 2), (3.0, -1.0))) == "no difference measured"
    # +1.0, +1.1, +0.9 would be 'higher' at n=3; one seed makes no claim however large.
    assert common.verdict(paired((1,), (50.0,))) == "n<2: no claim"
    assert common.fmt_paired(paired((1,), (50.0,))) == "one seed"


def test_a_seed_without_a_score_does_not_pair():
    """An undefined metric (e.g. the correlation of constant predictions) leaves its seed out."""
    exact = [fake_run("cola", "exact", 1.0, s, 50 + s, 100) for s in (1, 2, 3)]
    ours = [fake_run("cola", "blocksrht", 0.1, s, 40 + 2 * s, 100, share=True) for s in (1, 2, 3)]
    ours[1]["best_metrics"]["matthews"] = None
    for i, r in enumerate(exact + ours):
        r["_path"] = f"run{i}.json"
    p = common.paired(ours, exact)
    assert p.seeds == (1, 3) and p.diffs == (-9, -7)


def test_compact_and_lora_runs_get_their_rows_and_pairs(tmp_path):
    """Compact activations: a row of their own in Tables 2 and 4, paired with the runs that store
    activations (the only other difference); LoRA: its own pool with its own rate, paired with
    LoRA alone in tables/lora.md, never with the full model's runs."""
    compact = {"dropout": "seeded", "attention": "recompute", "gelu_bits": 2,
               "gelu_code": "stochastic"}
    assert common.COMPACT == compact == yaml_values("configs/activations/compact.yaml")
    runs = {"minilm_cpu": [], "lora_cpu": []}
    for seed, (exact, rec, packed) in {1: (50, 45, 44), 2: (52, 48, 46), 3: (57, 50, 50)}.items():
        runs["minilm_cpu"] += [fake_run("cola", "exact", 1.0, seed, exact, 100),
                               fake_run("cola", "blocksrht", 0.1, seed, rec, 100, share=True)]
        small = fake_run("cola", "blocksrht", 0.1, seed, packed, 100, share=True)
        small["identity"]["activations"] = compact
        other = fake_run("cola", "blocksrht", 0.1, seed, 0, 100, share=True)
        other["identity"]["activations"] = {**compact, "gelu_bits": 3, "gelu_code": "optimal"}
        alone = fake_run("cola", "exact", 1.0, seed, exact + 2 - seed, 100)  # +1, 0, -1
        alone["identity"]["activations"] = compact
        runs["minilm_cpu"] += [small, other, alone]
        for sketch, rho, value in (("exact", 1.0, 30 + seed), ("blocksrht", 0.1, 29 + 2 * seed)):
            run = fake_run("cola", sketch, rho, seed, value, 100, share=sketch != "exact",
                           learning_rate=3e-3)
            run["identity"]["adapter"] = {"name": "lora", "r": 8, "alpha": 16, "dropout": 0.0,
                                          "target_modules": ["query", "value"]}
            runs["lora_cpu"].append(run)
    for pool, rs in runs.items():
        for r in rs:
            r["recipe"] = sp_runs.recipe_hash(r["identity"])
            path = tmp_path / "runs" / pool / "cola" / f"{sp_runs.run_stem(r['identity'])}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(r))
    build(tmp_path)
    # Figure 5 draws the exact model of seed 1, not its compact twin.
    drawn = figure5_runs([{**r, "_experiment": "minilm_cpu"}
                                      for r in runs["minilm_cpu"]], "minilm_cpu")
    assert [(r["sketch"], r["seed"], "activations" in r["identity"]) for r in drawn] == \
        [("exact", 1, False)]
    table4 = (tmp_path / "tables/table4.md").read_text()
    # 44, 46, 50 against exact's 50, 52, 57: -6, -6, -7, mean -6.33, SE 0.33.
    assert "| blocksrht | ours+compact | 0.1 | 46.67 ± 3.06 (n=3) | -6.33 | -6.33 ± 0.33 (n=3) |" \
        in table4
    assert "| blocksrht | ours | 0.1 | 47.67 ± 2.52 (n=3) |" in table4
    # Compact activations on the exact layers: paired with exact like any method, and the paper's
    # exact score and time are not theirs.
    assert "| exact | - | - | 53.00 ± 3.61 (n=3) | - | - | - | - | - | 60.90 | 08:44 |" in table4
    assert "| exact | compact | - | 53.00 ± 2.65 (n=3) | +0.00 | +0.00 ± 0.58 (n=3) | - | - | - | - " \
           "| - |" in table4
    # Other compact settings: a row of their own, named by what differs.
    assert "| blocksrht | ours+compact(gelu_bits=3,gelu_code=optimal) | 0.1 | 0.00 ± 0.00 (n=3) |" \
        in table4
    assert "lora" not in table4 and "lora" not in (tmp_path / "tables/table2.md").read_text()
    # Against blocksrht alone: -1, -2, 0, mean -1, SE 0.58.
    rows = comparison_rows(tmp_path)
    assert rows[("blocksrht (ours+compact) rho=0.1", "blocksrht (ours) rho=0.1")][3:5] == \
        ["-1.00", "0.58"]
    lora = (tmp_path / "tables/lora.md").read_text()
    # LoRA + blocksrht 31, 33, 35 against LoRA 31, 32, 33: 0, +1, +2.
    assert "| CoLA | blocksrht (lora+ours) rho=0.1 | exact (lora) | 33.00 ± 2.00 (n=3) | " \
           "32.00 ± 1.00 (n=3) | 3 | 1, 2, 3 | +0.00 / +1.00 / +2.00 | +1.00 | 0.58 |" in lora


def test_scales_over_other_groups_get_their_own_rows_and_pairs(tmp_path):
    """Lean with scales over 128 columns (``method.group=128``) is a method of its own, never pooled
    with the default groups of 64: paired with exact and with lean at 64."""
    lean = dict(common.LEAN)
    runs = []
    for seed, (exact, g64, g128) in {1: (50, 49, 47), 2: (52, 53, 50), 3: (57, 55, 55)}.items():
        runs.append(fake_run("cola", "exact", 1.0, seed, exact, 100))
        for group, value in ((64, g64), (128, g128)):
            run = fake_run("cola", "exact", 1.0, seed, value, 100)
            run["identity"]["method"].update(bits=4, group=group)
            run["identity"]["activations"] = lean
            runs.append(run)
    assert [common.scheme(r) for r in runs[:3]] == ["-", "int4+lean", "int4g128+lean"]
    for r in runs:
        r["recipe"] = sp_runs.recipe_hash(r["identity"])
        path = tmp_path / "runs" / "minilm_cpu" / "cola" / f"{sp_runs.run_stem(r['identity'])}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    build(tmp_path)
    rows = comparison_rows(tmp_path)
    # 47, 50, 55 against exact's 50, 52, 57: -3, -2, -2; against lean at 64's 49, 53, 55: -2, -3, 0.
    assert rows[("exact (int4g128+lean)", "exact")][:4] == ["3", "1, 2, 3",
                                                         "-3.00 / -2.00 / -2.00", "-2.33"]
    assert rows[("exact (int4g128+lean)", "exact (int4+lean)")][3] == "-1.67"
    assert rows[("exact (int4+lean)", "exact")][3] == "-0.67"


def test_frontier_points_pairs_and_fronts(tmp_path):
    """sketchprop.report.frontier: bytes from the CoLA-256 memory point, scores paired by seed with exact,
    step ratios from the roberta-base benchmark; the fronts follow the numbers, and a configuration
    without runs or bytes is listed, not drawn."""
    write_runs(tmp_path)  # exact 51/52/53; blocksrht (ours) 0.1: 48 on seed 1; gaussian 0.1: 46
    write_bench(tmp_path)
    for name in ("model_cpu_test.json", "model_cpu_test2.json"):
        path = tmp_path / "bench" / name
        path.write_text(path.read_text().replace('"minilm"', '"roberta-base"'))
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "table3-cola-b256.json").write_text(json.dumps(
        memory_point("table3", "cola", 256, 400)))
    frontier.build(tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in (tmp_path / "tables" / "frontier.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| configuration")
            and not line.startswith("|---")}
    # ours 0.1: 0.6 of exact's bytes, 48 - 51 on the one seed both have, step 0.75x (pooled)
    assert rows["blocksrht (ours) 0.1"][1:5] == ["0.600", "-3.00 (n=1)", "0.75x", "-"]
    assert rows["gaussian (paper) 0.1"][1:3] == ["0.750", "-5.00 (n=1)"]
    assert rows["checkpointing"][1:3] == ["0.050", "0 (exact gradients)"]
    assert rows["exact"][2] == "+0.00 ± 0.00 (n=3)"
    assert rows["int4"][1:3] == ["-", "not run"]
    # Checkpointing keeps the fewest bytes at exact's score: it beats every point on those two
    # axes; with time, exact (faster than checkpointing) and ours (the fastest) join it.
    front2 = {name for name, cells in rows.items() if cells[5] == "yes"}
    front3 = {name for name, cells in rows.items() if cells[6].startswith("yes")}
    assert front2 == {"checkpointing"}
    assert front3 == {"checkpointing", "exact", "blocksrht (ours) 0.1"}
    assert (tmp_path / "figures" / "frontier.png").stat().st_size > 0


def fair_bench(results: Path, full: bool = True) -> None:
    """roberta-base step runs: one on padded rows (40% real tokens) timing exact-skip beside ours,
    one on those rows without it (int4), and with ``full`` one on full-length rows."""
    bench = results / "bench"
    bench.mkdir(parents=True, exist_ok=True)

    def run(name, batch, methods):
        (bench / f"{name}.json").write_text(json.dumps({
            "environment": {"torch_threads": 1, "device": "cpu", "cpu": "test CPU"},
            "args": {"batch": 16, "seq": 128, "task": "MRPC"},
            "results": [{"model": "roberta-base", "batch": batch, "methods": {
                n: {"time": {"ratios": r, "median_s": 1.0}} for n, r in methods.items()}}]}))

    padded = {"source": "MRPC dev, test tokenizer", "real_fraction": 0.4}
    run("model_cpu_skip", padded, {"exact": [1.0] * 4, "exact-skip": [0.8, 0.8, 0.9],
                                   "ours-blocksrht@0.1": [0.72, 0.6, 0.9]})
    run("model_cpu_bits", padded, {"exact": [1.0] * 4, "int4": [0.8, 0.81, 0.82]})
    if full:
        run("model_cpu_full", {"source": "every row full length", "real_fraction": 1.0},
            {"exact": [1.0] * 4, "exact-skip": [1.02, 1.02, 1.02],
             "ours-blocksrht@0.1": [0.9, 0.918, 0.95]})


def frontier_rows(results: Path) -> tuple[list[str], dict[str, list[str]]]:
    lines = (results / "tables" / "frontier.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| configuration"))
    return header.strip("| ").split(" | "), {
        line.split(" | ")[0].lstrip("| "): line.strip("| ").split(" | ") for line in lines
        if line.startswith("| ") and line != header and not line.startswith("|---")}


def test_time_tables_have_the_exact_skip_row_and_say_which_rows(tmp_path):
    """Every step time is against exact and, where the same run timed it, against exact with
    padding skipped (each round's ratio over exact-skip's of the same round); exact-skip is a row
    of its own; the tables say which rows were timed, and show full-length rows beside the real
    lengths where a run timed them."""
    write_runs(tmp_path)
    fair_bench(tmp_path)
    memory = tmp_path / "memory"
    memory.mkdir()
    point = memory_point("table3", "cola", 256, 400)
    point["exact-skip"] = {"saved_activation_bytes": 300 * 2**20}
    (memory / "table3-cola-b256.json").write_text(json.dumps(point))
    frontier.build(tmp_path)
    header, rows = frontier_rows(tmp_path)
    assert header[3:7] == ["step time / exact (real lengths, 40% real tokens)",
                           "step time / exact, padding skipped (real lengths, 40% real tokens)",
                           "step time / exact (full-length rows)",
                           "step time / exact, padding skipped (full-length rows)"]
    skip = rows["exact, padding skipped"]
    assert skip[1:7] == ["0.750", "0 (exact gradients)", "0.80x", "1.00x", "1.02x", "1.00x"]
    # ours / exact-skip per round: 0.72/0.8, 0.6/0.8, 0.9/0.9 = 0.9, 0.75, 1.0 (median 0.90);
    # full rows: 0.9/1.02, 0.918/1.02, 0.95/1.02 (median 0.90)
    assert rows["blocksrht (ours) 0.1"][3:7] == ["0.72x", "0.90x", "0.92x", "0.90x"]
    assert rows["exact"][3:7] == ["1.00x", "1.25x", "1.00x", "0.98x"]
    # int4 was timed only in a run without exact-skip: no ratio against it
    assert rows["int4"][3:5] == ["0.81x", "-"]
    text = (tmp_path / "tables" / "frontier.md").read_text()
    assert "rows: the task's real lengths (40.0% real tokens, MRPC dev, test tokenizer)" in text
    assert "rows: full-length (no padding)" in text and "pooled over model_cpu_skip" in text

    # Without a full-length run the table says they were not timed, and how to time them.
    (tmp_path / "bench" / "model_cpu_full.json").unlink()
    frontier.build(tmp_path)
    header, rows = frontier_rows(tmp_path)
    assert not any("full-length" in h for h in header)
    text = (tmp_path / "tables" / "frontier.md").read_text()
    assert "Full-length rows: not timed (rerun: `python scripts/bench_model.py --models " \
           "roberta-base --methods exact,exact-skip," in text and "--rows full" in text
    from sketchprop.report.summary import frontier_summary

    assert "Full-length rows were not timed" in frontier_summary(tmp_path / "tables" /
                                                                 "frontier.csv")

    # Table 3 and Table 4: the row, the column against exact-skip, the rows' note.
    from sketchprop.report.table4 import table4

    table3(memory, tmp_path / "tables", tmp_path / "bench")
    lines = (tmp_path / "tables" / "table3.md").read_text().splitlines()
    t3 = {line.split(" | ")[2]: line for line in lines if line.startswith("| cola (256) |")}
    assert "| 300 / - / - / - | 25% / - / - / - |" in t3["exact, padding skipped"]
    assert "| 0.80 / - / - / - | 1.00 / - / - / - |" in t3["exact, padding skipped"]
    assert "| 1.00 / - / - / 0.72 | 1.25 / - / - / 0.90 |" in t3["ours (blocksrht)"]
    assert "rows: the task's real lengths (40.0% real tokens" in lines[2]
    for path in (tmp_path / "bench").glob("*.json"):  # the same runs, of MiniLM
        path.write_text(path.read_text().replace('"roberta-base"', '"minilm"'))
    runs = common.load_runs(tmp_path / "runs")
    table4(runs, "minilm_cpu", tmp_path / "tables" / "table4", tmp_path / "bench")
    t4 = (tmp_path / "tables" / "table4.md").read_text()
    assert "| exact | padding skipped | - | exact's (exact gradients) | - | - | " \
           "0.80 (0.80-0.85) | 1.00 |" in t4
    assert "minilm step time / exact, padding skipped (bench)" in t4
    assert "rows: the task's real lengths (40.0% real tokens" in t4


def test_blocks_are_embedded_wherever_their_markers_are(tmp_path):
    """A block's markers may sit in README.md or a page under docs/: the table goes there, the
    rest of each file stays; markers in no file, or in two, stop the build naming the files."""
    from sketchprop.report.embed import BlockError
    from sketchprop.report.summary import frontier_summary

    results = tmp_path / "results"
    write_runs(results)
    write_bench(results)
    readme = tmp_path / "README.md"
    readme.write_text("# front door\n\n<!-- BEGIN table4 -->\nold\n<!-- END table4 -->\ntail\n"
                      "<!-- BEGIN frontier_summary -->\n<!-- END frontier_summary -->\n")
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    page.write_text("# results\n<!-- BEGIN comparisons -->\n<!-- END comparisons -->\nend\n")
    build(results)
    for path, name in ((readme, "table4"), (page, "comparisons")):
        body = (results / "tables" / f"{name}.md").read_text().split("\n", 2)[2].strip()
        assert f"<!-- BEGIN {name} -->\n{body}\n<!-- END {name} -->" in path.read_text()
    summary = frontier_summary(results / "tables" / "frontier.csv")
    assert readme.read_text().startswith("# front door\n\n") and readme.read_text().endswith(
        f"tail\n<!-- BEGIN frontier_summary -->\n{summary}\n<!-- END frontier_summary -->\n")
    assert page.read_text().endswith("<!-- END comparisons -->\nend\n")
    (tmp_path / "docs" / "other.md").write_text("<!-- BEGIN table4 -->\n<!-- END table4 -->\n")
    with pytest.raises(BlockError, match=r"'table4'.*several files: README\.md, docs/other\.md"):
        build(results)
    (tmp_path / "docs" / "other.md").unlink()
    readme.write_text("# front door\n<!-- BEGIN frontier_summary -->\n<!-- END frontier_summary -->\n")
    with pytest.raises(BlockError, match=r"'table4': no file holds .*searched README\.md, docs/"):
        build(results)


def test_the_committed_tables_and_figures_are_what_make_tables_makes(tmp_path):
    """`make tables` on a copy of the committed results/ rewrites every table and figure it makes
    byte for byte: none is stale (a table changed by a code change is remade in that change)."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "results", tmp_path / "results")
    before = digest(tmp_path / "results" / "tables") | digest(tmp_path / "results" / "figures")
    build(tmp_path / "results")
    after = digest(tmp_path / "results" / "tables") | digest(tmp_path / "results" / "figures")
    assert sorted(set(after) - set(before)) == [], "tables make tables writes but none is committed"
    assert {k for k in before if before[k] != after[k]} == set(), "stale: rerun make tables"


def _matrix(tmp_path, tag, cells, times=None):
    """An architecture-matrix file of one family, ``cells``: ``{setup: (saved, error)}``."""
    payload = {"environment": {"git_commit": "abc1234"},
               "width": {"hidden": 64, "heads": 4, "mlp": 128, "layers": 2},
               "results": [{"family": "llama", "cells": [
                   {"setup": s, "saved_ratio": b, "error": e, "bias_ratio": 1.0,
                    "refused": "" if b is not None else "no"} for s, (b, e) in cells.items()]}],
               "times": times or {}}
    bench = tmp_path / "results" / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    (bench / f"architectures{'_' + tag if tag else ''}.json").write_text(json.dumps(payload))


def test_a_familys_frontier_from_the_matrix_files(tmp_path):
    from scripts import make_tables
    from sketchprop.report import family

    _matrix(tmp_path, "", {"int4": (0.7, 0.01), "compact": (0.8, 1e-14), "lean": (0.5, 0.02),
                           "worse": (0.6, 0.05), "refused": (None, None)})
    _matrix(tmp_path, "wide", {"int4": (0.6, 0.01)}, times={"llama": {
        "exact": {"ratio": 1.0, "saved_ratio": 1.0},
        "checkpointing": {"ratio": 1.25, "saved_ratio": 0.1},
        "int4": {"ratio": 1.5, "saved_ratio": 0.6}}})
    results = tmp_path / "results"
    pts = family.points(json.loads((results / "bench/architectures.json").read_text()), "llama")
    assert family.front(pts) == {"exact", "compact", "int4", "lean"}  # not "worse", not refused
    nan = [*pts, {"setup": "unmeasured", "saved": 0.01, "error": None, "bias": None,
                  "time": None, "time_ckpt": None}]
    assert family.front(nan) == family.front(pts)  # an error not measured (NaN) is on no front
    assert "refused" not in {p["setup"] for p in pts}
    make_tables.main(["--results", str(results), "--family", "llama"])
    text = (results / "tables/frontier_llama.md").read_text()
    tiny, wide = text.split("**wide")
    assert "| worse | 0.600 | 5.0e-02 | 1.0 | - | - |  |" in tiny
    # timed: each setup over exact's and over checkpointing's, from the same run
    assert "| checkpointing | 0.100 | 0.0e+00 | - | 1.25 | 1.00 | yes |" in wide
    assert "| int4 | 0.600 | 1.0e-02 | 1.0 | 1.50 | 1.20 |  |" in wide
    assert "commit abc1234" in wide
    with pytest.raises(SystemExit):
        make_tables.main(["--results", str(results), "--family", "bert"])
    with pytest.raises(ValueError, match="the matrix has llama"):
        family.build_family(results, "bert")
