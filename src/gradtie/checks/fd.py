"""Derivatives along a direction, written once: central differences and their envelope, one-sided
slopes and the kink they reveal, Taylor coefficients along a path, the radius to the first kink.
The nodes' finite differences (`derivatives`), the germ walks, the census's one-sided slopes and
`check_vjp` use them. The loss is the forward's through the net's `Loss.value`, never a backward.

D(h) = (L(θ + h·v) − L(θ − h·v)) / 2h → ⟨∇L, v⟩ at O(h²) where L is smooth; its envelope is the
truncation seen between h and h/2 (Richardson: 4/3·|D(h) − D(h/2)|) plus the round-off ε_L/h. Real
batches hold windows within 1e-6 of a tie, and a difference across a kink measures nothing: a node's
step whose ends never come back into the point's smooth piece (every ReLU input's sign, every pool
window's choice) by FD_MIN_STEP is "no evidence (kink)". One step rule (`best_step`) serves the net's
nodes, whose piece the net reports (`KnownPiece`), and `check_vjp`, whose function shows its piece
only through its outputs (`SampledPiece`). The limit is FD_FACTOR of the envelope,
floored at FD_REL, its scale read off the oracle's gradient, never the rendered one (an inflated
node must not widen every other row's floor); a limit reaching ILL_CONDITIONED_REL is "no
evidence", never a pass. Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial, reduce
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng, reference, rendered
from .. import tolerances as tol
from ..host import to_device
from ..nets.protocol import Net, Pass, fold_forward
from ..ops import maxpool
from ..progress import bar
from .tie import Point, piece_of, targets_matrix


# ---- the step: central differences inside the point's smooth piece -------------------------------

class Step(NamedTuple):
    h: float           # the step taken
    d: float           # D(h) = (L(h) − L(−h)) / 2h
    envelope: float    # 4/3·|D(h) − D(h/2)| + roundoff/h + the probe's doubt
    inside: bool       # [−h, h] lies in the point's smooth piece; False: no evidence (a kink)


class Probe(Protocol):
    """L along a line through the point, and whether a step keeps to the point's smooth piece."""

    def loss(self, t: float) -> float: ...

    def inside(self, h: float) -> bool: ...

    def doubt(self, h: float) -> float:
        """What a kink the piece test cannot see may add to D(h) (0 where the piece is known)."""
        ...


class KnownPiece:
    """A probe whose ends say whether they lie in the point's smooth piece: `end(t)` -> (L(t), same),
    `same` read off the net itself (every ReLU input's sign and every pool window's choice as at the
    point). A step is inside when both ends of h and of h/2 are."""

    def __init__(self, end: Callable[[float], tuple[float, bool]]):
        self._end, self._ends = end, {}

    def _at(self, t: float) -> tuple[float, bool]:
        if t not in self._ends:
            self._ends[t] = self._end(t)
        return self._ends[t]

    def loss(self, t: float) -> float:
        return self._at(t)[0]

    def inside(self, h: float) -> bool:
        return all(self._at(s)[1] for s in (h, -h, h / 2, -h / 2))

    def doubt(self, h: float) -> float:
        return 0.0


