"""The smooth-point census: classify every max-pool window, flag ReLU inputs that are exactly 0, and
read off which of the Lean suite's three smooth-point hypotheses holds.

Each window of a pool, per example and channel, is read from the pre-activations z that feed
ReLU → pool (chapter Pools):

- dead: every cell has z ≤ 0 and reads 0 after the ReLU (z < 0: the pooled 0 stays nearby, whatever
  cell is chosen; a z exactly 0 is flagged on its own); strict: the maximum is above every other cell;
- twin tie: the maximum is attained only at twins — cells equal for every value of every weight
  upstream (found by equality under random draws of all the net's weights); a twin tie never
  breaks, so the parameter gradient is the same whichever twin the backward takes;
- non-twin tie: no hypothesis holds; the loss is not differentiable there.

The suite states three different smooth-point hypotheses, and one census reads all three:

| hypothesis | Lean | windows allowed | ReLU inputs off 0 |
|---|---|---|---|
| parameter gradients | `cifar8Bbn_net_lossGrad` (`Cifar8BbnLossSmoothAt`, C8PoolTwin₁…₄), `r34_net_lossGrad` (`R34LossSmoothAtB`) | dead, strict, twin tie | every one |
| ResNet-34 input gradient | `r34InputGradB_correct` (`h_stem`, `h_pool`: `StemPoolSmoothAt`) | dead (all zero), strict | the stem's (`h_stem`); the blocks' sit inside their `HasVJPDiffAt` witnesses hb₁…hb₁₆ |
| cifar8 input gradient | `cifar8BbnInputGradB_correct` (`Cifar8BbnSmoothAt`, `MaxPool2Smooth`) | strict only (a dead window ties its zeros) | c8Z₁…c8Z₈ and the two head pre-activations |

`SmoothReport.ok` is the parameter-gradient hypothesis (`gradtie check` exits 2 on it); a net the suite
does not name gets that one only. Node ties (`r34_net_tiedB`, …) carry none. Shown in: Pools, Stage germs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import rendered
from ..host import to_device
from ..kit import KIT
from ..nets import protocol
from ..nets.layers import zero_in_reals
from ..nets.protocol import require_net
from ..ops import maxpool
from ..tolerances import RADIUS_FRACTION, ROUTE_REL, SLOPE_REL, TWIN_REL
from . import fd
from .tie import compare, piece_of, targets_matrix

CLASSES = ("dead", "strict", "twin tie", "non-twin tie")
DEAD, STRICT, TWIN, NON_TWIN = range(4)
# A violating window is named by its class: a dead window breaks only MaxPool2Smooth.
WINDOW_KINDS = ("dead window", "strict", "twin tie", "non-twin tie")
# Fresh draws of every upstream weight that twins must stay equal under: one parts non-twins with
# probability 1 (different polynomials in the weights); three guard against a near coincidence.
DRAWS = 3
MAX_LISTED = 20
PARAMETERS, R34_INPUT, C8_INPUT = "parameters", "resnet34_input", "cifar8_input"


# ---- the report ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Violation:
    kind: str                 # "non-twin tie", "twin tie", "dead window" or "zero pre-activation"
    layer: str                # the pool (windows) or the layer whose output feeds a ReLU (zeros)
    example: int
    channel: int              # the channel, or a dense layer's unit
    where: tuple[int, ...]    # window (i, j); cell (h, w) for a zero; () for a dense unit

    def describe(self) -> str:
        if not self.where:   # a dense layer: its unit stands where a channel would
            return f"{self.kind} at {self.layer}, example {self.example}, unit {self.channel}"
        return (f"{self.kind} at {self.layer}, example {self.example}, channel {self.channel}, "
                f"{'cell' if self.kind == 'zero pre-activation' else 'window'} {self.where}")


@dataclass
class PoolCensus:
    pool: str
    preactivation: str
    classes: np.ndarray       # [N,C,H',W'] int: DEAD / STRICT / TWIN / NON_TWIN
    margin: float             # smallest gap between a live window's maximum and its nearest non-twin cell
    dead_margin: float        # smallest distance of a dead window's maximum below 0
    negative: float = np.nan  # share of the pool-feeding cells with z < 0
    independent: float = np.nan  # the dead share if a window's k² cells were independent: mean_c q_c^(k²)

    @property
    def counts(self) -> dict[str, int]:
        return {name: int(np.sum(self.classes == i)) for i, name in enumerate(CLASSES)}

    @property
    def windows(self) -> int:
        return int(self.classes.size)

    @property
    def dead(self) -> float:
        return self.counts["dead"] / self.windows

    @property
    def lift(self) -> float:
        """How many times more dead windows than independent cells give (neighbours correlate)."""
        return self.dead / self.independent if self.independent > 0 else np.inf

    def listed(self, classes: Sequence[int]) -> tuple[Violation, ...]:
        """The first MAX_LISTED windows of the given classes, in (example, channel, i, j) order."""
        return tuple(Violation(WINDOW_KINDS[int(self.classes[n, c, i, j])], self.pool, n, c, (i, j))
                     for n, c, i, j in _locations(np.isin(self.classes, classes)))


@dataclass(frozen=True)
class Clause:
    """One clause of a hypothesis: what it asks, how many windows or cells break it, the first few."""
    name: str                          # the clause as the suite names it, e.g. "h_pool (StemPoolSmoothAt)"
    asks: str                          # what it asks, in words
    violated: int                      # windows or cells that break it
    listed: tuple[Violation, ...] = ()  # the first MAX_LISTED of them

    @property
    def holds(self) -> bool:
        return self.violated == 0


@dataclass(frozen=True)
class Hypothesis:
    """One smooth-point hypothesis of the suite, read at one point: it holds when every clause does."""
    key: str                  # PARAMETERS, R34_INPUT or C8_INPUT
    name: str                 # "parameter gradients", "ResNet-34 input gradient", "cifar8 input gradient"
    lean: str                 # the statement whose hypothesis this is
    clauses: tuple[Clause, ...]

    @property
    def holds(self) -> bool:
        return all(c.holds for c in self.clauses)

    @property
    def violated(self) -> int:
        """Windows and cells that break a clause (a cell counted once per clause it breaks)."""
        return sum(c.violated for c in self.clauses)

    @property
    def violations(self) -> list[Violation]:
        """The first MAX_LISTED violations of each clause, clause by clause."""
        return [v for c in self.clauses for v in c.listed]

    @property
    def first(self) -> Optional[Violation]:
        """The first violation of the first clause that fails (None when the hypothesis holds)."""
        return next((c.listed[0] for c in self.clauses if c.listed), None)

    @property
    def broken(self) -> str:
        return ", ".join(f"{c.name} ×{c.violated}" for c in self.clauses if not c.holds)

    def verdict(self) -> str:
        """One short phrase: "parameter gradients hold", or which clauses break and how often."""
        plural = self.name.endswith("s")
        return (f"{self.name} {'hold' if plural else 'holds'}" if self.holds else
                f"{self.name} {'FAIL' if plural else 'FAILS'} ({self.broken})")

    def summary(self) -> str:
        """The verdict, and the first violation when it fails."""
        first = self.first.describe() if self.first else "unlisted"
        return f"{self.name}: holds" if self.holds else f"{self.name}: fails ({self.broken}); first: {first}"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "lean": self.lean, "holds": self.holds,
                "clauses": [{"name": c.name, "asks": c.asks, "violated": c.violated, "holds": c.holds}
                            for c in self.clauses],
                "violations": [v.__dict__ for v in self.violations]}


def _r34_input(zeros, windows, layers) -> Hypothesis:
    return Hypothesis(R34_INPUT, "ResNet-34 input gradient", "r34InputGradB_correct", (
        zeros("h_stem (R34StemSmoothAt)", "the stem ReLU off its kink", [k for k in layers if k in ("bn1", "?")]),
        windows("h_pool (StemPoolSmoothAt)", "each window's maximum at one position, or the window all zero",
                (TWIN, NON_TWIN)),
        zeros("hb₁…hb₁₆ (blocks' relu clauses)", "the ReLUs inside the sixteen HasVJPDiffAt witnesses off "
              "their kinks", [k for k in layers if k != "bn1"])))


def _c8_input(zeros, windows, layers) -> Hypothesis:
    return Hypothesis(C8_INPUT, "cifar8 input gradient", "cifar8BbnInputGradB_correct", (
        windows("MaxPool2Smooth (pools 1…4)", "every window's maximum attained once", (DEAD, TWIN, NON_TWIN)),
        zeros("c8Z₁…c8Z₈ off zero", "the eight conv pre-activations off their kinks",
              [k for k in layers if not k.startswith("fc")]),
        zeros("head pre-activations off zero", "fc1 and fc2 off their kinks",
              [k for k in layers if k.startswith("fc") or k == "?"])))


class Suite(NamedTuple):
    """A Lean suite's smooth-point hypotheses for its net: the parameter-gradient statement, where
    its pool windows lie, and its input-gradient hypothesis (zeros, windows, layers) -> Hypothesis."""
    lean: str
    where: str = ""
    input: Optional[Callable] = None


GENERIC = Suite("the loss differentiable in every parameter")
# the suite's nets, by `Net.suite`: a net of your own reads GENERIC
SUITES = {"resnet34": Suite("r34_net_lossGrad", " (stem pool)", _r34_input),
          "cifar8": Suite("cifar8Bbn_net_lossGrad", " (C8PoolTwin₁…₄)", _c8_input)}


@dataclass
class SmoothReport:
    pools: list[PoolCensus]
    zeros: int                            # ReLU inputs exactly 0
    min_abs_preactivation: float
    violations: list[Violation] = field(default_factory=list)   # the first MAX_LISTED of each kind
    non_twin_ties: int = 0
    zero_counts: dict[str, int] = field(default_factory=dict)    # ReLU inputs exactly 0, per layer
    zero_listed: dict[str, tuple[Violation, ...]] = field(default_factory=dict)  # the first few, per layer
    net: str = ""                         # the net's name
    suite: Optional[str] = None           # the Lean suite's name for the net, when its hypotheses apply

    @property
    def ok(self) -> bool:
        """The parameter-gradient hypothesis: every window dead, strict or twin-tied, no ReLU input 0."""
        return self.zeros == 0 and self.non_twin_ties == 0

    @property
    def hypotheses(self) -> list[Hypothesis]:
        """The hypotheses that apply to the net (module docstring), the parameter one first. Without
        per-layer `zero_counts`, `zeros` count against every zero clause: a zero is never lost."""
        counts = self.zero_counts or {"?": self.zeros}
        layers = list(counts)

        def zeros(name, asks, among):
            listed = [v for layer in among for v in self.zero_listed.get(layer, ())][:MAX_LISTED]
            return Clause(name, asks, sum(counts[layer] for layer in among), tuple(listed))

        def windows(name, asks, classes):
            listed = [v for p in self.pools for v in p.listed(classes)][:MAX_LISTED]
            return Clause(name, asks, sum(int(np.isin(p.classes, classes).sum()) for p in self.pools),
                          tuple(listed))

        # the parameter-gradient hypothesis of each suite: its Lean statement, and where its windows lie
        suite = SUITES.get(self.suite, GENERIC)
        out = [Hypothesis(PARAMETERS, "parameter gradients", suite.lean, (
            windows(f"no non-twin tie{suite.where}", "every window dead, strict or tied only between twins",
                    (NON_TWIN,)),
            zeros("no ReLU input exactly 0", "every ReLU off its kink", layers)))]
        if suite.input is not None:
            out.append(suite.input(zeros, windows, layers))
        return out

    def hypothesis(self, key: str) -> Hypothesis:
        """The verdict of one hypothesis by key (PARAMETERS, R34_INPUT, C8_INPUT) or name."""
        for h in self.hypotheses:
            if key in (h.key, h.name):
                return h
        known = ", ".join(h.key for h in self.hypotheses)
        raise ValueError(f"hypothesis {key!r} does not apply to {self.net}; expected one of {known}")

    def summary(self) -> str:
        counts = ", ".join(f"{sum(p.counts[c] for p in self.pools)} {c}" for c in CLASSES)
        verdicts = "hypotheses: " + ", ".join(h.verdict() for h in self.hypotheses)
        if self.ok:
            return f"smooth point: {counts}; {self.zeros} zero pre-activations; {verdicts}"
        return (f"NOT smooth: {self.non_twin_ties} non-twin ties, {self.zeros} zero pre-activations; "
                f"first: {self.violations[0].describe()}; {verdicts}")

    def pools_table(self) -> str:
        """One row per pool: the window classes and the margin (a measured distance to a tie: where
        BatchNorm divides by a small spread, as on flat images, it carries amplified round-off)."""
        return "\n".join([f"{'pool':<12} {'reads':<10} " + " ".join(f"{c:>13}" for c in CLASSES) + f" {'margin':>9}"] +
                         [f"{p.pool:<12} {p.preactivation:<10} " + " ".join(f"{p.counts[k]:>13}" for k in CLASSES) +
                          f" {p.margin:9.2e}" for p in self.pools])

    def table(self) -> str:
        """The pools table, then the hypotheses clause by clause."""
        return self.pools_table() + "\n\n" + hypotheses_table(self.hypotheses)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary(), "zeros": self.zeros, "non_twin_ties": self.non_twin_ties,
                "min_abs_preactivation": self.min_abs_preactivation,
                "pools": [{"pool": p.pool, "preactivation": p.preactivation, "counts": p.counts,
                           "margin": p.margin, "dead_margin": p.dead_margin} for p in self.pools],
                "violations": [v.__dict__ for v in self.violations], "zero_counts": dict(self.zero_counts),
                "hypotheses": [h.as_dict() for h in self.hypotheses]}


def hypotheses_table(hyps: Sequence[Hypothesis]) -> str:
    """One row per clause: hypothesis, clause, windows or cells breaking it, holds."""
    lines = [f"{'hypothesis':<26} {'clause':<46} {'violated':>9}  holds"]
    for h in hyps:
        for i, c in enumerate(h.clauses):
            lines.append(f"{h.name if i == 0 else '':<26} {c.name:<46} {c.violated:>9}  {'yes' if c.holds else 'NO'}")
        lines.append(f"{'':<26} {'→ ' + h.lean:<46} {h.violated:>9}  {'HOLDS' if h.holds else 'FAILS'}")
    return "\n".join(lines)


# ---- the point read (off `rendered.forward`: the forward the census, the germs, the tie and the FD
# all run), and the census -------------------------------------------------------------------------

def pool_inputs(net, params: dict, x: jax.Array, cfg) -> dict[str, jax.Array]:
    """Each pool's (post-ReLU) input at (params, x): {pool: [N,C,H,W]}."""
    return net.pool_inputs(rendered.forward(net, params, x, cfg)[1])


