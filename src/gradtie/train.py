"""Train steps: update rules, the learning-rate schedule, running statistics, a small training loop.

The rendered step runs the net's forward once and its rendered backward once (`rendered.step`):
one forward gives the batch statistics (for the running averages) and the saved activations the
backward reads; the cotangent at the logits is the loss's own. The autodiff step is the peer a
reader compares against: the same forward, differentiated through `gradtie.reference`. Shown in:
Training with the rendered step.

| optimizer  | update                                                                  | written   |
|------------|-------------------------------------------------------------------------|-----------|
| sgd        | θ ← θ − lr·g                                                            | here      |
| nesterov   | v ← μv + g; θ ← θ − lr·(g + μv), μ = 0.9                                | here      |
| heavy-ball | g ← g + wd·θ (every tensor); v ← 0.9v + g; θ ← θ − lr·v                 | here      |
| adamw      | θ ← θ − lr·m̂/(√v̂ + ε) − lr·wd·θ (bias-corrected moments)                | optax     |

The three SGD rules are written out: they are the rendered side of the train-step tie, which holds
them to optax's (`checks.step`). AdamW is optax's `scale_by_adam` and `add_decayed_weights`.
Every optimizer is a pair of pure functions on dict-of-array pytrees, `init(params) -> state` and
`update(params, grads, state, lr) -> (params, state)`; states are dicts of arrays, so checkpoints
are plain `.npz` files (or orbax's, `gradtie.checkpoints`).

`fit` is the training loop behind `gradtie train`: a run (`FitConfig`) trained epoch by epoch,
evaluated with recomputed (precise) BN statistics beside the running ones, in a run folder with
`run.json`, an append-only `metrics.jsonl` and atomic checkpoints, and an exact resume. It runs on
one device (`make_step`) or on the data mesh of every local device and every host
(`parallel.make_step`, `gradtie.cluster`), on in-memory data or an image folder read through
`gradtie.pipeline`; where the arrays live (`_OneDevice`, `_OnMesh`), what the run reads
(`_ArrayFeed`, `_FolderFeed`) and where it is stored (`_NpzStore`, `_OrbaxStore`) are one small
class each.
`side_by_side` follows the same run with the rendered and the autodiff step in lockstep and bounds
their distance by the float32 round-off envelope.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import data as data_
from . import reference, rendered
from . import tolerances as tol
from .host import to_device
from .kit import KIT, Kit
from .nets.layers import zero_in_reals
from .nets.protocol import Net, require_net
from .nets.protocol import fingerprint as value_key
from .ops import head, maxpool
from .progress import bar

Params = dict[str, jax.Array]
OptState = dict[str, Any]

RUNNING_MOMENTUM = 0.01     # running ← (1 − 0.01)·running + 0.01·batch (PyTorch's BatchNorm default)
CHECKPOINT = "checkpoint.npz"
CHECKPOINT_FORMATS = ("npz", "orbax")
METRICS = "metrics.jsonl"     # one JSON object per epoch, appended
# the fields of a metrics.jsonl record that time the run (everything else repeats bit for bit on a resume)
WALL_CLOCK = frozenset({"seconds", "eval_seconds", "images_per_second", "step_seconds", "step_images_per_second",
                        "images_per_second_per_device", "step_images_per_second_per_device"})
RUN = "run.json"


# ---- update rules --------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Optimizer:
    """A named update rule: init(params) -> state; update(params, grads, state, lr) -> (params, state).
    Hashed by value (`protocol.fingerprint`: its name, hyper-parameters and the code and closure of
    its functions): a static argument of `jax.jit`, so equal rules built separately share compiled
    steps and rules that differ never do."""
    name: str
    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Params, OptState]]
    hyper: dict

    @functools.cached_property
    def _fingerprint(self):
        return value_key((self.name, self.init, self.update, self.hyper))

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Optimizer) and self._fingerprint == other._fingerprint)

    def __hash__(self) -> int:
        return hash(self._fingerprint)


def _map(f, *trees: Mapping) -> Params:
    """f applied key by key; the result keeps the first tree's key order (the signature order)."""
    return {k: f(*(t[k] for t in trees)) for k in trees[0]}


def _lr(lr, like: jax.Array) -> jax.Array:
    return jnp.asarray(lr, dtype=like.dtype)


def _zeros(params: Params) -> Params:
    return _map(jnp.zeros_like, params)


@functools.lru_cache(maxsize=None)   # one object per setting: compiled steps are reused
def sgd() -> Optimizer:
    """θ ← θ − lr·g."""
    def update(params, grads, state, lr):
        return _map(lambda p, g: p - _lr(lr, p) * g, params, grads), state

    return Optimizer("sgd", lambda params: {}, update, {})


@functools.lru_cache(maxsize=None)
def nesterov(momentum: float = 0.9) -> Optimizer:
    """v ← μv + g; θ ← θ − lr·(g + μv) (the look-ahead form; optax's `sgd(nesterov=True)`)."""
    def update(params, grads, state, lr):
        v = _map(lambda v_, g: momentum * v_ + g, state["v"], grads)
        new = _map(lambda p, g, v_: p - _lr(lr, p) * (g + momentum * v_), params, grads, v)
        return new, {"v": v}

    return Optimizer("nesterov", lambda params: {"v": _zeros(params)}, update, {"momentum": momentum})


@functools.lru_cache(maxsize=None)
def heavy_ball(momentum: float = 0.9, weight_decay: float = 1e-4) -> Optimizer:
    """Coupled weight decay on every tensor, then momentum: g ← g + wd·θ; v ← μv + g; θ ← θ − lr·v."""
    def update(params, grads, state, lr):
        g = _map(lambda g_, p: g_ + weight_decay * p, grads, params)
        v = _map(lambda v_, g_: momentum * v_ + g_, state["v"], g)
        return _map(lambda p, v_: p - _lr(lr, p) * v_, params, v), {"v": v}

    return Optimizer("heavy-ball", lambda params: {"v": _zeros(params)}, update,
                     {"momentum": momentum, "weight_decay": weight_decay})


@functools.lru_cache(maxsize=None)
def adamw(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4) -> Optimizer:
    """optax's AdamW without its learning rate: `scale_by_adam` (bias-corrected moments, t = 1, 2, …)
    then `add_decayed_weights` (decay read from θ before the step); θ ← θ − lr·(that). The state is
    optax's, as a dict: m (its mu), v (its nu), count."""
    tx = optax.chain(optax.scale_by_adam(b1, b2, eps), optax.add_decayed_weights(weight_decay))

    def init(params):
        adam, _ = tx.init(params)
        return {"m": {k: adam.mu[k] for k in params}, "v": {k: adam.nu[k] for k in params},
                "count": adam.count}

    def update(params, grads, state, lr):
        adam = optax.ScaleByAdamState(state["count"], state["m"], state["v"])
        step, (adam, _) = tx.update(grads, (adam, optax.EmptyState()), params)
        new = _map(lambda p, u: p - _lr(lr, p) * u, params, step)
        return new, {"m": {k: adam.mu[k] for k in params}, "v": {k: adam.nu[k] for k in params},
                     "count": adam.count}

    return Optimizer("adamw", init, update, {"b1": b1, "b2": b2, "eps": eps, "weight_decay": weight_decay})


OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {
    "sgd": sgd, "nesterov": nesterov, "heavy-ball": heavy_ball, "adamw": adamw}

# upstream's learning rates for cifar8; heavy ball is the ResNet-34 ImageNet recipe's
DEFAULT_LR = {"sgd": 0.1, "nesterov": 0.02, "heavy-ball": 0.1, "adamw": 1e-3}


def _known_optimizer(op: str, name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"{op}: optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")


def make_optimizer(name: str, **hyper) -> Optimizer:
    """The registered optimizer `name` with its defaults overridden by `hyper`."""
    _known_optimizer("train.make_optimizer", name)
    return OPTIMIZERS[name](**hyper)


# ---- learning-rate schedules (optax's) -----------------------------------------------------------

_FLOAT = float   # jnp's default float: float64 under jax_enable_x64, else float32


def constant(base_lr: float) -> Callable[[Any], jax.Array]:
    if not base_lr > 0:
        raise ValueError(f"constant: base_lr must be positive, got {base_lr!r}")
    sched = optax.constant_schedule(base_lr)
    return lambda step: jnp.asarray(sched(step), _FLOAT)


def cosine_warmup(base_lr: float, warmup_steps: int, total_steps: int) -> Callable[[Any], jax.Array]:
    """lr(s) = base·(s+1)/W for s < W (linear warmup reaching base at s = W−1), then
    base·½(1 + cos(π·(s−W)/(T−W))) for W ≤ s < T, and 0 from s = T on: optax's `linear_schedule`
    joined to its `cosine_decay_schedule`. Step s counts from 0, so the first step already trains
    (a warmup starting at 0 would waste it)."""
    if not base_lr > 0:
        raise ValueError(f"cosine_warmup: base_lr must be positive, got {base_lr!r}")
    if not (isinstance(total_steps, int) and total_steps > 0):
        raise ValueError(f"cosine_warmup: total_steps must be a positive integer, got {total_steps!r}")
    if not (isinstance(warmup_steps, int) and 0 <= warmup_steps <= total_steps):
        raise ValueError(f"cosine_warmup: warmup_steps must be an integer in 0…{total_steps}, "
                         f"got {warmup_steps!r}")
    warm = optax.linear_schedule(base_lr / max(warmup_steps, 1), base_lr, warmup_steps - 1)
    cosine = optax.cosine_decay_schedule(base_lr, max(total_steps - warmup_steps, 1))
    sched = optax.join_schedules([warm, cosine], [warmup_steps])
    return lambda step: jnp.asarray(sched(step), _FLOAT)


def _segments_schedule(kind: str, segments: list) -> Callable[[int], jax.Array]:
    """lr(step) over the run's schedule segments: each a cosine cycle (with its own warmup) or a
    constant rate over steps [first, first + steps); past the last segment, its own tail."""
    fns = [(seg["first"], constant(seg["lr"]) if kind == "constant"
            else cosine_warmup(seg["lr"], seg["warmup_steps"], seg["steps"])) for seg in segments]

    def schedule(step: int) -> jax.Array:
        first, f = next((a, f) for a, f in reversed(fns) if step >= a)
        return f(step - first)

    return schedule


# ---- train state, running statistics, the step ---------------------------------------------------

class TrainState(NamedTuple):
    params: Params
    opt_state: OptState
    running: dict[str, jax.Array]    # "<bn>.running_mean" / "<bn>.running_var"
    step: jax.Array                  # int32 scalar: steps taken so far


def init_state(net, cfg, params: Params, opt: Optimizer) -> TrainState:
    """Step 0: the optimizer's initial state and the net's initial running statistics."""
    return TrainState(dict(params), opt.init(params), dict(net.init_running(params, cfg)),
                      jnp.zeros((), jnp.int32))