class SampledPiece:
    """A probe for a function the checker cannot see inside: the piece is found from its outputs.

    Y(t) = `outputs(t)` (the function at the point moved by t along the line, as float64 host
    values) and L(t) = ⟨ct, Y(t)⟩. The segment [−h, h] is taken to lie in one smooth piece when, at
    every output entry, the samples at 0, ±h/4, ±h/2, ±h scale as a smooth function's must:

    - central differences converge at second order: D(h) − D(h/2) = 4·(D(h/2) − D(h/4)), where a
      kink inside (−h, h) off the point makes the differences halve or jump instead;
    - one-sided slopes agree at third order: K(s) = right(s) − left(s) (`one_sided` at step s/2)
      shrinks 8× from s = h to h/2, where a kink near the point keeps its jump at every step;

    each within PIECE_SCALING_REL of the terms compared, plus PIECE_NOISE_FACTOR × the entry's
    round-off `noise` (its spread when the point's entries move by an ulp) carried through the
    differences, at h and again at h/2 (8 samples a side). A kink's ratios come out right at a few
    places of one level, never at both levels: no kink of a ReLU, a max or a max pool near a tie,
    abs, clip, or any composition of them stays hidden unless it hides in the round-off, and then
    `doubt` holds what it can do to D(h)."""

    def __init__(self, outputs: Callable[[float], np.ndarray], ct: np.ndarray, noise: np.ndarray):
        self._outputs, self.ct, self.noise = outputs, np.asarray(ct, np.float64), np.asarray(noise, np.float64)
        self._ys: dict[float, np.ndarray] = {}
        self._losses: dict[float, float] = {}

    def y(self, t: float) -> np.ndarray:
        if t not in self._ys:
            self._ys[t] = np.asarray(self._outputs(t), np.float64)
            self._losses[t] = float(np.vdot(self.ct, self._ys[t]))
        return self._ys[t]

    def loss(self, t: float) -> float:
        if t not in self._losses:
            self.y(t)
        return self._losses[t]

    def central(self, s: float) -> np.ndarray:
        return (self.y(s) - self.y(-s)) / (2 * s)

    def slope_jump(self, s: float) -> np.ndarray:
        """K(s) = right − left one-sided second-order slopes at step s/2: (4·S(s/2) − S(s)) / s, S the
        second difference S(r) = Y(r) − 2·Y(0) + Y(−r)."""
        def second(r):
            return self.y(r) - 2 * self.y(0.0) + self.y(-r)
        return (4 * second(s / 2) - second(s)) / s

    def _scales(self, h: float) -> np.ndarray:
        """Whether the samples at 0, ±h/4, ±h/2, ±h scale as a smooth function's, entry by entry."""
        rho, noise = tol.PIECE_SCALING_REL, tol.PIECE_NOISE_FACTOR * self.noise / h
        d1 = self.central(h) - self.central(h / 2)
        d2 = self.central(h / 2) - self.central(h / 4)
        # noise carried through: D(s) moves by ≤ noise_Y/s, so 27·noise_Y/h for d1 − 4·d2 ...
        converge = np.abs(d1 - 4 * d2) <= rho * (np.abs(d1) + 4 * np.abs(d2)) + 27 * noise
        k1, k2 = self.slope_jump(h), self.slope_jump(h / 2)
        # ... and 16·noise_Y/s for K(s): 272·noise_Y/h for K(h) − 8·K(h/2)
        agree = np.abs(k1 - 8 * k2) <= rho * (np.abs(k1) + 8 * np.abs(k2)) + 272 * noise
        return converge & agree

    def inside(self, h: float) -> bool:
        """[−h, h] in one smooth piece: the samples scale as they must at h and at h/2 (a kink at
        τ·h where one level's ratios happen to come out right is at 2τ·h/2 for the next). Steps
        only shrink from here: outputs beyond h are let go (their L is kept)."""
        self._ys = {t: y for t, y in self._ys.items() if abs(t) <= h}
        return bool(np.all(self._scales(h)) and np.all(self._scales(h / 2)))

    def doubt(self, h: float) -> float:
        """Half the one-sided slopes' disagreement of L, |⟨ct, K(h)⟩|/2: a kink at τ·h that hides in
        the round-off moves D(h) by J(1 − τ)/2, and 4/3·|D(h) − D(h/2)| + |K|/2 is at least 2/3 of
        that at every τ (K = J(1 − 3τ) and D(h) − D(h/2) = Jτ/2 below τ = 1/2, D(h) − D(h/2) the
        whole move above): a step that keeps such a kink is judged within FD_FACTOR × 2/3 of what
        the kink does. A smooth L gives O(h³) and round-off."""
        return abs(float(np.vdot(self.ct, self.slope_jump(h)))) / 2


