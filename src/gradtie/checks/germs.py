"""Stage germs: near a smooth point the real loss equals the gather model's along any parameter path.

The Lean suite states one germ per pre-activation c8Zₖ of cifar8 (`c8_germ_stageₖ`, k = 1…8): the loss
read from c8Zₖ (bnₖ's output) through the real net, c8Sₖ, equals c8Gₖ, the same through the gather
model, near the point. Along a path θ(t) = θ + t·v + t²·w through convₖ and bnₖ (`fd.Path`),

    S(t) = loss of the real net at θ(t),    G(t) = the same with every pool frozen at σ(θ),

agree bit for bit for |t| below a radius δ (no window's selection changes), and part beyond it;
the window margins, followed to second order in t, predict δ (`fd.radii`). Central differences of
S converge to ⟨rendered node, v⟩ = S'(0) while [−h, h] holds no kink, within a truncation predicted
from S''' (forward mode, not a fit) plus a round-off ε_L measured apart from the errors judged; a
step whose allowance pins ⟨g, v⟩ to GERM_EVIDENCE_REL is evidence, and with none between round-off
and the first kink the verdict is "no evidence", never "converges": the numeric face of `HasGradAt`.

Any `Net` is walked (a stage, or a BatchNorm layer's pre-activation: `bn3`, `layer2.0.bn1`); the
nodes are `gradtie.rendered`'s step of a chain (`rendered_nodes`). At a non-twin tie
(`census.planted_tie`) the germ fails: S and G part at every |t| and the one-sided slopes of S
differ by an amount that does not shrink with h (`fd.kinked`). Shown in: Stage germs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng, rendered
from ..host import to_device
from ..nets.protocol import Net, Pass, fold_forward
from ..progress import bar
from ..tolerances import (GERM_EVIDENCE_REL, GERM_KINK_FRACTION, GERM_KINK_STEPS, GERM_MIN_WINDOW,
                          GERM_PREDICTION_SPAN, GERM_ROUNDOFF_DRAWS, GERM_ROUNDOFF_SIGMAS, GERM_ROUNDOFF_NUDGE,
                          GERM_SHARP_REL, GERM_SLOPE_TOL, GERM_TRUNCATION_REL, GERM_WINDOW_MARGIN)
from . import census, fd
from .tie import Chain, Point, targets_matrix

# |t| grid for S vs G: decades, ±t each, in one vectorised pass (a fixed size: the programs compile once)
T_GRID = np.logspace(-8, 0, 9)
# refining where S and G part: each round keeps the step where they part among 9 log-spaced points
# (a decade shrinks 10×); two rounds give the parting radius to within a factor 10^(1/100), 2.3 %
BISECT_POINTS, BISECT_ROUNDS = 9, 2
# finite-difference steps: third decades from deep in round-off (ε_L/h ~ 10 at h = 1e-13) past any kink
H_GRID = np.logspace(-13, -1, 37)
# the eight cifar8 germs, one per pre-activation c8Zₖ (the output of bnₖ)
C8_GERMS = {f"c8Z{k}": f"bn{k}" for k in range(1, 9)}
DIRECTION_KINDS = ("straight", "curved", "straight")   # per germ: directions cycle through these
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
    kink_radius: float             # before a ReLU input crosses 0 (with FD every ReLU, else those feeding pools)
    hs: np.ndarray                 # finite-difference steps
    central: np.ndarray            # (S(h) − S(−h)) / 2h per h
    exact: float                   # ⟨rendered node, v⟩ = S'(0) by the chain
    loss: float                    # S(0)
    derivatives: tuple[float, float, float]  # S'(0), S''(0), S'''(0) along the path, by forward mode
    right: np.ndarray              # (S(h) − S(0)) / h per h
    left: np.ndarray               # (S(0) − S(−h)) / h per h
    loss_roundoff: float           # ε_L: the spread of one evaluation's round-off in S (`loss_roundoff`)
    node_scale: float = 1.0        # a control's factor on ⟨rendered node, v⟩ (1: the rendered node)

    # -- S vs G --

    @property
    def parts_at_smallest(self) -> bool:
        """S ≠ G already at the smallest |t| of the grid: no germ (a non-twin tie)."""
        return bool(self.real_minus_gather[0] != 0.0)

    @property
    def holds(self) -> bool:
        """The germ as a walk shows it: S = G bit for bit near 0 and apart somewhere on the grid."""
        return not self.parts_at_smallest and bool(np.isfinite(self.delta_measured))

    @property
    def delta(self) -> float:
        """The parting radius after refinement (geometric middle of the bracket)."""
        lo, hi = self.delta_bracket
        return float(np.sqrt(lo * hi)) if lo > 0 and np.isfinite(hi) else float(hi)

    @property
    def prediction_ratio(self) -> float:
        return self.delta / self.delta_predicted

    @property
    def prediction_consistent(self) -> bool:
        """The margins never promise more than holds: δ predicted is no later than the bracket's
        upper end (up to GERM_SHARP_REL), and δ found is at most GERM_PREDICTION_SPAN × predicted."""
        return bool(self.delta_predicted <= self.delta_bracket[1] * (1 + GERM_SHARP_REL)
                    and self.delta <= self.delta_predicted * GERM_PREDICTION_SPAN)

    @property
    def sharp(self) -> bool:
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
        """No ReLU input crosses 0 and no selection changes inside it (predicted, and below δ found)."""
        return float(min(self.kink_radius, self.delta_predicted, self.delta_bracket[0]))

    def truncation(self, h) -> np.ndarray:
        """The predicted truncation error |S'''(0)|·h²/6 of the central difference."""
        return abs(self.derivatives[2]) * np.asarray(h) ** 2 / 6

    def roundoff_term(self, h) -> np.ndarray:
        """(e(h) − e(−h))/2h has spread ε_L/(√2·h); we allow GERM_ROUNDOFF_SIGMAS of it."""
        return GERM_ROUNDOFF_SIGMAS * self.loss_roundoff / (np.sqrt(2) * np.asarray(h))

    def allowance(self, h) -> np.ndarray:
        """What a correct node's central difference may differ by: truncation (1 + its tolerance) plus round-off."""
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
        """The step below which round-off alone exceeds GERM_EVIDENCE_REL·|node|."""
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
        """Judged steps where the O(h²) truncation must show: at least GERM_WINDOW_MARGIN × round-off."""
        return self.judged & (self.truncation(self.hs) >= GERM_WINDOW_MARGIN * self.roundoff_term(self.hs))

    @property
    def has_window(self) -> bool:
        return int(self.fd_window.sum()) >= GERM_MIN_WINDOW

    @property
    def fd_slope(self) -> float:
        """Log-log slope of the FD error over the window (nan without one)."""
        w = self.fd_window
        return float(np.polyfit(np.log(self.hs[w]), np.log(self.fd_errors[w]), 1)[0]) if self.has_window else np.nan

    @property
    def truncation_ratios(self) -> np.ndarray:
        """|FD error| / (|S'''|·h²/6) over the window: 1 where the O(h²) term is what we see."""
        return self.fd_errors[self.fd_window] / self.truncation(self.hs[self.fd_window])

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
        return "kink at t = 0" if self.kinked else "converges"

    @property
    def fd_converges(self) -> bool:
        return self.fd_verdict == "converges"

    def judged_against(self, scale: float, label: Optional[str] = None) -> "GermReport":
        """The same walk judging `scale`·⟨rendered node, v⟩: a wrong node (2, 0) the FD must reject."""
        return replace(self, node_scale=float(scale), label=label or f"{self.label} (node ×{scale:g})")

    # -- one-sided slopes --

    @property
    def jumps(self) -> np.ndarray:
        """|right − left| per h: |S''|·h + round-off where S is smooth, a constant at a kink."""
        return np.abs(self.right - self.left)

    @property
    def kinked(self) -> bool:
        """The jump is the same at every step of GERM_KINK_STEPS (`fd.kinked`): S has a kink at 0."""
        lo, hi = GERM_KINK_STEPS
        return fd.kinked(self.jumps[(self.hs >= lo * (1 - 1e-9)) & (self.hs <= hi * (1 + 1e-9))])

    def summary(self) -> str:
        if not np.isfinite(self.delta_measured):
            line = "S = G bit for bit on the whole grid"
        elif self.parts_at_smallest:
            line = f"S ≠ G already at |t| = {self.ts[0]:.0e} (no germ)"
        else:
            line = f"S = G bit for bit below |t| = {self.delta:.2e} (predicted {self.delta_predicted:.2e})"
        line = f"{self.label}: {line}; first ReLU kink {self.kink_radius:.1e}"
        return f"{line}; finite differences: {self.fd_verdict}" if self.has_fd else line


# ---- the walk's parameters, its nodes and its round-off -------------------------------------------

def walk_parameters(net, where: str, params: dict, cfg=None) -> tuple[str, tuple[str, ...]]:
    """(stage, names) for a walk: `where` is a stage ("stage2", "stem": all its weights) or a
    pre-activation ("bn3": the conv→BN pair that writes it, conv3.* and bn3.*, as `c8_germ_stage₃`
    moves; "layer2.0.bn1": layer2.0.conv1.* and layer2.0.bn1.*)."""
    stages = net.stage_list(net.cfg(cfg))
    if where in [st.name for st in stages]:
        return where, tuple(n for st in stages if st.name == where for n in st.params if n in params)
    prefix, _, layer = where.rpartition(".")
    conv = f"{prefix}.conv{layer[2:]}." if prefix else f"conv{layer[2:]}."
    for st in stages if layer.startswith("bn") else ():    # in the stage's own (signature) order
        names = tuple(n for n in st.params if n in params and n.startswith((conv, f"{where}.")))
        if names:
            return st.name, names
    raise ValueError(f"unknown walk {where!r} of {net.name}: expected a stage "
                     f"({', '.join(s.name for s in stages)}) or a pre-activation such as 'bn1'")


def rendered_nodes(net, params, x, targets, cfg, label_smoothing: float = 0.0, *,
                   chain: Optional[Chain] = None) -> dict:
    """The rendered parameter nodes at θ: `gradtie.rendered`'s step of `chain` (default: the net's
    own, through the real kit; a planted one, `checks.bugs.plant`, gives nodes FD must reject)."""
    chain = chain or Chain(net)
    return rendered.run(chain.net, chain.kit, params, x, targets, net.cfg(cfg), alpha=label_smoothing,
                        how="quick").grads


def loss_roundoff(point: Point, path: fd.Path, *, key, draws: int = GERM_ROUNDOFF_DRAWS,
                  nudge: float = GERM_ROUNDOFF_NUDGE) -> float:
    """ε_L, the spread of one evaluation's round-off in S (S's own round-off at θ, which a central
    difference divides by h; not `checks.envelope`'s distance from a float64 reference), from draws
    of δ, the path's own parameters nudged by nudge·ξ (ξ standard normal on the host), of
    d = (S(θ + δ) + S(θ − δ))/2 − S(θ): the first order cancels, the second sits far below round-off,
    and every rounding downstream re-rolls, as between S(±h). Read on the program the finite
    differences use, with no reference to the node they judge. The point's targets are rows."""
    net, params, x, targets, cfg = point.net, point.params, point.x, point.targets, point.cfg

    def s(p):
        return float(fd.path_losses(net, p, x, targets, cfg, path, [0.0], label_smoothing=point.alpha)[0])

    s0, rng = s(params), prng.host_rng(key)
    host = {n: np.asarray(params[n]) for n in path.names}
    devs = []
    for _ in range(draws):
        delta = {n: a * nudge * rng.standard_normal(a.shape) for n, a in host.items()}
        up, down = (s(dict(params, **{n: to_device(a + sign * delta[n], a.dtype) for n, a in host.items()}))
                    for sign in (1, -1))
        devs.append((up + down) / 2 - s0)
    # each d carries e(θ+δ)/2 + e(θ−δ)/2 − e(θ): spread √(3/2)·σ for an evaluation error of spread σ;
    # never below half an ulp of S(0), the loss's own last rounding
    return max(float(np.sqrt(np.mean(np.array(devs) ** 2) / 1.5)), float(np.spacing(abs(s0))) / 2)


