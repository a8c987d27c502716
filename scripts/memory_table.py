"""Table 3 and Figure 3: the memory roberta-base keeps for backward, exact against randomized (the
benchmark: ``sketchprop.bench.memory_table``, whose docstring describes the points and methods).

    python scripts/memory_table.py --points table3 --parts bytes            # make memory runs
    python scripts/memory_table.py --points table3 --tasks CoLA --parts memory   # these three
    python scripts/memory_table.py --points figure3 --parts bytes,memory
    python scripts/memory_table.py --quick --out-dir /tmp/memory            # tiny model, seconds
"""

import argparse

from sketchprop.bench import memory_table
from sketchprop.bench.common import ROOT, BadArgs, add_threads_arg, default_glue_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=memory_table.__doc__.split("\n\n")[0])
    p.add_argument("--points", default="table3,figure3", help="table3, figure3 or both")
    p.add_argument("--parts", default="bytes", help="bytes, memory or both")
    p.add_argument("--methods", default=",".join(memory_table.METHOD_KINDS),
                   help=f"any of {', '.join(memory_table.METHOD_KINDS)} (default: all)")
    p.add_argument("--tasks", default=None, help="only these tasks' points (e.g. CoLA,MRPC)")
    p.add_argument("--sketch", default="blocksrht", help="our sketch (default: the recommended)")
    p.add_argument("--glue-dir", default=default_glue_dir())
    p.add_argument("--device", default="cpu")
    add_threads_arg(p)
    p.add_argument("--out-dir", default=str(ROOT / "results" / "memory"))
    p.add_argument("--overwrite", action="store_true",
                   help="measure the requested methods and parts again where the file has them "
                        "(the file's other methods are kept)")
    p.add_argument("--quick", action="store_true", help="tiny model and batches: a smoke test")
    args = p.parse_args(argv)
    try:
        memory_table.run(args)
    except BadArgs as err:
        p.error(str(err))


if __name__ == "__main__":
    main()
