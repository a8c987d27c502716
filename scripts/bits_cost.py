"""Where the time of b-bit stored rows goes: each phase of ``sketchprop.quantize`` on one layer's
rows, against the weight-gradient product (the study: ``sketchprop.bench.bits_cost``).

    python scripts/bits_cost.py --threads 1     # results/bench/bits_cost.{json,md}
    python scripts/bits_cost.py --quick --out-dir /tmp/bits
"""

import argparse

from sketchprop.bench import bits_cost
from sketchprop.bench.common import add_threads_arg
from sketchprop.quantize import DEFAULT_GROUP


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=bits_cost.__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=807)
    p.add_argument("--cols", type=int, default=3072)
    p.add_argument("--out-features", type=int, default=768)
    p.add_argument("--bits", default="8,4,2")
    p.add_argument("--group", type=int, default=DEFAULT_GROUP)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--device", default="cpu")
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true", help="tiny shapes: seconds")
    p.add_argument("--out-dir", default=None)
    bits_cost.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
