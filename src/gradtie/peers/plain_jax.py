"""Plain JAX: the step a JAX user writes without gradtie, and its gradient by JAX's autodiff, jitted.

The same two nets as `gradtie.nets` (cifar8-BN with conv biases and its head widths, ResNet-34 as
torchvision builds it), written directly: `lax.conv_general_dilated` with PyTorch's symmetric
`(k-1)//2` padding at every stride (as `gradtie.ops.conv`; XLA's 'SAME' pads a strided conv
asymmetrically), `lax.reduce_window` max pools (cifar8: 2×2/s2; the ResNet-34 stem: 3×3/s2 with
−∞ padding 1), BatchNorm in training mode (batch mean, biased variance, ε from the net's config),
ReLU, global average pool, dense layers, and optax's softmax cross-entropy against label-smoothed
targets, averaged over the batch. By default every contraction runs at `Precision.HIGHEST` (true
float32, as gradtie's `tie` policy; no TF32 on an accelerator). `Written.precision` "DEFAULT" is
what a JAX user gets by default (TF32 convolutions on a GPU), and `Written.compute` "bfloat16" the
mixed-precision step a user writes for speed: bf16 activations and conv operands (bf16 results),
float32 parameters, BatchNorm statistics, head and loss.

Two layouts: "NCHW" with OIHW kernels and "NHWC" with HWIO kernels; dense kernels are [in, out]
(y = x @ W) in both. Each peer holds its parameters in its own layout: `to_layout` converts
gradtie's once, when the peer is built, and `from_layout` converts the gradients back. In NHWC the
flatten before cifar8's fc1 reads (H,W,C), so fc1's kernel rows are permuted once to match: the
same function as gradtie's (C,H,W) flatten.

The gradient is `jax.value_and_grad` of the loss, reached through `gradtie.reference` (the one
module that calls JAX's autodiff): this peer is a baseline a user would write, not a kernel.
Shown in: Performance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .. import reference
from ..checks.tie import need_x64
from ..nets import cifar8, resnet34
from ..ops import conv
from ..ops.maxpool import PoolSpec
from .protocol import Jitted, Peer, check_dtype, config_of, host, net_of, xla_threads

LAYOUTS = ("NCHW", "NHWC")
KERNEL = {"NCHW": "OIHW", "NHWC": "HWIO"}


# ---- how the step is written: static under jit ------------------------------------------------------

def symmetric(kernel_size: int, stride: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """PyTorch's padding, gradtie's too: (k-1)//2 on every side, at every stride."""
    p = conv.padding(kernel_size)
    return (p, p), (p, p)


def xla_same(kernel_size: int, stride: int) -> str:
    """XLA's 'SAME': at stride 2 on an even side it pads (p-1, p), reading every window one cell off
    (a planted peer: `PLANTED`)."""
    return "SAME"


@dataclass(frozen=True)
class Written:
    """net: "cifar8" or "resnet34"; layout: "NCHW" or "NHWC"; eps: BatchNorm's ε; alpha: label
    smoothing α; padding(k, stride): every conv's padding."""
    net: str
    layout: str
    eps: float
    alpha: float
    padding: Callable[[int, int], Any] = symmetric
    precision: str = "HIGHEST"      # of every contraction: "HIGHEST" or "DEFAULT"
    compute: str = "float32"        # the activations' dtype: "float32" or "bfloat16"

    @property
    def lax_precision(self) -> lax.Precision:
        return lax.Precision[self.precision]

    @property
    def channel_axis(self) -> int:
        return self.layout.index("C")

    @property
    def spatial_axes(self) -> tuple[int, int]:
        return self.layout.index("H"), self.layout.index("W")


# ---- the layers -------------------------------------------------------------------------------------

def per_channel(v: jax.Array, how: Written) -> jax.Array:
    """A vector [C] shaped to broadcast along the layout's channel axis."""
    shape = [1, 1, 1, 1]
    shape[how.channel_axis] = -1
    return v.reshape(shape)


def conv2d(x: jax.Array, w: jax.Array, b, *, stride: int, how: Written) -> jax.Array:
    """y = conv(x, W) + b, W in the layout's kernel order (OIHW or HWIO)."""
    k = w.shape[KERNEL[how.layout].index("H")]
    y = lax.conv_general_dilated(x.astype(how.compute), w.astype(how.compute), (stride, stride), how.padding(k, stride),
                                 dimension_numbers=(how.layout, KERNEL[how.layout], how.layout),
                                 precision=how.lax_precision)
    return y if b is None else y + per_channel(b, how).astype(y.dtype)


