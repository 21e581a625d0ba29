"""Stage germs: near a smooth point the real loss equals the gather model's along any parameter path.

The Lean suite states one germ per pre-activation of cifar8 (`c8_germ_stageₖ`, k = 1…8): c8Sₖ is
the loss read from the pre-activation c8Zₖ (the output of bnₖ) through the REAL net, c8Gₖ the same
through the gather model (every pool frozen at its selection σ), and along any path through stage
k's weights (convₖ and bnₖ) the two agree near the point. For a path θ(t) = θ + t·v + t²·w in those
weights (w = 0: a straight walk),

    S(t) = loss of the real net at θ(t),    G(t) = the same with every pool frozen at σ(θ),

agree bit for bit for |t| below a radius δ (no window's selection changes), and part beyond it.
The margins predict δ: each window's gap between its selected cell and a competitor (or a dead
window's distance below 0), followed along the path to second order in t (tangents by forward-mode
autodiff of the forward), until it closes. Twins (cells equal for every upstream weight) have equal
values and tangents: their gap never opens, so it never closes.

Central finite differences of S converge to ⟨rendered node, v⟩ = S'(0) while [−h, h] holds no kink:
the error is |S'''(0)|·h²/6 + O(h⁴) plus the round-off of two evaluations over 2h. S''' comes from
autodiff of the forward, so the truncation line is a prediction, not a fit. The round-off level ε_L
of one evaluation is measured independently of the errors judged: the spread of S(0) when the walk's
parameters move by a few ulps (every rounding downstream of the moving layer re-rolls, as it does
between S(h) and S(−h)). A step is evidence when its allowance, truncation plus round-off, pins
⟨g, v⟩ to `GERM_EVIDENCE_REL`; where no step lies between round-off and the first kink the verdict
is "no evidence", never "converges". This is the numeric face of `HasGradAt`.

Any `Net` is walked (a stage, or a BatchNorm layer's pre-activation: `bn3`, `layer2.0.bn1`); S is
its `loss.value` of its forward, the nodes are `gradtie.rendered`'s step of a chain (`rendered_nodes`).
At a non-twin tie (`census.planted_tie`) the germ fails: S and G part at every |t| and the one-sided
slopes of S differ by an amount that does not shrink with h. Shown in: Stage germs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference, rendered
from ..host import to_device
from ..nets.protocol import Net, Pass, as_net, fold_forward
from ..ops import maxpool
from ..progress import bar
from ..tolerances import (GERM_EVIDENCE_REL, GERM_KINK_FLATNESS, GERM_KINK_FRACTION, GERM_KINK_STEPS,
                          GERM_MIN_WINDOW, GERM_PREDICTION_SPAN, GERM_ROUNDOFF_DRAWS, GERM_ROUNDOFF_SIGMAS,
                          GERM_ROUNDOFF_NUDGE, GERM_SHARP_REL, GERM_SLOPE_TOL, GERM_TRUNCATION_REL,
                          GERM_WINDOW_MARGIN)
from . import census
from .envelope import host_rng
from .tie import Chain, targets_matrix

# |t| grid for S vs G: decades, ±t each, evaluated in one vectorised pass (a fixed size: the
# op-by-op programs compile once)
T_GRID = np.logspace(-8, 0, 9)
# refinement of the bracket where S and G part: each round evaluates this many points inside it,
# evenly spaced in log |t|, and keeps the one step where they part: a decade shrinks 10× per round
BISECT_POINTS = 9
# two rounds: the parting radius to within a factor 10^(1/100), 2.3 %
BISECT_ROUNDS = 2
# finite-difference steps: third-decade steps from deep in round-off (ε_L/h ~ 10 at h = 1e-13)
# to well past any kink
H_GRID = np.logspace(-13, -1, 37)
# the eight cifar8 germs, one per pre-activation c8Zₖ (the output of bnₖ)
C8_GERMS = {f"c8Z{k}": f"bn{k}" for k in range(1, 9)}
_S3 = "S'''"   # a column header


# ---- the report -------------------------------------------------------------------------------

@dataclass
class GermReport:
    label: str                     # what the walk is: "c8Z3 straight 0", "stem", …
    germ: str                      # the pre-activation (or stage) whose weights the path moves
    path: str                      # "straight" (θ + t·v) or "curved" (θ + t·v + t²·w)
    params: tuple[str, ...]        # the parameters the path moves
    ts: np.ndarray                 # |t| grid (both signs are evaluated)
    real_minus_gather: np.ndarray  # max over ±t of |S(t) − G(t)|, per |t|
    delta_measured: float          # the smallest |t| on the grid where S ≠ G (inf if none)
    delta_bracket: tuple[float, float]  # after refinement: S = G at the first, S ≠ G at the second
    delta_predicted: float         # the margins' radius (second order along the path)
    kink_radius: float             # the radius before a ReLU input crosses 0 (S and G both kink);
                                   # every ReLU with finite differences, those feeding pools without
    hs: np.ndarray                 # finite-difference steps
    central: np.ndarray            # (S(h) − S(−h)) / 2h per h
    exact: float                   # ⟨rendered node, v⟩ = S'(0) by the chain
    loss: float                    # S(0)
    derivatives: tuple[float, float, float]  # S'(0), S''(0), S'''(0) along the path, by autodiff
    right: np.ndarray              # (S(h) − S(0)) / h per h
    left: np.ndarray               # (S(0) − S(−h)) / h per h
    loss_roundoff: float           # ε_L: the spread of one evaluation's round-off in S (`loss_roundoff`)
    node_scale: float = 1.0        # a control's factor on ⟨rendered node, v⟩ (1: the rendered node)

    # -- S vs G --

    @property
    def parted(self) -> bool:
        return bool(np.isfinite(self.delta_measured))

    @property
    def bit_identical_below(self) -> bool:
        """S = G bit for bit at every grid point below the measured radius (by its definition) and
        at least at the smallest grid point."""
        return bool(self.real_minus_gather[0] == 0.0)

    @property
    def parts_at_smallest(self) -> bool:
        """S ≠ G already at the smallest |t| of the grid: no germ (a non-twin tie)."""
        return bool(self.real_minus_gather[0] != 0.0)

    @property
    def holds(self) -> bool:
        """The germ as a walk shows it: S = G bit for bit near 0 and apart somewhere on the grid."""
        return self.bit_identical_below and self.parted

    @property
    def delta(self) -> float:
        """The parting radius after refinement (geometric middle of the bracket)."""
        lo, hi = self.delta_bracket
        return float(np.sqrt(lo * hi)) if lo > 0 and np.isfinite(hi) else float(hi)

    @property
    def prediction_ratio(self) -> float:
        """δ found / δ predicted: 1 where the margins' model holds up to δ."""
        return self.delta / self.delta_predicted

    @property
    def prediction_consistent(self) -> bool:
        """The margins never promise more than holds: δ predicted is no later than the upper end of
        the bracket where S and G part (up to GERM_SHARP_REL), and the found δ is at most
        GERM_PREDICTION_SPAN times the prediction."""
        return bool(self.delta_predicted <= self.delta_bracket[1] * (1 + GERM_SHARP_REL)
                    and self.delta <= self.delta_predicted * GERM_PREDICTION_SPAN)

    @property
    def sharp(self) -> bool:
        """δ found agrees with the prediction to GERM_SHARP_REL."""
        return bool(abs(self.prediction_ratio - 1) <= GERM_SHARP_REL)

    # -- finite differences --

    @property
    def has_fd(self) -> bool:
        return bool(self.hs.size)

    @property
    def node(self) -> float:
        """The directional derivative judged: ⟨rendered node, v⟩, times a control's factor."""
        return self.node_scale * self.exact

    @property
    def fd_errors(self) -> np.ndarray:
        return np.abs(self.central - self.node)

    @property
    def smooth_radius(self) -> float:
        """Inside this radius no ReLU input crosses 0 and no pool selection changes (by the margins'
        model, and below the found δ): S is smooth on [−h, h] for h below it."""
        return float(min(self.kink_radius, self.delta_predicted, self.delta_bracket[0]))

    def truncation(self, h) -> np.ndarray:
        """The predicted truncation error |S'''(0)|·h²/6 of the central difference."""
        return abs(self.derivatives[2]) * np.asarray(h) ** 2 / 6

    def roundoff_term(self, h) -> np.ndarray:
        """The round-off allowance of a central difference at step h: (e(h) − e(−h))/2h has spread
        ε_L/(√2·h), and we allow GERM_ROUNDOFF_SIGMAS of it."""
        return GERM_ROUNDOFF_SIGMAS * self.loss_roundoff / (np.sqrt(2) * np.asarray(h))

    def allowance(self, h) -> np.ndarray:
        """What a correct node's central difference may differ by: truncation (with its relative
        tolerance) plus round-off."""
        return (1 + GERM_TRUNCATION_REL) * self.truncation(h) + self.roundoff_term(h)

    @property
    def judged(self) -> np.ndarray:
        """Steps inside GERM_KINK_FRACTION of the smooth radius: [−h, h] is one smooth piece."""
        return self.hs < GERM_KINK_FRACTION * self.smooth_radius

    @property
    def evidence(self) -> np.ndarray:
        """Judged steps whose allowance pins the node to GERM_EVIDENCE_REL of its size."""
        return self.judged & (self.allowance(self.hs) <= GERM_EVIDENCE_REL * abs(self.node))

    @property
    def roundoff_edge(self) -> float:
        """The step below which round-off alone exceeds GERM_EVIDENCE_REL·|node|: evidence lies
        between this and GERM_KINK_FRACTION × the smooth radius."""
        return float(self.roundoff_term(1.0) / (GERM_EVIDENCE_REL * abs(self.node)))

    @property
    def resolution(self) -> float:
        """The best relative pin on the node any judged step gives: min allowance / |node|."""
        j = self.judged
        return float(np.min(self.allowance(self.hs[j])) / abs(self.node)) if j.any() and self.node else np.inf

    @property
    def violations(self) -> np.ndarray:
        """Judged steps where the error exceeds the allowance."""
        return self.judged & (self.fd_errors > self.allowance(self.hs))

    @property
    def fd_window(self) -> np.ndarray:
        """Judged steps where the O(h²) truncation must show: predicted at least GERM_WINDOW_MARGIN
        times above the round-off allowance."""
        return self.judged & (self.truncation(self.hs) >= GERM_WINDOW_MARGIN * self.roundoff_term(self.hs))

    @property
    def has_window(self) -> bool:
        return int(self.fd_window.sum()) >= GERM_MIN_WINDOW

    @property
    def fd_slope(self) -> float:
        """Log-log slope of the FD error over the window (nan without one)."""
        w = self.fd_window
        if int(w.sum()) < GERM_MIN_WINDOW:
            return float("nan")
        return float(np.polyfit(np.log(self.hs[w]), np.log(self.fd_errors[w]), 1)[0])

    @property
    def truncation_ratios(self) -> np.ndarray:
        """|FD error| / (|S'''|·h²/6) over the window: 1 where the O(h²) term is what we see."""
        w = self.fd_window
        return self.fd_errors[w] / self.truncation(self.hs[w])

    @property
    def fd_verdict(self) -> str:
        """"converges": every judged step within its allowance, at least one of them evidence, and
        on the O(h²) window (if any) the error IS the predicted truncation; "fails": a judged step
        beyond its allowance, or the window off its line; "no evidence": no step between round-off
        and the first kink; "kink at t = 0": the one-sided slopes differ at every small step."""
        if not self.has_fd:
            return "no finite differences"
        if self.violations.any():
            return "fails"
        if not self.evidence.any():
            return "no evidence"
        if self.has_window and not (np.all(np.abs(self.truncation_ratios - 1) <= GERM_TRUNCATION_REL)
                                    and abs(self.fd_slope - 2) <= GERM_SLOPE_TOL):
            return "fails"
        if self.kinked:
            return "kink at t = 0"
        return "converges"

    @property
    def fd_converges(self) -> bool:
        return self.fd_verdict == "converges"

    def judged_against(self, scale: float, label: Optional[str] = None) -> "GermReport":
        """The same walk with the node claimed to be `scale`·⟨rendered node, v⟩: a planted wrong
        gradient (2: doubled, 0: dropped) that the finite differences must reject."""
        return replace(self, node_scale=float(scale), label=label or f"{self.label} (node ×{scale:g})")

    # -- one-sided slopes --

    @property
    def jumps(self) -> np.ndarray:
        """|right − left| per h: |S''|·h + round-off where S is smooth, a constant at a kink."""
        return np.abs(self.right - self.left)

    @property
    def jump_flatness(self) -> float:
        """max / min of the one-sided jump over GERM_KINK_STEPS: ≈ 1 at a kink, ≫ 1 where S is smooth."""
        lo, hi = GERM_KINK_STEPS
        sel = (self.hs >= lo * (1 - 1e-9)) & (self.hs <= hi * (1 + 1e-9))
        j = self.jumps[sel]
        return float(np.max(j) / np.min(j)) if j.size and np.min(j) > 0 else np.inf

    @property
    def kinked(self) -> bool:
        """The one-sided slopes differ by the same amount at every small step: S has a kink at 0."""
        return self.jump_flatness <= GERM_KINK_FLATNESS

    def summary(self) -> str:
        if not self.parted:
            head_ = f"{self.label}: S = G bit for bit on the whole grid"
        elif self.parts_at_smallest:
            head_ = f"{self.label}: S ≠ G already at |t| = {self.ts[0]:.0e} (no germ)"
        else:
            head_ = (f"{self.label}: S = G bit for bit below |t| = {self.delta:.2e} "
                     f"(predicted {self.delta_predicted:.2e})")
        line = f"{head_}; first ReLU kink {self.kink_radius:.1e}"
        if not self.has_fd:
            return line
        return f"{line}; finite differences: {self.fd_verdict}"