def best_step(probe: Probe, h: float, *, roundoff: float, min_step: float = tol.FD_MIN_STEP) -> Step:
    """The step at which D(h) is judged: halved from `h` until the step keeps to the point's smooth
    piece (`probe.inside`), then further while the envelope 4/3·|D(h) − D(h/2)| + roundoff/h (plus
    the piece's `doubt`, where it is found from samples) keeps shrinking (where L curves hard, as a BatchNorm over few cells, the best step is far below the
    first one inside). No step from `h` down to `min_step` inside: `inside` False, no evidence (a
    kink), never a verdict. The one rule of every finite difference the checks take: a net's nodes
    (`KnownPiece`) and `check_vjp` (`SampledPiece`). A halving costs two evaluations."""
    def judged(h):
        d_h = (probe.loss(h) - probe.loss(-h)) / (2 * h)
        d_half = (probe.loss(h / 2) - probe.loss(-h / 2)) / h
        return d_h, 4 / 3 * abs(d_h - d_half) + roundoff / h + probe.doubt(h)

    inside = probe.inside(h)
    while not inside and h / 2 >= min_step:
        h /= 2
        inside = probe.inside(h)
    d_h, env = judged(h)
    while inside and h / 2 >= min_step:
        if not probe.inside(h / 2):
            break
        d2, env2 = judged(h / 2)
        if env2 >= env:
            break
        h, d_h, env = h / 2, d2, env2
    return Step(h, d_h, env, inside)


def one_sided(f: Callable, h: float) -> tuple[float, float]:
    """(left, right), f's second-order one-sided slopes at 0: right = (−3f(0) + 4f(h) − f(2h))/2h, left
    its mirror. Both are f'(0) where f is smooth on [−2h, 2h]; at a kink they part."""
    f0, fp, fp2, fm, fm2 = (f(t) for t in (0.0, h, 2 * h, -h, -2 * h))
    return (3 * f0 - 4 * fm + fm2) / (2 * h), (-3 * f0 + 4 * fp - fp2) / (2 * h)


def kinked(jumps) -> bool:
    """A kink at 0: the jump |right − left| the same (to GERM_KINK_FLATNESS) at steps decades apart."""
    j = np.asarray(jumps)
    return bool(j.size and j.min() > 0 and j.max() <= tol.GERM_KINK_FLATNESS * j.min())


# ---- every node, from its own stage onward --------------------------------------------------------

@dataclass(frozen=True)
class FDRow:
    name: str
    fd: float           # D(h), the central difference
    rendered: float     # ⟨rendered node, v⟩
    rel: float          # |fd − rendered| / scale
    limit: float        # max(FD_FACTOR · envelope, FD_REL)
    h: float = tol.FD_STEP
    envelope: float = 0.0   # (truncation + round-off of D(h)) / scale
    kinked: bool = False    # the step's ends never lay in the point's smooth piece: no evidence

    @property
    def ill_conditioned(self) -> bool:
        return bool(self.limit >= tol.ILL_CONDITIONED_REL)

    @property
    def ok(self) -> bool:
        return self.kinked or bool(self.rel <= self.limit)

    @property
    def verdict(self) -> str:
        return "FAILED" if not self.ok else "no evidence" if self.kinked or self.ill_conditioned else "ok"

    @property
    def no_evidence(self) -> str:
        """Why the row is no evidence: "kink" (no step kept to the point's smooth piece), "round-off"
        (the limit reaches ILL_CONDITIONED_REL of the value), or "" (it is evidence, or FAILED)."""
        return "" if self.verdict != "no evidence" else "kink" if self.kinked else "round-off"

    def verdict_text(self) -> str:
        """The verdict in words: "agree", "DISAGREE" or "no evidence (kink)" / "(round-off)", with the
        figures it stands on."""
        figures = f"rel {self.rel:.1e} vs limit {self.limit:.1e}, h {self.h:.1e}"
        if self.no_evidence == "kink":
            return f"no evidence (kink): no step down to h {self.h:.1e} stays in the point's smooth piece"
        if self.no_evidence == "round-off":
            return f"no evidence (round-off): the limit is {self.limit:.0%} of the value ({figures})"
        return f"{'agree' if self.ok else 'DISAGREE'} ({figures})"


def row(name: str, step: Step, dot: float, ref: float, *, floor: float, factor: float = tol.FD_FACTOR) -> FDRow:
    """The step's D(h) against a node's ⟨·, v⟩ `dot`, in units of max(|D(h)|, |ref|, floor) (ref: the
    oracle's ⟨·, v⟩), held to max(factor × the step's envelope, FD_REL); a step outside the point's
    smooth piece is no evidence (a kink)."""
    scale = max(abs(step.d), abs(ref), floor)
    return FDRow(name, step.d, dot, abs(step.d - dot) / scale, max(factor * step.envelope / scale, tol.FD_REL),
                 step.h, step.envelope / scale, not step.inside)


