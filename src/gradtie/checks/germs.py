"""Stage germs: near a smooth point the real loss equals the gather model's along any parameter path.

Stage k of cifar8 is conv(2k−1), BN, ReLU, conv(2k), BN, ReLU and pool k; for ResNet-34 the stem
(conv1, bn1, ReLU, the 3×3/s2 pool). Along a random unit direction v in that stage's parameters,

    S(t) = loss of the real net at θ + t·v,    G(t) = the same with every pool frozen at σ(θ),

agree bit for bit for |t| below a radius δ (no window's selection changes), and part beyond it.
The margins predict δ to first order: each window's gap between its selected cell and a competitor
(or a dead window's distance below 0) divided by the gap's rate of change along v. Central finite
differences of S converge to the rendered node at O(h²): the numeric face of `HasGradAt`.
Shown in: Stage germs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..ops import maxpool


@dataclass
class GermReport:
    stage: str
    params: tuple[str, ...]        # the parameters the direction moves
    ts: np.ndarray                 # |t| grid (both signs are evaluated)
    real_minus_gather: np.ndarray  # max over ±t of |S(t) − G(t)|, per |t|
    delta_measured: float          # the smallest |t| on the grid where S ≠ G (inf if none)
    delta_predicted: float         # first-order prediction from the pool-window margins
    kink_radius: float             # first-order radius before any ReLU input crosses 0 (S and G both kink)
    hs: np.ndarray                 # finite-difference steps
    fd_errors: np.ndarray          # |central difference − ⟨rendered node, v⟩| per h
    exact: float                   # ⟨rendered node, v⟩

    @property
    def bit_identical_below(self) -> bool:
        """S and G agree bit for bit at every grid point below the measured radius (by definition)
        and at least at the smallest grid point."""
        return bool(self.real_minus_gather[0] == 0.0)

    @property
    def fd_slope(self) -> float:
        """Log-log slope of the finite-difference error where truncation dominates: from the step
        with the smallest error (below it round-off grows as 1/h) up to the measured radius δ."""
        below = np.nonzero(self.hs < min(self.delta_measured, self.delta_predicted, self.kink_radius))[0]
        if below.size < 3:
            return float("nan")
        start = below[np.argmin(self.fd_errors[below])]
        h, e = self.hs[start:below[-1] + 1], self.fd_errors[start:below[-1] + 1]
        if h.size < 3:
            return float("nan")
        return float(np.polyfit(np.log(h), np.log(e), 1)[0])

    def summary(self) -> str:
        return (f"{self.stage}: S = G bit for bit below |t| = {self.delta_measured:.1e} "
                f"(predicted {self.delta_predicted:.1e}, first ReLU kink {self.kink_radius:.1e}); "
                f"finite differences slope {self.fd_slope:.2f}")


def stage_parameters(net, stage: str, params: dict) -> tuple[str, ...]:
    """The parameter names a stage owns, read off the net's stage list."""
    cfg_stages = {s.name: s for s in net.stage_list(net.Config())} if hasattr(net, "stage_list") else {}
    if stage in cfg_stages:
        return tuple(n for n in cfg_stages[stage].params if n in params)
    raise ValueError(f"unknown stage {stage!r} of {net.__name__}; stages: {list(cfg_stages)}")


def unit_direction(params: dict, names: Sequence[str], key) -> dict:
    """A random direction in the named parameters (zero elsewhere), unit Euclidean norm overall."""
    v = {}
    for i, name in enumerate(names):
        v[name] = jax.random.normal(jax.random.fold_in(key, i), params[name].shape, params[name].dtype)
    norm = jnp.sqrt(sum(jnp.sum(a * a) for a in v.values()))
    return {name: (v[name] / norm if name in v else jnp.zeros_like(p)) for name, p in params.items()}


def _moved(params: dict, v: dict, t) -> dict:
    return {k: params[k] + t * v[k] for k in params}


def path_losses(net, params, x, targets, cfg, v, ts, *, selections=None, label_smoothing: float = 0.0,
                op_by_op: bool = False):
    """The loss at θ + t·v for each t; with `selections`, through the gather model frozen there.

    `op_by_op` evaluates without whole-graph compilation: a fused graph may reassociate differently
    for the real and the gather forward, and "bit for bit" must compare the maths, not two
    compilations.
    """
    def loss(t):
        logits, _ = net.forward(_moved(params, v, t), x, cfg, selections=selections)
        return reference.smoothed_cross_entropy(logits, targets, label_smoothing)
    if op_by_op:
        with jax.disable_jit():
            return np.array([float(loss(jnp.asarray(t, x.dtype))) for t in ts])
    f = jax.jit(loss)
    return np.array([float(f(jnp.asarray(t, x.dtype))) for t in ts])


