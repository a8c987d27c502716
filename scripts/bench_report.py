"""Fill the generated blocks of ``results/bench/README.md`` from the benchmark JSON files (the
blocks: ``sketchprop.bench.readme``).

    python scripts/bench_report.py            # rewrite results/bench/README.md in place
"""

import argparse
from pathlib import Path

from sketchprop.bench import readme
from sketchprop.bench.common import RESULTS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=readme.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=str(RESULTS))
    folder = Path(p.parse_args(argv).dir)
    if not (folder / "README.md").is_file():
        p.error(f"{folder}: no README.md with generated blocks to fill")
    readme.fill(folder)


if __name__ == "__main__":
    main()