def preactivations(net, params: dict, x: jax.Array, cfg) -> dict[str, np.ndarray]:
    """Every ReLU's input at (params, x): {layer: [N,C,H,W] or [N,d]}."""
    saved = rendered.forward(net, params, x, cfg)[1]
    return {k: np.asarray(v) for k, v in net.preactivations(saved).items()}


def selections(net, params: dict, x: jax.Array, cfg) -> dict[str, jax.Array]:
    """σ = argmax (the first maximal cell) of every pool window at (params, x): {pool: [N,C,H',W']}."""
    return piece_of(net, rendered.forward(net, params, x, cfg)[1])[1]


def pool_stages(net, cfg, saved) -> list[int]:
    """The indices of the stages holding a pool. saved: the forward's record (arrays or shapes)."""
    return [i for i, st in enumerate(net.stage_list(net.cfg(cfg))) if st.pool_inputs(saved[st.name])]


def classify(z: np.ndarray, draws: list[np.ndarray], spec: maxpool.PoolSpec, rel: float):
    """Classes [N,C,H',W'], the live margin and the dead margin, from pre-activations z and draws."""
    win = maxpool.windows(np.asarray(z), spec)                                 # [N,C,H',W',k²]
    first = np.argmax(win, axis=-1)[..., None]
    top = np.take_along_axis(win, first, axis=-1)
    # a cell is the max's twin when it equals the max under the actual weights and every draw
    twin = np.abs(win - top) <= rel * np.maximum(np.abs(top), 1e-300)
    for zr in draws:
        wr = maxpool.windows(np.asarray(zr), spec)
        scale = np.max(np.abs(zr), axis=(0, 2, 3))[None, :, None, None, None]   # per channel
        twin &= np.abs(wr - np.take_along_axis(wr, first, axis=-1)) <= rel * scale
    m = top[..., 0]
    classes = np.full(m.shape, STRICT, np.int8)
    classes[twin.sum(-1) > 1] = TWIN
    classes[((win == top) & ~twin).any(-1)] = NON_TWIN
    # every cell reads 0 after the ReLU (a maximum exactly 0 is also a zero pre-activation)
    classes[m <= 0] = DEAD
    gaps = (m - np.where(twin, -np.inf, win).max(-1))[m > 0]
    margin = float(np.min(gaps)) if gaps.size else np.inf
    return classes, margin, float(np.min(-m[m < 0])) if np.any(m < 0) else np.inf


