"""The `gradtie` command line: one function per subcommand, each calling one package function."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _check(args: argparse.Namespace) -> int:
    import json

    import jax
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    from .checks.check import run_check
    report = run_check(args.net, batch=args.batch, image_size=args.image_size, data=args.data,
                       dtype=args.dtype, bf16=args.bf16, seed=args.seed,
                       label_smoothing=args.label_smoothing)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, default=float))
    else:
        if report.smooth is not None:
            print(report.smooth.table())
            for v in report.smooth.violations:
                print("  " + v.describe())
        print(report.tie.table())
        print(report.summary())
    return report.exit_code


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
    c = sub.add_parser(
        "check", help="tie every node of a net's rendered chain to autodiff and finite differences",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes:\n  0  every node tied at a verified smooth point\n  1  a node failed\n"
               "  2  the point is not smooth (the report names layer, example, channel, window)")
    c.add_argument("--net", choices=("cifar8", "resnet34"), default="cifar8")
    c.add_argument("--batch", type=int, default=4, help="examples in the batch (default 4)")
    c.add_argument("--image-size", type=int, default=None,
                   help="image side in pixels: 32 for cifar8, a multiple of 32 for resnet34 (default 32)")
    c.add_argument("--data", choices=("randn", "photos", "flat"), default="photos",
                   help="standard normal pixels, crops of shipped photos, or flat images full of twins")
    c.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    c.add_argument("--bf16", action="store_true", help="bf16 conv sites (operands rounded, f32 accumulation)")
    c.add_argument("--label-smoothing", type=float, default=0.0, help="α of the smoothed target")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_check)

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
