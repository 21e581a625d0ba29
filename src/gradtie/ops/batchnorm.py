"""BatchNorm in training mode: batch statistics, biased variance, y = γ(x−μ)/√(σ²+ε) + β.

`per_example=False` normalises each channel over (N,H,W) (batch BN, the nets' default);
`per_example=True` over each example's own (H,W) cells. `axis_name` makes the statistics global
across replicas of a `shard_map` (synchronised BatchNorm, Chan's variance combine). `valid` marks
the real examples of a padded batch: replicas holding different
numbers of examples, as the last batch of an epoch does. Statistics and backward means then run
over the valid cells only, combined across replicas by counts, and padded examples get a zero
cotangent. Shown in: Whole-net tie, Data-parallel tie.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from . import _dtype, _validate

EPS = 1e-5


class BNSaved(NamedTuple):
    x: jax.Array      # the BN input; the backward recomputes x̂ from it, as the Lean render does
    mean: jax.Array   # per channel [C] (batch) or [N,C] (per example), broadcastable after reshape
    var: jax.Array    # population (biased) variance, same shape as mean
    eps: float
    per_example: bool
    axis_name: Optional[str]
    valid: Optional[jax.Array] = None  # [N]: 1 for a real example, 0 for padding (None: all real)


def _axes(per_example: bool) -> tuple[int, ...]:
    return (2, 3) if per_example else (0, 2, 3)


def _bcast(v: jax.Array, per_example: bool) -> jax.Array:
    return v[:, :, None, None] if per_example else v[None, :, None, None]


# ---- padded batches: which examples are real ---------------------------------------------------------

def _weights(valid: jax.Array, dtype) -> jax.Array:
    """valid [N] -> [N,1,1,1] in the data's dtype: a factor 0 removes a padded example from a sum."""
    return jnp.asarray(valid).astype(dtype)[:, None, None, None]


def combine_means(sums: jax.Array, cells: jax.Array, axis_name: Optional[str]) -> jax.Array:
    """Means over the valid cells of every replica: Σ_r sums_r / Σ_r cells_r (one packed
    all-reduce). sums [k,C] are this replica's sums over its valid cells, cells its count of them.
    Weighted by counts: a plain mean of replica means is right only when every replica holds the
    same number of examples."""
    if axis_name is None:
        return sums / jnp.maximum(cells, 1)
    c = sums.shape[-1]
    total = lax.psum(jnp.concatenate([sums, jnp.broadcast_to(cells, (1, c)).astype(sums.dtype)]), axis_name)
    return total[:-1] / total[-1]


def _check(op: str, x, weight, bias) -> None:
    _validate.rank(op, "x", x, 4)
    c = x.shape[1]
    for name, v in (("weight", weight), ("bias", bias)):
        if v is not None and tuple(v.shape) != (c,):
            raise ValueError(f"{op}: {name} must have shape ({c},) for x {tuple(x.shape)}, "
                             f"got {tuple(v.shape)}")


def statistics(x: jax.Array, *, per_example: bool = False, axis_name: Optional[str] = None,
               valid: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """Mean and population variance per channel; across replicas when `axis_name` is given.

    Replicas hold equal counts, so Chan's combine is σ² = mean_r[σ_r² + (μ_r − μ)²]: it never forms
    E[x²] − μ², which drifts in float32 when the mean is large. With `valid` (a padded batch: 1 for
    a real example, 0 for padding) only the valid cells count and replicas combine by their counts m_r:
    μ = Σ_r m_r·μ_r / Σ_r m_r, σ² = Σ_r m_r[σ_r² + (μ_r − μ)²] / Σ_r m_r.
    """
    x = x.astype(_dtype.compute(x.dtype))   # bf16 activations: statistics in float32
    if valid is not None and not per_example:
        return _counted_statistics(x, valid, axis_name)
    axes = _axes(per_example)
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _bcast(mean, per_example)), axis=axes)
    if axis_name is not None and not per_example:
        gmean = lax.pmean(mean, axis_name)
        var = lax.pmean(var + jnp.square(mean - gmean), axis_name)
        mean = gmean
    return mean, var


def _counted_statistics(x: jax.Array, valid: jax.Array, axis_name: Optional[str]):
    """Chan's combine with counts over the valid examples (a replica holding only padding adds 0)."""
    axes = (0, 2, 3)
    w = _weights(valid, x.dtype)
    cells = jnp.sum(jnp.asarray(valid).astype(x.dtype)) * (x.shape[2] * x.shape[3])   # m_r
    total = jnp.sum(w * x, axis=axes)
    mean = total / jnp.maximum(cells, 1)
    m2 = jnp.sum(w * jnp.square(x - _bcast(mean, False)), axis=axes)            # m_r·σ_r²
    if axis_name is None:
        return mean, m2 / jnp.maximum(cells, 1)
    gmean = combine_means(total[None], cells, axis_name)[0]
    count = lax.psum(cells, axis_name)
    var = lax.psum(m2 + cells * jnp.square(mean - gmean), axis_name) / count
    return gmean, var


