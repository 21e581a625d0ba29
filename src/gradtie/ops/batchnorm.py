"""BatchNorm in training mode: batch statistics, biased variance, y = γ(x−μ)/√(σ²+ε) + β.

`per_example=False` normalises each channel over (N,H,W) (batch BN, the nets' default);
`per_example=True` over each example's own (H,W) cells. `axis_name` makes the statistics global
across replicas of a `shard_map` (synchronised BatchNorm, Chan's variance combine).
Shown in: Whole-net tie, Data-parallel tie.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from . import _validate

EPS = 1e-5


class BNSaved(NamedTuple):
    x: jax.Array      # the BN input; the backward recomputes x̂ from it, as the Lean render does
    mean: jax.Array   # per channel [C] (batch) or [N,C] (per example), broadcastable after reshape
    var: jax.Array    # population (biased) variance, same shape as mean
    eps: float
    per_example: bool
    axis_name: Optional[str]


def _axes(per_example: bool) -> tuple[int, ...]:
    return (2, 3) if per_example else (0, 2, 3)


def _bcast(v: jax.Array, per_example: bool) -> jax.Array:
    return v[:, :, None, None] if per_example else v[None, :, None, None]


def _check(op: str, x, weight, bias) -> None:
    _validate.rank(op, "x", x, 4)
    c = x.shape[1]
    for name, v in (("weight", weight), ("bias", bias)):
        if v is not None and tuple(v.shape) != (c,):
            raise ValueError(f"{op}: {name} must have shape ({c},) for x {tuple(x.shape)}, "
                             f"got {tuple(v.shape)}")


def statistics(x: jax.Array, *, per_example: bool = False,
               axis_name: Optional[str] = None) -> tuple[jax.Array, jax.Array]:
    """Mean and population variance per channel; across replicas when `axis_name` is given.

    Replicas hold equal counts, so Chan's combine is σ² = mean_r[σ_r² + (μ_r − μ)²]: it never forms
    E[x²] − μ², which drifts in float32 when the mean is large.
    """
    axes = _axes(per_example)
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _bcast(mean, per_example)), axis=axes)
    if axis_name is not None and not per_example:
        gmean = lax.pmean(mean, axis_name)
        var = lax.pmean(var + jnp.square(mean - gmean), axis_name)
        mean = gmean
    return mean, var


def forward(x: jax.Array, weight: jax.Array, bias: jax.Array, *, eps: float = EPS,
            per_example: bool = False, axis_name: Optional[str] = None) -> tuple[jax.Array, BNSaved]:
    """y = γ·x̂ + β, x̂ = (x − μ)·s, s = 1/√(σ² + ε). x [N,C,H,W], γ, β [C] -> y [N,C,H,W]."""
    _check("batchnorm.forward", x, weight, bias)
    _validate.finite("batchnorm.forward", "x", x)
    mean, var = statistics(x, per_example=per_example, axis_name=axis_name)
    xhat = (x - _bcast(mean, per_example)) * _bcast(lax.rsqrt(var + eps), per_example)
    y = _bcast(weight, False) * xhat + _bcast(bias, False)
    return y, BNSaved(x, mean, var, eps, per_example, axis_name)


def normalized(saved: BNSaved) -> tuple[jax.Array, jax.Array]:
    """x̂ and s recomputed from the saved input and statistics."""
    s = _bcast(lax.rsqrt(saved.var + saved.eps), saved.per_example)
    return (saved.x - _bcast(saved.mean, saved.per_example)) * s, s


# t = γ·dy[N,C,H,W]; per channel over its M cells: dx = (s/M)(M·t − Σt − x̂·Σ(x̂·t)) -> dx[N,C,H,W]
def backward(saved: BNSaved, weight: jax.Array, dy: jax.Array) -> jax.Array:
    """Input cotangent of batch-statistics BatchNorm; independent of β.

    dx = s·(t − mean(t) − x̂·mean(x̂·t)), t = γ·dy, means over the channel's M cells — the same as
    (s/M)(M·t − Σt − x̂·Σ(x̂·t)). Under `axis_name` the two means are one packed all-reduce and x̂
    uses the global statistics. Lean: `bnBatchBack`, `bnBackB`.

    γ is per channel, so mean(t) = γ·mean(dy) and mean(x̂·t) = γ·mean(x̂·dy): the two reductions
    are the ones the β and γ nodes take (Σdy, Σx̂·dy), and the compiler computes them once for all
    three; x̂ is recomputed from the saved input inside the same pass.
    """
    _check("batchnorm.backward", dy, weight, None)
    _validate.same_shape("batchnorm.backward", ("x", "dy"), saved.x, dy)
    xhat, s = normalized(saved)
    axes = _axes(saved.per_example)
    cells = math.prod(dy.shape[a] for a in axes)  # M
    means = jnp.stack([jnp.sum(dy, axis=axes), jnp.sum(dy * xhat, axis=axes)]) / cells
    if saved.axis_name is not None and not saved.per_example:
        means = lax.pmean(means, saved.axis_name)
    gamma = _bcast(weight, False)
    mean_t, mean_xt = (gamma * _bcast(m, saved.per_example) for m in means)
    return s * (gamma * dy - mean_t - xhat * mean_xt)


# dy[N,C,H,W]·x̂ summed over (n,h,w) -> dγ[C]
def grad_weight(saved: BNSaved, dy: jax.Array) -> jax.Array:
    """dγ = Σ_{n,h,w} dy·x̂ (local to a replica; the data-parallel step all-reduces it)."""
    _validate.same_shape("batchnorm.grad_weight", ("x", "dy"), saved.x, dy)
    xhat, _ = normalized(saved)
    return jnp.sum(dy * xhat, axis=(0, 2, 3))


# dy[N,C,H,W] summed over (n,h,w) -> dβ[C]
def grad_bias(dy: jax.Array) -> jax.Array:
    """dβ = Σ_{n,h,w} dy: no weight in the way, the cleanest trace of a wiring bug."""
    _validate.rank("batchnorm.grad_bias", "dy", dy, 4)
    return jnp.sum(dy, axis=(0, 2, 3))
