"""Max pools: 2×2/s2 (cifar8) and 3×3/s2 with padding 1 (the ResNet-34 stem pool).

The rendered backward is a selection followed by a scatter: each window's cotangent goes to ONE
cell, the first maximal cell in row-major window order compared on the pool's input, and
overlapping 3×3/s2 windows accumulate. `select` gives that selection σ; `scatter` is its transpose
(the gather model's selScatter). Shown in: Pools, Stage germs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _dtype, _validate


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

    Window (i,j) covers rows s·i−p … s·i−p+k−1 and the same columns. A NumPy array in, a NumPy
    array out: a census reads its windows on the host, with no program to compile.
    """
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.stack(_cells(x, spec, xp), axis=-1)


def _cells(x: jax.Array, spec: PoolSpec, xp=jnp) -> list[jax.Array]:
    """The k·k cells of every window, in row-major window order: k·k arrays [N,C,H',W'].

    Read through a blocked view where one exists (contiguous slices, which the CPU compiler fuses
    into one pass), else through strided slices of the −∞-padded input.
    """
    k, s, p = spec.size, spec.stride, spec.pad
    n, c, h, w = x.shape
    ho, wo = out_size(h, spec), out_size(w, spec)
    if _blocked(spec, h, w):  # non-overlapping: x viewed as [N,C,H',k,W',k]
        x6 = x.reshape(n, c, ho, k, wo, k)
        return [x6[:, :, :, kh, :, kw] for kh in range(k) for kw in range(k)]
    if _overlapping_3s2(spec):  # 3×3/s2 pad 1: the padded input viewed as [N,C,H'+1,2,W'+1,2]
        xpad = xp.pad(x, ((0, 0), (0, 0), (p, p + h % 2), (p, p + w % 2)), constant_values=-np.inf)
        x6 = xpad.reshape(n, c, ho + 1, 2, wo + 1, 2)
        # window i reads padded rows 2i, 2i+1, 2i+2: block i parity 0, block i parity 1, block i+1 parity 0
        rows = [(slice(0, ho), 0), (slice(0, ho), 1), (slice(1, ho + 1), 0)]
        cols = [(slice(0, wo), 0), (slice(0, wo), 1), (slice(1, wo + 1), 0)]
        return [x6[:, :, bi, pi, bj, pj] for bi, pi in rows for bj, pj in cols]
    xpad = xp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf) if p else x
    return [xpad[:, :, kh:kh + s * (ho - 1) + 1:s, kw:kw + s * (wo - 1) + 1:s]
            for kh in range(k) for kw in range(k)]


def _blocked(spec: PoolSpec, h: int, w: int) -> bool:
    return spec.pad == 0 and spec.size == spec.stride and h % spec.size == 0 and w % spec.size == 0


def _overlapping_3s2(spec: PoolSpec) -> bool:
    return (spec.size, spec.stride, spec.pad) == (3, 2, 1)


def _place(hits: list[jax.Array], input_shape: tuple[int, ...], spec: PoolSpec) -> jax.Array:
    """The transpose of `_cells`: k·k arrays [N,C,H',W'] (one per window cell, row-major) back onto
    the input grid [N,C,H,W]; where windows overlap, their contributions add in row-major window
    order. Built from reshapes, shifts and adds (no scatter: the CPU compiler fuses it)."""
    k, s, p = spec.size, spec.stride, spec.pad
    n, c, h, w = input_shape
    ho, wo = hits[0].shape[2], hits[0].shape[3]
    if _blocked(spec, h, w):
        rows = [jnp.stack(hits[kh * k:(kh + 1) * k], axis=-1) for kh in range(k)]  # [N,C,H',W',k]
        return jnp.stack(rows, axis=3).reshape(n, c, h, w)                       # [N,C,H',k,W',k]
    zero = jnp.zeros((), hits[0].dtype)
    if _overlapping_3s2(spec):
        # input row 2b is cell 1 of window b; row 2b+1 is cell 2 of window b and cell 0 of window b+1
        parity = {0: [(1, 0)], 1: [(2, 0), (0, 1)]}  # (cell, window offset) in window order

        def shifted(a, dh, dw):  # a[:, :, i+dh, j+dw], zero past the edge
            return lax.pad(a, zero, ((0, 0, 0), (0, 0, 0), (-dh, dh, 0), (-dw, dw, 0)))

        quads = {}
        for pr, row_terms in parity.items():
            for pc, col_terms in parity.items():
                terms = [shifted(hits[kh * k + kw], dh, dw) for kh, dh in row_terms for kw, dw in col_terms]
                quads[pr, pc] = functools.reduce(jnp.add, terms)
        rows = [jnp.stack([quads[pr, 0], quads[pr, 1]], axis=-1) for pr in (0, 1)]
        dx = jnp.stack(rows, axis=3).reshape(n, c, 2 * ho, 2 * wo)
        return dx[:, :, :h, :w]
    dx = None
    for i, hit in enumerate(hits):  # each cell's cotangents, spread to the stride and shifted into place
        kh, kw = divmod(i, k)
        lo_h, lo_w = kh - p, kw - p
        config = ((0, 0, 0), (0, 0, 0), (lo_h, h - lo_h - (s * (ho - 1) + 1), s - 1),
                  (lo_w, w - lo_w - (s * (wo - 1) + 1), s - 1))
        part = lax.pad(hit, zero, config)
        dx = part if dx is None else dx + part
    return dx


