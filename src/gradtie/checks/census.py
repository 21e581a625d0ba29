"""The smooth-point census: classify every max-pool window and flag ReLU inputs that are exactly 0.

Each window of a pool, per example and channel, is read from the pre-activations z that feed
ReLU → pool (SPEC §5):

- dead: every cell has z < 0 (the pooled value stays 0 nearby, whatever cell is chosen);
- strict: the maximum is strictly above every other cell;
- twin tie: the maximum is attained only at twins — cells equal for every value of every weight
  upstream (the image fixed); a twin tie never breaks, so the parameter gradient is the same
  whichever twin the backward routes to;
- non-twin tie: the hypothesis fails; the loss is not differentiable there.

Twins are found by equality under random draws of all the net's weights (conv weights and biases,
γ, β): equal values as functions of the weights stay equal under every draw, unequal ones part.
Shown in: Pools, Stage germs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import head, maxpool

CLASSES = ("dead", "strict", "twin tie", "non-twin tie")
DEAD, STRICT, TWIN, NON_TWIN = range(4)

# Twins agree to round-off under every draw; non-twins part by O(1) of the channel's scale.
TWIN_REL = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4}
DRAWS = 3
MAX_LISTED = 20


@dataclass(frozen=True)
class Violation:
    kind: str                 # "non-twin tie" or "zero pre-activation"
    layer: str                # the pool (ties) or the layer whose output feeds ReLU (zeros)
    example: int
    channel: int
    where: tuple[int, ...]    # window (i, j) for a tie; cell (h, w) or dense unit (u,) for a zero

    def describe(self) -> str:
        what = "window" if self.kind == "non-twin tie" else "cell"
        return (f"{self.kind} at {self.layer}, example {self.example}, channel {self.channel}, "
                f"{what} {self.where}")


@dataclass
class PoolCensus:
    pool: str
    preactivation: str
    classes: np.ndarray       # [N,C,H',W'] int: DEAD / STRICT / TWIN / NON_TWIN
    margin: float             # smallest gap between a live window's maximum and its nearest non-twin cell
    dead_margin: float        # smallest distance of a dead window's maximum below 0

    @property
    def counts(self) -> dict[str, int]:
        return {name: int(np.sum(self.classes == i)) for i, name in enumerate(CLASSES)}

    @property
    def windows(self) -> int:
        return int(self.classes.size)


@dataclass
class SmoothReport:
    pools: list[PoolCensus]
    zeros: int                            # ReLU inputs exactly 0
    min_abs_preactivation: float
    violations: list[Violation] = field(default_factory=list)   # the first MAX_LISTED of each kind
    non_twin_ties: int = 0

    @property
    def ok(self) -> bool:
        return self.zeros == 0 and self.non_twin_ties == 0

    def summary(self) -> str:
        total = {c: sum(p.counts[c] for p in self.pools) for c in CLASSES}
        counts = ", ".join(f"{v} {k}" for k, v in total.items())
        if self.ok:
            return f"smooth point: {counts}; {self.zeros} zero pre-activations"
        return (f"NOT smooth: {self.non_twin_ties} non-twin ties, {self.zeros} zero pre-activations; "
                f"first: {self.violations[0].describe()}")

    def table(self) -> str:
        lines = [f"{'pool':<12} {'reads':<10} " + " ".join(f"{c:>13}" for c in CLASSES) + f" {'margin':>9}"]
        for p in self.pools:
            c = p.counts
            lines.append(f"{p.pool:<12} {p.preactivation:<10} " +
                         " ".join(f"{c[k]:>13}" for k in CLASSES) + f" {p.margin:9.2e}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary(), "zeros": self.zeros,
                "non_twin_ties": self.non_twin_ties,
                "min_abs_preactivation": self.min_abs_preactivation,
                "pools": [{"pool": p.pool, "preactivation": p.preactivation, "counts": p.counts,
                           "margin": p.margin, "dead_margin": p.dead_margin} for p in self.pools],
                "violations": [v.__dict__ for v in self.violations]}


def random_weights(net, params: dict, cfg, key) -> dict:
    """A fresh draw of every weight: init's conv and dense weights, γ ~ U(0.5, 1.5), β and biases ~ N(0, 1)."""
    drawn = net.init(key, cfg)
    out = {}
    for i, (name, value) in enumerate(drawn.items()):
        k = jax.random.fold_in(key, i + 1)
        dtype = params[name].dtype
        if value.ndim == 1 and name.endswith(".weight"):      # γ
            value = jax.random.uniform(k, value.shape, minval=0.5, maxval=1.5)
        elif value.ndim == 1:                                   # β and biases
            value = jax.random.normal(k, value.shape)
        out[name] = value.astype(dtype)
    return out


