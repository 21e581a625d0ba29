"""A net of your own, checked by gradtie: a small ResNet-50-style bottleneck net with a depthwise conv.

Built only from gradtie's public protocol (`gradtie.nets.protocol`, `gradtie.nets.layers`), the way
a practitioner would write a net with a hand-written backward:

| stage    | layers                                                                         | output  |
|----------|--------------------------------------------------------------------------------|---------|
| stem     | conv1 3×3 3→16, bn1, ReLU; 2×2 max pool                                        | 16×H/2  |
| dw       | depthwise 3×3 16→16 (an op of our own, not in gradtie's kit), bn, ReLU         | 16×H/2  |
| layer1.0 | bottleneck 1×1 16→8, 3×3 8→8, 1×1 8→32; projection 1×1 16→32 + BN              | 32×H/2  |
| layer2.0 | bottleneck 1×1 32→16, 3×3/s2 16→16 (the stride in the 3×3), 1×1 16→64;         | 64×H/4  |
|          | projection 1×1/s2 32→64 + BN                                                   |         |
| head     | global average pool, fc 64 → K                                                 | K       |

Every op gradtie's kit has is called through the kit a stage is handed (so the catalogue of planted
bugs plants into it); the depthwise conv brings its own forward and hand-written backward (`depthwise`
below), and its own planted bug (`DEPTHWISE_NOT_FLIPPED`), which `gradtie check --plant-bug` plants
like any other. Check it:

    gradtie check --net examples/bottleneck.py:NET
    gradtie check --net examples/bottleneck.py:NET --plant-bug list
    gradtie check --net examples/bottleneck.py:NET --plant-bug depthwise_kernel_not_flipped   # exit 1

Shown in: Check your own backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from gradtie.checks.bugs import Bug
from gradtie.checks.tie import Chain
from gradtie.kit import KIT
from gradtie.nets import protocol
from gradtie.nets.layers import (ConvBNSaved, bn_input, bn_nodes, bn_saved, bn_specs, conv_bn, conv_bn_specs,
                                 conv_input, conv_nodes, dense_specs, pool, pool_input)
from gradtie.nets.protocol import Net, ParamSpec, Pass, Stage
from gradtie.ops import batchnorm, dense, gap, maxpool, relu


# ---- an op of our own: the depthwise 3×3 conv, forward and hand-written backward ------------------

class DepthwiseSaved(NamedTuple):
    x: jax.Array   # the input, read by the weight gradient


def _taps(x, k: int = 3):
    """The k·k shifted views of x zero-padded by (k−1)/2: tap (kh, kw) is xpad[:, :, i+kh, j+kw]."""
    p = k // 2
    xpad = jnp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    h, w = x.shape[2], x.shape[3]
    return [[xpad[:, :, kh:kh + h, kw:kw + w] for kw in range(k)] for kh in range(k)]


def depthwise_forward(x, weight):
    """y[n,c,i,j] = Σ_{kh,kw} xpad[n,c,i+kh,j+kw]·W[c,0,kh,kw]; x [N,C,H,W], W [C,1,3,3], stride 1."""
    taps = _taps(x, weight.shape[2])
    y = sum(taps[kh][kw] * weight[None, :, 0, kh, kw, None, None]
            for kh in range(weight.shape[2]) for kw in range(weight.shape[3]))
    return y, DepthwiseSaved(x)


# dy[N,C,H,W] correlated per channel with flip(W)[C,3,3] -> dx[N,C,H,W], same padding
def depthwise_backward(weight, dy):
    """dx[n,c,h,w] = Σ_{kh,kw} dypad[n,c,h+k−1−kh,w+k−1−kw]·W[c,0,kh,kw]: the kernel flipped."""
    k = weight.shape[2]
    taps = _taps(dy, k)
    return sum(taps[k - 1 - kh][k - 1 - kw] * weight[None, :, 0, kh, kw, None, None]
               for kh in range(k) for kw in range(k))


# x[N,C,H,W] (padded) against dy[N,C,H,W], summed over (n, i, j) -> dW[C,1,3,3]
def depthwise_grad_weight(saved: DepthwiseSaved, dy, kernel_size: int = 3):
    """dW[c,0,kh,kw] = Σ_{n,i,j} dy[n,c,i,j]·xpad[n,c,i+kh,j+kw]."""
    taps = _taps(saved.x, kernel_size)
    rows = [jnp.stack([jnp.sum(dy * taps[kh][kw], axis=(0, 2, 3)) for kw in range(kernel_size)], axis=-1)
            for kh in range(kernel_size)]
    return jnp.stack(rows, axis=-2)[:, None]


def depthwise_backward_not_flipped(weight, dy):
    """The bug of our own: the depthwise input backward correlating with W unflipped."""
    k = weight.shape[2]
    taps = _taps(dy, k)
    return sum(taps[kh][kw] * weight[None, :, 0, kh, kw, None, None] for kh in range(k) for kw in range(k))


# ---- the configuration and the parameters ----------------------------------------------------------

@dataclass(frozen=True)
class Config(protocol.Config):
    """stem width, the two bottleneck stages' (inner width, output width) and K."""
    stem: int = 16
    stages: tuple = ((8, 32, 1), (16, 64, 2))   # (inner width, output width, stride) per bottleneck


