"""Each node is the derivative of the whole loss: central finite differences of the real loss.

For node θ_k and a random unit direction v in its space, D(h) = (L(θ + h·v) − L(θ − h·v)) / 2h
→ ⟨∇_k L, v⟩ at O(h²) where L is smooth. The loss is the forward's logits through the net's loss
(`Loss.value`), never a backward. float64.

Every node's differences run the net's own stage forwards from the node's stage onward (the stages
before it do not move: their saved records and the stage input are the point's, computed once), one
compiled probe per entry stage (`entries`): the loss at ±h and ±h/2, and whether each end still
lies in the point's smooth piece (every ReLU input with the same sign, every pool window with the
same choice). Real batches hold windows within 1e-6 of a tie, and a difference taken across a kink
measures nothing: a step whose ends leave the piece is halved until they don't, and one whose ends
never come back inside by FD_MIN_STEP is "no evidence (kink)", never a verdict.

The verdict, like the tie's, is held to the point's own round-off: the envelope of D(h) is the
truncation seen between h and h/2 (Richardson) plus the round-off ε_L/h, ε_L the loss's spread over
the tie's envelope evaluations; the limit is FD_FACTOR of it, floored at FD_REL. Its scale is read
off the oracle's gradient, never the rendered one (an inflated node must not widen every other
row's floor). A row whose limit reaches ILL_CONDITIONED_REL is "no evidence", never a pass.
Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from .. import rendered
from .. import tolerances as tol
from ..host import to_device
from ..nets.protocol import Net, Pass, as_net, fold_forward
from ..ops import maxpool
from .envelope import host_rng
from .tie import piece_of

VERDICTS = ("ok", "no evidence", "FAILED")


@dataclass(frozen=True)
class FDRow:
    name: str
    fd: float           # D(h), the central difference
    rendered: float     # ⟨rendered node, v⟩
    rel: float          # |fd − rendered| / scale
    limit: float        # max(FD_FACTOR · envelope, FD_REL)
    h: float = tol.FD_STEP
    envelope: float = 0.0   # (truncation + round-off of D(h)) / scale
    kinked: bool = False    # the step's ends never lay in the point's smooth piece: no evidence

    @property
    def ill_conditioned(self) -> bool:
        return bool(self.limit >= tol.ILL_CONDITIONED_REL)

    @property
    def ok(self) -> bool:
        return self.kinked or bool(self.rel <= self.limit)

    @property
    def verdict(self) -> str:
        if self.kinked:
            return "no evidence"
        if not self.ok:
            return "FAILED"
        return "no evidence" if self.ill_conditioned else "ok"


def central_difference(loss, params: dict, name: str, direction: jax.Array, h: float) -> float:
    plus = dict(params, **{name: params[name] + h * direction})
    minus = dict(params, **{name: params[name] - h * direction})
    return float((loss(plus) - loss(minus)) / (2 * h))


def convergence(loss, params: dict, name: str, direction: jax.Array, exact: float,
                steps: Iterable[float]) -> np.ndarray:
    """|central difference − exact| for each step h: O(h²) where the loss is smooth."""
    return np.array([abs(central_difference(loss, params, name, direction, h) - exact) for h in steps])


def loss_fn(net, x, targets, cfg, label_smoothing: float = 0.0):
    net = as_net(net)

    def loss(params):
        logits, _ = net.forward(params, x, cfg)
        return net.loss.value(logits, targets, label_smoothing)
    return loss


# ---- every node, from its own stage onward --------------------------------------------------------

def _piece_of_stages(net: Net, stages, saved) -> tuple[dict, dict]:
    """The smooth piece's entries that `stages` compute: their ReLU signs and pool choices."""
    signs, choices = {}, {}
    for stage in stages:
        s = saved[stage.name]
        signs.update({k: z > 0 for k, z in stage.relu_inputs(s).items()})
        choices.update({k: maxpool.select(r, net.pools[k]) for k, r in stage.pool_inputs(s).items()})
    return signs, choices


@partial(jax.jit, static_argnums=(0, 1, 4))
def _suffix_probe(net: Net, start: int, params, h, cfg, targets, alpha, here):
    """(loss, whether the point lies in the smooth piece `here`) with stages start… run from their
    input h; only the piece's entries those stages compute are compared (the earlier ones cannot move)."""
    suffix = net.stage_list(cfg)[start:]
    logits, saved = fold_forward(suffix, params, h, cfg, Pass())
    signs, choices = _piece_of_stages(net, suffix, saved)
    same = jnp.bool_(True)
    for k, v in signs.items():
        same = same & jnp.all(v == here[0][k])
    for k, v in choices.items():
        same = same & jnp.all(v == here[1][k])
    return net.loss.value(logits, targets, alpha), same


def entries(stage_list) -> list[int]:
    """The stages a probe may start at: the first, and every stage that is not an identity block
    (ResNet-34: stem, the three downsample blocks, head; cifar8: every stage). One compiled probe
    each: starting at every stage would save a third of the forwards and cost three times the
    compilation."""
    return [i for i, stage in enumerate(stage_list) if i == 0 or stage.kind != "identity"]