# ---- the path and the losses along it -----------------------------------------------------------

def stage_parameters(net, stage: str, params: dict, cfg=None) -> tuple[str, ...]:
    """The parameter names a stage owns, read off the net's stage list."""
    net = as_net(net)
    listed = {s.name: s for s in net.stage_list(net.cfg(cfg))}
    if stage not in listed:
        raise ValueError(f"unknown stage {stage!r} of {net.name}; stages: {list(listed)}")
    return tuple(n for n in listed[stage].params if n in params)


def walk_parameters(net, where: str, params: dict, cfg=None) -> tuple[str, tuple[str, ...]]:
    """(stage, names) for a walk: `where` is a stage ("stage2", "stem": all its weights) or a
    pre-activation ("bn3": the conv→BN pair that writes it, conv3.* and bn3.*, as `c8_germ_stage₃`
    moves; "layer2.0.bn1": layer2.0.conv1.* and layer2.0.bn1.*)."""
    net = as_net(net)
    cfg = net.cfg(cfg)
    stages = net.stage_list(cfg)
    if where in {s.name for s in stages}:
        return where, stage_parameters(net, where, params, cfg)
    prefix, _, layer = where.rpartition(".")
    if layer.startswith("bn"):
        conv_name = f"{prefix}.conv{layer[2:]}" if prefix else f"conv{layer[2:]}"
        for st in stages:     # in the stage's own (signature) order
            names = tuple(n for n in st.params if n in params and n.startswith((f"{conv_name}.", f"{where}.")))
            if names:
                return st.name, names
    raise ValueError(f"unknown walk {where!r} of {net.name}: expected a stage "
                     f"({', '.join(s.name for s in stages)}) or a pre-activation such as 'bn1'")


