"""`check_vjp`: one hand-written VJP tied to autodiff at a point, judged only inside its smooth piece.

For a `jax.custom_vjp`, or any function with its VJP passed as `vjp`, at the point `args` (all
float64 or all float32: the VJP is checked in the dtype it is given), a random cotangent ct at the
output and a random direction v of the inputs:

1. at a kink (a ReLU input at 0, a max tied between two inputs) the one-sided slopes of
   ⟨ct, f(args + t·v)⟩ at the float64 point differ by the same jump at every step from 1e-6 to
   1e-8 (`fd.one_sided`, `fd.kinked`): `NotSmooth` is raised, never a verdict;
2. each argument's hand cotangent, run in the checked dtype, is tied to the float64 autodiff
   oracle at the exactly widened point (`gradtie.reference.vjp`) within ENVELOPE_FACTOR × the
   point's envelope in that dtype (`checks.envelope`), floored at the dtype's floor; a cotangent of
   another shape or dtype than its argument fails;
3. central differences of ⟨ct, f⟩ along v, evaluated in the checked dtype, are tied to ⟨hand VJP,
   v⟩ as a net's nodes are (`fd.best_step`, `fd.row`): only at a step whose samples stay in the
   point's smooth piece, found from the function's own outputs (`fd.SampledPiece`); where no step
   qualifies the row is "no evidence (kink)", and where round-off alone reaches
   ILL_CONDITIONED_REL of the value "no evidence (round-off)": neither ever fails.

A failure raises `VJPMismatch` (an AssertionError, as `jax.test_util.check_grads` raises), naming
the argument and its error against its limit; a pass returns the report. Shown in: Check your own
backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng, reference
from .. import tolerances as tol
from ..host import to_device
from . import envelope as env_, fd as fd_
from .tie import Limit, NodeRow, compare, need_x64

KINK_STEPS = (1e-6, 1e-7, 1e-8)


class NotSmooth(ValueError):
    """The point sits on a kink: the function has no derivative there, so no VJP can be judged."""


class VJPMismatch(AssertionError):
    """The hand VJP is not the derivative at a smooth point. `rows`: the tie rows that judged it, one
    per argument (empty when the VJP returned the wrong number of cotangents); `fd`: the finite
    difference's row, when it ran."""

    def __init__(self, message: str, rows: Sequence[NodeRow] = (), fd: Optional[fd_.FDRow] = None):
        super().__init__(message)
        self.rows, self.fd = list(rows), fd


@dataclass(frozen=True)
class VJPReport:
    """What `check_vjp` found at a smooth point: one tie row per argument (the hand cotangent against
    the float64 oracle's, within the point's envelope), the finite-difference row, and the jump
    between the one-sided slopes. `ok` when every row and the finite difference pass; `summary()`
    says so in one line."""
    dtype: str                # the dtype the hand VJP and the finite differences ran in (the arguments')
    rows: list[NodeRow]       # one per argument: the hand cotangent against the float64 oracle's
    fd: fd_.FDRow             # the central difference of ⟨ct, f⟩ along v against ⟨hand VJP, v⟩
    slope_jump: float         # |right − left| / scale of the one-sided slopes at the smallest step

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and self.fd.ok

    @property
    def no_evidence(self) -> list[NodeRow]:
        """Tie rows within their limit where round-off alone reaches ILL_CONDITIONED_REL of the value
        (a point within the dtype's round-off of a kink): they pass, and prove nothing."""
        return [r for r in self.rows if r.ok and r.ill_conditioned]

    def summary(self) -> str:
        w, f, ill = max(self.rows, key=lambda r: r.ratio), self.fd, self.no_evidence
        tie = f"{sum(r.agrees for r in self.rows)}/{len(self.rows)} arguments (worst {w.describe()})"
        if ill:
            tie += (f", {len(ill)} no evidence (round-off: the limit is {max(r.limit for r in ill):.0%} of the value "
                    f"at {', '.join(r.name for r in ill)})")
        return (f"{self.dtype} VJP checked in {self.dtype} (against the float64 oracle, within {self.dtype}'s "
                f"envelope): tied to autodiff at {tie}; finite differences in {self.dtype}: {f.verdict_text()}")


