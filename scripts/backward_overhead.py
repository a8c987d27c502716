"""Is ``.backward()`` slow? The forum case timed like for like, and the overhead of our Function
(the study: ``sketchprop.bench.backward_overhead``; ``--help`` describes it).

    python scripts/backward_overhead.py --device cpu
    python scripts/backward_overhead.py --quick
"""

import argparse

from sketchprop.bench import backward_overhead
from sketchprop.bench.common import add_threads_arg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=backward_overhead.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=200, help="iterations of the naive forum timing")
    p.add_argument("--block", type=int, default=50, help="iterations per fair timing sample")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--min-sample-ms", type=float, default=30.0)
    add_threads_arg(p)
    p.add_argument("--skip-model", action="store_true", help="leave out the whole-model step")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")
    backward_overhead.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
