"""A point's round-off envelope: how far correct evaluations of the gradient land from the float64
reference, measured at the point itself.

A fixed limit is wrong in both directions: at a well-conditioned point 1e-10 is loose, and where a
BatchNorm normalises over M = 2 values (ResNet-34's layer4 at 32 px, batch 2) correct float64
chains part by 1e-9. So each node's limit is a multiple of what round-off alone does there. The
envelope of a node is the largest distance from the float64 reference over a few correct
evaluations in the checked dtype:

- the oracle with the batch in reverse order: a second evaluation order of every batch sum (BN
  statistics, BN backward means, weight-gradient sums), the same value in ℝ;
- the oracle at inputs and parameters nudged by one unit roundoff of the dtype, x·(1 + u·ξ),
  θ·(1 + u·ξ) with ξ ~ N(0, 1) per entry;
- in float32 also the float32 oracle at the point itself (float32's own rounding of every op).

Pools with a tie at a positive maximum are evaluated frozen at the point's selection σ (reversed
with the batch), so the nudges measure round-off, not a twin broken by moving the image.
Shown in: Whole-net tie, Would the check catch it?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np

from ..host import to_device, tree_to_device
from . import tolerances as tol


@dataclass(frozen=True)
class Envelope:
    dtype: str                    # the dtype whose round-off was measured
    nodes: dict[str, float]       # node (and "input") -> max |g_sample − g_reference|
    loss: float                   # max |L_sample − L_reference|
    evaluations: tuple[str, ...]  # what each sample was

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "evaluations": list(self.evaluations), "loss": self.loss,
                "nodes": dict(self.nodes)}


def _host(tree, dtype):
    return jax.tree.map(lambda a: np.asarray(a, dtype), tree)


def samples(params: dict, x, targets, selections: Optional[dict], *, dtype: str, key,
            nudges: int = tol.ENVELOPE_NUDGES):
    """The correct evaluations the envelope is the spread of: (label, params, x, targets,
    selections, order) in `dtype`, host arrays; `order` maps the sample's batch back to the point's
    (None: the same order)."""
    dt = np.dtype(dtype)
    p64 = _host(params, np.float64)
    x64, t64 = np.asarray(x, np.float64), np.asarray(targets, np.float64)
    out = []
    if dt != np.float64:
        out.append(("the point", _host(p64, dt), x64.astype(dt), t64.astype(dt), selections, None))
    n = x64.shape[0]
    if n > 1:
        rev = np.arange(n)[::-1].copy()
        sel = None if selections is None else {k: np.asarray(v)[rev] for k, v in selections.items()}
        out.append(("batch reversed", _host(p64, dt), x64[rev].astype(dt), t64[rev].astype(dt), sel, rev))
    else:
        nudges += 1
    u = tol.UNIT_ROUNDOFF[dt.name]
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    for r in range(nudges):
        pn = {k: (v * (1 + u * rng.standard_normal(v.shape))).astype(dt) for k, v in p64.items()}
        xn = (x64 * (1 + u * rng.standard_normal(x64.shape))).astype(dt)
        out.append((f"nudge {r + 1} (u = 2^{int(np.log2(u))})", pn, xn, t64.astype(dt), selections, None))
    return out


def measure(oracle, params: dict, x, targets, reference, *, dtype: str, key,
            selections: Optional[dict] = None, nudges: int = tol.ENVELOPE_NUDGES) -> Envelope:
    """The envelope of every node at (params, x): `oracle(params, x, targets, selections)` ->
    (loss, grads, dx) is the autodiff oracle; `reference` its float64 value at the point."""
    loss_ref, g_ref, dx_ref = reference
    g_ref = {k: np.asarray(v, np.float64) for k, v in g_ref.items()}
    dx_ref = np.asarray(dx_ref, np.float64)
    worst = dict.fromkeys(list(g_ref) + ["input"], 0.0)
    loss_worst, labels = 0.0, []
    for label, p, xs, t, sel, order in samples(params, x, targets, selections, dtype=dtype, key=key,
                                               nudges=nudges):
        loss, g, dx = oracle(tree_to_device(p), to_device(xs), to_device(t),
                             None if sel is None else tree_to_device(sel))
        dx = np.asarray(dx, np.float64)
        if order is not None:
            dx = dx[np.argsort(order)]
        for name in g_ref:
            worst[name] = max(worst[name], float(np.max(np.abs(np.asarray(g[name], np.float64) - g_ref[name]))))
        worst["input"] = max(worst["input"], float(np.max(np.abs(dx - dx_ref))))
        loss_worst = max(loss_worst, abs(float(loss) - float(loss_ref)))
        labels.append(label)
    return Envelope(np.dtype(dtype).name, worst, loss_worst, tuple(labels))