class Path(NamedTuple):
    """θ(t) = θ + t·v + t²·w; v and w hold every parameter (zero outside the moving ones)."""
    v: dict
    w: Optional[dict]     # None: a straight walk
    names: tuple[str, ...]

    @property
    def kind(self) -> str:
        return "straight" if self.w is None else "curved"

    @property
    def curvature(self) -> dict:
        """w, or zeros for a straight walk: one compiled program walks both kinds."""
        return jax.tree.map(jnp.zeros_like, self.v) if self.w is None else self.w

    def at(self, params: dict, t, names: Optional[Sequence[str]] = None) -> dict:
        """θ(t) for the named parameters (all moving ones by default), the others as they are."""
        names = self.names if names is None else names
        if self.w is None:
            return dict(params, **{n: params[n] + t * self.v[n] for n in names})
        return dict(params, **{n: params[n] + t * self.v[n] + (t * t) * self.w[n] for n in names})


def make_path(params, names: Sequence[str], key, *, curved: bool = False, curvature: float = 1.0) -> Path:
    """A random unit direction v in the named parameters (`census.direction`: zero elsewhere);
    curved: w = curvature · (an independent unit direction in the same parameters)."""
    missing = [n for n in names if n not in params]
    if missing or not names:
        raise ValueError(f"make_path: names must be parameters, got {list(names)} (missing {missing})")
    v = census.direction(params, names, key)
    if not curved:
        return Path(v, None, tuple(names))
    w = census.direction(params, names, jax.random.fold_in(key, 10_000))
    return Path(v, jax.tree.map(lambda a: curvature * a, w), tuple(names))


