"""The layers nets are composed from: parameter specs, conv→BN, the pool and its gather model, and
the nodes of each, all through the kit a stage is handed.

A net of your own (`gradtie.nets.protocol`) uses these as cifar8-BN and ResNet-34 do: its stage
forwards call `conv_bn` and `pool`, its backwards `conv_input`, `conv_nodes`, `bn_input`,
`bn_nodes`, `pool_input` with the kit, and its `Stage.bn_layers` reader returns the `ConvBNSaved`
records. Shown in: Whole-net tie, Check your own backward.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from .. import policy as policy_
from ..kit import Kit
from ..ops import batchnorm, conv, dense, maxpool
from .protocol import ParamSpec, Pass


def conv_specs(name: str, in_ch: int, out_ch: int, kernel_size: int, bias: bool,
               bn: Optional[str] = None) -> list[ParamSpec]:
    """A conv's weight (OIHW) and, with `bias`, its bias; bn: the BatchNorm layer it feeds."""
    specs = [ParamSpec(f"{name}.weight", (out_ch, in_ch, kernel_size, kernel_size), "conv", "weight", bn)]
    return specs + ([ParamSpec(f"{name}.bias", (out_ch,), "zeros", "bias", bn)] if bias else [])


def bn_specs(name: str, channels: int) -> list[ParamSpec]:
    """A BatchNorm layer's γ (`.weight`, role "gamma") and β (`.bias`, role "beta")."""
    return [ParamSpec(f"{name}.weight", (channels,), "ones", "gamma", name),
            ParamSpec(f"{name}.bias", (channels,), "zeros", "beta", name)]


def conv_bn_specs(conv: str, bn: str, in_ch: int, out_ch: int, kernel_size: int, bias: bool) -> list[ParamSpec]:
    """A conv feeding a BatchNorm layer: the conv's specs (their `bn` set) then the layer's γ and β."""
    return conv_specs(conv, in_ch, out_ch, kernel_size, bias, bn=bn) + bn_specs(bn, out_ch)


def dense_specs(name: str, in_features: int, out_features: int) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (out_features, in_features), "dense", "weight"),
            ParamSpec(f"{name}.bias", (out_features,), "zeros", "bias")]


def zero_in_reals(params) -> set[str]:
    """Conv biases (a `.bias` beside a rank-4 `.weight`): a conv feeding BatchNorm, which subtracts
    the bias again, has a bias gradient 0 in ℝ and pure round-off in floats."""
    return {name for name in params if name.endswith(".bias")
            and jnp.ndim(params.get(name[:-len("bias")] + "weight", jnp.zeros(()))) == 4}


class ConvBNSaved(NamedTuple):
    """What a conv→BN layer's backward reads."""
    x: jax.Array     # conv input: the weight gradient reads it (its shape sizes the input backward)
    c: jax.Array     # conv output = BN input: the BN backward recomputes x̂ from it
    mean: jax.Array  # this batch's BN statistics ([C]; [N,C] for per-example BN)
    var: jax.Array   # population (biased) variance
    valid: Optional[jax.Array] = None   # the real examples of a padded batch (None: all)


def rounding(cfg) -> Optional[conv.Rounding]:
    """The rounding function of every conv site: none (the f32 ops) unless cfg.bf16, then the bf16
    kind with `cfg.bf16_rounding`: "bf16" real bf16-typed operands (the default), "nearest" bf16
    round-to-nearest-even carried in float32, "identity" (the f32 chain bit for bit: erasure)."""
    return conv.named_rounding(cfg.bf16_rounding) if cfg.bf16 else None


def precision(cfg) -> lax.Precision:
    """The precision of every contraction under the config's execution policy (`gradtie.policy`)."""
    return policy_.get(cfg.policy).precision


def contraction(cfg) -> dict:
    """The keyword a kit's conv and dense ops take under the config's policy: none under `tie` (the
    ops' own default, HIGHEST), so a kit written before policies existed still runs every check;
    `precision=` under the others, which such a kit must then accept."""
    if cfg is None or policy_.get(cfg.policy).name == "tie":
        return {}
    return {"precision": precision(cfg)}


def per_example(cfg) -> bool:
    """Per-example BatchNorm (the config's `bn_mode`)."""
    return cfg.per_example_bn


def bn_eval(x, weight, bias, running_mean, running_var, eps):
    """Eval-mode BatchNorm: y = γ(x − running_mean)/√(running_var + ε) + β."""
    s = lax.rsqrt(running_var + eps)
    return weight[None, :, None, None] * ((x - running_mean[None, :, None, None]) * s[None, :, None, None]) \
        + bias[None, :, None, None]


def conv_forward(params, name: str, x, cfg, how: Pass, *, stride: int = 1):
    """c = conv(x) (+ its bias) through the kit."""
    c, _ = how.kit.conv_forward(name, x, params[f"{name}.weight"], params.get(f"{name}.bias"), stride=stride,
                                rnd=rounding(cfg), formulation=cfg.conv_formulation, **contraction(cfg))
    return c


