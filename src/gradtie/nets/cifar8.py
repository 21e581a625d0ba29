"""cifar8-BN with batch statistics: eight conv→BN→ReLU layers, four 2×2 max pools, a dense head.

| stage  | layers                                                               | output   |
|--------|----------------------------------------------------------------------|----------|
| stage1 | conv1 3→16, bn1, ReLU; conv2 16→16, bn2, ReLU; pool1 (2×2)            | 16×16×16 |
| stage2 | conv3 16→16, bn3, ReLU; conv4 16→16, bn4, ReLU; pool2                 | 16×8×8   |
| stage3 | conv5 16→32, bn5, ReLU; conv6 32→32, bn6, ReLU; pool3                 | 32×4×4   |
| stage4 | conv7 32→32, bn7, ReLU; conv8 32→32, bn8, ReLU; pool4                 | 32×2×2   |
| head   | flatten (C,H,W) 128 → fc1 → ReLU → fc2 → ReLU → fc3                   | K        |

Input [N,3,32,32], pixels in [0,1]. The rendered backward is composed from `gradtie.ops` only and is
checked node by node against `gradtie.reference`. Shown in: Pools, Stage germs, Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional

import jax

from ..ops import maxpool, relu
from . import protocol
from .layers import (ConvBNSaved, bn_input, bn_nodes, bn_saved, conv_bn, conv_bn_specs, conv_input,
                     conv_nodes, dense_forward, dense_input, dense_nodes, dense_specs, pool, pool_input)
from .protocol import Net, Pass, Stage

NAME = "cifar8"
IMAGE_SIZE = 32
WIDTHS = (16, 16, 32, 32)  # output channels of stages 1…4; each stage is two conv→BN→ReLU layers
FLAT = WIDTHS[-1] * 2 * 2  # 32×2×2 after four 2×2 pools of a 32×32 image
POOLS = {f"pool{k}": maxpool.POOL2 for k in range(1, 5)}
POOL_PREACTIVATIONS = {f"pool{k}": f"bn{2 * k}" for k in range(1, 5)}  # the z feeding ReLU → pool k


@dataclass(frozen=True)
class Config(protocol.Config):
    """head_width d: 512 (the wide net) or 64 (the narrow one); bn: "batch" (batch statistics, the
    net the seeds name) or "example" (each image's own H·W cells; train = eval); conv_bias: every
    conv with a bias (cifar8's convs have one)."""
    head_width: int = 512
    bn: str = "batch"
    conv_bias: bool = True

    @property
    def bn_mode(self) -> str:
        return self.bn

    def __post_init__(self):
        super().__post_init__()
        if self.bn not in ("batch", "example"):
            raise ValueError(f"cifar8.Config: bn must be 'batch' or 'example', got {self.bn!r}")
        if isinstance(self.head_width, bool) or not isinstance(self.head_width, int) or self.head_width < 1:
            raise ValueError(f"cifar8.Config: head_width must be a positive integer, got {self.head_width!r}")


def _layers(k: int) -> tuple[int, int]:
    """Stage k holds layers 2k−1 and 2k."""
    return 2 * k - 1, 2 * k


def _stage_specs(k: int, cfg: Config):
    in_ch = 3 if k == 1 else WIDTHS[k - 2]
    width = WIDTHS[k - 1]
    a, b = _layers(k)
    return (conv_bn_specs(f"conv{a}", f"bn{a}", in_ch, width, 3, cfg.conv_bias)
            + conv_bn_specs(f"conv{b}", f"bn{b}", width, width, 3, cfg.conv_bias))


def _head_specs(cfg: Config):
    d = cfg.head_width
    return dense_specs("fc1", FLAT, d) + dense_specs("fc2", d, d) + dense_specs("fc3", d, cfg.num_classes)


def param_specs(cfg: Config = Config()):
    """(name, shape, init rule) of every tensor, in signature (state_dict) order."""
    return [spec for k in range(1, 5) for spec in _stage_specs(k, cfg)] + _head_specs(cfg)


# ---- stages 1…4: conv→BN→ReLU, conv→BN→ReLU, 2×2 pool ---------------------------------------------

class StageSaved(NamedTuple):
    """What stage k's backward reads; layer1 is conv/bn 2k−1, layer2 is conv/bn 2k."""
    layer1: ConvBNSaved        # stage input x, c1 = conv(x), bn statistics
    n1: jax.Array              # BN output feeding the first ReLU (its mask)
    layer2: ConvBNSaved        # r1 = relu(n1), c2 = conv(r1), bn statistics
    n2: jax.Array              # BN output feeding the second ReLU
    r2: jax.Array              # pool input (post-ReLU): the tie-break compares it
    sigma: Optional[jax.Array]  # the frozen selection under the gather model, else None


def _stage_forward(k: int, params, x, cfg: Config, how: Pass):
    a, b = _layers(k)
    n1, layer1 = conv_bn(params, f"conv{a}", f"bn{a}", x, cfg, how)
    r1, _ = relu.forward(n1)
    n2, layer2 = conv_bn(params, f"conv{b}", f"bn{b}", r1, cfg, how)
    r2, _ = relu.forward(n2)
    y, sigma = pool(f"pool{k}", POOLS[f"pool{k}"], r2, how)
    return y, StageSaved(layer1, n1, layer2, n2, r2, sigma)


# dv names the cotangent leaving node v's backward (the render's names): dn2 = bnBack(c2; dr2) sits at c2.
def _stage_backward(k: int, params, s: StageSaved, dy, cfg: Config, kit):
    a, b = _layers(k)
    bn1, bn2 = bn_saved(s.layer1, cfg), bn_saved(s.layer2, cfg)
    dp = pool_input(kit, f"pool{k}", POOLS[f"pool{k}"], s.r2, s.sigma, dy)
    dr2 = kit.relu_backward(relu.ReluSaved(s.n2), dp)
    dn2 = bn_input(kit, params, f"bn{b}", bn2, dr2)
    dc2 = conv_input(kit, params, f"conv{b}", dn2, s.layer2.x.shape, cfg)
    dr1 = kit.relu_backward(relu.ReluSaved(s.n1), dc2)
    dn1 = bn_input(kit, params, f"bn{a}", bn1, dr1)
    dx = conv_input(kit, params, f"conv{a}", dn1, s.layer1.x.shape, cfg)
    # conv{j} ← (its input, the cotangent at its output); bn{j} ← (c, the ReLU-masked cotangent)
    grads = {**conv_nodes(kit, params, f"conv{a}", s.layer1.x, dn1, cfg), **bn_nodes(kit, params, f"bn{a}", bn1, dr1),
             **conv_nodes(kit, params, f"conv{b}", s.layer2.x, dn2, cfg), **bn_nodes(kit, params, f"bn{b}", bn2, dr2)}
    return grads, dx


def _stage_relu_inputs(k: int, s: StageSaved) -> dict:
    a, b = _layers(k)
    return {f"bn{a}": s.n1, f"bn{b}": s.n2}


def _stage_pool_inputs(k: int, s: StageSaved) -> dict:
    return {f"pool{k}": s.r2}


def _stage_bn_layers(k: int, s: StageSaved) -> dict:
    a, b = _layers(k)
    return {f"bn{a}": s.layer1, f"bn{b}": s.layer2}


# ---- head: flatten → fc1 → ReLU → fc2 → ReLU → fc3 ------------------------------------------------

class HeadSaved(NamedTuple):
    f: jax.Array   # flattened stage-4 output [N,128] in (C,H,W) order: fc1's input
    h1: jax.Array  # fc1 output, feeding the first ReLU
    r1: jax.Array  # fc2's input
    h2: jax.Array  # fc2 output, feeding the second ReLU
    r2: jax.Array  # fc3's input


def _head_forward(params, x, cfg: Config, how: Pass):
    f = x.reshape(x.shape[0], -1)
    h1 = dense_forward(params, "fc1", f, cfg)
    r1, _ = relu.forward(h1)
    h2 = dense_forward(params, "fc2", r1, cfg)
    r2, _ = relu.forward(h2)
    logits = dense_forward(params, "fc3", r2, cfg)
    return logits, HeadSaved(f, h1, r1, h2, r2)


def _head_backward(params, s: HeadSaved, dlogits, cfg: Config, kit):
    dfc3 = dense_input(kit, params, "fc3", dlogits, cfg)
    dr2 = kit.relu_backward(relu.ReluSaved(s.h2), dfc3)
    dfc2 = dense_input(kit, params, "fc2", dr2, cfg)
    dr1 = kit.relu_backward(relu.ReluSaved(s.h1), dfc2)
    dfc1 = dense_input(kit, params, "fc1", dr1, cfg)
    dx = dfc1.reshape(s.f.shape[0], WIDTHS[-1], 2, 2)  # unflatten in (C,H,W) order
    grads = {**dense_nodes(kit, "fc1", s.f, dr1, cfg), **dense_nodes(kit, "fc2", s.r1, dr2, cfg),
             **dense_nodes(kit, "fc3", s.r2, dlogits, cfg)}
    return grads, dx


def _head_relu_inputs(s: HeadSaved) -> dict:
    return {"fc1": s.h1, "fc2": s.h2}


# ---- the net ---------------------------------------------------------------------------------------

def stage_list(cfg: Config = Config()) -> list[Stage]:
    """stage1 … stage4 (kind "conv"), then head (kind "head")."""
    out = [Stage(f"stage{k}", "conv", partial(_stage_forward, k), partial(_stage_backward, k),
                 tuple(spec.name for spec in _stage_specs(k, cfg)), partial(_stage_relu_inputs, k),
                 partial(_stage_pool_inputs, k), partial(_stage_bn_layers, k))
           for k in range(1, 5)]
    out.append(Stage("head", "head", _head_forward, _head_backward,
                     tuple(spec.name for spec in _head_specs(cfg)), _head_relu_inputs))
    return out


# ---- the same net as seventeen CertLayers (`cifar8BbnInputGradB_correct`'s `cifar8BbnLayer`) -------

class LayerSaved(NamedTuple):
    x: jax.Array                 # the layer's input
    z: Optional[jax.Array]       # the ReLU input (conv→BN→ReLU, relu) or the pool input (pool)
    layer: Optional[ConvBNSaved] = None   # conv→BN→ReLU: the conv and BN record
    sigma: Optional[jax.Array] = None     # pool: the frozen selection, else None


def _cbr_forward(j: int, params, x, cfg: Config, how: Pass):
    n, layer = conv_bn(params, f"conv{j}", f"bn{j}", x, cfg, how)
    return relu.forward(n)[0], LayerSaved(x, n, layer)


def _cbr_backward(j: int, params, s: LayerSaved, dy, cfg: Config, kit):
    bn = bn_saved(s.layer, cfg)
    dr = kit.relu_backward(relu.ReluSaved(s.z), dy)
    dn = bn_input(kit, params, f"bn{j}", bn, dr)
    dx = conv_input(kit, params, f"conv{j}", dn, s.x.shape, cfg)
    return {**conv_nodes(kit, params, f"conv{j}", s.x, dn, cfg), **bn_nodes(kit, params, f"bn{j}", bn, dr)}, dx


def _pool_forward(k: int, params, x, cfg: Config, how: Pass):
    y, sigma = pool(f"pool{k}", POOLS[f"pool{k}"], x, how)
    return y, LayerSaved(x, x, sigma=sigma)


def _pool_backward(k: int, params, s: LayerSaved, dy, cfg: Config, kit):
    return {}, pool_input(kit, f"pool{k}", POOLS[f"pool{k}"], s.x, s.sigma, dy)


def _dense_forward(name: str, params, x, cfg: Config, how: Pass):
    y = dense_forward(params, name, x.reshape(x.shape[0], -1), cfg)
    return y, LayerSaved(x, None)


def _dense_backward(name: str, params, s: LayerSaved, dy, cfg: Config, kit):
    f = s.x.reshape(s.x.shape[0], -1)
    dx = dense_input(kit, params, name, dy, cfg).reshape(s.x.shape)
    return dense_nodes(kit, name, f, dy, cfg), dx


def _relu_forward(params, x, cfg: Config, how: Pass):
    return relu.forward(x)[0], LayerSaved(x, x)


def _relu_backward(params, s: LayerSaved, dy, cfg: Config, kit):
    return {}, kit.relu_backward(relu.ReluSaved(s.z), dy)


def layer_list(cfg: Config = Config()) -> list[Stage]:
    """The seventeen layers in forward order: (conv→BN→ReLU)², pool per stage; fc1, ReLU, fc2, ReLU,
    fc3. Composed, they are `stage_list`'s net, op for op."""
    names = {spec.name for spec in param_specs(cfg)}

    def own(*candidates):
        return tuple(n for n in candidates if n in names)

    out = []
    for k in range(1, 5):
        for j in _layers(k):
            out.append(Stage(f"conv{j}-bn{j}-relu", "conv-bn-relu", partial(_cbr_forward, j), partial(_cbr_backward, j),
                             own(f"conv{j}.weight", f"conv{j}.bias", f"bn{j}.weight", f"bn{j}.bias"),
                             lambda s, j=j: {f"bn{j}": s.z}, bn_layers=lambda s, j=j: {f"bn{j}": s.layer}))
        out.append(Stage(f"pool{k}", "pool", partial(_pool_forward, k), partial(_pool_backward, k), (),
                         pool_inputs=lambda s, k=k: {f"pool{k}": s.z}))
    for name, relu_after in (("fc1", "fc1"), ("fc2", "fc2"), ("fc3", None)):
        out.append(Stage(name, "dense", partial(_dense_forward, name), partial(_dense_backward, name),
                         own(f"{name}.weight", f"{name}.bias")))
        if relu_after:
            out.append(Stage(f"relu({name})", "relu", _relu_forward, _relu_backward, (),
                             lambda s, n=relu_after: {n: s.z}))
    return out


def config_of_params(shapes) -> dict:
    """The config a checkpoint's tensors imply: conv biases, the head's width and classes."""
    out = {"conv_bias": "conv1.bias" in shapes}
    if "fc1.weight" in shapes and "fc3.weight" in shapes:
        out.update(head_width=int(shapes["fc1.weight"][0]), num_classes=int(shapes["fc3.weight"][0]))
    return out


_SIZE = dict(size_rule=f"{IMAGE_SIZE}", size_ok=lambda s: s == IMAGE_SIZE, default_size=IMAGE_SIZE, suite=NAME,
             config_of_params=config_of_params)
LAYERS = Net(f"{NAME} (17 CertLayers)", Config, param_specs, layer_list, POOLS, POOL_PREACTIVATIONS, **_SIZE,
             stage_lean={"conv-bn-relu": "cbReluLayer", "pool": "maxPool2Layer (MaxPool2Smooth)",
                         "dense": "denseLayer", "relu": "reluOut"})
NET = Net(NAME, Config, param_specs, stage_list, POOLS, POOL_PREACTIVATIONS, **_SIZE,
          stage_lean={"conv": "cbReluLayer ×2 + maxPool2Layer (MaxPool2Smooth)", "head": "denseLayer, reluOut"},
          layers=LAYERS)
