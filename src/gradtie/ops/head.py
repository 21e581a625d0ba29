"""The loss and its cotangent at the logits, composed from the six kit ops of the Lean render.

loss = mean_n Σ_k −t̃[n,k]·log softmax(z)[n,k], t̃ = (1−α)t + α/K; targets are rows summing to 1
(one-hot, mixup, cutmix). The cotangent dy = (p − t̃)/N is built step by step as the render
builds it. Shown in: Head fold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _validate

ROW_SUM_TOL = {jnp.dtype(jnp.float64): 1e-9, jnp.dtype(jnp.float32): 1e-5}


def check_targets(op: str, logits: jax.Array, targets: jax.Array) -> None:
    """Targets must be [N,K] like the logits, finite, with rows summing to 1."""
    _validate.rank(op, "logits", logits, 2)
    _validate.rank(op, "targets", targets, 2)
    if tuple(logits.shape) != tuple(targets.shape):
        raise ValueError(f"{op}: targets must have the logits' shape {tuple(logits.shape)}, "
                         f"got {tuple(targets.shape)}")
    _validate.finite(op, "logits", logits)
    _validate.finite(op, "targets", targets)
    if not isinstance(targets, jax.core.Tracer):
        tol = ROW_SUM_TOL.get(jnp.dtype(targets.dtype), 1e-2)
        worst = row_sum_error(targets)
        if worst > tol:
            raise ValueError(f"{op}: every target row must sum to 1 (the smoothed-loss cotangent "
                             f"assumes it); targets {tuple(targets.shape)}: the worst row is off by "
                             f"{worst:.3g}")


def row_sum_error(targets) -> float:
    """max over rows of |Σ_k t − 1|, in NumPy float64 (a concrete array captured by a traced function
    must not become a tracer)."""
    return float(np.max(np.abs(np.sum(np.asarray(targets, np.float64), axis=1) - 1)))


def one_hot(labels: jax.Array, num_classes: int, dtype=jnp.float32) -> jax.Array:
    """Int labels [N] -> one-hot rows [N,K]; labels outside 0…K−1 are an error."""
    labels = jnp.asarray(labels)
    if labels.ndim != 1 or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"one_hot: labels must be a 1-D integer array, got {labels.dtype} {tuple(labels.shape)}")
    if not isinstance(labels, jax.core.Tracer) and labels.size:
        lo, hi = int(np.min(np.asarray(labels))), int(np.max(np.asarray(labels)))
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"one_hot: labels must lie in 0…{num_classes - 1}, got {lo}…{hi}")
    return jax.nn.one_hot(labels, num_classes, dtype=dtype)


def targets_matrix(targets, num_classes: int, dtype) -> jax.Array:
    """Int labels [N] as one-hot rows [N,K], or rows as they are, in `dtype` (`as_targets` checks them)."""
    targets = jnp.asarray(targets)
    return one_hot(targets, num_classes, dtype) if targets.ndim == 1 else targets.astype(dtype)


def as_targets(net: str, targets, n: int, num_classes: int, dtype=None) -> jax.Array:
    """Int labels [N] -> one-hot rows; soft targets [N,K] pass through, their rows checked to sum to
    1 where the values can be seen (not under a trace)."""
    shape = tuple(jnp.shape(targets))
    if len(shape) == 1 and jnp.issubdtype(jnp.result_type(targets), jnp.integer):
        if shape[0] != n:
            raise ValueError(f"{net}: labels must have shape ({n},) for a batch of {n}, got {shape}")
        return one_hot(targets, num_classes, dtype or jnp.float32)
    if shape != (n, num_classes) or not jnp.issubdtype(jnp.result_type(targets), jnp.floating):
        raise ValueError(f"{net}: targets must be int labels ({n},) or float rows summing to 1 of "
                         f"shape ({n}, {num_classes}), got {jnp.result_type(targets)} {shape}")
    t = jnp.asarray(targets)
    t = t if dtype is None else t.astype(dtype)
    check_targets(net, t, t)
    return t


def smoothed(targets: jax.Array, alpha: float) -> jax.Array:
    """t̃ = (1−α)·t + α/K."""
    k = targets.shape[1]
    return (1 - alpha) * targets + alpha / k


def forward(logits: jax.Array, targets: jax.Array, alpha: float = 0.0) -> jax.Array:
    """Mean over the batch of the soft-target cross-entropy against t̃ (log-sum-exp, max subtracted)."""
    check_targets("head.forward", logits, targets)
    zmax = jnp.max(logits, axis=1, keepdims=True)
    logp = logits - zmax - jnp.log(jnp.sum(jnp.exp(logits - zmax), axis=1, keepdims=True))
    return -jnp.mean(jnp.sum(smoothed(targets, alpha) * logp, axis=1))


def row_losses(logits: jax.Array, targets: jax.Array, alpha: float = 0.0) -> jax.Array:
    """Each example's smoothed cross-entropy [N] (the values `forward` averages)."""
    zmax = jnp.max(logits, axis=1, keepdims=True)
    logp = logits - zmax - jnp.log(jnp.sum(jnp.exp(logits - zmax), axis=1, keepdims=True))
    return -jnp.sum(smoothed(targets, alpha) * logp, axis=1)


# ---- the six kit ops ---------------------------------------------------------------------------

def softmax_row(z: jax.Array) -> jax.Array:
    """p = softmax over each row, with the row maximum subtracted (same value in ℝ). Lean: `softmaxRow`."""
    e = jnp.exp(z - jnp.max(z, axis=1, keepdims=True))
    return e / jnp.sum(e, axis=1, keepdims=True)


def sub(a: jax.Array, b: jax.Array) -> jax.Array:
    """a − b. Lean: `subB`."""
    return a - b


def scale(c: float, a: jax.Array) -> jax.Array:
    """c·a. Lean: `scaleB`."""
    return c * a


def add(a: jax.Array, b: jax.Array) -> jax.Array:
    """a + b. Lean: `addVB`."""
    return a + b


def shift(a: jax.Array, c: float) -> jax.Array:
    """a − c, every entry. Lean: `shiftB`."""
    return a - c


def div_const(a: jax.Array, n: int) -> jax.Array:
    """a / n — a true division: 1/N is inexact in binary floats unless N is a power of two. Lean: `divConstB`."""
    return a / n


# z[N,K], t[N,K] -> dy[N,K] = (p − t̃)/N through the six ops
def cotangent(logits: jax.Array, targets: jax.Array, alpha: float = 0.0, divisor=None) -> jax.Array:
    """∂/∂z of the mean smoothed cross-entropy, composed exactly as the render composes it.

    p = softmaxRow(z); d0 = p − t; a = α·t; d1 = d0 + a; d2 = d1 − α/K; dy = d2 / N.
    Valid because every row of t sums to 1 (checked). divisor: the N of `divConstB` (default the
    batch; a data-parallel step over uneven replicas divides by the global count).
    """
    check_targets("head.cotangent", logits, targets)
    return fold(logits, targets, alpha, divisor)[-1]


def fold(logits: jax.Array, targets: jax.Array, alpha: float = 0.0, divisor=None) -> tuple[jax.Array, ...]:
    """`cotangent`'s six ops with every intermediate, (p, d0, a, d1, d2, dy); the rows not checked."""
    n, k = logits.shape
    p = softmax_row(logits)
    d0 = sub(p, targets)
    a = scale(alpha, targets)
    d1 = add(d0, a)
    d2 = shift(d1, alpha / k)
    return p, d0, a, d1, d2, div_const(d2, n if divisor is None else divisor)
