"""Input checks shared by the op kit: a clear ValueError that names the op and the shapes."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def shape_str(*arrays) -> str:
    return ", ".join(str(tuple(a.shape)) for a in arrays)


def rank(op: str, name: str, a, r: int) -> None:
    if jnp.ndim(a) != r:
        raise ValueError(f"{op}: {name} must have rank {r}, got shape {tuple(jnp.shape(a))}")


def same_shape(op: str, names: Sequence[str], *arrays) -> None:
    shapes = {tuple(jnp.shape(a)) for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"{op}: {' and '.join(names)} must have the same shape, got {shape_str(*arrays)}")


def finite(op: str, name: str, a) -> None:
    """Reject NaN/Inf when the value is concrete (under jit the check cannot see values)."""
    if isinstance(a, jax.core.Tracer):
        return
    if not bool(np.all(np.isfinite(np.asarray(a, dtype=np.float64)))):
        raise ValueError(f"{op}: {name} of shape {tuple(a.shape)} contains NaN or Inf")
