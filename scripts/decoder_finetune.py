"""Fine-tune a small pretrained causal LM with and without compact activations, same weights, seed
and data order (the run: ``sketchprop.bench.decoder_finetune``, whose docstring describes it).

    python scripts/decoder_finetune.py                # ~1 hour on two CPU cores
    python scripts/decoder_finetune.py --quick --out-dir /tmp/ft   # tiny random Llama
    python scripts/decoder_finetune.py --replot results/bench/decoder_finetune.json
"""

import argparse

from sketchprop.bench import decoder_finetune as ft
from sketchprop.bench.common import BadArgs, add_threads_arg, default_glue_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=ft.__doc__.splitlines()[0])
    p.add_argument("--methods", default="exact,compact,int4+lean")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sketch", default="blocksrht")
    p.add_argument("--rho", type=float, default=0.1)
    p.add_argument("--gguf", default=None, help=f"a local {ft.GGUF_NAME} (default: fetched)")
    p.add_argument("--glue-dir", default=default_glue_dir())
    p.add_argument("--figure", default=None, help=f"the figure's path (default {ft.FIGURE}; "
                   "--quick: none unless given)")
    p.add_argument("--quick", action="store_true", help="a tiny random Llama and 3 steps: seconds")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only draw the figure and rewrite the table from a JSON file this "
                        "script wrote")
    add_threads_arg(p)
    args = p.parse_args(argv)
    try:
        ft.run(args)
    except BadArgs as err:
        p.error(str(err))


if __name__ == "__main__":
    main()