def derivatives(net, params, x, targets, cfg, grads: dict, *, reference_grads: dict, key, names=None,
                label_smoothing: float = 0.0, loss_roundoff: float = 0.0, dx=None, reference_dx=None,
                factor: float = tol.FD_FACTOR) -> list[FDRow]:
    """One `FDRow` per node in `names` (default: all, then "input" when `dx` is given): D(h) along a
    random unit direction against ⟨rendered node, v⟩, held to FD_FACTOR × (truncation + round-off),
    floored at FD_REL.

    grads (and dx, the input cotangent): the rendered nodes judged; reference_grads (reference_dx):
    the oracle's, which set each row's scale (the floor for a direction nearly orthogonal to its
    node). The step starts at FD_STEP (or twice the last node's), is halved until both ends lie in
    the point's smooth piece (every ReLU sign, every pool choice), then halved further while the
    envelope (truncation + round-off) keeps shrinking: where the loss curves hard (a BatchNorm over
    few cells) the best step is far below the first one inside the piece. Every evaluation runs one
    compiled probe from the node's stage onward (the input's from the first stage), so no saved
    activation comes back to the host. loss_roundoff: ε_L, the loss's round-off spread at the point
    (`Envelope.loss` of the tie); the round-off of D(h) is ε_L/h. targets: rows [N,K]. Directions
    are drawn on the host.
    """
    net = as_net(net)
    names = list(params) + (["input"] if dx is not None else []) if names is None else list(names)
    params = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
    x = jnp.asarray(x, jnp.float64)
    t = jnp.asarray(targets, jnp.float64)
    alpha = jnp.float64(label_smoothing)
    stage_list = net.stage_list(cfg)
    starts = entries(stage_list)
    entry_of = {p: max(e for e in starts if e <= i) for i, stage in enumerate(stage_list) for p in stage.params}
    entry_of["input"] = 0
    missing = [n for n in names if n not in entry_of]
    if missing:
        raise ValueError(f"fd.derivatives: {missing} are not parameters of any stage of {net.name}")
    if "input" in names and (dx is None or reference_dx is None):
        raise ValueError("fd.derivatives: the input row needs dx and reference_dx")
    _, saved, inputs = rendered.forward(net, params, x, cfg)   # the tie's and the census's program
    here = piece_of(net, saved)
    rendered_of = dict(grads, input=dx)
    reference_of = dict(reference_grads, input=reference_dx)

    def evaluate(name, base, step, v):
        # θ + step·v on the host: no compiled program per node shape
        start = entry_of[name]
        moved = to_device(base + step * v)
        p, h = (params, moved) if name == "input" else (dict(params, **{name: moved}), inputs[stage_list[start].name])
        loss, same = jax.device_get(_suffix_probe(net, start, p, h, cfg, t, alpha, here))
        return float(loss), bool(same)
    gnorm = max(float(np.linalg.norm(np.asarray(g))) for g in reference_grads.values())
    rng = host_rng(key)
    rows = []
    h_last = tol.FD_STEP
    for name in names:
        base = np.asarray(x if name == "input" else params[name])
        v = rng.standard_normal(base.shape)
        v = v / np.linalg.norm(v)
        ends_at: dict[float, tuple[float, bool]] = {}

        def end(step):
            if step not in ends_at:
                ends_at[step] = evaluate(name, base, step, v)
            return ends_at[step]

        def judged(h):
            """(D(h), its envelope, both ends of h and h/2 inside the piece)"""
            ends = [end(step) for step in (h, -h, h / 2, -h / 2)]
            lp, lm, lp2, lm2 = (loss for loss, _ in ends)
            d_h, d_h2 = (lp - lm) / (2 * h), (lp2 - lm2) / h
            return d_h, 4 / 3 * abs(d_h - d_h2) + loss_roundoff / h, all(same for _, same in ends)

        # the nodes of one point keep to similar radii: start one halving above the last node's step
        # rather than at FD_STEP; each halving reuses the ±h/2 ends, so it costs two forwards
        h = min(tol.FD_STEP, 2 * h_last)
        d_h, env, inside = judged(h)
        while not inside and h / 2 >= tol.FD_MIN_STEP:
            h /= 2
            d_h, env, inside = judged(h)
        while inside and h / 2 >= tol.FD_MIN_STEP:   # a smaller step while the envelope shrinks
            d2, env2, inside2 = judged(h / 2)
            if not inside2 or env2 >= env:
                break
            h, d_h, env = h / 2, d2, env2
        h_last = h
        dot = float(np.vdot(np.asarray(rendered_of[name], np.float64), v))
        ref = float(np.vdot(np.asarray(reference_of[name], np.float64), v))
        scale = max(abs(d_h), abs(ref), tol.ZERO_NODE_FLOOR * gnorm)
        envelope = env / scale
        limit = max(factor * envelope, tol.FD_REL)
        rows.append(FDRow(name, d_h, dot, abs(d_h - dot) / scale, limit, h, envelope, kinked=not inside))
    return rows