def _locations(mask: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in np.argwhere(mask)[:MAX_LISTED]]


def smoothness(net, params: dict, x: jax.Array, cfg, *, key: Optional[jax.Array] = None,
               draws: int = DRAWS) -> SmoothReport:
    """The census of every pool window and ReLU input of `net` at (params, x), with the verdict of
    each smooth-point hypothesis that applies to the net (`SmoothReport.hypotheses`)."""
    dtype = np.dtype(x.dtype).name
    if draws < 1:
        raise ValueError(f"smoothness: draws must be at least 1 (twins are found under fresh weights), got {draws}")
    if dtype not in TWIN_REL:
        raise ValueError(f"smoothness: images must be {' or '.join(TWIN_REL)} (twins are told apart at that dtype's "
                         f"round-off), got {dtype}")
    require_net(net, "census.smoothness")
    key = jax.random.key(0) if key is None else key
    pre = preactivations(net, params, x, cfg)
    # fresh draws of every weight (init's drawn weights: γ ~ U(0.5, 1.5), β and biases nonzero), in
    # params' dtypes: twins are told apart by any generic draw, and this program drew the point's weights
    drawn = [preactivations(net, {k: to_device(a, params[k].dtype) for k, a in
                                  net.init(jax.random.fold_in(key, r), cfg, weights="drawn").items()}, x, cfg)
             for r in range(draws)]
    pools = []
    for pool, spec in net.pools.items():
        layer = net.pool_preactivations[pool]
        q = (pre[layer] < 0).mean(axis=(0, 2, 3))    # per channel
        pools.append(PoolCensus(pool, layer, *classify(pre[layer], [d[layer] for d in drawn], spec, TWIN_REL[dtype]),
                                float((pre[layer] < 0).mean()), float(np.mean(q ** spec.size ** 2))))
    # conv layers give (n, c, h, w); dense layers (n, unit) with no spatial cell
    zero_listed = {layer: tuple(Violation("zero pre-activation", layer, loc[0], loc[1], tuple(loc[2:]))
                                for loc in _locations(z == 0)) for layer, z in pre.items()}
    zero_counts = {layer: int((z == 0).sum()) for layer, z in pre.items()}
    # the first MAX_LISTED of each kind, so that many ties cannot hide a zero
    violations = ([v for p in pools for v in p.listed((NON_TWIN,))][:MAX_LISTED]
                  + [v for listed in zero_listed.values() for v in listed][:MAX_LISTED])
    return SmoothReport(pools, sum(zero_counts.values()), float(min((np.min(np.abs(z)) for z in pre.values()),
                                                                    default=np.inf)),
                        violations, sum(p.counts["non-twin tie"] for p in pools), zero_counts, zero_listed,
                        net.name, net.suite)