# ---- S vs G, bit for bit ------------------------------------------------------------------------
#
# Both losses run in three parts: the stages before the moving one (independent of t: the moving
# stage's input, read once off the census's forward); the moving stage up to the last stage holding
# a pool, op by op, real or gathered (a fused graph may reassociate differently around a pool and a
# gather: "bit for bit" compares the maths, not two compilations); the rest of the net and the loss
# as ONE compiled program applied to both. Every t of a grid runs in one vmap: the same primitives
# for S and G, row by row, and a fixed number of rows, so the op-by-op programs compile once.

def _plan(net: Net, params, x, cfg, stage: str) -> tuple[int, int, jax.Array]:
    """(start, stop, y0): the moving stage's index, one past the last stage holding a pool (op by op
    up to there), and the moving stage's input (independent of t)."""
    k = [st.name for st in net.stage_list(cfg)].index(stage)
    _, saved, inputs = rendered.forward(net, params, x, cfg)
    pools = [i for i in census.pool_stages(net, cfg, saved) if i >= k]
    return k, (max(pools) if pools else k) + 1, inputs[stage]


# once per grid or refinement round: compile-bound, so LLVM's optimisation is off (no IEEE result
# changes: S and G share this program)
@partial(jax.jit, static_argnums=(0, 1, 3), compiler_options=rendered.QUICK)
def _tail_losses(net: Net, start: int, params, cfg, moved, ys, targets, alpha):
    """The loss from stage `start` on, per row of ys (and of the moved parameters, if any)."""
    def one(m, y):
        logits, _ = fold_forward(net.stage_list(cfg)[start:], dict(params, **m), y, cfg)
        return net.loss.value(logits, targets, alpha)
    return jax.vmap(one)(moved, ys)


