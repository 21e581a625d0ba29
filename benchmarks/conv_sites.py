"""Each conv site of both nets, both formulations: XLA's convolution against patches · weights.

    .venv/bin/python benchmarks/conv_sites.py [--suite cpu] [--repeats 15]

For every distinct conv site (N, C, O, H, k, stride) of the suite's configurations, times the
forward, the input backward and the weight gradient with `formulation="conv"` and
`formulation="patches"` (minimum over the repeats, one process, interleaved) and prints what
the shape rule (`gradtie.ops.conv.use_patches`) picks. Run it pinned to one core
(`taskset -c 0 ...`) for per-op times that do not depend on thread scheduling. This is where
`conv.PATCHES_RATIO` comes from.
"""

from __future__ import annotations

import argparse
import time

import jax

from gradtie import bench
from gradtie.ops import conv


def sites(config: bench.BenchConfig) -> list[tuple[int, int, int, int, int, int]]:
    """(N, C, O, H, k, stride) of every conv of one configuration's net, in forward order."""
    n, s = config.batch, config.image_size
    if config.net == "cifar8":
        out, cin, h = [], 3, 32
        for width in (16, 16, 32, 32):
            out += [(n, cin, width, h, 3, 1), (n, width, width, h, 3, 1)]
            cin, h = width, h // 2
        return out
    out, h, cin = [(n, 3, 64, s, 7, 2)], s // 4, 64
    for width, stride in zip((64, 128, 256, 512), (1, 2, 2, 2)):
        if stride == 2:
            out += [(n, cin, width, h, 3, 2), (n, cin, width, h, 1, 2)]
            h //= 2
        out.append((n, width, width, h, 3, 1))
        cin = width
    return out


def _min_ms(fns: dict, repeats: int) -> dict[str, float]:
    for f, args in fns.values():
        jax.block_until_ready(f(*args))
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, (f, args) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(bench.SUITES), default="cpu")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    seen = dict.fromkeys(site for c in bench.SUITES[args.suite] if c.replicas <= 1 for site in sites(c))
    key = jax.random.key(0)
    print(f"{'site (N C O H k s)':<26} {'forward conv/patches':>22} {'input bwd conv/patches':>24} "
          f"{'weight grad conv/patches':>26}  rule: fwd+grad / bwd")
    for n, c, o, h, k, s in seen:
        x = jax.random.normal(key, (n, c, h, h))
        w = jax.random.normal(jax.random.fold_in(key, 1), (o, c, k, k))
        ho = conv.out_size(h, k, s)
        dy = jax.random.normal(jax.random.fold_in(key, 2), (n, o, ho, ho))
        ms = {}
        for form in conv.FORMULATIONS:
            ms[form] = _min_ms({
                "fwd": (jax.jit(lambda a, b: conv.forward(a, b, stride=s, formulation=form)[0]), (x, w)),
                "bwd": (jax.jit(lambda b, d: conv.backward(b, d, input_shape=x.shape, stride=s, formulation=form)),
                        (w, dy)),
                "gw": (jax.jit(lambda a, d: conv.grad_weight(a, d, kernel_size=k, stride=s, formulation=form)),
                       (x, dy))},
                args.repeats)
        rule = ("patches" if conv.use_patches(ho * ho, c * k * k, k) else "conv",
                "patches" if conv.use_patches(h * h, o * k * k, k) else "conv")
        cells = "  ".join(f"{ms['conv'][op]:9.2f} / {ms['patches'][op]:9.2f}" for op in ("fwd", "bwd", "gw"))
        print(f"{n:4d} {c:4d} {o:4d} {h:4d} {k} {s}        {cells}   {rule[0]} / {rule[1]}", flush=True)


if __name__ == "__main__":
    main()