@partial(jax.jit, static_argnums=(0, 1, 4))
def _suffix_probe(net: Net, start: int, params, h, cfg, targets, alpha, here):
    """(loss, whether the point lies in the smooth piece `here`) with stages start… run from their
    input h; only the piece's entries those stages compute are compared (the earlier ones cannot move)."""
    suffix = net.stage_list(cfg)[start:]
    logits, saved = fold_forward(suffix, params, h, cfg, Pass())
    piece = piece_of(net, saved, suffix)
    same = jnp.all(jnp.stack([jnp.all(a == here[i][k]) for i in (0, 1) for k, a in piece[i].items()] + [True]))
    return net.loss.value(logits, targets, alpha), same


def derivatives(point, grads: dict, *, dx=None, key=None, names=None, measured=None, factor: float = tol.FD_FACTOR,
                progress: bool = False) -> list[FDRow]:
    """One `row` per node in `names` (default: all, then "input" when `dx` is given and the
    point's input gradient is the real net's): D(h) along a random unit direction (drawn on the
    host from `key`) against ⟨rendered node, v⟩ (grads, dx), scaled by the oracle's, at the
    `best_step` from FD_STEP (or twice the last node's: a point's nodes keep to similar radii), each
    end one probe from the node's stage on. point: `tie.Point`, read at its float64 widening.
    measured: the oracle and envelope (`tie.Measured`: the scale's reference, the loss's round-off
    ε_L = `Envelope.loss`, the input model), default the point's own. progress: a bar."""
    net, cfg = point.net, point.cfg
    measured = point.measured if measured is None else measured
    _, reference_grads, dx_ref = measured.reference
    loss_roundoff = measured.envelope.loss
    real_input = dx is not None and measured.input_model == "real"   # no input row at a tie frozen at σ
    names = list(point.params) + (["input"] if real_input else []) if names is None else list(names)
    params, x, t = point.wide
    alpha = jnp.float64(point.alpha)
    stage_list = net.stage_list(cfg)
    # a probe starts at the first stage or one that is not an identity block (ResNet-34: stem, the
    # downsample blocks, head): one compiled probe each; every stage would save a third of the
    # forwards and cost three times the compilation
    starts = [i for i, stage in enumerate(stage_list) if i == 0 or stage.kind != "identity"]
    entry_of = {p: max(e for e in starts if e <= i) for i, stage in enumerate(stage_list) for p in stage.params}
    entry_of["input"] = 0
    missing = [n for n in names if n not in entry_of]
    if missing:
        raise ValueError(f"fd.derivatives: {missing} are not parameters of any stage of {net.name}")
    if "input" in names and not real_input:
        raise ValueError("fd.derivatives: the input row needs dx, at a point whose input gradient is the real net's")
    _, saved, inputs = rendered.forward(net, params, x, cfg)   # the tie's and the census's program
    here = piece_of(net, saved)
    rendered_of, reference_of = dict(grads, input=dx), dict(reference_grads, input=dx_ref)
    gnorm = max(float(np.linalg.norm(np.asarray(g))) for g in reference_grads.values())
    rows, h, rng = [], tol.FD_STEP, prng.host_rng(key)
    for name in bar(names, desc="finite differences", enabled=progress):
        start, base = entry_of[name], np.asarray(x if name == "input" else params[name])
        v = rng.standard_normal(base.shape)
        v = v / np.linalg.norm(v)

        def end(step):   # θ + step·v on the host: no compiled program per node shape
            moved = to_device(base + step * v)
            p, y = ((params, moved) if name == "input" else
                    (dict(params, **{name: moved}), inputs[stage_list[start].name]))
            loss, same = jax.device_get(_suffix_probe(net, start, p, y, cfg, t, alpha, here))
            return float(loss), bool(same)

        step = best_step(KnownPiece(end), min(tol.FD_STEP, 2 * h), roundoff=loss_roundoff)
        h = step.h
        dot, ref = (float(np.vdot(np.asarray(g[name], np.float64), v)) for g in (rendered_of, reference_of))
        rows.append(row(name, step, dot, ref, floor=tol.ZERO_NODE_FLOOR * gnorm, factor=factor))
    return rows