def _moved(params, v, w, t) -> dict:
    return {k: params[k] + t * v[k] + (t * t) * w[k] for k in params}


# evaluated ~130 times per walk: compiled with full optimisation (it pays for itself)
@partial(jax.jit, static_argnums=(0, 6))
def _loss_at(net: Net, params, v, w, x, targets, cfg, t, alpha):
    return reference.loss_at(net, _moved(params, v, w, t), x, targets, cfg, alpha)


def path_losses(net, params, x, targets, cfg, path: Path, ts, *, label_smoothing: float = 0.0) -> np.ndarray:
    """S(t), the net's own loss (`loss.value` of its forward), at θ(t) for each t: one compiled
    program, shared by every path and every t."""
    net = as_net(net)
    targets = targets_matrix(targets, net.cfg(cfg).num_classes, x.dtype)
    alpha, w = jnp.asarray(label_smoothing, x.dtype), path.curvature
    return np.array([float(_loss_at(net, params, path.v, w, x, targets, cfg, jnp.asarray(t, x.dtype), alpha))
                     for t in ts])


# Forward-mode Taylor coefficients along the path: the walk's oracle side, and this module's only
# autodiff (as `census.kink_radius`'s tangents are). It differentiates the forward, never a backward.
def _tangent(g, one, t):
    return reference.jvp(g, (t,), (one,))


def _taylor(f, zero, order: int) -> list:
    """[f(0), f'(0), …] up to the `order`-th derivative of a function of one scalar: `order` nested
    forward-mode passes, one program (the k-th derivative sits k tangent sides deep)."""
    g = f
    for _ in range(order):
        g = partial(_tangent, g, jnp.ones_like(zero))
    out = g(zero)

    def pick(k):
        node = out
        for level in range(order):
            node = node[1 if level < k else 0]
        return node
    return [pick(k) for k in range(order + 1)]


# run once per walk, but their nested forward-mode programs are slow without optimisation
@partial(jax.jit, static_argnums=(0, 6))
def _derivatives(net: Net, params, v, w, x, targets, cfg, alpha):
    """S', S'', S''' at t = 0 along θ(t), by nested forward mode through the real loss."""
    def s(t):
        return reference.loss_at(net, _moved(params, v, w, t), x, targets, cfg, alpha)
    return _taylor(s, jnp.zeros((), x.dtype), 3)[1:]