def split_losses(point: Point, path: fd.Path, ts, sigma: dict, *, stage: Optional[str] = None,
                 plan: Optional[tuple] = None) -> tuple[np.ndarray, np.ndarray]:
    """(S(t), G(t)) for each t, the real loss and the gather model's at σ, comparable bit for bit.
    The path moves the parameters of `stage` (or of the `plan` a previous call made) and later ones."""
    net, params, x, targets, cfg = point.net, point.params, point.x, point.targets, point.net.cfg(point.cfg)
    start, stop, y0 = plan or _plan(net, params, x, cfg, stage)
    stage_list = net.stage_list(cfg)
    if any(n in st.params for st in stage_list[:start] for n in path.names):
        raise ValueError(f"split_losses: the path moves parameters upstream of stage {stage_list[start].name}")
    targets = targets_matrix(targets, cfg.num_classes, x.dtype)
    ts = jnp.asarray(np.asarray(ts, np.float64), x.dtype)
    middle_names = {n for st in stage_list[start:stop] for n in st.params}
    in_middle = tuple(n for n in path.names if n in middle_names)
    in_tail = tuple(n for n in path.names if n not in middle_names)

    def middle(t, sel):
        return fold_forward(stage_list[start:stop], path.at(params, t, in_middle), y0, cfg, Pass(selections=sel))[0]

    moved = jax.vmap(lambda t: {n: path.at(params, t, in_tail)[n] for n in in_tail})(ts)
    out = []
    for sel in (None, sigma):
        with jax.disable_jit():
            ys = jax.vmap(lambda t: middle(t, sel))(ts)
        out.append(np.asarray(_tail_losses(net, stop, params, cfg, moved, ys, targets,
                                           jnp.asarray(point.alpha, x.dtype))))
    return out[0], out[1]


