"""The smooth-point census: classify every max-pool window, flag ReLU inputs that are exactly 0, and
read off which of the Lean suite's three smooth-point hypotheses holds.

Each window of a pool, per example and channel, is read from the pre-activations z that feed
ReLU → pool (SPEC §5):

- dead: every cell has z ≤ 0, so every cell reads 0 after the ReLU (z < 0: the pooled value stays
  0 nearby, whatever cell is chosen; a z exactly 0 is flagged on its own);
- strict: the maximum is strictly above every other cell;
- twin tie: the maximum is attained only at twins — cells equal for every value of every weight
  upstream (the image fixed); a twin tie never breaks, so the parameter gradient is the same
  whichever twin the backward routes to;
- non-twin tie: no hypothesis holds; the loss is not differentiable there.

Twins are found by equality under random draws of all the net's weights (conv weights and biases,
γ, β): equal values as functions of the weights stay equal under every draw, unequal ones part.

The suite states three different smooth-point hypotheses, and one census reads all three:

| hypothesis | Lean | windows allowed | ReLU inputs off 0 |
|---|---|---|---|
| parameter gradients | `cifar8Bbn_net_lossGrad` (`Cifar8BbnLossSmoothAt`, C8PoolTwin₁…₄), `r34_net_tiedB` | dead, strict, twin tie | every one |
| ResNet-34 input gradient | `r34InputGradB_correct` (`h_stem`, `h_pool`: `StemPoolSmoothAt`) | dead (all zero), strict | the stem's (`h_stem`); the blocks' sit inside their `HasVJPDiffAt` witnesses hb₁…hb₁₆ |
| cifar8 input gradient | `cifar8BbnInputGradB_correct` (`Cifar8BbnSmoothAt`, `MaxPool2Smooth`) | strict only (a dead window ties its zeros) | c8Z₁…c8Z₈ and the two head pre-activations |

`SmoothReport.ok` is the parameter-gradient hypothesis (the one `gradtie check` exits 2 on);
`SmoothReport.hypotheses` gives each hypothesis that applies to the net its own verdict. Shown in:
Pools, Stage germs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng, reference, rendered
from ..host import to_device
from ..kit import KIT
from ..nets import protocol
from ..nets.protocol import Net, as_net
from ..ops import head, maxpool
from ..tolerances import RADIUS_FRACTION, ROUTE_REL, SLOPE_REL, TWIN_REL

CLASSES = ("dead", "strict", "twin tie", "non-twin tie")
DEAD, STRICT, TWIN, NON_TWIN = range(4)
# A violating window is named by its class: a dead window breaks only MaxPool2Smooth.
WINDOW_KINDS = ("dead window", "strict", "twin tie", "non-twin tie")

# Fresh draws of every upstream weight that twins must stay equal under. One draw already parts
# non-twins with probability 1 (their values are different polynomials in the weights); three guard
# against a draw that happens to land near a coincidence.
DRAWS = 3
MAX_LISTED = 20

PARAMETERS, R34_INPUT, C8_INPUT = "parameters", "resnet34_input", "cifar8_input"


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
        what = "cell" if self.kind == "zero pre-activation" else "window"
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

    def listed(self, classes: Sequence[int]) -> tuple[Violation, ...]:
        """The first MAX_LISTED windows of the given classes, in (example, channel, i, j) order."""
        bad = np.isin(self.classes, classes)
        return tuple(Violation(WINDOW_KINDS[int(self.classes[n, c, i, j])], self.pool, n, c, (i, j))
                     for n, c, i, j in _locations(bad))


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

    def verdict(self) -> str:
        """One short phrase: "parameter gradients hold", or which clauses break and how often."""
        if self.holds:
            return f"{self.name} hold" if self.name.endswith("s") else f"{self.name} holds"
        broken = ", ".join(f"{c.name} ×{c.violated}" for c in self.clauses if not c.holds)
        return f"{self.name} FAIL ({broken})" if self.name.endswith("s") else f"{self.name} FAILS ({broken})"

    def summary(self) -> str:
        """The verdict, and the first violation when it fails."""
        if self.holds:
            return f"{self.name}: holds"
        broken = ", ".join(f"{c.name} ×{c.violated}" for c in self.clauses if not c.holds)
        first = self.first.describe() if self.first is not None else "unlisted"
        return f"{self.name}: fails ({broken}); first: {first}"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "lean": self.lean, "holds": self.holds,
                "clauses": [{"name": c.name, "asks": c.asks, "violated": c.violated, "holds": c.holds}
                            for c in self.clauses],
                "violations": [v.__dict__ for v in self.violations]}


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
    def net_name(self) -> str:
        return self.net

    @property
    def hypotheses(self) -> list[Hypothesis]:
        """Each hypothesis that applies to the net, the parameter-gradient one first: cifar8 →
        [parameters, cifar8_input]; ResNet-34 → [parameters, resnet34_input]; a net the suite does
        not name → [parameters] (the generic one: smooth ReLU inputs and pool windows)."""
        return hypotheses(self)

    def hypothesis(self, key: str) -> Hypothesis:
        """The verdict of one hypothesis by key (PARAMETERS, R34_INPUT, C8_INPUT) or name."""
        for h in self.hypotheses:
            if key in (h.key, h.name):
                return h
        known = ", ".join(h.key for h in self.hypotheses)
        raise ValueError(f"hypothesis {key!r} does not apply to {self.net_name}; expected one of {known}")

    def summary(self) -> str:
        total = {c: sum(p.counts[c] for p in self.pools) for c in CLASSES}
        counts = ", ".join(f"{v} {k}" for k, v in total.items())
        verdicts = "hypotheses: " + ", ".join(h.verdict() for h in self.hypotheses)
        if self.ok:
            return f"smooth point: {counts}; {self.zeros} zero pre-activations; {verdicts}"
        return (f"NOT smooth: {self.non_twin_ties} non-twin ties, {self.zeros} zero pre-activations; "
                f"first: {self.violations[0].describe()}; {verdicts}")

    def pools_table(self) -> str:
        """One row per pool: the window classes and the margin (a measured distance to a tie: where
        BatchNorm divides by a small spread, as on flat images, it carries amplified round-off)."""
        lines = [f"{'pool':<12} {'reads':<10} " + " ".join(f"{c:>13}" for c in CLASSES) + f" {'margin':>9}"]
        for p in self.pools:
            c = p.counts
            lines.append(f"{p.pool:<12} {p.preactivation:<10} " +
                         " ".join(f"{c[k]:>13}" for k in CLASSES) + f" {p.margin:9.2e}")
        return "\n".join(lines)

    def table(self) -> str:
        """The pools table, then the hypotheses clause by clause."""
        return self.pools_table() + "\n\n" + hypotheses_table(self.hypotheses)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary(), "zeros": self.zeros,
                "non_twin_ties": self.non_twin_ties,
                "min_abs_preactivation": self.min_abs_preactivation,
                "pools": [{"pool": p.pool, "preactivation": p.preactivation, "counts": p.counts,
                           "margin": p.margin, "dead_margin": p.dead_margin} for p in self.pools],
                "violations": [v.__dict__ for v in self.violations],
                "zero_counts": dict(self.zero_counts),
                "hypotheses": [h.as_dict() for h in self.hypotheses]}


def hypotheses_table(hyps: Sequence[Hypothesis]) -> str:
    """One row per clause: hypothesis, clause, windows or cells breaking it, holds."""
    lines = [f"{'hypothesis':<26} {'clause':<46} {'violated':>9}  holds"]
    for h in hyps:
        for i, c in enumerate(h.clauses):
            label = h.name if i == 0 else ""
            lines.append(f"{label:<26} {c.name:<46} {c.violated:>9}  {'yes' if c.holds else 'NO'}")
        lines.append(f"{'':<26} {'→ ' + h.lean:<46} {h.violated:>9}  {'HOLDS' if h.holds else 'FAILS'}")
    return "\n".join(lines)


# ---- the three hypotheses ---------------------------------------------------------------------

def _zero_clause(report: SmoothReport, name: str, asks: str, layers: Sequence[str]) -> Clause:
    listed = [v for layer in layers for v in report.zero_listed.get(layer, ())][:MAX_LISTED]
    return Clause(name, asks, sum(report.zero_counts.get(layer, 0) for layer in layers), tuple(listed))


def _window_clause(report: SmoothReport, name: str, asks: str, classes: Sequence[int]) -> Clause:
    listed = [v for p in report.pools for v in p.listed(classes)][:MAX_LISTED]
    return Clause(name, asks, sum(int(np.isin(p.classes, classes).sum()) for p in report.pools), tuple(listed))


def hypotheses(report: SmoothReport) -> list[Hypothesis]:
    """The verdicts of the hypotheses that apply to the report's net (see the module docstring).

    A report built without per-layer zero counts (`zero_counts` empty) counts its `zeros` against
    every zero clause, so a zero is never lost."""
    layers = list(report.zero_counts) or ["?"]
    zero_counts = report.zero_counts or {"?": report.zeros}
    report = SmoothReport(report.pools, report.zeros, report.min_abs_preactivation, report.violations,
                          report.non_twin_ties, zero_counts, report.zero_listed, report.net, report.suite)
    every_relu = _zero_clause(report, "no ReLU input exactly 0", "every ReLU off its kink", layers)
    if report.suite is None:
        return [Hypothesis(PARAMETERS, "parameter gradients", "the loss differentiable in every parameter", (
            _window_clause(report, "no non-twin tie", "every window dead, strict or tied only between twins",
                           (NON_TWIN,)),
            every_relu))]
    if report.suite == "resnet34":
        stem, blocks = [k for k in layers if k in ("bn1", "?")], [k for k in layers if k not in ("bn1",)]
        param = Hypothesis(PARAMETERS, "parameter gradients", "r34_net_tiedB", (
            _window_clause(report, "no non-twin tie (stem pool)",
                           "every window dead, strict or tied only between twins", (NON_TWIN,)),
            every_relu))
        r34 = Hypothesis(R34_INPUT, "ResNet-34 input gradient", "r34InputGradB_correct", (
            _zero_clause(report, "h_stem (R34StemSmoothAt)", "the stem ReLU off its kink", stem),
            _window_clause(report, "h_pool (StemPoolSmoothAt)",
                           "each window's maximum at one position, or the window all zero", (TWIN, NON_TWIN)),
            _zero_clause(report, "hb₁…hb₁₆ (blocks' relu clauses)",
                         "the ReLUs inside the sixteen HasVJPDiffAt witnesses off their kinks", blocks)))
        return [param, r34]
    convs = [k for k in layers if not k.startswith("fc")]
    fcs = [k for k in layers if k.startswith("fc") or k == "?"]
    param = Hypothesis(PARAMETERS, "parameter gradients", "cifar8Bbn_net_lossGrad", (
        _window_clause(report, "no non-twin tie (C8PoolTwin₁…₄)",
                       "every window dead, strict or tied only between twins", (NON_TWIN,)),
        every_relu))
    c8 = Hypothesis(C8_INPUT, "cifar8 input gradient", "cifar8BbnInputGradB_correct", (
        _window_clause(report, "MaxPool2Smooth (pools 1…4)", "every window's maximum attained once",
                       (DEAD, TWIN, NON_TWIN)),
        _zero_clause(report, "c8Z₁…c8Z₈ off zero", "the eight conv pre-activations off their kinks", convs),
        _zero_clause(report, "head pre-activations off zero", "fc1 and fc2 off their kinks", fcs)))
    return [param, c8]


# ---- the census --------------------------------------------------------------------------------

def random_weights(net, params: dict, cfg, key) -> dict:
    """A fresh draw of every weight, in params' dtypes: init's drawn weights (conv and dense weights
    as at init, γ ~ U(0.5, 1.5), β and biases nonzero). Twins are told apart by any generic draw;
    this one is the compiled program that drew the point's weights, at another key."""
    drawn = as_net(net).init(key, cfg, weights="drawn")
    return {name: to_device(value, params[name].dtype) for name, value in drawn.items()}


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
    exact_tie = (win == top) & ~twin
    m = top[..., 0]
    classes = np.full(m.shape, STRICT, np.int8)
    classes[twin.sum(-1) > 1] = TWIN
    classes[exact_tie.any(-1)] = NON_TWIN
    # every cell reads 0 after the ReLU (a maximum exactly 0 is also a zero pre-activation)
    classes[m <= 0] = DEAD
    others = np.where(twin, -np.inf, win).max(-1)
    live = m > 0
    gaps = (m - others)[live]
    margin = float(np.min(gaps)) if gaps.size else np.inf
    dead_margin = float(np.min(-m[m < 0])) if np.any(m < 0) else np.inf
    return classes, margin, dead_margin


