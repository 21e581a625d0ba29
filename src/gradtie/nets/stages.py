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
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import prng
from ..host import to_device
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


def fold_forward(stage_list: Sequence[Stage], params, x, cfg, *, selections=None, running=None,
                 inputs: Optional[list] = None):
    """x through every stage in order -> (y, {stage name: saved record}); `inputs`, a list, gets
    every stage's input appended."""
    saved = {}
    for stage in stage_list:
        if inputs is not None:
            inputs.append(x)
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


# ---- the net: its public functions, defined once over its stage list ------------------------------

# Drawn weights (`init(..., weights="drawn")`) sit where a trained net sits and where a backward that
# mixes up γ, β or a bias shows: at init every γ is exactly 1 and every β and bias 0, and a BN
# backward that forgets γ, or a dγ formed from y instead of x̂, is bit for bit the right one there.
DRAWN_GAMMA = (0.5, 1.5)    # γ ~ U(0.5, 1.5): trained BN scales spread around 1 (never exactly 1)
DRAWN_BETA_STD = 0.3        # β ~ N(0, 0.3²): shifts of a trained net, a fraction of the unit BN output
DRAWN_BIAS_STD = 0.1        # conv and dense biases ~ N(0, 0.1²)
WEIGHTS = ("init", "drawn")


