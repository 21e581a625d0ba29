"""The `gradtie` command line: one function per subcommand, each calling one package function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

# `gradtie.policy.NAMES`, spelled out so that `--help` does not import JAX (a test holds them equal)
POLICY_NAMES = ("tie", "tf32", "bf16")


def _check(args: argparse.Namespace) -> int:
    import json

    from .fake_devices import request_host_devices

    if args.plant_bug == "list":
        from . import nets
        from .checks import bugs
        print(bugs.listing(nets.load(args.net)))
        return 0
    if args.replica_counts is not None:   # uneven replica batches: R from the counts
        args.replica_counts = _counts(args.replica_counts)
        args.replicas = len(args.replica_counts)
    if args.replicas > 1:   # host devices for the mesh: read by XLA when JAX starts
        request_host_devices(args.replicas)
    import jax
    jax.config.update("jax_enable_x64", True)   # the reference is float64 whatever the chain's dtype
    _compilation_cache(jax)
    from .checks.check import run_check
    data = args.data or (None if args.plant_tie else "photos")   # --plant-tie: flat images
    report = run_check(args.net, batch=args.batch, image_size=args.image_size, data=data,
                       dtype=args.dtype, bf16=args.bf16, policy=args.policy, seed=args.seed, weights=args.weights,
                       label_smoothing=args.label_smoothing, plant_tie=args.plant_tie,
                       plant_bug=args.plant_bug, replicas=args.replicas, replica_counts=args.replica_counts,
                       finite_differences=not args.no_fd, progress=not args.json)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, default=float))
    else:
        if report.settings.get("beyond_literal_resolution"):
            print(report.settings["beyond_literal_resolution"])
        if report.smooth is not None:
            print(report.smooth.table())
            for v in report.smooth.violations:
                print("  " + v.describe())
        if report.tie is not None:
            print(report.tie.table())
            if args.sensitivity and hasattr(report.tie, "sensitivity_table"):
                print(report.tie.sensitivity_table())
        if args.timings:
            from .host import process_seconds
            print(report.timing_table(process_seconds()))
        print(report.summary())
    return report.exit_code


def _counts(text: str) -> tuple[int, ...]:
    """--replica-counts 3,1 -> (3, 1); a ValueError (exit 3) names what was expected."""
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) < 2 or min(counts) < 0 or sum(counts) < 1:
        raise ValueError(f"--replica-counts {text!r}: expected comma-separated example counts, one per "
                         f"replica, at least two, holding at least one example (e.g. 3,1)")
    return counts


def _compilation_cache(jax) -> None:
    """JAX's persistent compilation cache, so a second check of the same shapes skips compiling: the
    folder JAX_COMPILATION_CACHE_DIR names (the Makefile's, shared with the tests and the chapters),
    else $GRADTIE_CACHE, else ~/.cache/gradtie/jax."""
    import os
    folder = (os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.environ.get("GRADTIE_CACHE")
              or os.path.join(os.path.expanduser("~"), ".cache", "gradtie", "jax"))
    try:
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    except Exception:  # a read-only home: compile every time
        pass


def _bench(args: argparse.Namespace) -> int:
    import json

    from . import bench
    if args.abstract:
        from .book import workloads   # the chapters' computations: the book's, read by the front end
        rows = bench.abstract_in_fresh_process(workloads.profile_workloads(args.profile, args.chapters))
        if args.out:
            bench.write_abstract(args.out, rows, profile=args.profile)
        table, ok = bench.fit_table(rows)
        if args.json:
            print(json.dumps([{"owner": r.workload.owner, "label": r.workload.label, "side": r.workload.side,
                               "temp_gib": r.temp_gib, "total_gib": r.total_gib} for r in rows], indent=1))
        else:
            print(f"profile {args.profile}: every computation lowered and compiled from shapes alone "
                  f"(no data), XLA's convolutions at every conv site; memory from XLA's analysis")
            print(table)
        return 0 if ok else 1
    if args.input:
        return _bench_input(args)
    args.batch = args.batch or [32]
    if args.peers and args.conv_floor:
        raise ValueError("gradtie bench: --peers and --conv-floor are two runs; give one")
    if args.peers or args.conv_floor:
        return _bench_peers(args)
    if args.suite in peer_bench_suites():
        raise ValueError(f"gradtie bench: --suite {args.suite} is a peers suite; add --peers")
    if args.suite == "gpu":
        return _bench_gpu(args)
    if args.suite:
        configs = [c if args.repeats is None else bench.BenchConfig(**{**c.__dict__, "repeats": args.repeats})
                   for c in bench.SUITES[args.suite]]
    else:
        sizes = args.image_size or [32]
        if args.bf16 and args.policy != ["tie"]:
            raise ValueError("gradtie bench: --bf16 (the suite's conv kinds in a float32 chain) runs under "
                             "--policy tie only; --policy bf16 is the bf16 execution policy")
        configs = [bench.BenchConfig(net=args.net, batch=b, image_size=s, bf16=args.bf16,
                                     replicas=args.replicas, repeats=args.repeats or 10,
                                     num_classes=args.num_classes, policy=pol)
                   for pol in args.policy for b in args.batch for s in sizes]
    if args.warm_cache:
        seconds = bench.warm_cache(configs, progress=not args.json)
        if not args.json:
            print(f"compiled {2 * len(configs)} programs into the persistent cache in {seconds:.0f} s")
    results = bench.run(configs, progress=not args.json, fresh=not args.in_process, out=args.out,
                        suite=args.suite or "custom")
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1, default=float))
    else:
        print(f"backend {results[0].backend}; medians over the repeats, rendered and autodiff "
              f"interleaved, {'one process' if args.in_process else 'a fresh process per configuration'}")
        for r in results:
            print(r.row())
    return 0


def _bench_input(args: argparse.Namespace) -> int:
    """The input pipeline alone (`gradtie.pipeline.measure`): training batches of an image folder
    decoded, cropped, flipped and normalised by 1, 2, … worker processes, images per second."""
    import json
    import tempfile

    from . import bench, folder, pipeline
    size = (args.image_size or [224])[0]
    batch = (args.batch or [64])[0]
    with tempfile.TemporaryDirectory(prefix="gradtie-input-") as tmp:
        if args.data:
            path = folder.parse_spec(args.data)
            if path is None:
                raise ValueError(f"gradtie bench --input: --data must be folder:PATH, got {args.data!r}")
            listing = folder.read(path).train
            source = str(path)
        else:    # JPEGs of ImageNet's most common size, cut from the shipped photos
            listing = folder.write_photo_folder(Path(tmp) / "photos", per_class=INPUT_PER_CLASS, val_per_class=1,
                                                size=(500, 375)).train
            source = f"{len(listing)} JPEGs of 500×375 px cut from the shipped photos"
        rates = [pipeline.measure(listing, workers=w, size=size, batch=batch, batches=args.repeats or 16)
                 for w in args.workers]
    rows = [{**r._asdict(), "images_per_second": r.images_per_second} for r in rates]
    if args.out:
        bench.write_json(args.out, {"suite": "input", "source": source, "batch": batch, "machine": bench.machine(),
                                    "rows": rows})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"input pipeline: {source}; batches of {batch} at {size} px (decode, random resized crop, flip, "
          f"normalise), timed after the workers' start and every batch they held ready")
    for r in rates:
        print(r.row())
    return 0


INPUT_PER_CLASS = 40   # `bench --input`'s generated folder: 7 classes × 40 JPEGs


def _bench_gpu(args: argparse.Namespace) -> int:
    """The GPU run (`gradtie.gpu_peers.run_all`): compile everything at once, then each configuration
    and each peer in a fresh process; the table, the goals and what the backend keeps of a rounding."""
    import json

    from . import bench, gpu_peers
    configs = bench.GPU_SUITE if args.repeats is None else [
        bench.BenchConfig(**{**c.__dict__, "repeats": args.repeats}) for c in bench.GPU_SUITE]
    out = args.out or bench.RESULTS / "gpu.json"
    peers_out = args.peers_out or bench.RESULTS / "peers_gpu.json"
    done = gpu_peers.run_all(out, peers_out, configs=configs, progress=not args.json)
    if args.json:
        print(json.dumps({"goals": done["goals"], "table": gpu_peers.table(done["rows"])}, indent=1))
        return 0
    print(f"compiled every program in {done['compile_s']:.0f} s; wrote {out} and {peers_out}")
    for r in done["results"]:
        print(r.row())
    print(gpu_peers.table(done["rows"]))
    for r in done["peers"]["rounding"]:
        print(f"rounding with XLA_FLAGS={r['flags'] or '(default)'}: " + json.dumps(r))
    print("every goal met" if not done["goals"] else "goals not met:\n  " + "\n  ".join(done["goals"]))
    return 0


def _conv_floor(configs, args: argparse.Namespace) -> int:
    import json

    from . import conv_floor
    doc = conv_floor.run(configs, rounds=args.rounds, progress=not args.json, out=args.out)
    if args.json:
        print(json.dumps(doc, indent=1, default=float))
        return 0
    rows = [conv_floor.FloorRow.from_dict(r) for r in doc["rows"]]
    print(conv_floor.table(rows))
    bound = conv_floor.kernel_bound(rows)
    print("the conv floor is under the goal everywhere: the gap lies outside the convolutions" if not bound else
          "out of reach with this backend's convolution kernels:\n  " + "\n  ".join(bound))
    return 0


def peer_bench_suites() -> tuple[str, ...]:
    from . import peer_bench
    return tuple(peer_bench.PEER_SUITES)


def _bench_peers(args: argparse.Namespace) -> int:
    """The rendered step against autodiff, plain JAX and PyTorch eager (`gradtie.peer_bench`), or
    with --conv-floor the conv sites alone against PyTorch's (`gradtie.conv_floor`)."""
    import json

    from . import peer_bench
    flag = "--conv-floor" if args.conv_floor else "--peers"
    if args.suite and args.suite not in peer_bench.PEER_SUITES:
        raise ValueError(f"gradtie bench {flag}: --suite must be one of {', '.join(peer_bench.PEER_SUITES)}, "
                         f"got {args.suite!r}")
    if args.suite:
        configs = peer_bench.PEER_SUITES[args.suite]
        if args.repeats is not None:
            configs = [peer_bench.PeerConfig(**{**c.__dict__, "repeats": args.repeats}) for c in configs]
    else:
        configs = [peer_bench.PeerConfig(args.net, b, s, args.num_classes, args.repeats or 5)
                   for b in args.batch for s in (args.image_size or [32])]
    if args.conv_floor:
        return _conv_floor(configs, args)
    doc = peer_bench.run(configs, rounds=args.rounds, progress=not args.json, out=args.out)
    rows = [peer_bench.PeerRow.from_dict(r) for r in doc["rows"]]
    if args.json:
        print(json.dumps(doc, indent=1, default=float))
        return 0
    for c in doc["checks"]:
        print(f"{c['peer']} on {c['net']}: " + (f"not run ({c['skipped']})" if c.get("skipped") else c["describe"]))
    print(f"matrix product {peer_bench.MATMUL_N}³ float32: {doc['matmul_gflops']:.0f} GFLOP/s "
          f"(median over {len(configs) * args.rounds} rounds)")
    print(peer_bench.table(rows))
    behind = peer_bench.verdict(rows)
    print("rendered ahead of every peer by the goal" if not behind else "behind the goal:\n  " + "\n  ".join(behind))
    return 0


# `gradtie train` options and their defaults; an option left out takes the run's recorded value
# with --resume, else the recipe's (--recipe), else this default
TRAIN_DEFAULTS = {"net": "cifar8", "data": "digits", "optimizer": "nesterov", "epochs": None, "batch": 128,
                  "lr": None, "warmup_epochs": 0, "label_smoothing": None, "image_size": 32,
                  "head_width": 512, "n_train": None, "n_test": None, "bf16": False, "grads": "rendered",
                  "seed": 0, "flip": None, "precise_batches": 16, "replicas": None, "sync_bn": True,
                  "dtype": "float32", "checkpoints": None, "policy": "tie"}
# upstream's runs, as option values (what a recipe leaves out keeps its default)
RECIPES = {
    # ResNet-34 on ImageNet: 4 replicas × 64, heavy ball (momentum 0.9, coupled weight decay 1e-4),
    # peak lr 0.1 on a cosine with 5 warmup epochs, 90 epochs, label smoothing 0.1, random resized
    # crops and flips at 224 px (upstream: 74.17 % top-1 / 91.89 % top-5, synchronised BN)
    "resnet34-imagenet": {"net": "resnet34", "optimizer": "heavy-ball", "lr": 0.1, "epochs": 90,
                          "warmup_epochs": 5, "batch": 64, "replicas": 4, "label_smoothing": 0.1,
                          "image_size": 224, "flip": True},
}
EXIT_NOT_FINITE = 4
EXIT_INTERRUPTED = 130


def _train_options(args: argparse.Namespace) -> argparse.Namespace:
    """Every `gradtie train` option resolved: given, else recorded (--resume), else the recipe's,
    else the default. Reads run.json without starting JAX."""
    from . import train
    recorded = train.resume_arguments(args.out) if args.resume else {}
    recipe = RECIPES[args.recipe] if args.recipe else {}
    if args.recipe and args.data is None and not recorded:
        raise ValueError(f"--recipe {args.recipe} trains on an ImageNet folder: give --data folder:PATH "
                         f"(PATH/train/<class>/*.JPEG and PATH/val/<class>/*.JPEG)")
    def pick(k, default):
        return next((v for v in (getattr(args, k), recorded.get(k), recipe.get(k)) if v is not None), default)
    return argparse.Namespace(**{k: pick(k, default) for k, default in TRAIN_DEFAULTS.items()})


def _default_workers() -> int:
    """Decoding processes for an image folder: the cores but one, at most 8."""
    import os
    return min(8, max(1, (os.cpu_count() or 2) - 1))


def _train(args: argparse.Namespace) -> int:
    from . import cluster, fake_devices
    o = _train_options(args)
    # before JAX starts: host devices for --replicas on a CPU (read by XLA when JAX starts) and
    # the cluster from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)
    if o.replicas is not None and o.replicas > 1:
        fake_devices.request_host_devices(o.replicas)
    cluster.initialize(cluster.from_environment())
    import jax
    if o.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import dataclasses

    from . import data, folder, nets, train
    net = nets.load(o.net)
    path = folder.parse_spec(o.data)
    if path is not None:
        dataset = folder.read(path)
        num_classes = len(dataset.classes)
    else:
        dataset = data.load(o.data, size=o.image_size, n_train=o.n_train, n_test=o.n_test, seed=o.seed)
        num_classes = dataset.num_classes
    kwargs = {"num_classes": num_classes}
    if "head_width" in {f.name for f in dataclasses.fields(net.config)}:
        kwargs["head_width"] = o.head_width
    if o.policy != "tie" and o.dtype != "float32":
        raise ValueError(f"--policy {o.policy} trains float32 parameters (its activations are the policy's); "
                         f"--dtype {o.dtype} goes with --policy tie")
    cfg = net.config(bf16=o.bf16, policy=o.policy, **kwargs)
    replicas = cluster.local_replicas(o.replicas)
    workers = args.workers if args.workers is not None else (_default_workers() if path is not None else 0)
    try:
        config = train.FitConfig(optimizer=o.optimizer, lr=o.lr, epochs=o.epochs, batch=o.batch, grads=o.grads,
                                 seed=o.seed, flip=o.flip, warmup_epochs=o.warmup_epochs,
                                 label_smoothing=o.label_smoothing, precise_batches=o.precise_batches,
                                 dtype=o.dtype, replicas=replicas, sync_bn=o.sync_bn, checkpoints=o.checkpoints,
                                 keep=args.keep, workers=workers)
        result = train.fit(net, cfg, dataset, config, out=args.out, resume=args.resume,
                           extend_epochs=args.extend_epochs or 0, stop_after=args.stop_after,
                           log=lambda line: print(line, flush=True), force=args.force,
                           image_size=o.image_size if path is not None else None)
    except train.NonFiniteLoss as e:
        print(f"gradtie train: error: {e}", file=sys.stderr)
        return EXIT_NOT_FINITE
    except KeyboardInterrupt:
        print(f"gradtie train: interrupted; the checkpoint in {args.out} holds the last step taken; "
              f"continue with: gradtie train --out {args.out} --resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if jax.process_index() == 0:
        print(f"test accuracy: {result.history[-1]['test_accuracy']:.4f}")
    return 0


def _book(args: argparse.Namespace) -> int:
    from . import book
    book.execute(args.profile, force=args.force)
    book.render()
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is invalid input: one line naming the option, exit 3 (exit 2 is
    `check`'s "the point cannot be judged")."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    from . import __version__
    p = _Parser(
        prog="gradtie",
        description="Tie a hand-written backward chain to the gradient of the loss.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"gradtie {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser(
        "check", help="tie every node of a net's rendered chain to autodiff and finite differences",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Ties every parameter node, the input gradient and the loss of a net's rendered "
                    "backward to autodiff (float64) and to finite differences, at a verified smooth "
                    "point. Each node's limit is a multiple of the round-off envelope measured at "
                    "the point itself (the oracle under a second evaluation order and ulp nudges), "
                    "floored at 1e-10 (float64) or 1e-5 (float32).",
        epilog="exit codes:\n  0  every node tied at a verified smooth point\n"
               "  1  a node failed (the first in backward order is named)\n"
               "  2  the point is not smooth (the report names layer, example, channel, window), degenerate\n"
               "     (a BatchNorm layer averages M = 1 value per channel: the layer is named), or so\n"
               "     ill-conditioned that round-off hides a 1% bug (the report names the layer)\n"
               "  3  invalid input (the message says what was expected)\n\n"
               "examples:\n  gradtie check --net cifar8\n"
               "  gradtie check --net resnet34 --batch 2 --image-size 64 --timings\n"
               "  gradtie check --net cifar8 --plant-bug bn_forget_gamma     # exit 1\n"
               "  gradtie check --net examples/bottleneck.py:NET              # a net of your own\n"
               "  gradtie check --net resnet34 --batch 4 --replicas 2 --plant-bug sync_local_means_backward\n"
               "  gradtie check --net resnet34 --batch 4 --replica-counts 3,1 --plant-bug sync_plain_mean_of_means")
    c.add_argument("--net", default="cifar8", metavar="{cifar8,resnet34,FILE.py:NAME,MODULE:NAME}",
                   help="the book's nets, or a net of your own: a gradtie.nets.protocol.Net value named "
                        "NAME in a Python file or an importable module (default cifar8)")
    c.add_argument("--batch", type=_positive, default=4, help="examples in the batch, R·N with --replicas (default 4)")
    c.add_argument("--image-size", type=_positive, default=None,
                   help="image side in pixels: 32 for cifar8, a multiple of 32 for resnet34 (default 32; "
                        "its statements fix 224, other sizes are labelled beyond that literal resolution)")
    c.add_argument("--data", choices=("randn", "photos", "flat"), default=None,
                   help="standard normal pixels, crops of shipped photos (the default), or flat images "
                        "full of twins")
    c.add_argument("--weights", default="drawn", metavar="{drawn,init,PATH}",
                   help="drawn (default: γ ~ U(0.5,1.5), β and biases nonzero, where a backward that "
                        "confuses γ, β or a bias shows), init (γ = 1, β = 0: such bugs hide), or a "
                        "training checkpoint (checkpoint.npz, or a run folder: its checkpoint.npz or its latest orbax "
                        "checkpoint)")
    c.add_argument("--plant-bug", default=None, metavar="NAME",
                   help="plant one bug of the catalogue in the rendered backward (exit 1 expected); "
                        "'list' prints the entries that apply to --net")
    c.add_argument("--replicas", type=int, default=1,
                   help="tie the data-parallel step (R replicas, synchronised BN) at R·N = --batch to "
                        "one device (host devices on a CPU)")
    c.add_argument("--replica-counts", default=None, metavar="N1,N2,…",
                   help="uneven replica batches, as the last batch of an epoch: replica r holds N_r of "
                        "the --batch examples (they must sum to it; sets --replicas), e.g. 3,1")
    c.add_argument("--plant-tie", action="store_true",
                   help="a constructed non-twin tie: the convs before the first pool reduced to their "
                        "centre tap, on flat images (exit code 2)")
    c.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="the rendered chain's dtype; either way it is tied to the float64 oracle, "
                        "within that dtype's envelope at the point")
    c.add_argument("--bf16", action="store_true", help="bf16 conv sites (operands rounded, f32 accumulation)")
    c.add_argument("--policy", choices=POLICY_NAMES, default="tie",
                   help="execution policy: tie (the default; float64/float32 at HIGHEST), tf32 or bf16 "
                        "(the fast chains people train with, run from float32 and tied stage by stage "
                        "within their own envelope)")
    c.add_argument("--label-smoothing", type=float, default=None, help="α of the smoothed target (default 0)")
    c.add_argument("--seed", type=_nonnegative, default=0)
    c.add_argument("--no-fd", action="store_true", help="skip the finite differences (autodiff tie only)")
    c.add_argument("--timings", action="store_true", help="print where the time goes")
    c.add_argument("--sensitivity", action="store_true",
                   help="per node, the smallest relative error δ the verdict catches at this point (a node "
                        "returned as node·(1 + δ) fails from there on), and the summary over the net")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_check)

    be = sub.add_parser(
        "bench", help="rendered step vs autodiff step, side by side: median ms/step and the ratio",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Times the rendered and the autodiff gradient step of a net, interleaved in one "
                    "process per configuration (a fresh process each), and reports medians, the "
                    "ratio rendered/autodiff, images/s, XLA's compiled memory and, on a GPU of known "
                    "peak, the model FLOP utilisation. --abstract instead compiles every computation "
                    "of a profile from shapes alone and reports the device memory each needs.",
        epilog="examples:\n  gradtie bench --net cifar8 --batch 32 128\n"
               "  gradtie bench --suite cpu --out benchmarks/results/cpu.json\n"
               "  JAX_COMPILATION_CACHE_DIR=~/.cache/jax gradtie bench --suite gpu --warm-cache --out gpu.json\n"
               "  gradtie bench --abstract --profile gpu     # exit 1 if a chapter needs over 120 GiB\n"
               "  gradtie bench --peers --suite peers --out benchmarks/results/peers_cpu.json\n"
               "  gradtie bench --conv-floor --suite peers --rounds 2 --out benchmarks/results/conv_floor_cpu.json\n"
               "  gradtie bench --input --workers 1 2 --out benchmarks/results/input_cpu.json\n\n"
               "exit codes:\n  0  measured (with --abstract: every computation fits the profile's memory)\n"
               "  1  with --abstract: some computation needs more memory than the profile's device has\n"
               "  3  invalid input (one line on stderr)")
    be.add_argument("--net", choices=("cifar8", "resnet34"), default="cifar8")
    be.add_argument("--batch", type=_positive, nargs="+", default=None,
                    help="per-replica batch size(s) (default 32; with --input 64)")
    be.add_argument("--image-size", type=int, nargs="+", default=None, help="image side(s), default 32 (--input: 224)")
    be.add_argument("--num-classes", type=int, default=10, help="classes K (1000 for ImageNet)")
    be.add_argument("--bf16", action="store_true",
                    help="bf16 conv sites inside the float32 chain (the suite's kinds; policy tie only)")
    be.add_argument("--policy", choices=POLICY_NAMES, nargs="+", default=["tie"],
                    help="execution policy(ies): tie (float32 at HIGHEST, what the checks tie), tf32 (float32 "
                         "at default precision), bf16 (bf16 activations and convolutions, float32 "
                         "parameters, statistics, head and loss)")
    be.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (devices)")
    be.add_argument("--repeats", type=_positive, default=None, help="timed steps per side (median; default 10)")
    be.add_argument("--suite", choices=sorted(("cpu", "quick", "gpu", "peers", "peers-quick", "peers-gpu")), default=None,
                    help="a fixed set of configurations instead of --net/--batch: cpu (the committed CPU "
                         "results), quick, gpu (the GPU run: ResNet-34 at 224 px, batch 64/256, policies "
                         "bf16/tf32/tie, with plain JAX and PyTorch at each policy's precision, each in a "
                         "fresh process; --out and --peers-out); with --peers: peers (the committed CPU "
                         "peer results), peers-quick, peers-gpu")
    be.add_argument("--peers", action="store_true",
                    help="time the rendered step against autodiff through gradtie's forward, plain JAX "
                         "(NCHW and NHWC) and PyTorch eager (where installed: requirements-peers.txt), each "
                         "in its own process, in alternating rounds, after checking every peer computes "
                         "the same loss and gradients; reports GFLOP/s against one large float32 matmul")
    be.add_argument("--conv-floor", action="store_true",
                    help="time every conv site of the configurations alone, gradtie's conv nodes against "
                         "PyTorch's conv forward and backward, and PyTorch's whole step: where gradtie's "
                         "convolutions alone take longer than the goal allows, the kernels are the limit")
    be.add_argument("--input", action="store_true",
                    help="time the input pipeline alone: training batches of an image folder (--data folder:PATH, "
                         "default a generated folder of 500×375 JPEGs) decoded, cropped, flipped and normalised "
                         "at --image-size by each --workers count; --repeats batches timed (default 16)")
    be.add_argument("--data", default=None, help="with --input: folder:PATH")
    be.add_argument("--workers", type=_nonnegative, nargs="+", default=[1, 2],
                    help="with --input: worker process counts to time (default 1 2)")
    be.add_argument("--rounds", type=_positive, default=3,
                    help="with --peers or --conv-floor: alternating rounds (median)")
    be.add_argument("--out", type=Path, default=None, help="write the results as JSON here, with the machine")
    be.add_argument("--peers-out", type=Path, default=None,
                    help="with --suite gpu: the peers' results (default benchmarks/results/peers_gpu.json)")
    be.add_argument("--in-process", action="store_true",
                    help="measure every configuration in this process (no fresh process each)")
    be.add_argument("--warm-cache", action="store_true",
                    help="first compile every configuration's steps at once into JAX's persistent "
                         "compilation cache (JAX_COMPILATION_CACHE_DIR must be set; the GPU run)")
    be.add_argument("--abstract", action="store_true",
                    help="compile the profile's computations from shapes alone and report their memory")
    be.add_argument("--profile", choices=("ci", "cpu", "gpu"), default="gpu", help="with --abstract")
    be.add_argument("--chapters", nargs="+", default=None,
                    help="with --abstract: only these chapters ('benchmark' for the benchmark)")
    be.add_argument("--json", action="store_true")
    be.set_defaults(func=_bench)

    tr = sub.add_parser(
        "train", help="train a net with the rendered (or autodiff) gradient step",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Trains a net with the rendered train step and evaluates it after every epoch on the "
                    "test split twice: with BatchNorm statistics recomputed over fixed training batches "
                    "(precise BN: the reported test accuracy) and with the running statistics the step "
                    "keeps (momentum 0.01; they lag the weights). The run folder --out receives run.json "
                    "(the full configuration), metrics.jsonl (one JSON object per epoch, appended) and "
                    "checkpoints (checkpoint.npz written atomically, or orbax's checkpoints/ written "
                    "asynchronously; every epoch and on Ctrl-C). Each epoch's line gives top-1 and top-5; the "
                    "last line printed is 'test accuracy: X' (top-1).",
        epilog="resume: 'gradtie train --out DIR --resume' continues the run in DIR exactly (same schedule, "
               "data order, optimizer state and input position, mid-epoch too); options left out are read "
               "from DIR/run.json, options given must match it; another device or process count is refused "
               "naming both. --extend-epochs N adds N epochs as a new cosine cycle.\n\n"
               "data: digits (sklearn's 8x8 digits, upsampled), photos (crops of the shipped photos, a "
               "class per photo), synthetic, cifar10:PATH (PATH is cifar-10-batches-py or "
               "cifar-10-batches-bin from https://www.cs.toronto.edu/~kriz/cifar.html, or the folder "
               "holding it), or folder:PATH, an image folder as torchvision's ImageFolder reads it "
               "(PATH/train/<class>/ and PATH/val/<class>/, or PATH/<class>/ split 9:1; JPEG or PNG; "
               "classes in sorted order, recorded in run.json; decoded, randomly cropped and flipped in "
               "--workers processes at --image-size px; a file that does not decode is skipped and named).\n\n"
               "several hosts: run the same command on every host with JAX_COORDINATOR_ADDRESS=host0:port, "
               "JAX_NUM_PROCESSES=P and JAX_PROCESS_ID=p (0 … P−1) in its environment, --out on a shared "
               "file system; each host reads its own rows of every global batch.\n\n"
               "exit codes:\n  0  trained; the last line is 'test accuracy: X'\n"
               "  3  invalid input, a mismatched resume or an unreadable checkpoint (one line says which)\n"
               "  4  the loss or the gradient became NaN or Inf (the step is named; the last good "
               "checkpoint is kept)\n  130  interrupted (Ctrl-C): a checkpoint of the last step was saved")
    tr.add_argument("--net", choices=("cifar8", "resnet34"), default=None, help="default cifar8")
    tr.add_argument("--data", default=None,
                    help="digits (default), photos, synthetic, cifar10:PATH (python or binary version) or "
                         "folder:PATH (an ImageFolder of JPEG/PNG files)")
    tr.add_argument("--optimizer", choices=("sgd", "nesterov", "heavy-ball", "adamw"), default=None,
                    help="default nesterov")
    tr.add_argument("--epochs", type=int, default=None,
                    help="the run's total epochs; it fixes the cosine schedule (default 1; on --resume, the "
                         "recorded total)")
    tr.add_argument("--batch", type=int, default=None,
                    help="examples per replica, N (default 128); the global batch is N·R·P")
    tr.add_argument("--lr", type=float, default=None,
                    help="base learning rate (default: the upstream recipe's, SGD 0.1, Nesterov 0.02, "
                         "heavy ball 0.1, AdamW 1e-3)")
    tr.add_argument("--warmup-epochs", type=int, default=None, help="linear warmup epochs (default 0)")
    tr.add_argument("--label-smoothing", type=float, default=None,
                    help="α (default 0 for cifar8, 0.1 for resnet34)")
    tr.add_argument("--image-size", type=int, default=None, help="image side (default 32)")
    tr.add_argument("--head-width", type=int, default=None, help="cifar8 head width d (default 512)")
    tr.add_argument("--n-train", type=int, default=None, help="cap the training split")
    tr.add_argument("--n-test", type=int, default=None, help="cap the test split")
    tr.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 conv sites (default off)")
    tr.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                    help="random left-right flips, the cifar8 recipe's augmentation (default: on, "
                         "except for digits, where a mirrored digit is no digit)")
    tr.add_argument("--precise-batches", type=int, default=None,
                    help="training batches the BN statistics are recomputed over before each evaluation "
                         "(default 16)")
    tr.add_argument("--grads", choices=("rendered", "autodiff"), default=None,
                    help="default rendered (autodiff runs on one device only)")
    tr.add_argument("--seed", type=_nonnegative, default=None, help="default 0")
    tr.add_argument("--replicas", type=_positive, default=None,
                    help="devices of this process to train on, R (default: every local device; on a CPU, R host "
                         "devices). R·P > 1 (P processes) runs the synchronised-BN data-parallel step on a data "
                         "mesh; --batch is then each replica's N and the global batch is N·R·P")
    tr.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=None,
                    help="BatchNorm statistics over the global batch (default); --no-sync-bn: each replica over "
                         "its own N (per-replica BatchNorm, another function of the weights)")
    tr.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                    help="resnet34-imagenet: upstream's ResNet-34 ImageNet run (4 replicas × 64, heavy ball, lr 0.1 "
                         "cosine, 5 warmup epochs, 90 epochs, wd 1e-4, label smoothing 0.1, crops and flips at "
                         "224 px); options given override it; needs --data folder:PATH")
    tr.add_argument("--dtype", choices=("float32", "float64"), default=None, help="parameters and activations "
                    "(default float32)")
    tr.add_argument("--policy", choices=POLICY_NAMES, default=None,
                    help="execution policy of the rendered step: tie (default; every contraction at HIGHEST), "
                         "tf32 (default precision: TF32 tensor cores on a GPU) or bf16 (bf16 activations and "
                         "convolutions, float32 parameters, BatchNorm statistics, head and loss); the same chain "
                         "`gradtie check --policy` ties")
    tr.add_argument("--workers", type=_nonnegative, default=None,
                    help="decoding processes for --data folder:PATH (default: the cores but one, at most 8; "
                         "0 decodes in a thread of this process)")
    tr.add_argument("--checkpoints", choices=("npz", "orbax"), default=None,
                    help="npz: one checkpoint.npz, rewritten atomically; orbax: checkpoints/<step>/, written "
                         "asynchronously by every process, the last --keep and the best kept (default: npz on "
                         "one device with in-memory data, orbax otherwise)")
    tr.add_argument("--keep", type=_positive, default=3, help="orbax checkpoints kept besides the best (default 3)")
    tr.add_argument("--out", required=True,
                    help="the run folder (on a shared file system for several hosts): run.json, metrics.jsonl, "
                         "checkpoints")
    tr.add_argument("--resume", action="store_true", help="continue the run in --out")
    tr.add_argument("--force", action="store_true",
                    help="train in a non-empty --out that holds no run (refused otherwise: nothing of it is lost)")
    tr.add_argument("--extend-epochs", type=int, default=None,
                    help="with --resume: add this many epochs as a new cosine cycle")
    tr.add_argument("--stop-after", type=int, default=None,
                    help="stop once this many epochs of the run are done (continue with --resume)")
    tr.set_defaults(func=_train)

    b = sub.add_parser("book", help="execute every chapter with papermill, then render the book")
    b.add_argument("--profile", choices=("ci", "cpu", "gpu"), default="ci",
                   help="chapter sizes: ci (2-core CPU, ~1 min a chapter), cpu, gpu (ImageNet shapes)")
    b.add_argument("--force", action="store_true",
                   help="re-execute every chapter, even one already executed from its present sources "
                        "at these parameters")
    b.set_defaults(func=_book)
    return p


EXIT_BAD_INPUT = 3


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input (a value, a missing or unwritable path): one line, no traceback
        print(f"gradtie {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
