"""Train steps: update rules, the learning-rate schedule, running statistics, a small training loop.

The rendered step runs the net's forward once and its rendered backward once: one forward gives
the batch statistics (for the running averages) and the saved activations the backward reads; the
cotangent at the logits is the head's six kit ops. The autodiff step, kept apart at the bottom of
the step section, is the peer a reader compares against: the same forward, differentiated by
`jax.value_and_grad` through `gradtie.reference`'s loss. Shown in: Training with the rendered step.

| optimizer  | update (SPEC §9)                                                                    |
|------------|-------------------------------------------------------------------------------------|
| sgd        | θ ← θ − lr·g                                                                        |
| nesterov   | v ← μv + g; θ ← θ − lr·(g + μv), μ = 0.9                                            |
| heavy-ball | g ← g + wd·θ (every tensor); v ← 0.9v + g; θ ← θ − lr·v                             |
| adamw      | m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²; θ ← θ − lr·m̂/(√v̂ + ε) − lr·wd·θ              |

Every optimizer is a pair of pure functions on dict-of-array pytrees, `init(params) -> state` and
`update(params, grads, state, lr) -> (params, state)`; states are dicts of arrays, so checkpoints
are plain `.npz` files.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import data as data_
from .ops import head

Params = dict[str, jax.Array]
OptState = dict[str, Any]

RUNNING_MOMENTUM = 0.01     # running ← (1 − 0.01)·running + 0.01·batch (PyTorch's BatchNorm default)
CHECKPOINT = "checkpoint.npz"
METRICS = "metrics.json"


# ---- update rules --------------------------------------------------------------------------------

class Optimizer(NamedTuple):
    """A named update rule: init(params) -> state; update(params, grads, state, lr) -> (params, state)."""
    name: str
    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Params, OptState]]
    hyper: dict


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
    def init(params):
        return {}

    def update(params, grads, state, lr):
        return _map(lambda p, g: p - _lr(lr, p) * g, params, grads), state

    return Optimizer("sgd", init, update, {})


@functools.lru_cache(maxsize=None)
def nesterov(momentum: float = 0.9) -> Optimizer:
    """v ← μv + g; θ ← θ − lr·(g + μv) (the look-ahead form; optax's `sgd(nesterov=True)`)."""
    def init(params):
        return {"v": _zeros(params)}

    def update(params, grads, state, lr):
        v = _map(lambda v_, g: momentum * v_ + g, state["v"], grads)
        new = _map(lambda p, g, v_: p - _lr(lr, p) * (g + momentum * v_), params, grads, v)
        return new, {"v": v}

    return Optimizer("nesterov", init, update, {"momentum": momentum})


@functools.lru_cache(maxsize=None)
def heavy_ball(momentum: float = 0.9, weight_decay: float = 1e-4) -> Optimizer:
    """Coupled weight decay on every tensor, then momentum: g ← g + wd·θ; v ← μv + g; θ ← θ − lr·v."""
    def init(params):
        return {"v": _zeros(params)}

    def update(params, grads, state, lr):
        g = _map(lambda g_, p: g_ + weight_decay * p, grads, params)
        v = _map(lambda v_, g_: momentum * v_ + g_, state["v"], g)
        return _map(lambda p, v_: p - _lr(lr, p) * v_, params, v), {"v": v}

    return Optimizer("heavy-ball", init, update, {"momentum": momentum, "weight_decay": weight_decay})


@functools.lru_cache(maxsize=None)
def adamw(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4) -> Optimizer:
    """Adam with bias correction and decoupled weight decay read from θ before the step:
    θ ← θ − lr·(m/(1−β₁ᵗ))/(√(v/(1−β₂ᵗ)) + ε) − lr·wd·θ, t = 1, 2, … (the state's count)."""
    def init(params):
        return {"m": _zeros(params), "v": _zeros(params), "count": jnp.zeros((), jnp.int32)}

    def update(params, grads, state, lr):
        t = state["count"] + 1
        m = _map(lambda m_, g: b1 * m_ + (1 - b1) * g, state["m"], grads)
        v = _map(lambda v_, g: b2 * v_ + (1 - b2) * jnp.square(g), state["v"], grads)

        def step(p, m_, v_):
            m_hat = m_ / (1 - jnp.power(b1, t.astype(p.dtype)))
            v_hat = v_ / (1 - jnp.power(b2, t.astype(p.dtype)))
            return p - _lr(lr, p) * (m_hat / (jnp.sqrt(v_hat) + eps) + weight_decay * p)

        return _map(step, params, m, v), {"m": m, "v": v, "count": t}

    return Optimizer("adamw", init, update, {"b1": b1, "b2": b2, "eps": eps, "weight_decay": weight_decay})


OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {
    "sgd": sgd, "nesterov": nesterov, "heavy-ball": heavy_ball, "adamw": adamw}

# upstream's learning rates for cifar8 (SPEC §9); heavy ball is the ResNet-34 ImageNet recipe's
DEFAULT_LR = {"sgd": 0.1, "nesterov": 0.02, "heavy-ball": 0.1, "adamw": 1e-3}


def make_optimizer(name: str, **hyper) -> Optimizer:
    """The registered optimizer `name` with its defaults overridden by `hyper`."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](**hyper)


# ---- learning-rate schedules ---------------------------------------------------------------------

_FLOAT = float   # jnp's default float: float64 under jax_enable_x64, else float32

def constant(base_lr: float) -> Callable[[Any], jax.Array]:
    if not base_lr > 0:
        raise ValueError(f"constant: base_lr must be positive, got {base_lr!r}")
    return lambda step: jnp.asarray(base_lr, _FLOAT)


def cosine_warmup(base_lr: float, warmup_steps: int, total_steps: int) -> Callable[[Any], jax.Array]:
    """lr(s) = base·(s+1)/W for s < W (linear warmup reaching base at s = W−1), then
    base·½(1 + cos(π·(s−W)/(T−W))) for W ≤ s < T, and 0 from s = T on. Step s counts from 0, so
    the first step already trains (a warmup starting at 0 would waste it)."""
    if not base_lr > 0:
        raise ValueError(f"cosine_warmup: base_lr must be positive, got {base_lr!r}")
    if not (isinstance(total_steps, int) and total_steps > 0):
        raise ValueError(f"cosine_warmup: total_steps must be a positive integer, got {total_steps!r}")
    if not (isinstance(warmup_steps, int) and 0 <= warmup_steps <= total_steps):
        raise ValueError(f"cosine_warmup: warmup_steps must be an integer in 0…{total_steps}, "
                         f"got {warmup_steps!r}")

    def schedule(step):
        s = jnp.asarray(step, _FLOAT)
        warm = base_lr * (s + 1) / max(warmup_steps, 1)
        progress = jnp.clip((s - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
        cos = 0.5 * base_lr * (1 + jnp.cos(math.pi * progress))
        return jnp.where(s < warmup_steps, warm, cos)

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


def _as_rows(targets, num_classes: int, dtype) -> jax.Array:
    """Int labels [N] -> one-hot rows; rows [N,K] pass through, cast to the logits' dtype."""
    targets = jnp.asarray(targets)
    if jnp.issubdtype(targets.dtype, jnp.integer):
        return head.one_hot(targets, num_classes, dtype=dtype)
    return targets.astype(dtype)


def _rendered_loss_and_grads(net, cfg, alpha: float):
    """loss, grads, logits and batch stats from ONE forward and the rendered backward."""
    def run(params, x, targets):
        logits, saved = net.forward(params, x, cfg)
        t = _as_rows(targets, logits.shape[1], logits.dtype)
        loss = head.forward(logits, t, alpha)
        dlogits = head.cotangent(logits, t, alpha)
        grads, _ = net.backward(params, saved, dlogits, cfg)
        return loss, grads, logits, net.batch_stats(saved)
    return run


def make_step(net, cfg, opt: Optimizer, *, grads: str = "rendered", label_smoothing: float = 0.0,
              jit: bool = True) -> Callable[[TrainState, Any, Any, Any], tuple[TrainState, dict]]:
    """A train step `step(state, x, targets, lr) -> (state, metrics)`, jitted.

    targets: int labels [N] or rows summing to 1 [N,K]. grads="rendered" uses the net's rendered
    chain; grads="autodiff" differentiates the same forward with `jax.value_and_grad` (the peer the
    rendered step is compared against). metrics: loss, accuracy (argmax of logits against argmax
    of targets), grad_norm (global L2), lr.
    """
    try:
        key = (id(net), hash(cfg), cfg, id(opt), grads, label_smoothing, jit)
    except TypeError:       # an unhashable config: no reuse
        key = object()
    hit = _STEPS.get(key)
    if hit is not None and hit[0] is net and hit[1] is opt:
        return hit[2]
    if grads == "rendered":
        loss_and_grads = _rendered_loss_and_grads(net, cfg, label_smoothing)
    elif grads == "autodiff":
        loss_and_grads = _autodiff_loss_and_grads(net, cfg, label_smoothing)
    else:
        raise ValueError(f"make_step: grads must be 'rendered' or 'autodiff', got {grads!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"make_step: label_smoothing must lie in [0, 1], got {label_smoothing!r}")

    def step(state: TrainState, x, targets, lr):
        loss, g, logits, stats = loss_and_grads(state.params, x, targets)
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

    if jit:
        jitted = jax.jit(step)

        def ordered_step(state: TrainState, x, targets, lr):
            new, metrics = jitted(state, x, targets, lr)
            return _in_order_of(new, state), metrics

    _STEPS[key] = (net, opt, ordered_step if jit else step)
    return _STEPS[key][2]


# (net, config, optimizer, grads, α, jit) -> step: a second make_step (a resumed fit, a notebook
# cell run twice) reuses the compiled step instead of compiling it again
_STEPS: dict = {}


def _in_order_of(tree, template):
    """`tree` with every dict's keys in `template`'s order: jit hands dicts back sorted by key, and
    `list(params)` is the signature order (SPEC §1)."""
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_in_order_of(a, b) for a, b in zip(tree, template)))
    if isinstance(template, Mapping):
        return {k: _in_order_of(tree[k], template[k]) for k in template}
    return tree