# ---- constructed points: every hypothesis holding, and a non-twin tie ----------------------------

# How far above 0 `lift_dead_windows` puts a channel's lowest window maximum, in units of its γ (the
# spread of its pre-activations): far from the kink at 0, the other cells where the draw put them.
LIFT_MARGIN = 0.1


def lift_dead_windows(net, params: dict, x: jax.Array, cfg, *, margin: float = LIFT_MARGIN) -> dict:
    """params with each pool-feeding BatchNorm's shift β raised, channel by channel, just enough that
    every window has a cell at least margin·γ above 0 (β moves a channel's cells alike: strict windows
    stay strict), pools in forward order. At images without twins (randn) all three hypotheses then
    hold: the constructed point where even `MaxPool2Smooth` holds."""
    net, out = net, dict(params)
    for pool, spec in net.pools.items():
        layer = net.pool_preactivations[pool]
        z = preactivations(net, out, x, cfg)[layer]
        lowest = maxpool.windows(np.asarray(z), spec).max(-1).min(axis=(0, 2, 3))   # [C]
        shift = np.maximum(0.0, margin * np.abs(np.asarray(out[f"{layer}.weight"])) - lowest)
        out[f"{layer}.bias"] = out[f"{layer}.bias"] + jnp.asarray(shift, out[f"{layer}.bias"].dtype)
    return out