# running[C], batch[C] -> (1 − m)·running + m·batch, or batch itself on step 0
def update_running(running: Mapping, batch: Mapping, step: jax.Array) -> dict[str, jax.Array]:
    """running ← 0.99·running + 0.01·batch (biased variance); the first step copies the batch stats."""
    def one(r, b):
        b = b.astype(r.dtype)
        return jnp.where(step == 0, b, (1 - RUNNING_MOMENTUM) * r + RUNNING_MOMENTUM * b)
    return {k: one(running[k], batch[k]) for k in running}


def _loss_and_grads(net, kit, cfg, grads: str, alpha: float, params, x, targets):
    """(loss, grads, logits, batch stats): the rendered step (`rendered.step`), or its autodiff peer
    (`reference.value_and_grad` of the forward and the net's loss)."""
    if grads == "rendered":
        out = rendered.step(net, kit, params, x, targets, cfg, alpha=alpha)
        return out.loss, out.grads, out.logits, out.stats
    t = head.as_targets(net.name, targets, x.shape[0], cfg.num_classes, jnp.result_type(x))

    def loss_fn(p):
        logits, saved = net.forward(p, x, cfg)
        return net.loss.value(logits, t.astype(logits.dtype), alpha), (logits, net.batch_stats(saved))

    (loss, (logits, stats)), g = reference.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, g, logits, stats


def _step(net, kit, cfg, opt: Optimizer, grads: str, alpha: float, state: TrainState, x, targets, lr):
    loss, g, logits, stats = _loss_and_grads(net, kit, cfg, grads, alpha, state.params, x, targets)
    params, opt_state = opt.update(state.params, g, state.opt_state, lr)
    running = update_running(state.running, stats, state.step)
    t = jnp.asarray(targets)
    labels = t if jnp.issubdtype(t.dtype, jnp.integer) else jnp.argmax(t, axis=1)
    metrics = {
        "loss": loss,
        "accuracy": jnp.mean(jnp.argmax(logits, axis=1) == labels),
        "grad_norm": jnp.sqrt(sum(jnp.sum(jnp.square(v.astype(jnp.float32))) for v in g.values())),
        "lr": jnp.asarray(lr, jnp.float32),
    }
    return TrainState(params, opt_state, running, state.step + 1), metrics


_STATIC = (0, 1, 2, 3, 4, 5)
_jitted_step = jax.jit(_step, static_argnums=_STATIC)
_quick_step = jax.jit(_step, static_argnums=_STATIC, compiler_options=rendered.QUICK)


def make_step(net, cfg, opt: Optimizer, *, grads: str = "rendered", label_smoothing: float = 0.0,
              jit: bool = True, quick: bool = False, kit: Kit = KIT,
              ) -> Callable[[TrainState, Any, Any, Any], tuple[TrainState, dict]]:
    """A train step `step(state, x, targets, lr) -> (state, metrics)`, jitted.

    targets: int labels [N] or rows summing to 1 [N,K]. grads="rendered" runs the rendered step
    (`rendered.step` through `kit`); grads="autodiff" differentiates the same forward through
    `gradtie.reference` (the peer the rendered step is compared against). metrics: loss, accuracy
    (argmax of logits against argmax of targets), grad_norm (global L2), lr. quick: LLVM's
    optimisation off (a control taken a step or two). The compiled step is found again by JAX's
    own cache: the net, kit, config, optimizer, grads and α are its static arguments.
    """
    require_net(net, "train.make_step")
    if grads not in ("rendered", "autodiff"):
        raise ValueError(f"make_step: grads must be 'rendered' or 'autodiff', got {grads!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"make_step: label_smoothing must lie in [0, 1], got {label_smoothing!r}")
    if not isinstance(opt, Optimizer):
        raise ValueError(f"make_step: opt must be a train.Optimizer (train.make_optimizer(name)), "
                         f"got {type(opt).__name__}")
    statics = (net, kit, cfg, opt, grads, float(label_smoothing))
    if not jit:
        return functools.partial(_step, *statics)
    fn = _quick_step if quick else _jitted_step

    def ordered_step(state: TrainState, x, targets, lr):
        new, metrics = fn(*statics, state, x, targets, lr)
        return _in_order_of(new, state), metrics
    return ordered_step


def _in_order_of(tree, template):
    """`tree` with every dict's keys in `template`'s order: jit hands dicts back sorted by key, and
    `list(params)` is the signature order."""
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_in_order_of(a, b) for a, b in zip(tree, template)))
    if isinstance(template, Mapping):
        return {k: _in_order_of(tree[k], template[k]) for k in template}
    return tree


# ---- evaluation: precise BatchNorm statistics ----------------------------------------------------
#
# The running statistics move by 1% a step (momentum 0.01, kept as upstream has it; they lie
# downstream of the tied raw gradient nodes): after s steps they still hold 0.99^s of where they started and lag far behind weights
# that change fast early on (0.99^88 ≈ 41% after four epochs of digits at batch 64). Reading test
# accuracy through them measures that lag, not the model. Before each evaluation we therefore
# recompute every BN layer's population statistics with the current weights over a fixed set of
# training batches ("precise BN", as in Wu & Johnson, "Rethinking 'Batch' in BatchNorm", 2021) and
# evaluate with those; the running ones are evaluated too, and the gap is logged. Test images
# never normalise with their own batch's statistics.

PRECISE_BATCHES = 16    # training batches the population statistics are recomputed over
_PRECISE_STREAM = 2**31 - 1   # the fold_in tag of the key that fixes which batches those are

@functools.partial(jax.jit, static_argnums=(0, 1))
def _eval_logits(net, cfg, params, running, x):
    return net.forward_eval(params, running, x, cfg)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _batch_stats(net, cfg, params, x):
    return net.batch_stats(net.forward(params, x, cfg)[1])


def precise_statistics(net, cfg, params: Params, x, *, batch: int, batches: int = PRECISE_BATCHES,
                       seed: int = 0) -> dict[str, jax.Array]:
    """Every BN layer's population statistics over `batches` fixed training batches of `batch`.

    Each batch runs the train-mode forward with the current weights (every layer normalised with
    its batch's statistics, as in training); per layer, the batches' means and biased variances
    are combined with Chan's rule for equal counts, μ = mean_b μ_b and σ² = mean_b[σ_b² + (μ_b − μ)²],
    which is the mean and variance over all the cells of all the batches. The batches are the first
    `batches` of one permutation of x fixed by the seed (no augmentation), the same at every call;
    if x holds fewer full batches, all of them. Returns a dict shaped like the running statistics.
    """
    op = "train.precise_statistics"
    batch = data_._positive_int(op, "batch", batch)
    batches = data_._positive_int(op, "batches", batches)
    n = len(x)
    k = min(batches, n // batch)
    if k == 0:
        raise ValueError(f"{op}: {n} training images make no full batch of {batch}")
    order = np.asarray(jax.random.permutation(
        jax.random.fold_in(jax.random.key(seed), _PRECISE_STREAM), n))[:k * batch]
    dtype = next(iter(params.values())).dtype
    per_batch = [_batch_stats(net, cfg, params, jnp.asarray(x[order[i * batch:(i + 1) * batch]], dtype))
                 for i in range(k)]
    return combine_statistics(per_batch)


def combine_statistics(per_batch: Sequence[Mapping]) -> dict[str, jax.Array]:
    """Batches' BN statistics (equal counts) -> the statistics over all their cells: per layer
    μ = mean_b μ_b and σ² = mean_b[σ_b² + (μ_b − μ)²] (Chan's rule), in the statistics' dtype."""
    out = {}
    for name in per_batch[0]:
        if name.endswith(".running_var"):
            continue
        base = name[:-len("running_mean")]
        means = jnp.stack([b[name] for b in per_batch])
        variances = jnp.stack([b[base + "running_var"] for b in per_batch])
        mean = jnp.mean(means, axis=0)
        out[name] = mean
        out[base + "running_var"] = jnp.mean(variances + jnp.square(means - mean), axis=0)
    return {name: out[name] for name in per_batch[0]}


def evaluate(net, cfg, state: TrainState, x, labels, batch: int = 256, *,
             running: Optional[Mapping] = None) -> float:
    """Top-1 accuracy of the eval-mode net on (x, labels): every BN normalises with fixed statistics,
    `running` when given (e.g. `precise_statistics`), else the state's running averages.

    The last chunk is padded to the chunk size (eval mode treats examples independently), so one
    compiled forward serves every chunk.
    """
    return evaluate_topk(net, cfg, state, x, labels, batch, running=running)[0]


TOP_K = 5     # the second accuracy every evaluation reports: the label among the 5 largest logits


def hits(logits: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """(top-1, top-5) hits of host logits [n,K] against int labels [n]: top-1 is the first largest
    logit's class (argmax); top-5 counts a label with fewer than 5 classes scored above it."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    top1 = int(np.sum(np.argmax(logits, axis=1) == labels))
    above = np.sum(logits > np.take_along_axis(logits, labels[:, None], axis=1), axis=1)
    return top1, int(np.sum(above < TOP_K))


def evaluate_topk(net, cfg, state: TrainState, x, labels, batch: int = 256, *,
                  running: Optional[Mapping] = None) -> tuple[float, float]:
    """(top-1, top-5) accuracy of the eval-mode net on (x, labels), as `evaluate` reads them."""
    batch = data_._positive_int("train.evaluate", "batch", batch)
    n = len(labels)
    if n == 0 or len(x) != n:
        raise ValueError(f"train.evaluate: need as many labels as images (and at least one), "
                         f"got {len(x)} images and {n} labels")
    stats = state.running if running is None else running
    dtype = next(iter(state.params.values())).dtype
    chunk = min(batch, n)
    labels = np.asarray(labels)
    correct = top5 = 0
    for start in range(0, n, chunk):
        xb = np.asarray(x[start:start + chunk])
        m = len(xb)
        if m < chunk:
            xb = np.concatenate([xb, np.zeros((chunk - m,) + xb.shape[1:], xb.dtype)])
        logits = _eval_logits(net, cfg, state.params, stats, jnp.asarray(xb, dtype))
        one, five = hits(np.asarray(logits)[:m], labels[start:start + m])
        correct, top5 = correct + one, top5 + five
    return correct / n, top5 / n


# ---- checkpoints ---------------------------------------------------------------------------------
#
# One file, `checkpoint.npz`: every tensor of the state under "params/…", "opt_state/…",
# "running/…", "step", plus "meta", a JSON string with the per-epoch history and the partial sums
# of the epoch in progress (so a run stopped mid-epoch resumes mid-epoch). It is written to a
# temporary file and renamed over the old one: a run killed at any moment leaves the last good
# checkpoint whole.

def _flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: np.asarray(tree)}


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


def save_checkpoint(out, state: TrainState, meta: Mapping) -> Path:
    """Write `out/checkpoint.npz` (the state's tensors and `meta` as JSON) atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    flat = _flatten(state._asdict())
    flat["meta"] = np.asarray(json.dumps(meta))
    file = out / CHECKPOINT
    tmp = out / (CHECKPOINT + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **flat)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    return file


def checkpoint_params(path, net) -> tuple[dict, dict]:
    """(params, Config overrides) from a training checkpoint (`gradtie train`'s checkpoint.npz, or a
    folder holding one, or a run folder of orbax checkpoints: the latest; or an .npz of state_dict
    names). One-line errors name the file and what is wrong."""
    file = Path(path)
    if file.is_dir() and not (file / CHECKPOINT).is_file() and (file / "checkpoints").is_dir():
        from . import checkpoints   # a run's orbax checkpoints: the latest one's parameters
        return _named_params(net, file, checkpoints.read_params(file))
    if file.is_dir():
        file = file / "checkpoint.npz"
    if not file.is_file():
        raise FileNotFoundError(f"weights {str(path)!r}: no such checkpoint (expected a .npz file or a "
                                f"folder holding checkpoint.npz)")
    try:
        with np.load(file, allow_pickle=False) as z:
            flat = {k: z[k] for k in z.files}
    except Exception:  # a truncated or foreign file, or one holding Python objects
        raise ValueError(f"weights {str(file)!r}: not a readable .npz checkpoint of arrays") from None
    params = {k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")} or flat
    return _named_params(net, file, params)


def tensor_distances(a: Mapping, b: Mapping, skip=()) -> dict[str, float]:
    """max|a − b| / max|b|, tensor by tensor of `b` (host arrays or device arrays; names in `skip`
    left out, e.g. the conv biases behind BatchNorm, which are 0 in ℝ and round-off only)."""
    out = {}
    for k, ref in b.items():
        if k in skip:
            continue
        x, y = np.asarray(a[k], np.float64), np.asarray(ref, np.float64)
        out[k] = float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), np.finfo(np.float64).tiny))
    return out


def _named_params(net, file: Path, params: dict) -> tuple[dict, dict]:
    """A checkpoint's tensors in the net's signature order, and the Config its shapes imply."""
    overrides = net.config_overrides(params)   # the Config the tensors imply (`Net.config_of_params`)
    names = [spec.name for spec in net.param_specs(net.config(**overrides))]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"weights {str(file)!r}: lacks {missing[0]} ({len(missing)} of {net.name}'s tensors "
                         f"missing): a checkpoint of another net?")
    return {n: params[n] for n in names}, overrides


