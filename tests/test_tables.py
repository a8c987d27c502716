"""scripts/make_tables.py rebuilds tables and figures from run JSON files alone, deterministically."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tables.py"


@pytest.fixture(scope="module")
def make_tables():
    spec = importlib.util.spec_from_file_location("make_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(task, sketch, rho, seed, score, runtime, share=False):
    metric = "matthews" if task == "cola" else "accuracy"
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
        name = f"{r['sketch']}-rho{r['rho']}-seed{r['seed']}.json"
        path = results / "runs" / "minilm_cpu" / r["task"] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.*"))}


def test_tables_and_figures_from_json_only_and_deterministic(make_tables, tmp_path):
    write_runs(tmp_path)
    make_tables.main(["--results", str(tmp_path)])
    table2 = (tmp_path / "tables" / "table2.md").read_text()
    table4 = (tmp_path / "tables" / "table4.md").read_text()
    # exact CoLA: seeds 1, 2, 3 -> 51, 52, 53: mean 52.00, sample sd 1.00
    assert "52.00 ± 1.00 (n=3)" in table2
    # gaussian rho=0.1 on CoLA: 46.00, 6.00 below the exact mean; the paper's 56.52 beside it
    row = next(line for line in table2.splitlines() if "gaussian (paper) rho=0.1" in line)
    assert "46.00 [-6.00]" in row and "56.52" in row and "78.00 [-2.00]" in row
    row = next(line for line in table4.splitlines() if line.startswith("| blocksrht"))
    assert "| ours |" in row and "0.80x" in row and "01:20" in row
    assert "test CPU" in table4
    for name in ("figure5_loss.png", "figure6_throughput.png"):
        assert (tmp_path / "figures" / name).stat().st_size > 0
    first = digest(tmp_path / "tables") | digest(tmp_path / "figures")
    make_tables.main(["--results", str(tmp_path)])
    assert digest(tmp_path / "tables") | digest(tmp_path / "figures") == first


def test_table3_from_training_runs(make_tables, tmp_path):
    """experiment=table3 runs (GPU) give table3_roberta: peak memory per point and rate."""
    for sketch, rho, peak in (("exact", 1.0, 8), ("gaussian", 0.5, 6), ("gaussian", 0.1, 4)):
        run = fake_run("mrpc", sketch, rho, 1, 80, 100)
        run["config"]["train"]["batch_size"] = 128
        run["peak_memory_bytes"] = peak * 2**30
        path = tmp_path / "runs" / "table3" / "mrpc" / f"{sketch}-rho{rho}-seed1.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))
    make_tables.main(["--results", str(tmp_path)])
    table = (tmp_path / "tables" / "table3_roberta.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| mrpc (128)"))
    assert "6.00 / - / 4.00" in row and "25% / - / 50%" in row and "| 8.00 |" in row
    assert "11.30 / ~10.64 / 9.20 / ~8.72" in row


def test_majority_baseline_row(make_tables, tmp_path, glue_dir):
    """scripts/majority_baseline.py scores the constant prediction with the pipeline's metrics;
    Table 2 shows it under the exact row."""
    import subprocess
    import sys

    out = tmp_path / "baselines" / "majority.json"
    subprocess.run([sys.executable, str(SCRIPT.parent / "majority_baseline.py"), "--glue-dir",
                    str(glue_dir), "--tasks", "cola,stsb", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    tasks = json.loads(out.read_text())["tasks"]
    assert tasks["cola"]["validation"] == {"matthews": 0.0}
    assert tasks["stsb"]["validation"] == {"pearson": None, "spearman": None}
    write_runs(tmp_path)
    make_tables.main(["--results", str(tmp_path)])
    lines = (tmp_path / "tables" / "table2.md").read_text().splitlines()
    exact = next(i for i, line in enumerate(lines) if line.startswith("| exact |"))
    assert lines[exact + 1].startswith("| majority class | 0.00 | - |")  # cola; mrpc not scored


def test_tuning_table_per_task_with_the_pool_run(make_tables, tmp_path):
    for experiment, lr, batch, epochs, score in (("tune_cpu/lr3e-05", 3e-5, 32, 3, 55.0),
                                                 ("tune_cpu/bs16-lr3e-05", 3e-5, 16, 3, 56.0),
                                                 ("tune_cpu/ep10-lr3e-05", 3e-5, 32, 10, 56.5),
                                                 ("minilm_cpu", 1e-4, 32, 3, 57.0)):
        run = fake_run("rte", "exact", 1.0, 1, score, 100)
        run["config"]["train"].update(learning_rate=lr, batch_size=batch, epochs=epochs)
        path = tmp_path / "runs" / experiment / "rte" / "exact-rho1.0-seed1.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))
    make_tables.main(["--results", str(tmp_path)])
    text = (tmp_path / "tables" / "tuning.md").read_text()
    assert "Highest dev score per task at: rte lr 0.0001 batch 32 3 epochs." in text
    assert "Recipe: 3/10 epochs, batch 16/32, lr 3e-05, max length 128" in text  # tuned runs only
    rows = [line for line in text.splitlines() if line.startswith("| rte |")]
    assert [row.split(" | ")[2:6] for row in rows] == [["3e-05", "16", "3", "56.00"],
                                                       ["3e-05", "32", "3", "55.00"],
                                                       ["0.0001", "32", "3", "57.00"],
                                                       ["3e-05", "32", "10", "56.50"]]
