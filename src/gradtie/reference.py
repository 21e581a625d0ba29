"""The autodiff oracles: `jax.vjp` of each forward, and losses built from the forward and plain jnp.

This module (with `gradtie.checks`) is the only place autodiff appears. It never borrows a rendered
backward's code, so a bug the kernels carry cannot hide on both sides.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from .ops import batchnorm, conv, dense, gap, maxpool, relu


def vjp(f: Callable, *primals, cotangent):
    """Cotangents of every primal of `f` at `primals` for the output cotangent."""
    _, pullback = jax.vjp(f, *primals)
    return pullback(cotangent)


def conv_vjp(x, weight, bias, dy, *, stride: int = 1, rnd: Optional[conv.Rounding] = None):
    """(dx, dW, db) of conv.forward; db is None without a bias."""
    if bias is None:
        dx, dw = vjp(lambda x_, w_: conv.forward(x_, w_, None, stride=stride, rnd=rnd)[0],
                     x, weight, cotangent=dy)
        return dx, dw, None
    return vjp(lambda x_, w_, b_: conv.forward(x_, w_, b_, stride=stride, rnd=rnd)[0],
               x, weight, bias, cotangent=dy)


def batchnorm_vjp(x, weight, bias, dy, *, eps: float = batchnorm.EPS, per_example: bool = False):
    """(dx, dγ, dβ) of batchnorm.forward."""
    return vjp(lambda x_, g_, b_: batchnorm.forward(x_, g_, b_, eps=eps, per_example=per_example)[0],
               x, weight, bias, cotangent=dy)


def relu_vjp(x, dy):
    (dx,) = vjp(lambda x_: relu.forward(x_)[0], x, cotangent=dy)
    return dx


def maxpool_vjp(x, dy, spec: maxpool.PoolSpec = maxpool.POOL2):
    (dx,) = vjp(lambda x_: maxpool.forward(x_, spec)[0], x, cotangent=dy)
    return dx


def gap_vjp(x, dg):
    (dx,) = vjp(lambda x_: gap.forward(x_)[0], x, cotangent=dg)
    return dx


def dense_vjp(x, weight, bias, dy):
    return vjp(lambda x_, w_, b_: dense.forward(x_, w_, b_)[0], x, weight, bias, cotangent=dy)


def smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, alpha: float = 0.0) -> jax.Array:
    """The loss as users write it: mean_n −Σ_k t̃·log_softmax(z), t̃ = (1−α)t + α/K (plain jnp)."""
    k = logits.shape[-1]
    t_smooth = (1.0 - alpha) * targets + alpha / k
    return jnp.mean(-jnp.sum(t_smooth * jax.nn.log_softmax(logits, axis=-1), axis=-1))


def head_cotangent(logits: jax.Array, targets: jax.Array, alpha: float = 0.0) -> jax.Array:
    """∂/∂z of the mean smoothed cross-entropy, by autodiff."""
    return jax.grad(smoothed_cross_entropy)(logits, targets, alpha)