def planted_tie(net, params: dict) -> dict:
    """A non-twin tie point (with flat images): the convs up to the net's first pool (every rank-4
    weight of the stages up to the first that pools) reduced to their centre tap, the other taps set
    to 0. They then read one pixel, so on flat images many cells of the first pool's input share a
    value because they share a PIXEL, not a receptive field: the off-centre taps are 0, not absent,
    and tell them apart once they move."""
    shapes, x = protocol.abstract_inputs(net)
    pooling = pool_stages(net, None, jax.eval_shape(lambda p, a: net.forward(p, a)[1], shapes, x))
    if not pooling:
        raise ValueError(f"{net.name} has no max pool: no non-twin tie can be planted")
    out = dict(params)
    for name in (n for st in net.stage_list(net.config())[:pooling[0] + 1] for n in st.params
                 if n.endswith(".weight") and len(shapes[n].shape) == 4):
        w = params[name]
        ch, cw = w.shape[2] // 2, w.shape[3] // 2
        out[name] = jnp.zeros_like(w).at[:, :, ch, cw].set(w[:, :, ch, cw])
    return out


# ---- routing: the backward at another selection ------------------------------------------------

def rerouted(net, params: dict, x: jax.Array, cfg, report: SmoothReport, kind: str) -> tuple[dict, dict]:
    """(σ, σ'): σ = argmax for every pool; σ' the same except that every window of class `kind`
    ("dead", "twin tie" or "non-twin tie") routes to its last maximal cell on the pool input."""
    if kind not in CLASSES:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(CLASSES)}")
    inputs, sigma = pool_inputs(net, params, x, cfg), selections(net, params, x, cfg)
    return sigma, {pool: jnp.where(jnp.asarray(p.classes == CLASSES.index(kind)),
                                   maxpool.last_max(inputs[pool], net.pools[pool]), sigma[pool])
                   for pool, p in zip(net.pools, report.pools)}


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
        loss = "unchanged" if self.loss == self.loss_rerouted else "CHANGED"
        return (f"rerouted {sum(self.rerouted.values())} {self.kind} windows: loss {loss}; parameter gradient "
                f"{'the same' if self.same_parameter_gradient else 'DIFFERENT'} (to {ROUTE_REL:.0e}); "
                f"input gradient {'the same' if self.same_input_gradient else 'different'}")


