"""One linear layer, forward + backward: every sketch at every rate against ``nn.Linear`` (the
benchmark: ``sketchprop.bench.layer_step``; ``--help`` describes it).

    python scripts/bench_layer.py --device cpu
    python scripts/bench_layer.py --quick          # tiny shapes, seconds
"""

import argparse

from sketchprop.bench import layer_step
from sketchprop.bench.common import add_threads_arg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=layer_step.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="768x768,768x3072,3072x768")
    p.add_argument("--rows", default="2048,4096")
    p.add_argument("--sketches", default="exact,gaussian,rademacher,dct,dft,blocksrht,rowsample,importance",
                   help="names in SKETCHES, or blocksrht:B for block size B")
    p.add_argument("--rhos", default="0.5,0.2,0.1")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-sample-ms", type=float, default=20.0)
    p.add_argument("--every", type=int, default=2, help="configurations between baseline samples")
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat: a smoke test")
    p.add_argument("--out-dir", default=None, help="default results/bench")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    layer_step.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
