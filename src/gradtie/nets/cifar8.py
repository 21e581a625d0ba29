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

from ..ops import batchnorm, conv, dense, maxpool, relu
from .stages import (ConvBNSaved, NetDef, Stage, batch_statistic_entries, bn_nodes, bn_saved, bn_specs,
                     conv_bn, conv_nodes, conv_specs, dense_specs, pool, pool_backward, rounding)
from . import stages as _stages

NAME = "cifar8"
IMAGE_SIZE = 32
WIDTHS = (16, 16, 32, 32)  # output channels of stages 1…4; each stage is two conv→BN→ReLU layers
FLAT = WIDTHS[-1] * 2 * 2  # 32×2×2 after four 2×2 pools of a 32×32 image
POOLS = {f"pool{k}": maxpool.POOL2 for k in range(1, 5)}
POOL_PREACTIVATIONS = {f"pool{k}": f"bn{2 * k}" for k in range(1, 5)}  # the z feeding ReLU → pool k


@dataclass(frozen=True)
class Config:
    """head_width d: 512 (the wide net) or 64 (the narrow one); bn: "batch" (batch statistics, the
    net the seeds name) or "example" (each image's own H·W cells; train = eval); bn_axis_name: the
    mesh axis for synchronised BatchNorm (None on one device)."""
    head_width: int = 512
    num_classes: int = 10
    bn: str = "batch"
    conv_bias: bool = True
    eps: float = 1e-5
    bf16: bool = False
    bn_axis_name: Optional[str] = None
    bf16_rounding: str = "bf16"  # the conv sites' rounding under bf16: "bf16", "nearest", "identity"

    def __post_init__(self):
        if self.bn not in ("batch", "example"):
            raise ValueError(f"cifar8.Config: bn must be 'batch' or 'example', got {self.bn!r}")
        if self.head_width < 1 or self.num_classes < 1:
            raise ValueError(f"cifar8.Config: head_width and num_classes must be positive, got "
                             f"{self.head_width} and {self.num_classes}")
        if not self.eps > 0:
            raise ValueError(f"cifar8.Config: eps must be positive, got {self.eps}")
        conv.named_rounding(self.bf16_rounding)  # ValueError naming the choices


def _layers(k: int) -> tuple[int, int]:
    """Stage k holds layers 2k−1 and 2k."""
    return 2 * k - 1, 2 * k


def _stage_specs(k: int, cfg: Config):
    in_ch = 3 if k == 1 else WIDTHS[k - 2]
    width = WIDTHS[k - 1]
    a, b = _layers(k)
    return (conv_specs(f"conv{a}", in_ch, width, 3, cfg.conv_bias) + bn_specs(f"bn{a}", width)
            + conv_specs(f"conv{b}", width, width, 3, cfg.conv_bias) + bn_specs(f"bn{b}", width))


def _head_specs(cfg: Config):
    d = cfg.head_width
    return dense_specs("fc1", FLAT, d) + dense_specs("fc2", d, d) + dense_specs("fc3", d, cfg.num_classes)


def param_specs(cfg: Config = Config()):
    """(name, shape, init rule) of every tensor, in signature (state_dict) order."""
    return [spec for k in range(1, 5) for spec in _stage_specs(k, cfg)] + _head_specs(cfg)


def bn_names(cfg: Config = Config()) -> list[str]:
    return [f"bn{j}" for j in range(1, 9)]



# ---- stages 1…4: conv→BN→ReLU, conv→BN→ReLU, 2×2 pool ---------------------------------------------

class StageSaved(NamedTuple):
    """What stage k's backward reads; layer1 is conv/bn 2k−1, layer2 is conv/bn 2k."""
    layer1: ConvBNSaved        # stage input x, c1 = conv(x), bn statistics
    n1: jax.Array              # BN output feeding the first ReLU (its mask)
    layer2: ConvBNSaved        # r1 = relu(n1), c2 = conv(r1), bn statistics
    n2: jax.Array              # BN output feeding the second ReLU
    r2: jax.Array              # pool input (post-ReLU): the tie-break compares it
    sigma: Optional[jax.Array]  # the frozen selection under the gather model, else None


def _stage_forward(k: int, params, x, cfg: Config, *, selections=None, running=None):
    a, b = _layers(k)
    n1, layer1 = conv_bn(params, f"conv{a}", f"bn{a}", x, cfg, running=running)
    r1, _ = relu.forward(n1)
    n2, layer2 = conv_bn(params, f"conv{b}", f"bn{b}", r1, cfg, running=running)
    r2, _ = relu.forward(n2)
    y, sigma = pool(f"pool{k}", POOLS[f"pool{k}"], r2, selections)
    return y, StageSaved(layer1, n1, layer2, n2, r2, sigma)


