"""Rebuild the paper's tables and figures from the run files alone (``make tables``).

    python scripts/make_tables.py                   # make tables
    python scripts/make_tables.py --family llama    # one family's frontier (make tables FAMILY=llama)

Reads every ``results/runs/<experiment>/<task>/<sketch>-rho<rho>-seed<seed>.json``, the memory
points of ``scripts/memory_table.py`` (``results/memory``) and the controlled benchmark
(``results/bench``), and writes ``results/tables/*.md|csv`` and ``results/figures/*.png``; the
tables the docs show are copied into their ``<!-- BEGIN name -->`` blocks. One module per table or
figure: ``sketchprop.report``. With ``--family``, only that family's frontier, from the
architecture matrix's files (``sketchprop.report.family``): ``results/tables/frontier_<family>.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sketchprop.report.build import RESULTS, build
from sketchprop.report.family import build_family


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--cpu-experiment", default="minilm_cpu")
    parser.add_argument("--family", default=None,
                        help="only this family's frontier (bert, llama, gemma2, ...: the families "
                             "of results/bench/architectures*.json)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if args.family is not None:
        try:
            path = build_family(results, args.family)
        except ValueError as err:
            parser.error(str(err))
        print(path.read_text())
        print(path)
        return
    if not (results / "runs").is_dir():
        parser.error(f"{results}: no runs/ folder of run files to build the tables from")
    for path in build(results, args.cpu_experiment):
        print(path.relative_to(results.parent) if path.is_relative_to(results.parent) else path)


if __name__ == "__main__":
    main()
