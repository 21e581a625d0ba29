"""ResNet-34 at true batch BatchNorm: 7×7/s2 stem, 3×3/s2 stem pool, [3,4,6,3] basic blocks, GAP + fc.

Eighteen stages: "stem" (conv1 7×7/s2 → bn1 → ReLU → 3×3/s2 pool), sixteen basic blocks
"layer1.0" … "layer4.2" (thirteen identity blocks, three downsample blocks "layer2.0", "layer3.0",
"layer4.0" with a 1×1/s2 conv + BN projection on the skip) and "head" (GAP → fc). Parameter names
are torchvision's `resnet34().state_dict()` keys without the running statistics. Input [N,3,S,S],
S any multiple of 32. The rendered backward is composed from `gradtie.ops` only and is checked
node by node against `gradtie.reference`. Shown in: Whole-net tie, bf16 erasure, Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional

import jax

from ..ops import gap, maxpool, relu, residual
from . import protocol
from .layers import (ConvBNSaved, bn_input, bn_nodes, bn_saved, conv_bn, conv_bn_specs, conv_input,
                     conv_nodes, dense_forward, dense_input, dense_nodes, dense_specs, pool, pool_input)
from .protocol import Net, Pass, Stage

NAME = "resnet34"
STAGE_SIZES = (3, 4, 6, 3)      # basic blocks per layer
WIDTHS = (64, 128, 256, 512)    # channels per layer
STEM_WIDTH = 64
POOLS = {"stem.pool": maxpool.POOL3S2}
POOL_PREACTIVATIONS = {"stem.pool": "bn1"}  # the z feeding ReLU → the stem pool
# The suite's statements fix the resolution (and the widths above) as literals; the batch N is a binder
SUITE_IMAGE_SIZE = 224


@dataclass(frozen=True)
class Config(protocol.Config):
    """num_classes K (1000 for ImageNet); conv_bias adds a bias to every conv (36 vectors)."""
    num_classes: int = 1000
    conv_bias: bool = False


class Block(NamedTuple):
    name: str      # "layer2.0"
    in_ch: int
    width: int
    stride: int    # 2 for the first block of layers 2–4 (downsample), else 1

    @property
    def kind(self) -> str:
        return "downsample" if self.stride == 2 else "identity"


def blocks() -> list[Block]:
    """The sixteen basic blocks, from the sizes (3, 4, 6, 3) at widths 64 … 512."""
    out, in_ch = [], STEM_WIDTH
    for layer, (size, width) in enumerate(zip(STAGE_SIZES, WIDTHS), start=1):
        for i in range(size):
            stride = 2 if layer > 1 and i == 0 else 1
            out.append(Block(f"layer{layer}.{i}", in_ch, width, stride))
            in_ch = width
    return out


def _stem_specs(cfg: Config):
    return conv_bn_specs("conv1", "bn1", 3, STEM_WIDTH, 7, cfg.conv_bias)


def _block_specs(block: Block, cfg: Config):
    p = block.name
    specs = (conv_bn_specs(f"{p}.conv1", f"{p}.bn1", block.in_ch, block.width, 3, cfg.conv_bias)
             + conv_bn_specs(f"{p}.conv2", f"{p}.bn2", block.width, block.width, 3, cfg.conv_bias))
    if block.stride == 2:
        specs += conv_bn_specs(f"{p}.downsample.0", f"{p}.downsample.1", block.in_ch, block.width, 1, cfg.conv_bias)
    return specs


def _head_specs(cfg: Config):
    return dense_specs("fc", WIDTHS[-1], cfg.num_classes)


def param_specs(cfg: Config = Config()):
    """(name, shape, init rule) of every tensor, in torchvision state_dict order."""
    return (_stem_specs(cfg) + [spec for block in blocks() for spec in _block_specs(block, cfg)]
            + _head_specs(cfg))


# ---- stem: conv 7×7/s2 → BN → ReLU → max pool 3×3/s2 pad 1 -----------------------------------------

class StemSaved(NamedTuple):
    layer: ConvBNSaved         # input x, c1 = conv(x), bn1 statistics
    n1: jax.Array              # BN output feeding the ReLU
    r1: jax.Array              # pool input (post-ReLU): the tie-break compares it
    sigma: Optional[jax.Array]  # the frozen selection under the gather model, else None


def _stem_forward(params, x, cfg: Config, how: Pass):
    n1, layer = conv_bn(params, "conv1", "bn1", x, cfg, how, stride=2)
    r1, _ = relu.forward(n1)
    y, sigma = pool("stem.pool", POOLS["stem.pool"], r1, how)
    return y, StemSaved(layer, n1, r1, sigma)


# dv names the cotangent leaving node v's backward (the render's names): dn1 = bnBack(c1; dr1) sits at c1.
def _stem_backward(params, s: StemSaved, dy, cfg: Config, kit):
    bn1 = bn_saved(s.layer, cfg)
    dp = pool_input(kit, "stem.pool", POOLS["stem.pool"], s.r1, s.sigma, dy)  # overlapping windows accumulate
    dr1 = kit.relu_backward(relu.ReluSaved(s.n1), dp)
    dn1 = bn_input(kit, params, "bn1", bn1, dr1)
    dx = conv_input(kit, params, "conv1", dn1, s.layer.x.shape, cfg, stride=2)
    grads = {**conv_nodes(kit, params, "conv1", s.layer.x, dn1, cfg, stride=2), **bn_nodes(kit, params, "bn1", bn1, dr1)}
    return grads, dx


def _stem_readers():
    return (lambda s: {"bn1": s.n1}, lambda s: {"stem.pool": s.r1}, lambda s: {"bn1": s.layer})


# ---- basic blocks ----------------------------------------------------------------------------------

class BlockSaved(NamedTuple):
    layer1: ConvBNSaved            # block input x, c1 = conv1(x), bn1 statistics
    n1: jax.Array                  # bn1 output feeding the inner ReLU
    layer2: ConvBNSaved            # r1 = relu(n1), c2 = conv2(r1), bn2 statistics
    a: jax.Array                   # a = n2 + skip, feeding the block's output ReLU
    proj: Optional[ConvBNSaved]    # downsample: x, cp = 1×1/s2 conv(x), projection BN statistics


def _block_forward(block: Block, params, x, cfg: Config, how: Pass):
    p = block.name
    n1, layer1 = conv_bn(params, f"{p}.conv1", f"{p}.bn1", x, cfg, how, stride=block.stride)
    r1, _ = relu.forward(n1)
    n2, layer2 = conv_bn(params, f"{p}.conv2", f"{p}.bn2", r1, cfg, how)
    if block.stride == 1:
        skip, proj = x, None
    else:
        skip, proj = conv_bn(params, f"{p}.downsample.0", f"{p}.downsample.1", x, cfg, how, stride=2)
    a = residual.forward(n2, skip)
    out, _ = relu.forward(a)
    return out, BlockSaved(layer1, n1, layer2, a, proj)


# da = mask(a>0)·dy, dn2 = bnBack(c2; da), dc2 = convBack(W2; dn2), dr1 = mask(n1>0)·dc2,
# dn1 = bnBack(c1; dr1), dx = convBack(W1; dn1) + da  (downsample: + stridedConvBack(Wp; bnBack(cp; da)))
def _block_backward(block: Block, params, s: BlockSaved, dy, cfg: Config, kit):
    p = block.name
    bn1, bn2 = bn_saved(s.layer1, cfg), bn_saved(s.layer2, cfg)
    da = kit.relu_backward(relu.ReluSaved(s.a), dy)
    dn2 = bn_input(kit, params, f"{p}.bn2", bn2, da)
    dc2 = conv_input(kit, params, f"{p}.conv2", dn2, s.layer2.x.shape, cfg)
    dr1 = kit.relu_backward(relu.ReluSaved(s.n1), dc2)
    dn1 = bn_input(kit, params, f"{p}.bn1", bn1, dr1)
    dc1 = conv_input(kit, params, f"{p}.conv1", dn1, s.layer1.x.shape, cfg, stride=block.stride)
    grads = {**conv_nodes(kit, params, f"{p}.conv1", s.layer1.x, dn1, cfg, stride=block.stride),
             **bn_nodes(kit, params, f"{p}.bn1", bn1, dr1),
             **conv_nodes(kit, params, f"{p}.conv2", s.layer2.x, dn2, cfg),
             **bn_nodes(kit, params, f"{p}.bn2", bn2, da)}
    if s.proj is None:
        return grads, kit.residual_backward(dc1, da)
    bnp = bn_saved(s.proj, cfg)
    dnp = bn_input(kit, params, f"{p}.downsample.1", bnp, da)  # reads the same da as bn2
    dcp = conv_input(kit, params, f"{p}.downsample.0", dnp, s.proj.x.shape, cfg, stride=2)
    grads.update({**conv_nodes(kit, params, f"{p}.downsample.0", s.proj.x, dnp, cfg, stride=2),
                  **bn_nodes(kit, params, f"{p}.downsample.1", bnp, da)})
    return grads, kit.residual_backward(dc1, dcp)


def _block_relu_inputs(block: Block, s: BlockSaved) -> dict:
    return {f"{block.name}.bn1": s.n1, f"{block.name}.add": s.a}


def _block_bn_layers(block: Block, s: BlockSaved) -> dict:
    out = {f"{block.name}.bn1": s.layer1, f"{block.name}.bn2": s.layer2}
    if s.proj is not None:
        out[f"{block.name}.downsample.1"] = s.proj
    return out


# ---- head: global average pool → fc ----------------------------------------------------------------

class HeadSaved(NamedTuple):
    x: jax.Array  # the GAP input (its shape is what the GAP backward reads)
    g: jax.Array  # GAP output [N,512]: the fc input


def _head_forward(params, x, cfg: Config, how: Pass):
    g, _ = gap.forward(x)      # float32 for bf16 activations: the head's dtype
    return dense_forward(params, "fc", g, cfg), HeadSaved(x, g)


def _head_backward(params, s: HeadSaved, dlogits, cfg: Config, kit):
    dg = dense_input(kit, params, "fc", dlogits, cfg)
    dx = kit.gap_backward(s.x.shape, dg)   # in the head's dtype: the ReLU mask below hands on its own
    return dense_nodes(kit, "fc", s.g, dlogits, cfg), dx


# ---- the net ---------------------------------------------------------------------------------------

def stage_list(cfg: Config = Config()) -> list[Stage]:
    """The eighteen stages: stem, 13 identity and 3 downsample blocks, head."""
    out = [Stage("stem", "stem", _stem_forward, _stem_backward, tuple(s.name for s in _stem_specs(cfg)),
                 *_stem_readers())]
    out += [Stage(block.name, block.kind, partial(_block_forward, block), partial(_block_backward, block),
                  tuple(s.name for s in _block_specs(block, cfg)), partial(_block_relu_inputs, block),
                  bn_layers=partial(_block_bn_layers, block))
            for block in blocks()]
    out.append(Stage("head", "head", _head_forward, _head_backward, tuple(s.name for s in _head_specs(cfg))))
    return out


def config_of_params(shapes) -> dict:
    """The config a checkpoint's tensors imply: conv biases and the classes."""
    out = {"conv_bias": "conv1.bias" in shapes}
    if "fc.weight" in shapes:
        out["num_classes"] = int(shapes["fc.weight"][0])
    return out


# each projection BN on a downsample block's skip reads the cotangent its block's bn2 reads
PROJECTIONS = {f"{b.name}.downsample.1": f"{b.name}.bn2" for b in blocks() if b.stride == 2}
NET = Net(NAME, Config, param_specs, stage_list, POOLS, POOL_PREACTIVATIONS, size_rule="a positive multiple of 32",
          size_ok=lambda s: s >= 32 and s % 32 == 0, default_size=SUITE_IMAGE_SIZE, suite=NAME,
          stage_lean={"stem": "cbReluStridedBBack_eq_vjp_backward + the stem pool (StemPoolSmoothAt)",
                      "identity": "r34IdCotIn_eq_vjp", "downsample": "r34DownCotIn_eq_vjp",
                      "head": "r34HeadBBack_eq_vjp_backward (r34HeadBHasVJP: global)"},
          projections=PROJECTIONS, check_classes=10, label_smoothing=0.1, config_of_params=config_of_params)
