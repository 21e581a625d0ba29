"""How `check_vjp` fares near kinks: correct VJPs of piecewise-smooth functions at points placed near
their kinks, and the same VJPs planted wrong, counted by verdict.

    .venv/bin/python benchmarks/check_vjp_kinks.py single --dtype float64 --entries 5 --trials 600
    .venv/bin/python benchmarks/check_vjp_kinks.py single --dtype float64 --entries 200 --trials 600 --place grid
    .venv/bin/python benchmarks/check_vjp_kinks.py kinds --dtype float32 --trials 400
    .venv/bin/python benchmarks/check_vjp_kinks.py matmul --dtype float64 --trials 40

`single`: y = J·relu(x − c) + sin(κx + 1) + x/2 over `entries` entries, one of them crossing its kink
at t_k along the direction check_vjp draws (log-uniform in 1e-9…1e-1, or `--place grid`: at τ·h₀/2ᵏ,
τ uniform, every place a step could meet it), the jump J log-uniform in 1e-10…1, κ ∈ {0, 1, 10}.
`kinds`: ReLU, leaky ReLU, abs and clip with one entry's kink log-uniform in 1e-11…1e-1 of it.
`matmul`: relu(x @ W), x [32, 64], W [64, 64]/8, its ReLU input nearest 0 moved log-uniformly to
1e-9…1e-3 of it, with the VJP right and planted off by 1e-7 (float64), 1e-3 and −1.
A correct VJP must never read VJPMismatch; a row's "no evidence" is counted, never a failure.
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import NotSmooth, VJPMismatch, check_vjp, prng  # noqa: E402
from gradtie import tolerances as tol  # noqa: E402


def direction(key, out_shape, x) -> np.ndarray:
    """The direction check_vjp draws for one argument x (after the cotangent), as long as max|x|."""
    rng = prng.host_rng(key)
    rng.standard_normal(out_shape)
    v = rng.standard_normal(x.shape)
    return v * max(1.0, float(np.max(np.abs(x)))) / np.linalg.norm(v)


def verdict(f, args, vjp, key=None) -> str:
    try:
        rep = check_vjp(f, *args, vjp=vjp, key=key)
    except VJPMismatch:
        return "VJPMismatch"
    except NotSmooth:
        return "NotSmooth"
    return rep.fd.verdict + (f" ({rep.fd.no_evidence})" if rep.fd.no_evidence else "")


def single(dtype: str, entries: int, trials: int, place: str) -> collections.Counter:
    out, rng = collections.Counter(), np.random.default_rng(7)
    for trial in range(trials):
        x, key = rng.standard_normal(entries), jax.random.key(trial)
        v = direction(key, (entries,), x)
        if place == "grid":
            tk = rng.uniform(0, 1) * tol.VJP_FD_STEP[dtype] * 2.0 ** -rng.integers(0, 12) * rng.choice([-1, 1])
        else:
            tk = 10 ** rng.uniform(-9, -1) * rng.choice([-1, 1])
        jump, kappa, j = float(10 ** rng.uniform(-10, 0)), float(rng.choice([0.0, 1.0, 10.0])), rng.integers(entries)
        far = x - 0.7 * np.sign(rng.standard_normal(entries)) - 0.3
        shift = jnp.asarray(np.where(np.arange(entries) == j, x + tk * v, far), dtype)

        def f(a, shift=shift, jump=jump, kappa=kappa):
            return jump * jnp.maximum(a - shift, 0.0) + jnp.sin(kappa * a + 1.0) + 0.5 * a

        def vjp(a, ct, shift=shift, jump=jump, kappa=kappa):
            return (ct * (jump * (a - shift > 0) + kappa * jnp.cos(kappa * a + 1.0) + 0.5),)

        out[verdict(f, (jnp.asarray(x, dtype),), vjp, key)] += 1
    return out


KINDS = {"relu": (lambda z: jnp.maximum(z, 0.0), lambda z: 1.0 * (z > 0)),
         "leaky relu": (lambda z: jnp.where(z > 0, z, 0.1 * z), lambda z: jnp.where(z > 0, 1.0, 0.1)),
         "abs": (jnp.abs, jnp.sign),
         "clip": (lambda z: jnp.clip(z, 0.0, 0.5), lambda z: 1.0 * ((z > 0) & (z < 0.5)))}


def kinds(dtype: str, trials: int) -> collections.Counter:
    out, rng = collections.Counter(), np.random.default_rng(123)
    for trial in range(trials):
        kind = list(KINDS)[trial % len(KINDS)]
        act, dact = KINDS[kind]
        x, key = rng.standard_normal(40), jax.random.key(trial)
        v = direction(key, (40,), x)
        tk = 10 ** rng.uniform(-11, -1) * rng.choice([-1, 1])
        j = rng.integers(40)
        shift = jnp.asarray(np.where(np.arange(40) == j, x + tk * v, x - 0.7 * np.sign(rng.standard_normal(40)) - 0.3),
                            dtype)
        out[(kind, verdict(lambda a, s=shift: act(a - s), (jnp.asarray(x, dtype),),
                           lambda a, ct, s=shift: (ct * dact(a - s),), key))] += 1
    return out


def matmul(dtype: str, trials: int) -> collections.Counter:
    def f(x, w):
        return jnp.maximum(x @ w, 0.0)

    def right(x, w, ct):
        g = ct * (x @ w > 0)
        return g @ w.T, x.T @ g

    out = collections.Counter()
    for s in range(trials):
        rng = np.random.default_rng(100 + s)
        x, w = rng.standard_normal((32, 64)), rng.standard_normal((64, 64)) / 8
        z = x @ w
        n, j = np.unravel_index(np.argmin(np.abs(z)), z.shape)
        x[n] += (10 ** rng.uniform(-9, -3) - z[n, j]) * w[:, j] / (w[:, j] @ w[:, j])
        args = (x.astype(dtype), w.astype(dtype))
        out[("right", verdict(f, args, right))] += 1
        for by in ([1 + 1e-7] if dtype == "float64" else []) + [1.001, -1.0]:
            label = "sign flipped" if by < 0 else f"off by {by - 1:.0e}"
            out[(label, verdict(f, args, lambda *a, by=by: tuple(by * c for c in right(*a))))] += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep", choices=("single", "kinds", "matmul"))
    parser.add_argument("--dtype", choices=tuple(tol.FLOORS), default="float64")
    parser.add_argument("--entries", type=int, default=5)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--place", choices=("log", "grid"), default="log")
    args = parser.parse_args()
    counts = (single(args.dtype, args.entries, args.trials, args.place) if args.sweep == "single" else
              kinds(args.dtype, args.trials) if args.sweep == "kinds" else matmul(args.dtype, args.trials))
    for k, n in sorted(counts.items(), key=str):
        print(f"{str(k):<50} {n:5d}")
    def correct_called_wrong(k) -> bool:   # single: the verdict; kinds: (kind, verdict); matmul: (planted, verdict)
        if isinstance(k, str):
            return k == "VJPMismatch"
        return k[1] == "VJPMismatch" and (args.sweep == "kinds" or k[0] == "right")

    wrong = sum(n for k, n in counts.items() if correct_called_wrong(k))
    print(f"correct VJPs called wrong: {wrong}")


if __name__ == "__main__":
    main()