def load_checkpoint(out, template: TrainState) -> tuple[TrainState, dict]:
    """The state saved in `out` and its meta record.

    Every tensor is checked against `template` in signature order (params, optimizer state,
    running statistics, step); the first one missing, extra or of another shape or dtype is a
    one-line ValueError naming the file and the tensor. An unreadable file is a ValueError naming
    the file; a missing one a FileNotFoundError.
    """
    file = Path(out) / CHECKPOINT
    if not file.is_file():
        raise FileNotFoundError(f"no checkpoint in {str(out)!r}: expected {CHECKPOINT}")
    try:
        with np.load(file, allow_pickle=False) as z:
            flat = {k: z[k] for k in z.files}
        meta = json.loads(str(flat.pop("meta")))
    except Exception as err:  # truncated zip, bad CRC, no meta, bad JSON: one meaning to the reader
        raise ValueError(f"checkpoint {str(file)!r} is not a readable gradtie checkpoint "
                         f"({_one_line(err)})") from err
    want = _flatten(template._asdict())
    for key, ref in want.items():
        if key not in flat:
            raise ValueError(f"checkpoint {str(file)!r}: first mismatching tensor {key!r} is missing "
                             f"(was it written for another net or optimizer?)")
        got = flat[key]
        if (got.shape, got.dtype) != (ref.shape, ref.dtype):
            raise ValueError(f"checkpoint {str(file)!r}: first mismatching tensor {key!r} is "
                             f"{got.dtype} {got.shape}, this run expects {ref.dtype} {ref.shape}")
    extra = [k for k in flat if k not in want]
    if extra:
        raise ValueError(f"checkpoint {str(file)!r}: first mismatching tensor {extra[0]!r} is not "
                         f"in this run's state (was it written for another net or optimizer?)")

    def rebuild(tree, prefix=""):
        if isinstance(tree, Mapping):
            return {k: rebuild(v, f"{prefix}{k}/") for k, v in tree.items()}
        return jnp.asarray(flat[prefix[:-1]])

    return TrainState(**rebuild(template._asdict())), meta


# ---- the run: its configuration, run.json, metrics.jsonl, checkpoints, resume ---------------------

