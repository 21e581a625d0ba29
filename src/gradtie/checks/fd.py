"""Central finite differences of the real loss along random directions, one node at a time.

For node θ_k and a unit direction v in its space, (L(θ + h·v) − L(θ − h·v)) / 2h → ⟨∇_k L, v⟩ at
O(h²) where L is smooth. The loss is the forward's, built with `gradtie.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from . import tolerances as tol


@dataclass(frozen=True)
class FDRow:
    name: str
    fd: float         # the central difference
    rendered: float   # ⟨rendered node, v⟩
    rel: float
    limit: float

    @property
    def ok(self) -> bool:
        return bool(self.rel <= self.limit)


def loss_fn(net, x, targets, cfg, label_smoothing: float = 0.0):
    def loss(params):
        logits, _ = net.forward(params, x, cfg)
        return reference.smoothed_cross_entropy(logits, targets, label_smoothing)
    return loss


def unit_direction(key, shape, dtype) -> jax.Array:
    v = jax.random.normal(key, shape, dtype)
    return v / jnp.linalg.norm(v.ravel())


def central_difference(loss, params: dict, name: str, direction: jax.Array, h: float) -> float:
    plus = dict(params, **{name: params[name] + h * direction})
    minus = dict(params, **{name: params[name] - h * direction})
    return float((loss(plus) - loss(minus)) / (2 * h))


def directional(net, params, x, targets, cfg, grads: dict, *, key, label_smoothing: float = 0.0,
                names: Optional[Iterable[str]] = None, h: float = tol.FD_STEP,
                limit: float = tol.FD_REL) -> list[FDRow]:
    """Compare each node's rendered gradient with central differences along a random unit direction.

    The error is relative to max(|fd|, |⟨g, v⟩|, floor·‖g‖) so that a node whose directional
    derivative happens to be tiny is not judged on noise.
    """
    loss = jax.jit(loss_fn(net, x, targets, cfg, label_smoothing))
    names = list(params) if names is None else list(names)
    gnorm = max(float(jnp.linalg.norm(g.ravel())) for g in grads.values())
    rows = []
    for i, name in enumerate(names):
        v = unit_direction(jax.random.fold_in(key, i), params[name].shape, params[name].dtype)
        fd = central_difference(loss, params, name, v, h)
        dot = float(jnp.vdot(grads[name], v))
        scale = max(abs(fd), abs(dot), tol.ZERO_NODE_FLOOR * gnorm)
        rows.append(FDRow(name, fd, dot, abs(fd - dot) / scale, limit))
    return rows


def convergence(loss, params: dict, name: str, direction: jax.Array, exact: float,
                steps: Iterable[float]) -> np.ndarray:
    """|central difference − exact| for each step h: O(h²) where the loss is smooth."""
    return np.array([abs(central_difference(loss, params, name, direction, h) - exact) for h in steps])