def _locations(mask: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in np.argwhere(mask)[:MAX_LISTED]]


def _read(net, params, x, cfg):
    """(pool inputs, pre-activations) from the forward every check of a point shares
    (`rendered.forward`): the census, the tie and the finite differences run one program."""
    net = as_net(net)
    _, saved, _ = rendered.forward(net, params, x, cfg)
    return net.pool_inputs(saved), net.preactivations(saved)


def pool_inputs(net, params: dict, x: jax.Array, cfg) -> dict[str, jax.Array]:
    """Each pool's (post-ReLU) input at (params, x): {pool: [N,C,H,W]}."""
    return _read(net, params, x, cfg)[0]


def preactivations(net, params: dict, x: jax.Array, cfg) -> dict[str, np.ndarray]:
    """Every ReLU's input at (params, x): {layer: [N,C,H,W] or [N,d]}."""
    return {k: np.asarray(v) for k, v in _read(net, params, x, cfg)[1].items()}


def smoothness(net, params: dict, x: jax.Array, cfg, *, key: Optional[jax.Array] = None,
               draws: int = DRAWS) -> SmoothReport:
    """The census of every pool window and ReLU input of `net` at (params, x), with the verdict of
    each smooth-point hypothesis that applies to the net (`SmoothReport.hypotheses`)."""
    if draws < 1:
        raise ValueError(f"smoothness: draws must be at least 1 (twins are found under fresh weights), got {draws}")
    net = as_net(net)
    key = jax.random.key(0) if key is None else key
    pre = preactivations(net, params, x, cfg)
    drawn = [preactivations(net, random_weights(net, params, cfg, jax.random.fold_in(key, r)), x, cfg)
             for r in range(draws)]
    dtype = np.dtype(x.dtype).name
    if dtype not in TWIN_REL:
        raise ValueError(f"smoothness: images must be {' or '.join(TWIN_REL)} (twins are told apart at "
                         f"that dtype's round-off), got {dtype}")
    rel = TWIN_REL[dtype]
    violations: list[Violation] = []
    pools, non_twin = [], 0
    for pool, spec in net.pools.items():
        layer = net.pool_preactivations[pool]
        classes, margin, dead_margin = classify(pre[layer], [d[layer] for d in drawn], spec, rel)
        census = PoolCensus(pool, layer, classes, margin, dead_margin)
        pools.append(census)
        non_twin += census.counts["non-twin tie"]
        violations += census.listed((NON_TWIN,))
    zero_counts, zero_listed = {}, {}
    for layer, z in pre.items():
        zero = z == 0
        zero_counts[layer] = int(zero.sum())
        # conv layers give (n, c, h, w); dense layers (n, unit) with no spatial cell
        zero_listed[layer] = tuple(Violation("zero pre-activation", layer, loc[0], loc[1], tuple(loc[2:]))
                                   for loc in _locations(zero))
    zeros = sum(zero_counts.values())
    first_zeros = [v for listed in zero_listed.values() for v in listed][:MAX_LISTED]
    min_abs = float(min((np.min(np.abs(z)) for z in pre.values()), default=np.inf))
    # the first MAX_LISTED of each kind, so that many ties cannot hide a zero
    return SmoothReport(pools, zeros, min_abs, violations[:MAX_LISTED] + first_zeros, non_twin,
                        zero_counts, zero_listed, net.name, net.suite)