@dataclass(frozen=True)
class FitConfig:
    """A training run: what `run.json` records and a resume must match.

    optimizer: a name of `OPTIMIZERS`; lr: its base rate (None: `DEFAULT_LR[optimizer]`).
    epochs: the run's total, which fixes the cosine schedule (None: 1, or the recorded total when
    resuming). schedule: "cosine" (one cycle, `warmup_epochs` of linear warmup) or "constant".
    grads: "rendered" or "autodiff" (`make_step`). label_smoothing: α (None: the net's default,
    `default_label_smoothing`). flip: random left–right flips (None: where they keep the class,
    `data.flips_keep_class`). mix: None, "mixup" or "cutmix". seed: the init, the batch order and
    the augmentations. dtype: "float32" or "float64". precise_batches: the training batches the BN
    statistics are recomputed over before each evaluation; eval_batch: the evaluation's chunk size
    (not recorded: it changes no accuracy).

    Scale (`gradtie train --replicas`, `gradtie.cluster`): replicas is R, the devices of each
    process the run trains on; `batch` is then each replica's N, and the global batch is N·R·P over
    P processes. R·P = 1 is the single-device step (`make_step`); more is the synchronised-BN
    data-parallel step (`parallel.make_step`) on the data mesh, at the same global batch the same
    run up to round-off; sync_bn=False normalises each replica with its own N examples instead
    (per-replica BatchNorm: another function of the weights). checkpoints: "npz" (one file, `checkpoint.npz`) or "orbax" (asynchronous,
    sharded, the last `keep` and the best kept: `gradtie.checkpoints`); None picks npz for a
    single-device run on in-memory data and orbax otherwise. workers: the input pipeline's worker
    processes for an image folder (`gradtie.pipeline`); keep and workers are not recorded.
    """
    optimizer: str = "sgd"
    lr: Optional[float] = None
    epochs: Optional[int] = None
    batch: int = 128
    schedule: str = "cosine"
    warmup_epochs: int = 0
    grads: str = "rendered"
    label_smoothing: Optional[float] = None
    flip: Optional[bool] = None
    mix: Optional[str] = None
    seed: int = 0
    dtype: str = "float32"
    precise_batches: int = PRECISE_BATCHES
    eval_batch: int = 256
    replicas: int = 1
    sync_bn: bool = True
    checkpoints: Optional[str] = None
    keep: int = 3
    workers: int = 0

    def __post_init__(self):
        op = "train.FitConfig"
        _known_optimizer(op, self.optimizer)
        for name in ("replicas", "keep"):
            data_._positive_int(op, name, getattr(self, name))
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"{op}: workers must be a non-negative integer, got {self.workers!r}")
        if self.checkpoints not in (None, *CHECKPOINT_FORMATS):
            raise ValueError(f"{op}: checkpoints must be None, {' or '.join(map(repr, CHECKPOINT_FORMATS))}, "
                             f"got {self.checkpoints!r}")
        if self.lr is not None and not (math.isfinite(float(self.lr)) and self.lr > 0):
            raise ValueError(f"{op}: lr must be a positive number, got {self.lr!r}")
        if self.epochs is not None:
            data_._positive_int(op, "epochs", self.epochs)
        for name in ("batch", "precise_batches", "eval_batch"):
            data_._positive_int(op, name, getattr(self, name))
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"{op}: schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        w = self.warmup_epochs
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"{op}: warmup_epochs must be a non-negative integer, got {w!r}")
        if self.grads not in ("rendered", "autodiff"):
            raise ValueError(f"{op}: grads must be 'rendered' or 'autodiff', got {self.grads!r}")
        if self.label_smoothing is not None and not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"{op}: label_smoothing must lie in [0, 1], got {self.label_smoothing!r}")
        if self.mix not in (None, "mixup", "cutmix"):
            raise ValueError(f"{op}: mix must be None, 'mixup' or 'cutmix', got {self.mix!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"{op}: dtype must be 'float32' or 'float64', got {self.dtype!r}")


def default_label_smoothing(net) -> float:
    """The net's own α (`Net.label_smoothing`): 0.1 for ResNet-34 (the ImageNet recipe), 0 for
    cifar8 (the book's convention) and by default."""
    return float(net.label_smoothing)


class _Plan(NamedTuple):
    """A run laid out: the config with every default resolved, the data, the optimizer, the key,
    and where it runs (the data mesh over R·P devices, or None for one device)."""
    config: FitConfig          # lr, label_smoothing and flip filled in; epochs: the requested total or None
    split: Optional[data_.Split]     # in-memory data (None for an image folder)
    data_name: str
    num_classes: int
    steps_per_epoch: int
    opt: Optimizer
    key: jax.Array
    folder: Any = None         # a `gradtie.folder.Folder` (None for in-memory data)
    image_size: int = 0
    mesh: Any = None           # the data mesh (None: one device)
    processes: int = 1

    @property
    def devices(self) -> int:
        """R·P: the replicas of the whole run."""
        return self.config.replicas * self.processes

    @property
    def global_batch(self) -> int:
        return self.config.batch * self.devices

    @property
    def n_train(self) -> int:
        return len(self.split.y_train) if self.folder is None else len(self.folder.train)

    @property
    def n_test(self) -> int:
        return len(self.split.y_test) if self.folder is None else len(self.folder.val)

    @property
    def dtype(self):
        return jnp.dtype(self.config.dtype)

    def init_params(self, net: Net, cfg) -> Params:
        return {k: v.astype(self.dtype) for k, v in net.init(jax.random.fold_in(self.key, 0), cfg).items()}

    def batches(self, epoch: int, start: int = 0):
        """The global batches of an epoch from `start` on (in-memory data; flips and mixes drawn on
        the global batch, so a mesh run sees what the single-device run at that batch sees)."""
        c = self.config
        return _batch_stream(self.split, batch=self.global_batch, key=self.key, epoch=epoch, start=start,
                             flip=c.flip, mix=c.mix, num_classes=self.num_classes, dtype=self.dtype)


def _plan(op: str, net: Net, cfg, dataset, config: FitConfig, *, image_size: Optional[int] = None) -> _Plan:
    if not isinstance(config, FitConfig):
        raise ValueError(f"{op}: config must be a train.FitConfig, got {type(config).__name__}")
    if config.dtype == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(f"{op}: dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
    from .folder import Folder
    if isinstance(dataset, Folder):
        return _folder_plan(op, net, cfg, dataset, config, image_size)
    if config.replicas * jax.process_count() > 1 or config.checkpoints == "orbax":
        return _scaled(op, _array_plan(op, net, cfg, dataset, dataclasses.replace(
            config, batch=config.batch * config.replicas * jax.process_count())), config)
    plan = _array_plan(op, net, cfg, dataset, config)
    return plan._replace(config=dataclasses.replace(plan.config, checkpoints="npz"))


def _array_plan(op: str, net: Net, cfg, dataset, config: FitConfig) -> _Plan:
    """In-memory data on one device: the plan every run had before meshes (kept as it was, so that
    a single-device run is the same run bit for bit)."""
    split = dataset.split if isinstance(dataset, data_.Dataset) else data_.Split(*dataset)
    data_name = dataset.name if isinstance(dataset, data_.Dataset) else "split"
    num_classes = getattr(cfg, "num_classes", None)
    if isinstance(dataset, data_.Dataset) and num_classes is not None and num_classes != dataset.num_classes:
        raise ValueError(f"{op}: the net has {num_classes} classes but {dataset.name!r} has "
                         f"{dataset.num_classes}; build the config with num_classes={dataset.num_classes}")
    num_classes = num_classes or int(max(split.y_train.max(), split.y_test.max())) + 1
    steps_per_epoch = len(split.y_train) // config.batch
    if steps_per_epoch == 0:
        raise ValueError(f"{op}: {len(split.y_train)} training examples make no full batch of {config.batch}")
    config = dataclasses.replace(
        config, lr=float(DEFAULT_LR[config.optimizer] if config.lr is None else config.lr),
        label_smoothing=float(default_label_smoothing(net) if config.label_smoothing is None
                              else config.label_smoothing),
        flip=data_.flips_keep_class(data_name) if config.flip is None else bool(config.flip))
    return _Plan(config, split, data_name, num_classes, steps_per_epoch, make_optimizer(config.optimizer),
                 jax.random.key(config.seed), image_size=int(split.x_train.shape[-1]))


def _scaled(op: str, plan: _Plan, config: FitConfig) -> _Plan:
    """A plan laid out at the global batch, put back at the per-replica batch with its mesh."""
    from . import cluster
    c = dataclasses.replace(plan.config, batch=config.batch)
    processes = jax.process_count()
    mesh = cluster.mesh(cluster.local_replicas(config.replicas)) if config.replicas * processes > 1 else None
    return plan._replace(config=_resolved_format(op, c, processes, in_memory=True), mesh=mesh, processes=processes)


def _resolved_format(op: str, c: FitConfig, processes: int, *, in_memory: bool) -> FitConfig:
    if c.replicas * processes > 1 and c.grads != "rendered":
        raise ValueError(f"{op}: the data-parallel step is the rendered one; grads={c.grads!r} runs on one "
                         f"device (replicas 1, one process)")
    if c.replicas * processes == 1 and not c.sync_bn:
        raise ValueError(f"{op}: sync_bn=False (per-replica BatchNorm) needs more than one replica")
    fmt = c.checkpoints or ("npz" if in_memory and c.replicas * processes == 1 else "orbax")
    if fmt == "npz" and processes > 1:
        raise ValueError(f"{op}: a run on {processes} processes writes orbax checkpoints (every process its "
                         f"shards); checkpoints='npz' is one file from one process")
    return dataclasses.replace(c, checkpoints=fmt)


def _folder_plan(op: str, net: Net, cfg, folder, config: FitConfig, image_size: Optional[int]) -> _Plan:
    """An image folder read through `gradtie.pipeline`, on one device or the mesh."""
    from . import cluster
    if image_size is None:
        raise ValueError(f"{op}: an image folder needs the image side the pipeline crops to (image_size)")
    data_._positive_int(op, "image_size", image_size)
    if config.mix is not None:
        raise ValueError(f"{op}: mixup and cutmix are drawn on in-memory batches; an image folder trains "
                         f"with random resized crops and flips (mix=None)")
    num_classes = getattr(cfg, "num_classes", None)
    if num_classes is not None and num_classes != len(folder.classes):
        raise ValueError(f"{op}: the net has {num_classes} classes but the folder {str(folder.path)!r} has "
                         f"{len(folder.classes)}; build the config with num_classes={len(folder.classes)}")
    processes = jax.process_count()
    replicas = cluster.local_replicas(config.replicas)
    global_batch = config.batch * replicas * processes
    steps_per_epoch = len(folder.train) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"{op}: {len(folder.train)} training images in {str(folder.path)!r} make no full "
                         f"global batch of {global_batch}")
    config = dataclasses.replace(
        config, lr=float(DEFAULT_LR[config.optimizer] if config.lr is None else config.lr),
        label_smoothing=float(default_label_smoothing(net) if config.label_smoothing is None
                              else config.label_smoothing),
        flip=True if config.flip is None else bool(config.flip))
    config = _resolved_format(op, config, processes, in_memory=False)
    mesh = cluster.mesh(replicas) if replicas * processes > 1 else None
    return _Plan(config, None, f"folder:{folder.path}", len(folder.classes), steps_per_epoch,
                 make_optimizer(config.optimizer), jax.random.key(config.seed), folder=folder,
                 image_size=int(image_size), mesh=mesh, processes=processes)


def _first_segment(plan: _Plan) -> list[dict]:
    """The schedule of a new run: one cycle over its epochs (resuming may add more: `_resumed_run`)."""
    c, spe = plan.config, plan.steps_per_epoch
    total = (c.epochs or 1) * spe
    return [{"first": 0, "steps": total, "lr": c.lr, "warmup_steps": min(c.warmup_epochs * spe, total)}]


def _run_record(net: Net, cfg, plan: _Plan) -> dict:
    """What run.json holds (before the environment is added): the run, as JSON reads it back."""
    c, spe = plan.config, plan.steps_per_epoch
    data = {"name": plan.data_name, "image_size": plan.image_size, "n_train": plan.n_train, "n_test": plan.n_test,
            "num_classes": int(plan.num_classes),
            "fingerprint": fingerprint(plan.split) if plan.folder is None else plan.folder.fingerprint()}
    if plan.folder is not None:     # label k is classes[k]: the sorted class folder names
        data.update(classes=list(plan.folder.classes), split=plan.folder.split)
    run = {
        "net": net.name, "config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg),
        "data": data,
        "optimizer": plan.opt.name, "hyper": plan.opt.hyper, "lr": c.lr, "schedule": c.schedule,
        "warmup_epochs": c.warmup_epochs, "epochs": c.epochs or 1, "batch": c.batch, "steps_per_epoch": spe,
        "grads": c.grads, "label_smoothing": c.label_smoothing, "flip": c.flip, "mix": c.mix, "seed": c.seed,
        "dtype": c.dtype, "precise_batches": c.precise_batches, "running_momentum": RUNNING_MOMENTUM,
        "segments": _first_segment(plan),
        "replicas": plan.devices, "processes": plan.processes, "global_batch": plan.global_batch,
        "sync_bn": bool(c.sync_bn), "checkpoints": c.checkpoints or "npz",
    }
    return json.loads(json.dumps(run))       # tuples become lists, as run.json reads back


# what a run recorded before meshes and orbax checkpoints ran on one device, in one process, into checkpoint.npz
LEGACY_RUN = {"replicas": 1, "processes": 1, "sync_bn": True, "checkpoints": "npz"}


def fingerprint(split: data_.Split) -> str:
    """A short SHA-256 of the split's arrays (dtype, shape, bytes): a resumed run reads the same data."""
    h = hashlib.sha256()
    for a in split:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _batch_stream(split: data_.Split, *, batch: int, key: jax.Array, epoch: int, start: int,
                  flip: bool, mix: Optional[str], num_classes: int, dtype):
    """Epoch `epoch`'s batches from index `start` on: (i, x, targets). The order and the flips and
    mixes depend on (seed, epoch, i) only, so a resumed run sees exactly the batches it would have."""
    k_batch, k_flip, k_mix = jax.random.split(jax.random.fold_in(key, epoch + 1), 3)
    for i, (xb, yb) in enumerate(data_.batches(split.x_train, split.y_train, batch, key=k_batch)):
        if i < start:
            continue
        xb = jnp.asarray(xb, dtype)
        if flip:
            xb = data_.augment_flip(xb, jax.random.fold_in(k_flip, i))
        targets = jnp.asarray(yb)
        if mix is not None:
            mixer = data_.mixup if mix == "mixup" else data_.cutmix
            m = mixer(xb, head.one_hot(targets, num_classes, dtype=dtype), jax.random.fold_in(k_mix, i))
            xb, targets = m.x, m.targets
        yield i, xb, targets


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient left the finite floats; the run stopped before saving that state."""


class FitResult(NamedTuple):
    state: TrainState
    history: list[dict]                       # one record per epoch, as in metrics.jsonl
    precise: Optional[dict[str, jax.Array]]   # the last evaluation's recomputed BN statistics
    out: Optional[Path]


class _Progress(NamedTuple):
    """What a checkpoint records, replaced as one value after each step (a Ctrl-C between two
    statements never leaves the state and the epoch's sums out of step with each other)."""
    state: TrainState
    step: int
    sums: dict          # loss, accuracy, seconds (the loop), step_seconds and step_images (the step alone,
                        # its compiling first call left out), lr of the epoch in progress
    history: list

    def meta(self) -> dict:
        return {"sums": self.sums, "history": self.history}


def _zero_sums() -> dict:
    return {"loss": 0.0, "accuracy": 0.0, "seconds": 0.0, "lr": 0.0, "step_seconds": 0.0, "step_images": 0}


def fit(net, cfg, dataset, config: FitConfig = FitConfig(), *,
        out=None, resume: bool = False, extend_epochs: int = 0, stop_after: Optional[int] = None,
        progress: bool = True, log: Optional[Callable[[str], None]] = None, force: bool = False,
        image_size: Optional[int] = None) -> FitResult:
    """Train `net` on a dataset's train split as `config` says; after each epoch evaluate on its
    test split twice: with BN statistics recomputed over `config.precise_batches` training batches
    (`test_accuracy`, and `test_top5`) and with the running statistics the tied step keeps
    (`test_accuracy_running`).

    Lean: each step is the rendered train step whose raw gradient nodes `cifar8Bbn_train_step_tiedB`
    (cifar8-BN) and `r34_net_tiedB` (ResNet-34) tie to each op's derivative at the cotangent the
    chain hands it; that they are the loss's gradient is `cifar8Bbn_net_lossGrad`'s and
    `r34_net_lossGrad`'s, under their smooth-point hypotheses. On R·P > 1 devices the step is the
    synchronised-BN one whose all-reduced nodes are `r34_net_syncTiedB`'s. Training accuracy itself
    goes beyond what the suite states. Shown in: Training with the rendered step.

    dataset: a `data.Dataset` or `data.Split` (in memory), or a `folder.Folder` (an image folder,
    read through `gradtie.pipeline` at `image_size` px in `config.workers` worker processes).
    config.replicas > 1, or several processes (`gradtie.cluster`): the data-parallel step on the
    mesh at the global batch N·R·P; evaluation and the precise statistics run on the mesh too.

    With `out`, the run writes there (process 0 the files, every process its checkpoint shards):
      run.json       the full configuration (net, data fingerprint and classes, optimizer, schedule
                     segments, replicas and processes …);
      metrics.jsonl  one JSON object per epoch, appended (epoch, step, loss, train_accuracy,
                     test_accuracy, test_top5, test_accuracy_running, bn_gap, lr, seconds,
                     step_seconds, eval_seconds, devices, images_per_second (the whole loop,
                     compiling included) and step_images_per_second (the step alone, its first call
                     in the process left out: null for an epoch of that one step), in total and per
                     device; for a folder skipped_images);
      checkpoints    `checkpoint.npz` written atomically, or orbax's `checkpoints/<step>/` written
                     asynchronously (`config.checkpoints`), after every epoch and on Ctrl-C
                     (KeyboardInterrupt, which is then re-raised).
    resume=True continues the run in `out` exactly (same schedule, data order, optimizer state,
    the input pipeline's position): any other configuration is a ValueError naming the field, and
    another device or process count one naming both counts; a different `config.epochs` too,
    unless `extend_epochs` > 0 adds that many epochs as a new cosine cycle after the recorded total.
    stop_after=E stops once E epochs of the run are done (the schedule still spans the run).
    A non-empty `out` that holds no run is refused (nothing of it is overwritten) unless `force`.
    A NaN or Inf loss or gradient raises NonFiniteLoss naming the step; the last checkpoint stays.
    progress: a bar per epoch on a terminal's stderr (loss, images/s). log: called with one line
    per epoch and with notes (a skipped file); the CLI prints them.
    """
    op = "train.fit"
    require_net(net, "train.fit")
    if isinstance(extend_epochs, bool) or not isinstance(extend_epochs, int) or extend_epochs < 0:
        raise ValueError(f"{op}: extend_epochs must be a non-negative integer, got {extend_epochs!r}")
    if stop_after is not None:
        stop_after = data_._positive_int(op, "stop_after", stop_after)
    if (resume or extend_epochs) and out is None:
        raise ValueError(f"{op}: resume and extend_epochs need the run's folder (out)")
    if extend_epochs and not resume:
        raise ValueError(f"{op}: extend_epochs extends a run being resumed; pass resume=True")
    plan = _plan(op, net, cfg, dataset, config, image_size=image_size)
    c = plan.config
    where = _OneDevice(net, cfg, plan) if plan.mesh is None else _OnMesh(net, cfg, plan)
    fresh = where.place(init_state(net, cfg, plan.init_params(net, cfg), plan.opt))
    out = None if out is None else Path(out)
    primary = jax.process_index() == 0
    log = log if primary else None
    run, live, data_state, store = _open_run(op, out, _run_record(net, cfg, plan), fresh, resume, c.epochs,
                                             extend_epochs, force, c)
    total = run["epochs"]
    if resume and len(live.history) >= total and log is not None:
        log(f"the run in {str(out)!r} is finished ({total} epochs); its results are in {out / METRICS} "
            f"(add epochs with --extend-epochs N)")
    sched = _segments_schedule(c.schedule, run["segments"])
    step_fn = where.step_fn()
    feed = _ArrayFeed(plan) if plan.folder is None else _FolderFeed(plan, total, log)
    precise, warm = None, {"compiled": False}
    try:
        feed.seek(live.step, data_state)
        while len(live.history) < min(total, stop_after or total):
            for live in _epoch(plan, where, feed, step_fn, sched, live, total, out, store, fresh,
                               progress and primary, warm):
                pass    # `live` follows every step taken: a Ctrl-C saves the last one
            live, precise = _evaluated(net, cfg, plan, where, feed, live)
            if store is not None:
                store.save(live, feed.state_at(live.step), {"test_accuracy": live.history[-1]["test_accuracy"]})
                if primary:
                    with open(out / METRICS, "a") as f:
                        f.write(json.dumps(live.history[-1]) + "\n")
            if log is not None:
                log(epoch_line(live.history[-1], total))
    except KeyboardInterrupt:
        if store is not None:
            store.save(live, feed.state_at(live.step))
            store.wait()
        raise
    finally:
        feed.close()
        if store is not None:
            store.close()
    return FitResult(live.state, live.history, precise, out)


def _epoch(plan: _Plan, where, feed, step_fn, sched, live: _Progress, total: int, out: Optional[Path], store,
           fresh: TrainState, progress: bool, warm: dict) -> Iterator[_Progress]:
    """The steps left of the epoch in progress, one `_Progress` after each. The bar shows the loss
    and the images a second of the whole loop (input included) and of the step alone (after the
    step's first call in the process, `warm["compiled"]`, which compiles it)."""
    spe = plan.steps_per_epoch
    epoch = len(live.history)
    done = live.step - epoch * spe                    # batches of this epoch already taken
    steps = bar(desc=f"epoch {epoch + 1}/{total}", total=spe, initial=done, enabled=progress)
    start, seconds0 = time.perf_counter(), live.sums["seconds"]
    stepping0, stepped0 = live.sums.get("step_seconds", 0.0), live.sums.get("step_images", 0)
    stepping, stepped = 0.0, 0
    try:
        for i, xb, targets in feed.batches(epoch, done):
            lr_now = sched(live.step)
            tic = time.perf_counter()
            state, metrics = where.step(step_fn, live.state, xb, targets, lr_now)
            loss, acc, gnorm, lr_seen = (float(where.host(metrics[k])) for k in ("loss", "accuracy", "grad_norm", "lr"))
            if warm["compiled"]:        # the step alone, its first call in this process (it compiles) left out
                stepping, stepped = stepping + time.perf_counter() - tic, stepped + plan.global_batch
            warm["compiled"] = True
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                raise _non_finite(loss, gnorm, live.step + 1, epoch, i, spe, float(lr_now), store, fresh)
            seconds = seconds0 + time.perf_counter() - start
            sums = {"loss": live.sums["loss"] + loss, "accuracy": live.sums["accuracy"] + acc,
                    "seconds": seconds, "lr": lr_seen, "step_seconds": stepping0 + stepping,
                    "step_images": stepped0 + stepped}
            if plan.folder is not None:     # files skipped in the epoch so far (a resume carries them on)
                sums["skipped_images"] = live.sums.get("skipped_images", 0) + feed.take_skipped()
            live = _Progress(state, live.step + 1, sums, live.history)
            steps.update(1)
            if steps.n % 10 == 0 or steps.n == spe:      # images a second, in total (and per device)
                rates = [(i + 1 - done) * plan.global_batch / max(seconds - seconds0, 1e-9),
                         stepped / stepping if stepped else math.nan]
                shown = [f"{r:.0f} img/s" + (f" ({r / plan.devices:.0f}/device)" if plan.devices > 1 else "")
                         for r in rates]
                steps.set_postfix(loss=f"{loss:.4f}", loop=shown[0], step=shown[1], refresh=False)
            yield live
    finally:
        steps.close()


def _non_finite(loss: float, gnorm: float, step: int, epoch: int, i: int, spe: int, lr: float,
                store, fresh: TrainState) -> NonFiniteLoss:
    """The error a NaN or Inf at `step` stops the run with, saying which checkpoint is left."""
    kept = store.kept(fresh) if store is not None else None
    kept = kept or "no checkpoint was written"
    return NonFiniteLoss(f"the loss is {loss} and the gradient norm {gnorm} at step {step} (epoch {epoch + 1}, "
                         f"batch {i + 1} of {spe}, lr {lr:.4g}); stopped, {kept}")


def _evaluated(net: Net, cfg, plan: _Plan, where, feed, live: _Progress) -> tuple[_Progress, dict]:
    """The epoch just trained, closed: evaluated with recomputed and with running statistics, its
    record appended to the history, the sums reset. Returns it and the recomputed statistics."""
    c, spe = plan.config, plan.steps_per_epoch
    tic = time.perf_counter()
    params = live.state.params
    if plan.folder is None and plan.mesh is None:     # in memory, one device: as it always was
        split = plan.split
        precise = precise_statistics(net, cfg, params, split.x_train, batch=c.batch,
                                     batches=c.precise_batches, seed=c.seed)
        test_acc, top5 = evaluate_topk(net, cfg, live.state, split.x_test, split.y_test, c.eval_batch,
                                       running=precise)
        test_running = evaluate(net, cfg, live.state, split.x_test, split.y_test, c.eval_batch)
    else:
        precise = where.place_statistics(combine_statistics(
            [where.batch_statistics(params, x) for x in feed.precise_batches()]))
        (test_acc, top5), (test_running, _) = where.accuracies(params, (precise, live.state.running),
                                                               feed.eval_chunks(c.eval_batch))
    s = live.sums
    seconds, images = s["seconds"], spe * plan.global_batch
    stepping, stepped = s.get("step_seconds", 0.0), s.get("step_images", 0)
    step_rate = stepped / stepping if stepped else None     # None: the epoch's one step compiled
    entry = {"epoch": len(live.history) + 1, "step": live.step,
             "loss": s["loss"] / spe, "train_accuracy": s["accuracy"] / spe,
             "test_accuracy": test_acc, "test_accuracy_running": test_running,
             "bn_gap": test_acc - test_running, "lr": s["lr"], "seconds": seconds,
             "eval_seconds": time.perf_counter() - tic,
             "images_per_second": images / max(seconds, 1e-9), "test_top5": top5,
             "step_seconds": stepping, "step_images_per_second": step_rate, "devices": plan.devices,
             "images_per_second_per_device": images / max(seconds, 1e-9) / plan.devices,
             "step_images_per_second_per_device": None if step_rate is None else step_rate / plan.devices}
    if plan.folder is not None:     # in the epoch's batches, its precise-BN batches and its evaluation
        entry["skipped_images"] = s.get("skipped_images", 0) + feed.take_skipped()
    return _Progress(live.state, live.step, _zero_sums(), live.history + [entry]), precise


def epoch_line(entry: Mapping, total: int) -> str:
    """One line per epoch: the figures metrics.jsonl records, rounded for reading."""
    top5 = f"top-5 {entry['test_top5']:.4f}; " if "test_top5" in entry else ""
    return (f"epoch {entry['epoch']}/{total} (step {entry['step']}): loss {entry['loss']:.4f}, "
            f"train accuracy {entry['train_accuracy']:.4f}, test accuracy {entry['test_accuracy']:.4f} "
            f"({top5}running statistics {entry['test_accuracy_running']:.4f}, gap {entry['bn_gap']:+.4f}), "
            f"lr {entry['lr']:.4g}, {entry['images_per_second']:.0f} images/s")


# ---- where the arrays live: one device, or the data mesh ---------------------------------------------

class _OneDevice:
    """A run on one device: `make_step`, statistics and evaluation of whole batches."""
    mesh = None

    def __init__(self, net: Net, cfg, plan: _Plan):
        self.net, self.cfg, self.plan = net, cfg, plan

    def step_fn(self):
        c = self.plan.config
        return make_step(self.net, self.cfg, self.plan.opt, grads=c.grads, label_smoothing=c.label_smoothing)

    def place(self, tree):
        return tree

    def host(self, v):
        return v

    def step(self, step_fn, state, x, targets, lr):
        if isinstance(x, np.ndarray):       # an image folder's batch: onto the device
            x, targets = to_device(x, self.plan.dtype), to_device(targets)
        return step_fn(state, x, targets, lr)

    def batch_statistics(self, params, x):
        return _batch_stats(self.net, self.cfg, params, to_device(x, self.plan.dtype))

    def place_statistics(self, stats):
        return stats

    def accuracies(self, params, stats_sets, chunks) -> list[tuple[float, float]]:
        counts, n = np.zeros((len(stats_sets), 2), np.int64), 0
        for x, labels, valid in chunks:
            keep = np.asarray(valid) > 0
            n += int(keep.sum())
            for j, stats in enumerate(stats_sets):
                logits = np.asarray(_eval_logits(self.net, self.cfg, params, stats, to_device(x, self.plan.dtype)))
                counts[j] += hits(logits[keep], np.asarray(labels)[keep])
        return _rates(counts, n)


def _rates(counts: np.ndarray, n: int) -> list[tuple[float, float]]:
    if n == 0:
        raise ValueError("train.evaluate: no test image could be read")
    return [(int(a) / n, int(b) / n) for a, b in counts]


class _OnMesh:
    """A run on the data mesh: `parallel.make_step` (synchronised BN) on the global batch, every
    process handing in its own rows; statistics and evaluation sharded the same way."""

    def __init__(self, net: Net, cfg, plan: _Plan):
        self.net, self.cfg, self.plan, self.mesh = net, cfg, plan, plan.mesh

    def step_fn(self):
        from . import parallel
        c = self.plan.config
        return parallel.make_step(self.net, self.cfg, self.plan.opt, mesh=self.mesh, label_smoothing=c.label_smoothing,
                                  sync_bn=c.sync_bn)

    def place(self, tree):
        from . import parallel
        return parallel.replicate(self.mesh, tree)

    def host(self, v):
        """A replicated value as this process holds it."""
        return np.asarray(v.addressable_data(0)) if isinstance(v, jax.Array) else v

    def step(self, step_fn, state, x, targets, lr):
        from . import parallel
        gx, gt = parallel.global_batch(self.mesh, (np.asarray(x, self.plan.dtype), np.asarray(targets)))
        return step_fn(state, gx, gt, np.asarray(lr))

    def batch_statistics(self, params, x):
        from . import parallel
        stats = _mesh_statistics_fn(self.net, self.cfg, self.mesh)(params, parallel.global_batch(
            self.mesh, np.asarray(x, self.plan.dtype)))
        return {k: v.addressable_data(0) for k, v in stats.items()}

    def place_statistics(self, stats):
        return self.place({k: np.asarray(v) for k, v in stats.items()})

    def accuracies(self, params, stats_sets, chunks) -> list[tuple[float, float]]:
        from . import parallel
        fn = _mesh_counts_fn(self.net, self.cfg, self.mesh)
        counts, n = np.zeros((len(stats_sets), 2), np.int64), 0
        for x, labels, valid in chunks:
            gx, gl, gv = parallel.global_batch(self.mesh, (np.asarray(x, self.plan.dtype), np.asarray(labels, np.int32),
                                                           np.asarray(valid, np.int32)))
            for j, stats in enumerate(stats_sets):
                counts[j] += [int(self.host(v)) for v in fn(params, stats, gx, gl, gv)]
            n += int(self.host(_mesh_sum_fn(self.mesh)(gv)))
        return _rates(counts, n)


@functools.lru_cache(maxsize=None)
def _mesh_statistics_fn(net, cfg, mesh):
    """BN batch statistics of the global batch (synchronised over the mesh), replicated."""
    from jax.sharding import PartitionSpec as P

    from . import parallel
    rcfg = parallel.replica_config(cfg, True)

    def stats(params, x):
        return jax.tree.map(parallel._global, net.batch_stats(net.forward(params, x, rcfg)[1]))

    return jax.jit(jax.shard_map(stats, mesh=mesh, in_specs=(P(), P(parallel.AXIS)), out_specs=P()))


@functools.lru_cache(maxsize=None)
def _mesh_counts_fn(net, cfg, mesh):
    """(top-1, top-5) hits among the valid rows of a sharded evaluation chunk, summed over the mesh."""
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from . import parallel

    def counts(params, stats, x, labels, valid):
        logits = net.forward_eval(params, stats, x, cfg)
        one = (jnp.argmax(logits, axis=1) == labels).astype(jnp.int32)
        above = jnp.sum(logits > jnp.take_along_axis(logits, labels[:, None], axis=1), axis=1)
        five = (above < TOP_K).astype(jnp.int32)
        return lax.psum(jnp.sum(valid * one), parallel.AXIS), lax.psum(jnp.sum(valid * five), parallel.AXIS)

    a = P(parallel.AXIS)
    return jax.jit(jax.shard_map(counts, mesh=mesh, in_specs=(P(), P(), a, a, a), out_specs=(P(), P())))


@functools.lru_cache(maxsize=None)
def _mesh_sum_fn(mesh):
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from . import parallel
    return jax.jit(jax.shard_map(lambda v: lax.psum(jnp.sum(v), parallel.AXIS), mesh=mesh,
                                 in_specs=P(parallel.AXIS), out_specs=P()))


# ---- what a run reads: in-memory arrays, or an image folder through the pipeline ------------------

class _ArrayFeed:
    """In-memory data: each global batch drawn as the single-device run at that batch draws it
    (`_Plan.batches`), this process keeping its rows; the order follows from the step alone."""

    def __init__(self, plan: _Plan):
        from . import cluster
        self.plan = plan
        self.rows = None if plan.mesh is None else cluster.rows(plan.global_batch)

    def seek(self, step: int, state) -> None:
        pass

    def batches(self, epoch: int, start: int):
        for i, xb, targets in self.plan.batches(epoch, start):
            yield (i, xb, targets) if self.rows is None else (i, xb[self.rows], targets[self.rows])

    def state_at(self, step: int) -> None:
        return None

    def precise_batches(self):
        """This process's rows of the fixed batches of the precise statistics (as `precise_statistics`
        picks them, at the global batch)."""
        c, split, g = self.plan.config, self.plan.split, self.plan.global_batch
        n = len(split.x_train)
        k = min(c.precise_batches, n // g)
        order = np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.key(c.seed), _PRECISE_STREAM), n))
        rows = self.rows or slice(0, g)
        for i in range(k):
            yield split.x_train[order[i * g:(i + 1) * g][rows]]

    def eval_chunks(self, eval_batch: int):
        """This process's rows of the test split in chunks of eval_batch rounded up to the devices,
        the last one padded (valid = 0 on padding)."""
        split, devices = self.plan.split, self.plan.devices
        g = -(-min(eval_batch, len(split.y_test)) // devices) * devices
        rows = self.rows_of(g)
        for start in range(0, len(split.y_test), g):
            x, y = split.x_test[start:start + g], split.y_test[start:start + g]
            valid = np.zeros(g, np.int32)
            valid[:len(y)] = 1
            pad = g - len(y)
            if pad:
                x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
                y = np.concatenate([y, np.zeros(pad, y.dtype)])
            yield x[rows], y[rows], valid[rows]

    def rows_of(self, g: int) -> slice:
        from . import cluster
        return slice(0, g) if self.plan.mesh is None else cluster.rows(g)

    def close(self) -> None:
        pass


class _FolderFeed:
    """An image folder through `gradtie.pipeline`: one reader over the run's epochs whose position
    is checkpointed; the precise-BN batches and the evaluation chunks read the same way."""

    def __init__(self, plan: _Plan, epochs: int, log: Optional[Callable[[str], None]]):
        from . import pipeline
        c, folder = plan.config, plan.folder
        self.plan, self.log = plan, log
        self.layout = pipeline.Layout(plan.global_batch, jax.process_index(), jax.process_count())
        self.train_files, self.val_files = pipeline.Files(folder.train), pipeline.Files(folder.val)
        self.reader = pipeline.Reader(self.train_files, size=plan.image_size, seed=c.seed,
                                      steps_per_epoch=plan.steps_per_epoch, epochs=epochs, layout=self.layout,
                                      workers=c.workers, dtype=c.dtype, flip=c.flip)
        self.skipped: set[tuple[str, int]] = set()
        self.epoch_skipped = 0
        self._before: Optional[tuple[int, dict]] = None
        if log is not None and folder.skipped_line():
            log(folder.skipped_line())

    def seek(self, step: int, state: Optional[dict]) -> None:
        self.reader.seek(step, state)

    def batches(self, epoch: int, start: int):
        want = epoch * self.plan.steps_per_epoch + start
        if self.reader.position != want:
            self.reader.seek(want)
        for i in range(start, self.plan.steps_per_epoch):
            self._before = (self.reader.position, self.reader.state())
            element = next(self.reader)
            self._note(element, self.train_files)
            yield i, element["image"], element["label"]

    def state_at(self, step: int) -> Optional[dict]:
        """The pipeline's state standing at global step `step` (None: unknown; a resume then seeks
        by position)."""
        if self.reader.position == step:
            return self.reader.state()
        if self._before is not None and self._before[0] == step:
            return self._before[1]
        return None

    def precise_batches(self):
        from . import pipeline
        c, g = self.plan.config, self.plan.global_batch
        k = min(c.precise_batches, len(self.train_files) // g)
        source = pipeline.PreciseBatches(self.train_files, self.plan.image_size, c.seed, self.layout)
        for element in pipeline.chunks(source, k, workers=c.workers, dtype=c.dtype):
            self._note(element, self.train_files)
            yield element["image"]

    def eval_chunks(self, eval_batch: int):
        from . import pipeline
        c, devices = self.plan.config, self.plan.devices
        n = len(self.val_files)
        g = -(-min(eval_batch, n) // devices) * devices
        layout = pipeline.Layout(g, self.layout.process_index, self.layout.process_count)
        source = pipeline.EvalChunks(self.val_files, self.plan.image_size, layout)
        for element in pipeline.chunks(source, -(-n // g), workers=c.workers, dtype=c.dtype):
            self._note(element, self.val_files)
            yield element["image"], element["label"], element["valid"]

    def _note(self, element: dict, files) -> None:
        """Count the files an element skipped; name the first one the run meets, once."""
        from . import pipeline
        for record in pipeline.skipped_records([element]):
            self.epoch_skipped += 1
            key = (files.path(record), record)
            if key not in self.skipped:
                if not self.skipped and self.log is not None:
                    path = files.path(record)
                    self.log(f"skipped {path}: {pipeline.why_unreadable(path)} (the run goes on without it; "
                             f"skipped images are counted in {METRICS})")
                self.skipped.add(key)

    def take_skipped(self) -> int:
        n, self.epoch_skipped = self.epoch_skipped, 0
        return n

    def close(self) -> None:
        self.reader.close()


# ---- where a run is stored: checkpoint.npz or orbax's checkpoints/ -----------------------------------

def _store(out: Path, fmt: str, keep: int):
    return _NpzStore(out) if fmt == "npz" else _OrbaxStore(out, keep)


class _NpzStore:
    """`checkpoint.npz`, one file written atomically (the pipeline's position, if any, in its meta)."""

    def __init__(self, out: Path):
        self.out = out

    def exists(self) -> bool:
        return (self.out / CHECKPOINT).exists()

    def load(self, template: TrainState) -> tuple[TrainState, dict, Optional[dict]]:
        state, meta = load_checkpoint(self.out, template)
        return state, meta, meta.get("data")

    def save(self, live: _Progress, data: Optional[dict], metrics: Optional[dict] = None) -> None:
        meta = live.meta()
        if data is not None:
            meta["data"] = data
        save_checkpoint(self.out, live.state, meta)

    def kept(self, fresh: TrainState) -> Optional[str]:
        if not self.exists():
            return None
        return (f"the last good checkpoint {str(self.out / CHECKPOINT)!r} "
                f"(step {int(load_checkpoint(self.out, fresh)[0].step)}) is kept")

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class _OrbaxStore:
    """orbax's `checkpoints/<step>/` (`gradtie.checkpoints`): asynchronous, sharded, last k and best."""

    def __init__(self, out: Path, keep: int):
        from . import checkpoints
        self.checkpoints = checkpoints.Checkpoints(out, keep=keep)

    def exists(self) -> bool:
        return self.checkpoints.exists()

    def load(self, template: TrainState) -> tuple[TrainState, dict, Optional[dict]]:
        got = self.checkpoints.restore(template)
        return got.state, got.meta, got.data

    def save(self, live: _Progress, data: Optional[dict], metrics: Optional[dict] = None) -> None:
        if self.checkpoints.latest_step() == live.step:
            return      # this step is saved already (an interrupt right after an epoch's checkpoint)
        self.checkpoints.save(live.step, live.state, live.meta(), data=data, metrics=metrics)

    def kept(self, fresh: TrainState) -> Optional[str]:
        self.checkpoints.wait()
        step = self.checkpoints.latest_step()
        if step is None:
            return None
        return f"the last good checkpoint {str(self.checkpoints.directory / str(step))!r} (step {step}) is kept"

    def wait(self) -> None:
        self.checkpoints.wait()

    def close(self) -> None:
        self.checkpoints.close()


# ---- resume ----------------------------------------------------------------------------------------

def _open_run(op: str, out: Optional[Path], run: dict, fresh: TrainState, resume: bool,
              epochs: Optional[int], extend_epochs: int, force: bool = False,
              config: Optional[FitConfig] = None) -> tuple[dict, _Progress, Optional[dict], Any]:
    """The run record to train under, where training stands, the pipeline's position and the
    checkpoint store: a new run (its folder prepared), or the run in `out` resumed from its
    checkpoint (its record checked against `run`, extended if asked, its metrics log reconciled
    with the checkpoint). Every process checks before any writes; process 0 writes."""
    from . import cluster
    live, data, store = _Progress(fresh, 0, _zero_sums(), []), None, None
    primary = jax.process_index() == 0
    if out is not None and (out / RUN).exists():
        if not resume:
            raise ValueError(f"{op}: {str(out)!r} already holds a run ({RUN}); pass resume=True "
                             f"(--resume) to continue it, or choose another folder")
        run = _resumed_run(op, out, run, epochs, extend_epochs)
        cluster.barrier("gradtie-run-read")
        store = _store(out, run["checkpoints"], config.keep if config else 3)
        if store.exists():
            state, meta, data = store.load(fresh)
            live = _Progress(state, meta_step(state), meta["sums"], meta["history"])
        if primary:
            _reconcile_metrics(out / METRICS, live.history)
    elif resume:
        read_run(out)                        # raises the clear "no run to resume" error
    elif out is not None:
        if out.exists() and not out.is_dir():
            raise ValueError(f"{op}: {str(out)!r} is a file, not a run folder")
        if out.is_dir() and any(out.iterdir()) and not force:
            raise ValueError(f"{op}: {str(out)!r} is not empty and holds no run ({RUN}); choose another "
                             f"folder, or pass force=True (--force) to train there anyway")
        cluster.barrier("gradtie-run-checked")
        if primary:
            out.mkdir(parents=True, exist_ok=True)
            (out / METRICS).unlink(missing_ok=True)
        cluster.barrier("gradtie-run-made")
        store = _store(out, run["checkpoints"], config.keep if config else 3)
    if out is not None:
        run["environment"] = {"jax": jax.__version__, "backend": jax.default_backend()}
        if primary:
            _atomic_write(out / RUN, json.dumps(run, indent=1) + "\n")
        cluster.barrier("gradtie-run-written")
    return run, live, data, store


def meta_step(state: TrainState) -> int:
    """The step a (possibly replicated, multi-process) train state stands at."""
    step = state.step
    if isinstance(step, jax.Array) and not step.is_fully_addressable:
        step = step.addressable_data(0)
    return int(np.asarray(step))


def _resumed_run(op: str, out: Path, requested: dict, epochs: Optional[int], extend_epochs: int) -> dict:
    """The recorded run, checked field by field against the requested one; extended if asked."""
    saved = {**LEGACY_RUN, **read_run(out)}
    saved.setdefault("global_batch", saved["batch"])
    was, now = (saved["replicas"], saved["processes"]), (requested["replicas"], requested["processes"])
    if was != now:
        raise ValueError(f"{op}: cannot resume the run in {str(out)!r} on {now[0]} device(s) in {now[1]} "
                         f"process(es): it was trained on {was[0]} device(s) in {was[1]} process(es), and its "
                         f"global batch, data order and checkpoints are laid out for them (resume with "
                         f"--replicas {was[0] // was[1]} on {was[1]} process(es))")
    for field in requested:
        if field in ("epochs", "segments"):
            continue
        if saved.get(field) != requested[field]:
            raise ValueError(f"{op}: cannot resume the run in {str(out)!r}: it was started with "
                             f"{field}={saved.get(field)!r}, this call asks for {requested[field]!r}")
    recorded = saved["epochs"]
    if extend_epochs:
        if epochs is not None and epochs not in (recorded, recorded + extend_epochs):
            raise ValueError(f"{op}: epochs={epochs} with extend_epochs={extend_epochs}: the run in "
                             f"{str(out)!r} has {recorded} epochs, so the new total is "
                             f"{recorded + extend_epochs}; leave epochs out")
        spe = saved["steps_per_epoch"]
        saved["segments"].append({"first": recorded * spe, "steps": extend_epochs * spe,
                                  "lr": saved["lr"], "warmup_steps": 0})
        saved["epochs"] = recorded + extend_epochs
    elif epochs is not None and epochs != recorded:
        raise ValueError(f"{op}: the run in {str(out)!r} has a schedule fixed by its total of {recorded} "
                         f"epochs; resuming with epochs={epochs} would change the steps already taken. "
                         f"Leave epochs out (or pass {recorded}), or add epochs with extend_epochs "
                         f"(--extend-epochs N: a new cosine cycle after epoch {recorded})")
    return saved


def _atomic_write(file: Path, text: str) -> None:
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, file)


def read_run(out) -> dict:
    """`out/run.json`, the full configuration of the run there (a clear error when absent or bad)."""
    file = Path(out) / RUN
    if not file.is_file():
        raise FileNotFoundError(f"no run to resume in {str(out)!r}: expected {RUN}")
    try:
        run = json.loads(file.read_text())
    except ValueError as err:
        raise ValueError(f"{str(file)!r} is not a readable run record ({_one_line(err)})") from err
    if not isinstance(run, dict) or "epochs" not in run or "segments" not in run:
        raise ValueError(f"{str(file)!r} is not a gradtie run record (no 'epochs' and 'segments')")
    return run


def resume_arguments(out) -> dict[str, Any]:
    """The `gradtie train` options a run in `out` was started with, read back from its run.json
    (so `gradtie train --out DIR --resume` needs nothing else)."""
    run = read_run(out)
    cfg, d = run.get("config") or {}, run["data"]
    args = {"net": run["net"], "data": d["name"], "image_size": d["image_size"], "n_train": d["n_train"],
            "n_test": d["n_test"], "optimizer": run["optimizer"], "lr": run["lr"], "epochs": run["epochs"],
            "batch": run["batch"], "warmup_epochs": run["warmup_epochs"],
            "label_smoothing": run["label_smoothing"], "grads": run["grads"], "seed": run["seed"],
            "flip": run["flip"], "precise_batches": run["precise_batches"], "bf16": cfg.get("bf16", False),
            "dtype": run.get("dtype", "float32"), "checkpoints": run.get("checkpoints", "npz"),
            "replicas": run.get("replicas", 1) // run.get("processes", 1), "sync_bn": run.get("sync_bn", True),
            "policy": cfg.get("policy", "tie")}
    if "head_width" in cfg:
        args["head_width"] = cfg["head_width"]
    return args


def _reconcile_metrics(file: Path, history: list) -> None:
    """metrics.jsonl holds exactly one line per epoch of the checkpoint's history: lines a killed
    run wrote after its last checkpoint are dropped, lines it had no time to write are added."""
    lines = file.read_text().splitlines() if file.is_file() else []
    want = [json.dumps(h) for h in history]
    if lines != want:
        _atomic_write(file, "".join(line + "\n" for line in want))


# ---- rendered vs autodiff, side by side ------------------------------------------------------------
#
# Two float32 runs from the same weights on the same batches, one stepping with the rendered chain
# and one with autodiff, cannot stay bit-equal: the two gradients round differently. Left to run
# freely they part the way any two runs one ulp apart part: training passes near kinks (a
# pre-activation or a pool window a hair from a tie), and a difference of one ulp decides on which
# side, so from the first such step on the runs are different samples of the same training noise.
# Measured on digits: 3e-8 apart after three steps, 8e-6 after the fourth, 10% by step 100; runs
# whose weights are nudged by one ulp each step part the same way, a step earlier or later.
#
# A bound that can fail is therefore stated step by step along the run: at every step t, the
# autodiff step taken from the rendered run's own state θ_t must land within `factor` × the
# round-off envelope of the rendered step: the largest distance between the rendered step from θ_t
# and the rendered step from θ_t with every weight moved one unit in the last place (up or down at
# random), over a few draws. A gradient that differs by round-off stays inside it at every step;
# one that differs by a bug leaves it at the first. The free runs are shown beside it.
#
# One kind of step is not judged: a point where no gradient exists (chapter Pools). On digits a live pool
# window can hold two cells that are equal in float32 without being twins, or a pre-activation can
# be exactly 0; the rendered backward then takes the first maximal cell (`maxPoolBackB`), autodiff
# of the max splits the cotangent between the tied cells, and both are legal one-sided answers. A
# tie counts as non-twin when the first of the envelope's one-ulp weight nudges breaks it (twins
# stay equal under every weight). Such steps are counted and shown, not hidden.

class Tracking(NamedTuple):
    """Steps t = 1…T of a run, in lockstep on the same batches.

    loss, accuracy: the batch loss and accuracy of the free rendered and autodiff runs.
    drift: ‖θ_autodiff − θ_rendered‖₂ / ‖θ_rendered‖₂ of the free runs after step t.
    distance: per checked step ("autodiff" and each control), the same relative distance between
        that step and the rendered step, both taken from the rendered run's state θ_{t−1}.
    envelope: the largest such distance of the rendered step from one-ulp nudged weights.
    kinks: per step, the live pool windows tied at θ_{t−1} whose tie a one-ulp weight nudge breaks
        (non-twin ties) plus the pre-activations exactly 0: the steps where kinks > 0 sit where no
        gradient exists and are not judged.
    Conv biases behind BN (0 in ℝ, round-off only) are left out of every distance.
    """
    steps: np.ndarray
    loss: dict[str, np.ndarray]
    accuracy: dict[str, np.ndarray]
    drift: np.ndarray
    distance: dict[str, np.ndarray]
    envelope: np.ndarray
    kinks: np.ndarray
    factor: float                  # bound = factor × envelope
    draws: int
    dtype: str

    @property
    def bound(self) -> np.ndarray:
        return self.factor * self.envelope

    @property
    def smooth(self) -> np.ndarray:
        """The steps taken at a point where the gradient exists (no non-twin tie, no zero pre-activation)."""
        return self.kinks == 0

    def first_over(self, name: str) -> Optional[int]:
        """The first smooth step at which `name` leaves the bound (None: never)."""
        over = np.nonzero((self.distance[name] > self.bound) & self.smooth)[0]
        return int(self.steps[over[0]]) if over.size else None

    def steps_over(self, name: str) -> int:
        """Smooth steps at which `name` leaves the bound."""
        return int(np.sum((self.distance[name] > self.bound) & self.smooth))

    def worst_ratio(self, name: str) -> float:
        """max over smooth steps of distance / envelope."""
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(self.distance[name] == 0, 0.0, self.distance[name] / self.envelope)
        return float(np.max(r[self.smooth], initial=0.0))

    @property
    def controls(self) -> list[str]:
        return [name for name in self.distance if name != "autodiff"]

    @property
    def ok(self) -> bool:
        """Some steps smooth; at every smooth step autodiff within the bound; every control out of
        it at some smooth step."""
        return (bool(np.any(self.smooth)) and self.first_over("autodiff") is None
                and all(self.first_over(c) is not None for c in self.controls))

    def summary(self) -> str:
        t, smooth = len(self.steps), int(np.sum(self.smooth))
        over = self.steps_over("autodiff")
        lines = [f"{self.dtype}, {t} steps; bound = {self.factor:g} × the rendered step's envelope "
                 f"({self.draws} one-ulp weight nudges); {smooth} steps at smooth points, {t - smooth} "
                 f"at a non-twin tie or a zero pre-activation (not judged)",
                 f"autodiff step: within the bound at {smooth - over}/{smooth} smooth steps"]
        for c in self.controls:
            lines.append(f"control {c}: out of the bound at {self.steps_over(c)}/{smooth} smooth steps")
        return "\n".join(lines)


def nudge_ulp(x: jax.Array, key: jax.Array) -> jax.Array:
    """Every nonzero entry moved one unit in the last place of its dtype, up or down at random;
    zeros stay zero."""
    up = jax.random.bernoulli(key, 0.5, x.shape)
    toward = jnp.where(up, jnp.inf, -jnp.inf).astype(x.dtype)
    return jnp.where(x == 0, x, jnp.nextafter(x, toward))


@jax.jit
def _nudge_tree(params: Params, key: jax.Array) -> Params:
    keys = jax.random.split(key, len(params))
    return {k: nudge_ulp(v, kk) for (k, v), kk in zip(params.items(), keys)}


@functools.partial(jax.jit, static_argnums=(0, 1))
def kinks(net: Net, cfg, params, nudged, x) -> jax.Array:
    """The kinks `Tracking.kinks` counts at (params, x): live pool windows tied at params whose tie
    the nudged weights break (non-twin ties), plus the pre-activations exactly 0."""
    _, saved = net.forward(params, x, cfg)
    _, saved_n = net.forward(nudged, x, cfg)
    count = sum((jnp.sum(v == 0) for v in net.preactivations(saved).values()), jnp.zeros((), jnp.int32))
    inputs, inputs_n = net.pool_inputs(saved), net.pool_inputs(saved_n)
    for name, r in inputs.items():
        spec = net.pools[name]
        w, wn = maxpool.windows(r, spec), maxpool.windows(inputs_n[name], spec)
        top = jnp.max(w, axis=-1, keepdims=True)
        at_top = w == top
        tied = (jnp.sum(at_top, axis=-1) >= 2) & (top[..., 0] > 0)
        # the nudged values of the cells tied at params: still all equal only for twins
        hi = jnp.max(jnp.where(at_top, wn, -jnp.inf), axis=-1)
        lo = jnp.min(jnp.where(at_top, wn, jnp.inf), axis=-1)
        count = count + jnp.sum(tied & (hi != lo))
    return jnp.asarray(count, jnp.int32)


@jax.jit
def _squared_norms(a: Params, b: Params) -> tuple[list, list]:
    """Per tensor, Σ(a − b)² and Σb², in the tensors' dtype: one program and one transfer for the
    whole tree (one eager reduction and one host read per tensor took half of side_by_side's time)."""
    return [jnp.sum(jnp.square(x - y)) for x, y in zip(a, b)], [jnp.sum(jnp.square(y)) for y in b]


def _relative_distance(a: Params, b: Params, skip=frozenset()) -> float:
    keys = [k for k in b if k not in skip]
    num, den = jax.device_get(_squared_norms([a[k] for k in keys], [b[k] for k in keys]))
    return math.sqrt(sum(float(v) for v in num) / sum(float(v) for v in den))


def side_by_side(net, cfg, dataset: Union[data_.Dataset, data_.Split],
                 config: FitConfig = FitConfig(optimizer="nesterov", epochs=8, batch=64), *, steps: int = 100,
                 draws: Optional[int] = None, factor: Optional[float] = None, controls: Sequence = (),
                 progress: bool = True) -> Tracking:
    """The first `steps` steps of `fit`'s run of `config` (the same init, batches, augmentations and
    schedule), rendered and autodiff side by side, and the per-step bound (`config.grads` and the
    evaluation settings play no part).

    Free runs: the rendered run and the autodiff run, each on its own. Checked steps: at every
    step, from the rendered run's state, the autodiff step, each must-fail control (a planted
    chain, e.g. `gradtie.checks.bugs.plant("bn_swap_dgamma_dbeta", cifar8.NET)`) and `draws`
    rendered steps from one-ulp nudged weights (the envelope; bound = `factor` × envelope). Steps
    taken at a non-twin pool tie or a zero pre-activation (no gradient exists there) are counted in
    `kinks` and left out of the verdict.

    Lean: the steps are the tied train steps (`cifar8Bbn_train_step_tiedB`, `r34_net_tiedB`: each
    raw node is its op's derivative at the chain's cotangent, over ℝ); that those nodes ARE the loss's
    gradient is `cifar8Bbn_net_lossGrad`'s and `r34_net_lossGrad`'s, at smooth points only (the
    steps at a kink are counted apart). This shows the float32 steps agreeing to round-off along a
    real run. Shown in: Training with the rendered step.
    """
    op = "train.side_by_side"
    steps = data_._positive_int(op, "steps", steps)
    draws = data_._positive_int(op, "draws", tol.TRAIN_TRACK_DRAWS if draws is None else draws)
    factor = tol.TRAIN_TRACK_FACTOR if factor is None else float(factor)
    for c in controls:
        if not getattr(c, "planted", "") or not hasattr(c, "kit"):
            raise ValueError(f"{op}: each control must be a planted chain (`gradtie.checks.bugs.plant`), "
                             f"got {type(c).__name__}")
    plan = _plan(op, net, cfg, dataset, config)
    total = plan.config.epochs or 1
    if steps > total * plan.steps_per_epoch:
        raise ValueError(f"{op}: steps={steps} exceeds the run's {total} epochs × {plan.steps_per_epoch} steps")
    sched = _segments_schedule(plan.config.schedule, _first_segment(plan))
    params = plan.init_params(net, cfg)
    skip = frozenset(zero_in_reals(params))
    opt, alpha = plan.opt, plan.config.label_smoothing

    rendered_step = make_step(net, cfg, opt, grads="rendered", label_smoothing=alpha)
    checked = {"autodiff": make_step(net, cfg, opt, grads="autodiff", label_smoothing=alpha)}
    for c in controls:
        checked[c.planted] = make_step(c.net, cfg, opt, grads="rendered", label_smoothing=alpha, kit=c.kit)
    free = {"rendered": init_state(net, cfg, params, opt), "autodiff": init_state(net, cfg, params, opt)}
    loss = {name: [] for name in free}
    acc = {name: [] for name in free}
    drift, envelope, kinks_ = [], [], []
    dist = {name: [] for name in checked}
    k_nudge = jax.random.fold_in(plan.key, _PRECISE_STREAM - 1)
    shown = bar(desc="side by side", total=steps, enabled=progress)
    batches = ((xb, targets) for epoch in range(total) for _, xb, targets in plan.batches(epoch))
    for t, (xb, targets) in zip(range(steps), batches):
        lr_t = sched(t)
        here = free["rendered"]
        for name, f in (("rendered", rendered_step), ("autodiff", checked["autodiff"])):
            free[name], m = f(free[name], xb, targets, lr_t)
            loss[name].append(float(m["loss"]))
            acc[name].append(float(m["accuracy"]))
        ref = free["rendered"].params
        drift.append(_relative_distance(free["autodiff"].params, ref, skip))
        for name, f in checked.items():
            dist[name].append(_relative_distance(f(here, xb, targets, lr_t)[0].params, ref, skip))
        spread = 0.0
        for j in range(draws):
            k_j = jax.random.fold_in(jax.random.fold_in(k_nudge, j), t)
            nudged = here._replace(params=_nudge_tree(here.params, k_j))
            spread = max(spread, _relative_distance(rendered_step(nudged, xb, targets, lr_t)[0].params, ref, skip))
            if j == 0:
                kinks_.append(int(kinks(net, cfg, here.params, nudged.params, xb)))
        envelope.append(spread)
        shown.update(1)
    shown.close()
    as_np = lambda d: {k: np.asarray(v) for k, v in d.items()}  # noqa: E731
    return Tracking(np.arange(1, steps + 1), as_np(loss), as_np(acc), np.asarray(drift), as_np(dist),
                    np.asarray(envelope), np.asarray(kinks_), factor, draws, plan.config.dtype)
