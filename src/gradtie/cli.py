"""The `gradtie` command line: one function per subcommand, each calling one package function."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _book(args: argparse.Namespace) -> int:
    from . import book
    book.execute(args.profile)
    book.render()
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradtie",
        description="Tie a hand-written backward chain to the gradient of the loss.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("book", help="execute every chapter with papermill, then render the book")
    b.add_argument("--profile", choices=("ci", "cpu", "gpu"), default="ci",
                   help="chapter sizes: ci (2-core CPU, ~1 min a chapter), cpu, gpu (ImageNet shapes)")
    b.set_defaults(func=_book)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
