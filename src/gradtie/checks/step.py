"""The train step tie: the rendered step of `gradtie.train` against optax applied to autodiff gradients.

The Lean suite ties the gradient nodes of two train steps: `r34_net_tiedB` (ResNet34StepTieB), the
110 SGD-updated tensors of ResNet-34's step (146 at convBias := true), and
`cifar8Bbn_train_step_tiedB`, the 38 of cifar8-BN's. A train step is those nodes fed to an update
rule, plus the BatchNorm running averages. This module ties the whole step as `train.make_step`
takes it to the step a user of the usual tools takes: autodiff of the forward-based loss
(`reference.oracle`) fed to optax, the running averages recomputed from the BatchNorm inputs in jnp.

Both runs take `len(batches)` consecutive steps from the same weights, each on its own, so the
momentum buffer carries each step into the next. After every step each updated tensor, momentum
buffer and running statistic, and the loss, is a row of `tie.compare`, held to max(STEP_TIE_FACTOR ×
its envelope, 1e-10): the spread (`envelope.spread`) of the reference run itself with each of its
gradients taken at an `envelope.samples` point instead (the batch reversed; parameters and images
nudged by one unit roundoff, fresh every step), each such run going to the last step.

| recipe     | `gradtie.train`                         | optax                                                   |
|------------|-----------------------------------------|---------------------------------------------------------|
| sgd        | θ ← θ − lr·g                            | `sgd(lr)`                                               |
| nesterov   | v ← μv + g; θ ← θ − lr·(g + μv)         | `sgd(lr, momentum=0.9, nesterov=True)`                  |
| heavy-ball | g ← g + wd·θ; v ← μv + g; θ ← θ − lr·v  | `chain(add_decayed_weights(wd), sgd(lr, momentum=0.9))` |

optax's `trace` forms the buffer as g + μ·t and, with `nesterov`, the update as g + μ·(new buffer):
our formulas term by term, so on the same gradients the two rules agree bit for bit
(`rule_difference`). AdamW is not tied: its step is blind to the gradient's scale (its first step ≈ lr·sign(g)).

Shown in: Training with the rendered step.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import reference, train
from .. import tolerances as tol
from ..host import to_device, tree_to_device
from ..nets.protocol import Net, require_net
from ..ops import head
from ..progress import bar
from . import envelope as env_
from .tie import Limit, NodeRow, bn_cells, compare, is_beta, need_x64, node_cells, zero_in_reals

RECIPES = ("sgd", "nesterov", "heavy-ball")
# The book's convention, written out here apart from `gradtie.train`: running ← 0.99·running + 0.01·batch, and
# the first step copies the batch's statistics (biased variance)
RUNNING_MOMENTUM = 0.01
GROUP_NAMES = {"loss": "loss", "momentum": "momentum buffer", "params": "updated tensor",
               "running": "running statistic"}


# ---- the recipes: ours and optax's ---------------------------------------------------------------

def _check_recipe(recipe: str) -> train.Optimizer:
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)} (the momentum-free "
                         f"and momentum SGD rules of `gradtie.train`; AdamW is not tied)")
    return train.make_optimizer(recipe)


def optax_recipe(recipe: str, lr: float) -> optax.GradientTransformation:
    """The optax transformation that is `gradtie.train`'s `recipe` at learning rate lr, with `gradtie.train`'s
    hyperparameters (μ = 0.9, heavy ball's wd = 1e-4)."""
    h = _check_recipe(recipe).hyper
    sgd = optax.sgd(lr, momentum=h.get("momentum"), nesterov=recipe == "nesterov")
    return optax.chain(optax.add_decayed_weights(h["weight_decay"]), sgd) if recipe == "heavy-ball" else sgd


def optax_text(recipe: str) -> str:
    """`optax_recipe` as code, for a report."""
    h = _check_recipe(recipe).hyper
    momentum = f", momentum={h['momentum']}" if "momentum" in h else ""
    sgd = f"optax.sgd(lr{momentum}{', nesterov=True' if recipe == 'nesterov' else ''})"
    return f"optax.chain(optax.add_decayed_weights({h['weight_decay']}), {sgd})" if recipe == "heavy-ball" else sgd


def optax_trace(state) -> Optional[dict]:
    """The momentum buffer inside an optax state (its `TraceState.trace`), or None without one."""
    leaves = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.TraceState))
    return next((s.trace for s in leaves if isinstance(s, optax.TraceState)), None)


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
    mine, other = dict(params), dict(params)
    state, opt_state, worst = ours.init(mine), tx.init(other), 0.0
    for g in grads:
        mine, state = _rule(ours, lr, mine, g, state)
        other, opt_state = theirs(other, g, opt_state)
        worst = max([worst] + [float(jnp.max(jnp.abs(mine[k] - other[k]))) for k in params])
    return worst