def classify(z: np.ndarray, draws: list[np.ndarray], spec: maxpool.PoolSpec, rel: float):
    """Classes [N,C,H',W'], the live margin and the dead margin, from pre-activations z and draws."""
    win = np.asarray(maxpool.windows(jnp.asarray(z), spec))                    # [N,C,H',W',k²]
    first = np.argmax(win, axis=-1)[..., None]
    top = np.take_along_axis(win, first, axis=-1)
    # a cell is the max's twin when it equals the max under the actual weights and every draw
    twin = np.abs(win - top) <= rel * np.maximum(np.abs(top), 1e-300)
    for zr in draws:
        wr = np.asarray(maxpool.windows(jnp.asarray(zr), spec))
        scale = np.max(np.abs(zr), axis=(0, 2, 3))[None, :, None, None, None]   # per channel
        twin &= np.abs(wr - np.take_along_axis(wr, first, axis=-1)) <= rel * scale
    exact_tie = (win == top) & ~twin
    m = top[..., 0]
    classes = np.full(m.shape, STRICT, np.int8)
    classes[twin.sum(-1) > 1] = TWIN
    classes[exact_tie.any(-1)] = NON_TWIN
    classes[m < 0] = DEAD
    others = np.where(twin, -np.inf, win).max(-1)
    live = m > 0
    gaps = (m - others)[live]
    margin = float(np.min(gaps)) if gaps.size else np.inf
    dead_margin = float(np.min(-m[m < 0])) if np.any(m < 0) else np.inf
    return classes, margin, dead_margin


def _locations(mask: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in np.argwhere(mask)[:MAX_LISTED]]


@partial(jax.jit, static_argnums=(0, 3))
def _read(net, params, x, cfg):
    """(pool inputs, pre-activations) from one compiled forward, shared by every census call."""
    _, saved = net.forward(params, x, cfg)
    return net.pool_inputs(saved), net.preactivations(saved)


def pool_inputs(net, params: dict, x: jax.Array, cfg) -> dict[str, jax.Array]:
    """Each pool's (post-ReLU) input at (params, x): {pool: [N,C,H,W]}."""
    return _read(net, params, x, cfg)[0]


def smoothness(net, params: dict, x: jax.Array, cfg, *, key: Optional[jax.Array] = None,
               draws: int = DRAWS) -> SmoothReport:
    """The census of every pool window and ReLU input of `net` at (params, x)."""
    key = jax.random.key(0) if key is None else key
    pre = {k: np.asarray(v) for k, v in _read(net, params, x, cfg)[1].items()}
    drawn = [{k: np.asarray(v) for k, v in
              _read(net, random_weights(net, params, cfg, jax.random.fold_in(key, r)), x, cfg)[1].items()}
             for r in range(draws)]
    rel = TWIN_REL.get(np.dtype(x.dtype), 1e-2)
    violations: list[Violation] = []
    pools, non_twin = [], 0
    for pool, spec in net.POOLS.items():
        layer = net.POOL_PREACTIVATIONS[pool]
        classes, margin, dead_margin = classify(pre[layer], [d[layer] for d in drawn], spec, rel)
        pools.append(PoolCensus(pool, layer, classes, margin, dead_margin))
        bad = classes == NON_TWIN
        non_twin += int(bad.sum())
        violations += [Violation("non-twin tie", pool, n, c, (i, j)) for n, c, i, j in _locations(bad)]
    zeros, zero_listed = 0, []
    for layer, z in pre.items():
        zero = z == 0
        zeros += int(zero.sum())
        # conv layers give (n, c, h, w); dense layers (n, unit) with no spatial cell
        zero_listed += [Violation("zero pre-activation", layer, loc[0], loc[1], tuple(loc[2:]))
                        for loc in _locations(zero)]
    min_abs = float(min(np.min(np.abs(z)) for z in pre.values()))
    # the first MAX_LISTED of each kind, so that many ties cannot hide a zero
    return SmoothReport(pools, zeros, min_abs, violations[:MAX_LISTED] + zero_listed[:MAX_LISTED], non_twin)


