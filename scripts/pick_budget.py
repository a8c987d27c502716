"""Pick by budget: the largest batch each memory-saving configuration fits in a memory budget, and
how fast it trains, for one model and one GLUE task (``sketchprop.report.budget``, whose docstring
says how each number is measured).

    python scripts/pick_budget.py --model roberta-base --task cola --budget-gib 8 --batch 64
    make budget MODEL=roberta-base TASK=cola BUDGET_GIB=8 BATCH=64
    python scripts/pick_budget.py --quick --task cola --budget-gib 1 --batch 8   # tiny model
    python scripts/pick_budget.py --family llama --budget-gib 24 --batch 8 --length 512
    make budget FAMILY=llama BUDGET_GIB=24 BATCH=8

With ``--family`` (a family of the architecture matrix: ``sketchprop.report.budget_family``): that
family at its published shape and depth, random weights, full-length rows of ``--length`` tokens,
in place of ``--model`` and ``--task``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sketchprop.bench.common import ROOT, BadArgs, add_threads_arg, default_glue_dir
from sketchprop.glue.paths import portable_command
from sketchprop.report import budget, budget_family


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=budget.__doc__.split("\n\n")[0])
    p.add_argument("--model", default="roberta-base", help="roberta-base or minilm")
    p.add_argument("--task", default="cola", help="cola, sst2, mrpc, rte, stsb, wnli (or folder names)")
    p.add_argument("--budget-gib", type=float, default=16.0, help="memory budget in GiB")
    p.add_argument("--batch", type=int, default=32, help="the batch size you want to train at")
    p.add_argument("--glue-dir", default=default_glue_dir())
    p.add_argument("--max-length", type=int, default=512, help="truncation length (the paper's 512)")
    p.add_argument("--ref-batch", type=int, default=32, help="examples in the measured batch")
    p.add_argument("--sketch", default="blocksrht", help="our sketch (default: the recommended)")
    p.add_argument("--bench-dir", default=str(ROOT / "results" / "bench"))
    p.add_argument("--memory-dir", default=str(ROOT / "results" / "memory"))
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    p.add_argument("--family", default=None,
                   help="a model family (llama, mistral, gemma2, t5, ...) at its published shape "
                        "and depth, in place of --model and --task")
    p.add_argument("--family-width", default="published",
                   help="published, or tiny (a smoke test: the tiny width at the published depth)")
    p.add_argument("--length", type=int, default=512, help="--family: tokens per row")
    p.add_argument("--rows", type=int, default=1, help="--family: rows in the measured forward (1-4)")
    add_threads_arg(p)
    args = p.parse_args(argv)
    command = portable_command(["python", "scripts/pick_budget.py",
                                *(argv if argv is not None else sys.argv[1:])])
    try:
        text = (budget_family if args.family is not None else budget).run(args, command)
    except BadArgs as err:
        p.error(str(err))
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