def selections(net, params, x, cfg) -> dict:
    """σ = argmax for every pool, read from the pool inputs at θ."""
    _, saved = net.forward(params, x, cfg)
    return {name: maxpool.select(r, net.POOLS[name]) for name, r in net.pool_inputs(saved).items()}


def predicted_radius(net, params, x, cfg, v, sigma: dict) -> tuple[float, float]:
    """First-order radius: min over windows of gap / |d gap/dt| (the tangents by the autodiff oracle).

    A live window keeps its selection while its selected cell stays above every non-twin competitor
    (post-ReLU values); a dead window keeps it while every cell's pre-activation stays below 0.
    """
    def read(p):
        _, saved = net.forward(p, x, cfg)
        return net.pool_inputs(saved), net.preactivations(saved)

    (r0, z0), (dr, dz) = jax.jvp(read, (params,), (v,))
    kinks = np.inf
    for layer in z0:
        z, dzl = np.asarray(z0[layer]), np.asarray(dz[layer])
        with np.errstate(divide="ignore", invalid="ignore"):
            kinks = min(kinks, float(np.min(np.where(dzl != 0, np.abs(z) / np.abs(dzl), np.inf))))
    radius = np.inf
    for name, spec in net.POOLS.items():
        layer = net.POOL_PREACTIVATIONS[name]
        w, dw = (np.asarray(maxpool.windows(a, spec)) for a in (r0[name], dr[name]))
        zw, dzw = (np.asarray(maxpool.windows(a, spec)) for a in (z0[layer], dz[layer]))
        finite = np.isfinite(w)
        dw, dzw = np.where(finite, dw, 0.0), np.where(finite, dzw, 0.0)
        idx = np.asarray(sigma[name])[..., None]
        top, dtop = np.take_along_axis(w, idx, -1), np.take_along_axis(dw, idx, -1)
        gap, dgap = top - w, dtop - dw
        live_window = top > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            t_live = np.where(live_window & finite & (gap > 0) & (dgap != 0), gap / np.abs(dgap), np.inf)
            t_dead = np.where(~live_window & finite & (zw < 0) & (dzw != 0), -zw / np.abs(dzw), np.inf)
        radius = min(radius, float(np.min(t_live)), float(np.min(t_dead)))
    return radius, kinks


def germ(net, params, x, targets, cfg, grads: dict, stage: str, *, key, names: Optional[Sequence[str]] = None,
         ts: Optional[np.ndarray] = None, hs: Optional[np.ndarray] = None,
         label_smoothing: float = 0.0) -> GermReport:
    """Walk a random direction in one stage's parameters: S vs G, δ measured and predicted, FD convergence.

    `grads` are the rendered nodes at θ (net.backward); FD compares against ⟨grads, v⟩.
    """
    names = tuple(names) if names is not None else stage_parameters(net, stage, params)
    ts = np.logspace(-8, 1, 19) if ts is None else np.asarray(ts)
    hs = np.logspace(-7, 0, 29) if hs is None else np.asarray(hs)
    v = unit_direction(params, names, key)
    sigma = selections(net, params, x, cfg)
    both = np.concatenate([ts, -ts])
    real = path_losses(net, params, x, targets, cfg, v, both, label_smoothing=label_smoothing, op_by_op=True)
    gath = path_losses(net, params, x, targets, cfg, v, both, selections=sigma,
                       label_smoothing=label_smoothing, op_by_op=True)
    diff = np.maximum(np.abs(real - gath)[: ts.size], np.abs(real - gath)[ts.size:])
    parted = np.nonzero(diff != 0)[0]
    measured = float(ts[parted[0]]) if parted.size else np.inf
    exact = float(sum(jnp.vdot(grads[n], v[n]) for n in names))
    plus = path_losses(net, params, x, targets, cfg, v, hs, label_smoothing=label_smoothing)
    minus = path_losses(net, params, x, targets, cfg, v, -hs, label_smoothing=label_smoothing)
    fd_errors = np.abs((plus - minus) / (2 * hs) - exact)
    predicted, kinks = predicted_radius(net, params, x, cfg, v, sigma)
    return GermReport(stage, names, ts, diff, measured, predicted, kinks, hs, fd_errors, exact)
