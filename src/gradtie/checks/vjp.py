"""`check_vjp`: one hand-written VJP tied to autodiff at a point, kink-aware.

For a function with a VJP of your own — a `jax.custom_vjp`, or any function with its VJP passed as
`vjp` — at the point `args` (float64) and a random cotangent at the output:

1. the point must be smooth: along a random direction v of the inputs, the one-sided slopes of
   ⟨ct, f(args + t·v)⟩ must agree. At a kink (a ReLU input at 0, a max tied between two inputs) they
   differ by the same jump at every step from 1e-6 to 1e-8: `NotSmooth` is raised, never a verdict;
2. the hand VJP is tied to the autodiff oracle (`gradtie.reference.vjp` of the primal function),
   each argument's cotangent within ENVELOPE_FACTOR × the point's envelope (the oracle at inputs and
   cotangent nudged by one unit roundoff, `checks.envelope`), floored at 1e-10;
3. central finite differences of ⟨ct, f⟩ along v at the step that converges best (the smallest
   truncation-plus-round-off envelope over a halving sequence, so the step stays inside the smooth
   piece) are tied to ⟨hand VJP, v⟩, within FD_FACTOR × that envelope, floored at 1e-6.

A failure raises `VJPMismatch` (an AssertionError, as `jax.test_util.check_grads` raises), naming
the argument and its error against its limit; a pass returns the report. Shown in: Check your own
backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from .. import tolerances as tol
from . import envelope as env_
from .tie import NodeRow, compare

KINK_STEPS = (1e-6, 1e-7, 1e-8)


class NotSmooth(ValueError):
    """The point sits on a kink: the function has no derivative there, so no VJP can be judged."""


class VJPMismatch(AssertionError):
    """The hand VJP is not the derivative at a smooth point."""


@dataclass(frozen=True)
class VJPReport:
    rows: list[NodeRow]       # one per argument: the hand cotangent against the oracle's
    fd: float                 # the central difference of ⟨ct, f⟩ along v
    fd_rendered: float        # ⟨hand VJP, v⟩
    fd_rel: float
    fd_limit: float
    fd_h: float
    slope_jump: float         # |right − left| / scale of the one-sided slopes at the smallest step

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and self.fd_rel <= self.fd_limit

    def summary(self) -> str:
        w = max(self.rows, key=lambda r: r.ratio)
        return (f"hand VJP tied to autodiff: {sum(r.ok for r in self.rows)}/{len(self.rows)} arguments "
                f"(worst {w.describe()}); finite differences {'agree' if self.fd_rel <= self.fd_limit else 'DISAGREE'} "
                f"(rel {self.fd_rel:.1e} vs limit {self.fd_limit:.1e}, h {self.fd_h:.1e})")


def _hand_vjp(f, vjp: Optional[Callable]) -> tuple[Callable, Callable]:
    """(primal function, args, ct -> the hand cotangents of every argument)."""
    if vjp is not None:
        return f, lambda args, ct: _as_tuple(vjp(*args, ct))
    if not isinstance(f, jax.custom_vjp) or getattr(f, "bwd", None) is None:
        raise ValueError("check_vjp: give a jax.custom_vjp function with its VJP defined (defvjp), or any "
                         "function with its hand-written VJP as vjp=(*args, ct) -> cotangents")
    if getattr(f, "nondiff_argnums", ()):
        raise ValueError("check_vjp: custom_vjp functions with nondiff_argnums are not supported; close over them")

    def hand(args, ct):
        _, residuals = f.fwd(*args)
        return _as_tuple(f.bwd(residuals, ct))
    return f.fun, hand


def _as_tuple(cts) -> tuple:
    return tuple(cts) if isinstance(cts, (tuple, list)) else (cts,)


def _along(f, args, ct, v, t):
    out = f(*(a + t * d for a, d in zip(args, v)))
    return float(jnp.vdot(ct, out))


def check_vjp(f: Callable, *args, vjp: Optional[Callable] = None, key: Optional[jax.Array] = None,
              factor: float = tol.ENVELOPE_FACTOR) -> VJPReport:
    """Tie the hand-written VJP of `f` at `args` to autodiff and to finite differences; raise
    `NotSmooth` at a kink and `VJPMismatch` on a wrong VJP. args: float arrays (float64, which
    needs `jax_enable_x64`). vjp: `(*args, ct)` -> one cotangent per argument, for a plain `f`."""
    if not jax.config.jax_enable_x64:
        raise ValueError("check_vjp: the oracle is float64: it needs jax_enable_x64")
    if not args:
        raise ValueError("check_vjp: give the point, one array per argument of f")
    args = tuple(jnp.asarray(a, jnp.float64) for a in args)
    primal, hand = _hand_vjp(f, vjp)
    key = jax.random.key(0) if key is None else key
    rng = env_.host_rng(key)
    out = primal(*args)
    ct = jnp.asarray(rng.standard_normal(np.shape(out)))
    v = [jnp.asarray(rng.standard_normal(a.shape)) for a in args]
    norm = float(np.sqrt(sum(float(jnp.vdot(d, d)) for d in v)))
    scale_x = max(1.0, max(float(jnp.max(jnp.abs(a))) for a in args if a.size))
    v = [d * (scale_x / norm) for d in v]

    # 1. a kink at the point: one-sided slopes whose jump does not shrink with the step
    g0 = _along(primal, args, ct, v, 0.0)
    jumps, scales = [], []
    for h in KINK_STEPS:
        gp, gp2, gm, gm2 = (_along(primal, args, ct, v, t) for t in (h, 2 * h, -h, -2 * h))
        right, left = (-3 * g0 + 4 * gp - gp2) / (2 * h), (3 * g0 - 4 * gm + gm2) / (2 * h)
        jumps.append(abs(right - left))
        scales.append(max(abs(right), abs(left), 1e-300))
    rel_jumps = [j / s for j, s in zip(jumps, scales)]
    if min(rel_jumps) > tol.SLOPE_REL and max(jumps) <= tol.GERM_KINK_FLATNESS * min(jumps):
        raise NotSmooth(f"check_vjp: not smooth here: along a random direction the one-sided slopes differ by "
                        f"{min(jumps):.3g} ({min(rel_jumps):.1e} of the slope) at every step from "
                        f"{KINK_STEPS[0]:g} to {KINK_STEPS[-1]:g}: the point sits on a kink (an input at 0 of a "
                        f"ReLU, a max tied between inputs), where no derivative exists")

    # 2. the hand VJP against the oracle, within the point's envelope
    got = hand(args, ct)
    if len(got) != len(args):
        raise VJPMismatch(f"check_vjp: the hand VJP returns {len(got)} cotangents for {len(args)} arguments")
    ref = reference.vjp(primal, *args, cotangent=ct)
    names = [f"arg{i}" for i in range(len(args))]
    outputs = []
    for s in env_.samples({"args": list(args), "ct": ct}, dtype="float64", key=jax.random.fold_in(key, 1),
                          nudged=("args", "ct")):
        outputs.append(list(reference.vjp(primal, *[jnp.asarray(a) for a in s.values["args"]],
                                          cotangent=jnp.asarray(s.values["ct"]))))
    worst = env_.spread(list(ref), outputs)
    rows = compare(dict(zip(names, got)), dict(zip(names, ref)), envelope=dict(zip(names, worst)), factor=factor,
                   shapes={n: tuple(a.shape) for n, a in zip(names, args)}, dtype="float64")
    shaped = [r for r in rows if r.mismatch]
    if shaped:
        raise VJPMismatch("check_vjp: the hand VJP's cotangents are not its arguments': "
                          + "; ".join(r.describe() for r in shaped))

    # 3. finite differences at the best-converged step
    dot = float(sum(jnp.vdot(jnp.asarray(c, jnp.float64), d) for c, d in zip(got, v)))
    roundoff = np.finfo(np.float64).eps * max(abs(g0), 1.0) * 4
    best = None
    h = 1e-3
    d_prev = (_along(primal, args, ct, v, h) - _along(primal, args, ct, v, -h)) / (2 * h)
    while h > 1e-9:
        h2 = h / 2
        d_h2 = (_along(primal, args, ct, v, h2) - _along(primal, args, ct, v, -h2)) / (2 * h2)
        envelope = 4 / 3 * abs(d_prev - d_h2) + roundoff / h
        if best is None or envelope < best[1]:
            best = (h, envelope, d_prev)
        h, d_prev = h2, d_h2
    h, envelope, d = best
    scale = max(abs(d), abs(dot), 1e-300)
    fd_rel, fd_limit = abs(d - dot) / scale, max(tol.FD_FACTOR * envelope / scale, tol.FD_REL)
    rep = VJPReport(rows, d, dot, fd_rel, fd_limit, h, rel_jumps[-1])
    bad = [r for r in rows if not r.ok]
    if bad or fd_rel > fd_limit:
        parts = [r.describe() for r in bad]
        if fd_rel > fd_limit:
            parts.append(f"finite differences along a random direction: {d:.6g} against ⟨hand VJP, v⟩ = {dot:.6g} "
                         f"(rel {fd_rel:.1e} > limit {fd_limit:.1e})")
        raise VJPMismatch("check_vjp: the hand VJP is not the derivative here: " + "; ".join(parts))
    return rep