def random_gradients(params: Mapping, steps: int, *, seed: int = 0) -> list[dict]:
    """`steps` gradients shaped like `params`, entries N(0, 1): inputs for `rule_difference`."""
    rng = np.random.default_rng(seed)
    return [{k: jnp.asarray(rng.standard_normal(np.shape(v)).astype(jnp.result_type(v))) for k, v in params.items()}
            for _ in range(steps)]


# ---- must-fail controls: a rendered step with one thing wrong -----------------------------------

class StepControl(NamedTuple):
    """A rendered train step with one planted mistake: `net` stepped by `optimizer` (`train.make_step`)."""
    name: str
    breaks: str
    net: Any
    optimizer: train.Optimizer


# name -> (the recipes it applies to, what it breaks); all but the last a small change around a real rule
CONTROLS = {
    "decoupled_weight_decay": (("heavy-ball",), "weight decay applied after momentum (decoupled) instead of "
                               "added to g"),
    "dampened_momentum": (("heavy-ball", "nesterov"), "the buffer takes (1 − μ)·g (PyTorch dampening = μ)"),
    "no_lookahead": (("nesterov",), "θ ← θ − lr·v: Nesterov's look-ahead g + μv dropped"),
    "learning_rate_twice": (RECIPES, "the learning rate applied twice (θ moves by lr²·step)"),
    "skip_tensor": (RECIPES, "the step leaves {skip} as it was"),
    "unbiased_running_variance": (RECIPES, "running_var averages M/(M−1)·σ² (unbiased) instead of the biased σ²")}


@functools.lru_cache(maxsize=None)   # one object per control: its compiled steps are reused
def _planted_rule(recipe: str, name: str, skip: str) -> train.Optimizer:
    """`recipe`'s update rule with the mistake `name`, written around a real rule of `gradtie.train`:
    a change to what goes in (the gradient, the learning rate) or to what comes out."""
    ours = _check_recipe(recipe)
    mu, wd = ours.hyper.get("momentum", 0.0), ours.hyper.get("weight_decay", 0.0)
    without_decay = train.heavy_ball(mu, 0.0).update
    dampened = train.make_optimizer(recipe, **{k: (1 - mu) * v if k == "weight_decay" else v
                                               for k, v in ours.hyper.items()})

    def keep(old, new):
        return {k: old[k] if k == skip else v for k, v in new.items()}

    def update(params, grads, state, lr):
        if name == "decoupled_weight_decay":     # the heavy ball without decay, then θ ← θ − lr·wd·θ
            new, state = without_decay(params, grads, state, lr)
            return {k: new[k] - lr * wd * params[k] for k in new}, state
        if name == "dampened_momentum":          # the rule fed (1 − μ)·g, its decay scaled alike
            return dampened.update(params, {k: (1 - mu) * g for k, g in grads.items()}, state, lr)
        if name == "no_lookahead":               # Nesterov's buffer stepped as the heavy ball: θ ← θ − lr·v
            return without_decay(params, grads, state, lr)
        if name == "learning_rate_twice":
            return ours.update(params, grads, state, lr * lr)
        new, new_state = ours.update(params, grads, state, lr)   # skip_tensor: it and its buffer stay
        return keep(params, new), {g: keep(state[g], tree) for g, tree in new_state.items()}
    return train.Optimizer(name, ours.init, update, dict(ours.hyper))