def routing(net, params: dict, x: jax.Array, targets: jax.Array, cfg, report: SmoothReport,
            kind: str = "twin tie") -> RoutingReport:
    """The rendered gradients at σ = argmax against those at σ' (windows of class `kind` routed to
    their last maximal cell), node by node as a tie compares them (`tie.compare`), with the gather
    model and its transpose selScatter frozen at each. targets: labels [N] or rows [N,K]."""
    targets = targets_matrix(targets, cfg.num_classes, x.dtype)
    sigma, sigma_alt = rerouted(net, params, x, cfg, report, kind)
    at, alt = (rendered.compiled(net, KIT, params, x, targets, cfg, selections=s) for s in (sigma, sigma_alt))
    zero = zero_in_reals(params)
    rel = {r.name: r.rel for r in compare(alt.grads, at.grads, zero_nodes=zero, dx=(alt.dx, at.dx))}
    return RoutingReport(kind, {pool: int(jnp.sum(sigma[pool] != sigma_alt[pool])) for pool in sigma},
                         float(at.loss), float(alt.loss), {n: rel[n] for n in params},   # in signature order
                         tuple(n for n in params if n in zero), rel["input"])


# ---- one-sided slopes along a direction ---------------------------------------------------------

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
        return (f"one-sided slopes {'agree' if self.smooth else 'DIFFER'}: left {self.left:.4f}, "
                f"right {self.right:.4f}, rendered {self.rendered:.4f}")


def one_sided_slopes(net, params: dict, x: jax.Array, targets: jax.Array, cfg, v: dict, *,
                     span: float = 1e-3, points: int = 41) -> SlopeReport:
    """The loss along θ + t·v (v: `fd.direction`; at `points` steps over ±min(radius, span), for a
    figure) and its one-sided slopes at t = 0 (`fd.one_sided`) at h = RADIUS_FRACTION × the
    first-order radius to the nearest kink not already at the point (`fd.radii`), capped at span/10:
    each side sees one smooth piece. At a smooth point both equal ⟨∇L, v⟩; at a non-twin tie they part."""
    path = fd.Path(v, jax.tree.map(jnp.zeros_like, v), tuple(v))
    radius = min(fd.radii(net, params, x, cfg, path, selections(net, params, x, cfg), order=1))
    h = min(RADIUS_FRACTION * radius, span / 10)

    def loss(t):
        return float(fd.path_losses(net, params, x, targets, cfg, path, [t])[0])

    ts = np.linspace(-1.0, 1.0, points) * min(radius, span)
    g = rendered.compiled(net, KIT, params, x, targets_matrix(targets, cfg.num_classes, x.dtype), cfg).grads
    return SlopeReport(ts, fd.path_losses(net, params, x, targets, cfg, path, ts) - loss(0.0), h, radius,
                       *fd.one_sided(loss, h), float(sum(jnp.vdot(g[k], v[k]) for k in g)))
