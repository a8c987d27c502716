"""One training step of a whole model per method: time, saved-activation bytes, peak memory
(the benchmark: ``sketchprop.bench.model_step``; ``--help`` describes it).

    python scripts/bench_model.py --device cpu --models roberta-base
    python scripts/bench_model.py --quick          # tiny models, seconds
"""

import argparse

from sketchprop.bench import model_step
from sketchprop.bench.common import add_threads_arg, default_glue_dir
from sketchprop.bench.models import AUTOCAST, TASKS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=model_step.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default="roberta-base,minilm")
    p.add_argument("--methods", default="exact,ckpt,paper,ours,ours-gaussian,ckpt+ours")
    p.add_argument("--sketch", default="blocksrht", help="our sketch (default: the recommended)")
    p.add_argument("--rhos", default="0.5,0.2,0.1")
    p.add_argument("--parts", default="bytes,time,memory")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--task", default="MRPC", choices=sorted(TASKS))
    p.add_argument("--glue-dir", default=default_glue_dir())
    p.add_argument("--rows", default="real", choices=["real", "full"],
                   help="real: the task's real lengths, padded to --seq (default); full: every row "
                        "--seq tokens, no padding")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up rounds before timing (default 0 after the bytes part, which runs "
                        "every method once, else 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--every", type=int, default=3, help="methods between baseline steps")
    add_threads_arg(p)
    p.add_argument("--autocast", default="none", choices=sorted(AUTOCAST),
                   help="forward passes under torch.autocast in this dtype (default: none)")
    p.add_argument("--quick", action="store_true", help="tiny models and batch: a smoke test")
    p.add_argument("--out-dir", default=None, help="default results/bench")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--retable", default=None, metavar="JSON",
                   help="rewrite the .md tables of an earlier run from its JSON file and exit")
    model_step.run(p.parse_args(argv))


if __name__ == "__main__":
    main()