def batchnorm(x: jax.Array, gamma: jax.Array, beta: jax.Array, *, how: Written) -> jax.Array:
    """Training mode: y = γ(x − μ)/√(σ² + ε) + β over the batch and both spatial axes, σ² biased."""
    axes = tuple(a for a in range(4) if a != how.channel_axis)
    xf = x.astype(gamma.dtype)            # statistics in the parameters' dtype (float32 for bf16 activations)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.var(xf, axis=axes, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + how.eps) * per_channel(gamma, how) + per_channel(beta, how)
    return y.astype(x.dtype)


def maxpool(x: jax.Array, spec: PoolSpec, *, how: Written) -> jax.Array:
    """k×k max over windows at stride s, −∞ padding p (the pool's `PoolSpec`)."""
    window, strides, pads = [1, 1, 1, 1], [1, 1, 1, 1], [(0, 0)] * 4
    for a in how.spatial_axes:
        window[a], strides[a], pads[a] = spec.size, spec.stride, (spec.pad, spec.pad)
    return lax.reduce_window(x, np.array(-np.inf, x.dtype), lax.max, window, strides, pads)   # a constant: the max monoid


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array, *, how: Written) -> jax.Array:
    """y = x @ W + b, W [in, out], in the kernel's dtype."""
    return jnp.dot(x.astype(kernel.dtype), kernel, precision=how.lax_precision) + bias


def conv_bn_relu(params, conv_name: str, bn_name: str, x, *, stride: int = 1, how: Written, relu: bool = True):
    y = conv2d(x, params[f"{conv_name}.weight"], params.get(f"{conv_name}.bias"), stride=stride, how=how)
    y = batchnorm(y, params[f"{bn_name}.weight"], params[f"{bn_name}.bias"], how=how)
    return jax.nn.relu(y) if relu else y


# ---- the nets ---------------------------------------------------------------------------------------

def cifar8_logits(params, x: jax.Array, how: Written) -> jax.Array:
    """Four stages of (conv→BN→ReLU)² and a 2×2 pool, flatten, fc1→ReLU→fc2→ReLU→fc3
    (`gradtie.nets.cifar8`)."""
    for k in range(1, len(cifar8.WIDTHS) + 1):
        for j in (2 * k - 1, 2 * k):
            x = conv_bn_relu(params, f"conv{j}", f"bn{j}", x, how=how)
        x = maxpool(x, cifar8.POOLS[f"pool{k}"], how=how)
    x = x.reshape(x.shape[0], -1)   # (C,H,W) in NCHW, (H,W,C) in NHWC: fc1's rows are laid out to match
    x = jax.nn.relu(dense(x, params["fc1.weight"], params["fc1.bias"], how=how))
    x = jax.nn.relu(dense(x, params["fc2.weight"], params["fc2.bias"], how=how))
    return dense(x, params["fc3.weight"], params["fc3.bias"], how=how)


def resnet34_logits(params, x: jax.Array, how: Written) -> jax.Array:
    """Stem 7×7/s2 conv→BN→ReLU and 3×3/s2 pool, sixteen basic blocks (a 1×1/s2 conv→BN projection
    on the skip of each strided one), global average pool, fc (`gradtie.nets.resnet34`, torchvision's
    resnet34)."""
    x = conv_bn_relu(params, "conv1", "bn1", x.astype(how.compute), stride=2, how=how)
    x = maxpool(x, resnet34.POOLS["stem.pool"], how=how)
    for block in resnet34.blocks():
        p = block.name
        y = conv_bn_relu(params, f"{p}.conv1", f"{p}.bn1", x, stride=block.stride, how=how)
        y = conv_bn_relu(params, f"{p}.conv2", f"{p}.bn2", y, how=how, relu=False)
        skip = x if block.stride == 1 else conv_bn_relu(params, f"{p}.downsample.0", f"{p}.downsample.1", x,
                                                        stride=block.stride, how=how, relu=False)
        x = jax.nn.relu(y + skip)
    g = jnp.mean(x.astype(params["fc.bias"].dtype), axis=how.spatial_axes)
    return dense(g, params["fc.weight"], params["fc.bias"], how=how)


LOGITS = {"cifar8": cifar8_logits, "resnet34": resnet34_logits}


def loss(params, x: jax.Array, targets: jax.Array, *, how: Written) -> jax.Array:
    """Mean over the batch of the softmax cross-entropy against t̃ = (1 − α)t + α/K (optax)."""
    logits = LOGITS[how.net](params, x, how)
    return jnp.mean(optax.softmax_cross_entropy(logits, optax.smooth_labels(targets, how.alpha)))