@dataclass(frozen=True)
class VJPPoint:
    """The point `check_vjp` judges, validated once: the arguments in the checked dtype and widened
    exactly to float64 (the oracle's)."""
    args: tuple[jax.Array, ...]
    args64: tuple[jax.Array, ...]
    dtype: str

    @staticmethod
    def of(args: tuple) -> "VJPPoint":
        if not args:
            raise ValueError("check_vjp: give the point, one array per argument of f")
        given = tuple(jnp.asarray(a) for a in args)
        dtypes = [np.dtype(a.dtype).name for a in given]
        bad = [f"arg{i} is {d}" for i, d in enumerate(dtypes) if d not in tol.FLOORS]
        if bad:
            raise ValueError(f"check_vjp: {', '.join(bad)}: give float64 or float32 arrays (the VJP is checked "
                             f"in the dtype it is given)")
        if len(set(dtypes)) > 1:
            raise ValueError(f"check_vjp: the arguments mix {' and '.join(sorted(set(dtypes)))} "
                             f"({', '.join(f'arg{i} {d}' for i, d in enumerate(dtypes))}): give them in one dtype, "
                             f"the one the VJP is checked in")
        return VJPPoint(given, tuple(to_device(a, np.float64) for a in given), dtypes[0])

    def ulp_nudges(self, key, draws: int) -> list[tuple[jax.Array, ...]]:
        """`draws` copies of the point, each entry one ulp of the checked dtype up or down at random."""
        rng = prng.host_rng(key)
        return [tuple(to_device(np.where(rng.random(np.shape(a)) < 0.5, np.nextafter(a, -np.inf),
                                         np.nextafter(a, np.inf))) for a in map(np.asarray, self.args))
                for _ in range(draws)]

    def nudged_pairs(self, key, draws: int) -> list[tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]]:
        """`draws` pairs of copies of the point, its entries moved by a relative ±PIECE_NOISE_NUDGE·ξ
        (ξ ~ N(0, 1) per entry), rounded to the checked dtype."""
        rng, u = prng.host_rng(key), tol.PIECE_NOISE_NUDGE[self.dtype]
        pairs = []
        for _ in range(draws):
            xi = [rng.standard_normal(np.shape(a)) for a in self.args64]
            pairs.append(tuple(tuple(to_device(np.asarray(a) * (1 + sign * u * e), self.dtype)
                                     for a, e in zip(self.args64, xi)) for sign in (1, -1)))
        return pairs

    def moved(self, v: list[np.ndarray], t: float) -> tuple[jax.Array, ...]:
        """The point moved by t·v, rounded to the checked dtype."""
        return tuple(to_device(np.asarray(a) + t * d, self.dtype) for a, d in zip(self.args64, v))


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


def _not_smooth(along: Callable[[float], float]) -> tuple[Optional[str], float]:
    """(why the point sits on a kink, or None; the relative slope jump at the smallest step): the
    one-sided slopes of `along` part by a jump that does not shrink with the step."""
    slopes = [fd_.one_sided(along, h) for h in KINK_STEPS]
    jumps = [abs(right - left) for left, right in slopes]
    rel_jumps = [j / max(abs(left), abs(right), 1e-300) for j, (left, right) in zip(jumps, slopes)]
    if min(rel_jumps) > tol.SLOPE_REL and fd_.kinked(jumps):
        return (f"check_vjp: not smooth here: along a random direction the one-sided slopes differ by "
                f"{min(jumps):.3g} ({min(rel_jumps):.1e} of the slope) at every step from {KINK_STEPS[0]:g} to "
                f"{KINK_STEPS[-1]:g}: the point sits on a kink (an input at 0 of a ReLU, a max tied between "
                f"inputs), where no derivative exists"), rel_jumps[-1]
    return None, rel_jumps[-1]