# ---- routing: the backward at another selection ------------------------------------------------

# Routing a twin-tied window's cotangent to another twin changes only the order of float sums in
# the parameter nodes: float64 round-off, far below this. A non-twin reroute moves a node by O(1)
# of its scale.
ROUTE_REL = 1e-12


def last_max(x: jax.Array, spec: maxpool.PoolSpec) -> jax.Array:
    """Per window the index of its LAST maximal cell in row-major order (σ = argmax takes the first)."""
    win = maxpool.windows(x, spec)
    return win.shape[-1] - 1 - jnp.argmax(win[..., ::-1], axis=-1)


def rerouted(net, params: dict, x: jax.Array, cfg, report: SmoothReport, kind: str) -> tuple[dict, dict]:
    """(σ, σ'): σ = argmax for every pool; σ' the same except that every window of class `kind`
    ("dead", "twin tie" or "non-twin tie") routes to its last maximal cell on the pool input."""
    if kind not in CLASSES:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(CLASSES)}")
    inputs = pool_inputs(net, params, x, cfg)
    sigma, sigma_alt = {}, {}
    for pool, census in zip(net.POOLS, report.pools):
        r, spec = inputs[pool], net.POOLS[pool]
        sigma[pool] = maxpool.select(r, spec)
        chosen = jnp.asarray(census.classes == CLASSES.index(kind))
        sigma_alt[pool] = jnp.where(chosen, last_max(r, spec), sigma[pool])
    return sigma, sigma_alt


@dataclass
class RoutingReport:
    kind: str                       # the class of the rerouted windows
    rerouted: dict[str, int]        # pool -> windows whose selected cell moved
    loss: float                     # the loss at σ
    loss_rerouted: float            # the loss at σ' (the same: tied cells hold the same value)
    nodes: dict[str, float]         # per node: max|g − g'| / max|g| (zero-in-ℝ nodes: / max over the net)
    zero_nodes: tuple[str, ...]     # nodes that are 0 in ℝ (conv biases behind BN)
    dx_rel: float                   # max|dx − dx'| / max|dx|

    @property
    def param_rel(self) -> float:
        return max(self.nodes.values())

    @property
    def worst(self) -> str:
        return max(self.nodes, key=self.nodes.get)

    @property
    def same_parameter_gradient(self) -> bool:
        return self.param_rel <= ROUTE_REL

    @property
    def same_input_gradient(self) -> bool:
        return self.dx_rel <= ROUTE_REL

    def summary(self) -> str:
        moved = sum(self.rerouted.values())
        p = "the same" if self.same_parameter_gradient else "DIFFERENT"
        d = "the same" if self.same_input_gradient else "different"
        return (f"rerouted {moved} {self.kind} windows: loss {'unchanged' if self.loss == self.loss_rerouted else 'CHANGED'}; "
                f"parameter gradient {p} (to {ROUTE_REL:.0e}); input gradient {d}")


@partial(jax.jit, static_argnums=(0, 4))
def _gradients_at(net, params, x, targets, cfg, selections):
    logits, saved = net.forward(params, x, cfg, selections=selections)
    grads, dx = net.backward(params, saved, head.cotangent(logits, targets), cfg)
    return head.forward(logits, targets), grads, dx


def gradients_at(net, params: dict, x: jax.Array, targets: jax.Array, cfg, selections: dict):
    """(loss, parameter grads, dx) of the rendered chain with every pool frozen at `selections`:
    the gather model's forward and its transpose, selScatter, in the backward."""
    return _gradients_at(net, params, x, targets, cfg, selections)


