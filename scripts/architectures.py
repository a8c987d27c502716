"""Every family, every setup: saved bytes over exact's, gradient error and bias, the parts that
applied and those left (the matrix: ``sketchprop.bench.architectures``, whose docstring describes
it).

    python scripts/architectures.py                       # results/bench/architectures.*
    python scripts/architectures.py --width wide --tag wide   # hidden 384: architectures_wide.*
    python scripts/architectures.py --width wide --time --tag wide_time   # and step time
    python scripts/architectures.py --width published --tag published   # saved bytes, published widths
    python scripts/architectures.py --width published --real 0.4 \
        --setups 'exact-skip,int4+lean(gelu4)+floor4' --tag published_real40   # padded rows
    python scripts/architectures.py --families bert,gpt2 --setups int4,lean --out-dir /tmp/arch
"""

import argparse

from sketchprop.bench import architectures
from sketchprop.bench.common import add_threads_arg
from sketchprop.bench.families import FAMILIES


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=architectures.__doc__.splitlines()[0])
    p.add_argument("--families", default=None,
                   help="default: every family, and the conv net but at --width published")
    p.add_argument("--setups", default=None,
                   help=f"default: every setup; at --width published "
                        f"{','.join(architectures.PUBLISHED_SETUPS)}")
    p.add_argument("--width", choices=[*architectures.WIDTHS, "published"], default="tiny",
                   help="published: each family's published shape, saved bytes only")
    p.add_argument("--steps", type=int, default=4,
                   help="training steps per setup: the error's mean and the bias's (default 4)")
    p.add_argument("--time", action="store_true",
                   help="also time a step of exact, checkpointing and --time-setups")
    p.add_argument("--time-setups",
                   default=f"int4+lean+floor4,int4+lean-gelu+floor4,{architectures.LEAN_FLOOR},"
                           f"{architectures.LEAN_FLOOR_SRHT}")
    p.add_argument("--time-length", type=int, default=512,
                   help="tokens per row when timing, and at --width published")
    p.add_argument("--real", type=float, default=1.0,
                   help="with --width published: that share of the tokens real, rows padded on "
                        "the right (0.4: rows of 70/50/30/10%%); default 1, full-length rows")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--tag", default="", help="architectures_<tag>.{json,md}")
    p.add_argument("--out-dir", default=None)
    add_threads_arg(p)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the bias compares the steps' mean with one step)")
    published = args.width == "published"
    if args.families is None:
        args.families = ",".join([*FAMILIES, *([] if published else [architectures.CONV])])
    if args.setups is None:
        args.setups = ",".join(architectures.PUBLISHED_SETUPS if published else architectures.SETUPS)
    architectures.run(args)


if __name__ == "__main__":
    main()