def _first_max_index(cells: list[jax.Array]) -> jax.Array:
    """Per window the row-major index of its first maximal cell: the smallest k whose cell equals
    the window's maximum. Written as a reduction over a leading axis so the compiler keeps the
    index as an array: the placement reads it up to four times per input cell (overlapping
    windows), and recomputing it there from the k·k cells costs more than the backward itself."""
    top = functools.reduce(jnp.maximum, cells)
    k = len(cells)
    order = jnp.arange(k, dtype=jnp.int32).reshape((k,) + (1,) * top.ndim)
    return jnp.min(jnp.where(jnp.stack(cells) == top, order, k), axis=0)


def forward(x: jax.Array, spec: PoolSpec = POOL2) -> tuple[jax.Array, PoolSaved]:
    """y[n,c,i,j] = max of window (i,j). x [N,C,H,W] -> y [N,C,H',W']."""
    _check("maxpool.forward", x, spec)
    _validate.finite("maxpool.forward", "x", x)
    return jnp.max(windows(x, spec), axis=-1), PoolSaved(x, spec)


def select(x: jax.Array, spec: PoolSpec = POOL2) -> jax.Array:
    """σ = argmax: per window the index (row-major, 0…k²−1) of its first maximal cell. [N,C,H',W']."""
    return jnp.argmax(windows(x, spec), axis=-1)  # argmax returns the first maximal index


def last_max(x: jax.Array, spec: PoolSpec = POOL2) -> jax.Array:
    """Per window the index of its LAST maximal cell in row-major order: `select`'s mirror, where a
    tie routes the other way (the selection a control reroutes a window to). [N,C,H',W']."""
    win = windows(x, spec)
    return win.shape[-1] - 1 - jnp.argmax(win[..., ::-1], axis=-1)


def gather(x: jax.Array, sigma: jax.Array, spec: PoolSpec = POOL2) -> jax.Array:
    """The gather model: the pool frozen at σ, y = x[σ] — a linear map of x."""
    return jnp.take_along_axis(windows(x, spec), sigma[..., None], axis=-1)[..., 0]


# dy[N,C,H',W'] onto the cell σ picks in each window -> dx[N,C,H,W]; overlapping windows add
def scatter(sigma: jax.Array, dy: jax.Array, input_shape: tuple[int, ...],
            spec: PoolSpec = POOL2) -> jax.Array:
    """selScatter: the transpose of `gather` at σ. Each pooled cotangent lands on the one cell it read."""
    _validate.same_shape("maxpool.scatter", ("sigma", "dy"), sigma, dy)
    zero = jnp.zeros_like(dy)
    hits = [jnp.where(sigma == cell, dy, zero) for cell in range(spec.size ** 2)]
    return _place(hits, tuple(input_shape), spec)


def backward(saved: PoolSaved, dy: jax.Array) -> jax.Array:
    """Route each window's cotangent to its first maximal cell of this example's own saved input.

    = scatter(select(x), dy). Lean: `maxPoolBackB` (2×2), `maxPool3s2BackB` (3×3/s2, accumulating).
    """
    x, spec = saved
    expected = (x.shape[0], x.shape[1], out_size(x.shape[2], spec), out_size(x.shape[3], spec))
    if tuple(dy.shape) != expected:
        raise ValueError(f"maxpool.backward: dy must have shape {expected} for the {spec.name} pool "
                         f"of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    # the selection is recomputed from the saved input inside the backward's own pass: the masks
    # fuse with the placement (and with the ReLU mask and BatchNorm backward that read dx).
    # Overlapping windows add in at least float32; dx is x's dtype.
    sigma = _first_max_index(_cells(x, spec))
    dy = dy.astype(_dtype.compute(dy.dtype))
    zero = jnp.zeros_like(dy)
    hits = [jnp.where(sigma == cell, dy, zero) for cell in range(spec.size ** 2)]
    return _place(hits, tuple(x.shape), spec).astype(x.dtype)