def loss_roundoff(net, params, x, targets, cfg, path: Path, *, key, label_smoothing: float = 0.0,
                  draws: int = GERM_ROUNDOFF_DRAWS, nudge: float = GERM_ROUNDOFF_NUDGE) -> tuple[float, np.ndarray]:
    """ε_L, the spread of one evaluation's round-off in S, and the deviations it is read from.

    For each draw, a random nudge δ of the path's own parameters (each entry times nudge·ξ, ξ
    standard normal drawn on the host from `key`): d = (S(θ + δ) + S(θ − δ))/2 − S(θ). The
    first-order change cancels between ±δ and the second order, δᵀ∇²Lδ, sits far below round-off,
    while every rounding downstream of the moving weights re-rolls, as between S(h) and S(−h): d is
    round-off alone, and its root mean square over the draws, over √(3/2), is the spread of one
    evaluation's error. Measured on the same compiled program the finite differences use, and with
    no reference to the node they judge. (Not `checks.envelope`'s largest distance from a float64
    reference: the spread of S's own round-off at θ, which a central difference divides by h.)
    """
    net = as_net(net)
    targets = targets_matrix(targets, net.cfg(cfg).num_classes, x.dtype)
    alpha, zero, w = jnp.asarray(label_smoothing, x.dtype), jnp.zeros((), x.dtype), path.curvature

    def s(p):
        return float(_loss_at(net, p, path.v, w, x, targets, cfg, zero, alpha))

    s0, rng = s(params), host_rng(key)
    host = {n: np.asarray(params[n]) for n in path.names}
    devs = []
    for _ in range(draws):
        delta = {n: a * nudge * rng.standard_normal(a.shape) for n, a in host.items()}
        up, down = (dict(params, **{n: to_device(a + sign * delta[n], a.dtype) for n, a in host.items()})
                    for sign in (1, -1))
        devs.append((s(up) + s(down)) / 2 - s0)
    devs = np.array(devs)
    # each d carries e(θ+δ)/2 + e(θ−δ)/2 − e(θ): spread √(3/2)·σ for an evaluation error of spread σ;
    # never below half an ulp of S(0), the loss's own last rounding
    sigma = float(np.sqrt(np.mean(devs ** 2) / 1.5))
    return max(sigma, float(np.spacing(abs(s0))) / 2), devs


def selections(net, params, x, cfg) -> dict:
    """σ = argmax (the first maximal cell) for every pool, read from the pool inputs at θ: the
    census's forward program, and the windows on the host, as the census reads them."""
    net = as_net(net)
    _, saved, _ = rendered.forward(net, params, x, cfg)
    return {name: to_device(np.argmax(maxpool.windows(np.asarray(r), net.pools[name]), axis=-1))
            for name, r in net.pool_inputs(saved).items()}


@partial(jax.jit, static_argnums=(0, 3, 6))
def _read_taylor(net: Net, params, x, cfg, v, w, everywhere: bool):
    """z(0), z'(0) and z''(0)/2 along θ(t) for every ReLU input (or those feeding pools)."""
    feeding = sorted(set(net.pool_preactivations.values()))

    def read(t):
        _, saved = net.forward(_moved(params, v, w, t), x, cfg)
        pre = net.preactivations(saved)
        # only the layers feeding pools: the compiler drops the rest of the net
        return pre if everywhere else {k: pre[k] for k in feeding}

    z0, z1, z2 = _taylor(read, jnp.zeros((), x.dtype), 2)
    return z0, z1, jax.tree.map(lambda a: a / 2, z2)


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


def predicted_radius(net, params, x, cfg, path: Path, sigma: dict, *,
                     kinks_everywhere: bool = True) -> tuple[float, float]:
    """The radii (pool δ, ReLU kinks) along θ(t), each margin followed to second order in t.

    Each pool reads relu(z), z the pre-activations `net.pool_preactivations` names. Per window,
    with σ its selected cell:

    - live (z[σ] > 0): σ stays the maximum until a competitor's z meets z[σ]: the gap
      z[σ] − z_c closes. (z[σ] itself falling below 0 changes nothing: the window turns dead, pool
      and gather both read 0.) Twins have equal values and tangents: their gap is 0 and stays 0.
    - dead (z < 0 everywhere): the pooled 0 holds until a cell other than σ (and not σ's twin)
      crosses 0. (σ crossing 0 makes it the window's maximum: still σ.)

    δ is the smallest |t| at which one of these closes; the kink radius is the smallest |t| at which
    a ReLU input of the net crosses 0 (with `kinks_everywhere=False`, those feeding pools only).
    """
    net = as_net(net)
    taylor = _read_taylor(net, params, x, net.cfg(cfg), path.v, path.curvature, kinks_everywhere)
    z0, z1, z2 = (jax.tree.map(np.asarray, a) for a in taylor)
    kinks = np.inf
    for layer in z0:
        s = np.sign(z0[layer])
        kinks = min(kinks, first_crossing(np.abs(z0[layer]), s * z1[layer], s * z2[layer]))
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