def _blocks(cfg: Config):
    in_ch = cfg.stem
    for i, (inner, out, stride) in enumerate(cfg.stages, start=1):
        yield f"layer{i}.0", in_ch, inner, out, stride
        in_ch = out


def _stem_specs(cfg: Config):
    return conv_bn_specs("conv1", "bn1", 3, cfg.stem, 3, False)


def _dw_specs(cfg: Config):
    return [ParamSpec("dw.conv.weight", (cfg.stem, 1, 3, 3), "conv", "weight", "dw.bn")] + bn_specs("dw.bn", cfg.stem)


def _block_specs(name, in_ch, inner, out):
    return (conv_bn_specs(f"{name}.conv1", f"{name}.bn1", in_ch, inner, 1, False)
            + conv_bn_specs(f"{name}.conv2", f"{name}.bn2", inner, inner, 3, False)
            + conv_bn_specs(f"{name}.conv3", f"{name}.bn3", inner, out, 1, False)
            + conv_bn_specs(f"{name}.downsample.0", f"{name}.downsample.1", in_ch, out, 1, False))


def _head_specs(cfg: Config):
    return dense_specs("fc", cfg.stages[-1][1], cfg.num_classes)


def param_specs(cfg: Config = Config()):
    return (_stem_specs(cfg) + _dw_specs(cfg)
            + [s for name, i, m, o, _ in _blocks(cfg) for s in _block_specs(name, i, m, o)] + _head_specs(cfg))


# ---- the stages ------------------------------------------------------------------------------------

class StemSaved(NamedTuple):
    layer: ConvBNSaved
    n: jax.Array                # BN output, the ReLU's input
    r: jax.Array                # the pool's input
    sigma: Optional[jax.Array]  # the frozen selection under the gather model


def _stem_forward(params, x, cfg, how: Pass):
    n, layer = conv_bn(params, "conv1", "bn1", x, cfg, how)
    r, _ = relu.forward(n)
    y, sigma = pool("stem.pool", maxpool.POOL2, r, how)
    return y, StemSaved(layer, n, r, sigma)


def _stem_backward(params, s: StemSaved, dy, cfg, kit):
    bn = bn_saved(s.layer, cfg)
    dr = kit.relu_backward(relu.ReluSaved(s.n), pool_input(kit, "stem.pool", maxpool.POOL2, s.r, s.sigma, dy))
    dn = bn_input(kit, params, "bn1", bn, dr)
    grads = {**conv_nodes(kit, params, "conv1", s.layer.x, dn, cfg), **bn_nodes(kit, params, "bn1", bn, dr)}
    return grads, conv_input(kit, params, "conv1", dn, s.layer.x.shape, cfg)


class DwSaved(NamedTuple):
    x: jax.Array
    c: jax.Array      # the depthwise conv's output, the BN's input
    mean: jax.Array
    var: jax.Array
    n: jax.Array      # the BN output, the ReLU's input


def _dw_forward(params, x, cfg, how: Pass):
    c, _ = depthwise_forward(x, params["dw.conv.weight"])
    n, bn = batchnorm.forward(c, params["dw.bn.weight"], params["dw.bn.bias"], eps=cfg.eps,
                              axis_name=cfg.bn_axis_name, valid=how.valid)
    return relu.forward(n)[0], DwSaved(x, c, bn.mean, bn.var, n)


def _dw_backward(depthwise_input, params, s: DwSaved, dy, cfg, kit):
    bn = batchnorm.BNSaved(s.c, s.mean, s.var, cfg.eps, False, cfg.bn_axis_name)
    dr = kit.relu_backward(relu.ReluSaved(s.n), dy)
    dc = bn_input(kit, params, "dw.bn", bn, dr)
    grads = {"dw.conv.weight": depthwise_grad_weight(DepthwiseSaved(s.x), dc), **bn_nodes(kit, params, "dw.bn", bn, dr)}
    return grads, depthwise_input(params["dw.conv.weight"], dc)


class BlockSaved(NamedTuple):
    l1: ConvBNSaved
    n1: jax.Array
    l2: ConvBNSaved
    n2: jax.Array
    l3: ConvBNSaved
    proj: ConvBNSaved
    a: jax.Array      # n3 + the projection: the output ReLU's input


def _block_forward(name, stride, params, x, cfg, how: Pass):
    n1, l1 = conv_bn(params, f"{name}.conv1", f"{name}.bn1", x, cfg, how)
    n2, l2 = conv_bn(params, f"{name}.conv2", f"{name}.bn2", relu.forward(n1)[0], cfg, how, stride=stride)
    n3, l3 = conv_bn(params, f"{name}.conv3", f"{name}.bn3", relu.forward(n2)[0], cfg, how)
    skip, proj = conv_bn(params, f"{name}.downsample.0", f"{name}.downsample.1", x, cfg, how, stride=stride)
    a = n3 + skip
    return relu.forward(a)[0], BlockSaved(l1, n1, l2, n2, l3, proj, a)


