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
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import maxpool

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
    where: tuple[int, int]    # window (i, j) for a tie, cell (h, w) for a zero

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
    violations: list[Violation] = field(default_factory=list)   # the first MAX_LISTED
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


def smoothness(net, params: dict, x: jax.Array, cfg, *, key: Optional[jax.Array] = None,
               draws: int = DRAWS) -> SmoothReport:
    """The census of every pool window and ReLU input of `net` at (params, x)."""
    key = jax.random.key(0) if key is None else key
    fwd = jax.jit(net.forward, static_argnums=2)
    _, saved = fwd(params, x, cfg)
    pre = {k: np.asarray(v) for k, v in net.preactivations(saved).items()}
    drawn = [{k: np.asarray(v) for k, v in
              net.preactivations(fwd(random_weights(net, params, cfg, jax.random.fold_in(key, r)), x, cfg)[1]).items()}
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
    zeros = 0
    for layer, z in pre.items():
        zero = z == 0
        zeros += int(zero.sum())
        violations += [Violation("zero pre-activation", layer, n, c, (h, w)) for n, c, h, w in _locations(zero)]
    min_abs = float(min(np.min(np.abs(z)) for z in pre.values()))
    return SmoothReport(pools, zeros, min_abs, violations[:MAX_LISTED], non_twin)
