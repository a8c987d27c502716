"""scripts/architectures.py on tiny sizes: the matrix of architectures that the committed
results/bench/architectures.md reports, checked against what each architecture must give."""

import json

import pytest
from test_bench_scripts import py, run_script

pytestmark = pytest.mark.usefixtures("one_thread")

# Per architecture at the --quick size (2 blocks): layers patched, of the linear layers, those
# left exact, and the groups that share one sketch (block index as N).
EXPECTED = {
    "bert": (14, 14, [], ["bert.encoder.layer.N.attention.self.{query, key, value} (x2)"]),
    "roberta": (14, 14, [], ["roberta.encoder.layer.N.attention.self.{query, key, value} (x2)"]),
    "t5": (32, 33, ["lm_head"], [
        "encoder.block.N.layer.0.SelfAttention.{q, k, v} (x2)",
        "decoder.block.N.layer.0.SelfAttention.{q, k, v} (x2)",
        "decoder.block.N.layer.1.EncDecAttention.{k, v} (one sketch for all 2 blocks)"]),
    "llama": (14, 15, ["lm_head"], ["model.layers.N.self_attn.{q_proj, k_proj, v_proj} (x2)",
                                    "model.layers.N.mlp.{gate_proj, up_proj} (x2)"]),
    "gpt2": (8, 9, ["lm_head"], []),
    "mlp": (2, 2, [], []),
}


def test_architectures_quick(tmp_path):
    out = run_script(py("architectures.py", "--quick", "--threads", "1", "--out-dir",
                        str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "architectures_quick.json").read_text())
    table = (tmp_path / "architectures_quick.md").read_text()
    assert out.rstrip().splitlines()[-1].startswith("- ")  # the table and its notes come last
    rows = {r["architecture"]: r for r in data["results"]}
    assert list(rows) == list(EXPECTED)
    for arch, (patched, linear, exact, shared) in EXPECTED.items():
        r = rows[arch]
        assert (r["patched"], r["linear_layers"], r["left_exact"], r["shared"]) == (
            patched, linear, exact, shared), arch
        assert r["patched_types"] == ({"Conv1D": 8} if arch == "gpt2" else {"Linear": patched})
        assert r["forward_exact"] and r["round_trip_exact"], arch
        assert 0 < r["saved_bytes_patched"] < r["saved_bytes_exact"], arch
        assert r["saved_ratio"] == r["saved_bytes_patched"] / r["saved_bytes_exact"]
        assert f"| {arch} | {r['model']} |" in table