# (loss, gradients of every parameter), one program per (how, shapes)
loss_and_grads = jax.jit(reference.value_and_grad(loss), static_argnames="how")


# ---- gradtie's layout <-> the peer's, once --------------------------------------------------------

def _flat_feature_map() -> tuple[int, int, int]:
    """(C, H, W) of cifar8's last pool output, the map fc1 reads flattened."""
    c = cifar8.WIDTHS[-1]
    side = math.isqrt(cifar8.FLAT // c)
    return c, side, side


def _to(name: str, v: np.ndarray, net: str, layout: str) -> np.ndarray:
    if v.ndim == 4:
        return v if layout == "NCHW" else v.transpose(2, 3, 1, 0)           # OIHW -> HWIO
    if v.ndim == 2:
        if net == "cifar8" and name == "fc1.weight" and layout == "NHWC":   # [out, (C,H,W)] -> [out, (H,W,C)]
            v = v.reshape(v.shape[0], *_flat_feature_map()).transpose(0, 2, 3, 1).reshape(v.shape[0], -1)
        return v.T                                                          # [out, in] -> [in, out]
    return v


def _back(name: str, v: np.ndarray, net: str, layout: str) -> np.ndarray:
    if v.ndim == 4:
        return v if layout == "NCHW" else v.transpose(3, 2, 0, 1)           # HWIO -> OIHW
    if v.ndim == 2:
        v = v.T
        if net == "cifar8" and name == "fc1.weight" and layout == "NHWC":
            c, h, w = _flat_feature_map()
            v = v.reshape(v.shape[0], h, w, c).transpose(0, 3, 1, 2).reshape(v.shape[0], -1)
        return v
    return v


def to_layout(params: Mapping[str, np.ndarray], net: str, layout: str) -> dict[str, np.ndarray]:
    """gradtie's parameters (OIHW convs, [out, in] dense) in the peer's layout (contiguous copies)."""
    return {name: np.ascontiguousarray(_to(name, np.asarray(v), net, layout)) for name, v in params.items()}


def from_layout(grads: Mapping[str, np.ndarray], net: str, layout: str) -> dict[str, np.ndarray]:
    """The peer's gradients back in gradtie's layout: `to_layout`'s inverse."""
    return {name: np.ascontiguousarray(_back(name, np.asarray(v), net, layout)) for name, v in grads.items()}


# ---- the peer ---------------------------------------------------------------------------------------

def make(net_name: str, params: Mapping[str, Any], x, targets, *, num_classes: int, dtype: str = "float32",
         alpha: float = 0.0, layout: str = "NCHW", padding: Callable[[int, int], Any] = symmetric,
         precision: str = "HIGHEST", compute: Optional[str] = None) -> Jitted:
    """The plain-JAX step of `net_name` at (params, x, targets), gradtie's layout in (NCHW images,
    OIHW kernels), converted once to `layout`; float64 needs jax_enable_x64. precision, compute:
    see `Written` (compute None: `dtype`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"plain_jax: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    dt = check_dtype(dtype)
    if dt == np.float64:
        need_x64("plain_jax")
    cfg = config_of(net_of(net_name), params, num_classes)
    how = Written(net_name, layout, float(cfg.eps), float(alpha), padding, precision, compute or str(np.dtype(dt)))
    p = jax.device_put(to_layout(host(params, dt), net_name, layout))
    xs = np.asarray(x, dt)
    xs = np.ascontiguousarray(xs if layout == "NCHW" else xs.transpose(0, 2, 3, 1))
    args = (p, jax.device_put(xs), jax.device_put(np.asarray(targets, dt)))
    return Jitted(partial(loss_and_grads, how=how), args, partial(from_layout, net=net_name, layout=layout),
                  list(params))


def available() -> tuple[bool, str]:
    return True, ""


def version() -> str:
    return f"jax {jax.__version__}"


def threads(n=None) -> int:
    """XLA's CPU client sizes its own pool; the peer leaves it and reports it."""
    return xla_threads()


def device() -> str:
    return jax.default_backend()


def peer(layout: str, *, padding: Callable[[int, int], Any] = symmetric, name: str = "") -> Peer:
    return Peer(name or f"jax-{layout.lower()}", layout, partial(make, layout=layout, padding=padding), available,
                version, threads, device)


# Peers that are wrong on purpose: the agreement must go red on them.
PLANTED = {"jax_same_padding_strided": peer("NCHW", padding=xla_same, name="jax-nchw, 'SAME' on strided convs")}
