"""Mutation check of the test suite: plant one small bug at a time and confirm that the tests catch
it (the mutants and the runner: ``sketchprop.bench.mutants``; ``--help`` describes it).

    python scripts/mutation_check.py                      # every mutant (about 10 minutes, 1 core)
    python scripts/mutation_check.py --only gaussian-scale f1-class-swap
    python scripts/mutation_check.py --list
"""

import argparse
import sys

from sketchprop.bench import mutants


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=mutants.__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--timeout", type=int, default=600, help="seconds per pytest run")
    return mutants.run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
