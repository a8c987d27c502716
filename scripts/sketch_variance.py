"""Variance of each sketch's weight gradient on real activations and gradients, against Gaussian
(the study: ``sketchprop.bench.sketch_variance``; ``--help`` describes it).

    python scripts/sketch_variance.py              # MiniLM, MRPC and SST-2 dev
    python scripts/sketch_variance.py --quick      # tiny random model, seconds
"""

import argparse

from sketchprop.bench import sketch_variance
from sketchprop.bench.common import add_threads_arg, default_glue_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=sketch_variance.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="minilm", choices=["minilm", "roberta-base"])
    p.add_argument("--tasks", default="MRPC,SST-2")
    p.add_argument("--sketches", default="gaussian,rademacher,dct,dft,rowsample,blocksrht:2,"
                   "blocksrht:4,blocksrht,blocksrht:16,blocksrht:32,normsys")
    p.add_argument("--rhos", default="0.5,0.2,0.1")
    p.add_argument("--seeds", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--glue-dir", default=default_glue_dir())
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    sketch_variance.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