# da = mask(a>0)·dy; the main branch bn3 → conv3 → relu → bn2 → conv2 (strided) → relu → bn1 → conv1;
# the projection bnₚ reads the same da; dx = main + projection (the residual fan-in)
def _block_backward(name, stride, params, s: BlockSaved, dy, cfg, kit):
    da = kit.relu_backward(relu.ReluSaved(s.a), dy)
    grads = {}

    def conv_bn_back(conv, bn_name, layer, dn_out, stride_=1):
        bn = bn_saved(layer, cfg)
        dc = bn_input(kit, params, bn_name, bn, dn_out)
        grads.update({**conv_nodes(kit, params, conv, layer.x, dc, cfg, stride=stride_),
                      **bn_nodes(kit, params, bn_name, bn, dn_out)})
        return conv_input(kit, params, conv, dc, layer.x.shape, cfg, stride=stride_)

    d = conv_bn_back(f"{name}.conv3", f"{name}.bn3", s.l3, da)
    d = conv_bn_back(f"{name}.conv2", f"{name}.bn2", s.l2, kit.relu_backward(relu.ReluSaved(s.n2), d), stride)
    d = conv_bn_back(f"{name}.conv1", f"{name}.bn1", s.l1, kit.relu_backward(relu.ReluSaved(s.n1), d))
    dp = conv_bn_back(f"{name}.downsample.0", f"{name}.downsample.1", s.proj, da, stride)
    return grads, kit.residual_backward(d, dp)


class HeadSaved(NamedTuple):
    x: jax.Array
    g: jax.Array


def _head_forward(params, x, cfg, how: Pass):
    g, _ = gap.forward(x)
    return dense.forward(g, params["fc.weight"], params["fc.bias"])[0], HeadSaved(x, g)


def _head_backward(params, s: HeadSaved, dlogits, cfg, kit):
    dg = kit.dense_backward("fc", params["fc.weight"], dlogits)
    grads = {"fc.weight": kit.dense_grad_weight("fc", s.g, dlogits), "fc.bias": kit.dense_grad_bias("fc", dlogits)}
    return grads, kit.gap_backward(s.x.shape, dg)


def _names(specs):
    return tuple(s.name for s in specs)


def stage_list(cfg: Config = Config(), *, depthwise_input=depthwise_backward):
    out = [Stage("stem", "stem", _stem_forward, _stem_backward, _names(_stem_specs(cfg)),
                 relu_inputs=lambda s: {"bn1": s.n}, pool_inputs=lambda s: {"stem.pool": s.r},
                 bn_layers=lambda s: {"bn1": s.layer}),
           Stage("dw", "depthwise", _dw_forward, partial(_dw_backward, depthwise_input), _names(_dw_specs(cfg)),
                 relu_inputs=lambda s: {"dw.bn": s.n},
                 bn_layers=lambda s: {"dw.bn": ConvBNSaved(s.x, s.c, s.mean, s.var)})]
    for name, in_ch, inner, width, stride in _blocks(cfg):
        out.append(Stage(name, "bottleneck", partial(_block_forward, name, stride), partial(_block_backward, name, stride),
                         _names(_block_specs(name, in_ch, inner, width)),
                         relu_inputs=lambda s, n=name: {f"{n}.bn1": s.n1, f"{n}.bn2": s.n2, f"{n}.add": s.a},
                         bn_layers=lambda s, n=name: {f"{n}.bn1": s.l1, f"{n}.bn2": s.l2, f"{n}.bn3": s.l3,
                                                      f"{n}.downsample.1": s.proj}))
    out.append(Stage("head", "head", _head_forward, _head_backward, _names(_head_specs(cfg))))
    return out


def make_net(depthwise_input=depthwise_backward, name: str = "bottleneck") -> Net:
    """The net, with the depthwise input backward it runs (a planted one: its own bug)."""
    return Net(name, Config, param_specs, partial(stage_list, depthwise_input=depthwise_input),
               pools={"stem.pool": maxpool.POOL2}, pool_preactivations={"stem.pool": "bn1"},
               size_rule="a positive multiple of 4", size_ok=lambda s: s >= 4 and s % 4 == 0, default_size=32,
               # each block's projection BN reads the cotangent its bn3 reads (the catalogue's projection entry)
               projections={f"{n}.downsample.1": f"{n}.bn3" for n, *_ in _blocks(Config())})


DEPTHWISE_NOT_FLIPPED = Bug(
    "depthwise_kernel_not_flipped", "the net's own ops", "the depthwise conv's input backward with W unflipped",
    "correlation and convolution confused in a hand-written depthwise transpose",
    lambda net: Chain(make_net(depthwise_backward_not_flipped, net.name), KIT),
    lambda net, calls: True)

NET = dataclasses.replace(make_net(), bugs=(DEPTHWISE_NOT_FLIPPED,))
