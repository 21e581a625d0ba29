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
    data = args.data or (None if args.plant_tie else "photos")   # --plant-tie: flat images
    report = run_check(args.net, batch=args.batch, image_size=args.image_size, data=data,
                       dtype=args.dtype, bf16=args.bf16, seed=args.seed,
                       label_smoothing=args.label_smoothing, plant_tie=args.plant_tie)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, default=float))
    else:
        if report.smooth is not None:
            print(report.smooth.table())
            for v in report.smooth.violations:
                print("  " + v.describe())
        if report.tie is not None:
            print(report.tie.table())
        print(report.summary())
    return report.exit_code


def _bench(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from . import bench
    sizes = args.image_size or [32]
    configs = [bench.BenchConfig(net=args.net, batch=b, image_size=s, bf16=args.bf16,
                                 replicas=args.replicas, repeats=args.repeats)
               for b in args.batch for s in sizes]
    results = bench.run(configs, progress=not args.json)
    if args.json:
        print(json.dumps([dict(asdict(r), ratio=r.ratio) for r in results], indent=1))
    else:
        print(f"backend {results[0].backend}; median of {args.repeats} steps each, "
              f"rendered and autodiff interleaved, a fresh process per configuration")
        for r in results:
            print(r.row())
    return 0


def _train(args: argparse.Namespace) -> int:
    from . import data, train
    from .checks.check import net_module
    net = net_module(args.net)
    dataset = data.load(args.data, size=args.image_size, n_train=args.n_train, n_test=args.n_test,
                        seed=args.seed)
    kwargs = {"num_classes": dataset.num_classes}
    if args.net == "cifar8":
        kwargs["head_width"] = args.head_width
    cfg = net.Config(bf16=args.bf16, **kwargs)
    result = train.fit(net, cfg, dataset, optimizer=args.optimizer, lr=args.lr, epochs=args.epochs,
                       batch=args.batch, grads=args.grads, seed=args.seed, out=args.out,
                       resume=args.resume, warmup_epochs=args.warmup_epochs,
                       label_smoothing=args.label_smoothing)
    last = result.history[-1] if result.history else {}
    print(f"trained {args.net} with {args.optimizer} ({args.grads} gradients) for {len(result.history)} "
          f"epochs: " + ", ".join(f"{k} {v:.4g}" for k, v in last.items() if isinstance(v, float)))
    return 0


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
               "  2  the point is not smooth (the report names layer, example, channel, window)\n"
               "  3  invalid input (the message says what was expected)")
    c.add_argument("--net", choices=("cifar8", "resnet34"), default="cifar8")
    c.add_argument("--batch", type=int, default=4, help="examples in the batch (default 4)")
    c.add_argument("--image-size", type=int, default=None,
                   help="image side in pixels: 32 for cifar8, a multiple of 32 for resnet34 (default 32)")
    c.add_argument("--data", choices=("randn", "photos", "flat"), default=None,
                   help="standard normal pixels, crops of shipped photos (the default), or flat images "
                        "full of twins")
    c.add_argument("--plant-tie", action="store_true",
                   help="a constructed non-twin tie: the convs before the first pool reduced to their "
                        "centre tap, on flat images (exit code 2)")
    c.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    c.add_argument("--bf16", action="store_true", help="bf16 conv sites (operands rounded, f32 accumulation)")
    c.add_argument("--label-smoothing", type=float, default=0.0, help="α of the smoothed target")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_check)

    be = sub.add_parser(
        "bench", help="rendered step vs autodiff step, side by side: median ms/step and the ratio",
        description="Times the rendered and the autodiff gradient step of a net, interleaved in one "
                    "process per configuration (a fresh process each), and reports medians, the "
                    "ratio rendered/autodiff and XLA's compiled temporary memory.")
    be.add_argument("--net", choices=("cifar8", "resnet34"), default="cifar8")
    be.add_argument("--batch", type=int, nargs="+", default=[32], help="per-replica batch size(s)")
    be.add_argument("--image-size", type=int, nargs="+", default=None, help="image side(s), default 32")
    be.add_argument("--bf16", action="store_true", help="bf16 conv sites")
    be.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (devices)")
    be.add_argument("--repeats", type=int, default=10, help="timed steps per side (median)")
    be.add_argument("--json", action="store_true")
    be.set_defaults(func=_bench)

    tr = sub.add_parser("train", help="train a net with the rendered (or autodiff) gradient step")
    tr.add_argument("--net", choices=("cifar8", "resnet34"), default="cifar8")
    tr.add_argument("--data", default="digits",
                    help="digits, photos, synthetic or cifar10:PATH (the python pickle batches)")
    tr.add_argument("--optimizer", choices=("sgd", "nesterov", "heavy-ball", "adamw"), default="nesterov")
    tr.add_argument("--epochs", type=int, default=1)
    tr.add_argument("--batch", type=int, default=128)
    tr.add_argument("--lr", type=float, default=None, help="default: the upstream recipe's rate")
    tr.add_argument("--warmup-epochs", type=int, default=0)
    tr.add_argument("--label-smoothing", type=float, default=None)
    tr.add_argument("--image-size", type=int, default=32)
    tr.add_argument("--head-width", type=int, default=512, help="cifar8 head width d")
    tr.add_argument("--n-train", type=int, default=None, help="cap the training split")
    tr.add_argument("--n-test", type=int, default=None, help="cap the test split")
    tr.add_argument("--bf16", action="store_true")
    tr.add_argument("--grads", choices=("rendered", "autodiff"), default="rendered")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", required=True, help="folder for checkpoint.npz and metrics.json")
    tr.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    tr.set_defaults(func=_train)

    b = sub.add_parser("book", help="execute every chapter with papermill, then render the book")
    b.add_argument("--profile", choices=("ci", "cpu", "gpu"), default="ci",
                   help="chapter sizes: ci (2-core CPU, ~1 min a chapter), cpu, gpu (ImageNet shapes)")
    b.set_defaults(func=_book)
    return p


EXIT_BAD_INPUT = 3


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: say what was expected, no traceback
        print(f"gradtie {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
