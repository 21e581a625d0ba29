"""A point's round-off envelope: how far correct evaluations land from the float64 reference,
measured at the point itself — written once, for a whole net, a stage, a cotangent or a train step.

A fixed limit is wrong in both directions: at a well-conditioned point 1e-10 is loose, and where a
BatchNorm normalises over M = 2 values (ResNet-34's layer4 at 32 px, batch 2) correct float64
chains part by 1e-9. So each row's limit is a multiple of what round-off alone does there. The
envelope of a row is the largest distance from the float64 reference over a few correct
evaluations in the checked dtype (`samples`):

- the oracle with the batch in reverse order: a second evaluation order of every batch sum (BN
  statistics, BN backward means, weight-gradient sums), the same value in ℝ;
- the oracle at inputs and parameters nudged by one unit roundoff of the dtype, a·(1 + u·ξ) with
  ξ ~ N(0, 1) per entry;
- in float32 also the float32 oracle at the point itself (float32's own rounding of every op).

`spread` is the largest distance of those evaluations from the reference, leaf by leaf. Pools with
a tie at a positive maximum are evaluated frozen at the point's selection σ (reversed with the
batch), so the nudges measure round-off, not a twin broken by moving the image.
Shown in: Whole-net tie, Would the check catch it?
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng
from .. import reference as reference_
from .. import tolerances as tol
from ..host import tree_to_device


class Sample(NamedTuple):
    """One correct evaluation's inputs: `values` by name (host arrays in the checked dtype) and the
    batch order (`order[i]`: the point's example at row i; None: the point's order)."""
    label: str
    values: dict
    order: Optional[np.ndarray]


def samples(values: dict, *, dtype: str, key, nudged: Sequence[str] = (), batched: Sequence[str] = (),
            nudges: int = tol.ENVELOPE_NUDGES, unit: Optional[float] = None) -> list[Sample]:
    """The correct evaluations an envelope is the spread of. values: name -> a pytree of arrays
    (read in float64); `nudged` names get the relative unit·ξ nudge (unit: the dtype's unit
    roundoff), `batched` names hold the batch on axis 0 (reversed in "batch reversed"). A batch of
    one has no second order: one more nudge instead. Integer leaves (a selection σ) are kept as
    they are, reordered with the batch."""
    dt = np.dtype(dtype)
    u = tol.UNIT_ROUNDOFF[dt.name] if unit is None else unit

    def cast(a, nudge=None, order=None):
        a = np.asarray(a) if order is None else np.asarray(a)[order]
        if not jnp.issubdtype(a.dtype, jnp.floating):   # bf16 (ml_dtypes) is no np.floating
            return a
        a = a.astype(np.float64)
        return (a if nudge is None else a * (1 + u * nudge(a.shape))).astype(dt)

    out = []
    if dt != np.float64:
        out.append(Sample("the point", {k: jax.tree.map(cast, v) for k, v in values.items()}, None))
    batch = {np.shape(a)[0] for k in batched if k in values for a in jax.tree.leaves(values[k])}
    n = max(batch) if batch else 1
    if n > 1:
        rev = np.arange(n)[::-1].copy()
        out.append(Sample("batch reversed", {k: jax.tree.map(partial(cast, order=rev) if k in batched else cast, v)
                                             for k, v in values.items()}, rev))
    rng = prng.host_rng(key)
    for r in range(nudges + (n == 1)):
        out.append(Sample(f"nudge {r + 1} (u = 2^{int(np.log2(u))})",
                          {k: jax.tree.map(partial(cast, nudge=rng.standard_normal) if k in nudged else cast, v)
                           for k, v in values.items()}, None))
    return out


def unorder(a, order: Optional[np.ndarray]):
    """A batched output of a reordered evaluation, back in the point's order."""
    return a if order is None else np.asarray(a)[np.argsort(order)]


def spread(reference, outputs) -> Any:
    """Leaf by leaf, the largest |output − reference| over `outputs` (each a pytree shaped like
    `reference`, already in the point's batch order)."""
    worst = jax.tree.map(lambda r: 0.0, reference)
    for out in outputs:
        worst = jax.tree.map(lambda w, o, r: max(w, float(np.max(np.abs(np.asarray(o, np.float64)
                                                                       - np.asarray(r, np.float64))))),
                             worst, out, reference)
    return worst


@dataclass(frozen=True)
class Envelope:
    nodes: dict[str, float]       # node (and "input") -> max |g_sample − g_reference|
    loss: float                   # max |L_sample − L_reference|
    evaluations: tuple[str, ...]  # what each sample was


def measure(point, reference, *, selections: Optional[dict] = None, nudges: int = tol.ENVELOPE_NUDGES,
            oracle: Callable = reference_.compiled, nudged: Sequence[str] = ("params", "x")) -> Envelope:
    """The envelope of every node of the point's net at the point (`tie.Point`, read at its exact
    float64 widening, in its checked dtype, with its key and α): the autodiff oracle
    (`reference.oracle`, or `oracle` with its signature, e.g. a VJP at a cotangent held as the
    point's `targets`) at each sample, against `reference`, its float64 (loss, grads, dx) there."""
    params, x, targets = point.wide
    outputs, labels = [], []
    for s in samples({"params": params, "x": x, "targets": targets, "selections": selections}, dtype=point.dtype,
                     key=point.key, nudged=nudged, batched=("x", "targets", "selections"), nudges=nudges):
        v = tree_to_device(s.values)
        loss, g, dx = oracle(point.net, v["params"], v["x"], v["targets"], point.cfg, point.alpha, v["selections"])
        outputs.append((loss, dict(g), unorder(dx, s.order)))
        labels.append(s.label)
    loss_w, g_w, dx_w = spread((reference[0], dict(reference[1]), reference[2]), outputs)
    return Envelope({**g_w, "input": dx_w}, loss_w, tuple(labels))
