"""ReLU and its mask: the derivative is taken as 0 at 0 (strict `pre > 0`).

Shown in: Pools, Stage germs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _validate


class ReluSaved(NamedTuple):
    pre: jax.Array  # the pre-activation the mask reads


def forward(x: jax.Array) -> tuple[jax.Array, ReluSaved]:
    """y = max(x, 0)."""
    return jnp.where(x > 0, x, jnp.zeros_like(x)), ReluSaved(x)


# dy[...] * [pre > 0] -> dx[...]
def backward(saved: ReluSaved, dy: jax.Array) -> jax.Array:
    """dx = dy · [pre > 0]; the mask is strict, so the derivative at 0 is 0. dx is pre's dtype
    (the cotangent of a bf16 activation is bf16).

    Lean: `selectPosB`, `reluMaskB`. Shown in: Pools.
    """
    _validate.same_shape("relu.backward", ("pre", "dy"), saved.pre, dy)
    return jnp.where(saved.pre > 0, dy, jnp.zeros_like(dy)).astype(saved.pre.dtype)
