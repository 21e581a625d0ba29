"""Each node is the derivative of the whole loss: central finite differences of the real loss.

For node θ_k and a random unit direction v in its space, D(h) = (L(θ + h·v) − L(θ − h·v)) / 2h
→ ⟨∇_k L, v⟩ at O(h²) where L is smooth. The loss is the forward's logits through
`gradtie.reference`'s loss, never a backward. float64.

Every node's differences come from one compiled evaluation: the parameters as one flat vector, the
node's direction placed at its offset, the loss at ±h and ±h/2 in one batched call, together with
whether each end still lies in the point's smooth piece (every ReLU input with the same sign, every
pool window with the same choice). Real batches hold windows within 1e-6 of a tie, and a difference
taken across a kink measures nothing: a step whose ends leave the piece is shrunk (÷4) until they
don't.

The verdict, like the tie's, is held to the point's own round-off: the envelope of D(h) is the
truncation seen between h and h/2 (Richardson) plus the round-off ε_L/h, ε_L the loss's spread over
the tie's envelope evaluations; the limit is FD_FACTOR of it, floored at FD_REL. A row whose limit
reaches ILL_CONDITIONED_REL is "no evidence", never a pass. Shown in: Whole-net tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..ops import maxpool
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


# ---- every node in one compiled evaluation ---------------------------------------------------------

def _piece(net, saved):
    """The smooth piece a point lies in: every ReLU input's sign, every pool window's choice."""
    return ({k: z > 0 for k, z in net.preactivations(saved).items()},
            {k: maxpool.select(r, net.POOLS[k]) for k, r in net.pool_inputs(saved).items()})


@partial(jax.jit, static_argnums=(0, 1, 4, 5))
def _point_piece(net, layout, flat, x, cfg, alpha):
    _, saved = net.forward(_unflatten(flat, layout), x, cfg)
    return _piece(net, saved)


def _unflatten(flat, layout):
    return {name: flat[off:off + math.prod(shape)].reshape(shape) for name, shape, off in layout}


@partial(jax.jit, static_argnums=(0, 1, 5, 6))
def _along(net, layout, flat, x, targets, cfg, alpha, piece, offset, v, steps):
    """L(θ + t·v) and "same piece as the point" for each t in `steps`; v [max node size] is placed
    at `offset` of the flat parameters (padded so that every node's slice fits)."""
    total = flat.shape[0]
    padded = jnp.concatenate([flat, jnp.zeros(v.shape, flat.dtype)])

    def one(t):
        here = jax.lax.dynamic_slice(padded, (offset,), v.shape)
        moved = jax.lax.dynamic_update_slice(padded, here + t * v, (offset,))[:total]
        logits, saved = net.forward(_unflatten(moved, layout), x, cfg)
        loss = reference.smoothed_cross_entropy(logits, targets, alpha)
        signs, picks = _piece(net, saved)
        same = jnp.array(True)
        for k in signs:
            same &= jnp.all(signs[k] == piece[0][k])
        for k in picks:
            same &= jnp.all(picks[k] == piece[1][k])
        return loss, same

    return jax.lax.map(one, steps)


def derivatives(net, params, x, targets, cfg, grads: dict, *, key, names=None,
                label_smoothing: float = 0.0, loss_roundoff: float = 0.0,
                factor: float = tol.FD_FACTOR) -> list[FDRow]:
    """One `FDRow` per node in `names` (default: all): D(h) along a random unit direction against
    ⟨rendered node, v⟩, held to FD_FACTOR × (truncation + round-off), floored at FD_REL.

    loss_roundoff: ε_L, the loss's round-off spread at the point (`Envelope.loss` of the tie); the
    round-off of D(h) is ε_L/h. targets: rows [N,K] in x's dtype. Directions are drawn on the host.
    """
    from .tie import host_rng, real_net
    net = real_net(net)
    names = list(params) if names is None else list(names)
    layout, offset = [], 0
    for name, p in params.items():
        layout.append((name, tuple(np.shape(p)), offset))
        offset += math.prod(np.shape(p))
    layout = tuple(layout)
    offsets = {name: off for name, _, off in layout}
    flat = jnp.concatenate([jnp.ravel(jnp.asarray(p, jnp.float64)) for p in params.values()])
    x = jnp.asarray(x, jnp.float64)
    t = jnp.asarray(targets, jnp.float64)
    piece = _point_piece(net, layout, flat, x, cfg, label_smoothing)
    width = max(math.prod(np.shape(params[name])) for name in names)
    gnorm = max(float(np.linalg.norm(np.asarray(g))) for g in grads.values())
    rng = host_rng(key)
    rows = []
    for name in names:
        size = math.prod(np.shape(params[name]))
        v = rng.standard_normal(size)
        v /= np.linalg.norm(v)
        vpad = jnp.asarray(np.concatenate([v, np.zeros(width - size)]))
        h = tol.FD_STEP
        while True:
            steps = jnp.asarray([h, -h, h / 2, -h / 2], jnp.float64)
            losses, same = _along(net, layout, flat, x, t, cfg, label_smoothing, piece, offsets[name], vpad, steps)
            if bool(jnp.all(same)) or h / 4 < tol.FD_MIN_STEP:
                break
            h /= 4
        lp, lm, lp2, lm2 = (float(a) for a in losses)
        d_h, d_h2 = (lp - lm) / (2 * h), (lp2 - lm2) / h
        dot = float(np.vdot(np.asarray(grads[name], np.float64).ravel(), v))
        scale = max(abs(d_h), abs(dot), tol.ZERO_NODE_FLOOR * gnorm)
        envelope = (4 / 3 * abs(d_h - d_h2) + loss_roundoff / h) / scale
        limit = max(factor * envelope, tol.FD_REL)
        rows.append(FDRow(name, d_h, dot, abs(d_h - dot) / scale, limit, h, envelope))
    return rows
