"""What ``patch_linear`` does to common architectures, with its defaults, on tiny random models
(the matrix: ``sketchprop.bench.architectures``, whose docstring describes it).

    python scripts/architectures.py                 # results/bench/architectures.*
    python scripts/architectures.py --quick --out-dir /tmp/arch   # tiny, seconds
"""

import argparse

from sketchprop.bench import architectures
from sketchprop.bench.common import add_threads_arg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=architectures.__doc__.splitlines()[0])
    p.add_argument("--architectures", default=",".join(architectures.ARCHITECTURES))
    p.add_argument("--sketch", default="blocksrht")
    p.add_argument("--rho", type=float, default=0.1)
    p.add_argument("--quick", action="store_true", help="tiny sizes: seconds")
    p.add_argument("--out-dir", default=None)
    add_threads_arg(p)
    architectures.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