def routing(net, params: dict, x: jax.Array, targets: jax.Array, cfg, report: SmoothReport,
            kind: str = "twin tie") -> RoutingReport:
    """The rendered gradients at σ = argmax against those at σ' (windows of class `kind` routed to
    their last maximal cell). targets: one-hot or soft rows [N,K]."""
    if jnp.ndim(targets) == 1:
        targets = head.one_hot(targets, cfg.num_classes, x.dtype)
    sigma, sigma_alt = rerouted(net, params, x, cfg, report, kind)
    loss, g, dx = gradients_at(net, params, x, targets, cfg, sigma)
    loss_alt, g_alt, dx_alt = gradients_at(net, params, x, targets, cfg, sigma_alt)
    gmax = max(float(jnp.max(jnp.abs(v))) for v in g.values())
    zero = tuple(n for n in params if n.endswith(".bias") and getattr(params.get(n[:-4] + "weight"), "ndim", 0) == 4)
    nodes = {}
    for name in params:   # signature order (compiled code hands dicts back key-sorted)
        a, b = np.asarray(g[name]), np.asarray(g_alt[name])
        scale = gmax if name in zero else float(np.max(np.abs(a)))
        nodes[name] = float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)
    dx_rel = float(jnp.max(jnp.abs(dx - dx_alt)) / jnp.max(jnp.abs(dx)))
    moved = {pool: int(jnp.sum(sigma[pool] != sigma_alt[pool])) for pool in sigma}
    return RoutingReport(kind, moved, float(loss), float(loss_alt), nodes, zero, dx_rel)


# ---- a constructed non-twin tie ----------------------------------------------------------------

# The convs upstream of each net's first pool. Reduced to their centre tap they read one pixel, so
# on flat images many cells of the first pool's input share a value because they share a PIXEL,
# not a receptive field: the off-centre taps are 0, not absent, and tell them apart once they move.
FIRST_POOL_CONVS = {"cifar8": ("conv1.weight", "conv2.weight"), "resnet34": ("conv1.weight",)}


def centre_tap(params: dict, names: Sequence[str]) -> dict:
    """params with each named conv kernel [O,C,kh,kw] reduced to its centre tap (the others set to 0)."""
    out = dict(params)
    for name in names:
        w = params[name]
        ch, cw = w.shape[2] // 2, w.shape[3] // 2
        out[name] = jnp.zeros_like(w).at[:, :, ch, cw].set(w[:, :, ch, cw])
    return out


def planted_tie(net, params: dict) -> dict:
    """A non-twin tie point (with flat images): the convs before the first pool reduced to their centre tap."""
    return centre_tap(params, FIRST_POOL_CONVS[net.NAME])


# ---- one-sided slopes along a direction ---------------------------------------------------------

# h as a fraction of the first-order radius to the nearest kink that is not at the point itself:
# [−2h, 2h] then holds no other kink.
RADIUS_FRACTION = 0.1
# One-sided second-order differences carry O(h²·|L'''|) truncation and O(ε·|L|/h) round-off; at a
# smooth point the two sides agree far below this, relative to the larger slope.
SLOPE_REL = 1e-4


def direction(params: dict, names: Sequence[str], key) -> dict:
    """A random direction in the named parameters (zero elsewhere), unit Euclidean norm overall."""
    v = {name: jax.random.normal(jax.random.fold_in(key, i), params[name].shape, params[name].dtype)
         for i, name in enumerate(names)}
    norm = jnp.sqrt(sum(jnp.sum(a * a) for a in v.values()))
    return {name: (v[name] / norm if name in v else jnp.zeros_like(p)) for name, p in params.items()}


@partial(jax.jit, static_argnums=(0, 3))
def _read_tangents(net, params, x, cfg, v):
    def read(p):
        _, saved = net.forward(p, x, cfg)
        return net.pool_inputs(saved), net.preactivations(saved)
    return jax.jvp(read, (params,), (v,))