def conv_bn(params, conv_name: str, bn_name: str, x, cfg, how: Pass, *, stride: int = 1):
    """c = conv(x), n = BN(c) -> (n, ConvBNSaved). Train mode: batch statistics; with `how.running`:
    the running statistics (per-example BN has no running statistics: train = eval)."""
    c = conv_forward(params, conv_name, x, cfg, how, stride=stride)
    gamma, beta = params[f"{bn_name}.weight"], params[f"{bn_name}.bias"]
    if how.running is not None and not per_example(cfg):
        rm, rv = how.running[f"{bn_name}.running_mean"], how.running[f"{bn_name}.running_var"]
        return bn_eval(c, gamma, beta, rm, rv, cfg.eps), ConvBNSaved(x, c, rm, rv)
    n, bn = how.kit.bn_forward(bn_name, c, gamma, beta, eps=cfg.eps, per_example=per_example(cfg),
                               axis_name=cfg.bn_axis_name, valid=how.valid)
    return n, ConvBNSaved(x, c, bn.mean, bn.var, how.valid)


def bn_saved(layer: ConvBNSaved, cfg) -> batchnorm.BNSaved:
    """The op kit's BN record, rebuilt from the saved arrays and the (static) config."""
    return batchnorm.BNSaved(layer.c, layer.mean, layer.var, cfg.eps, per_example(cfg), cfg.bn_axis_name,
                             layer.valid)


def pool(name: str, spec: maxpool.PoolSpec, r, how: Pass):
    """The max pool, or (when `name` is in `how.selections`) the gather model frozen at σ -> (y, σ or None)."""
    selections = how.selections
    if selections is None or name not in selections:
        y, _ = maxpool.forward(r, spec)
        return y, None
    sigma = jnp.asarray(selections[name])
    expected = (r.shape[0], r.shape[1], maxpool.out_size(r.shape[2], spec), maxpool.out_size(r.shape[3], spec))
    if tuple(sigma.shape) != expected or not jnp.issubdtype(sigma.dtype, jnp.integer):
        raise ValueError(f"{name}: the selection σ must be integer of shape {expected} (one cell per "
                         f"window of the {spec.name} pool), got {sigma.dtype} {tuple(sigma.shape)}")
    return maxpool.gather(r, sigma, spec), sigma


# ---- backward pieces, through the kit ----------------------------------------------------------

def pool_input(kit: Kit, name: str, spec: maxpool.PoolSpec, r, sigma, dy):
    """dy[N,C,H',W'] -> dr[N,C,H,W]: first-max routing on r, or selScatter at the frozen σ."""
    return kit.pool_backward(name, maxpool.PoolSaved(r, spec), dy, sigma)


def conv_input(kit: Kit, params, name: str, dc, input_shape, cfg, *, stride: int = 1):
    """The cotangent at a conv's input from the one at its output."""
    return kit.conv_backward(name, params[f"{name}.weight"], dc, input_shape=tuple(input_shape), stride=stride,
                             rnd=rounding(cfg), formulation=cfg.conv_formulation, **contraction(cfg))


def conv_nodes(kit: Kit, params, name: str, x, dc, cfg, *, stride: int = 1) -> dict[str, jax.Array]:
    """conv weight (and bias) nodes from the conv input x and the cotangent dc at the conv output,
    each in its parameter's dtype (the bf16 policy's nodes are float32)."""
    weight = params[f"{name}.weight"]
    nodes = {f"{name}.weight": kit.conv_grad_weight(name, x, dc, kernel_size=weight.shape[2], stride=stride,
                                                    rnd=rounding(cfg), formulation=cfg.conv_formulation,
                                                    **contraction(cfg)).astype(weight.dtype)}
    if f"{name}.bias" in params:
        nodes[f"{name}.bias"] = kit.conv_grad_bias(name, dc).astype(params[f"{name}.bias"].dtype)
    return nodes


def bn_input(kit: Kit, params, name: str, saved: batchnorm.BNSaved, dn):
    """The cotangent at a BatchNorm's input from the one at its output."""
    return kit.bn_backward(name, saved, params[f"{name}.weight"], dn)


def bn_nodes(kit: Kit, params, name: str, saved: batchnorm.BNSaved, dn) -> dict[str, jax.Array]:
    """γ and β nodes from the cotangent dn at the BN output."""
    dgamma, dbeta = kit.bn_nodes(name, saved, params[f"{name}.weight"], params[f"{name}.bias"], dn)
    return {f"{name}.weight": dgamma, f"{name}.bias": dbeta}


def dense_forward(params, name: str, x, cfg=None):
    """y = x @ Wᵀ + b in the weights' dtype, at the policy's precision (cfg None: HIGHEST)."""
    return dense.forward(x, params[f"{name}.weight"], params[f"{name}.bias"],
                         **contraction(cfg))[0]


def dense_input(kit: Kit, params, name: str, dy, cfg=None):
    """The cotangent at a dense layer's input from the one at its output."""
    return kit.dense_backward(name, params[f"{name}.weight"], dy, **contraction(cfg))


def dense_nodes(kit: Kit, name: str, x, dy, cfg=None) -> dict[str, jax.Array]:
    """The dense weight and bias nodes (cfg: the policy's precision; None: HIGHEST)."""
    return {f"{name}.weight": kit.dense_grad_weight(name, x, dy, **contraction(cfg)),
            f"{name}.bias": kit.dense_grad_bias(name, dy)}
