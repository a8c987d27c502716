"""``python -m sketchprop.glue DIR``: write small GLUE-format files (toy CoLA and STS-B) for
smoke runs and tests."""

import argparse

from .data import write_toy_glue


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sketchprop.glue",
                                     description="Write toy CoLA and STS-B data for smoke runs.")
    parser.add_argument("root", help="folder to write CoLA/ and STS-B/ into")
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-dev", type=int, default=64)
    args = parser.parse_args(argv)
    print(write_toy_glue(args.root, args.n_train, args.n_dev))


if __name__ == "__main__":
    main()