def kink_radius(net, params: dict, x: jax.Array, cfg, v: dict) -> float:
    """First-order distance along v to the nearest kink that is not already at the point: a ReLU
    input z ≠ 0 reaching 0, or a live window's selected cell meeting a cell below it (cells tied
    with it now — twins or a planted tie — are left out). The tangents come from the autodiff oracle."""
    (pools, pre), (dpools, dpre) = _read_tangents(net, params, x, cfg, v)
    radius = np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        for layer in pre:
            z, dz = np.asarray(pre[layer]), np.asarray(dpre[layer])
            radius = min(radius, float(np.min(np.where((z != 0) & (dz != 0), np.abs(z / dz), np.inf))))
        for pool, spec in net.POOLS.items():
            w = np.asarray(maxpool.windows(pools[pool], spec))
            dw = np.nan_to_num(np.asarray(maxpool.windows(dpools[pool], spec)), nan=0.0, posinf=0.0, neginf=0.0)
            first = np.argmax(w, axis=-1)[..., None]
            top, dtop = np.take_along_axis(w, first, -1), np.take_along_axis(dw, first, -1)
            gap, dgap = top - w, dtop - dw
            hit = np.isfinite(w) & (top > 0) & (gap > 0) & (dgap < 0)   # the gap shrinks along +v
            hit_back = np.isfinite(w) & (top > 0) & (gap > 0) & (dgap > 0)   # … along −v
            radius = min(radius, float(np.min(np.where(hit | hit_back, gap / np.abs(dgap), np.inf))))
    return radius


@dataclass
class SlopeReport:
    ts: np.ndarray          # steps t along v (for the figure), both signs
    losses: np.ndarray      # L(θ + t·v) − L(θ)
    h: float                # the step of the one-sided differences
    radius: float           # first-order radius to the nearest other kink
    left: float             # one-sided slope from t < 0 (second order)
    right: float            # one-sided slope from t > 0
    rendered: float         # ⟨rendered gradient, v⟩

    @property
    def jump(self) -> float:
        return self.right - self.left

    @property
    def smooth(self) -> bool:
        return abs(self.jump) <= SLOPE_REL * max(abs(self.left), abs(self.right))

    def summary(self) -> str:
        verdict = "agree" if self.smooth else "DIFFER"
        return (f"one-sided slopes {verdict}: left {self.left:.4f}, right {self.right:.4f}, "
                f"rendered {self.rendered:.4f}")


@partial(jax.jit, static_argnums=(0, 4))
def _loss_along(net, params, x, targets, cfg, v, t):
    logits, _ = net.forward({k: params[k] + t * v[k] for k in params}, x, cfg)
    return head.forward(logits, targets)


def one_sided_slopes(net, params: dict, x: jax.Array, targets: jax.Array, cfg, v: dict, *,
                     span: float = 1e-3, points: int = 41) -> SlopeReport:
    """The loss along θ + t·v and its one-sided slopes at t = 0.

    right = (−3L(0) + 4L(h) − L(2h)) / 2h, left the mirror image; h = RADIUS_FRACTION × the radius
    to the nearest other kink (capped at `span`/10), so each side sees one smooth piece. At a smooth
    point both equal ⟨∇L, v⟩; at a non-twin tie they differ. The losses for a figure are taken at
    `points` steps t over ±min(radius, span).
    """
    if jnp.ndim(targets) == 1:
        targets = head.one_hot(targets, cfg.num_classes, x.dtype)
    radius = kink_radius(net, params, x, cfg, v)
    h = min(RADIUS_FRACTION * radius, span / 10)

    def loss(t):
        return float(_loss_along(net, params, x, targets, cfg, v, jnp.asarray(t, x.dtype)))

    l0, lp, lp2, lm, lm2 = (loss(t) for t in (0.0, h, 2 * h, -h, -2 * h))
    right = (-3 * l0 + 4 * lp - lp2) / (2 * h)
    left = (3 * l0 - 4 * lm + lm2) / (2 * h)
    ts = np.linspace(-1.0, 1.0, points) * min(radius, span)
    losses = np.array([loss(t) for t in ts]) - l0
    _, g, _ = gradients_at(net, params, x, targets, cfg,
                           {p: maxpool.select(r, net.POOLS[p]) for p, r in
                            pool_inputs(net, params, x, cfg).items()})
    rendered = float(sum(jnp.vdot(g[k], v[k]) for k in g))
    return SlopeReport(ts, losses, h, radius, left, right, rendered)
