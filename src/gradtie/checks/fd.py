"""Each node is the derivative of the whole loss: central finite differences of the real loss.

For node θ_k and a random unit direction v in its space, D(h) = (L(θ + h·v) − L(θ − h·v)) / 2h
→ ⟨∇_k L, v⟩ at O(h²) where L is smooth. The loss is the forward's logits through
`gradtie.reference`'s loss, never a backward. float64.

Every node's differences run the net's own stage forwards from the node's stage onward (the stages
before it do not move: their saved records and the stage input are the point's, computed once), one
compiled probe per entry stage (`entries`): the loss at ±h and ±h/2, and whether each end still lies in the point's
smooth piece (every ReLU input with the same sign, every pool window with the same choice). Real
batches hold windows within 1e-6 of a tie, and a difference taken across a kink measures nothing: a
step whose ends leave the piece is halved until they don't.

The verdict, like the tie's, is held to the point's own round-off: the envelope of D(h) is the
truncation seen between h and h/2 (Richardson) plus the round-off ε_L/h, ε_L the loss's spread over
the tie's envelope evaluations; the limit is FD_FACTOR of it, floored at FD_REL. A row whose limit
reaches ILL_CONDITIONED_REL is "no evidence", never a pass. Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..host import to_device
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


def central_difference(loss, params: dict, name: str, direction: jax.Array, h: float) -> float:
    plus = dict(params, **{name: params[name] + h * direction})
    minus = dict(params, **{name: params[name] - h * direction})
    return float((loss(plus) - loss(minus)) / (2 * h))


def convergence(loss, params: dict, name: str, direction: jax.Array, exact: float,
                steps: Iterable[float]) -> np.ndarray:
    """|central difference − exact| for each step h: O(h²) where the loss is smooth."""
    return np.array([abs(central_difference(loss, params, name, direction, h) - exact) for h in steps])


# ---- every node, from its own stage onward --------------------------------------------------------

@partial(jax.jit, static_argnums=(0, 1, 4, 5))
def _suffix_probe(net, start: int, params, h, cfg, moved: tuple, before: dict, targets, alpha, here):
    """(loss, whether the point lies in the smooth piece `here`) with stages start… run from their
    input h. `before` holds the earlier stages' saved records, which the perturbation cannot move;
    only the `moved` (kind, name) entries of the piece are compared."""
    from ..nets.stages import fold_forward
    from .tie import piece_of
    logits, suffix = fold_forward(net.stage_list(cfg)[start:], params, h, cfg)
    piece = piece_of(net, {**before, **suffix})
    same = jnp.bool_(True)
    for kind, name in moved:
        same = same & jnp.all(piece[kind][name] == here[kind][name])
    return reference.smoothed_cross_entropy(logits, targets, alpha), same


def entries(stage_list) -> list[int]:
    """The stages a probe may start at: the first, and every stage that is not an identity block
    (ResNet-34: stem, the three downsample blocks, head; cifar8: every stage). One compiled probe
    each: starting at every stage would save a third of the forwards and cost three times the
    compilation."""
    return [i for i, stage in enumerate(stage_list) if i == 0 or stage.kind != "identity"]


def _moved(net, saved, stage_list, start: int) -> tuple:
    """The piece's (kind, name) entries that stages start… compute: those whose array is not one of
    the earlier stages' saved arrays (an entry a net derives afresh counts as moved: compared, never
    skipped)."""
    earlier = {id(a) for stage in stage_list[:start] for a in jax.tree.leaves(saved[stage.name])}
    kinds = (net.preactivations(saved), net.pool_inputs(saved))
    return tuple((kind, name) for kind, source in enumerate(kinds) for name, a in source.items()
                 if id(a) not in earlier)


def derivatives(net, params, x, targets, cfg, grads: dict, *, key, names=None,
                label_smoothing: float = 0.0, loss_roundoff: float = 0.0,
                factor: float = tol.FD_FACTOR) -> list[FDRow]:
    """One `FDRow` per node in `names` (default: all): D(h) along a random unit direction against
    ⟨rendered node, v⟩, held to FD_FACTOR × (truncation + round-off), floored at FD_REL.

    Every evaluation runs one compiled probe from the node's stage onward: the loss and whether the
    perturbed point lies in the same smooth piece (every ReLU sign, every pool choice), compared
    where the forward ran, so no saved activation comes back to the host.
    loss_roundoff: ε_L, the loss's round-off spread at the point (`Envelope.loss` of the tie); the
    round-off of D(h) is ε_L/h. targets: rows [N,K]. Directions are drawn on the host.
    """
    from .tie import _forward, _piece, host_rng, real_net
    net = real_net(net)
    names = list(params) if names is None else list(names)
    params = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
    x = jnp.asarray(x, jnp.float64)
    t = jnp.asarray(targets, jnp.float64)
    alpha = jnp.float64(label_smoothing)
    stage_list = net.stage_list(cfg)
    starts = entries(stage_list)
    entry_of = {p: max(e for e in starts if e <= i) for i, stage in enumerate(stage_list) for p in stage.params}
    missing = [n for n in names if n not in entry_of]
    if missing:
        raise ValueError(f"fd.derivatives: {missing} are not parameters of any stage of {net.__name__}")
    _, saved, inputs = _forward(net, params, x, cfg)   # the tie's and the census's program
    here = _piece(net, saved)
    moved = {start: _moved(net, saved, stage_list, start) for start in starts}
    before = {start: {stage.name: saved[stage.name] for stage in stage_list[:start]} for start in starts}

    def evaluate(name, base, step, v):
        # θ + step·v on the host: no compiled program per node shape
        start = entry_of[name]
        p = dict(params, **{name: to_device(base + step * v)})
        loss, same = jax.device_get(_suffix_probe(net, start, p, inputs[start], cfg, moved[start], before[start],
                                                  t, alpha, here))
        return float(loss), bool(same)
    gnorm = max(float(np.linalg.norm(np.asarray(g))) for g in grads.values())
    rng = host_rng(key)
    rows = []
    h_last = tol.FD_STEP
    for name in names:
        v = rng.standard_normal(np.shape(params[name]))
        v = v / np.linalg.norm(v)
        base = np.asarray(params[name])
        # the nodes of one point keep to similar radii: start one halving above the last node's step
        # rather than at FD_STEP; each halving reuses the ±h/2 ends, so it costs two forwards
        ends_at: dict[float, tuple[float, bool]] = {}

        def end(step):
            if step not in ends_at:
                ends_at[step] = evaluate(name, base, step, v)
            return ends_at[step]
        h = min(tol.FD_STEP, 2 * h_last)
        while True:
            ends = [end(step) for step in (h, -h, h / 2, -h / 2)]
            if all(same for _, same in ends) or h / 2 < tol.FD_MIN_STEP:
                break
            h /= 2
        h_last = h
        lp, lm, lp2, lm2 = (loss for loss, _ in ends)
        d_h, d_h2 = (lp - lm) / (2 * h), (lp2 - lm2) / h
        dot = float(np.vdot(np.asarray(grads[name], np.float64), v))
        scale = max(abs(d_h), abs(dot), tol.ZERO_NODE_FLOOR * gnorm)
        envelope = (4 / 3 * abs(d_h - d_h2) + loss_roundoff / h) / scale
        limit = max(factor * envelope, tol.FD_REL)
        rows.append(FDRow(name, d_h, dot, abs(d_h - dot) / scale, limit, h, envelope))
    return rows