# ---- how many windows are dead, and why ----------------------------------------------------------

@dataclass(frozen=True)
class DeadShare:
    """One pool's dead windows against what independent cells would give."""
    pool: str
    negative: float       # share of the pool-feeding cells with z < 0
    independent: float    # the dead share if a window's k² cells were independent: mean over channels of q_c^(k²)
    dead: float           # the dead share the census found

    @property
    def lift(self) -> float:
        """How many times more dead windows than independent cells would give."""
        return self.dead / self.independent if self.independent > 0 else np.inf


def dead_shares(net, params: dict, x: jax.Array, cfg, report: SmoothReport) -> list[DeadShare]:
    """Per pool of `report` (the census at the same point): the share of negative cells q, the dead
    share independent cells would give (q_c^(k²) per channel c, averaged over channels) and the
    dead share found. Neighbouring cells of a photo are correlated, so the found share is larger."""
    net = as_net(net)
    pre = preactivations(net, params, x, cfg)
    out = []
    for p in report.pools:
        z = pre[p.preactivation]
        q = (z < 0).mean(axis=(0, 2, 3))
        cells = net.pools[p.pool].size ** 2
        out.append(DeadShare(p.pool, float((z < 0).mean()), float(np.mean(q ** cells)),
                             p.counts["dead"] / p.windows))
    return out


