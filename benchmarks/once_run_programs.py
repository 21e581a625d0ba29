"""What the checks' run-once programs cost cold: the catalogue compiled or op by op, and the mesh tie.

    .venv/bin/python benchmarks/once_run_programs.py catalogue --net resnet34 --mode op-by-op
    .venv/bin/python benchmarks/once_run_programs.py catalogue --net resnet34 --mode compiled
    .venv/bin/python benchmarks/once_run_programs.py mesh

Each invocation is one configuration in a fresh process with an empty compilation cache of its own
(set before jax starts), so run the modes one after the other and compare. `catalogue` times
`bugs.run` at Would the check catch it?'s point for the net (the shared reference apart);
"compiled" runs each planted chain as one program instead of op by op (`bugs.run(how="quick")`).
`mesh` times the Data-parallel chapter's ci R·N sweep (`data_parallel.sweep`) and lists the seconds
XLA spent compiling each program (`jit(even)`: the mesh tie of one R, N).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gradtie-bench-cache-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from gradtie import data  # noqa: E402
from gradtie.checks import bugs  # noqa: E402
from gradtie import sync_sweep as dp  # noqa: E402
from gradtie.checks.tie import reference_at, targets_matrix  # noqa: E402
from gradtie.nets import cifar8, resnet34  # noqa: E402

COMPILES: list[tuple[str, float]] = []


def _listen(event: str, duration: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append((kw.get("fun_name", "?"), duration))


def timed(label: str, f):
    start, first = time.perf_counter(), len(COMPILES)
    out = f()
    print(f"{label:<30} {time.perf_counter() - start:7.1f} s, compiling {sum(d for _, d in COMPILES[first:]):7.1f} s",
          flush=True)
    return out


def catalogue(net_name: str, mode: str) -> None:
    net, cfg, images, n = {"cifar8": (cifar8.NET, cifar8.Config(), data.photos, 4),
                           "resnet34": (resnet34.NET, resnet34.Config(num_classes=10), data.flat_images, 2)}[net_name]
    params = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in net.init(jax.random.key(0), cfg, weights="drawn").items()}
    x = jnp.asarray(images(n, 32, seed=0), jnp.float64)
    t = targets_matrix(jnp.arange(n) * 3 % 10, 10, jnp.float64)
    point = timed("reference and envelope", lambda: reference_at(net, params, x, t, cfg, label_smoothing=0.1))
    rep = timed(f"catalogue ({mode})", lambda: bugs.run(point,
                                                        how="quick" if mode == "compiled" else "eager"))
    print(rep.summary())


def mesh() -> None:
    cfg = resnet34.Config(num_classes=10)
    params = {k: v.astype(jnp.float64)
              for k, v in resnet34.NET.init(jax.random.key(0), cfg, weights="drawn").items()}
    first = len(COMPILES)
    sweep = timed("R·N sweep", lambda: dp.sweep(resnet34.NET, params, cfg, dp.splits(4, 2), label_smoothing=0.1,
                                                devices=jax.devices("cpu"), progress=False))
    print(sweep.summary())
    by_program: dict[str, list] = {}
    for name, seconds in COMPILES[first:]:
        by_program.setdefault(name, []).append(seconds)
    for name, seconds in sorted(by_program.items(), key=lambda kv: -sum(kv[1]))[:6]:
        print(f"  {name:<28} compiled {len(seconds)}×: " + ", ".join(f"{t:.1f}" for t in seconds) + " s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("catalogue", help="bugs.run at Would the check catch it?'s point")
    c.add_argument("--net", choices=("cifar8", "resnet34"), default="resnet34")
    c.add_argument("--mode", choices=("op-by-op", "compiled"), default="op-by-op")
    sub.add_parser("mesh", help="the Data-parallel chapter's ci R·N sweep, compile seconds by program")
    args = parser.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_listen)
    if args.what == "catalogue":
        catalogue(args.net, args.mode)
    else:
        mesh()


if __name__ == "__main__":
    main()
