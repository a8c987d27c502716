"""Weight-gradient error against stored bits: sketches, b-bit codes of ``X``, and both together
(the study: ``sketchprop.bench.equal_bytes``; ``--help`` describes it).

    python scripts/equal_bytes.py --threads 1     # MiniLM, CoLA/SST-2/MRPC
    python scripts/equal_bytes.py --quick         # tiny random model, seconds
"""

import argparse

from sketchprop.bench import equal_bytes
from sketchprop.bench.common import BadArgs, add_threads_arg
from sketchprop.glue.data import SHIPPED_GLUE_DIR


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=equal_bytes.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tasks", default=",".join(equal_bytes.TASKS))
    p.add_argument("--rhos", default="0.05,0.1,0.2,0.25,0.5")
    p.add_argument("--groups", default="16,32,64,128,256")
    p.add_argument("--combo", default="blocksrht,rowsample",
                   help="sketches whose rows are also stored as b-bit codes")
    p.add_argument("--draws", type=int, default=6, help="sketch draws for the rounding variance")
    p.add_argument("--batches", type=int, default=1, help="training batches per task")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--glue-dir", default=str(SHIPPED_GLUE_DIR))
    p.add_argument("--figure", default=None, help=f"the figure's path (default {equal_bytes.FIGURE}; "
                   "--quick: none unless given)")
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only draw the figure from a JSON file this script wrote")
    args = p.parse_args(argv)
    try:
        equal_bytes.run(args)
    except BadArgs as err:
        p.error(str(err))


if __name__ == "__main__":
    main()
