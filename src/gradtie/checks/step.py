"""The train step tie: the rendered step of `gradtie.train` against optax applied to autodiff gradients.

The Lean suite ties the gradient nodes of two train steps: `r34_net_tiedB` (ResNet34StepTieB), the
110 SGD-updated tensors of ResNet-34's step (146 at convBias := true), and
`cifar8Bbn_train_step_tiedB`, the 38 of cifar8-BN's. A train step is those nodes fed to an update
rule, plus the BatchNorm running averages. This module ties the whole step as `train.make_step`
takes it (one forward, the rendered chain, the update rule, the running statistics) to the step a
user of the usual tools takes: autodiff of the forward-based loss (`gradtie.reference.oracle`) fed
to optax, with the running averages recomputed from the BatchNorm inputs in plain jnp.

The two runs start from the same weights and take `len(batches)` consecutive steps each on their
own, so the optimizer state (the momentum buffer) carries each step into the next. After every step
each tensor is a row: the updated parameters, the momentum buffer, the running statistics, and the
step's loss.

Limits. A row is held to `tie.compare`'s max(STEP_TIE_FACTOR × envelope, 1e-10). Its envelope is
the spread of the reference run itself when each of its autodiff gradients is taken at a
`checks.envelope` sample instead: the batch in reverse order, or the parameters and the images
nudged by one unit roundoff, a fresh nudge every step. Each such run goes from the start to the
last step, so the envelope holds whatever step 1's round-off has grown into by step 2.

| recipe     | `gradtie.train` (SPEC §9)               | optax                                                   |
|------------|-----------------------------------------|---------------------------------------------------------|
| sgd        | θ ← θ − lr·g                            | `sgd(lr)`                                               |
| nesterov   | v ← μv + g; θ ← θ − lr·(g + μv)         | `sgd(lr, momentum=0.9, nesterov=True)`                  |
| heavy-ball | g ← g + wd·θ; v ← μv + g; θ ← θ − lr·v  | `chain(add_decayed_weights(wd), sgd(lr, momentum=0.9))` |

optax's `trace` forms the new buffer as g + μ·t and, with `nesterov`, the update as g + μ·(new
buffer), scaled by −lr and added to θ: SPEC's formulas term by term, so on the same gradients the
two rules agree bit for bit (`rule_difference`). AdamW is not tied here: its step is blind to the
gradient's scale (SPEC §11), so a parameter tie after it proves little.

Shown in: Training with the rendered step.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import data as data_
from .. import reference, train
from .. import tolerances as tol
from ..host import to_device, tree_to_device
from ..nets.protocol import Net, as_net
from ..progress import bar
from . import envelope as env_
from .tie import NodeRow, bn_cells, bn_of, compare, is_beta, targets_matrix, zero_in_reals

RECIPES = ("sgd", "nesterov", "heavy-ball")
# SPEC §1, written out here apart from `gradtie.train`: running ← 0.99·running + 0.01·batch, and
# the first step copies the batch's statistics (biased variance)
RUNNING_MOMENTUM = 0.01
GROUPS = ("loss", "momentum", "params", "running")
GROUP_NAMES = {"loss": "loss", "momentum": "momentum buffer", "params": "updated tensor",
               "running": "running statistic"}


# ---- the recipes: ours and optax's ---------------------------------------------------------------

def _check_recipe(recipe: str) -> train.Optimizer:
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)} (the momentum-free "
                         f"and momentum SGD rules of SPEC §9; AdamW is not tied)")
    return train.make_optimizer(recipe)


def optax_recipe(recipe: str, lr: float) -> optax.GradientTransformation:
    """The optax transformation that is SPEC §9's `recipe` at learning rate lr, with `gradtie.train`'s
    hyperparameters (μ = 0.9, heavy ball's wd = 1e-4)."""
    hyper = _check_recipe(recipe).hyper
    if recipe == "sgd":
        return optax.sgd(lr)
    if recipe == "nesterov":
        return optax.sgd(lr, momentum=hyper["momentum"], nesterov=True)
    return optax.chain(optax.add_decayed_weights(hyper["weight_decay"]),
                       optax.sgd(lr, momentum=hyper["momentum"]))


def optax_text(recipe: str) -> str:
    """The optax chain as code, for a report."""
    hyper = _check_recipe(recipe).hyper
    return {"sgd": "optax.sgd(lr)",
            "nesterov": f"optax.sgd(lr, momentum={hyper.get('momentum')}, nesterov=True)",
            "heavy-ball": f"optax.chain(optax.add_decayed_weights({hyper.get('weight_decay')}), "
                          f"optax.sgd(lr, momentum={hyper.get('momentum')}))"}[recipe]


def optax_trace(state) -> Optional[dict]:
    """The momentum buffer inside an optax state (its `TraceState.trace`), or None without one."""
    for leaf in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.TraceState)):
        if isinstance(leaf, optax.TraceState):
            return leaf.trace
    return None


