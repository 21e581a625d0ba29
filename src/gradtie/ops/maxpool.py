"""Max pools: 2×2/s2 (cifar8) and 3×3/s2 with padding 1 (the ResNet-34 stem pool).

The rendered backward is a selection followed by a scatter: each window's cotangent goes to ONE
cell, the first maximal cell in row-major window order compared on the pool's input, and
overlapping 3×3/s2 windows accumulate. `select` gives that selection σ; `scatter` is its transpose
(the gather model's selScatter). Shown in: Pools, Stage germs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _validate


class PoolSpec(NamedTuple):
    name: str
    size: int     # window k×k
    stride: int
    pad: int      # −∞ padding on each side


POOL2 = PoolSpec("2x2/s2", 2, 2, 0)
POOL3S2 = PoolSpec("3x3/s2 pad 1", 3, 2, 1)
KINDS = {"2x2": POOL2, "3x3s2": POOL3S2}


class PoolSaved(NamedTuple):
    x: jax.Array  # the pool input (post-ReLU values) the tie-break compares
    spec: PoolSpec


def out_size(size: int, spec: PoolSpec) -> int:
    return (size + 2 * spec.pad - spec.size) // spec.stride + 1


def _check(op: str, x, spec: PoolSpec) -> None:
    _validate.rank(op, "x", x, 4)
    h, w = x.shape[2], x.shape[3]
    if spec.pad == 0 and (h % spec.stride or w % spec.stride):
        raise ValueError(f"{op}: {spec.name} pool needs even H and W, got x {tuple(x.shape)}")
    if h < spec.size - 2 * spec.pad or w < spec.size - 2 * spec.pad:
        raise ValueError(f"{op}: x {tuple(x.shape)} is smaller than the {spec.name} window")


def windows(x: jax.Array, spec: PoolSpec) -> jax.Array:
    """x [N,C,H,W] -> [N,C,H',W',k·k]: each window's cells in row-major order (−∞ in the padding).

    Window (i,j) covers rows s·i−p … s·i−p+k−1 and the same columns.
    """
    k, s, p = spec.size, spec.stride, spec.pad
    ho, wo = out_size(x.shape[2], spec), out_size(x.shape[3], spec)
    xpad = jnp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-jnp.inf) if p else x
    cells = [xpad[:, :, kh:kh + s * (ho - 1) + 1:s, kw:kw + s * (wo - 1) + 1:s]
             for kh in range(k) for kw in range(k)]
    return jnp.stack(cells, axis=-1)


def forward(x: jax.Array, spec: PoolSpec = POOL2) -> tuple[jax.Array, PoolSaved]:
    """y[n,c,i,j] = max of window (i,j). x [N,C,H,W] -> y [N,C,H',W']."""
    _check("maxpool.forward", x, spec)
    _validate.finite("maxpool.forward", "x", x)
    return jnp.max(windows(x, spec), axis=-1), PoolSaved(x, spec)


def select(x: jax.Array, spec: PoolSpec = POOL2) -> jax.Array:
    """σ = argmax: per window the index (row-major, 0…k²−1) of its first maximal cell. [N,C,H',W']."""
    return jnp.argmax(windows(x, spec), axis=-1)  # argmax returns the first maximal index


def gather(x: jax.Array, sigma: jax.Array, spec: PoolSpec = POOL2) -> jax.Array:
    """The gather model: the pool frozen at σ, y = x[σ] — a linear map of x."""
    return jnp.take_along_axis(windows(x, spec), sigma[..., None], axis=-1)[..., 0]


# dy[N,C,H',W'] onto the cell σ picks in each window -> dx[N,C,H,W]; overlapping windows add
def scatter(sigma: jax.Array, dy: jax.Array, input_shape: tuple[int, ...],
            spec: PoolSpec = POOL2) -> jax.Array:
    """selScatter: the transpose of `gather` at σ. Each pooled cotangent lands on the one cell it read."""
    _validate.same_shape("maxpool.scatter", ("sigma", "dy"), sigma, dy)
    k, s, p = spec.size, spec.stride, spec.pad
    n, c, h, w = input_shape
    ho, wo = dy.shape[2], dy.shape[3]
    dxpad = jnp.zeros((n, c, h + 2 * p, w + 2 * p), dy.dtype)
    for kh in range(k):
        for kw in range(k):
            hit = jnp.where(sigma == kh * k + kw, dy, jnp.zeros_like(dy))
            dxpad = dxpad.at[:, :, kh:kh + s * (ho - 1) + 1:s, kw:kw + s * (wo - 1) + 1:s].add(hit)
    return dxpad[:, :, p:p + h, p:p + w]


def backward(saved: PoolSaved, dy: jax.Array) -> jax.Array:
    """Route each window's cotangent to its first maximal cell of this example's own saved input.

    = scatter(select(x), dy). Lean: `maxPoolBackB` (2×2), `maxPool3s2BackB` (3×3/s2, accumulating).
    """
    x, spec = saved
    expected = (x.shape[0], x.shape[1], out_size(x.shape[2], spec), out_size(x.shape[3], spec))
    if tuple(dy.shape) != expected:
        raise ValueError(f"maxpool.backward: dy must have shape {expected} for the {spec.name} pool "
                         f"of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    return scatter(select(x, spec), dy, x.shape, spec)
