"""scripts/architectures.py on every family at the tiny width, with the setups the targets name:
the floor alone and int4 + lean with the floor (and a 4-bit GELU code) within their bounds
of exact's saved bytes (lean at most 0.08x on every transformer family), lean's gradient
error within twice int4's, every gradient kept, the layers
patched, the round trip exact (the committed results/bench/architectures.md is the full
matrix)."""

import json
import subprocess

import pytest
import torch
from test_bench_scripts import py, run_script

from sketchprop.bench import architectures as arch
from sketchprop.bench import families as fam
from sketchprop.bench.architectures import LEAN_FLOOR
from sketchprop.bench.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

SETUPS = ("int4", "floor4", LEAN_FLOOR)
# Linear layers patched by patch_linear(bits=4): every one but a language model's lm_head.
PATCHED = {"bert": "14 of 14", "gpt2": "8 of 9", "llama": "14 of 15", "t5": "32 of 33",
           "convnet": "1 of 1"}
# With int4, lean keeps at most 0.08 of exact's saved bytes on every transformer family (its parts
# found by what the modules compute), 0.06 on those it was first written for, and the floor's
# 0.20 on the conv net (no part but the floor applies there).
LEAN_BOUND = {"bert": 0.06, "roberta": 0.06, "llama": 0.06, "qwen2": 0.06, "mistral": 0.06,
              "convnet": 0.20}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arch")
    out = run_script(py("architectures.py", "--setups", ",".join(SETUPS), "--steps", "2",
                        "--threads", "1", "--out-dir", str(tmp)), tmp, timeout=1200)
    data = json.loads((tmp / "architectures.json").read_text())
    return out, (tmp / "architectures.md").read_text(), {
        r["family"]: {c["setup"]: c for c in r["cells"]} for r in data["results"]}


def test_every_family_and_a_conv_net(matrix):
    out, table, rows = matrix
    assert list(rows) == [*FAMILIES, "convnet"]
    for family, cells in rows.items():
        assert list(cells) == list(SETUPS)
        for setup, c in cells.items():
            assert not c["refused"], (family, setup, c["refused"])
            assert c["lost"] == 0 and c["round_trip_exact"], (family, setup)
            assert 0 < c["saved_ratio"] < 1, (family, setup)
        assert f"| {family} |" in table
    for family, patched in PATCHED.items():
        assert rows[family]["int4"]["linear_patched"] == patched, family
    assert "floor_bits=4" in rows["convnet"][LEAN_FLOOR]["parts"]


def test_the_targets(matrix):
    _, _, rows = matrix
    for family, cells in rows.items():
        assert cells["floor4"]["saved_ratio"] <= 0.20, family
        assert cells[LEAN_FLOOR]["saved_ratio"] <= LEAN_BOUND.get(family, 0.08), family
        assert cells[LEAN_FLOOR]["error"] <= 2 * cells["int4"]["error"], family


def test_a_bad_name_fails_before_any_model_is_built(tmp_path):
    """A timing setup is checked with the matrix's, before the matrix runs."""
    for flag, bad in (("--setups", "int5"), ("--families", "bart"), ("--time-setups", "lean8")):
        args = ["--families", "bert", "--setups", "int4", flag, bad]  # (--time-setups: no --time)
        proc = subprocess.run(py("architectures.py", *args, "--out-dir", str(tmp_path)),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and "unknown setup or family" in proc.stderr, proc.stderr
        assert bad in proc.stderr
        assert not list(tmp_path.iterdir())


def test_published_widths_measure_saved_bytes(tmp_path):
    """``--width published``: a family at its published shape (BERT-base here, on short rows to
    be quick), its saved bytes under a setup over exact's and the shape it follows; no error
    column (no backward at those widths), and the conv net is not a published family."""
    run_script(py("architectures.py", "--width", "published", "--families", "bert", "--setups",
                  LEAN_FLOOR, "--time-length", "64", "--threads", "1", "--out-dir",
                  str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "architectures.json").read_text())
    (row,) = data["results"]
    assert row["model"] == "BertForSequenceClassification" and row["saved_bytes_exact"] > 0
    assert 0 < row["cells"][0]["saved_ratio"] < 0.2
    assert data["published"]["bert"].startswith("bert-base-uncased: hidden 768, 12 heads")
    table = (tmp_path / "architectures.md").read_text()
    assert "published width" in table and "Gradient error" not in table
    proc = subprocess.run(py("architectures.py", "--width", "published", "--families", "convnet"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown setup or family ['convnet']" in proc.stderr


def test_published_widths_on_padded_rows_compare_with_exact_skipping_the_padding(tmp_path):
    """``--real 0.4``: rows of 70/50/30/10% real tokens; exact-skip (exact, the linear layers
    keeping non-padding rows only) keeps less than exact, and the table gives each setup over
    exact-skip's too."""
    run_script(py("architectures.py", "--width", "published", "--families", "bert", "--setups",
                  f"exact-skip,{LEAN_FLOOR}", "--real", "0.4", "--time-length", "64",
                  "--threads", "1", "--out-dir", str(tmp_path)), tmp_path)
    data = json.loads((tmp_path / "architectures.json").read_text())
    skip, lean = (c["saved_ratio"] for c in data["results"][0]["cells"])
    assert 0.4 < skip < 1 and 0 < lean < skip
    table = (tmp_path / "architectures.md").read_text()
    assert "40% of them real (rows of 70%, 50%, 30%, 10%" in table
    assert f"| bert | {lean / skip:.3f} |" in table.split("over exact-skip's")[1]
    batch = arch.timing_batch("bert", fam.build("bert"), 64, 0.4)
    assert batch["attention_mask"].sum(1).tolist() == [45, 32, 19, 6]
    for bad in ("0.6", "0"):
        proc = subprocess.run(py("architectures.py", "--width", "published", "--families", "bert",
                                 "--real", bad), capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and "--real is a share of real tokens" in proc.stderr


def test_timing_runs_every_model_with_the_familys_fastest_exact_attention(monkeypatch):
    """Exact, checkpointing and each setup are timed with SDPA where the family has it (its fused
    kernels are not a saving of the setups), eager where SDPA would not compute the family's own
    attention (Gemma 2's soft cap) or the family has none (DeBERTa-v2)."""
    built, real = [], arch.build

    def spy(name, width, positions=None, overrides=None, attention="eager"):
        built.append(attention)
        return real(name, width, positions, overrides, attention)
    monkeypatch.setattr(arch, "build", spy)
    stats = arch.time_family("llama", fam.TINY, [arch.LEAN_FLOOR_SRHT], 16, 1,
                             torch.device("cpu"))
    assert built == ["sdpa"] * 3 and stats["exact"]["attention"] == "sdpa"
    assert set(stats) == {"exact", "checkpointing", arch.LEAN_FLOOR_SRHT}
    assert fam.fastest_attention("gemma2") == fam.fastest_attention("deberta-v2") == "eager"
    assert fam.fastest_attention("gemma3") == fam.fastest_attention("gpt2") == "sdpa"