@dataclass(frozen=True, eq=False)
class UnbiasedRunningVariance(Net):
    """A net definition whose batch statistics hand the running average the unbiased variance
    M/(M − 1)·σ² (PyTorch's convention for `running_var`) instead of the book's biased one; its
    stages, forward and backward are those of the net it is made from."""

    def batch_stats(self, saved) -> dict:
        stats = super().batch_stats(saved)
        for name, layer in self.bn_layers(saved).items():
            m = layer.c.shape[0] * layer.c.shape[2] * layer.c.shape[3]
            stats[f"{name}.running_var"] = stats[f"{name}.running_var"] * (m / (m - 1))
        return stats


@functools.lru_cache(maxsize=None)
def unbiased_running_variance(net: Net) -> UnbiasedRunningVariance:
    return UnbiasedRunningVariance(**{f.name: getattr(net, f.name) for f in dataclasses.fields(Net)})


def control(net, recipe: str, name: str, *, skip: Optional[str] = None) -> StepControl:
    """The must-fail control `name` of `recipe`'s step (CONTROLS): a rendered step with one mistake a
    hand-written optimizer or BatchNorm commonly has. `skip`: the tensor skip_tensor leaves out
    (default: a BatchNorm β in the middle of the net)."""
    ours = _check_recipe(recipe)
    names = [n for n, (recipes, _) in CONTROLS.items() if recipe in recipes]
    if name not in names:
        raise ValueError(f"control {name!r} for {recipe}: expected one of {', '.join(names)}")
    if name == "unbiased_running_variance":
        return StepControl(name, CONTROLS[name][1], unbiased_running_variance(net), ours)
    if skip is None:
        shapes = {s.name: s.shape for s in net.param_specs(net.cfg())}
        betas = [n for n in shapes if is_beta(n, shapes)]
        skip = betas[len(betas) // 2]
    return StepControl(name, CONTROLS[name][1].format(skip=skip), net, _planted_rule(recipe, name, skip))


# ---- the reference run: optax on autodiff gradients ---------------------------------------------

def _reference_running(running, bn_inputs, count, per_example: bool):
    """The running statistics from the BatchNorm inputs c: mean and biased variance over (n, h, w) (per example over
    (h, w), then averaged over the examples), copied on the first step, else averaged in at 0.01."""
    out = {}
    for name, c in bn_inputs.items():
        axes = (2, 3) if per_example else (0, 2, 3)
        mean = jnp.mean(c, axis=axes, keepdims=True)
        mean, var = jnp.squeeze(mean, axis=axes), jnp.mean(jnp.square(c - mean), axis=axes)
        if per_example:
            mean, var = jnp.mean(mean, axis=0), jnp.mean(var, axis=0)
        for stat, b in (("running_mean", mean), ("running_var", var)):
            key = f"{name}.{stat}"
            out[key] = jnp.where(count == 0, b, (1 - RUNNING_MOMENTUM) * running[key] + RUNNING_MOMENTUM * b)
    return out


@dataclass(frozen=True)
class Recipe:
    """An update rule the step tie runs: optax's `name` ("sgd", "nesterov", "heavy-ball", "adamw") at
    `lr` (None: train.DEFAULT_LR[name]) with label smoothing α (None: the net's default)."""
    name: str = "heavy-ball"
    lr: Optional[float] = None
    label_smoothing: Optional[float] = None

    @classmethod
    def of(cls, recipe: "str | Recipe") -> "Recipe":
        return recipe if isinstance(recipe, Recipe) else cls(recipe)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _reference_step(net: Net, cfg, rule: tuple, carry: tuple, batch: tuple):
    """-> (params, opt_state, running, loss): the oracle's gradient (`reference.oracle`) at `at` (the
    parameters, or an envelope's evaluation point), optax's update applied to `params`, the running
    statistics from the forward's BatchNorm inputs at `at`. rule = (recipe, lr, α); carry = (params,
    at, opt_state, running, count); batch = (x, targets)."""
    (recipe, lr, alpha), (params, at, opt_state, running, count), (x, targets) = rule, carry, batch
    loss, g, _ = reference.oracle(net, at, x, targets, cfg, alpha)
    _, saved = net.forward(at, x, cfg)
    bn_inputs = {name: layer.c for name, layer in net.bn_layers(saved).items()}
    updates, opt_state = _optax_rule(recipe, lr)[0].update(g, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            _reference_running(running, bn_inputs, count, cfg.per_example_bn), loss)


def _evaluation(label: Optional[str], params, x, targets, key):
    """(params, x, targets) where a run takes its gradient at one step: the point itself (label None),
    the batch reversed, or parameters and images nudged by one unit roundoff (`envelope.samples`)."""
    if label is None:
        return params, x, targets
    if label == "batch reversed":
        (s,) = env_.samples({"x": x, "targets": targets}, dtype="float64", key=key, batched=("x", "targets"),
                            nudges=0)
        return params, to_device(s.values["x"]), to_device(s.values["targets"])
    # nothing batched: `samples` draws the one nudge it gives a batch of one
    (s,) = env_.samples({"params": params, "x": x}, dtype="float64", key=key, nudged=("params", "x"), nudges=0)
    return tree_to_device(s.values["params"]), to_device(s.values["x"]), targets


class StepState(NamedTuple):
    """One run after one step (or, in an envelope, each leaf's largest distance from the reference)."""
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
    envelopes: list[StepState]                 # per step, each leaf: max |sample − reference|
    bn_cells: dict[str, int]
    zero_at_start: frozenset                   # conv biases that start (and, in ℝ, stay) at 0
    batches: list                              # the (x, targets) of each step, float64
    start: dict                                # θ₀, float64


def reference_run(net, params: Mapping, batches: Sequence, cfg, *, recipe: "str | Recipe" = "heavy-ball",
                  key: Optional[jax.Array] = None, nudges: int = tol.STEP_TIE_NUDGES,
                  progress: bool = False) -> StepReference:
    """optax's `recipe` (a name, or a `Recipe` with its lr and α) on autodiff gradients from
    `params`, one step per (x, targets) in `batches` (float64, the parameters widened exactly), and
    the envelope of every row at every step: the same run with each gradient taken on the batch
    reversed, and `nudges` runs with each gradient taken at parameters and images nudged by one unit
    roundoff (fresh every step)."""
    op = "step.reference_run"
    rule = Recipe.of(recipe)
    recipe, lr, label_smoothing = rule.name, rule.lr, rule.label_smoothing
    need_x64(op)
    if cfg.bf16:
        raise ValueError(f"{op}: the step tie is float64; cfg.bf16 must be False")
    _check_recipe(recipe)
    lr = train.DEFAULT_LR[recipe] if lr is None else float(lr)
    if not lr > 0:
        raise ValueError(f"{op}: lr must be positive, got {lr!r}")
    alpha = train.default_label_smoothing(net) if label_smoothing is None else float(label_smoothing)
    if not batches:
        raise ValueError(f"{op}: batches must hold at least one (x, targets) pair, one per step")
    batches = [(to_device(x, np.float64), head.as_targets(f"{op}: batch {i}", t, np.shape(x)[0], cfg.num_classes,
                                                          jnp.float64)) for i, (x, t) in enumerate(batches)]
    p64 = {k: to_device(v, np.float64) for k, v in params.items()}
    tx = _optax_rule(recipe, lr)[0]
    key = jax.random.key(0) if key is None else key

    def run(label: Optional[str], r: int = 0) -> list[StepState]:
        """The states after each step of one run: the reference (label None), the batch reversed, or
        the r-th run of nudges."""
        q, s, running, out = p64, tx.init(p64), dict(net.init_running(p64, cfg)), []
        for t, (x, targets) in enumerate(batches):
            at, xs, ts = _evaluation(label, q, x, targets, jax.random.fold_in(jax.random.fold_in(key, r), t))
            q, s, running, loss = _reference_step(net, cfg, (recipe, lr, alpha), (q, at, s, running, jnp.asarray(t)),
                                                  (xs, ts))
            q, trace = {k: q[k] for k in p64}, optax_trace(s)
            out.append(StepState(q, None if trace is None else {k: trace[k] for k in p64}, dict(running),
                                 float(loss)))
        return out

    n = batches[0][0].shape[0]
    runs = ([("batch reversed", 0)] if n > 1 else []) + [(f"nudge {r + 1} (u = 2^-53)", r + 1)
                                                        for r in range(nudges + (n == 1))]
    states = run(None)
    # one envelope run at a time: each holds the net's parameters and buffer at every step
    envelopes = env_.spread(states, (run(label, r) for label, r in
                                     bar(runs, desc="step tie: envelope runs", enabled=progress)))
    zero = frozenset(n_ for n_ in zero_in_reals(p64) if not bool(jnp.any(p64[n_] != 0)))
    return StepReference(net.name, recipe, lr, alpha, states, envelopes, bn_cells(net, p64, batches[0][0], cfg),
                         zero, batches, p64)


# ---- the rendered run and the verdict ------------------------------------------------------------

@dataclass(frozen=True)
class StepRows:
    """One step's `tie.compare` rows by group, in the order a failure is looked for: the loss, the
    momentum buffer (none for plain SGD), the updated tensors, the running statistics."""
    step: int                          # 1, 2, …
    groups: dict[str, list[NodeRow]]
    moved: int                         # tensors the rendered step changed, of those whose step is not 0 in ℝ

    def within(self, group: str) -> tuple[int, int]:
        """(rows of `group` within their limit, rows of `group`) at this step."""
        rows = self.groups[group]
        return sum(r.ok for r in rows), len(rows)


def _within_text(counts) -> str:
    return ", ".join(f"{ok}/{n} {GROUP_NAMES[g]}s" for g, (ok, n) in counts if n)


@dataclass
class StepTieReport:
    net: str
    recipe: str
    optax: str                    # the optax chain, as code
    lr: float
    label_smoothing: float
    tensors: int                  # the census: tensors the step updates
    movers: int                   # tensors whose step is not 0 in ℝ (all but conv biases without decay)
    steps: list[StepRows]
    control: Optional[str] = None     # the planted mistake's name (None: the real step)

    def rows(self) -> list[tuple[int, str, NodeRow]]:
        """(step, group, row) in the order a failure is looked for: by step and group, the momentum
        buffer and the updated tensors in backward order (head first)."""
        return [(s.step, g, r) for s in self.steps for g, rows in s.groups.items()
                for r in (rows[::-1] if g in ("momentum", "params") else rows)]

    @property
    def failed(self) -> list[tuple[int, str, NodeRow]]:
        return [row for row in self.rows() if not row[2].ok]

    @property
    def ill_conditioned(self) -> list[tuple[int, str, NodeRow]]:
        return [row for row in self.rows() if row[2].ill_conditioned]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def red(self) -> bool:
        """A row failed that round-off could not have moved that far (what a control must show)."""
        return any(not r.ill_conditioned for _, _, r in self.failed)

    def first_failure(self) -> Optional[tuple[int, str, NodeRow]]:
        return next(iter(self.failed), None)

    def counts(self, group: str) -> tuple[int, int]:
        """(rows within their limit at every step, rows per step) of a group."""
        per_step = [s.groups[group] for s in self.steps]
        return sum(all(rows[i].ok for rows in per_step) for i in range(len(per_step[0]))), len(per_step[0])

    def summary(self) -> str:
        what = self.net if self.control is None else f"{self.net} + {self.control}"
        t, g, w = max(self.rows(), key=lambda row: row[2].ratio)
        line = (f"{self.recipe} step of {what} tied to {self.optax} on autodiff gradients: {self.tensors} tensors, "
                f"{len(self.steps)} steps, float64; within their limits at every step: "
                f"{_within_text((g_, self.counts(g_)) for g_ in ('params', 'momentum', 'running'))}, "
                f"loss {'yes' if self.counts('loss')[0] else 'NO'}; worst {w.ratio:.2g} of its limit (step {t}, "
                f"{GROUP_NAMES[g]} {w.name})")
        if self.ill_conditioned:
            t, g, r = self.ill_conditioned[0]
            line += f"; {len(self.ill_conditioned)} rows too ill-conditioned to judge (first: step {t}, {r.name})"
        if self.failed:
            t, g, r = self.first_failure()
            line += f"; first to break: step {t}, {GROUP_NAMES[g]} {r.name} (err {r.rel:.1e} > limit {r.limit:.1e})"
        return line

    def verdict_lines(self) -> list[str]:
        """One line per step: counts within their limits (stable text: no error sizes)."""
        still = (f" (the other {self.tensors - self.movers} are conv biases behind BatchNorm: their step is 0 in "
                 f"ℝ)" if self.movers < self.tensors else "")
        return [f"step {s.step}: {s.moved}/{self.movers} tensors moved{still}; within their limits: "
                f"{_within_text((g, s.within(g)) for g in ('params', 'momentum', 'running'))}, "
                f"loss {'yes' if s.within('loss')[0] else 'NO'}" for s in self.steps]


def tie_step(net, params: Mapping, batches: Sequence, cfg, *, recipe: "str | Recipe" = "heavy-ball",
             reference: Optional[StepReference] = None, control: Optional[StepControl] = None,
             factor: float = tol.STEP_TIE_FACTOR) -> StepTieReport:
    """The rendered train step (`train.make_step`) taken `len(batches)` times from `params`, tied after
    every step to optax's `recipe` (a name, or a `Recipe` with its lr and α) on autodiff gradients
    (`reference_run`, or `reference` when the controls of one run share it, or to choose the
    envelope's key, its nudges or a progress bar): every updated tensor, the momentum buffer, the
    running statistics and the loss. `control`: a `StepControl` whose net and update rule replace
    the real ones.

    Lean: `r34_net_tiedB` (110 tensors; 146 at convBias := true), `cifar8Bbn_train_step_tiedB` (38).
    Shown in: Training with the rendered step.
    """
    require_net(net, "step.tie_step")
    rule = Recipe.of(recipe)
    recipe, lr = rule.name, rule.lr
    if reference is None:
        reference = reference_run(net, params, batches, cfg, recipe=rule)
    elif (reference.recipe != recipe or (lr is not None and float(lr) != reference.lr)
          or (rule.label_smoothing is not None and float(rule.label_smoothing) != reference.label_smoothing)):
        raise ValueError(f"step.tie_step: the shared reference ran {reference.recipe} at lr {reference.lr} "
                         f"(α {reference.label_smoothing}), not {recipe} at lr {lr} (α {rule.label_smoothing})")
    ours = train.make_optimizer(recipe)
    opt, stepper = (ours, net) if control is None else (control.optimizer, control.net)
    # a control's step runs once per batch: LLVM's optimisation off halves its compile (rendered.QUICK)
    step = train.make_step(stepper, cfg, opt, grads="rendered", label_smoothing=reference.label_smoothing,
                           quick=control is not None)
    state = train.init_state(stepper, cfg, reference.start, opt)
    start, cells = reference.start, reference.bn_cells
    cells_of = node_cells(net, cfg, cells)
    conv_biases = zero_in_reals(start)
    # a conv bias behind BatchNorm has gradient 0 in ℝ: it moves only by weight decay, if it is not 0
    decay = ours.hyper.get("weight_decay", 0.0)
    movers = [n for n in start if n not in conv_biases or (decay and bool(np.any(np.asarray(start[n]) != 0)))]

    def judge(got, want, envelope, **rows):
        return compare(got, want, limit=Limit(envelope, factor, tol.REL_F64), **rows)

    steps = []
    for t, ((x, targets), ref, env) in enumerate(zip(reference.batches, reference.states, reference.envelopes)):
        before = state.params
        state, metrics = step(state, x, targets, reference.lr)
        params_rows = judge(state.params, ref.params, {**env.params, "loss": env.loss},
                            zero_nodes=reference.zero_at_start, cells=cells_of, loss=(metrics["loss"], ref.loss))
        # a conv bias's buffer is wd·θ plus a gradient that is 0 in ℝ: its round-off is on the scale
        # of the net's gradient, not of itself
        momentum_rows = [] if ref.momentum is None else judge(
            state.opt_state["v"], ref.momentum, env.momentum, zero_nodes=conv_biases, cells=cells_of)
        running_rows = judge(state.running, ref.running, env.running,
                             cells={name: cells[name.rsplit(".", 1)[0]] for name in ref.running})
        moved = sum(bool(np.any(np.asarray(state.params[n]) != np.asarray(before[n]))) for n in movers)
        steps.append(StepRows(t + 1, {"loss": params_rows[:1], "momentum": momentum_rows,
                                      "params": params_rows[1:], "running": running_rows}, moved))
    return StepTieReport(reference.net, recipe, optax_text(recipe), reference.lr, reference.label_smoothing,
                         len(start), len(movers), steps, None if control is None else control.name)