# ---- the autodiff peer (an oracle, not a kernel: the only autodiff in this module) ---------------

def _autodiff_loss_and_grads(net, cfg, alpha: float):
    """loss, grads, logits and batch stats by `jax.value_and_grad` of the forward-based loss."""
    from .reference import smoothed_cross_entropy

    def run(params, x, targets):
        def loss_fn(p):
            logits, saved = net.forward(p, x, cfg)
            t = _as_rows(targets, logits.shape[1], logits.dtype)
            return smoothed_cross_entropy(logits, t, alpha), (logits, net.batch_stats(saved))

        (loss, (logits, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, grads, logits, stats
    return run


# ---- evaluation ----------------------------------------------------------------------------------

_EVAL_FNS: dict = {}


def _eval_fn(net, cfg):
    """One jitted eval forward per (net, config), reused across calls (no recompiles per epoch)."""
    key = (id(net), cfg)
    if key not in _EVAL_FNS or _EVAL_FNS[key][0] is not net:
        _EVAL_FNS[key] = (net, jax.jit(lambda params, running, x: net.forward_eval(params, running, x, cfg)))
    return _EVAL_FNS[key][1]


def evaluate(net, cfg, state: TrainState, x, labels, batch: int = 256) -> float:
    """Top-1 accuracy of the eval-mode net (BN with running statistics) on (x, labels)."""
    batch = data_._positive_int("train.evaluate", "batch", batch)
    n = len(labels)
    if n == 0 or len(x) != n:
        raise ValueError(f"train.evaluate: need as many labels as images (and at least one), "
                         f"got {len(x)} images and {n} labels")
    f = _eval_fn(net, cfg)
    dtype = next(iter(state.params.values())).dtype
    correct = 0
    for start in range(0, n, batch):
        logits = f(state.params, state.running, jnp.asarray(x[start:start + batch], dtype))
        correct += int(jnp.sum(jnp.argmax(logits, axis=1) == jnp.asarray(labels[start:start + batch])))
    return correct / n


# ---- checkpoints ---------------------------------------------------------------------------------

def _flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: np.asarray(tree)}


def _unflatten_like(template, flat: Mapping[str, np.ndarray], file: Path, prefix: str = ""):
    if isinstance(template, Mapping):
        return {k: _unflatten_like(v, flat, file, f"{prefix}{k}/") for k, v in template.items()}
    key = prefix[:-1]
    if key not in flat:
        raise ValueError(f"checkpoint {str(file)!r} lacks {key!r}; was it written for another net "
                         f"or optimizer?")
    arr = flat[key]
    want = (tuple(np.shape(template)), np.dtype(jnp.asarray(template).dtype))
    if (arr.shape, arr.dtype) != want:
        raise ValueError(f"checkpoint {str(file)!r}: {key!r} is {arr.dtype} {arr.shape}, expected "
                         f"{want[1]} {want[0]}")
    return jnp.asarray(arr)


def save_checkpoint(out, state: TrainState, record: dict) -> None:
    """`out/checkpoint.npz` (params, opt_state, running, step) and `out/metrics.json` (record);
    each written to a temporary file first and renamed, so a killed run leaves the last good pair."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    flat = _flatten({"params": state.params, "opt_state": state.opt_state,
                     "running": state.running, "step": state.step})
    tmp = out / (CHECKPOINT + ".tmp.npz")
    np.savez(tmp, **flat)
    os.replace(tmp, out / CHECKPOINT)
    tmp = out / (METRICS + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=float) + "\n")
    os.replace(tmp, out / METRICS)


def load_checkpoint(out, template: TrainState) -> tuple[TrainState, dict]:
    """The state saved in `out` (checked key by key against `template`) and its metrics record."""
    out = Path(out)
    file = out / CHECKPOINT
    if not file.is_file() or not (out / METRICS).is_file():
        raise FileNotFoundError(f"no checkpoint in {str(out)!r}: expected {CHECKPOINT} and {METRICS}")
    with np.load(file) as z:
        flat = {k: z[k] for k in z.files}
    tree = _unflatten_like({"params": template.params, "opt_state": template.opt_state,
                            "running": template.running, "step": template.step}, flat, file)
    record = json.loads((out / METRICS).read_text())
    return TrainState(tree["params"], tree["opt_state"], tree["running"], tree["step"]), record


# ---- the training loop ---------------------------------------------------------------------------

class FitResult(NamedTuple):
    state: TrainState
    history: list[dict]     # one record per epoch


def default_label_smoothing(net) -> float:
    """α = 0.1 for ResNet-34 (the ImageNet recipe), 0 for cifar8 (SPEC §1)."""
    return 0.1 if getattr(net, "NAME", "") == "resnet34" else 0.0


def fit(net, cfg, dataset: Union[data_.Dataset, data_.Split], *, optimizer: str = "sgd",
        lr: Optional[float] = None, epochs: int = 1, batch: int = 128, schedule: str = "cosine",
        warmup_epochs: int = 0, grads: str = "rendered", label_smoothing: Optional[float] = None,
        flip: bool = True, mix: Optional[str] = None, seed: int = 0, dtype: str = "float32",
        out=None, resume: bool = False, progress: bool = True, eval_batch: int = 256) -> FitResult:
    """Train `net` on a dataset's train split for `epochs` epochs; report test accuracy per epoch.

    Each epoch shuffles with a key folded from (seed, epoch), so a run resumed from `out` after
    epoch e continues exactly as the uninterrupted run would. With `out`, every epoch writes
    `checkpoint.npz` and `metrics.json` there; `resume=True` continues from them when present.
    mix: None, "mixup" or "cutmix" (soft targets); flip: the left-right flip augmentation.
    """
    op = "train.fit"
    split = dataset.split if isinstance(dataset, data_.Dataset) else data_.Split(*dataset)
    epochs = data_._positive_int(op, "epochs", epochs)
    batch = data_._positive_int(op, "batch", batch)
    if mix not in (None, "mixup", "cutmix"):
        raise ValueError(f"{op}: mix must be None, 'mixup' or 'cutmix', got {mix!r}")
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"{op}: schedule must be 'cosine' or 'constant', got {schedule!r}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"{op}: dtype must be 'float32' or 'float64', got {dtype!r}")
    if dtype == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(f"{op}: dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
    num_classes = getattr(cfg, "num_classes", None)
    if isinstance(dataset, data_.Dataset) and num_classes is not None and num_classes != dataset.num_classes:
        raise ValueError(f"{op}: the net has {num_classes} classes but {dataset.name!r} has "
                         f"{dataset.num_classes}; build the config with num_classes={dataset.num_classes}")
    num_classes = num_classes or int(max(split.y_train.max(), split.y_test.max())) + 1
    steps_per_epoch = len(split.y_train) // batch
    if steps_per_epoch == 0:
        raise ValueError(f"{op}: {len(split.y_train)} training examples make no full batch of {batch}")
    opt = make_optimizer(optimizer)
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    total = epochs * steps_per_epoch
    sched = (constant(lr) if schedule == "constant"
             else cosine_warmup(lr, min(warmup_epochs * steps_per_epoch, total), total))
    alpha = default_label_smoothing(net) if label_smoothing is None else label_smoothing
    dt = jnp.dtype(dtype)

    key = jax.random.key(seed)
    params = {k: v.astype(dt) for k, v in net.init(jax.random.fold_in(key, 0), cfg).items()}
    state = init_state(net, cfg, params, opt)
    record = {"net": getattr(net, "NAME", type(net).__name__), "config": _jsonable(cfg),
              "optimizer": opt.name, "hyper": opt.hyper, "lr": lr, "schedule": schedule,
              "warmup_epochs": warmup_epochs, "epochs": epochs, "batch": batch, "grads": grads,
              "label_smoothing": alpha, "flip": flip, "mix": mix, "seed": seed, "dtype": dtype,
              "steps_per_epoch": steps_per_epoch, "history": []}
    if resume and out is not None and (Path(out) / CHECKPOINT).is_file():
        saved = json.loads((Path(out) / METRICS).read_text()) if (Path(out) / METRICS).is_file() else {}
        for field in ("net", "optimizer", "batch", "seed", "dtype", "grads"):
            if saved.get(field) != record[field]:
                raise ValueError(f"{op}: cannot resume from {str(out)!r}: it was trained with "
                                 f"{field}={saved.get(field)!r}, this run asks for {record[field]!r}")
        state, saved = load_checkpoint(out, state)
        record["history"] = saved["history"]
    step_fn = make_step(net, cfg, opt, grads=grads, label_smoothing=alpha)

    for epoch in range(len(record["history"]), epochs):
        k_batch, k_flip, k_mix = jax.random.split(jax.random.fold_in(key, epoch + 1), 3)
        sums, start = {"loss": 0.0, "accuracy": 0.0}, time.perf_counter()
        bar = _progress(steps_per_epoch, f"epoch {epoch + 1}/{epochs}", progress)
        for i, (xb, yb) in enumerate(data_.batches(split.x_train, split.y_train, batch, key=k_batch)):
            xb = jnp.asarray(xb, dt)
            if flip:
                xb = data_.augment_flip(xb, jax.random.fold_in(k_flip, i))
            targets = jnp.asarray(yb)
            if mix is not None:
                mixer = data_.mixup if mix == "mixup" else data_.cutmix
                m = mixer(xb, head.one_hot(targets, num_classes, dtype=dt), jax.random.fold_in(k_mix, i))
                xb, targets = m.x, m.targets
            state, metrics = step_fn(state, xb, targets, sched(state.step))
            for name in sums:
                sums[name] += float(metrics[name])
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
        if bar is not None:
            bar.close()
        entry = {"epoch": epoch + 1, "step": int(state.step),
                 "loss": sums["loss"] / steps_per_epoch,
                 "train_accuracy": sums["accuracy"] / steps_per_epoch,
                 "test_accuracy": evaluate(net, cfg, state, split.x_test, split.y_test, eval_batch),
                 "lr": float(metrics["lr"]), "seconds": time.perf_counter() - start}
        record["history"].append(entry)
        if out is not None:
            save_checkpoint(out, state, record)
    return FitResult(state, record["history"])


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, leave=False)


def _jsonable(cfg) -> Any:
    if hasattr(cfg, "__dataclass_fields__"):
        return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    return repr(cfg)