# ---- paths through the parameters; the loss and Taylor coefficients along them -------------------

def direction(params: dict, names: Sequence[str], key) -> dict:
    """A random direction in the named parameters (zero elsewhere), unit Euclidean norm overall."""
    v = {name: prng.normal(jax.random.fold_in(key, i), params[name].shape, params[name].dtype)
         for i, name in enumerate(names)}
    norm = jnp.sqrt(sum(jnp.sum(a * a) for a in v.values()))
    return {name: (v[name] / norm if name in v else jnp.zeros_like(p)) for name, p in params.items()}


class Path(NamedTuple):
    """θ(t) = θ + t·v + t²·w; v and w hold every parameter (zero outside the moving ones; w = 0 on
    a straight walk, so one compiled program walks both kinds)."""
    v: dict
    w: dict
    names: tuple[str, ...]
    kind: str = "straight"    # or "curved"

    def at(self, params: dict, t, names: Optional[Sequence[str]] = None) -> dict:
        """θ(t) for the named parameters (all moving ones by default), the others as they are."""
        names = self.names if names is None else names
        return dict(params, **_moved({n: params[n] for n in names}, self.v, self.w, t))


def make_path(params, names: Sequence[str], key, *, curved: bool = False, curvature: float = 1.0) -> Path:
    """v = `direction(params, names, key)`; curved: w = curvature · an independent one."""
    if not names or any(n not in params for n in names):
        raise ValueError(f"make_path: names must be parameters, got {list(names)}")
    v = direction(params, names, key)
    w = direction(params, names, jax.random.fold_in(key, 10_000)) if curved else v
    w = jax.tree.map(lambda a: curvature * a if curved else jnp.zeros_like(a), w)
    return Path(v, w, tuple(names), "curved" if curved else "straight")


def _moved(params, v, w, t) -> dict:
    return {k: params[k] + t * v[k] + (t * t) * w[k] for k in params}


def path_losses(net, params, x, targets, cfg, path: Path, ts, *, label_smoothing: float = 0.0) -> np.ndarray:
    """S(t), the net's own loss (`loss.value` of its forward), at θ(t) for each t: one compiled
    program (`taylor` to order 0), shared by every path and every t. targets: labels [N] or rows [N,K]."""
    cfg = net.cfg(cfg)
    at = Point(net, cfg, params, x, targets_matrix(targets, cfg.num_classes, x.dtype), label_smoothing)
    return np.array([float(taylor(at, path, 0, "loss", jnp.asarray(t, x.dtype))[0]) for t in ts])


def taylor(point: Point, path: Path, order: int, read: str, t0=0.0) -> list:
    """[f(t0), f'(t0), …] to the `order`-th derivative along θ(t) = `path` from the point's
    parameters, f the loss at the point's x, targets and α (read="loss"), every ReLU input ("relu")
    or those feeding pools ("pool relu"): `order` nested forward-mode passes through the forward
    (never a backward), in one program. The point may be built directly (`tie.Point(net, cfg,
    params, x, targets)`: no validation); its targets are read only for the loss."""
    alpha = jnp.asarray(point.alpha, point.x.dtype) if read == "loss" else None
    return _taylor(point.net, point.cfg, order, read,
                   (point.params, point.x, path.v, path.w, point.targets if read == "loss" else None, alpha, t0))


# S(t) runs ~130 times per walk, the nested forward-mode programs once: compiled with full optimisation
@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _taylor(net: Net, cfg, order: int, read: str, args: tuple) -> list:
    params, x, v, w, targets, alpha, t0 = args

    def f(t):
        p = _moved(params, v, w, t0 + t)
        if read == "loss":
            return reference.loss_at(net, p, x, targets, cfg, alpha)
        pre = net.preactivations(net.forward(p, x, cfg)[1])
        # only the layers feeding pools: the compiler drops the rest of the net
        return pre if read == "relu" else {k: pre[k] for k in sorted(set(net.pool_preactivations.values()))}

    g = f
    for _ in range(order):
        g = partial(lambda g_, t: reference.jvp(g_, (t,), (jnp.ones((), x.dtype),)), g)
    out = g(jnp.zeros((), x.dtype))
    # the k-th derivative sits k tangent sides deep: (primal, tangent) index 1 at the first k levels
    return [reduce(lambda node, level: node[int(level < k)], range(order), out) for k in range(order + 1)]