# ---- a point where every hypothesis holds --------------------------------------------------------

# How far above 0 `lift_dead_windows` puts the lowest window maximum of a channel, in units of that
# channel's γ (the spread of its pre-activations): far from the kink at 0, while the other cells of
# each window stay where the draw put them (most of them still below 0).
LIFT_MARGIN = 0.1


def lift_dead_windows(net, params: dict, x: jax.Array, cfg, *, margin: float = LIFT_MARGIN) -> dict:
    """params with the shift β of every pool-feeding BatchNorm raised, channel by channel, just
    enough that every window of that pool has a cell at least margin·γ above 0: no dead window.

    A shift of one channel moves all its cells alike (x̂ does not depend on β), so strict windows
    stay strict and the ReLUs elsewhere keep their kinks; pools are lifted in forward order, each
    after the shifts upstream of it. At an image batch without twins (randn) the result satisfies
    all three hypotheses: the constructed point where even `MaxPool2Smooth` holds."""
    net = as_net(net)
    out = dict(params)
    for pool, spec in net.pools.items():
        layer = net.pool_preactivations[pool]
        z = preactivations(net, out, x, cfg)[layer]
        lowest = maxpool.windows(np.asarray(z), spec).max(-1).min(axis=(0, 2, 3))   # [C]
        gamma = np.abs(np.asarray(out[f"{layer}.weight"]))
        shift = np.maximum(0.0, margin * gamma - lowest)
        out[f"{layer}.bias"] = out[f"{layer}.bias"] + jnp.asarray(shift, out[f"{layer}.bias"].dtype)
    return out


