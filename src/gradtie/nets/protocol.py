"""The net protocol: what a net is, for the two nets of the book and for yours.

A net is a value: a `Net` record of its name, its `Config` class, its parameter specs, its stage
list, its pools, its input rule and its loss. cifar8-BN (`gradtie.nets.cifar8.NET`) and ResNet-34
(`gradtie.nets.resnet34.NET`) are two instances; a net of your own is a third, built from the same
parts, and every check of `gradtie.checks` takes it (`gradtie.check(net, params, x, targets)`,
`gradtie check --net path/to/file.py:NAME`).

A stage (`Stage`) is a named piece of the net with its forward and, beside it, its rendered
backward:

    forward(params, x, cfg, how: Pass) -> (y, saved)
        the train-mode forward (batch statistics); `how` carries the kit (whose `conv_forward` the
        stage calls), the pools frozen at σ (`how.selections`, the gather model), the running
        statistics (`how.running`: eval mode) and the real examples of a padded batch
        (`how.valid`). `saved` is a NamedTuple of arrays: exactly what the backward reads.
    backward(params, saved, dy, cfg, kit) -> (grads, dx)
        the rendered chain of the stage: every op backward and parameter node through `kit`
        (`gradtie.kit`), never imported directly, so a planted bug is just another kit; `grads`
        maps each of the stage's parameters to its node, dx is the cotangent at the stage input.

and three readers of its saved record, for the census: `relu_inputs` (every ReLU's input, by layer
name), `pool_inputs` (each max pool's post-ReLU input, by pool name) and `bn_layers` (each
BatchNorm's `ConvBNSaved`: its input and batch statistics). Nothing else is read off a net: no
attribute of a module. A `Net` hashes by value (`fingerprint`): it is a static argument of
`jax.jit` and a key of caches, so equal nets built separately share compiled programs and nets
that differ in anything never do.

The loss (`Loss`) comes with its own cotangent: the rendered chain starts from
`loss.cotangent(logits, targets, α, divisor)`, the autodiff oracle differentiates `loss.value`.
The default is the label-smoothed softmax cross-entropy, whose cotangent is the Lean render's six
kit ops (`gradtie.ops.head`). Shown in: Check your own backward.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
import functools
import itertools
import types
import weakref
from functools import lru_cache
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import policy as policy_
from .. import prng, rendered
from ..host import to_device
from ..kit import KIT, Kit
from ..ops import conv, head, maxpool


# ---- values: nets and update rules hash by what they compute ----------------------------------------

_SERIALS = itertools.count()
_HELD: list = []   # (weak reference, serial) for each live object fingerprinted by identity


def _serial(value) -> int:
    """A number for an object keyed by identity: the same while the object lives, never given to
    another. The registry holds only weak references, and an entry leaves when its object dies, so
    it stays as long as the set of live objects so keyed, however many nets a run builds. An object
    that cannot be weakly referenced gets a fresh number each time (its keys never match: a cache
    miss, never a wrong hit)."""
    for ref, serial in tuple(_HELD):     # a snapshot: a collection may drop an entry meanwhile
        if ref() is value:
            return serial
    serial = next(_SERIALS)
    try:
        ref = weakref.ref(value, _forget)
    except TypeError:
        return serial
    _HELD.append((ref, serial))
    return serial


def _forget(ref) -> None:
    for i, (held, _) in enumerate(_HELD):
        if held is ref:
            del _HELD[i]
            return


def fingerprint(value, _seen: tuple = ()):
    """A hashable key equal for values that compute the same thing: a function by its module, name,
    code, defaults and the fingerprints of what its closure holds; a partial by its function and
    arguments; a mapping, list or tuple by its items; a `Net` by its fields; a hashable value by
    itself; anything else (an array) by identity. Equal nets built separately get equal keys (and
    share compiled programs); nets that differ in any field, or in a value a closure holds, never do."""
    if any(v is value for v in _seen):
        return ("cycle", getattr(value, "__qualname__", type(value).__name__))
    inner = (*_seen, value)
    if isinstance(value, Net):
        return value._fingerprint
    if isinstance(value, types.FunctionType):
        cells = tuple(fingerprint(c.cell_contents, inner) if _filled(c) else ("empty",)
                      for c in (value.__closure__ or ()))
        return ("fn", value.__module__, value.__qualname__, value.__code__, fingerprint(value.__defaults__, inner),
                fingerprint(value.__kwdefaults__, inner), cells)
    if isinstance(value, types.MethodType):
        return ("method", fingerprint(value.__func__, inner), fingerprint(value.__self__, inner))
    if isinstance(value, functools.partial):
        return ("partial", fingerprint(value.func, inner), fingerprint(value.args, inner),
                fingerprint(value.keywords, inner))
    if isinstance(value, Mapping):
        return ("map", type(value), tuple((k, fingerprint(v, inner)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(fingerprint(v, inner) for v in value))
    try:
        hash(value)
        return value
    except TypeError:
        return ("object", type(value), _serial(value))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


# ---- configuration --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """What every net's configuration holds; a net's own `Config` subclasses it (frozen, every field
    with a default). num_classes K; eps: BatchNorm's ε; bf16: the conv sites run as bf16 kinds with
    `bf16_rounding` ("bf16": bf16-typed operands, "nearest": bf16 rounding carried in float32,
    "identity": the f32 ops bit for bit); bn_axis_name: the mesh axis of synchronised BatchNorm
    (None on one device); conv_formulation: every conv site as XLA's convolution ("conv"), as
    patches · weights ("patches"), or by the shape rule (None; `gradtie.ops.conv.use_patches`);
    policy: the execution policy by name ("tie", "tf32", "bf16"; `gradtie.policy`): the dtype the
    activations travel in and the precision of every contraction, over the same chain."""
    num_classes: int = 10
    eps: float = 1e-5
    bf16: bool = False
    bf16_rounding: str = "bf16"
    bn_axis_name: Optional[str] = None
    conv_formulation: Optional[str] = None
    policy: str = "tie"

    @property
    def bn_mode(self) -> str:
        """The BatchNorm mode: "batch" (statistics over the batch; every net's default) or "example"
        (each image's own H·W cells; train = eval). A net whose config offers both overrides it."""
        return "batch"

    @property
    def per_example_bn(self) -> bool:
        return self.bn_mode == "example"

    def __post_init__(self):
        name = type(self).__qualname__
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ValueError(f"{name}: num_classes must be a positive integer, got {self.num_classes!r}")
        if not self.eps > 0:
            raise ValueError(f"{name}: eps must be positive, got {self.eps}")
        conv.named_rounding(self.bf16_rounding)   # ValueError naming the choices
        if self.conv_formulation not in (None, *conv.FORMULATIONS):
            raise ValueError(f"{name}: conv_formulation must be one of {', '.join(map(repr, conv.FORMULATIONS))} "
                             f"or None, got {self.conv_formulation!r}")
        policy_.get(self.policy)                  # ValueError naming the policies
        if self.bf16 and self.policy != "tie":
            raise ValueError(f"{name}: bf16=True (the suite's bf16 conv kinds inside a float32 chain) runs under "
                             f"the 'tie' policy only; policy {self.policy!r} sets the precision itself "
                             f"(the 'bf16' policy already runs every conv site as a bf16 kind)")


class ParamSpec(NamedTuple):
    """One parameter tensor of a net: its PyTorch `state_dict` key, its shape in PyTorch's layout,
    how `Net.init` draws it and what it is.

    init: "conv" (He fan-out), "dense" (Glorot), "ones", "zeros". role: "weight" (a conv or dense
    weight), "gamma" (a BatchNorm scale), "beta" (a BatchNorm shift) or "bias" (a conv or dense
    bias); "" reads it off init ("conv"/"dense": weight, "ones": gamma, "zeros": bias). At
    `weights="drawn"` the role, never the name, decides the draw: γ ~ U(0.5, 1.5), β ~ N(0, 0.3²),
    a bias ~ N(0, 0.1²) (`bn_specs` and `conv_specs` set them). bn: the BatchNorm layer the tensor
    belongs to (its γ and β) or feeds (the conv before it), None for none: where its node's
    reduction size M is read (`Net.bn_of`)."""
    name: str               # PyTorch state_dict key
    shape: tuple[int, ...]  # PyTorch layout: OIHW convs, [out, in] dense
    init: str               # "conv" (He fan-out), "dense" (Glorot), "ones" (γ), "zeros" (β, biases)
    role: str = ""          # "weight", "gamma", "beta", "bias"; "" = by init
    bn: Optional[str] = None  # the BatchNorm layer it belongs to or feeds

    @property
    def kind(self) -> str:
        """The role, explicit or read off init."""
        return self.role or _ROLE_OF_INIT.get(self.init, "")


class Pass(NamedTuple):
    """How a forward runs: the kit whose `conv_forward` it calls, pools frozen at σ (the gather
    model: {pool: σ}), running statistics (eval mode) and the real examples of a padded batch
    (valid [N]: 1 real, 0 padding)."""
    kit: Kit = KIT
    selections: Optional[Mapping[str, jax.Array]] = None
    running: Optional[Mapping[str, jax.Array]] = None
    valid: Optional[jax.Array] = None


class Loss(NamedTuple):
    """A loss of the logits with its own cotangent.

    value(logits, targets, α) -> the mean loss (plain jnp: the oracle differentiates it);
    cotangent(logits, targets, α, divisor) -> dlogits, the rendered head (divisor: the batch size
    it divides by; the data-parallel step passes the global count); rows(logits, targets, α) -> the
    per-example losses [N] (a padded batch averages the real ones)."""
    name: str
    value: Callable
    cotangent: Callable
    rows: Callable


SMOOTHED_CE = Loss("label-smoothed softmax cross-entropy", head.forward, head.cotangent, head.row_losses)


def _nothing(saved) -> dict:
    return {}


@dataclass(frozen=True, eq=False)
class Stage:
    """One named stage of a net (see the module docstring for the signatures)."""
    name: str
    kind: str                                  # "conv", "stem", "identity", "downsample", "head", …
    forward: Callable
    backward: Callable
    params: tuple[str, ...]
    relu_inputs: Callable[[Any], dict] = _nothing
    pool_inputs: Callable[[Any], dict] = _nothing
    bn_layers: Callable[[Any], dict] = _nothing


def fold_forward(stage_list: Sequence[Stage], params, x, cfg, how: Pass = Pass(),
                 inputs: Optional[dict] = None):
    """x through every stage in order -> (y, {stage name: saved record}); `inputs` (a tape), when
    given, gets every stage's input."""
    saved = {}
    for stage in stage_list:
        if inputs is not None:
            inputs[stage.name] = x
        x, saved[stage.name] = stage.forward(params, x, cfg, how)
    return x, saved


def fold_backward(stage_list: Sequence[Stage], params, saved, dy, cfg, kit: Kit = KIT,
                  cotangents: Optional[dict] = None, after_stage: Optional[Callable] = None):
    """dy through every stage's rendered backward in reverse -> (grads in params' order, dx);
    `cotangents` (a tape), when given, gets the cotangent each stage is handed at its output;
    `after_stage(nodes, dx) -> (nodes, dx)` sees each stage's nodes as soon as they exist (the
    data-parallel step all-reduces them there, while the stages below still run)."""
    names = [stage.name for stage in stage_list]
    if not isinstance(saved, Mapping) or sorted(saved) != sorted(names):
        got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(f"backward: saved must be the forward's record of the stages {names}, got {got}")
    grads = {}
    for stage in reversed(stage_list):
        if cotangents is not None:
            cotangents[stage.name] = dy
        stage_grads, dy = stage.backward(params, saved[stage.name], dy, cfg, kit)
        if after_stage is not None:
            stage_grads, dy = after_stage(stage_grads, dy)
        grads.update(stage_grads)
    return {name: grads[name] for name in params}, dy


# ---- the net ----------------------------------------------------------------------------------------

# Drawn weights (`init(..., weights="drawn")`) sit where a trained net sits and where a backward that
# mixes up γ, β or a bias shows: at init every γ is exactly 1 and every β and bias 0, and a BN
# backward that forgets γ, or a dγ formed from y instead of x̂, is bit for bit the right one there.
DRAWN_GAMMA = (0.5, 1.5)    # γ ~ U(0.5, 1.5): trained BN scales spread around 1 (never exactly 1)
DRAWN_BETA_STD = 0.3        # β ~ N(0, 0.3²): shifts of a trained net, a fraction of the unit BN output
DRAWN_BIAS_STD = 0.1        # conv and dense biases ~ N(0, 0.1²)
WEIGHTS = ("init", "drawn")


def _any_size(size: int) -> bool:
    return size >= 1


def _no_overrides(shapes: Mapping[str, tuple]) -> dict:
    return {}


@dataclass(frozen=True, eq=False)
class Net:
    """A net as data, with the public functions every net shares defined once over it.

    name: what reports call it. config: its frozen `Config` subclass. param_specs(cfg): its tensors
    in signature (state_dict) order. stage_list(cfg): its stages in forward order. pools: {pool:
    PoolSpec}, pool_preactivations: {pool: the ReLU input layer feeding it} (the census reads each
    window's cells there). channels, size_rule, size_ok: the input [N, channels, H, W] it takes.
    loss: its loss and cotangent. suite: the Lean suite's name for the net ("cifar8", "resnet34")
    when its statements are about this net: the census then reads the suite's own smooth-point
    hypotheses (None, a net of your own: the generic ones, smooth ReLU inputs and pool windows).
    stage_lean: the Lean statement each stage kind's tie shows. bugs: catalogue entries for ops
    of its own (`gradtie.checks.bugs.Bug`), planted as any other. layers: the same net split into
    finer stages (cifar8's seventeen CertLayers), when a statement is about those. projections:
    {a projection BatchNorm on a block's skip: the main-branch BatchNorm that reads the same output
    cotangent} (the catalogue's projection entry plants there, whatever the layers are named).
    check_classes: the classes a check's own config takes (None: the config's default).
    label_smoothing: the α its training recipe uses. config_of_params({name: shape}) -> the config
    fields a checkpoint's shapes imply.
    """
    name: str
    config: type
    param_specs: Callable[[Any], list]
    stage_list: Callable[[Any], list]
    pools: Mapping[str, maxpool.PoolSpec] = field(default_factory=dict)
    pool_preactivations: Mapping[str, str] = field(default_factory=dict)
    channels: int = 3
    size_rule: str = "a positive integer"
    size_ok: Callable[[int], bool] = _any_size
    default_size: int = 32
    loss: Loss = SMOOTHED_CE
    suite: Optional[str] = None
    stage_lean: Mapping[str, str] = field(default_factory=dict)
    bugs: tuple = ()
    layers: Optional["Net"] = None
    projections: Mapping[str, str] = field(default_factory=dict)
    check_classes: Optional[int] = None
    label_smoothing: float = 0.0
    config_of_params: Callable[[Mapping[str, tuple]], dict] = _no_overrides

    def __repr__(self) -> str:
        return f"Net({self.name!r})"

    @functools.cached_property
    def _fingerprint(self):
        return ("Net",) + tuple(fingerprint(getattr(self, f.name), (self,))
                                for f in dataclasses.fields(self))

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        return isinstance(other, Net) and self._fingerprint == other._fingerprint

    def __hash__(self) -> int:
        return hash(self._fingerprint)

    def cfg(self, cfg=None):
        """cfg itself, or the net's default configuration."""
        if cfg is None:
            return self.config()
        if not isinstance(cfg, self.config):
            raise ValueError(f"{self.name}: cfg must be a {self.config.__qualname__}, got {type(cfg).__name__}")
        return cfg

    @property
    def default_shape(self) -> tuple[int, ...]:
        return (1, self.channels, self.default_size, self.default_size)

    def check(self, params, x, cfg) -> None:
        check_image(self, x)
        check_params(self.name, params, self.param_specs(cfg))

    def init(self, key: jax.Array, cfg=None, *, weights: str = "init") -> dict[str, jax.Array]:
        """float32 tensors in signature order. weights "init": He fan-out convs, Glorot dense, γ = 1,
        β = 0, biases 0; "drawn": the same weights with γ ~ U(0.5, 1.5), β ~ N(0, 0.3²) and biases
        ~ N(0, 0.1²) — a point where a backward that confuses γ, β or a bias cannot hide."""
        if weights not in WEIGHTS:
            raise ValueError(f"{self.name}.init: weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        return init_params(key, self.param_specs(self.cfg(cfg)), drawn=weights == "drawn")

    def bn_of(self, cfg=None) -> dict[str, str]:
        """{parameter: the BatchNorm layer it belongs to (γ, β) or feeds (a conv's weight and bias)},
        as its `ParamSpec.bn` declares; parameters of no BatchNorm left out."""
        return {s.name: s.bn for s in self.param_specs(self.cfg(cfg)) if s.bn is not None}

    def roles(self, cfg=None) -> dict[str, str]:
        """{parameter: its role ("weight", "gamma", "beta", "bias"; `ParamSpec.kind`)}."""
        return {s.name: s.kind for s in self.param_specs(self.cfg(cfg))}

    def check_config(self, **overrides):
        """The config a check builds when none is handed in: the net's own with `overrides`, its
        classes at `check_classes` unless given (ResNet-34's 1000 ImageNet classes read 10)."""
        if self.check_classes is not None:
            overrides.setdefault("num_classes", self.check_classes)
        return self.config(**overrides)

    def config_overrides(self, params: Mapping) -> dict:
        """The config fields a params dict (arrays or shapes) implies (`config_of_params`): what a
        checkpoint's tensors say of its config (conv biases, head width, classes)."""
        return dict(self.config_of_params({k: tuple(jnp.shape(v)) for k, v in params.items()}))

    def bn_names(self, cfg=None) -> list[str]:
        """Every BatchNorm layer, in forward order (read off the stages at abstract shapes)."""
        return _bn_names(self, self.cfg(cfg))

    def floats(self, image_size: int, cfg=None) -> tuple[int, int]:
        """(floats one example's saved record holds, floats of the weights) at this image size, read
        at abstract shapes (nothing is allocated or compiled): what a run's memory grows with."""
        cfg = self.cfg(cfg)
        params, x = abstract_inputs(self, cfg, (1, self.channels, image_size, image_size))
        _, saved = jax.eval_shape(lambda p, a: self.forward(p, a, cfg), params, x)
        count = lambda tree: sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))  # noqa: E731
        return count(saved), count(params)

    def init_running(self, params: Mapping, cfg=None) -> dict[str, jax.Array]:
        """Running statistics before the first step: mean 0, variance 1 (PyTorch's)."""
        return running_init(params, self.bn_names(cfg))

    def stages(self, params, cfg=None) -> list[tuple[str, Callable]]:
        """The (name, callable) stages, train-mode BN; composing them is `forward`'s logits."""
        cfg = self.cfg(cfg)
        check_params(self.name, params, self.param_specs(cfg))

        def bind(stage):
            return lambda x: stage.forward(params, x, cfg, Pass())[0]
        return [(stage.name, bind(stage)) for stage in self.stage_list(cfg)]

    def forward(self, params, x, cfg=None, *, kit: Kit = KIT, selections=None, valid=None,
                inputs: Optional[dict] = None):
        """Train-mode forward (batch statistics) -> (logits [N,K], saved).

        saved: {stage name: that stage's saved record}, arrays only (a pytree): exactly what the
        rendered backward reads. selections {pool name: σ}: those pools are the gather model frozen
        at σ. valid [N]: the real examples of a padded batch. inputs (a tape): gets every stage's input.
        """
        cfg = self.cfg(cfg)
        self.check(params, x, cfg)
        check_selections(self.name, selections, self.pools)
        x = as_input(self.name, x, params, cfg)
        return fold_forward(self.stage_list(cfg), params, x, cfg, Pass(kit, selections, None, valid), inputs)

    def backward(self, params, saved, dlogits, cfg=None, *, kit: Kit = KIT, cotangents: Optional[dict] = None,
                 after_stage: Optional[Callable] = None):
        """The rendered chain through `kit` -> (grads with params' keys in their order, dx at the
        input). cotangents (a tape): gets the cotangent each stage is handed; after_stage: see
        `fold_backward`."""
        cfg = self.cfg(cfg)
        check_params(self.name, params, self.param_specs(cfg))
        return fold_backward(self.stage_list(cfg), params, saved, dlogits, cfg, kit, cotangents, after_stage)

    def loss_and_grads(self, params, x, targets, cfg=None, label_smoothing: float = 0.0, *, kit: Kit = KIT):
        """The loss and its gradient from the rendered chain (never autodiff).

        targets: int labels [N] or rows summing to 1 [N,K]; the chain starts from the loss's own
        cotangent (the default loss: the head's six kit ops, dy = (p − t̃)/N)."""
        out = rendered.step(self, kit, params, x, targets, self.cfg(cfg), alpha=label_smoothing)
        return out.loss, out.grads

    def forward_eval(self, params, running, x, cfg=None):
        """Eval-mode logits: every BN with the running statistics (per-example BN: its own)."""
        cfg = self.cfg(cfg)
        self.check(params, x, cfg)
        check_running(self.name, running, self.bn_names(cfg), params)
        x = as_input(self.name, x, params, cfg)
        logits, _ = fold_forward(self.stage_list(cfg), params, x, cfg, Pass(running=running))
        return logits

    def summary(self, params, cfg=None, x_shape=None) -> list["SummaryRow"]:
        """Rows (name, kind, output shape, parameter count), one per stage; `format_summary` prints them."""
        cfg = self.cfg(cfg)
        return summary(self.stage_list(cfg), params, cfg, x_shape or self.default_shape)

    # -- reading `saved`: the stages' own readers (of `stages`, default all), merged in forward order --
    def _read(self, reader: str, saved, stages=None) -> dict:
        out = {}
        for stage in self.stage_list(self.config()) if stages is None else stages:
            out.update(getattr(stage, reader)(saved[stage.name]))
        return out

    def preactivations(self, saved, stages=None) -> dict[str, jax.Array]:
        """Every ReLU's input, by layer name, in forward order."""
        return self._read("relu_inputs", saved, stages)

    def pool_inputs(self, saved, stages=None) -> dict[str, jax.Array]:
        """Each max pool's (post-ReLU) input, by pool name."""
        return self._read("pool_inputs", saved, stages)

    def bn_layers(self, saved) -> dict[str, "Any"]:
        """Each BatchNorm layer's saved record (its input c and batch statistics), by layer name."""
        return self._read("bn_layers", saved)

    def batch_stats(self, saved) -> dict[str, jax.Array]:
        """`<bn>.running_mean` / `<bn>.running_var`: this batch's mean and biased variance
        (per-example BN: averaged over the examples)."""
        out = {}
        for name, layer in self.bn_layers(saved).items():
            mean, var = layer.mean, layer.var
            if mean.ndim == 2:
                mean, var = jnp.mean(mean, axis=0), jnp.mean(var, axis=0)
            out[f"{name}.running_mean"], out[f"{name}.running_var"] = mean, var
        return out


def abstract_inputs(net: Net, cfg=None, x_shape=None, dtype=jnp.float32):
    """(params, x) as shape structs: what `jax.eval_shape` reads a net at."""
    cfg = net.cfg(cfg)
    params = {s.name: jax.ShapeDtypeStruct(s.shape, dtype) for s in net.param_specs(cfg)}
    return params, jax.ShapeDtypeStruct(tuple(x_shape or net.default_shape), dtype)


@lru_cache(maxsize=None)
def _bn_names(net: Net, cfg) -> list[str]:
    params, x = abstract_inputs(net, cfg)
    _, saved = jax.eval_shape(lambda p, a: net.forward(p, a, cfg), params, x)
    return list(net.bn_layers(saved))


# ---- parameters: specs, init, checks --------------------------------------------------------------

def init_params(key: jax.Array, specs: Sequence[ParamSpec], *, drawn: bool = False) -> dict[str, jax.Array]:
    """float32 tensors in spec order: conv weights N(0, 2/(O·kh·kw)) (He fan-out), dense weights
    N(0, 2/(in+out)) (Glorot), γ = 1, β = 0, biases 0; with `drawn`, γ, β and biases drawn instead
    (DRAWN_GAMMA, DRAWN_BETA_STD, DRAWN_BIAS_STD), each by its spec's role (`ParamSpec.kind`),
    never by its name."""
    specs = tuple(specs)
    drawn_ = _draw(key, specs, drawn)
    return {spec.name: drawn_[spec.name] for spec in specs}  # a jit hands dicts back key-sorted


def _std(spec: ParamSpec) -> float:
    if spec.init == "conv":
        o, _, kh, kw = spec.shape
        return math.sqrt(2.0 / (o * kh * kw))
    out_features, in_features = spec.shape
    return math.sqrt(2.0 / (in_features + out_features))


INITS = ("conv", "dense", "ones", "zeros")
# the roles each init rule can carry; the first is what an empty role reads as
ROLES = {"conv": ("weight",), "dense": ("weight",), "ones": ("gamma",), "zeros": ("bias", "beta")}
_ROLE_OF_INIT = {init: roles[0] for init, roles in ROLES.items()}
DRAWN_STD = {"beta": DRAWN_BETA_STD, "bias": DRAWN_BIAS_STD}


def _draw(key: jax.Array, specs: tuple[ParamSpec, ...], drawn: bool) -> dict[str, jax.Array]:
    # one standard-normal draw for all weights (and one uniform, one normal for the vectors), cut
    # into tensors on the host: the random-number programs compile once per size class
    # (`gradtie.prng`), not once per net or tensor shape, and the values are jax.random's. Under a
    # trace (eval_shape, a caller's jit) the same arithmetic is traced instead.
    bad = [s.name for s in specs if s.init not in INITS]
    if bad:
        raise ValueError(f"init: {bad[0]} has init rule {specs[[s.name for s in specs].index(bad[0])].init!r}; "
                         f"expected one of {', '.join(INITS)}")
    for s in specs:
        if s.kind not in ROLES[s.init]:
            raise ValueError(f"init: {s.name} has role {s.role!r}; an {s.init!r} tensor is one of "
                             f"{', '.join(map(repr, ROLES[s.init]))} (or '' for {_ROLE_OF_INIT[s.init]!r})")
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
                value = f32(DRAWN_STD[spec.kind]) * zv[cut]
            else:
                value = xp.zeros(size, f32)
        params[spec.name] = value.reshape(spec.shape) if traced else to_device(value.reshape(spec.shape))
    return params


def check_params(net: str, params: Mapping, specs: Sequence[ParamSpec]) -> None:
    """ValueError naming the missing keys, the extra keys or the first wrong shape."""
    if not isinstance(params, Mapping):
        raise ValueError(f"{net}: params must be a dict of arrays by state_dict name, got {type(params).__name__}")
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


def check_image(net: Net, x) -> None:
    """x must be [N, net.channels, H, W] NCHW with N ≥ 1 and H, W allowed by the net."""
    shape = tuple(jnp.shape(x))
    c_ = net.channels
    if len(shape) != 4:
        raise ValueError(f"{net.name}: x must have rank 4, [N,{c_},H,W] (NCHW), got shape {shape}")
    n, c, h, w = shape
    if n < 1:
        raise ValueError(f"{net.name}: x must hold at least one example, got shape {shape}")
    if c != c_:
        raise ValueError(f"{net.name}: x must have {c_} channels at axis 1 (NCHW), got {c} in shape {shape}")
    if not (net.size_ok(h) and net.size_ok(w)):
        raise ValueError(f"{net.name}: image height and width must be {net.size_rule}, got {h}×{w} in shape {shape}")


def as_input(net: str, x, params: Mapping, cfg=None) -> jax.Array:
    """Float pixels in the dtype the activations travel in: the parameters' dtype, or the execution
    policy's (bf16) when `cfg` names one."""
    dtype = jnp.result_type(next(iter(params.values())))
    if cfg is not None:
        dtype = policy_.get(cfg.policy).activation_dtype(dtype)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{net}: x must hold float pixels, got {jnp.result_type(x)}")
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


def check_selections(net: str, selections, pools: Mapping[str, maxpool.PoolSpec]) -> None:
    if selections is None:
        return
    unknown = [name for name in selections if name not in pools]
    if unknown:
        raise ValueError(f"{net}: selections name unknown pool(s) {unknown}; the pools are {list(pools)}")


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
        x = jax.eval_shape(lambda p, a, s=stage: s.forward(p, a, cfg, Pass())[0], shapes, x)
        count = sum(math.prod(jnp.shape(params[name])) for name in stage.params)
        rows.append(SummaryRow(stage.name, stage.kind, tuple(x.shape), count))
    return rows


def format_summary(rows: Sequence[SummaryRow]) -> str:
    lines = [f"{'stage':<10} {'kind':<11} {'output':<20} {'params':>12}"]
    lines += [f"{r.name:<10} {r.kind:<11} {str(r.output_shape):<20} {r.params:>12,}" for r in rows]
    lines.append(f"{'total':<10} {'':<11} {'':<20} {sum(r.params for r in rows):>12,}")
    return "\n".join(lines)


def with_backwards(net: Net, wrap: Callable[[Stage], Optional[Callable]], name: Optional[str] = None) -> Net:
    """Another net definition: `net` with each stage's backward replaced by wrap(stage) (None keeps
    it). Its forwards are `net`'s, so the oracle of one is the oracle of the other."""
    def stage_list(cfg):
        out = []
        for stage in net.stage_list(cfg):
            backward = wrap(stage)
            out.append(stage if backward is None else dataclasses.replace(stage, backward=backward))
        return out
    return dataclasses.replace(net, stage_list=stage_list, name=name or net.name)


def resolution_note(net, size: int) -> str:
    """The label a figure at `size` px carries: "" at the resolution a suite net's statements fix as a
    literal (its `default_size`: ResNet-34's 224 px; the claim map lists each statement's binders)."""
    require_net(net, "resolution_note")
    if net.suite is None or int(size) == net.default_size:
        return ""
    return (f"{net.name} at {size} px: the same architecture beyond the statement's literal "
            f"{net.default_size}-px resolution")


def require_net(net, where: str) -> Net:
    """`net` itself when it is a `Net`; else a TypeError naming what to pass (a net module is not a
    net: pass its `NET`, e.g. `gradtie.nets.cifar8.NET`)."""
    if isinstance(net, Net):
        return net
    hint = (f"pass {getattr(net, '__name__', 'the module')}.NET, the Net it defines"
            if isinstance(getattr(net, "NET", None), Net) else
            "build one with gradtie.nets.protocol.Net, or pass gradtie.nets.cifar8.NET / resnet34.NET")
    raise TypeError(f"{where}: expected a gradtie Net (gradtie.nets.protocol.Net), got "
                    f"{type(net).__name__} {net!r:.60}; {hint}")
