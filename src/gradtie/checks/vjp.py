"""`check_vjp`: one hand-written VJP tied to autodiff at a point, kink-aware.

For a `jax.custom_vjp`, or any function with its VJP passed as `vjp`, at the point `args` (float64),
a random cotangent ct at the output and a random direction v of the inputs:

1. at a kink (a ReLU input at 0, a max tied between two inputs) the one-sided slopes of
   ⟨ct, f(args + t·v)⟩ differ by the same jump at every step from 1e-6 to 1e-8 (`fd.one_sided`,
   `fd.kinked`): `NotSmooth` is raised, never a verdict;
2. each argument's hand cotangent is tied to the autodiff oracle (`gradtie.reference.vjp`) within
   ENVELOPE_FACTOR × the point's envelope (`checks.envelope`), floored at 1e-10;
3. central differences of ⟨ct, f⟩ along v at the best-converged step (`fd.best_step`) are tied to
   ⟨hand VJP, v⟩ as a node's are (`fd.row`): within FD_FACTOR × their envelope, floored at 1e-6.

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

from .. import prng, reference
from .. import tolerances as tol
from . import envelope as env_, fd as fd_
from .tie import NodeRow, compare, need_x64

KINK_STEPS = (1e-6, 1e-7, 1e-8)


class NotSmooth(ValueError):
    """The point sits on a kink: the function has no derivative there, so no VJP can be judged."""


class VJPMismatch(AssertionError):
    """The hand VJP is not the derivative at a smooth point."""


@dataclass(frozen=True)
class VJPReport:
    rows: list[NodeRow]       # one per argument: the hand cotangent against the oracle's
    fd: fd_.FDRow             # the central difference of ⟨ct, f⟩ along v against ⟨hand VJP, v⟩
    slope_jump: float         # |right − left| / scale of the one-sided slopes at the smallest step

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and self.fd.ok

    def summary(self) -> str:
        w, f = max(self.rows, key=lambda r: r.ratio), self.fd
        return (f"hand VJP tied to autodiff: {sum(r.ok for r in self.rows)}/{len(self.rows)} arguments "
                f"(worst {w.describe()}); finite differences {'agree' if f.ok else 'DISAGREE'} "
                f"(rel {f.rel:.1e} vs limit {f.limit:.1e}, h {f.h:.1e})")


def _hand_vjp(f, vjp: Optional[Callable]) -> tuple[Callable, Callable]:
    """(the primal function, its hand VJP: (*args, ct) -> the cotangents of every argument)."""
    if vjp is not None:
        return f, vjp
    if not isinstance(f, jax.custom_vjp) or getattr(f, "bwd", None) is None:
        raise ValueError("check_vjp: give a jax.custom_vjp function with its VJP defined (defvjp), or any "
                         "function with its hand-written VJP as vjp=(*args, ct) -> cotangents")
    if getattr(f, "nondiff_argnums", ()):
        raise ValueError("check_vjp: custom_vjp functions with nondiff_argnums are not supported; close over them")
    return f.fun, lambda *a: f.bwd(f.fwd(*a[:-1])[1], a[-1])


def check_vjp(f: Callable, *args, vjp: Optional[Callable] = None, key: Optional[jax.Array] = None,
              factor: float = tol.ENVELOPE_FACTOR) -> VJPReport:
    """Tie the hand-written VJP of `f` at `args` to autodiff and to finite differences; raise
    `NotSmooth` at a kink and `VJPMismatch` on a wrong VJP. args: float arrays (float64, which
    needs `jax_enable_x64`). vjp: `(*args, ct)` -> one cotangent per argument, for a plain `f`."""
    need_x64("check_vjp")
    if not args:
        raise ValueError("check_vjp: give the point, one array per argument of f")
    args = tuple(jnp.asarray(a, jnp.float64) for a in args)
    primal, hand = _hand_vjp(f, vjp)
    key = jax.random.key(0) if key is None else key
    rng = prng.host_rng(key)
    ct = jnp.asarray(rng.standard_normal(np.shape(primal(*args))))
    v = [jnp.asarray(rng.standard_normal(a.shape)) for a in args]
    norm = float(np.sqrt(sum(float(jnp.vdot(d, d)) for d in v)))
    v = [d * (max(1.0, max(float(jnp.max(jnp.abs(a))) for a in args if a.size)) / norm) for d in v]

    def along(t):
        return float(jnp.vdot(ct, primal(*(a + t * d for a, d in zip(args, v)))))

    # 1. a kink at the point: one-sided slopes whose jump does not shrink with the step
    slopes = [fd_.one_sided(along, h) for h in KINK_STEPS]
    jumps = [abs(right - left) for left, right in slopes]
    rel_jumps = [j / max(abs(left), abs(right), 1e-300) for j, (left, right) in zip(jumps, slopes)]
    if min(rel_jumps) > tol.SLOPE_REL and fd_.kinked(jumps):
        raise NotSmooth(f"check_vjp: not smooth here: along a random direction the one-sided slopes differ by "
                        f"{min(jumps):.3g} ({min(rel_jumps):.1e} of the slope) at every step from "
                        f"{KINK_STEPS[0]:g} to {KINK_STEPS[-1]:g}: the point sits on a kink (an input at 0 of a "
                        f"ReLU, a max tied between inputs), where no derivative exists")

    # 2. the hand VJP against the oracle, within the point's envelope
    got = hand(*args, ct)
    got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
    if len(got) != len(args):
        raise VJPMismatch(f"check_vjp: the hand VJP returns {len(got)} cotangents for {len(args)} arguments")
    ref = reference.vjp(primal, *args, cotangent=ct)
    names = [f"arg{i}" for i in range(len(args))]
    outputs = [list(reference.vjp(primal, *map(jnp.asarray, s.values["args"]), cotangent=jnp.asarray(s.values["ct"])))
               for s in env_.samples({"args": list(args), "ct": ct}, dtype="float64",
                                     key=jax.random.fold_in(key, 1), nudged=("args", "ct"))]
    rows = compare(dict(zip(names, got)), dict(zip(names, ref)), factor=factor,
                   envelope=dict(zip(names, env_.spread(list(ref), outputs))), dtype="float64")
    if any(r.mismatch for r in rows):
        raise VJPMismatch("check_vjp: the hand VJP's cotangents are not its arguments': "
                          + "; ".join(r.describe() for r in rows if r.mismatch))

    # 3. finite differences at the best-converged step, halved from 1e-3
    dot = float(sum(jnp.vdot(jnp.asarray(c, jnp.float64), d) for c, d in zip(got, v)))
    roundoff = np.finfo(np.float64).eps * max(abs(along(0.0)), 1.0) * 4
    h, d, envelope, _ = fd_.best_step(lambda t: (along(t), True), 1e-3, roundoff=roundoff, min_step=1e-9)
    rep = VJPReport(rows, fd_.row("fd", d, dot, dot, h, envelope, floor=1e-300), rel_jumps[-1])
    if not rep.ok:
        parts = [r.describe() for r in rows if not r.ok]
        if not rep.fd.ok:
            parts.append(f"finite differences along a random direction: {d:.6g} against ⟨hand VJP, v⟩ = {dot:.6g} "
                         f"(rel {rep.fd.rel:.1e} > limit {rep.fd.limit:.1e})")
        raise VJPMismatch("check_vjp: the hand VJP is not the derivative here: " + "; ".join(parts))
    return rep