@functools.partial(jax.jit, static_argnums=(0, 1))
def _rule(opt: train.Optimizer, lr: float, params, grads, state):
    """opt's update at lr: one program per (optimizer, lr, shapes)."""
    return opt.update(params, grads, state, lr)


@functools.lru_cache(maxsize=None)
def _optax_rule(recipe: str, lr: float):
    tx = optax_recipe(recipe, lr)

    def update(params, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return tx, jax.jit(update)


def rule_difference(recipe: str, params: Mapping, grads: Sequence[Mapping], *, lr: Optional[float] = None,
                    optimizer: Optional[train.Optimizer] = None) -> float:
    """max |θ_ours − θ_optax| over every entry after each step, when both rules take the same
    gradients `grads[0]`, `grads[1]`, … from `params`, each run on its own (two compiled programs):
    0.0 when the formulations agree bit for bit. `optimizer`: ours in place of `recipe`'s (a control)."""
    ours = _check_recipe(recipe) if optimizer is None else optimizer
    lr = train.DEFAULT_LR[recipe] if lr is None else float(lr)
    if not grads:
        raise ValueError("rule_difference: needs at least one step's gradients")
    tx, theirs = _optax_rule(recipe, lr)
    names = list(params)
    mine, other = dict(params), dict(params)
    state, opt_state, worst = ours.init(mine), tx.init(other), 0.0
    for g in grads:
        g = {k: g[k] for k in names}
        mine, state = _rule(ours, lr, mine, g, state)
        other, opt_state = theirs(other, g, opt_state)
        worst = max(worst, max(float(jnp.max(jnp.abs(mine[k] - other[k]))) for k in names))
    return worst


# ---- must-fail controls: a rendered step with one thing wrong -----------------------------------

class StepControl(NamedTuple):
    """A rendered train step with one planted mistake: `net` (the real net, or a wrapper of it) stepped
    by `optimizer` through `train.make_step`."""
    name: str
    breaks: str
    net: Any
    optimizer: train.Optimizer


def _map(f, *trees):
    return {k: f(*(t[k] for t in trees)) for k in trees[0]}


@functools.lru_cache(maxsize=None)
def decoupled_weight_decay(momentum: float = 0.9, weight_decay: float = 1e-4) -> train.Optimizer:
    """Heavy ball with the decay taken out of the buffer: v ← μv + g; θ ← θ − lr·v − lr·wd·θ (the
    step after the first differs from coupled decay only through v)."""
    def update(params, grads, state, lr):
        v = _map(lambda v_, g: momentum * v_ + g, state["v"], grads)
        new = _map(lambda p, v_: p - lr * v_ - lr * weight_decay * p, params, v)
        return new, {"v": v}
    return train.Optimizer("decoupled_weight_decay", lambda p: {"v": _map(jnp.zeros_like, p)}, update,
                           {"momentum": momentum, "weight_decay": weight_decay})


@functools.lru_cache(maxsize=None)
def dampened_momentum(recipe: str) -> train.Optimizer:
    """The recipe with PyTorch's `dampening = μ`: the buffer takes (1 − μ)·g instead of g."""
    ours = _check_recipe(recipe)
    mu, wd = ours.hyper["momentum"], ours.hyper.get("weight_decay", 0.0)
    nesterov = recipe == "nesterov"

    def update(params, grads, state, lr):
        g = _map(lambda g_, p: g_ + wd * p, grads, params)
        v = _map(lambda v_, g_: mu * v_ + (1 - mu) * g_, state["v"], g)
        step = _map(lambda g_, v_: g_ + mu * v_, g, v) if nesterov else v
        return _map(lambda p, s: p - lr * s, params, step), {"v": v}
    return train.Optimizer("dampened_momentum", ours.init, update, dict(ours.hyper))


@functools.lru_cache(maxsize=None)
def no_lookahead() -> train.Optimizer:
    """Nesterov's buffer with the heavy-ball step: θ ← θ − lr·v instead of θ − lr·(g + μv)."""
    ours = train.nesterov()
    mu = ours.hyper["momentum"]

    def update(params, grads, state, lr):
        v = _map(lambda v_, g: mu * v_ + g, state["v"], grads)
        return _map(lambda p, v_: p - lr * v_, params, v), {"v": v}
    return train.Optimizer("no_lookahead", ours.init, update, dict(ours.hyper))


@functools.lru_cache(maxsize=None)
def learning_rate_twice(recipe: str) -> train.Optimizer:
    """The recipe with the learning rate applied twice: θ moves by lr²·(its step)."""
    ours = _check_recipe(recipe)
    return train.Optimizer("learning_rate_twice", ours.init,
                           lambda params, grads, state, lr: ours.update(params, grads, state, lr * lr),
                           dict(ours.hyper))


@functools.lru_cache(maxsize=None)
def skip_tensor(recipe: str, name: str) -> train.Optimizer:
    """The recipe's step on every tensor but `name`, which (with its buffer) stays as it was."""
    ours = _check_recipe(recipe)

    def update(params, grads, state, lr):
        new, new_state = ours.update(params, grads, state, lr)
        new = {k: params[k] if k == name else v for k, v in new.items()}
        if "v" in new_state:
            new_state = dict(new_state, v={k: state["v"][k] if k == name else v for k, v in new_state["v"].items()})
        return new, new_state
    return train.Optimizer("skip_tensor", ours.init, update, dict(ours.hyper))


@dataclass(frozen=True, eq=False)
class UnbiasedRunningVariance(Net):
    """A net definition whose batch statistics hand the running average the unbiased variance
    M/(M − 1)·σ² (PyTorch's convention for `running_var`) instead of SPEC §1's biased one; its
    stages, forward and backward are those of the net it is made from."""

    def batch_stats(self, saved) -> dict:
        stats = super().batch_stats(saved)
        for name, layer in self.bn_layers(saved).items():
            m = layer.c.shape[0] * layer.c.shape[2] * layer.c.shape[3]
            stats[f"{name}.running_var"] = stats[f"{name}.running_var"] * (m / (m - 1))
        return stats


@functools.lru_cache(maxsize=None)   # one definition per net: its compiled steps are reused
def unbiased_running_variance(net: Net) -> UnbiasedRunningVariance:
    return UnbiasedRunningVariance(**{f.name: getattr(net, f.name) for f in dataclasses.fields(Net)})


def controls(net, recipe: str, *, skip: Optional[str] = None) -> list[StepControl]:
    """The must-fail controls of `recipe`'s step: each a rendered step with one mistake a hand-written
    optimizer or BatchNorm commonly has. `skip`: the tensor the skipping step leaves out (default:
    a BatchNorm β in the middle of the net)."""
    _check_recipe(recipe)
    net = as_net(net)
    if skip is None:
        shapes = {s.name: s.shape for s in net.param_specs(net.cfg())}
        betas = [n for n in shapes if is_beta(n, shapes)]
        skip = betas[len(betas) // 2]
    out = []
    if recipe == "heavy-ball":
        out.append(StepControl("decoupled_weight_decay", "weight decay applied after momentum (decoupled) "
                               "instead of added to g", net, decoupled_weight_decay()))
    if recipe != "sgd":
        out.append(StepControl("dampened_momentum", "the buffer takes (1 − μ)·g (PyTorch dampening = μ)",
                               net, dampened_momentum(recipe)))
    if recipe == "nesterov":
        out.append(StepControl("no_lookahead", "θ ← θ − lr·v: Nesterov's look-ahead g + μv dropped",
                               net, no_lookahead()))
    out += [StepControl("learning_rate_twice", "the learning rate applied twice (θ moves by lr²·step)",
                        net, learning_rate_twice(recipe)),
            StepControl("skip_tensor", f"the step leaves {skip} as it was", net, skip_tensor(recipe, skip)),
            StepControl("unbiased_running_variance", "running_var averages M/(M−1)·σ² (unbiased) instead "
                        "of the biased σ²", unbiased_running_variance(net), train.make_optimizer(recipe))]
    return out


def control(net, recipe: str, name: str, **kwargs) -> StepControl:
    """The control `name` of `recipe`'s step (`controls`), or a ValueError naming the ones there are."""
    found = {c.name: c for c in controls(net, recipe, **kwargs)}
    if name not in found:
        raise ValueError(f"control {name!r} for {recipe}: expected one of {', '.join(found)}")
    return found[name]


def random_gradients(params: Mapping, steps: int, *, seed: int = 0) -> list[dict]:
    """`steps` gradients shaped like `params`, entries N(0, 1): inputs for `rule_difference`."""
    steps = data_._positive_int("step.random_gradients", "steps", steps)
    rng = np.random.default_rng(seed)
    return [{k: jnp.asarray(rng.standard_normal(np.shape(v)).astype(jnp.result_type(v))) for k, v in params.items()}
            for _ in range(steps)]


# ---- the reference run: optax on autodiff gradients ---------------------------------------------

def _reference_running(running, bn_inputs, count, per_example: bool):
    """SPEC §1 from the BatchNorm inputs c: mean and biased variance over (n, h, w) (per example over
    (h, w), then averaged over the examples), copied on the first step, else averaged in at 0.01."""
    out = {}
    for name, c in bn_inputs.items():
        axes = (2, 3) if per_example else (0, 2, 3)
        mean = jnp.mean(c, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(c - mean), axis=axes)
        mean = jnp.squeeze(mean, axis=axes)
        if per_example:
            mean, var = jnp.mean(mean, axis=0), jnp.mean(var, axis=0)
        for stat, b in (("running_mean", mean), ("running_var", var)):
            key = f"{name}.{stat}"
            out[key] = jnp.where(count == 0, b, (1 - RUNNING_MOMENTUM) * running[key] + RUNNING_MOMENTUM * b)
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _reference_step(net: Net, cfg, recipe: str, lr: float, alpha: float, params, at, opt_state, running, count,
                    x, targets):
    """-> (params, opt_state, running, loss): the oracle's gradient (`reference.oracle`) at `at` (the
    parameters, or an envelope's evaluation point), optax's update applied to `params`, the running
    statistics from the forward's BatchNorm inputs at `at`."""
    loss, g, _ = reference.oracle(net, at, x, targets, cfg, alpha)
    _, saved = net.forward(at, x, cfg)
    bn_inputs = {name: layer.c for name, layer in net.bn_layers(saved).items()}
    updates, opt_state = _optax_rule(recipe, lr)[0].update(g, opt_state, params)
    per_example = getattr(cfg, "bn", "batch") == "example"
    return (optax.apply_updates(params, updates), opt_state,
            _reference_running(running, bn_inputs, count, per_example), loss)


def _evaluation(kind: Optional[str], params, x, targets, key):
    """(params, x, targets) where a run takes its gradient at one step: the point itself (kind None),
    the batch reversed, or the parameters and images nudged by one unit roundoff (a fresh
    `envelope.samples` draw every step)."""
    if kind is None:
        return params, x, targets
    if kind == "batch reversed":
        (s,) = env_.samples({"x": x, "targets": targets}, dtype="float64", key=key, batched=("x", "targets"),
                            nudges=0)
        return params, to_device(s.values["x"]), to_device(s.values["targets"])
    # nothing batched: `samples` draws the one nudge it gives a batch of one
    (s,) = env_.samples({"params": params, "x": x}, dtype="float64", key=key, nudged=("params", "x"), nudges=0)
    return tree_to_device(s.values["params"]), to_device(s.values["x"]), targets


def _max_abs_diff(a: Mapping, b: Mapping) -> dict[str, float]:
    return {k: float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in b}


class StepState(NamedTuple):
    """One run after one step: the parameters, the momentum buffer (None without one), the running
    statistics and the step's loss."""
    params: dict
    momentum: Optional[dict]
    running: dict
    loss: float


@dataclass
class StepReference:
    """The optax run on autodiff gradients, step by step, with every row's envelope."""
    net: str
    recipe: str
    lr: float
    label_smoothing: float
    states: list[StepState]                    # after step 1, 2, …
    envelopes: list[dict[str, dict[str, float]]]   # per step: group -> tensor -> max |sample − reference|
    evaluations: tuple[str, ...]               # what each envelope run's gradients were
    bn_cells: dict[str, int]
    zero_at_start: frozenset                   # conv biases that start (and, in ℝ, stay) at 0
    batches: list = field(repr=False, default_factory=list)   # the (x, targets) of each step, float64
    start: dict = field(repr=False, default_factory=dict)     # θ₀, float64

    @property
    def steps(self) -> int:
        return len(self.states)


def _float64(tree):
    return {k: to_device(v, np.float64) for k, v in tree.items()}


def _checked_batches(op: str, batches, cfg) -> list[tuple[jax.Array, jax.Array]]:
    if not batches:
        raise ValueError(f"{op}: batches must hold at least one (x, targets) pair, one per step")
    out = []
    for i, b in enumerate(batches):
        if len(b) != 2:
            raise ValueError(f"{op}: batch {i} must be an (x, targets) pair")
        x = to_device(b[0], np.float64)
        if x.ndim != 4:
            raise ValueError(f"{op}: batch {i}'s images must be [N,3,H,W], got shape {tuple(x.shape)}")
        t = targets_matrix(jnp.asarray(b[1]), cfg.num_classes, jnp.float64)
        if t.shape != (x.shape[0], cfg.num_classes):
            raise ValueError(f"{op}: batch {i}'s targets must be {x.shape[0]} labels or rows of "
                             f"{cfg.num_classes}, got shape {tuple(jnp.shape(b[1]))}")
        out.append((x, t))
    return out


def _state_of(params, opt_state_momentum, running, loss) -> StepState:
    return StepState(dict(params), None if opt_state_momentum is None else dict(opt_state_momentum),
                     dict(running), float(loss))


def reference_run(net, params: Mapping, batches: Sequence, cfg, *, recipe: str = "heavy-ball",
                  lr: Optional[float] = None, label_smoothing: Optional[float] = None,
                  key: Optional[jax.Array] = None, nudges: int = tol.STEP_TIE_NUDGES,
                  progress: bool = False) -> StepReference:
    """optax's `recipe` on autodiff gradients from `params`, one step per (x, targets) in `batches`
    (float64, the parameters widened exactly), and the envelope of every row at every step: the
    same run with each gradient taken on the batch reversed, and `nudges` runs with each gradient
    taken at parameters and images nudged by one unit roundoff (fresh every step)."""
    op = "step.reference_run"
    net = as_net(net)
    if not jax.config.jax_enable_x64:
        raise ValueError(f"{op}: the step tie runs in float64: it needs jax_enable_x64 "
                         f"(jax.config.update('jax_enable_x64', True))")
    if cfg.bf16:
        raise ValueError(f"{op}: the step tie is float64; cfg.bf16 must be False")
    _check_recipe(recipe)
    lr = train.DEFAULT_LR[recipe] if lr is None else float(lr)
    if not lr > 0:
        raise ValueError(f"{op}: lr must be positive, got {lr!r}")
    alpha = train.default_label_smoothing(net) if label_smoothing is None else float(label_smoothing)
    batches = _checked_batches(op, batches, cfg)
    p64 = _float64(params)
    tx = _optax_rule(recipe, lr)[0]
    key = jax.random.key(0) if key is None else key

    def run(kind: Optional[str], r: int = 0):
        """The states after each step of one run (a generator): the reference (kind None), the
        batch reversed, or the r-th run of nudges."""
        q, s, running = p64, tx.init(p64), dict(net.init_running(p64, cfg))
        for t, (x, targets) in enumerate(batches):
            at, xs, ts = _evaluation(kind, q, x, targets, jax.random.fold_in(jax.random.fold_in(key, r), t))
            q, s, running, loss = _reference_step(net, cfg, recipe, lr, alpha, q, at, s, running, jnp.asarray(t),
                                                  xs, ts)
            q = {k_: q[k_] for k_ in p64}
            yield _state_of(q, optax_trace(s), running, loss)

    n = batches[0][0].shape[0]
    runs = ([("batch reversed", 0)] if n > 1 else []) + [(f"nudge {r + 1} (u = 2^-53)", r + 1)
                                                        for r in range(nudges + (n == 1))]
    shown = bar(desc="step tie: reference and envelope runs", total=len(runs) + 1, enabled=progress)
    states = list(run(None))
    shown.update(1)
    envelopes = [{g: {} for g in GROUPS} for _ in states]
    for label, r in runs:
        kind = label if label == "batch reversed" else "nudge"
        for t, (mine, ref) in enumerate(zip(run(kind, r), states)):
            env = envelopes[t]
            for group in ("params", "momentum", "running"):
                a, b = getattr(mine, group), getattr(ref, group)
                if b is None:
                    continue
                for name, d in _max_abs_diff(a, b).items():
                    env[group][name] = max(env[group].get(name, 0.0), d)
            env["loss"]["loss"] = max(env["loss"].get("loss", 0.0), abs(mine.loss - ref.loss))
        shown.update(1)
    shown.close()
    zero = frozenset(n_ for n_ in zero_in_reals(p64) if not bool(jnp.any(p64[n_] != 0)))
    return StepReference(net.name, recipe, lr, alpha, states, envelopes,
                         ("autodiff (the reference)",) + tuple(label for label, _ in runs),
                         bn_cells(net, p64, batches[0][0], cfg), zero, batches, p64)


# ---- the rendered run and the verdict ------------------------------------------------------------

@dataclass(frozen=True)
class StepRows:
    """The verdict of one step: the loss row, then one row per tensor of each group."""
    step: int                     # 1, 2, …
    loss: NodeRow
    params: list[NodeRow]
    momentum: list[NodeRow]       # empty for plain SGD
    running: list[NodeRow]
    moved: int                    # tensors the rendered step changed, of those whose step is not 0 in ℝ

    def groups(self) -> dict[str, list[NodeRow]]:
        return {"loss": [self.loss], "momentum": self.momentum, "params": self.params, "running": self.running}

    def rows(self) -> list[NodeRow]:
        return [r for rows in self.groups().values() for r in rows]

    def within(self, group: str) -> tuple[int, int]:
        """(rows of `group` within their limit, rows of `group`) at this step."""
        rows = self.groups()[group]
        return sum(r.ok for r in rows), len(rows)


@dataclass
class StepTieReport:
    net: str
    recipe: str
    optax: str                    # the optax chain, as code
    lr: float
    label_smoothing: float
    tensors: int                  # the census: tensors the step updates
    floats: int
    movers: int                   # tensors whose step is not 0 in ℝ (all but conv biases without decay)
    steps: list[StepRows]
    control: Optional[str] = None     # the planted mistake's name (None: the real step)
    meta: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[tuple[int, str, NodeRow]]:
        return [(s.step, g, r) for s in self.steps for g, rows in s.groups().items() for r in rows]

    @property
    def failed(self) -> list[tuple[int, str, NodeRow]]:
        return [(t, g, r) for t, g, r in self.rows() if not r.ok]

    @property
    def ill_conditioned(self) -> list[tuple[int, str, NodeRow]]:
        return [(t, g, r) for t, g, r in self.rows() if r.ill_conditioned]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def red(self) -> bool:
        """A row failed that round-off could not have moved that far (what a control must show)."""
        return any(not r.ill_conditioned for _, _, r in self.failed)

    def first_failure(self) -> Optional[tuple[int, str, NodeRow]]:
        """The first failing row: by step, then loss, momentum buffer, updated tensors (each in
        backward order, head first), running statistics."""
        for s in self.steps:
            order = [s.loss] + list(reversed(s.momentum)) + list(reversed(s.params)) + s.running
            groups = ["loss"] + ["momentum"] * len(s.momentum) + ["params"] * len(s.params) + ["running"] * len(s.running)
            for g, r in zip(groups, order):
                if not r.ok:
                    return s.step, g, r
        return None

    def worst(self) -> tuple[int, str, NodeRow]:
        return max(self.rows(), key=lambda tgr: tgr[2].rel / tgr[2].limit)

    def counts(self, group: str) -> tuple[int, int]:
        """(rows within their limit at every step, rows per step) of a group."""
        per_step = [s.groups()[group] for s in self.steps]
        n = len(per_step[0])
        ok = sum(all(rows[i].ok for rows in per_step) for i in range(n))
        return ok, n

    def summary(self) -> str:
        what = self.net if self.control is None else f"{self.net} + {self.control}"
        line = (f"{self.recipe} step of {what} tied to {self.optax} on autodiff gradients: "
                f"{self.tensors} tensors, {len(self.steps)} steps, float64")
        parts = []
        for g in ("params", "momentum", "running"):
            ok, n = self.counts(g)
            if n:
                parts.append(f"{ok}/{n} {GROUP_NAMES[g]}s")
        line += "; within their limits at every step: " + ", ".join(parts)
        line += f", loss {'yes' if self.counts('loss')[0] else 'NO'}"
        t, g, w = self.worst()
        line += f"; worst {w.rel / w.limit:.2g} of its limit (step {t}, {GROUP_NAMES[g]} {w.name})"
        if self.ill_conditioned:
            t, g, r = self.ill_conditioned[0]
            line += f"; {len(self.ill_conditioned)} rows too ill-conditioned to judge (first: step {t}, {r.name})"
        first = self.first_failure()
        if first:
            t, g, r = first
            line += (f"; first to break: step {t}, {GROUP_NAMES[g]} {r.name} (err {r.rel:.1e} > limit "
                     f"{r.limit:.1e})")
        return line

    def verdict_lines(self) -> list[str]:
        """One line per step: counts within their limits (stable text: no error sizes)."""
        lines = []
        for s in self.steps:
            parts = [f"{ok}/{n} {GROUP_NAMES[g]}s" for g in ("params", "momentum", "running")
                     for ok, n in [s.within(g)] if n]
            still = (f" (the other {self.tensors - self.movers} are conv biases behind BatchNorm: their "
                     f"step is 0 in ℝ)" if self.movers < self.tensors else "")
            lines.append(f"step {s.step}: {s.moved}/{self.movers} tensors moved{still}; within their limits: "
                         f"{', '.join(parts)}, loss {'yes' if s.loss.ok else 'NO'}")
        return lines

    def table(self, step: Optional[int] = None) -> str:
        head_ = f"{'step':>4} {'group':<9} {'tensor':<36} {'M':>6} {'envelope':>9} {'limit':>8} {'rel err':>9} {'err/lim':>8}  ok"
        lines = [head_, "-" * len(head_)]
        for t, g, r in self.rows():
            if step is not None and t != step:
                continue
            verdict = "ILL" if r.ill_conditioned else ("yes" if r.ok else "NO")
            lines.append(f"{t:>4} {g:<9} {r.name:<36} {r.cells if r.cells else '-':>6} {r.envelope:9.1e} "
                         f"{r.limit:8.1e} {r.rel:9.1e} {r.rel / r.limit:8.2g}  {verdict}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "recipe": self.recipe, "optax": self.optax, "lr": self.lr,
                "label_smoothing": self.label_smoothing, "tensors": self.tensors, "floats": self.floats,
                "movers": self.movers,
                "control": self.control, "ok": self.ok, "summary": self.summary(), **self.meta,
                "rows": [{"step": t, "group": g, "name": r.name, "err": r.err, "scale": r.scale,
                          "rel": r.rel, "limit": r.limit, "envelope": r.envelope, "ok": r.ok,
                          "ill_conditioned": r.ill_conditioned} for t, g, r in self.rows()]}


def _changed(a: Mapping, b: Mapping) -> dict[str, bool]:
    return {k: bool(np.any(np.asarray(a[k]) != np.asarray(b[k]))) for k in b}


def tie_step(net, params: Mapping, batches: Sequence, cfg, *, recipe: str = "heavy-ball",
             lr: Optional[float] = None, label_smoothing: Optional[float] = None,
             reference: Optional[StepReference] = None, control: Optional[StepControl] = None,
             key: Optional[jax.Array] = None, factor: float = tol.STEP_TIE_FACTOR,
             progress: bool = False) -> StepTieReport:
    """The rendered train step (`train.make_step`, grads="rendered") taken `len(batches)` times from
    `params`, tied after every step to optax's `recipe` on autodiff gradients (`reference_run`):
    every updated tensor, the momentum buffer, the running statistics and the loss, each within
    max(factor × its envelope, 1e-10) of the reference (`tie.compare`).

    `reference`: a `reference_run` to share (the controls of one run). `control`: a `StepControl`
    whose net and update rule replace the real ones on the rendered side.

    Lean: `r34_net_tiedB` (110 tensors; 146 at convBias := true), `cifar8Bbn_train_step_tiedB` (38).
    Shown in: Training with the rendered step.
    """
    op = "step.tie_step"
    net = as_net(net)
    if reference is None:
        reference = reference_run(net, params, batches, cfg, recipe=recipe, lr=lr,
                                  label_smoothing=label_smoothing, key=key, progress=progress)
    elif reference.recipe != recipe or (lr is not None and float(lr) != reference.lr):
        raise ValueError(f"{op}: the shared reference ran {reference.recipe} at lr {reference.lr}, "
                         f"not {recipe} at lr {lr}")
    opt = train.make_optimizer(recipe) if control is None else control.optimizer
    stepper = net if control is None else control.net
    # a control's step runs once per batch: LLVM's optimisation off halves its compile (rendered.QUICK)
    step = train.make_step(stepper, cfg, opt, grads="rendered", label_smoothing=reference.label_smoothing,
                           quick=control is not None)
    state = train.init_state(stepper, cfg, reference.start, opt)
    cells_of = {name: reference.bn_cells[b] for name in reference.start
                if (b := bn_of(name, reference.bn_cells)) is not None}
    conv_biases = zero_in_reals(reference.start)
    # a conv bias behind BatchNorm has gradient 0 in ℝ: it moves only by weight decay, if it is not 0
    decay = train.make_optimizer(recipe).hyper.get("weight_decay", 0.0)
    movers = [n for n in reference.start if n not in conv_biases
              or (decay and bool(np.any(np.asarray(reference.start[n]) != 0)))]
    out = []
    for t, ((x, targets), ref, env) in enumerate(zip(reference.batches, reference.states, reference.envelopes)):
        before = state.params
        state, metrics = step(state, x, targets, reference.lr)
        params_rows = compare(state.params, ref.params, envelope=env["params"], factor=factor,
                              floor=tol.REL_F64, zero_nodes=reference.zero_at_start, cells=cells_of,
                              loss=(metrics["loss"], ref.loss), loss_envelope=env["loss"].get("loss", 0.0))
        momentum_rows = []
        if ref.momentum is not None:
            if "v" not in state.opt_state:
                raise ValueError(f"{op}: the recipe keeps a momentum buffer, the rendered optimizer "
                                 f"{opt.name!r} keeps none ('v')")
            # a conv bias's buffer is wd·θ plus a gradient that is 0 in ℝ: its round-off is on the
            # scale of the net's gradient, not of itself
            momentum_rows = compare(state.opt_state["v"], ref.momentum, envelope=env["momentum"],
                                    factor=factor, floor=tol.REL_F64, zero_nodes=conv_biases, cells=cells_of)
        running_cells = {name: reference.bn_cells[name.rsplit(".", 1)[0]] for name in ref.running}
        running_rows = compare(state.running, ref.running, envelope=env["running"], factor=factor,
                               floor=tol.REL_F64, cells=running_cells)
        changed = _changed(state.params, before)
        moved = sum(changed[n] for n in movers)
        out.append(StepRows(t + 1, params_rows[0], params_rows[1:], momentum_rows, running_rows, moved))
    sizes = [int(np.prod(np.shape(v))) for v in reference.start.values()]
    return StepTieReport(reference.net, recipe, optax_text(recipe), reference.lr, reference.label_smoothing,
                         len(sizes), sum(sizes), len(movers), out, None if control is None else control.name,
                         {"evaluations": list(reference.evaluations), "factor": factor,
                          "bn_cells": reference.bn_cells,
                          "breaks": None if control is None else control.breaks})


# ---- the photos a user would step on ------------------------------------------------------------

def photo_batches(steps: int, batch: int, image_size: int, *, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps` batches of photo crops (float64) with their labels, the photo each was cut from
    (`data.photo_labels`, K = 7)."""
    op = "step.photo_batches"
    steps, batch = data_._positive_int(op, "steps", steps), data_._positive_int(op, "batch", batch)
    x, labels = data_.photo_labels(steps * batch, image_size, seed=seed, dtype=np.float64)
    order = np.random.default_rng(seed).permutation(len(labels))   # mix the photos across batches
    x, labels = x[order], labels[order]
    return [(x[i * batch:(i + 1) * batch], labels[i * batch:(i + 1) * batch]) for i in range(steps)]
