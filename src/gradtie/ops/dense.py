"""Dense layer, PyTorch layout: y = x @ Wᵀ + b, W stored [out, in]. Shown in: Head fold.

A dense layer computes in its weights' dtype: under the bf16 policy the head reads the bf16
activations in float32. `precision` (None: HIGHEST) is the policy's.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from . import _validate


def _precision(precision) -> lax.Precision:
    return lax.Precision.HIGHEST if precision is None else precision


def forward(x: jax.Array, weight: jax.Array, bias: Optional[jax.Array] = None, *,
            precision: Optional[lax.Precision] = None) -> tuple[jax.Array, jax.Array]:
    """x [N,in], W [out,in], b [out] -> y [N,out]; saved: x (the weight gradient reads it)."""
    op = "dense.forward"
    _validate.rank(op, "x", x, 2)
    _validate.rank(op, "weight", weight, 2)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: x {tuple(x.shape)} has {x.shape[1]} features but weight "
                         f"{tuple(weight.shape)} expects {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    _validate.finite(op, "x", x)
    x = x.astype(weight.dtype)
    y = jnp.matmul(x, weight.T, precision=_precision(precision))
    return (y if bias is None else y + bias), x


# dy[N,out] @ W[out,in] -> dx[N,in]
def backward(weight: jax.Array, dy: jax.Array, *, precision: Optional[lax.Precision] = None) -> jax.Array:
    """dx = dy @ W. Lean: `rowDenseBackFlat`."""
    _validate.rank("dense.backward", "dy", dy, 2)
    if dy.shape[1] != weight.shape[0]:
        raise ValueError(f"dense.backward: dy {tuple(dy.shape)} does not match weight {tuple(weight.shape)}")
    return jnp.matmul(dy, weight, precision=_precision(precision))


# dy[N,out]ᵀ @ x[N,in] -> dW[out,in]
def grad_weight(x: jax.Array, dy: jax.Array, *, precision: Optional[lax.Precision] = None) -> jax.Array:
    """dW = dyᵀ @ x."""
    _validate.rank("dense.grad_weight", "x", x, 2)
    _validate.rank("dense.grad_weight", "dy", dy, 2)
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"dense.grad_weight: x {tuple(x.shape)} and dy {tuple(dy.shape)} differ in batch")
    return jnp.matmul(dy.T, x.astype(dy.dtype), precision=_precision(precision))


# dy[N,out] summed over n -> db[out]
def grad_bias(dy: jax.Array) -> jax.Array:
    """db = Σ_n dy."""
    _validate.rank("dense.grad_bias", "dy", dy, 2)
    return jnp.sum(dy, axis=0)