def _bracket(ts, diff, diff_at) -> tuple[float, float]:
    """(lo, hi): S = G at lo, S ≠ G at hi, from the grid's first parting refined by BISECT_ROUNDS
    rounds of BISECT_POINTS log-spaced points; diff_at(ts) -> |S − G| per t."""
    parted = np.nonzero(diff != 0)[0]
    if not parted.size:
        return float(ts[-1]), np.inf
    if parted[0] == 0:
        return 0.0, float(ts[0])
    lo, hi = float(ts[parted[0] - 1]), float(ts[parted[0]])
    for _ in range(BISECT_ROUNDS):
        inner = lo * (hi / lo) ** (np.arange(1, BISECT_POINTS + 1) / (BISECT_POINTS + 1))
        parted = np.nonzero(diff_at(inner) != 0)[0]
        if parted.size:
            hi = float(inner[parted[0]])
            lo = float(inner[parted[0] - 1]) if parted[0] > 0 else lo
        else:
            lo = float(inner[-1])
    return lo, hi


def germ(point: Point, grads: Optional[dict], where: str, *, key, curved: bool = False,
         ts: Optional[np.ndarray] = None, hs: Optional[np.ndarray] = None, label: Optional[str] = None) -> GermReport:
    """Walk a random path through one germ's weights (`walk_parameters`): S vs G, δ found and
    predicted, FD convergence. Straight: θ + t·v, v a random unit direction; curved: θ + t·v + t²·w,
    |w| = 1/δ₀ with δ₀ the straight walk's predicted radius (the path bends as much as it moves at
    the germ's own scale). FD compares against ⟨grads, v⟩, grads the rendered nodes at θ
    (`rendered_nodes`; None skips the finite differences). The point (`tie.Point.of`) carries the
    net, its config, the parameters, x, the targets and α; `key` draws the walk's direction."""
    net, params, x, cfg, label_smoothing = point.net, point.params, point.x, point.net.cfg(point.cfg), point.alpha
    stage, names = walk_parameters(net, where, params, cfg)
    ts = T_GRID if ts is None else np.asarray(ts, np.float64)
    hs = H_GRID if hs is None else np.asarray(hs, np.float64)
    if x.dtype != params[names[0]].dtype:
        raise ValueError(f"germ: x is {x.dtype} but the parameters are {params[names[0]].dtype}; "
                         f"cast both to one dtype")
    targets = targets_matrix(point.targets, cfg.num_classes, x.dtype)
    point = replace(point, cfg=cfg, targets=targets)
    sigma = census.selections(net, params, x, cfg)
    path = fd.make_path(params, names, key)
    if curved:
        straight_delta, _ = fd.radii(net, params, x, cfg, path, sigma, everywhere=False)
        path = fd.make_path(params, names, key, curved=True, curvature=1.0 / straight_delta)
    plan = _plan(net, params, x, cfg, stage)

    def diff_at(tt):     # max over ±t of |S(t) − G(t)| for each t (2·len(tt) rows in one pass)
        real, gath = split_losses(point, path, np.concatenate([tt, -tt]), sigma, plan=plan)
        return np.max(np.abs(real - gath).reshape(2, -1), axis=0)

    diff = diff_at(ts)
    measured = float(ts[np.argmax(diff != 0)]) if np.any(diff != 0) else np.inf
    bracket = _bracket(ts, diff, diff_at)
    # without finite differences only the pools' own ReLUs matter: a cheaper program
    predicted, kinks = fd.radii(net, params, x, cfg, path, sigma, everywhere=grads is not None)
    head = (label or f"{where} {path.kind}", where, path.kind, names, ts, diff, measured, bracket, predicted, kinks)
    if grads is None:
        empty = np.zeros(0)
        return GermReport(*head, empty, empty, np.nan, np.nan, (np.nan,) * 3, empty, empty, np.nan)
    s0, plus, minus = (fd.path_losses(net, params, x, targets, cfg, path, tt, label_smoothing=label_smoothing)
                       for tt in ([0.0], hs, -hs))
    derivs = fd.taylor(point, path, 3, "loss")
    eps_l = loss_roundoff(point, path, key=jax.random.fold_in(key, 20_000))
    return GermReport(*head, hs, (plus - minus) / (2 * hs), float(sum(jnp.vdot(grads[n], path.v[n]) for n in names)),
                      float(s0[0]), tuple(float(d) for d in derivs[1:]), (plus - s0[0]) / hs, (s0[0] - minus) / hs,
                      eps_l)