def forward(x: jax.Array, weight: jax.Array, bias: jax.Array, *, eps: float = EPS,
            per_example: bool = False, axis_name: Optional[str] = None,
            valid: Optional[jax.Array] = None) -> tuple[jax.Array, BNSaved]:
    """y = γ·x̂ + β, x̂ = (x − μ)·s, s = 1/√(σ² + ε). x [N,C,H,W], γ, β [C] -> y [N,C,H,W].

    valid [N]: the real examples of a padded batch (None: every example); the saved record carries
    it to the backward. A bf16 x: statistics, x̂ and y in float32, y rounded once to bf16.
    """
    _check("batchnorm.forward", x, weight, bias)
    _validate.finite("batchnorm.forward", "x", x)
    if valid is not None and tuple(jnp.shape(valid)) != (x.shape[0],):
        raise ValueError(f"batchnorm.forward: valid must have shape ({x.shape[0]},) for x "
                         f"{tuple(x.shape)}, got {tuple(jnp.shape(valid))}")
    mean, var = statistics(x, per_example=per_example, axis_name=axis_name, valid=valid)
    xc = x.astype(mean.dtype)
    xhat = (xc - _bcast(mean, per_example)) * _bcast(lax.rsqrt(var + eps), per_example)
    y = _bcast(weight.astype(mean.dtype), False) * xhat + _bcast(bias.astype(mean.dtype), False)
    return y.astype(x.dtype), BNSaved(x, mean, var, eps, per_example, axis_name, valid)


def normalized(saved: BNSaved) -> tuple[jax.Array, jax.Array]:
    """x̂ and s recomputed from the saved input and statistics (in the statistics' dtype)."""
    s = _bcast(lax.rsqrt(saved.var + saved.eps), saved.per_example)
    return (saved.x.astype(s.dtype) - _bcast(saved.mean, saved.per_example)) * s, s


# t = γ·dy[N,C,H,W]; per channel over its M cells: dx = (s/M)(M·t − Σt − x̂·Σ(x̂·t)) -> dx[N,C,H,W]
def backward(saved: BNSaved, weight: jax.Array, dy: jax.Array) -> jax.Array:
    """Input cotangent of batch-statistics BatchNorm; independent of β.

    dx = s·(t − mean(t) − x̂·mean(x̂·t)), t = γ·dy, means over the channel's M cells — the same as
    (s/M)(M·t − Σt − x̂·Σ(x̂·t)). Under `axis_name` the two means are one packed all-reduce and x̂
    uses the global statistics. Lean: `bnBatchBack`, `bnBackB`.

    γ is per channel, so mean(t) = γ·mean(dy) and mean(x̂·t) = γ·mean(x̂·dy): the two reductions
    are the ones the β and γ nodes take (Σdy, Σx̂·dy), and the compiler computes them once for all
    three; x̂ is recomputed from the saved input inside the same pass.

    Padded batches (`saved.valid`): the means run over the valid cells of every replica
    (`combine_means`, by counts) and padded examples get dx = 0.

    Computed in the statistics' dtype (float32 for bf16 activations) and returned in the saved
    input's dtype: the cotangent of x travels as x does.
    """
    _check("batchnorm.backward", dy, weight, None)
    _validate.same_shape("batchnorm.backward", ("x", "dy"), saved.x, dy)
    xhat, s = normalized(saved)
    dy, weight = dy.astype(s.dtype), weight.astype(s.dtype)
    valid = saved.valid
    if valid is not None:
        return _counted_backward(saved, valid, weight, dy, xhat, s).astype(saved.x.dtype)
    axes = _axes(saved.per_example)
    cells = math.prod(dy.shape[a] for a in axes)  # M
    means = jnp.stack([jnp.sum(dy, axis=axes), jnp.sum(dy * xhat, axis=axes)]) / cells
    if saved.axis_name is not None and not saved.per_example:
        means = lax.pmean(means, saved.axis_name)
    gamma = _bcast(weight, False)
    mean_t, mean_xt = (gamma * _bcast(m, saved.per_example) for m in means)
    return (s * (gamma * dy - mean_t - xhat * mean_xt)).astype(saved.x.dtype)


def _counted_backward(saved: BNSaved, valid, weight, dy, xhat, s):
    """The backward over the valid cells: the same formula, both means by counts."""
    w = _weights(valid, dy.dtype)
    gamma = _bcast(weight, False)
    if saved.per_example:   # each example's own cells: nothing to combine, padding zeroed
        axes = (2, 3)
        means = jnp.stack([jnp.mean(dy, axis=axes), jnp.mean(dy * xhat, axis=axes)])
        mean_t, mean_xt = (gamma * _bcast(m, True) for m in means)
        return w * s * (gamma * dy - mean_t - xhat * mean_xt)
    axes = (0, 2, 3)
    wdy = w * dy
    sums = jnp.stack([jnp.sum(wdy, axis=axes), jnp.sum(wdy * xhat, axis=axes)])
    cells = jnp.sum(jnp.asarray(valid).astype(dy.dtype)) * (dy.shape[2] * dy.shape[3])
    means = combine_means(sums, cells, saved.axis_name)
    mean_t, mean_xt = (gamma * _bcast(m, False) for m in means)
    return w * (s * (gamma * dy - mean_t - xhat * mean_xt))


# dy[N,C,H,W]·x̂ summed over (n,h,w) -> dγ[C]
def grad_weight(saved: BNSaved, dy: jax.Array) -> jax.Array:
    """dγ = Σ_{n,h,w} dy·x̂ (local to a replica; the data-parallel step all-reduces it); padded
    examples excluded."""
    _validate.same_shape("batchnorm.grad_weight", ("x", "dy"), saved.x, dy)
    xhat, _ = normalized(saved)
    dy = dy.astype(xhat.dtype)
    if saved.valid is not None:
        dy = _weights(saved.valid, dy.dtype) * dy
    return jnp.sum(dy * xhat, axis=(0, 2, 3))


# dy[N,C,H,W] summed over (n,h,w) -> dβ[C]
def grad_bias(dy: jax.Array) -> jax.Array:
    """dβ = Σ_{n,h,w} dy: no weight in the way, the cleanest trace of a wiring bug (summed in at
    least float32)."""
    _validate.rank("batchnorm.grad_bias", "dy", dy, 4)
    return jnp.sum(dy.astype(_dtype.compute(dy.dtype)), axis=(0, 2, 3))
