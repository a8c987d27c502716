"""Smoke tests of the benchmark scripts: each runs on tiny shapes on CPU (``--quick``) and writes its
JSON and markdown table; plus checks of the fast sketch implementations the benchmarks rely on."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sketchprop.sketches import SKETCHES, BlockSRHT

ROOT = Path(__file__).resolve().parents[1]


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


def test_bench_layer_quick(tmp_path):
    out = run_script(py("bench_layer.py", "--quick", "--threads", "1", "--out-dir", str(tmp_path)),
                     tmp_path)
    data = json.loads((tmp_path / "layer_cpu_quick.json").read_text())
    assert (tmp_path / "layer_cpu_quick.md").is_file()
    assert out.rstrip().splitlines()[-1].startswith("|")  # the summary table is printed last
    for group in data["groups"]:
        cfg = group["configs"]
        assert cfg["nn.Linear"]["saved_ratio"] == 1.0
        assert cfg["exact@1"]["saved_ratio"] == pytest.approx(1.0)
        for name in SKETCHES:
            if name == "exact":
                continue
            for rho in (0.5, 0.2, 0.1):
                c = cfg[f"{name}@{rho:g}"]
                k = max(16, math.ceil(rho * group["rows"]))
                assert c["saved_ratio"] == pytest.approx(k / group["rows"])
                assert c["ratio"] > 0 and c["median_s"] > 0


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
        assert m["memory"]["peak_rss"] > 0
        assert m["time"]["median_s"] > 0
    assert ms["exact"]["time"]["ratio"] == 1.0


def test_backward_overhead_quick(tmp_path):
    out = run_script(py("backward_overhead.py", "--quick", "--threads", "1", "--out-dir",
                        str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "overhead_cpu_quick.json").read_text())
    assert data["forum"]["same_iterates"]
    assert set(data["forum"]["fair"]) == {"autograd", "manual", "manual+loss"}
    assert data["exact_path"] and data["exact_model"]["ratio"] > 0
    assert "exact sketch" in out


def test_sketch_variance_quick(tmp_path):
    run_script(py("sketch_variance.py", "--quick", "--threads", "1", "--tasks", "MRPC",
                  "--sketches", "gaussian,blocksrht,rowsample,normsys", "--rhos", "0.5",
                  "--out-dir", str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "variance_quick.json").read_text())
    assert set(data["summary"]) == {"gaussian@0.5", "blocksrht@0.5", "rowsample@0.5",
                                    "normsys@0.5"}
    for v in data["summary"].values():
        assert 0 < v["aggregate"] < 10


def test_gpu_check_on_cpu(tmp_path):
    out = run_script(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick",
                      "--out-dir", str(tmp_path)], tmp_path, timeout=900)
    for name in ("layer", "model", "overhead"):
        assert (tmp_path / f"{name}_cpu_quick_gpucheck.json").is_file()
    assert "gpu_check: tables" in out
    assert out.rstrip().splitlines()[-1].startswith("|")


# --------------------------------------------------------------------- fast sketch implementations

SKETCH_NAMES = [n for n in SKETCHES if n != "exact"]


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
        torch.testing.assert_close(sk.apply(a[:n], k, 11), sk.apply(a[:n], k, 11))
        assert sk.apply(a[:n].float(), k, 11).dtype == torch.float32


@pytest.mark.parametrize("name", SKETCH_NAMES)
def test_fast_path_unbiased(name):
    """``E[S S^T] = I``: the mean over seeds converges (n = 13: odd, not a multiple of the block)."""
    n, k, seeds = 13, 5, 3000
    sk = SKETCHES[name]
    acc = torch.zeros(n, n, dtype=torch.float64)
    for s in range(seeds):
        st = dense_st(sk, n, k, seed=s)
        acc += st.T @ st
    mean = acc / seeds
    # Entries of S S^T have variance O(n/k) at most; 6 standard errors.
    tol = 6 * math.sqrt(4 * n / k / seeds)
    assert (mean - torch.eye(n, dtype=torch.float64)).abs().max().item() < tol


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
