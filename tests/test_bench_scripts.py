"""Smoke tests of the benchmark scripts: each runs on tiny shapes on CPU (``--quick``) and writes its
JSON and markdown table; plus checks of the fast sketch implementations the benchmarks rely on."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sketchprop.sketches import SKETCHES, BlockSRHT

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def run_script(args: list[str], tmp_path: Path, timeout: int = 600) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHON"] = sys.executable  # for gpu_check.sh
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def py(script: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / script), *args]


def check_timing(t: dict, base_median_s: float) -> None:
    """The reported statistics are those of the recorded samples."""
    assert t["samples_s"] and min(t["samples_s"]) > 0
    assert t["median_s"] == statistics.median(t["samples_s"])
    assert t["ratio"] == statistics.median(t["ratios"])
    assert t["ratio_q1"] <= t["ratio"] <= t["ratio_q3"]
    assert t["ratio_of_medians"] == pytest.approx(t["median_s"] / base_median_s)


def test_bench_layer_quick(tmp_path):
    out = run_script(py("bench_layer.py", "--quick", "--threads", "1", "--out-dir", str(tmp_path)),
                     tmp_path)
    data = json.loads((tmp_path / "layer_cpu_quick.json").read_text())
    assert (tmp_path / "layer_cpu_quick.md").is_file()
    assert out.rstrip().splitlines()[-1].startswith("|")  # the summary table is printed last
    for group in data["groups"]:
        cfg = group["configs"]
        base = cfg["nn.Linear"]
        assert base["saved_ratio"] == 1.0 and base["ratios"] == [1.0] * len(base["samples_s"])
        assert cfg["exact@1"]["saved_ratio"] == pytest.approx(1.0)
        for c in cfg.values():
            check_timing(c, base["median_s"])
        for name in SKETCHES:
            if name == "exact":
                continue
            for rho in (0.5, 0.2, 0.1):
                c = cfg[f"{name}@{rho:g}"]
                k = max(16, math.ceil(rho * group["rows"]))
                # k of the rows, and the 8-byte seed that regenerates S in backward (importance:
                # k row indices and k scales, 8 bytes per row, and an 8-byte top count).
                extra = 8 * k if SKETCHES[name].data_dependent else 0
                assert c["saved_bytes"] == k / group["rows"] * base["saved_bytes"] + 8 + extra
                assert c["saved_ratio"] == pytest.approx(c["saved_bytes"] / base["saved_bytes"])


def test_importance_variance_quick(tmp_path):
    out = run_script(py("importance_variance.py", "--quick", "--threads", "1", "--out-dir",
                        str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "importance_variance_quick.json").read_text())
    assert (tmp_path / "importance_variance_quick.md").read_text() in out
    configs = {"blocksrht", "gaussian", "importance", "importance+allocate"}
    assert {(r["state"], r["rho"]) for r in data["results"]} == {
        (s, rho) for s in ("step 0", "step 4") for rho in (0.1, 0.2)}
    for row in data["results"]:
        assert set(row["summary"]) == set(row["saved_bytes"]) == configs
        for c in configs:
            rel = row["layers"][c]
            assert rel and all(math.isfinite(v) and v >= 0 for v in rel.values())
            assert row["summary"][c]["mean"] == pytest.approx(statistics.mean(
                v for n, v in rel.items() if "pooler" not in n))


def test_bench_model_quick(tmp_path):
    out = run_script(py("bench_model.py", "--quick", "--threads", "1", "--models", "roberta-base",
                        "--methods", "exact,ckpt,paper,ours,ckpt+ours", "--rhos", "0.5",
                        "--out-dir", str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "model_cpu_quick.json").read_text())
    assert "roberta-base" in out and out.rstrip().splitlines()[-1].startswith("Analytic limit")
    res = data["results"][0]
    ms = res["methods"]
    exact = ms["exact"]["saved_bytes"]
    ours, paper = ms["ours-blocksrht@0.5"], ms["paper@0.5"]
    assert ours["saved_bytes"] < exact and paper["saved_bytes"] < exact
    assert ms["ckpt"]["saved_bytes"] < exact
    assert ours["analytic_limit_bytes"] < exact
    a = res["analytic"]
    assert a["linear_only"] + a["other"] == a["total"] == exact
    for m in ms.values():
        mem = m["memory"]
        # The peak of the steps is reset to the resident size they start from (Linux).
        assert mem["peak_covers"] == "training steps"
        assert mem["peak_rss"] >= mem["rss_before_steps"] > 0
        check_timing(m["time"], ms["exact"]["time"]["median_s"])
    assert ms["exact"]["time"]["ratio"] == 1.0


def test_backward_overhead_quick(tmp_path):
    out = run_script(py("backward_overhead.py", "--quick", "--threads", "1", "--out-dir",
                        str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "overhead_cpu_quick.json").read_text())
    assert data["forum"]["same_iterates"]
    assert set(data["forum"]["fair"]) == {"autograd", "manual", "manual+loss"}
    assert data["exact_path"] and data["exact_model"]["ratio"] > 0
    assert "exact sketch" in out


def import_script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


# The script's aggregate is the mean over its seeds of the per-seed aggregate a = sum over layers of
# |dW_hat - dW|^2 / sum of the Gaussian closed forms, so it is 1 in expectation for the Gaussian
# sketch and the ratio of the closed forms for the others. Its Monte-Carlo error is sd(a) / sqrt(4)
# (--quick: 4 seeds), with sd(a) measured here over MORE_SEEDS other seeds on the same layers; the
# mean over those seeds is held to the same expectation within its own, 5x smaller, error.
MORE_SEEDS = 100
Z_AGG = 4.5


def test_sketch_variance_quick(tmp_path):
    specs, rho = ["gaussian", "blocksrht", "rowsample", "normsys"], 0.5
    run_script(py("sketch_variance.py", "--quick", "--threads", "1", "--tasks", "MRPC",
                  "--sketches", ",".join(specs), "--rhos", str(rho),
                  "--out-dir", str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "variance_quick.json").read_text())
    assert set(data["summary"]) == {f"{s}@{rho:g}" for s in specs}
    quick_seeds = data["args"]["seeds"]
    assert quick_seeds == 4

    sv, bm = import_script("sketch_variance"), import_script("bench_model")
    model = bm.build_model("minilm", True).train()
    args = SimpleNamespace(batch=4, seq=32, task="MRPC", glue_dir=bm.default_glue_dir(), quick=True)
    batch, _ = bm.make_batch("minilm", model, args)
    torch.manual_seed(0)
    layers = [(x, y, math.ceil(rho * x.shape[0] - 1e-9)) for _, x, y in sv.capture(model, batch)]
    assert len(layers) == len(data["layers"])

    def closed_form(spec):
        return sum(SKETCHES[spec].expected_variance(x, y, k) for x, y, k in layers)

    gaussian = closed_form("gaussian")
    for spec in specs:
        fn = sv.estimator(spec)
        a = torch.tensor([sum((fn(x, y, k, seed) - y.T @ x).square().sum().item()
                              for x, y, k in layers) / gaussian
                          for seed in range(10_000, 10_000 + MORE_SEEDS)], dtype=torch.float64)
        sd = a.std().item()
        more = a.mean().item()
        if spec == "normsys":  # no closed form: the script's value against the larger sample
            want, err = more, math.hypot(sd / math.sqrt(quick_seeds), sd / math.sqrt(MORE_SEEDS))
        else:
            want, err = closed_form(spec) / gaussian, sd / math.sqrt(quick_seeds)
            assert abs(more - want) < Z_AGG * sd / math.sqrt(MORE_SEEDS), (spec, more, want)
        got = data["summary"][f"{spec}@{rho:g}"]["aggregate"]
        assert abs(got - want) < Z_AGG * err, (spec, got, want, err)


def test_gpu_check_on_cpu(tmp_path):
    out = run_script(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick",
                      "--out-dir", str(tmp_path)], tmp_path, timeout=900)
    for name in ("layer", "model", "overhead"):
        assert (tmp_path / f"{name}_cpu_quick_gpucheck.json").is_file()
    assert "gpu_check: tables" in out
    assert out.rstrip().splitlines()[-1].startswith("|")


# --------------------------------------------------------------------- fast sketch implementations

# Kinds whose S is a linear map fixed by the seed (importance's depends on X: test_layers).
SKETCH_NAMES = [n for n, sk in SKETCHES.items() if not sk.exact and not sk.data_dependent]


def dense_st(sketch, n: int, k: int, seed: int) -> torch.Tensor:
    """``S^T`` as a dense ``k x n`` matrix, read off the sketch applied to the identity."""
    return sketch.apply(torch.eye(n, dtype=torch.float64), k, seed)


@pytest.mark.parametrize("name", SKETCH_NAMES)
@pytest.mark.parametrize("n", [1, 2, 7, 13, 16])
def test_fast_path_is_one_linear_map(name, n):
    """``apply`` is ``S^T a`` for one fixed ``S`` per seed, with and without a ``rows`` index."""
    sk = SKETCHES[name]
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n + 5, 6, dtype=torch.float64, generator=g)
    rows = torch.arange(1, n + 1)  # a strict subset of a's rows
    for k in sorted({1, max(1, n // 3), n}):
        st = dense_st(sk, n, k, seed=11)
        torch.testing.assert_close(sk.apply(a[:n], k, 11), st @ a[:n])
        torch.testing.assert_close(sk.apply(a, k, 11, rows), st @ a[rows])
        assert sk.apply(a[:n].float(), k, 11).dtype == torch.float32


@pytest.mark.parametrize("name", SKETCH_NAMES)
def test_fast_path_draws_a_new_sketch_per_seed(name):
    n, k = 13, 5
    draws = {tuple(dense_st(SKETCHES[name], n, k, seed).flatten().tolist()) for seed in range(8)}
    assert len(draws) > 1


# E[S S^T] = I, entry by entry, within Z_ENTRIES standard errors of the mean over SEEDS draws,
# each computed from the draws' own variance: 2/k on the diagonal and 1/k off it for the i.i.d.
# kinds, n/k - 1 on the diagonal for row sampling (0.02-0.03 as standard errors here). The 91
# distinct entries together raise a false alarm with probability < 1e-3 (two-sided 6.8e-6 each).
# The scale, tr(S S^T)/n, has a far smaller error (0 for the sampling kinds, whose trace is exactly
# n without padding): a 5% scale error lies over 2 Z_SCALE standard errors away for every kind.
SEEDS = 3000
Z_ENTRIES = 4.5
Z_SCALE = 3.3  # two-sided 1e-3
ROUNDING = 1e-6


@pytest.mark.parametrize("name", SKETCH_NAMES)
def test_fast_path_unbiased(name):
    """``E[S S^T] = I``: the mean over seeds converges (n = 13: odd, not a multiple of the block)."""
    n, k = 13, 5
    sk = SKETCHES[name]
    sts = [dense_st(sk, n, k, seed=s) for s in range(SEEDS)]
    sst = torch.stack([st.T @ st for st in sts])
    dev = sst.mean(0) - torch.eye(n, dtype=torch.float64)
    se = sst.std(0) / math.sqrt(SEEDS)
    # ROUNDING: the dct/dft row weights are float32 numbers (relative 6e-8) even in float64.
    assert (dev.abs() - Z_ENTRIES * se).max().item() < ROUNDING, (dev / se).abs().max()

    trace = sst.diagonal(dim1=1, dim2=2).sum(1) / n
    scale_se = trace.std().item() / math.sqrt(SEEDS)
    assert abs(trace.mean().item() - 1) < Z_SCALE * scale_se + ROUNDING
    assert 2 * Z_SCALE * scale_se < 0.05, "no power against a 5% scale error"


@pytest.mark.parametrize("gather_limit", [1 << 24, 0])
def test_blocksrht_sparse_and_gather_paths_agree(monkeypatch, gather_limit):
    """On CPU float32/64 the block SRHT is one CSR product; other dtypes and devices gather (all
    source rows at once, or one block column at a time past GATHER_LIMIT)."""
    import sketchprop.sketches as sketches

    monkeypatch.setattr(sketches, "GATHER_LIMIT", gather_limit)
    sk = BlockSRHT()
    a = torch.randn(37, 12)
    rows = torch.tensor([0, 2, 3, 5, 8, 9, 10, 20, 21, 22, 30, 31, 33, 36])
    for r in (None, rows):
        fast = sk.apply(a, 5, 3, r)
        slow = sk.apply(a.bfloat16(), 5, 3, r).float()
        torch.testing.assert_close(fast, slow, rtol=0.05, atol=0.05)


def write_dev(root: Path, task: str, header: str | None, rows: list[str]) -> None:
    (root / task).mkdir(parents=True, exist_ok=True)
    (root / task / "dev.tsv").write_text("\n".join(([header] if header else []) + rows) + "\n")


def test_memory_table_quick(tmp_path):
    glue, out = tmp_path / "glue", tmp_path / "memory"
    write_dev(glue, "CoLA", None, [f"gj04\t1\t\t{'the cat sees a dog ' * (i % 5 + 1)}."
                                   for i in range(12)])
    write_dev(glue, "MRPC", "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
              [f"1\t{i}\t{i + 1}\tthe old river {'runs ' * i}\ta red house." for i in range(8)])
    args = py("memory_table.py", "--quick", "--threads", "1", "--glue-dir", str(glue),
              "--out-dir", str(out))
    run_script(args, tmp_path)
    names = sorted(p.name for p in out.glob("*.json"))
    assert names == ["figure3-cola-b4.json", "figure3-cola-b6.json", "table3-cola-b8.json",
                     "table3-mrpc-b4.json"]
    for name in names:
        p = json.loads((out / name).read_text())
        exact = p["exact"]["saved_activation_bytes"]
        assert p["real_tokens"] < p["padded_tokens"]
        for scheme in ("paper", "ours"):
            saved = [p[scheme][r]["saved_activation_bytes"] for r in ("0.5", "0.2", "0.1")]
            assert exact > saved[0] >= saved[1] >= saved[2] > 0, (name, scheme, exact, saved)
        assert exact > p["limit"]["0.5"] > p["limit"]["0.1"] > 0
    # A second run skips what is there; nothing is rewritten.
    before = {n: (out / n).read_bytes() for n in names}
    assert "skipped" in run_script(args, tmp_path)
    assert {n: (out / n).read_bytes() for n in names} == before
    # The tables read the files: Table 3 and the Figure 3 curve (which borrows Table 3's CoLA point).
    spec = importlib.util.spec_from_file_location("make_tables", ROOT / "scripts" / "make_tables.py")
    make_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tables)
    make_tables.table3(out, tmp_path / "tables")
    make_tables.figure3(out, tmp_path / "figures")
    table = (tmp_path / "tables" / "table3.md").read_text()
    assert "| mrpc (4) |" in table and "| cola (8) |" in table and "memory_table.py" in table
    assert (tmp_path / "figures" / "figure3_memory.png").stat().st_size > 0


def test_memory_table_peak_child_and_merge(tmp_path):
    """The fresh-process peak of one training step, and adding that part to a bytes-only file."""
    line = run_script(py("memory_table.py", "--quick", "--threads", "1", "--child", "null",
                         "--lengths", "[3, 5]"), tmp_path).splitlines()[-1]
    res = json.loads(line.removeprefix("RESULT "))
    assert res["peak_bytes"] >= res["before_step_bytes"] > 0
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from memory_table import merge
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    old = {"parts": ["bytes"], "command": "a", "wall_seconds": 1.0, "limit": {"0.1": 5},
           "exact": {"saved_activation_bytes": 10}, "paper": {"0.1": {"saved_activation_bytes": 6}},
           "ours": {"0.1": {"saved_activation_bytes": 5}}}
    new = {"parts": ["memory"], "command": "b", "wall_seconds": 2.0,
           "exact": {"peak_memory": {"peak_bytes": 100}}, "paper": {"0.1": {"peak_memory": 1}},
           "ours": {"0.1": {"peak_memory": 2}}}
    m = merge(old, new)
    assert m["parts"] == ["bytes", "memory"] and m["limit"] == {"0.1": 5}
    assert m["exact"] == {"saved_activation_bytes": 10, "peak_memory": {"peak_bytes": 100}}
    assert m["ours"]["0.1"] == {"saved_activation_bytes": 5, "peak_memory": 2}
    assert m["wall_seconds"] == 3.0 and m["command"] == "a ; b"


@pytest.mark.parametrize("bad, message", [(["--parts", "bites"], "bites"),
                                          (["--points", "table9"], "table9"),
                                          (["--tasks", "QQP"], "QQP"),
                                          (["--glue-dir", "/nonexistent"], "lacks dev.tsv")])
def test_memory_table_bad_input_fails_before_work(tmp_path, bad, message):
    proc = subprocess.run(py("memory_table.py", "--quick", "--out-dir", str(tmp_path), *bad),
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 2 and message in proc.stderr
    assert not any(tmp_path.iterdir())