# ---- routing: the backward at another selection ------------------------------------------------

# A twin reroute must keep every parameter node within ROUTE_REL (`checks.tolerances`).

def last_max(x: jax.Array, spec: maxpool.PoolSpec) -> jax.Array:
    """Per window the index of its LAST maximal cell in row-major order (σ = argmax takes the first)."""
    win = maxpool.windows(x, spec)
    return win.shape[-1] - 1 - jnp.argmax(win[..., ::-1], axis=-1)


def rerouted(net, params: dict, x: jax.Array, cfg, report: SmoothReport, kind: str) -> tuple[dict, dict]:
    """(σ, σ'): σ = argmax for every pool; σ' the same except that every window of class `kind`
    ("dead", "twin tie" or "non-twin tie") routes to its last maximal cell on the pool input."""
    if kind not in CLASSES:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(CLASSES)}")
    net = as_net(net)
    inputs = pool_inputs(net, params, x, cfg)
    sigma, sigma_alt = {}, {}
    for pool, census in zip(net.pools, report.pools):
        r, spec = inputs[pool], net.pools[pool]
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


def gradients_at(net, params: dict, x: jax.Array, targets: jax.Array, cfg, selections: dict):
    """(loss, parameter grads, dx) of the rendered chain with every pool frozen at `selections`:
    the gather model's forward and its transpose, selScatter, in the backward."""
    out = rendered.compiled(as_net(net), KIT, params, x, targets, cfg, selections=selections)
    return out.loss, out.grads, out.dx


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

def centre_tap(params: dict, names: Sequence[str]) -> dict:
    """params with each named conv kernel [O,C,kh,kw] reduced to its centre tap (the others set to 0)."""
    out = dict(params)
    for name in names:
        w = params[name]
        ch, cw = w.shape[2] // 2, w.shape[3] // 2
        out[name] = jnp.zeros_like(w).at[:, :, ch, cw].set(w[:, :, ch, cw])
    return out


