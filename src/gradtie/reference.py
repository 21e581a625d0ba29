"""The autodiff oracles: `jax.vjp` of each forward, and the loss built from the forward and plain jnp.

This module is the only place autodiff appears (the checks call it). It never borrows a rendered
backward's code, so a bug the kernels carry cannot hide on both sides. `oracle` is THE whole-net
oracle every check ties a rendered chain to; `vjp` the oracle of one piece (a stage, a layer, an op).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from .ops import batchnorm, conv, dense, gap, maxpool, relu


def oracle(net, params, x, targets, cfg, alpha: float = 0.0, selections=None):
    """(loss, parameter gradients, input gradient) by autodiff of `net.forward` and `net.loss.value`
    (never a backward). targets: rows [N,K].

    The parameter gradients are the real net's. The input gradient is the real net's too, unless
    `selections` {pool: σ} is given: then it is the vector–Jacobian product of the model with those
    pools frozen at σ (the gather model). At a twin tie the input gradient of the real net does not
    exist (moving the image breaks the twins), and the frozen model's is what the rendered chain
    computes at σ = argmax (`batchMapAux_maxPoolBackFlat_eq_selScatter`).
    """
    def loss(p, x_, sel=None):
        logits, _ = net.forward(p, x_, cfg, selections=sel)
        return net.loss.value(logits, targets.astype(logits.dtype), alpha)

    if selections is None:
        value, (g, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    else:
        value, g = jax.value_and_grad(loss)(params, x)
        dx = jax.grad(loss, argnums=1)(params, x, selections)
    return value, g, dx


# compiled once per (net, config, α, shapes)
compiled = jax.jit(oracle, static_argnums=(0, 4, 5))


def loss_at(net, params, x, targets, cfg, alpha: float = 0.0):
    """The loss from the forward alone (what finite differences and germs evaluate)."""
    logits, _ = net.forward(params, x, cfg)
    return net.loss.value(logits, targets.astype(logits.dtype), alpha)


def value_and_grad(f: Callable, **kwargs):
    """`jax.value_and_grad`: the autodiff peer of a train step differentiates its loss here."""
    return jax.value_and_grad(f, **kwargs)


def jvp(f: Callable, primals: tuple, tangents: tuple):
    """`jax.jvp`: forward-mode derivatives (a walk's Taylor coefficients, a census's tangents)."""
    return jax.jvp(f, primals, tangents)


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


def plain_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """−mean_n log softmax(z)[n, label_n], written with integer labels (no target rows at all)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def head_cotangent(logits: jax.Array, targets: jax.Array, alpha: float = 0.0) -> jax.Array:
    """∂/∂z of the mean smoothed cross-entropy, by autodiff."""
    return jax.grad(smoothed_cross_entropy)(logits, targets, alpha)