# dv names the cotangent leaving node v's backward (SPEC §4): dn2 = bnBack(c2; dr2) sits at c2.
def _stage_backward(k: int, params, s: StageSaved, dy, cfg: Config):
    a, b = _layers(k)
    rnd = rounding(cfg)
    bn1, bn2 = bn_saved(s.layer1, cfg), bn_saved(s.layer2, cfg)
    dp = pool_backward(POOLS[f"pool{k}"], s.r2, s.sigma, dy)
    dr2 = relu.backward(relu.ReluSaved(s.n2), dp)
    dn2 = batchnorm.backward(bn2, params[f"bn{b}.weight"], dr2)
    dc2 = conv.backward(params[f"conv{b}.weight"], dn2, input_shape=s.layer2.x.shape, rnd=rnd)
    dr1 = relu.backward(relu.ReluSaved(s.n1), dc2)
    dn1 = batchnorm.backward(bn1, params[f"bn{a}.weight"], dr1)
    dx = conv.backward(params[f"conv{a}.weight"], dn1, input_shape=s.layer1.x.shape, rnd=rnd)
    # conv{j} ← (its input, the cotangent at its output); bn{j} ← (c, the ReLU-masked cotangent)
    grads = {**conv_nodes(params, f"conv{a}", s.layer1.x, dn1, cfg), **bn_nodes(f"bn{a}", bn1, dr1),
             **conv_nodes(params, f"conv{b}", s.layer2.x, dn2, cfg), **bn_nodes(f"bn{b}", bn2, dr2)}
    return grads, dx


# ---- head: flatten → fc1 → ReLU → fc2 → ReLU → fc3 ------------------------------------------------

class HeadSaved(NamedTuple):
    f: jax.Array   # flattened stage-4 output [N,128] in (C,H,W) order: fc1's input
    h1: jax.Array  # fc1 output, feeding the first ReLU
    r1: jax.Array  # fc2's input
    h2: jax.Array  # fc2 output, feeding the second ReLU
    r2: jax.Array  # fc3's input


def _head_forward(params, x, cfg: Config, *, selections=None, running=None):
    f = x.reshape(x.shape[0], -1)
    h1, _ = dense.forward(f, params["fc1.weight"], params["fc1.bias"])
    r1, _ = relu.forward(h1)
    h2, _ = dense.forward(r1, params["fc2.weight"], params["fc2.bias"])
    r2, _ = relu.forward(h2)
    logits, _ = dense.forward(r2, params["fc3.weight"], params["fc3.bias"])
    return logits, HeadSaved(f, h1, r1, h2, r2)


def _head_backward(params, s: HeadSaved, dlogits, cfg: Config):
    dfc3 = dense.backward(params["fc3.weight"], dlogits)
    dr2 = relu.backward(relu.ReluSaved(s.h2), dfc3)
    dfc2 = dense.backward(params["fc2.weight"], dr2)
    dr1 = relu.backward(relu.ReluSaved(s.h1), dfc2)
    dfc1 = dense.backward(params["fc1.weight"], dr1)
    dx = dfc1.reshape(s.f.shape[0], WIDTHS[-1], 2, 2)  # unflatten in (C,H,W) order
    grads = {"fc1.weight": dense.grad_weight(s.f, dr1), "fc1.bias": dense.grad_bias(dr1),
             "fc2.weight": dense.grad_weight(s.r1, dr2), "fc2.bias": dense.grad_bias(dr2),
             "fc3.weight": dense.grad_weight(s.r2, dlogits), "fc3.bias": dense.grad_bias(dlogits)}
    return grads, dx


# ---- the net ---------------------------------------------------------------------------------------

def stage_list(cfg: Config = Config()) -> list[Stage]:
    """stage1 … stage4 (kind "conv"), then head (kind "head")."""
    out = [Stage(f"stage{k}", "conv", partial(_stage_forward, k), partial(_stage_backward, k),
                 tuple(spec.name for spec in _stage_specs(k, cfg)))
           for k in range(1, 5)]
    out.append(Stage("head", "head", _head_forward, _head_backward,
                     tuple(spec.name for spec in _head_specs(cfg))))
    return out


NET = NetDef(NAME, Config, param_specs, stage_list, bn_names, f"{IMAGE_SIZE}", lambda s: s == IMAGE_SIZE, POOLS, (1, 3, IMAGE_SIZE, IMAGE_SIZE))
init = NET.init
init_running = NET.init_running
stages = NET.stages
forward = NET.forward
backward = NET.backward
loss_and_grads = NET.loss_and_grads
forward_eval = NET.forward_eval
summary = NET.summary


# ---- reading `saved` -------------------------------------------------------------------------------

def preactivations(saved) -> dict[str, jax.Array]:
    """Every ReLU's input: "bn1" … "bn8" (BN outputs, [N,C,H,W]), then "fc1", "fc2" ([N,d])."""
    out = {}
    for k in range(1, 5):
        a, b = _layers(k)
        out[f"bn{a}"], out[f"bn{b}"] = saved[f"stage{k}"].n1, saved[f"stage{k}"].n2
    out["fc1"], out["fc2"] = saved["head"].h1, saved["head"].h2
    return out


def pool_inputs(saved) -> dict[str, jax.Array]:
    """"pool1" … "pool4": each pool's (post-ReLU) input."""
    return {f"pool{k}": saved[f"stage{k}"].r2 for k in range(1, 5)}


def bn_layers(saved) -> dict[str, ConvBNSaved]:
    """"bn1" … "bn8": each BN layer's saved record (its input c and batch statistics)."""
    out = {}
    for k in range(1, 5):
        a, b = _layers(k)
        out[f"bn{a}"], out[f"bn{b}"] = saved[f"stage{k}"].layer1, saved[f"stage{k}"].layer2
    return out


def batch_stats(saved) -> dict[str, jax.Array]:
    """`bn{j}.running_mean` / `bn{j}.running_var`: this batch's mean and biased variance."""
    out = {}
    for name, layer in bn_layers(saved).items():
        out.update(batch_statistic_entries(name, layer))
    return out


census = _stages.census