def _refuse_a_kink_at_the_point(primal: Callable, point: VJPPoint, ct64: np.ndarray, v: list, rows: list) -> None:
    """Before a tie row is called wrong: raise `NotSmooth` where the oracle's cotangents just either
    side of the point (t = ±PIECE_NOISE_NUDGE along v, at the float64 point) part by more than the
    row's limit. There the point sits on a kink whose jump the one-sided slopes of L cannot resolve
    (a ReLU at 0 feeding a small term), and the oracle's own value is one subgradient of several."""
    t = tol.PIECE_NOISE_NUDGE["float64"]
    sides = [reference.vjp(primal, *(to_device(np.asarray(a) + s * t * d) for a, d in zip(point.args64, v)),
                           cotangent=to_device(ct64)) for s in (1, -1)]
    for i, row in enumerate(rows):
        jump = float(np.max(np.abs(np.asarray(sides[0][i]) - np.asarray(sides[1][i])))) if row.shape else 0.0
        if not row.ok and jump > row.limit * row.scale:
            raise NotSmooth(f"check_vjp: not smooth here: just either side of the point (±{t:.1e} along a random "
                            f"direction) autodiff's {row.name} cotangent jumps by {jump / row.scale:.1e} of its scale, "
                            f"more than the tie's limit {row.limit:.1e}: the point sits on a kink (an input at 0 "
                            f"of a ReLU, a max tied between inputs), where no derivative exists")


