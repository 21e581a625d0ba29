"""The Stage record both nets are made of, and the folds over a stage list.

A net is data first: a list of `Stage` records, each with a name (`stage1`, `layer2.0`, `head`), a
kind, its forward and, beside it, its rendered backward, and the names of the parameters it owns.
`forward` folds over the list; `backward` walks it in reverse. The helpers below are what the stage
bodies of both nets share: parameter specs and init, input and parameter checks, conv→BN layers,
the pool with its optional gather model, the parameter-gradient nodes, the census and the summary.
Shown in: Whole-net tie, Stage germs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ..ops import batchnorm, conv, head, maxpool


# ---- the record ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """One named stage of a net.

    forward(params, x, cfg, *, selections=None, running=None) -> (y, saved): the train-mode
        forward (batch statistics); with `running`, the eval-mode forward (running statistics).
        `saved` is a NamedTuple of arrays: exactly what `backward` reads.
    backward(params, saved, dy, cfg) -> (grads, dx): the rendered chain of this stage; `grads` maps
        each of `params` to its node, dx is the cotangent at the stage input.
    """
    name: str
    kind: str
    forward: Callable
    backward: Callable
    params: tuple[str, ...]


def fold_forward(stage_list: Sequence[Stage], params, x, cfg, *, selections=None, running=None):
    """x through every stage in order -> (y, {stage name: saved record})."""
    saved = {}
    for stage in stage_list:
        x, saved[stage.name] = stage.forward(params, x, cfg, selections=selections, running=running)
    return x, saved


def fold_backward(stage_list: Sequence[Stage], params, saved, dy, cfg):
    """dy through every stage's rendered backward in reverse -> (grads in params' order, dx)."""
    names = [stage.name for stage in stage_list]
    if not isinstance(saved, Mapping) or sorted(saved) != sorted(names):
        got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(f"backward: saved must be the forward's record of the stages {names}, got {got}")
    grads = {}
    for stage in reversed(stage_list):
        stage_grads, dy = stage.backward(params, saved[stage.name], dy, cfg)
        grads.update(stage_grads)
    return {name: grads[name] for name in params}, dy


def callables(stage_list: Sequence[Stage], params, cfg) -> list[tuple[str, Callable]]:
    """(name, x -> next activation) per stage, train-mode BN; composing them is the forward."""
    def bind(stage):
        return lambda x: stage.forward(params, x, cfg)[0]
    return [(stage.name, bind(stage)) for stage in stage_list]


# ---- parameters: specs, init, checks --------------------------------------------------------------

class ParamSpec(NamedTuple):
    name: str               # PyTorch state_dict key
    shape: tuple[int, ...]  # PyTorch layout: OIHW convs, [out, in] dense
    init: str               # "conv" (He fan-out), "dense" (Glorot), "ones" (γ), "zeros" (β, biases)


def conv_specs(name: str, in_ch: int, out_ch: int, kernel_size: int, bias: bool) -> list[ParamSpec]:
    specs = [ParamSpec(f"{name}.weight", (out_ch, in_ch, kernel_size, kernel_size), "conv")]
    return specs + ([ParamSpec(f"{name}.bias", (out_ch,), "zeros")] if bias else [])


def bn_specs(name: str, channels: int) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (channels,), "ones"), ParamSpec(f"{name}.bias", (channels,), "zeros")]


def dense_specs(name: str, in_features: int, out_features: int) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (out_features, in_features), "dense"),
            ParamSpec(f"{name}.bias", (out_features,), "zeros")]


def init_params(key: jax.Array, specs: Sequence[ParamSpec]) -> dict[str, jax.Array]:
    """float32 tensors in spec order: conv weights N(0, 2/(O·kh·kw)) (He fan-out), dense weights
    N(0, 2/(in+out)) (Glorot), γ = 1, β = 0, biases 0."""
    specs = tuple(specs)
    drawn = _draw(key, specs)
    return {spec.name: drawn[spec.name] for spec in specs}  # a jit hands dicts back key-sorted


def _std(spec: ParamSpec) -> float:
    if spec.init == "conv":
        o, _, kh, kw = spec.shape
        return math.sqrt(2.0 / (o * kh * kw))
    out_features, in_features = spec.shape
    return math.sqrt(2.0 / (in_features + out_features))


@partial(jax.jit, static_argnums=1)
def _draw(key: jax.Array, specs: tuple[ParamSpec, ...]) -> dict[str, jax.Array]:
    # one standard-normal draw for all weights, cut into tensors: one small program to compile
    # instead of a random-number kernel per tensor shape
    weights = [spec for spec in specs if spec.init in ("conv", "dense")]
    z = jax.random.normal(key, (sum(math.prod(spec.shape) for spec in weights),), jnp.float32)
    params, offset = {}, 0
    for spec in specs:
        if spec.init in ("conv", "dense"):
            size = math.prod(spec.shape)
            params[spec.name] = _std(spec) * z[offset:offset + size].reshape(spec.shape)
            offset += size
        elif spec.init == "ones":
            params[spec.name] = jnp.ones(spec.shape, jnp.float32)
        else:
            params[spec.name] = jnp.zeros(spec.shape, jnp.float32)
    return params


def check_params(net: str, params: Mapping, specs: Sequence[ParamSpec]) -> None:
    """ValueError naming the missing keys, the extra keys or the first wrong shape."""
    expected = {spec.name: spec.shape for spec in specs}
    missing = [name for name in expected if name not in params]
    extra = [name for name in params if name not in expected]
    if missing:
        raise ValueError(f"{net}: params lack {len(missing)} expected tensor(s) for this config: "
                         f"{', '.join(missing[:6])}{' …' if len(missing) > 6 else ''}")
    if extra:
        raise ValueError(f"{net}: params hold {len(extra)} tensor(s) this config does not expect: "
                         f"{', '.join(extra[:6])}{' …' if len(extra) > 6 else ''}")
    for name, shape in expected.items():
        got = tuple(jnp.shape(params[name]))
        if got != shape:
            raise ValueError(f"{net}: {name} must have shape {shape}, got {got}")


def check_image(net: str, x, size_rule: str, size_ok: Callable[[int], bool]) -> None:
    """x must be [N,3,H,W] NCHW with N ≥ 1 and H, W allowed by the net."""
    shape = tuple(jnp.shape(x))
    if len(shape) != 4:
        raise ValueError(f"{net}: x must have rank 4, [N,3,H,W] (NCHW), got shape {shape}")
    n, c, h, w = shape
    if n < 1:
        raise ValueError(f"{net}: x must hold at least one example, got shape {shape}")
    if c != 3:
        raise ValueError(f"{net}: x must have 3 channels at axis 1 (NCHW RGB), got {c} in shape {shape}")
    if not (size_ok(h) and size_ok(w)):
        raise ValueError(f"{net}: image height and width must be {size_rule}, got {h}×{w} in shape {shape}")


def as_input(net: str, x, params: Mapping) -> jax.Array:
    """Float pixels in the parameters' dtype (the conv ops need one dtype for x and W)."""
    dtype = jnp.result_type(params["conv1.weight"])
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{net}: x must hold float pixels in [0,1], got {jnp.result_type(x)}")
    return jnp.asarray(x, dtype)


