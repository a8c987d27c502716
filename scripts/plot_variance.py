"""Figure 4: the variance the sketch adds against SGD's own, over training steps
(``sketchprop.report.figure4`` draws it).

Reads the ``variance`` records (``sketchprop.tracking.collect``) from one or more run JSON files
(``result.json`` or ``results/runs/...json``: a dict with key ``variance``; a bare list of records
also works).

    python scripts/plot_variance.py results/runs/figure4/cola/gaussian-rho0.5-seed1-*.json
    python scripts/plot_variance.py RUN.json --out results/figures/figure4_variance.png --window 25
"""

from __future__ import annotations

import argparse
import sys

from sketchprop.report.figure4 import DEFAULT_OUT, draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run JSON files with a 'variance' key")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output image (png, pdf, svg)")
    parser.add_argument("--window", type=int, default=25, help="moving-median window in steps")
    parser.add_argument("--title", default=None,
                        help="default: model, task, sketch, rate, batch, epochs, seed and scale "
                             "from the (first) run file")
    args = parser.parse_args(argv)
    try:
        print(draw(args.runs, args.out, args.window, args.title))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