def first_pool_convs(net) -> tuple[str, ...]:
    """The conv kernels upstream of the net's first pool: every rank-4 weight of the stages up to
    and including the first stage that pools."""
    net = as_net(net)
    params, x = protocol.abstract_inputs(net)
    _, saved = jax.eval_shape(lambda p, a: net.forward(p, a), params, x)
    names = []
    for stage in net.stage_list(net.config()):
        names += [n for n in stage.params if n.endswith(".weight") and len(params[n].shape) == 4]
        if stage.pool_inputs(saved[stage.name]):
            return tuple(names)
    raise ValueError(f"{net.name} has no max pool: no non-twin tie can be planted")


def planted_tie(net, params: dict) -> dict:
    """A non-twin tie point (with flat images): the convs before the first pool reduced to their
    centre tap. They then read one pixel, so on flat images many cells of the first pool's input
    share a value because they share a PIXEL, not a receptive field: the off-centre taps are 0, not
    absent, and tell them apart once they move."""
    return centre_tap(params, first_pool_convs(net))


# ---- one-sided slopes along a direction ---------------------------------------------------------

# h = RADIUS_FRACTION × the radius to the nearest other kink; SLOPE_REL judges the two sides
# (both in `checks.tolerances`).


def direction(params: dict, names: Sequence[str], key) -> dict:
    """A random direction in the named parameters (zero elsewhere), unit Euclidean norm overall."""
    v = {name: prng.normal(jax.random.fold_in(key, i), params[name].shape, params[name].dtype)
         for i, name in enumerate(names)}
    norm = jnp.sqrt(sum(jnp.sum(a * a) for a in v.values()))
    return {name: (v[name] / norm if name in v else jnp.zeros_like(p)) for name, p in params.items()}


@partial(jax.jit, static_argnums=(0, 3))
def _read_tangents(net: Net, params, x, cfg, v):
    def read(p):
        _, saved = net.forward(p, x, cfg)
        return net.pool_inputs(saved), net.preactivations(saved)
    return reference.jvp(read, (params,), (v,))


def kink_radius(net, params: dict, x: jax.Array, cfg, v: dict) -> float:
    """First-order distance along v to the nearest kink that is not already at the point: a ReLU
    input z ≠ 0 reaching 0, or a live window's selected cell meeting a cell below it (cells tied
    with it now — twins or a planted tie — are left out). The tangents come from the autodiff oracle."""
    net = as_net(net)
    (pools, pre), (dpools, dpre) = _read_tangents(net, params, x, cfg, v)
    radius = np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        for layer in pre:
            z, dz = np.asarray(pre[layer]), np.asarray(dpre[layer])
            radius = min(radius, float(np.min(np.where((z != 0) & (dz != 0), np.abs(z / dz), np.inf))))
        for pool, spec in net.pools.items():
            w = maxpool.windows(np.asarray(pools[pool]), spec)
            dw = np.nan_to_num(maxpool.windows(np.asarray(dpools[pool]), spec), nan=0.0, posinf=0.0, neginf=0.0)
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
def _loss_along(net: Net, params, x, targets, cfg, v, t):
    return reference.loss_at(net, {k: params[k] + t * v[k] for k in params}, x, targets, cfg)


def one_sided_slopes(net, params: dict, x: jax.Array, targets: jax.Array, cfg, v: dict, *,
                     span: float = 1e-3, points: int = 41) -> SlopeReport:
    """The loss along θ + t·v and its one-sided slopes at t = 0.

    right = (−3L(0) + 4L(h) − L(2h)) / 2h, left the mirror image; h = RADIUS_FRACTION × the radius
    to the nearest other kink (capped at `span`/10), so each side sees one smooth piece. At a smooth
    point both equal ⟨∇L, v⟩; at a non-twin tie they differ. The losses for a figure are taken at
    `points` steps t over ±min(radius, span).
    """
    net = as_net(net)
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
                           {p: maxpool.select(r, net.pools[p]) for p, r in
                            pool_inputs(net, params, x, cfg).items()})
    rendered = float(sum(jnp.vdot(g[k], v[k]) for k in g))
    return SlopeReport(ts, losses, h, radius, left, right, rendered)
