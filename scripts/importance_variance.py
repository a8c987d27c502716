"""Per-layer gradient variance of importance sampling against the paper's sketches, on real batches
(the study: ``sketchprop.bench.importance_variance``; ``--help`` describes it).

    python scripts/importance_variance.py              # MiniLM, CoLA (data/glue)
    python scripts/importance_variance.py --quick      # tiny random model, seconds
"""

import argparse

from sketchprop.bench import importance_variance
from sketchprop.bench.common import add_threads_arg
from sketchprop.glue.data import SHIPPED_GLUE_DIR


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=importance_variance.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rhos", default="0.1,0.2")
    p.add_argument("--steps", type=int, default=300, help="exact training steps for the later state")
    p.add_argument("--warmup", type=int, default=60, help="passes that train the estimates")
    p.add_argument("--batches", type=int, default=8, help="held-out batches measured")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--glue-dir", default=str(SHIPPED_GLUE_DIR))
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    importance_variance.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
