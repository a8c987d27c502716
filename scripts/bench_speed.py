"""Speed: step time of every memory saving against exact and exact-skip, on full and real rows, one
thread and all; each codec against a copy of its bytes (the benchmark: ``sketchprop.bench.speed``;
``--help`` describes it).

    python scripts/bench_speed.py                          # results/bench/speed_cpu.{json,md}
    python scripts/bench_speed.py --eager-codecs --compile-model
    python scripts/bench_speed.py --quick --out-dir /tmp/speed   # tiny model, seconds
    python scripts/bench_speed.py --tables-from results/bench/speed_cpu.json  # its tables again
"""

import argparse

from sketchprop.bench import speed
from sketchprop.bench.common import ALLOCATORS, BadArgs, default_glue_dir
from sketchprop.bench.models import AUTOCAST, TASKS
from sketchprop.quantize import BITS, DEFAULT_GROUP


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=speed.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="roberta-base", choices=["roberta-base", "minilm"])
    p.add_argument("--methods",
                   default="exact,exact-skip,ckpt,int4,compact,int4+compact,int4+lean,ours+compact",
                   help="as scripts/bench_model.py names them; must include exact and exact-skip")
    p.add_argument("--sketch", default="blocksrht", help="ours' sketch (default: the recommended)")
    p.add_argument("--rhos", default="0.1")
    p.add_argument("--shapes", default="8x128,16x128", help="batch x sequence length, comma-separated")
    p.add_argument("--rows", default="full,real", help="row kinds: full (no padding), real (task lengths)")
    p.add_argument("--threads", default="1,all", help="torch thread counts; all: every usable core")
    p.add_argument("--task", default="MRPC", choices=sorted(TASKS), help="the real rows' lengths")
    p.add_argument("--glue-dir", default=default_glue_dir())
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds first (with --compile-model: the passes that warm it count)")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per cell")
    p.add_argument("--every", type=int, default=3, help="methods between exact's steps")
    p.add_argument("--autocast", default="none", choices=sorted(AUTOCAST),
                   help="forward passes and codec inputs in this dtype (default: none, float32)")
    p.add_argument("--allocator", default="keep", choices=ALLOCATORS,
                   help="keep: the C allocator keeps the pages it faulted in (default; glibc); "
                        "default: glibc as it is, returning large freed blocks to the OS")
    p.add_argument("--compile-model", action="store_true",
                   help="also every method under torch.compile(model), against compiled exact")
    p.add_argument("--codec-rows", type=int, default=807)
    p.add_argument("--codec-cols", type=int, default=3072)
    p.add_argument("--out-features", type=int, default=768, help="the dW product's output width")
    p.add_argument("--bits", type=int, default=4, choices=BITS)
    p.add_argument("--group", type=int, default=DEFAULT_GROUP)
    p.add_argument("--gelu-shape", default="2048x3072")
    p.add_argument("--mask-shape", default="16x12x128x128")
    p.add_argument("--norm-shape", default="2048x768", help="LayerNorm backward's rows x columns")
    p.add_argument("--codec-rounds", type=int, default=9)
    p.add_argument("--inner", type=int, default=5, help="codec calls per timed sample")
    p.add_argument("--eager-codecs", action="store_true",
                   help="also each codec eagerly, beside its fused (compiled) function")
    p.add_argument("--quick", action="store_true", help="tiny model and shapes: a smoke test")
    p.add_argument("--out-dir", default=None, help="default results/bench")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--tables-from", metavar="JSON", default=None,
                   help="time nothing: rebuild that run's statistics and tables from its JSON")
    args = p.parse_args(argv)
    try:
        if args.tables_from:
            speed.retable(args.tables_from)
        else:
            speed.run(args)
    except BadArgs as err:
        p.error(str(err))


if __name__ == "__main__":
    main()
