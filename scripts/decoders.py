"""Compact activations on decoder LMs: what one training step saves for backward, by op, and its
time (the measurement: ``sketchprop.bench.decoders``, whose docstring lists the methods).

    python scripts/decoders.py --architectures llama --methods \
        "exact,compact,compact(mlp=input),compact(attention=recompute),ours+compact" --tag _llama
    python scripts/decoders.py --architectures llama \
        --methods "exact,lora,lora+ours+compact" --tag _llama_lora
    python scripts/decoders.py --architectures llama --batch 4 --time-steps 7 \
        --methods "exact,lora,lora+ours+compact,lora+ours+compact(mlp=recompute)" \
        --tag _llama_lora_time
    python scripts/decoders.py --architectures llama --time-steps 7 \
        --methods "exact,compact,compact(lm_loss=stored),ours+compact,lora,lora+ours+compact" \
        --tag _time
    python scripts/decoders.py --architectures gpt2 \
        --methods "exact,compact,compact(attention=stored),ours+compact" --tag _gpt2
    python scripts/decoders.py --architectures gpt2 \
        --methods "exact,lora,lora+ours+compact" --tag _gpt2_lora
    python scripts/decoders.py --architectures gpt2 --time-steps 5 \
        --methods "exact,compact,ours+compact,lora,lora+ours+compact" --tag _gpt2_time
    python scripts/decoders.py --quick --out-dir /tmp/dec
"""

import argparse

from sketchprop.bench import decoders
from sketchprop.bench.common import BadArgs, add_threads_arg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=decoders.__doc__.splitlines()[0])
    p.add_argument("--architectures", default="gpt2,llama")
    p.add_argument("--methods", default=",".join(decoders.METHODS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--sketch", default="blocksrht")
    p.add_argument("--rho", type=float, default=0.1)
    p.add_argument("--time-steps", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny shapes and batch: seconds")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    p.add_argument("--retable", default=None, metavar="JSON",
                   help="rewrite the .md tables of an earlier run from its JSON file and exit")
    add_threads_arg(p)
    args = p.parse_args(argv)
    try:
        decoders.run(args)
    except BadArgs as err:
        p.error(str(err))


if __name__ == "__main__":
    main()