def check_running(net: str, running: Mapping, bn_names: Sequence[str], params: Mapping) -> None:
    """Every BN layer needs `<bn>.running_mean` and `<bn>.running_var` shaped like its γ."""
    for bn in bn_names:
        for stat in ("running_mean", "running_var"):
            key = f"{bn}.{stat}"
            if key not in running:
                raise ValueError(f"{net}: running statistics lack {key}")
            want = tuple(jnp.shape(params[f"{bn}.weight"]))
            if tuple(jnp.shape(running[key])) != want:
                raise ValueError(f"{net}: {key} must have shape {want}, got {tuple(jnp.shape(running[key]))}")


def running_init(params: Mapping, bn_names: Sequence[str]) -> dict[str, jax.Array]:
    """PyTorch's initial running statistics: mean 0, variance 1, in the params' dtype."""
    out = {}
    for bn in bn_names:
        gamma = params[f"{bn}.weight"]
        out[f"{bn}.running_mean"] = jnp.zeros(jnp.shape(gamma), gamma.dtype)
        out[f"{bn}.running_var"] = jnp.ones(jnp.shape(gamma), gamma.dtype)
    return out


def as_targets(net: str, targets, n: int, num_classes: int) -> jax.Array:
    """Int labels [N] -> one-hot rows; soft targets [N,K] pass through (the head checks the row sums)."""
    shape = tuple(jnp.shape(targets))
    if len(shape) == 1 and jnp.issubdtype(jnp.result_type(targets), jnp.integer):
        if shape[0] != n:
            raise ValueError(f"{net}: labels must have shape ({n},) for a batch of {n}, got {shape}")
        return head.one_hot(targets, num_classes)
    if shape != (n, num_classes) or not jnp.issubdtype(jnp.result_type(targets), jnp.floating):
        raise ValueError(f"{net}: targets must be int labels ({n},) or float rows summing to 1 of "
                         f"shape ({n}, {num_classes}), got {jnp.result_type(targets)} {shape}")
    return jnp.asarray(targets)