def check_vjp(f: Callable, *args, vjp: Optional[Callable] = None, key: Optional[jax.Array] = None,
              factor: float = tol.ENVELOPE_FACTOR) -> VJPReport:
    """Tie the hand-written VJP of `f` at `args` to autodiff and to finite differences; raise
    `NotSmooth` at a kink and `VJPMismatch` on a wrong VJP. args: float arrays, all float64 or all
    float32 (the VJP and the finite differences run in that dtype; the oracle is float64, which
    needs `jax_enable_x64`). vjp: `(*args, ct)` -> one cotangent per argument, for a plain `f`.
    Finite differences count only at a step that stays in the point's smooth piece: near a kink
    they are no evidence, never a failure."""
    need_x64("check_vjp")
    point = VJPPoint.of(args)
    primal, hand = _hand_vjp(f, vjp)
    key = jax.random.key(0) if key is None else key
    rng = prng.host_rng(key)
    out = jax.eval_shape(primal, *point.args)
    if not isinstance(out, jax.ShapeDtypeStruct) or not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"check_vjp: f must return one float array, got {jax.tree.map(lambda s: s.dtype, out)}: "
                         f"close over the others, or check each output on its own")
    # the cotangent in the output's dtype (a float32 f returns float32; one that promotes, its own)
    ct64 = rng.standard_normal(out.shape).astype(out.dtype).astype(np.float64)
    scale = max(1.0, max(float(jnp.max(jnp.abs(a))) for a in point.args64 if a.size))
    v = [rng.standard_normal(a.shape) for a in point.args64]
    norm = float(np.sqrt(sum(float(np.vdot(d, d)) for d in v)))
    v = [d * (scale / norm) for d in v]

    # 1. a kink at the point, read at the float64 point (the kink is the point's, not a dtype's)
    def along64(t: float) -> float:
        return float(np.vdot(ct64, np.asarray(primal(*(to_device(np.asarray(a) + t * d) for a, d in zip(point.args64, v))))))

    why, slope_jump = _not_smooth(along64)
    if why:
        raise NotSmooth(why)

    # 2. the hand VJP in the checked dtype against the float64 oracle, within the point's envelope
    ct = to_device(ct64, out.dtype)
    got = hand(*point.args, ct)
    got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
    if len(got) != len(point.args):
        raise VJPMismatch(f"check_vjp: the hand VJP returns {len(got)} cotangents for {len(point.args)} arguments")
    ref = reference.vjp(primal, *point.args64, cotangent=to_device(ct64))
    names = [f"arg{i}" for i in range(len(point.args))]
    samples = env_.samples({"args": list(point.args64), "ct": ct64}, dtype=point.dtype,
                           key=jax.random.fold_in(key, 1), nudged=("args", "ct"))
    outputs = [list(reference.vjp(primal, *map(to_device, s.values["args"]), cotangent=to_device(s.values["ct"], out.dtype)))
               for s in samples]
    rows = compare(dict(zip(names, got)), dict(zip(names, ref)), dtype=point.dtype,
                   limit=Limit(dict(zip(names, env_.spread(list(ref), outputs))), factor, tol.FLOORS[point.dtype]))
    if any(r.mismatch for r in rows):
        raise VJPMismatch("check_vjp: the hand VJP's cotangents are not its arguments': "
                          + "; ".join(r.describe() for r in rows if r.mismatch), rows)
    if not all(r.ok for r in rows):
        _refuse_a_kink_at_the_point(primal, point, ct64, v, rows)

    # 3. finite differences in the checked dtype, at a step inside the point's smooth piece. The
    # round-off of f's outputs (entry by entry) and of L, as a moved point meets it: its entries
    # rounded to the dtype (the point with each entry one ulp up or down) and every rounding inside f
    # re-rolled (pairs of copies moved by a relative ±δ: the first-order change cancels, and so
    # does the rounding of the pair's entries); at least one unit roundoff of each output entry
    y0 = np.asarray(primal(*point.args), np.float64)
    keys = jax.random.split(jax.random.fold_in(key, 2))
    spread = [np.asarray(primal(*args), np.float64) - y0
              for args in point.ulp_nudges(keys[0], tol.PIECE_NOISE_DRAWS)]
    spread += [np.asarray(primal(*up), np.float64) / 2 + np.asarray(primal(*down), np.float64) / 2 - y0
               for up, down in point.nudged_pairs(keys[1], tol.PIECE_NOISE_DRAWS)]
    noise = np.maximum(np.max(np.abs(spread), axis=0), tol.UNIT_ROUNDOFF[point.dtype] * np.abs(y0))
    roundoff = max([abs(float(np.vdot(ct64, s))) for s in spread]
                   + [tol.UNIT_ROUNDOFF[point.dtype] * abs(float(np.vdot(ct64, y0)))])
    probe = fd_.SampledPiece(lambda t: primal(*point.moved(v, t)), ct64, noise)
    step = fd_.best_step(probe, tol.VJP_FD_STEP[point.dtype], roundoff=roundoff,
                         min_step=tol.VJP_FD_MIN_STEP[point.dtype])
    dot, dot_ref = (float(sum(np.vdot(np.asarray(c, np.float64), d) for c, d in zip(g, v))) for g in (got, ref))
    # the scale: |D(h)|, |⟨oracle, v⟩|, a fraction of the oracle's norm along v, or the envelope itself
    # (a derivative 0 along v: a hand VJP off 0 by more than FD_FACTOR envelopes fails)
    floor = tol.ZERO_NODE_FLOOR * scale * float(np.sqrt(sum(np.vdot(np.asarray(g), np.asarray(g)) for g in ref)))
    fd_row = fd_.row("fd", step, dot, dot_ref, floor=max(floor, step.envelope, 1e-300))
    rep = VJPReport(point.dtype, rows, fd_row, slope_jump)
    if not rep.ok:
        parts = [r.describe() for r in rows if not r.ok]
        if not rep.fd.ok:
            parts.append(f"finite differences along a random direction: {step.d:.6g} against ⟨hand VJP, v⟩ = "
                         f"{dot:.6g} (rel {rep.fd.rel:.1e} > limit {rep.fd.limit:.1e}, h {step.h:.1e}, in "
                         f"{point.dtype})")
        raise VJPMismatch("check_vjp: the hand VJP is not the derivative here: " + "; ".join(parts), rows, fd_row)
    return rep
