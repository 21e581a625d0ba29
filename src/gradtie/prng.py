"""Random draws bit for bit those of `jax.random`, compiled once per size class instead of per shape.

`jax.random.normal(key, shape)` compiles a threefry program for every new shape, 0.4-3 s each on
a CPU (a 4-D shape costs the most), and a check draws at dozens of shapes: a direction per
parameter tensor, images, labels. With JAX's default partitionable threefry, element i of a draw
depends on the key and i alone, so the first n values of a flat draw of any length ≥ n are the
draw of n values, and reshaping a flat draw of prod(shape) values gives the draw at that shape.
Each function here draws a flat vector at the next size class (a power of two; above 2²² a
multiple of 2²⁰, so at most 1 in 4 values is wasted) and cuts it on the host: one compilation
serves every shape of the class, and the values do not move (tests/test_prng.py holds them to
`jax.random`'s).

Under a trace (eval_shape, a caller's jit) they are `jax.random`'s functions: the draw is then part
of the caller's program.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .host import to_device

__all__ = ["host_rng", "normal", "uniform", "randint", "size_class"]

_FINE = 1 << 22     # above this, classes are multiples of 2**20 rather than powers of two
_STEP = 1 << 20


def host_rng(key=None) -> np.random.Generator:
    """A NumPy generator seeded from a JAX key (typed or legacy uint32; None: key(0)), for draws made on the host."""
    key = jax.random.key(0) if key is None else key
    data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return np.random.default_rng(np.asarray(data).ravel())


def size_class(n: int) -> int:
    """The flat length drawn for n values: the next power of two, or above 2²² the next multiple of 2²⁰."""
    if n <= 1:
        return 1
    if n > _FINE:
        return -(-n // _STEP) * _STEP
    return 1 << (n - 1).bit_length()


def _partitionable() -> bool:
    return bool(jax.config.jax_threefry_partitionable)


def _cut(flat: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    n = math.prod(shape)
    return to_device(np.asarray(flat)[:n].reshape(shape))


def _traced(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def _draw(draw, key, shape, *args, **kwargs) -> jax.Array:
    shape = tuple(int(s) for s in shape)
    if _traced(key) or not _partitionable():
        return draw(key, shape, *args, **kwargs)
    flat = draw(key, (size_class(math.prod(shape)),), *args, **kwargs)
    if _traced(flat):          # a concrete key inside someone's trace (eval_shape, jit of a closure)
        return draw(key, shape, *args, **kwargs)
    return _cut(flat, shape)


def _dtype(dtype) -> dict:
    # None keeps jax.random's default (float64 or int64 with x64 on, as there)
    return {} if dtype is None else {"dtype": dtype}


def normal(key: jax.Array, shape: Sequence[int] = (), dtype=None) -> jax.Array:
    """`jax.random.normal(key, shape, dtype)`, bit for bit."""
    return _draw(jax.random.normal, key, shape, **_dtype(dtype))


def uniform(key: jax.Array, shape: Sequence[int] = (), dtype=None, minval=0.0, maxval=1.0) -> jax.Array:
    """`jax.random.uniform(key, shape, dtype, minval, maxval)`, bit for bit."""
    return _draw(jax.random.uniform, key, shape, minval=minval, maxval=maxval, **_dtype(dtype))


def randint(key: jax.Array, shape: Sequence[int], minval, maxval, dtype=None) -> jax.Array:
    """`jax.random.randint(key, shape, minval, maxval, dtype)`, bit for bit."""
    return _draw(jax.random.randint, key, shape, minval, maxval, **_dtype(dtype))