def rendered_nodes(net, params, x, targets, cfg, label_smoothing: float = 0.0, *,
                   chain: Optional[Chain] = None) -> dict:
    """The rendered parameter nodes at θ: the one rendered step (`gradtie.rendered`) of `chain`
    (default: the net's own, through the real kit), from its loss's own cotangent. A planted chain
    (`checks.bugs.plant`) gives its planted nodes; the finite differences must reject them."""
    net = as_net(net)
    chain = chain or Chain(net)
    return rendered.run(chain.net, chain.kit, params, x, targets, net.cfg(cfg), alpha=label_smoothing,
                        how="quick").grads


# ---- S vs G, bit for bit ------------------------------------------------------------------------
#
# Both losses are evaluated in three parts: the stages before the moving one (they do not depend on
# t: their output is the moving stage's input, read once off the census's forward), then the moving
# stage up to the last stage holding a pool, op by op, real or gathered (a fused graph may contract
# or reassociate differently around a max pool and a gather, and "bit for bit" must compare the
# maths, not two compilations), then the rest of the net and the loss as ONE compiled program
# applied to both: it returns equal bits for equal inputs. Every t of a grid runs in one vectorised
# pass (vmap over t): the same primitives for S and G, row by row, and a fixed number of rows, so
# the op-by-op programs compile once.


def pool_stages(net, cfg, saved) -> list[int]:
    """Indices in the stage list of the stages that hold a pool (their saved record has pool
    inputs). saved: the forward's record, arrays or `jax.eval_shape` structs."""
    net = as_net(net)
    return [i for i, st in enumerate(net.stage_list(net.cfg(cfg))) if st.pool_inputs(saved[st.name])]


class _Plan(NamedTuple):
    start: int          # the moving stage's index
    stop: int           # one past the last stage holding a pool: op by op up to here
    y0: jax.Array       # the moving stage's input (independent of t)


def _plan(net: Net, params, x, cfg, stage: str) -> _Plan:
    names = [st.name for st in net.stage_list(cfg)]
    if stage not in names:
        raise ValueError(f"unknown stage {stage!r} of {net.name}; stages: {names}")
    k = names.index(stage)
    _, saved, inputs = rendered.forward(net, params, x, cfg)
    pools = [i for i in pool_stages(net, cfg, saved) if i >= k]
    return _Plan(k, (max(pools) if pools else k) + 1, inputs[stage])


# once per grid or refinement round: compile-bound, so LLVM's optimisation is off (no IEEE result
# changes: S and G share this program)
@partial(jax.jit, static_argnums=(0, 1, 3), compiler_options=rendered.QUICK)
def _tail_losses(net: Net, start: int, params, cfg, moved, ys, targets, alpha):
    """The loss from stage `start` on, per row of ys (and of the moved parameters, if any)."""
    tail = net.stage_list(cfg)[start:]

    def one(m, y):
        logits, _ = fold_forward(tail, dict(params, **m), y, cfg)
        return net.loss.value(logits, targets, alpha)
    return jax.vmap(one)(moved, ys)


