"""Planted bf16 kinds, each named for the claim it breaks (erasure, the rounding identity, the
bound). The whole-gradient controls (a node zeroed, sign-flipped, scaled) live with their verdict in
`gradient`. Shown in: bf16 erasure.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from ...ops import conv
from .kinds import _widen

def drop_bias_forward(x, weight, bias, *, stride: int = 1, rnd=conv.identity):
    """The forward kind that forgets the bias: breaks erasure (conv biases of cifar8)."""
    return conv.forward(x, weight, None, stride=stride, rnd=rnd)[0]


def same_padding_forward(x, weight, bias=None, *, stride: int = 1, rnd=conv.identity):
    """The forward kind with XLA 'SAME' padding (asymmetric on strided convs): breaks erasure."""
    y = lax.conv_general_dilated(_widen(rnd(x), x.dtype), _widen(rnd(weight), x.dtype), (stride, stride), "SAME",
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=x.dtype)
    y = _widen(rnd(y), x.dtype)
    return y if bias is None else y + bias[None, :, None, None]


def grad_weight_rounded_per_example(x, dy, *, kernel_size: int, stride: int = 1, rnd=conv.identity):
    """The weight-grad kind rounding INSIDE the batch sum, Σ_n rnd(S_n): at identity it reassociates
    the float32 sum (breaks erasure), under bf16 it is not rnd(f32 node at rounded operands)."""
    parts = [conv.grad_weight(x[i:i + 1], dy[i:i + 1], kernel_size=kernel_size, stride=stride, rnd=rnd)
             for i in range(x.shape[0])]
    return sum(parts[1:], parts[0])


def forward_result_only(x, weight, bias=None, *, stride: int = 1, rnd=conv.round_bf16):
    """The forward kind rounding only its result, rnd(conv(x, W)): not rnd(f32 node at rounded operands)."""
    y = conv.forward(x, weight, None, stride=stride)[0]
    y = _widen(rnd(y), x.dtype)
    return y if bias is None else y + bias[None, :, None, None]


@partial(jax.jit, static_argnames=("stride",))
def forward_bf16_accumulation(x, weight, *, stride: int = 1):
    """The forward kind accumulating in bf16 (every partial sum rounded, one product at a time):
    its error grows like n·u on positive data and breaks the bound."""
    k = weight.shape[2]
    p = conv.padding(k)
    patches = lax.conv_general_dilated_patches(conv.round_bf16(x), (k, k), (stride, stride), ((p, p), (p, p)),
                                               dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                               precision=lax.Precision.HIGHEST)   # [N, C·k·k, H', W']
    w = conv.round_bf16(weight).reshape(weight.shape[0], -1)                     # [O, C·k·k]
    prods = patches[:, None] * w[None, :, :, None, None]                          # exact: bf16·bf16

    def step(acc, p_i):
        return conv.round_bf16(acc + p_i), None

    acc, _ = lax.scan(step, jnp.zeros_like(prods[:, :, 0]), jnp.moveaxis(prods, 2, 0))
    return acc
