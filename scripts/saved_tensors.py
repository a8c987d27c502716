"""What one training forward saves for backward, by the autograd node that saves it (the listing:
``sketchprop.bench.saved_tensors``; ``--help`` describes it).

    python scripts/saved_tensors.py --device cuda
    python scripts/saved_tensors.py --quick        # tiny model, seconds
    python scripts/saved_tensors.py --rows full --methods exact,int4+compact,int4+lean,ckpt
"""

import argparse

from sketchprop.bench import saved_tensors
from sketchprop.bench.common import add_threads_arg, default_glue_dir
from sketchprop.bench.models import TASKS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=saved_tensors.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--methods", default="exact,compact,ours+compact,ckpt+ours+compact")
    p.add_argument("--sketch", default="blocksrht")
    p.add_argument("--rhos", default="0.1")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--task", default="MRPC", choices=sorted(TASKS))
    p.add_argument("--rows", default="real", choices=["real", "full"],
                   help="the task's real lengths, or every row a real token")
    p.add_argument("--glue-dir", default=default_glue_dir())
    add_threads_arg(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")
    saved_tensors.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