def near_kink(net, params, x, cfg, where: str, *, key, radius: float) -> dict:
    """params with one BN shift β moved so that the ReLU input of `where` ("bn3") nearest its kink
    along the straight walk `germ(..., where, key=key)` reaches 0 at |t| ≈ `radius`. A control: with
    the first kink closer than round-off allows a step, the finite differences say "no evidence"."""
    net, cfg = net, net.cfg(cfg)
    _, names = walk_parameters(net, where, params, cfg)
    if f"{where}.bias" not in params:
        raise ValueError(f"near_kink: {where!r} must name a BatchNorm layer of {net.name} (its shift "
                         f"{where}.bias moves)")
    path = fd.make_path(params, names, key)
    z0, z1, _ = fd.taylor(Point(net, cfg, params, x, None), path, 2, "relu")   # the walk's own program
    z, dz = np.asarray(z0[where]), np.asarray(z1[where])
    with np.errstate(divide="ignore", invalid="ignore"):
        cell = np.unravel_index(np.argmin(np.where(dz != 0, np.abs(z) / np.abs(dz), np.inf)), z.shape)
    beta = np.asarray(params[f"{where}.bias"]).copy()
    beta[cell[1]] += np.sign(z[cell]) * radius * abs(dz[cell]) - z[cell]
    return dict(params, **{f"{where}.bias": to_device(beta, params[f"{where}.bias"].dtype)})