def split_losses(net, params, x, targets, cfg, path: Path, ts, sigma: dict, *, stage: Optional[str] = None,
                 plan: Optional[_Plan] = None, label_smoothing: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(S(t), G(t)) for each t, the real loss and the gather model's at σ, comparable bit for bit.

    The path moves the parameters of `stage` only (or give the `plan` a previous call made).
    """
    net = as_net(net)
    cfg = net.cfg(cfg)
    if plan is None:
        if stage is None:
            raise ValueError("split_losses: name the stage the path moves (or pass a plan)")
        plan = _plan(net, params, x, cfg, stage)
    stage_list = net.stage_list(cfg)
    middle_stages = stage_list[plan.start:plan.stop]
    middle_names = {n for st in middle_stages for n in st.params}
    outside = [n for n in path.names if n not in middle_names and n not in
               {m for st in stage_list[plan.stop:] for m in st.params}]
    if outside:
        raise ValueError(f"split_losses: the path moves {outside}, upstream of stage {stage_list[plan.start].name}")
    targets = targets_matrix(targets, cfg.num_classes, x.dtype)
    ts = jnp.asarray(np.asarray(ts, np.float64), x.dtype)
    alpha = jnp.asarray(label_smoothing, x.dtype)
    in_middle = tuple(n for n in path.names if n in middle_names)
    in_tail = tuple(n for n in path.names if n not in middle_names)

    def middle(t, sel):
        y, _ = fold_forward(middle_stages, path.at(params, t, in_middle), plan.y0, cfg, Pass(selections=sel))
        return y

    moved = jax.vmap(lambda t: {n: path.at(params, t, in_tail)[n] for n in in_tail})(ts)
    out = []
    for sel in (None, sigma):
        with jax.disable_jit():
            ys = jax.vmap(lambda t: middle(t, sel))(ts)
        out.append(np.asarray(_tail_losses(net, plan.stop, params, cfg, moved, ys, targets, alpha)))
    return out[0], out[1]


def _refine(lo: float, hi: float, parted_at) -> tuple[float, float]:
    """BISECT_ROUNDS rounds of BISECT_POINTS log-spaced points inside (lo, hi), keeping the step
    where S and G part; `parted_at(ts)` -> bool per t."""
    for _ in range(BISECT_ROUNDS):
        inner = lo * (hi / lo) ** (np.arange(1, BISECT_POINTS + 1) / (BISECT_POINTS + 1))
        parted = np.nonzero(parted_at(inner))[0]
        if parted.size:
            hi = float(inner[parted[0]])
            lo = float(inner[parted[0] - 1]) if parted[0] > 0 else lo
        else:
            lo = float(inner[-1])
    return lo, hi


def germ(net, params, x, targets, cfg, grads: Optional[dict], where: str, *, key, curved: bool = False,
         ts: Optional[np.ndarray] = None, hs: Optional[np.ndarray] = None, label_smoothing: float = 0.0,
         label: Optional[str] = None) -> GermReport:
    """Walk a random path through one germ's weights: S vs G, δ found and predicted, FD convergence.

    `where` names the walk: a pre-activation ("bn3": conv3 and bn3 move, as `c8_germ_stage₃` says)
    or a whole stage ("stage2", "stem"). A straight walk is θ + t·v, v a random unit direction; a
    curved one θ + t·v + t²·w, |w| = 1/δ₀ with δ₀ the straight walk's predicted radius, so the path
    bends as much as it moves at the germ's own scale. `grads` are the rendered nodes at θ
    (`rendered_nodes`); FD compares against ⟨grads, v⟩ (grads=None skips the finite differences).
    targets: int labels [N] or rows [N,K].
    """
    net = as_net(net)
    cfg = net.cfg(cfg)
    stage, names = walk_parameters(net, where, params, cfg)
    ts = T_GRID if ts is None else np.asarray(ts, np.float64)
    hs = H_GRID if hs is None else np.asarray(hs, np.float64)
    if x.dtype != params[names[0]].dtype:
        raise ValueError(f"germ: x is {x.dtype} but the parameters are {params[names[0]].dtype}; "
                         f"cast both to one dtype")
    targets = targets_matrix(targets, cfg.num_classes, x.dtype)
    sigma = selections(net, params, x, cfg)
    path = make_path(params, names, key)
    if curved:
        straight_delta, _ = predicted_radius(net, params, x, cfg, path, sigma, kinks_everywhere=False)
        path = make_path(params, names, key, curved=True, curvature=1.0 / straight_delta)
    plan = _plan(net, params, x, cfg, stage)

    def diff_at(tt):     # max over ±t of |S(t) − G(t)| for each t (2·len(tt) rows in one pass)
        real, gath = split_losses(net, params, x, targets, cfg, path, np.concatenate([tt, -tt]), sigma, plan=plan,
                                  label_smoothing=label_smoothing)
        return np.max(np.abs(real - gath).reshape(2, -1), axis=0)

    diff = diff_at(ts)
    parted = np.nonzero(diff != 0)[0]
    measured = float(ts[parted[0]]) if parted.size else np.inf
    if not parted.size:
        bracket = (float(ts[-1]), np.inf)
    elif parted[0] == 0:
        bracket = (0.0, float(ts[0]))
    else:
        bracket = _refine(float(ts[parted[0] - 1]), float(ts[parted[0]]), lambda tt: diff_at(tt) != 0)
    # without finite differences only the pools' own ReLUs matter: a cheaper program
    predicted, kinks = predicted_radius(net, params, x, cfg, path, sigma, kinks_everywhere=grads is not None)
    label = label or f"{where} {path.kind}"
    if grads is None:
        empty = np.zeros(0)
        return GermReport(label, where, path.kind, names, ts, diff, measured, bracket, predicted, kinks, empty,
                          empty, np.nan, np.nan, (np.nan,) * 3, empty, empty, np.nan)
    exact = float(sum(jnp.vdot(grads[n], path.v[n]) for n in names))
    s0, plus, minus = (path_losses(net, params, x, targets, cfg, path, tt, label_smoothing=label_smoothing)
                       for tt in ([0.0], hs, -hs))
    derivs = tuple(float(d) for d in _derivatives(net, params, path.v, path.curvature, x, targets, cfg,
                                                   jnp.asarray(label_smoothing, x.dtype)))
    eps_l, _ = loss_roundoff(net, params, x, targets, cfg, path, key=jax.random.fold_in(key, 20_000),
                             label_smoothing=label_smoothing)
    return GermReport(label, where, path.kind, names, ts, diff, measured, bracket, predicted, kinks, hs,
                      (plus - minus) / (2 * hs), exact, float(s0[0]), derivs, (plus - s0[0]) / hs,
                      (s0[0] - minus) / hs, eps_l)


# ---- a point where the first kink is close -----------------------------------------------------

def near_kink(net, params, x, cfg, where: str, *, key, radius: float) -> dict:
    """params with one BN shift β moved so that a ReLU input of `where` (a pre-activation such as
    "bn3") reaches 0 at |t| ≈ `radius` along the straight walk `germ(..., where, key=key)` takes.

    The cell chosen is the one nearest its kink along that walk; its channel's β moves by the
    cell's distance to radius·|dz/dt| (on its own side of 0), so no other cell of the channel
    crosses. A control: with the first kink closer than round-off allows a step, the finite
    differences must say "no evidence".
    """
    net = as_net(net)
    cfg = net.cfg(cfg)
    _, names = walk_parameters(net, where, params, cfg)
    if f"{where}.bias" not in params:
        raise ValueError(f"near_kink: {where!r} must name a BatchNorm layer of {net.name} (its shift "
                         f"{where}.bias moves)")
    path = make_path(params, names, key)
    z0, z1, _ = _read_taylor(net, params, x, cfg, path.v, path.curvature, True)
    z, dz = np.asarray(z0[where]), np.asarray(z1[where])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(dz != 0, np.abs(z) / np.abs(dz), np.inf)
    cell = np.unravel_index(np.argmin(ratio), z.shape)
    target = np.sign(z[cell]) * radius * abs(dz[cell])
    beta = np.asarray(params[f"{where}.bias"]).copy()
    beta[cell[1]] += target - z[cell]
    return dict(params, **{f"{where}.bias": to_device(beta, params[f"{where}.bias"].dtype)})


# ---- many germs, many directions ----------------------------------------------------------------

@dataclass
class GermSurvey:
    reports: list[GermReport]

    @property
    def germs_hold(self) -> bool:
        """Every walk: S = G bit for bit at the small |t| and apart somewhere on the grid."""
        return all(r.holds for r in self.reports)

    @property
    def predictions_hold(self) -> bool:
        return all(r.prediction_consistent for r in self.reports)

    @property
    def fd_converges(self) -> bool:
        return all(r.fd_converges for r in self.reports if r.has_fd)

    @property
    def windows(self) -> list[GermReport]:
        return [r for r in self.reports if r.has_window]

    def radii_table(self) -> str:
        head_ = (f"{'walk':<20} {'S = G below':>11} {'δ found':>9} {'predicted':>9} {'ratio':>6} "
                 f"{'first kink':>10}")
        lines = [head_]
        for r in self.reports:
            lines.append(f"{r.label:<20} {r.delta_bracket[0]:11.2e} {r.delta:9.2e} {r.delta_predicted:9.2e} "
                         f"{r.prediction_ratio:6.3f} {r.kink_radius:10.1e}")
        return "\n".join(lines)

    def fd_table(self) -> str:
        head_ = (f"{'walk':<20} {'⟨g, v⟩':>10} {_S3:>9} {'ε_L':>8} {'evidence':>17} {'resolves':>9} "
                 f"{'slope':>6}  verdict")
        lines = [head_]
        for r in self.reports:
            if not r.has_fd:
                continue
            ev = r.hs[r.evidence]
            span = f"{ev.min():.0e}…{ev.max():.0e}" if ev.size else "none"
            slope = f"{r.fd_slope:6.2f}" if r.has_window else f"{'–':>6}"
            lines.append(f"{r.label:<20} {r.exact:10.3e} {r.derivatives[2]:9.2e} {r.loss_roundoff:8.1e} "
                         f"{span:>17} {r.resolution:9.1e} {slope}  {r.fd_verdict}")
        return "\n".join(lines)

    def summary(self) -> str:
        n = len(self.reports)
        held = sum(r.holds for r in self.reports)
        pred = sum(r.prediction_consistent for r in self.reports)
        sharp = sum(r.sharp for r in self.reports)
        fd = [r for r in self.reports if r.has_fd]
        conv = sum(r.fd_converges for r in fd)
        return (f"{held}/{n} walks: S = G bit for bit near 0, apart beyond δ\n"
                f"{pred}/{n} predicted δ no later than where S and G part and within "
                f"{GERM_PREDICTION_SPAN:g}× of it; {sharp}/{n} within {GERM_SHARP_REL:.0%}\n"
                f"{conv}/{len(fd)} finite differences converge to the rendered node; "
                f"{len(self.windows)} with an O(h²) window")


DIRECTION_KINDS = ("straight", "curved", "straight")   # per germ: directions cycle through these


def survey(net, params, x, targets, cfg, grads: Optional[dict], germs: dict[str, str], *, key,
           directions: int = 3, progress: bool = False, **kwargs) -> GermSurvey:
    """`germ` for each {label: where} and `directions` paths (cycling straight, curved, straight:
    two directions already walk both kinds; keys folded from `key`). progress: a bar on a terminal's
    stderr (never in a chapter's output)."""
    reports = []
    jobs = [(i, label, where, d) for i, (label, where) in enumerate(germs.items()) for d in range(directions)]
    for i, label, where, d in bar(jobs, desc="germ walks", enabled=progress):
        curved = DIRECTION_KINDS[d % len(DIRECTION_KINDS)] == "curved"
        reports.append(germ(net, params, x, targets, cfg, grads, where, curved=curved,
                            key=jax.random.fold_in(jax.random.fold_in(key, i), d),
                            label=f"{label} {'curved' if curved else 'straight'} {d}", **kwargs))
    return GermSurvey(reports)