@dataclass(frozen=True)
class NetDef:
    """A net as data: its name, parameter specs, stage list and BN layers, with the public functions
    every net shares (SPEC §12) defined once over them. A net module binds them to module names."""
    name: str
    config: type                               # the net's frozen Config dataclass
    param_specs: Callable[..., list]           # cfg -> [ParamSpec] in signature order
    stage_list: Callable[..., list]            # cfg -> [Stage]
    bn_names: Callable[..., list]              # cfg -> BN layer names (running statistics)
    size_rule: str                             # what the image side must be, for the error message
    size_ok: Callable[[int], bool]
    pools: Mapping[str, maxpool.PoolSpec]
    default_shape: tuple[int, ...]             # the input shape `summary` assumes

    def _cfg(self, cfg):
        return self.config() if cfg is None else cfg

    def _check(self, params, x, cfg) -> None:
        check_image(self.name, x, self.size_rule, self.size_ok)
        check_params(self.name, params, self.param_specs(cfg))

    def init(self, key: jax.Array, cfg=None, *, weights: str = "init") -> dict[str, jax.Array]:
        """float32 tensors in signature order. weights "init": He fan-out convs, Glorot dense, γ = 1,
        β = 0, biases 0; "drawn": the same weights with γ ~ U(0.5, 1.5), β ~ N(0, 0.3²) and biases
        ~ N(0, 0.1²) — a point where a backward that confuses γ, β or a bias cannot hide."""
        if weights not in WEIGHTS:
            raise ValueError(f"{self.name}.init: weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        return init_params(key, self.param_specs(self._cfg(cfg)), drawn=weights == "drawn")

    def init_running(self, params: Mapping, cfg=None) -> dict[str, jax.Array]:
        """Running statistics before the first step: mean 0, variance 1 (PyTorch's)."""
        return running_init(params, self.bn_names(self._cfg(cfg)))

    def stages(self, params, cfg=None) -> list[tuple[str, Callable]]:
        """The (name, callable) stages, train-mode BN; composing them is `forward`'s logits."""
        cfg = self._cfg(cfg)
        check_params(self.name, params, self.param_specs(cfg))
        return callables(self.stage_list(cfg), params, cfg)

    def forward(self, params, x, cfg=None, *, selections=None, stage_inputs: bool = False):
        """Train-mode forward (batch statistics) -> (logits [N,K], saved), and with `stage_inputs`
        the list of every stage's input as a third element.

        saved: {stage name: that stage's saved record}, arrays only (a pytree): exactly what the
        rendered backward reads. With `selections` {pool name: σ}, those pools are the gather model
        frozen at σ.
        """
        cfg = self._cfg(cfg)
        self._check(params, x, cfg)
        check_selections(self.name, selections, self.pools)
        x = as_input(self.name, x, params)
        inputs = [] if stage_inputs else None
        logits, saved = fold_forward(self.stage_list(cfg), params, x, cfg, selections=selections, inputs=inputs)
        return (logits, saved, inputs) if stage_inputs else (logits, saved)

    def backward(self, params, saved, dlogits, cfg=None):
        """The rendered chain -> (grads with params' keys in their order, dx at the input)."""
        cfg = self._cfg(cfg)
        check_params(self.name, params, self.param_specs(cfg))
        return fold_backward(self.stage_list(cfg), params, saved, dlogits, cfg)

    def loss_and_grads(self, params, x, targets, cfg=None, label_smoothing: float = 0.0):
        """Mean smoothed cross-entropy and its gradient from the rendered chain (never autodiff).

        targets: int labels [N] or rows summing to 1 [N,K]; the cotangent at the logits is the head's
        six kit ops, dy = (p − t̃)/N.
        """
        cfg = self._cfg(cfg)
        self._check(params, x, cfg)
        targets = as_targets(self.name, targets, x.shape[0], cfg.num_classes)
        return head_fold(self.forward, self.backward, params, x, targets, cfg, label_smoothing)

    def forward_eval(self, params, running, x, cfg=None):
        """Eval-mode logits: every BN with the running statistics (per-example BN: its own)."""
        cfg = self._cfg(cfg)
        self._check(params, x, cfg)
        check_running(self.name, running, self.bn_names(cfg), params)
        x = as_input(self.name, x, params)
        logits, _ = fold_forward(self.stage_list(cfg), params, x, cfg, running=running)
        return logits

    def summary(self, params, cfg=None, x_shape=None) -> list["SummaryRow"]:
        """Rows (name, kind, output shape, parameter count), one per stage; `format_summary` prints them."""
        cfg = self._cfg(cfg)
        return summary(self.stage_list(cfg), params, cfg, x_shape or self.default_shape)


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


def init_params(key: jax.Array, specs: Sequence[ParamSpec], *, drawn: bool = False) -> dict[str, jax.Array]:
    """float32 tensors in spec order: conv weights N(0, 2/(O·kh·kw)) (He fan-out), dense weights
    N(0, 2/(in+out)) (Glorot), γ = 1, β = 0, biases 0; with `drawn`, γ, β and biases drawn instead
    (DRAWN_GAMMA, DRAWN_BETA_STD, DRAWN_BIAS_STD)."""
    specs = tuple(specs)
    drawn_ = _draw(key, specs, drawn)
    return {spec.name: drawn_[spec.name] for spec in specs}  # a jit hands dicts back key-sorted


def _std(spec: ParamSpec) -> float:
    if spec.init == "conv":
        o, _, kh, kw = spec.shape
        return math.sqrt(2.0 / (o * kh * kw))
    out_features, in_features = spec.shape
    return math.sqrt(2.0 / (in_features + out_features))


def _is_beta(spec: ParamSpec, specs: Sequence[ParamSpec]) -> bool:
    """A BN shift: a zeros-initialised vector beside a ones-initialised γ of the same layer."""
    gamma = spec.name[: -len("bias")] + "weight"
    return spec.name.endswith(".bias") and any(s.name == gamma and s.init == "ones" for s in specs)


def _draw(key: jax.Array, specs: tuple[ParamSpec, ...], drawn: bool) -> dict[str, jax.Array]:
    # one standard-normal draw for all weights (and one uniform, one normal for the vectors), cut
    # into tensors on the host: the random-number programs compile once per size class
    # (`gradtie.prng`), not once per net or tensor shape, and the values are jax.random's. Under a
    # trace (eval_shape, a caller's jit) the same arithmetic is traced instead.
    weights = [spec for spec in specs if spec.init in ("conv", "dense")]
    z = prng.normal(key, (sum(math.prod(spec.shape) for spec in weights),), jnp.float32)
    traced = isinstance(z, jax.core.Tracer)
    xp = jnp if traced else np
    host = (lambda a: a) if traced else np.asarray
    z = host(z)
    vectors = [spec for spec in specs if spec.init in ("ones", "zeros")]
    nv = sum(math.prod(s.shape) for s in vectors)
    u = host(prng.uniform(jax.random.fold_in(key, 1), (nv,), jnp.float32)) if drawn else None
    zv = host(prng.normal(jax.random.fold_in(key, 2), (nv,), jnp.float32)) if drawn else None
    params, offset, voffset = {}, 0, 0
    lo, hi = DRAWN_GAMMA
    f32 = np.float32
    for spec in specs:
        size = math.prod(spec.shape)
        if spec.init in ("conv", "dense"):
            value = f32(_std(spec)) * z[offset:offset + size]
            offset += size
        else:
            cut = slice(voffset, voffset + size)
            voffset += size
            if spec.init == "ones":
                value = f32(lo) + f32(hi - lo) * u[cut] if drawn else xp.ones(size, f32)
            elif drawn:
                value = f32(DRAWN_BETA_STD if _is_beta(spec, specs) else DRAWN_BIAS_STD) * zv[cut]
            else:
                value = xp.zeros(size, f32)
        params[spec.name] = value.reshape(spec.shape) if traced else to_device(value.reshape(spec.shape))
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
