"""Stage germs: near a smooth point the real loss equals the gather model's along any parameter path.

Stage k of cifar8 is conv(2k−1), BN, ReLU, conv(2k), BN, ReLU and pool k; for ResNet-34 the stem
(conv1, bn1, ReLU, the 3×3/s2 pool). Along a random unit direction v in that stage's parameters,

    S(t) = loss of the real net at θ + t·v,    G(t) = the same with every pool frozen at σ(θ),

agree bit for bit for |t| below a radius δ (no window's selection changes), and part beyond it.
The margins predict δ to first order: each window's gap between its selected cell and a competitor
(or a dead window's distance below 0) divided by the gap's rate of change along v.

Central finite differences of S converge to the rendered node at O(h²) while [−h, h] holds no kink:
the error is |S'''(0)|·h²/6 + O(h⁴) plus round-off of order ε̂/h, ε̂ the round-off noise of one
evaluation of S. S''' comes from the autodiff oracle, so the truncation line is a prediction, not a
fit. The truncation is visible only where it rises above round-off before the first kink; where it
does not, the errors must sit at round-off. This is the numeric face of `HasGradAt`.

At a non-twin tie (`census.planted_tie`) the germ fails: S and G part at every |t| and the
one-sided slopes of S differ by an amount that does not shrink with h. Shown in: Stage germs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..ops import head, maxpool

# |t| grid for S vs G: half-decade steps (ratio √10), so "measured" is known to within one step
# before the bisection refines it
T_GRID = np.logspace(-8, 0, 17)
# decade steps, for nets whose every evaluation is costly (ResNet-34)
T_GRID_COARSE = np.logspace(-8, 0, 9)
# finite-difference steps: quarter-decade steps from deep in round-off to well past any kink
H_GRID = np.logspace(-8, -1, 29)
# bisection halvings of the log-width of the grid step where S and G part: 2⁻⁶ of a half decade,
# i.e. the parting radius to within 1.8 %
BISECT_STEPS = 6
# steps this small carry no visible truncation: |S'''|·h²/6 would need |S'''| > 10⁴ to reach the
# ~1e-9 round-off seen at h = 1e-6 (checked per report); the largest |error|·h among them sizes ε̂
ROUNDOFF_STEPS = 1e-6
# The first-order δ uses the tangents at t = 0; a ReLU crossing before δ bends the gaps (the
# tangents change there), so the found δ may come later than predicted: we require it within
# this factor of the prediction (a decade: two steps of the half-decade grid)
PREDICTION_SPAN = 10.0
# … and count as first-order agreement a bisected δ within this of the prediction (the bisection
# resolves 1.8 %; second-order bending inside a kink-free stretch adds a little)
FIRST_ORDER_REL = 0.05
# a step is in the truncation window when the predicted truncation |S'''|·h²/6 exceeds the
# round-off envelope ε̂/h this many times: round-off is then under a tenth of the error
WINDOW_MARGIN = 10.0
# the window must hold this many steps (half a decade at quarter-decade steps) for a slope fit
MIN_WINDOW = 3
# inside the window, |error| / (|S'''|·h²/6) lies within 1 ± this: round-off adds at most
# 1/WINDOW_MARGIN, the h⁴ term a few per cent inside the smooth radius; the rest is headroom for
# round-off excursions above the largest one seen at the small steps
TRUNCATION_REL = 0.25
# the log-log slope over the window: 2 within this (the same budget over ≥ half a decade)
SLOPE_TOL = 0.25
# a kink at t = 0 shows as a jump |right slope − left slope| that does not shrink with h: over
# these two decades of small steps a smooth S gives |S''|·h + round-off/h, which changes by a
# factor 100 at either end of the range (and by ≥ 5 between the ends and the middle where the two
# terms cross), while a kink gives the same jump at every step
KINK_STEPS = (1e-8, 1e-6)
KINK_FLATNESS = 2.0
_S3 = "S'''"   # a column header


@dataclass
class GermReport:
    stage: str
    params: tuple[str, ...]        # the parameters the direction moves
    ts: np.ndarray                 # |t| grid (both signs are evaluated)
    real_minus_gather: np.ndarray  # max over ±t of |S(t) − G(t)|, per |t|
    delta_measured: float          # the smallest |t| on the grid where S ≠ G (inf if none)
    delta_bracket: tuple[float, float]  # after bisection: S = G at the first, S ≠ G at the second
    delta_predicted: float         # first-order prediction from the pool-window margins
    kink_radius: float             # first-order radius before a ReLU input crosses 0 (S and G both kink);
                                   # every ReLU with finite differences, those feeding pools without
    hs: np.ndarray                 # finite-difference steps
    fd_errors: np.ndarray          # |central difference − ⟨rendered node, v⟩| per h
    exact: float                   # ⟨rendered node, v⟩
    loss: float                    # S(0)
    derivatives: tuple[float, float, float]  # S'(0), S''(0), S'''(0) along v, by the autodiff oracle
    right: np.ndarray              # (S(h) − S(0)) / h per h
    left: np.ndarray               # (S(0) − S(−h)) / h per h

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
    def grid_ratio(self) -> float:
        return float(self.ts[1] / self.ts[0])

    @property
    def delta(self) -> float:
        """The parting radius after bisection (geometric middle of the bracket)."""
        lo, hi = self.delta_bracket
        return float(np.sqrt(lo * hi)) if lo > 0 else float(hi)

    @property
    def prediction_ratio(self) -> float:
        """δ (bisected) / δ predicted: 1 to first order."""
        return self.delta / self.delta_predicted

    @property
    def prediction_consistent(self) -> bool:
        """The margins never promise more than holds: δ predicted is no later than the first grid
        point where S and G part (up to FIRST_ORDER_REL: the prediction is first order), and the
        bisected δ is at most PREDICTION_SPAN times the prediction."""
        return bool(self.delta_predicted <= self.delta_measured * (1 + FIRST_ORDER_REL)
                    and self.delta <= self.delta_predicted * PREDICTION_SPAN)

    @property
    def first_order(self) -> bool:
        """The bisected δ agrees with the prediction to FIRST_ORDER_REL."""
        return bool(abs(self.prediction_ratio - 1) <= FIRST_ORDER_REL)

    # -- finite differences --

    @property
    def has_fd(self) -> bool:
        return bool(self.hs.size)

    @property
    def smooth_radius(self) -> float:
        """Inside this radius (first order) no ReLU input crosses 0 and no pool selection changes:
        S is smooth on [−h, h] for h below it."""
        return float(min(self.kink_radius, self.delta_predicted, self.delta_bracket[0] or np.inf))

    @property
    def roundoff(self) -> float:
        """ε̂, the round-off noise of one evaluation of S: the largest |FD error|·h at steps ≤
        ROUNDOFF_STEPS (the central difference's round-off is at most ε̂/h)."""
        tiny = self.hs <= ROUNDOFF_STEPS
        return float(np.max(self.fd_errors[tiny] * self.hs[tiny])) if tiny.any() else np.nan

    @property
    def roundoff_clean(self) -> bool:
        """ε̂ is read where truncation is negligible: at ROUNDOFF_STEPS the predicted truncation is
        under 1/WINDOW_MARGIN of the round-off envelope."""
        return bool(self.truncation(ROUNDOFF_STEPS) * WINDOW_MARGIN <= self.roundoff / ROUNDOFF_STEPS)

    def truncation(self, h) -> np.ndarray:
        """The predicted truncation error |S'''(0)|·h²/6 of the central difference."""
        return abs(self.derivatives[2]) * np.asarray(h) ** 2 / 6

    @property
    def fd_window(self) -> np.ndarray:
        """Steps where the O(h²) truncation must show: inside the smooth radius, and predicted at
        least WINDOW_MARGIN times above the round-off envelope ε̂/h."""
        return (self.hs < self.smooth_radius) & (self.truncation(self.hs) >= WINDOW_MARGIN * self.roundoff / self.hs)

    @property
    def has_window(self) -> bool:
        return int(self.fd_window.sum()) >= MIN_WINDOW

    @property
    def window_crossover(self) -> float:
        """The step where the predicted truncation reaches WINDOW_MARGIN × round-off: (6·M·ε̂/|S'''|)^⅓.
        A window exists when the smooth radius lies beyond it."""
        return float((6 * WINDOW_MARGIN * self.roundoff / abs(self.derivatives[2])) ** (1 / 3))

    @property
    def fd_slope(self) -> float:
        """Log-log slope of the FD error over the window (nan without one)."""
        w = self.fd_window
        if int(w.sum()) < MIN_WINDOW:
            return float("nan")
        return float(np.polyfit(np.log(self.hs[w]), np.log(self.fd_errors[w]), 1)[0])

    @property
    def truncation_ratios(self) -> np.ndarray:
        """|FD error| / (|S'''|·h²/6) over the window: 1 where the O(h²) term is what we see."""
        w = self.fd_window
        return self.fd_errors[w] / self.truncation(self.hs[w])

    @property
    def fd_converges(self) -> bool:
        """O(h²) convergence as far as float64 shows it: on the window (if any) the error IS the
        predicted truncation (ratio 1 ± TRUNCATION_REL, slope 2 ± SLOPE_TOL); everywhere inside
        the smooth radius it stays under that truncation plus the round-off envelope. False at a
        kink, where ε̂ (which assumes a smooth S) means nothing, and without finite differences."""
        if not self.has_fd or self.kinked or not self.roundoff_clean:
            return False
        inside = self.hs < self.smooth_radius
        bound = (1 + TRUNCATION_REL) * self.truncation(self.hs) + WINDOW_MARGIN * self.roundoff / self.hs
        ok = bool(np.all(self.fd_errors[inside] <= bound[inside]))
        if self.has_window:
            ok &= bool(np.all(np.abs(self.truncation_ratios - 1) <= TRUNCATION_REL))
            ok &= abs(self.fd_slope - 2) <= SLOPE_TOL
        return ok

    # -- one-sided slopes --

    @property
    def jumps(self) -> np.ndarray:
        """|right − left| per h: |S''|·h + round-off where S is smooth, a constant at a kink."""
        return np.abs(self.right - self.left)

    @property
    def jump_flatness(self) -> float:
        """max / min of the one-sided jump over KINK_STEPS: ≈ 1 at a kink, ≫ 1 where S is smooth."""
        lo, hi = KINK_STEPS
        sel = (self.hs >= lo * (1 - 1e-9)) & (self.hs <= hi * (1 + 1e-9))
        j = self.jumps[sel]
        return float(np.max(j) / np.min(j)) if j.size and np.min(j) > 0 else np.inf

    @property
    def kinked(self) -> bool:
        """The one-sided slopes differ by the same amount at every small step: S has a kink at 0."""
        return self.jump_flatness <= KINK_FLATNESS

    def summary(self) -> str:
        if not self.parted:
            head = f"{self.stage}: S = G bit for bit on the whole grid"
        elif self.parts_at_smallest:
            head = f"{self.stage}: S ≠ G already at |t| = {self.ts[0]:.0e} (no germ)"
        else:
            head = (f"{self.stage}: S = G bit for bit below |t| = {self.delta:.2e} "
                    f"(predicted {self.delta_predicted:.2e})")
        line = f"{head}; first ReLU kink {self.kink_radius:.1e}"
        if not self.has_fd:
            return line
        if self.kinked:
            return f"{line}; one-sided slopes {self.right[0]:.3g} / {self.left[0]:.3g}: a kink at t = 0"
        if self.has_window:
            return f"{line}; FD slope {self.fd_slope:.2f} over {int(self.fd_window.sum())} steps"
        return f"{line}; FD at round-off below the kink (no truncation window)"


# ---- the direction and the losses along it ------------------------------------------------------

def stage_parameters(net, stage: str, params: dict, cfg=None) -> tuple[str, ...]:
    """The parameter names a stage owns, read off the net's stage list."""
    listed = {s.name: s for s in net.stage_list(cfg if cfg is not None else net.Config())}
    if stage not in listed:
        raise ValueError(f"unknown stage {stage!r} of {net.__name__}; stages: {list(listed)}")
    return tuple(n for n in listed[stage].params if n in params)


def unit_direction(params: dict, names: Sequence[str], key) -> dict:
    """A random direction in the named parameters (zero elsewhere), unit Euclidean norm overall."""
    missing = [n for n in names if n not in params]
    if missing or not names:
        raise ValueError(f"unit_direction: names must be parameters, got {list(names)} (missing {missing})")
    v = {}
    for i, name in enumerate(names):
        v[name] = jax.random.normal(jax.random.fold_in(key, i), params[name].shape, params[name].dtype)
    norm = jnp.sqrt(sum(jnp.sum(a * a) for a in v.values()))
    return {name: (v[name] / norm if name in v else jnp.zeros_like(p)) for name, p in params.items()}


def _moved(params: dict, v: dict, t) -> dict:
    return {k: params[k] + t * v[k] for k in params}


@partial(jax.jit, static_argnums=(0, 5))
def _loss_at(net, params, v, x, targets, cfg, t, alpha, selections):
    logits, _ = net.forward(_moved(params, v, t), x, cfg, selections=selections)
    return reference.smoothed_cross_entropy(logits, targets, alpha)


def path_losses(net, params, x, targets, cfg, v, ts, *, selections=None, label_smoothing: float = 0.0,
                op_by_op: bool = False) -> np.ndarray:
    """The loss at θ + t·v for each t; with `selections`, through the gather model frozen there.

    `op_by_op` evaluates without whole-graph compilation: a fused graph may reassociate differently
    for the real and the gather forward, and "bit for bit" must compare the maths, not two
    compilations. Otherwise one compiled program serves every t (and every later call with the
    same shapes).
    """
    alpha = jnp.asarray(label_smoothing, x.dtype)

    def at(t):
        return float(_loss_at(net, params, v, x, targets, cfg, jnp.asarray(t, x.dtype), alpha, selections))
    if op_by_op:
        with jax.disable_jit():
            return np.array([at(t) for t in ts])
    return np.array([at(t) for t in ts])


@partial(jax.jit, static_argnums=(0, 5))
def _derivatives(net, params, v, x, targets, cfg, alpha):
    """S', S'', S''' at t = 0 along v, by nested forward-mode autodiff of the real loss."""
    def s(t):
        return _loss_at(net, params, v, x, targets, cfg, t, alpha, None)

    def d(f):
        return lambda t: jax.jvp(f, (t,), (jnp.ones_like(t),))[1]
    zero = jnp.zeros((), x.dtype)
    return d(s)(zero), d(d(s))(zero), d(d(d(s)))(zero)


@partial(jax.jit, static_argnums=(0, 3))
def _selections(net, params, x, cfg):
    _, saved = net.forward(params, x, cfg)
    return {name: maxpool.select(r, net.POOLS[name]) for name, r in net.pool_inputs(saved).items()}


def selections(net, params, x, cfg) -> dict:
    """σ = argmax for every pool, read from the pool inputs at θ."""
    return _selections(net, params, x, cfg)


@partial(jax.jit, static_argnums=(0, 3, 5))
def _read_with_tangents(net, params, x, cfg, v, everywhere: bool):
    def read(p):
        _, saved = net.forward(p, x, cfg)
        pre = net.preactivations(saved)
        if not everywhere:      # only the layers feeding pools: the compiler drops the rest of the net
            pre = {k: pre[k] for k in sorted(set(net.POOL_PREACTIVATIONS.values()))}
        return pre
    return jax.jvp(read, (params,), (v,))


def predicted_radius(net, params, x, cfg, v, sigma: dict, *, kinks_everywhere: bool = True) -> tuple[float, float]:
    """First-order radii (pool δ, ReLU kinks) along v, the tangents by the autodiff oracle.

    Each pool reads relu(z), z the pre-activations `net.POOL_PREACTIVATIONS` names. Per window,
    with σ its selected cell:

    - live (z[σ] > 0): σ stays the maximum until a competitor's z meets z[σ], at
      |t| = (z[σ] − z_c) / |d(z[σ] − z_c)/dt|. (z[σ] itself falling below 0 changes nothing: the
      window turns dead, pool and gather both read 0.) Twins have equal values and equal tangents:
      they never meet.
    - dead (z < 0 everywhere): the pooled 0 holds until a cell other than σ crosses 0, at
      |t| = −z_c / |dz_c/dt|. (σ crossing 0 makes it the window's maximum: still σ.)

    δ is the smallest of these; the kink radius is the smallest |z| / |dz/dt| over every ReLU input
    of the net (with `kinks_everywhere=False`, over those feeding pools only).
    """
    z0, dz = _read_with_tangents(net, params, x, cfg, v, kinks_everywhere)
    kinks = np.inf
    for layer in z0:
        z, dzl = np.asarray(z0[layer]), np.asarray(dz[layer])
        with np.errstate(divide="ignore", invalid="ignore"):
            kinks = min(kinks, float(np.min(np.where(dzl != 0, np.abs(z) / np.abs(dzl), np.inf))))
    radius = np.inf
    for name, spec in net.POOLS.items():
        layer = net.POOL_PREACTIVATIONS[name]
        zw, dzw = (np.asarray(maxpool.windows(a, spec)) for a in (z0[layer], dz[layer]))
        finite = np.isfinite(zw)                       # the stem pool's −∞ padding is never a competitor
        dzw = np.where(finite, dzw, 0.0)
        idx = np.asarray(sigma[name])[..., None]
        other = np.arange(zw.shape[-1]) != idx
        top, dtop = np.take_along_axis(zw, idx, -1), np.take_along_axis(dzw, idx, -1)
        gap, dgap = top - zw, dtop - dzw
        live = top > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            t_live = np.where(live & finite & other & (gap > 0) & (dgap != 0), gap / np.abs(dgap), np.inf)
            t_dead = np.where(~live & finite & other & (zw < 0) & (dzw != 0), -zw / np.abs(dzw), np.inf)
        radius = min(radius, float(np.min(t_live)), float(np.min(t_dead)))
    return radius, kinks


@partial(jax.jit, static_argnums=(0, 4))
def rendered_nodes(net, params, x, targets, cfg, label_smoothing=0.0) -> dict:
    """The rendered parameter nodes at θ: net.backward of the head's six-op cotangent."""
    logits, saved = net.forward(params, x, cfg)
    grads, _ = net.backward(params, saved, head.cotangent(logits, targets, label_smoothing), cfg)
    return grads


# ---- S vs G, bit for bit ------------------------------------------------------------------------
#
# Both losses are evaluated in three parts: the stages before the moving one (they do not depend on
# t: computed once, shared), then the moving stage up to the last stage holding a pool, op by op,
# real or gathered (a fused graph may reassociate differently for a max pool and a gather, and
# "bit for bit" must compare the maths, not two compilations), then the rest of the net and the
# loss as ONE compiled program applied to both: it returns equal bits for equal inputs.


def _pool_stages(net, params, x, cfg) -> list[int]:
    """Indices in the stage list of the stages that hold a pool (their saved record carries σ)."""
    _, saved = jax.eval_shape(lambda p, x_: net.forward(p, x_, cfg), params, x)
    return [i for i, st in enumerate(net.stage_list(cfg)) if hasattr(saved[st.name], "sigma")]


@partial(jax.jit, static_argnums=(0, 1, 2, 4))
def _fold(net, start: int, stop: int, params, cfg, y):
    for st in net.stage_list(cfg)[start:stop]:
        y, _ = st.forward(params, y, cfg)
    return y


@partial(jax.jit, static_argnums=(0, 1, 3))
def _tail_loss(net, start: int, params, cfg, y, targets, alpha):
    for st in net.stage_list(cfg)[start:]:
        y, _ = st.forward(params, y, cfg)
    return reference.smoothed_cross_entropy(y, targets, alpha)


def _middle(net, start: int, stop: int, params, cfg, y, selections):
    with jax.disable_jit():
        for st in net.stage_list(cfg)[start:stop]:
            y, _ = st.forward(params, y, cfg, selections=selections)
    return y


class _Plan(NamedTuple):
    start: int          # the moving stage's index
    stop: int           # one past the last stage holding a pool: op by op up to here
    y0: jax.Array       # the moving stage's input (independent of t)


def _plan(net, params, x, cfg, stage: str) -> _Plan:
    names = [st.name for st in net.stage_list(cfg)]
    if stage not in names:
        raise ValueError(f"unknown stage {stage!r} of {net.__name__}; stages: {names}")
    k = names.index(stage)
    pools = [i for i in _pool_stages(net, params, x, cfg) if i >= k]
    return _Plan(k, (max(pools) if pools else k) + 1, _fold(net, 0, k, params, cfg, x))


def split_losses(net, params, x, targets, cfg, v, ts, sigma: dict, *, stage: Optional[str] = None,
                 plan: Optional[_Plan] = None, label_smoothing: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(S(t), G(t)) for each t, the real loss and the gather model's at σ, comparable bit for bit.

    v moves the parameters of `stage` only (or give the `plan` a previous call made).
    """
    if plan is None:
        if stage is None:
            raise ValueError("split_losses: name the stage v moves (or pass a plan)")
        plan = _plan(net, params, x, cfg, stage)
    alpha = jnp.asarray(label_smoothing, x.dtype)
    real, gath = [], []
    moving = [n for n in net.stage_list(cfg)[plan.start].params if n in params]
    for t in ts:
        t = jnp.asarray(t, x.dtype)
        p = dict(params, **{n: params[n] + t * v[n] for n in moving})
        for sel, out in ((None, real), (sigma, gath)):
            y = _middle(net, plan.start, plan.stop, p, cfg, plan.y0, sel)
            out.append(float(_tail_loss(net, plan.stop, p, cfg, y, targets, alpha)))
    return np.array(real), np.array(gath)


def _real_minus_gather(net, params, x, targets, cfg, v, sigma, ts, plan, label_smoothing) -> np.ndarray:
    """max over ±t of |S(t) − G(t)| for each t."""
    ts = np.asarray(ts, np.float64)
    real, gath = split_losses(net, params, x, targets, cfg, v, np.concatenate([ts, -ts]), sigma,
                              plan=plan, label_smoothing=label_smoothing)
    return np.maximum(np.abs(real - gath)[: ts.size], np.abs(real - gath)[ts.size:])


def germ(net, params, x, targets, cfg, grads: Optional[dict], stage: str, *, key, names: Optional[Sequence[str]] = None,
         ts: Optional[np.ndarray] = None, hs: Optional[np.ndarray] = None,
         label_smoothing: float = 0.0, bisect_steps: int = BISECT_STEPS,
         label: Optional[str] = None) -> GermReport:
    """Walk a random direction in one stage's parameters: S vs G, δ measured and predicted, FD convergence.

    `grads` are the rendered nodes at θ (net.backward); FD compares against ⟨grads, v⟩ (with
    grads=None the finite differences are skipped). The grid gives the first |t| where S and G
    part; bisection between it and the grid point below refines the radius. `label` names the
    report (the stage name by default).
    """
    names = tuple(names) if names is not None else stage_parameters(net, stage, params, cfg)
    ts = T_GRID if ts is None else np.asarray(ts, np.float64)
    hs = H_GRID if hs is None else np.asarray(hs, np.float64)
    if x.dtype != params[names[0]].dtype:
        raise ValueError(f"germ: x is {x.dtype} but the parameters are {params[names[0]].dtype}; "
                         f"cast both to one dtype")
    v = unit_direction(params, names, key)
    sigma = selections(net, params, x, cfg)
    plan = _plan(net, params, x, cfg, stage)
    diff = _real_minus_gather(net, params, x, targets, cfg, v, sigma, ts, plan, label_smoothing)
    parted = np.nonzero(diff != 0)[0]
    measured = float(ts[parted[0]]) if parted.size else np.inf
    if not parted.size:
        bracket = (float(ts[-1]), np.inf)
    elif parted[0] == 0:
        bracket = (0.0, float(ts[0]))
    else:
        lo, hi = float(ts[parted[0] - 1]), float(ts[parted[0]])
        for _ in range(bisect_steps):
            mid = float(np.sqrt(lo * hi))
            if _real_minus_gather(net, params, x, targets, cfg, v, sigma, [mid], plan, label_smoothing)[0] != 0:
                hi = mid
            else:
                lo = mid
        bracket = (lo, hi)
    # without finite differences only the pools' own ReLUs matter: a cheaper program
    predicted, kinks = predicted_radius(net, params, x, cfg, v, sigma, kinks_everywhere=grads is not None)
    stage = label or stage
    if grads is None:
        empty = np.zeros(0)
        return GermReport(stage, names, ts, diff, measured, bracket, predicted, kinks, empty, empty, np.nan,
                          np.nan, (np.nan,) * 3, empty, empty)
    exact = float(sum(jnp.vdot(grads[n], v[n]) for n in names))
    s0, plus, minus = (path_losses(net, params, x, targets, cfg, v, tt, label_smoothing=label_smoothing)
                       for tt in ([0.0], hs, -hs))
    fd_errors = np.abs((plus - minus) / (2 * hs) - exact)
    derivs = tuple(float(d) for d in _derivatives(net, params, v, x, targets, cfg,
                                                   jnp.asarray(label_smoothing, x.dtype)))
    return GermReport(stage, names, ts, diff, measured, bracket, predicted, kinks, hs, fd_errors, exact,
                      float(s0[0]), derivs, (plus - s0[0]) / hs, (s0[0] - minus) / hs)


# ---- many stages, many directions --------------------------------------------------------------

@dataclass
class GermSurvey:
    reports: list[GermReport]

    @property
    def germs_hold(self) -> bool:
        """Every walk: S = G bit for bit at the small |t| and apart somewhere on the grid."""
        return all(r.bit_identical_below and r.parted for r in self.reports)

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
        head = (f"{'stage':<10} {'S = G below':>11} {'δ found':>9} {'predicted':>9} {'ratio':>6} "
                f"{'first kink':>10}")
        lines = [head]
        for r in self.reports:
            lines.append(f"{r.stage:<10} {r.delta_bracket[0]:11.2e} {r.delta:9.2e} {r.delta_predicted:9.2e} "
                         f"{r.prediction_ratio:6.2f} {r.kink_radius:10.1e}")
        return "\n".join(lines)

    def fd_table(self) -> str:
        head = (f"{'stage':<10} {'⟨g, v⟩':>10} {_S3:>9} {'ε̂':>8} {'window from':>11} {'first kink':>10} "
                f"{'steps':>5} {'slope':>6} {'err/trunc':>10}")
        lines = [head]
        for r in self.reports:
            if not r.has_fd:
                continue
            ratios = r.truncation_ratios
            span = f"{ratios.min():.2f}–{ratios.max():.2f}" if ratios.size else "–"
            slope = f"{r.fd_slope:6.2f}" if r.has_window else f"{'–':>6}"
            lines.append(f"{r.stage:<10} {r.exact:10.3e} {r.derivatives[2]:9.2e} {r.roundoff:8.1e} "
                         f"{r.window_crossover:11.1e} {r.smooth_radius:10.1e} {int(r.fd_window.sum()):5d} "
                         f"{slope} {span:>10}")
        return "\n".join(lines)

    def summary(self) -> str:
        n = len(self.reports)
        held = sum(r.bit_identical_below and r.parted for r in self.reports)
        pred = sum(r.prediction_consistent for r in self.reports)
        first = sum(r.first_order for r in self.reports)
        fd = [r for r in self.reports if r.has_fd]
        conv = sum(r.fd_converges for r in fd)
        slopes = ", ".join(f"{r.stage} {r.fd_slope:.1f}" for r in self.windows) or "none"
        return (f"{held}/{n} walks: S = G bit for bit near 0, apart beyond δ\n"
                f"{pred}/{n} predicted δ no later than the parting grid point and within "
                f"{PREDICTION_SPAN:g}× of the bisected δ; {first}/{n} within {FIRST_ORDER_REL:.0%} of it\n"
                f"{conv}/{len(fd)} finite differences converge as O(h²) + round-off; "
                f"{len(self.windows)} with a truncation window (slopes: {slopes})")


def survey(net, params, x, targets, cfg, grads: Optional[dict], stages: Sequence[str], *, key,
           directions: int = 1, **kwargs) -> GermSurvey:
    """`germ` for each stage and `directions` random directions (keys folded from `key`)."""
    reports = []
    for i, stage in enumerate(stages):
        for d in range(directions):
            r = germ(net, params, x, targets, cfg, grads, stage,
                     key=jax.random.fold_in(jax.random.fold_in(key, i), d), **kwargs)
            if directions > 1:
                r.stage = f"{stage}/{d}"
            reports.append(r)
    return GermSurvey(reports)
