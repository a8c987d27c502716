"""What the lean preset costs in gradient accuracy, on real activations (the study:
``sketchprop.bench.lean_check``; ``--help`` describes it).

    python scripts/lean_check.py             # MiniLM, CoLA (data/glue)
    python scripts/lean_check.py --quick     # tiny random model, seconds
"""

import argparse

from sketchprop.bench import lean_check
from sketchprop.bench.common import add_threads_arg
from sketchprop.glue.data import SHIPPED_GLUE_DIR


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=lean_check.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, default=4, help="CoLA training batches measured")
    p.add_argument("--draws", type=int, default=8, help="backward passes per batch and method")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--glue-dir", default=str(SHIPPED_GLUE_DIR))
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    lean_check.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
