"""Shared fixtures: small GLUE-format files written by the tests themselves (no real GLUE data).

The suite runs the fused codecs eagerly (``SKETCHPROP_CODECS=eager``): compiling each of their
variants would add minutes, and both ways draw the same bits. ``tests/test_codecs.py`` checks
the compiled functions against the eager ones, and the tests marked ``compile`` run them compiled.
"""

import os
import random

import pytest
import torch

os.environ.setdefault("SKETCHPROP_CODECS", "eager")

WORDS = "the a cat dog bird tree house river stone red blue old new runs sees near with".split()


def _sentence(rng):
    return " ".join(rng.choices(WORDS, k=rng.randint(3, 10))) + "."


def write_glue(root, n_train=48, n_dev=16, seed=0):
    """A CoLA-like task (no header; source, label, mark, sentence) and an STS-B-like regression
    task (ten columns, header, ``score`` last) in the classic GLUE layout under ``root``."""
    rng = random.Random(seed)
    (root / "CoLA").mkdir(parents=True)
    (root / "STS-B").mkdir(parents=True)
    header = "\t".join(["index", "genre", "filename", "year", "old_index", "source1", "source2",
                        "sentence1", "sentence2", "score"])
    for split, n in (("train", n_train), ("dev", n_dev)):
        cola = []
        for _ in range(n):
            label = rng.randint(0, 1)
            cola.append(f"gj04\t{label}\t{'' if label else '*'}\t{_sentence(rng)}")
        (root / "CoLA" / f"{split}.tsv").write_text("\n".join(cola) + "\n")
        stsb = [header]
        for i in range(n):
            stsb.append(f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone"
                        f"\t{_sentence(rng)}\t{_sentence(rng)}\t{rng.uniform(0, 5):.3f}")
        (root / "STS-B" / f"{split}.tsv").write_text("\n".join(stsb) + "\n")
    return root


@pytest.fixture(scope="session")
def glue_dir(tmp_path_factory):
    """A folder with CoLA/{train,dev}.tsv and STS-B/{train,dev}.tsv (48 and 16 rows)."""
    return write_glue(tmp_path_factory.mktemp("glue"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of thousands of tiny ops: several times faster than two on a
    shared machine. Modules ask for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