def head_fold(forward, backward, params, x, targets, cfg, label_smoothing: float):
    """One forward, the head's loss and its six-op cotangent, one rendered backward -> (loss, grads)."""
    logits, saved = forward(params, x, cfg)
    targets = targets.astype(logits.dtype)
    loss = head.forward(logits, targets, label_smoothing)
    dlogits = head.cotangent(logits, targets, label_smoothing)
    grads, _ = backward(params, saved, dlogits, cfg)
    return loss, grads


# ---- layers both nets use -------------------------------------------------------------------------

class ConvBNSaved(NamedTuple):
    """What a conv→BN layer's backward reads."""
    x: jax.Array     # conv input: the weight gradient reads it (its shape sizes the input backward)
    c: jax.Array     # conv output = BN input: the BN backward recomputes x̂ from it
    mean: jax.Array  # this batch's BN statistics ([C]; [N,C] for per-example BN)
    var: jax.Array   # population (biased) variance


def rounding(cfg) -> Optional[conv.Rounding]:
    """The rounding function of every conv site: none (the f32 ops) unless cfg.bf16, then the bf16
    kind with `cfg.bf16_rounding`: "bf16" real bf16-typed operands (the default), "nearest" bf16
    round-to-nearest-even carried in float32, "identity" (the f32 chain bit for bit: erasure)."""
    if not cfg.bf16:
        return None
    return conv.named_rounding(getattr(cfg, "bf16_rounding", "bf16"))


def per_example(cfg) -> bool:
    return getattr(cfg, "bn", "batch") == "example"


def bn_eval(x, weight, bias, running_mean, running_var, eps):
    """Eval-mode BatchNorm: y = γ(x − running_mean)/√(running_var + ε) + β."""
    s = lax.rsqrt(running_var + eps)
    return weight[None, :, None, None] * ((x - running_mean[None, :, None, None]) * s[None, :, None, None]) \
        + bias[None, :, None, None]


def conv_bn(params, conv_name: str, bn_name: str, x, cfg, *, stride: int = 1, running=None):
    """c = conv(x), n = BN(c) -> (n, ConvBNSaved). Train mode: batch statistics; with `running`:
    the running statistics (per-example BN has no running statistics: train = eval)."""
    c, _ = conv.forward(x, params[f"{conv_name}.weight"], params.get(f"{conv_name}.bias"),
                        stride=stride, rnd=rounding(cfg))
    gamma, beta = params[f"{bn_name}.weight"], params[f"{bn_name}.bias"]
    if running is not None and not per_example(cfg):
        rm, rv = running[f"{bn_name}.running_mean"], running[f"{bn_name}.running_var"]
        return bn_eval(c, gamma, beta, rm, rv, cfg.eps), ConvBNSaved(x, c, rm, rv)
    n, bn = batchnorm.forward(c, gamma, beta, eps=cfg.eps, per_example=per_example(cfg),
                              axis_name=cfg.bn_axis_name)
    return n, ConvBNSaved(x, c, bn.mean, bn.var)


def bn_saved(layer: ConvBNSaved, cfg) -> batchnorm.BNSaved:
    """The op kit's BN record, rebuilt from the saved arrays and the (static) config."""
    return batchnorm.BNSaved(layer.c, layer.mean, layer.var, cfg.eps, per_example(cfg), cfg.bn_axis_name)


def check_selections(net: str, selections, pools: Mapping[str, maxpool.PoolSpec]) -> None:
    if selections is None:
        return
    unknown = [name for name in selections if name not in pools]
    if unknown:
        raise ValueError(f"{net}: selections name unknown pool(s) {unknown}; the pools are {list(pools)}")


