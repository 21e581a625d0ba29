"""The dtype an op computes in: bf16 inputs are widened to float32 inside the op (BatchNorm's
statistics and x̂, sums that become parameter nodes, overlapping pool windows), and the op rounds
once, to its primal's dtype, what it hands on. float32 and float64 compute in their own dtype."""

from __future__ import annotations

import jax.numpy as jnp


def compute(dtype) -> jnp.dtype:
    dt = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dt.itemsize < 4 else dt
