"""Each node is the derivative of the whole loss: central finite differences of the real loss.

For node θ_k and a random unit direction v in its space, D(h) = (L(θ + h·v) − L(θ − h·v)) / 2h
→ ⟨∇_k L, v⟩ at O(h²) where L is smooth. The loss is the forward's logits through
`gradtie.reference`'s loss, never a backward. float64.

Every node's differences run the tie's own compiled forward (nothing new to compile): the loss at
±h and ±h/2, and whether each end still lies in the point's smooth piece (every ReLU input with the
same sign, every pool window with the same choice). Real batches hold windows within 1e-6 of a tie, and a difference
taken across a kink measures nothing: a step whose ends leave the piece is shrunk (÷4) until they
don't.

The verdict, like the tie's, is held to the point's own round-off: the envelope of D(h) is the
truncation seen between h and h/2 (Richardson) plus the round-off ε_L/h, ε_L the loss's spread over
the tie's envelope evaluations; the limit is FD_FACTOR of it, floored at FD_REL. A row whose limit
reaches ILL_CONDITIONED_REL is "no evidence", never a pass. Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from . import tolerances as tol


@dataclass(frozen=True)
class FDRow:
    name: str
    fd: float           # D(h), the central difference
    rendered: float     # ⟨rendered node, v⟩
    rel: float          # |fd − rendered| / scale
    limit: float        # max(FD_FACTOR · envelope, FD_REL)
    h: float = tol.FD_STEP
    envelope: float = 0.0   # (truncation + round-off of D(h)) / scale

    @property
    def ill_conditioned(self) -> bool:
        return bool(self.limit >= tol.ILL_CONDITIONED_REL)

    @property
    def ok(self) -> bool:
        return bool(self.rel <= self.limit)

    @property
    def verdict(self) -> str:
        if not self.ok:
            return "FAILED"
        return "no evidence" if self.ill_conditioned else "ok"


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


def convergence(loss, params: dict, name: str, direction: jax.Array, exact: float,
                steps: Iterable[float]) -> np.ndarray:
    """|central difference − exact| for each step h: O(h²) where the loss is smooth."""
    return np.array([abs(central_difference(loss, params, name, direction, h) - exact) for h in steps])


# ---- every node, through the one compiled forward the tie already has --------------------------------

def derivatives(net, params, x, targets, cfg, grads: dict, *, key, names=None,
                label_smoothing: float = 0.0, loss_roundoff: float = 0.0,
                factor: float = tol.FD_FACTOR) -> list[FDRow]:
    """One `FDRow` per node in `names` (default: all): D(h) along a random unit direction against
    ⟨rendered node, v⟩, held to FD_FACTOR × (truncation + round-off), floored at FD_REL.

    Every evaluation runs one compiled probe: the forward's logits and whether the perturbed point
    lies in the same smooth piece (every ReLU sign, every pool choice), compared where the forward
    ran, so no saved activation comes back to the host.
    loss_roundoff: ε_L, the loss's round-off spread at the point (`Envelope.loss` of the tie); the
    round-off of D(h) is ε_L/h. targets: rows [N,K]. Directions are drawn on the host.
    """
    from .tie import _forward, _piece, _probe, host_rng, real_net
    net = real_net(net)
    names = list(params) if names is None else list(names)
    params = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
    x = jnp.asarray(x, jnp.float64)
    t = jnp.asarray(targets, jnp.float64)
    _, saved = _forward(net, params, x, cfg)
    here = _piece(net, saved)
    del saved

    def evaluate(p):
        logits, same = _probe(net, p, x, cfg, here)
        return float(reference.smoothed_cross_entropy(logits, t, label_smoothing)), bool(same)
    gnorm = max(float(np.linalg.norm(np.asarray(g))) for g in grads.values())
    rng = host_rng(key)
    rows = []
    h_last = tol.FD_STEP
    for name in names:
        v = rng.standard_normal(np.shape(params[name]))
        v = jnp.asarray(v / np.linalg.norm(v))
        # the nodes of one point keep to similar radii: start one shrink above the last node's step
        # rather than at FD_STEP, so a point near many kinks costs two rounds a node, not five
        h = min(tol.FD_STEP, 4 * h_last)
        while True:
            ends = [evaluate(dict(params, **{name: params[name] + step * v})) for step in (h, -h, h / 2, -h / 2)]
            if all(same for _, same in ends) or h / 4 < tol.FD_MIN_STEP:
                break
            h /= 4
        h_last = h
        lp, lm, lp2, lm2 = (loss for loss, _ in ends)
        d_h, d_h2 = (lp - lm) / (2 * h), (lp2 - lm2) / h
        dot = float(jnp.vdot(jnp.asarray(grads[name], jnp.float64), v))
        scale = max(abs(d_h), abs(dot), tol.ZERO_NODE_FLOOR * gnorm)
        envelope = (4 / 3 * abs(d_h - d_h2) + loss_roundoff / h) / scale
        limit = max(factor * envelope, tol.FD_REL)
        rows.append(FDRow(name, d_h, dot, abs(d_h - dot) / scale, limit, h, envelope))
    return rows