def pool(name: str, spec: maxpool.PoolSpec, r, selections):
    """The max pool, or (when `name` is in `selections`) the gather model frozen at σ -> (y, σ or None)."""
    if selections is None or name not in selections:
        y, _ = maxpool.forward(r, spec)
        return y, None
    sigma = jnp.asarray(selections[name])
    expected = (r.shape[0], r.shape[1], maxpool.out_size(r.shape[2], spec), maxpool.out_size(r.shape[3], spec))
    if tuple(sigma.shape) != expected or not jnp.issubdtype(sigma.dtype, jnp.integer):
        raise ValueError(f"{name}: the selection σ must be integer of shape {expected} (one cell per "
                         f"window of the {spec.name} pool), got {sigma.dtype} {tuple(sigma.shape)}")
    return maxpool.gather(r, sigma, spec), sigma


# dy[N,C,H',W'] -> dr[N,C,H,W]: first-max routing on r, or selScatter at the frozen σ
def pool_backward(spec: maxpool.PoolSpec, r, sigma, dy):
    if sigma is None:
        return maxpool.backward(maxpool.PoolSaved(r, spec), dy)
    return maxpool.scatter(sigma, dy, r.shape, spec)


def conv_nodes(params, name: str, x, dc, cfg, *, stride: int = 1) -> dict[str, jax.Array]:
    """conv weight (and bias) nodes from the conv input x and the cotangent dc at the conv output."""
    weight = params[f"{name}.weight"]
    nodes = {f"{name}.weight": conv.grad_weight(x, dc, kernel_size=weight.shape[2], stride=stride,
                                                rnd=rounding(cfg))}
    if f"{name}.bias" in params:
        nodes[f"{name}.bias"] = conv.grad_bias(dc)
    return nodes


def bn_nodes(name: str, saved: batchnorm.BNSaved, dn) -> dict[str, jax.Array]:
    """γ and β nodes from the cotangent dn at the BN output."""
    return {f"{name}.weight": batchnorm.grad_weight(saved, dn), f"{name}.bias": batchnorm.grad_bias(dn)}


def batch_statistic_entries(bn_name: str, layer: ConvBNSaved) -> dict[str, jax.Array]:
    """`<bn>.running_mean/var` holding this batch's statistics (per-example: averaged over examples)."""
    mean, var = layer.mean, layer.var
    if mean.ndim == 2:
        mean, var = jnp.mean(mean, axis=0), jnp.mean(var, axis=0)
    return {f"{bn_name}.running_mean": mean, f"{bn_name}.running_var": var}


# ---- census and summary ---------------------------------------------------------------------------

class Census(NamedTuple):
    rows: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, floats) in signature order
    tensors: int
    floats: int

    def table(self) -> str:
        width = max([len(name) for name, _, _ in self.rows] + [6])
        lines = [f"{'tensor':<{width}}  {'shape':<18} {'floats':>12}"]
        lines += [f"{name:<{width}}  {str(shape):<18} {count:>12,}" for name, shape, count in self.rows]
        lines.append(f"{self.tensors} tensors, {self.floats:,} floats")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def census(params: Mapping) -> Census:
    """Tensors and floats of a params dict (arrays or `jax.eval_shape` structs)."""
    rows = tuple((name, tuple(jnp.shape(p)), math.prod(jnp.shape(p))) for name, p in params.items())
    return Census(rows, len(rows), sum(count for _, _, count in rows))


class SummaryRow(NamedTuple):
    name: str
    kind: str
    output_shape: tuple[int, ...]
    params: int


def summary(stage_list: Sequence[Stage], params, cfg, x_shape) -> list[SummaryRow]:
    """A row per stage: name, kind, output shape, parameter count (shapes only: nothing is computed)."""
    shapes = {name: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)) for name, p in params.items()}
    x = jax.ShapeDtypeStruct(tuple(x_shape), jnp.result_type(next(iter(params.values()))))
    rows = []
    for stage in stage_list:
        x = jax.eval_shape(lambda p, a, s=stage: s.forward(p, a, cfg)[0], shapes, x)
        count = sum(math.prod(jnp.shape(params[name])) for name in stage.params)
        rows.append(SummaryRow(stage.name, stage.kind, tuple(x.shape), count))
    return rows


def format_summary(rows: Sequence[SummaryRow]) -> str:
    lines = [f"{'stage':<10} {'kind':<11} {'output':<20} {'params':>12}"]
    lines += [f"{r.name:<10} {r.kind:<11} {str(r.output_shape):<20} {r.params:>12,}" for r in rows]
    lines.append(f"{'total':<10} {'':<11} {'':<20} {sum(r.params for r in rows):>12,}")
    return "\n".join(lines)