# ---- many germs, many directions ----------------------------------------------------------------

@dataclass
class GermSurvey:
    reports: list[GermReport]

    @property
    def germs_hold(self) -> bool:
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
        return "\n".join([f"{'walk':<20} {'S = G below':>11} {'δ found':>9} {'predicted':>9} {'ratio':>6} "
                          f"{'first kink':>10}"] +
                         [f"{r.label:<20} {r.delta_bracket[0]:11.2e} {r.delta:9.2e} {r.delta_predicted:9.2e} "
                          f"{r.prediction_ratio:6.3f} {r.kink_radius:10.1e}" for r in self.reports])

    def fd_table(self) -> str:
        lines = [f"{'walk':<20} {'⟨g, v⟩':>10} {_S3:>9} {'ε_L':>8} {'evidence':>17} {'resolves':>9} "
                 f"{'slope':>6}  verdict"]
        for r in (r for r in self.reports if r.has_fd):
            ev = r.hs[r.evidence]
            span = f"{ev.min():.0e}…{ev.max():.0e}" if ev.size else "none"
            slope = f"{r.fd_slope:6.2f}" if r.has_window else f"{'–':>6}"
            lines.append(f"{r.label:<20} {r.exact:10.3e} {r.derivatives[2]:9.2e} {r.loss_roundoff:8.1e} "
                         f"{span:>17} {r.resolution:9.1e} {slope}  {r.fd_verdict}")
        return "\n".join(lines)

    def summary(self) -> str:
        rs, n = self.reports, len(self.reports)
        with_fd = [r for r in rs if r.has_fd]
        return (f"{sum(r.holds for r in rs)}/{n} walks: S = G bit for bit near 0, apart beyond δ\n"
                f"{sum(r.prediction_consistent for r in rs)}/{n} predicted δ no later than where S and G part "
                f"and within {GERM_PREDICTION_SPAN:g}× of it; {sum(r.sharp for r in rs)}/{n} within "
                f"{GERM_SHARP_REL:.0%}\n{sum(r.fd_converges for r in with_fd)}/{len(with_fd)} finite differences "
                f"converge to the rendered node; {len(self.windows)} with an O(h²) window")


def survey(point: Point, grads: Optional[dict], germs: dict[str, str], *, key, directions: int = 3,
           progress: bool = False, **kwargs) -> GermSurvey:
    """`germ` for each {label: where} and `directions` paths (cycling straight, curved, straight; keys
    folded from `key`). progress: a bar on a terminal's stderr (never in a chapter's output)."""
    reports = []
    jobs = [(i, label, where, d) for i, (label, where) in enumerate(germs.items()) for d in range(directions)]
    for i, label, where, d in bar(jobs, desc="germ walks", enabled=progress):
        kind = DIRECTION_KINDS[d % len(DIRECTION_KINDS)]
        reports.append(germ(point, grads, where, curved=kind == "curved",
                            key=jax.random.fold_in(jax.random.fold_in(key, i), d), label=f"{label} {kind} {d}",
                            **kwargs))
    return GermSurvey(reports)
