"""Global average pool over (H,W): the ResNet-34 head's first op. Shown in: Head fold."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _dtype, _validate


def forward(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    """g[n,c] = mean_{h,w} x[n,c,h,w]. x [N,C,H,W] -> g [N,C]; saved: the input shape. A bf16 x is
    averaged in float32 and g stays float32: the head's dtype."""
    _validate.rank("gap.forward", "x", x, 4)
    return jnp.mean(x.astype(_dtype.compute(x.dtype)), axis=(2, 3)), tuple(x.shape)


# dg[N,C] broadcast over (H,W), divided by H·W -> dx[N,C,H,W]
def backward(input_shape: tuple[int, ...], dg: jax.Array) -> jax.Array:
    """dx[n,c,h,w] = dg[n,c] / (H·W). Lean: `gapBack`."""
    n, c, h, w = input_shape
    if tuple(dg.shape) != (n, c):
        raise ValueError(f"gap.backward: dg must have shape {(n, c)}, got {tuple(dg.shape)}")
    return jnp.broadcast_to((dg / (h * w))[:, :, None, None], input_shape)