# ---- the radius to the first kink ----------------------------------------------------------------

def _first_positive_root(a, b, c) -> np.ndarray:
    """Smallest s > 0 with a·s² + b·s + c = 0, elementwise, for c > 0 (inf where none)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        disc = b * b - 4 * a * c
        sq = np.sqrt(np.maximum(disc, 0.0))
        q = -0.5 * (b + np.copysign(sq, b))                 # the stable pair: q/a and c/q
        r1 = np.where(a != 0, q / a, np.inf)
        r2 = np.where(q != 0, c / q, np.inf)
        roots = np.stack([r1, r2])
        roots = np.where((disc >= 0) & np.isfinite(roots) & (roots > 0), roots, np.inf)
    return roots.min(axis=0)


def first_crossing(g0, g1, g2) -> float:
    """The smallest |t| at which some gap g0 + g1·t + g2·t² (g0 > 0) reaches 0, either sign of t."""
    g0, g1, g2 = (np.asarray(a, np.float64) for a in (g0, g1, g2))
    keep = g0 > 0
    if not keep.any():
        return np.inf
    g0, g1, g2 = g0[keep], g1[keep], g2[keep]
    return float(min(np.min(_first_positive_root(g2, g1, g0)), np.min(_first_positive_root(g2, -g1, g0))))


def radii(net, params, x, cfg, path: Path, sigma: dict, *, everywhere: bool = True,
          order: int = 2) -> tuple[float, float]:
    """(δ, kinks) along θ(t), each margin followed to `order` in t. Each pool reads relu(z), z the
    pre-activations `net.pool_preactivations` names; a live window (z[σ] > 0, σ its selected cell)
    keeps σ until a competitor's z meets z[σ] (twins, and cells tied with σ now, never do), a dead
    one (z < 0 everywhere) its 0 until a cell other than σ and its twins crosses 0. δ is the smallest
    |t| at which one of these gaps closes; `kinks` the smallest at which a ReLU input crosses 0
    (everywhere=False: those feeding pools only); min(δ, kinks) is the smooth piece's radius."""
    z = [jax.tree.map(np.asarray, a) for a in
         taylor(Point(net, net.cfg(cfg), params, x, None), path, order, "relu" if everywhere else "pool relu")]
    z0, z1, z2 = z[0], z[1], jax.tree.map(lambda a: a / 2 if order > 1 else np.zeros_like(a), z[-1])
    kinks = min((first_crossing(np.abs(z0[k]), np.sign(z0[k]) * z1[k], np.sign(z0[k]) * z2[k]) for k in z0),
                default=np.inf)
    radius = np.inf
    for name, spec in net.pools.items():
        layer = net.pool_preactivations[name]
        zw, z1w, z2w = (maxpool.windows(np.asarray(a[layer]), spec) for a in (z0, z1, z2))
        finite = np.isfinite(zw)                       # the stem pool's −∞ padding is never a competitor
        z1w, z2w = np.where(finite, z1w, 0.0), np.where(finite, z2w, 0.0)
        idx = np.asarray(sigma[name])[..., None]
        other = np.arange(zw.shape[-1]) != idx
        top, t1, t2 = (np.take_along_axis(a, idx, -1) for a in (zw, z1w, z2w))
        live = top > 0
        twin = (zw == top) & (z1w == t1) & (z2w == t2)
        on_live = live & finite & other
        radius = min(radius, first_crossing((top - zw)[on_live], (t1 - z1w)[on_live], (t2 - z2w)[on_live]))
        on_dead = ~live & finite & other & ~twin
        radius = min(radius, first_crossing(-zw[on_dead], -z1w[on_dead], -z2w[on_dead]))
    return radius, kinks
