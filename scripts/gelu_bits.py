"""Bias and variance of the few-bit GELU codes against exact GELU, on real activations (the study:
``sketchprop.bench.gelu_bits``; ``--help`` describes it).

    python scripts/gelu_bits.py             # MiniLM, CoLA (data/glue)
    python scripts/gelu_bits.py --quick     # tiny random model, seconds
"""

import argparse

from sketchprop.bench import gelu_bits
from sketchprop.bench.common import BadArgs, add_threads_arg
from sketchprop.glue.data import SHIPPED_GLUE_DIR


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=gelu_bits.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bits", default="1,2,3,4")
    p.add_argument("--steps", type=int, default=300, help="exact training steps for the later state")
    p.add_argument("--batches", type=int, default=8, help="held-out batches measured")
    p.add_argument("--draws", type=int, default=16, help="draws of the stochastic code per batch")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--glue-dir", default=str(SHIPPED_GLUE_DIR))
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    try:
        gelu_bits.run(p.parse_args(argv))
    except BadArgs as err:
        p.error(str(err))


if __name__ == "__main__":
    main()
