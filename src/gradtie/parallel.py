"""Data parallelism with synchronised BatchNorm on a JAX device mesh.

R replicas on a 1-D mesh (axis "data") each hold N examples of a global batch of R·N. Each replica
runs the rendered chain (`net.forward`, the head cotangent with its own divisor N, `net.backward`)
with `cfg.bn_axis_name = "data"`, so every BatchNorm layer normalises with the statistics of the
whole global batch: the mean is all-reduced, the variances are combined with Chan's formula, and
the backward all-reduces the per-channel means of γ·dy and x̂·γ·dy (see `gradtie.ops.batchnorm`).
The parameter gradients are then all-reduced by mean. Because the cotangent is linear and each
replica divides by its own N, the replica mean of the gradients is the gradient of the mean loss
over all R·N examples: the single-device gradient at batch R·N (Lean: `r34_net_syncTiedB`, the
all-reduced nodes of `ResNet34SyncStepTieB` are the single-device nodes at N := R·N).

Uneven replica batches (the last batch of an epoch): `counts=(n_1, …, n_R)` gives replica r its
own n_r examples. Each replica's rows are padded to max n_r and a validity mask marks the real
ones; every BatchNorm then counts valid cells only (statistics by Chan's combine with counts, the
backward's two means over the global valid cells), padded examples get a zero cotangent
everywhere, and the loss and gradients are divided by the global count Σ n_r and all-reduced by
sum. The result is the single-device step at the concatenated valid batch.

With per-replica BatchNorm (`sync_bn=False`) each replica normalises with its own examples'
statistics; that is a different function of the parameters, and its gradient differs.

The verdicts (the mesh step tied to the single-device float64 oracle) are `gradtie.checks`':
`checks.tie.tie` on R replicas. Multi-process (several hosts, or several processes on one host with
`jax.distributed`): build the global batch with `global_batch` and the parameters with
`replicate`; everything else is the same. Shown in: Data-parallel tie.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import rendered, tolerances, train
from .kit import KIT, Kit
from .nets.protocol import require_net
from .ops import batchnorm, head

AXIS = "data"
FAKE_DEVICES_HINT = ("for R fake CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count=R "
                     "in the environment before jax is first imported (os.environ in Python works "
                     "if it runs before `import jax`)")


# ---- the mesh -------------------------------------------------------------------------------------

def replica_counts(largest: int) -> list[int]:
    """R = 2, 4, 8, … up to `largest`: the meshes a chapter ties."""
    out, r = [], 2
    while r <= largest:
        out.append(r)
        r *= 2
    return out


def data_mesh(replicas: int, *, devices: Optional[Sequence] = None) -> Mesh:
    """A 1-D mesh of the first `replicas` devices (default `jax.devices()`), axis "data".

    A classic `Mesh` (not `jax.make_mesh`, whose axes default to Explicit in JAX 0.10 and then
    reject unsharded inputs to `shard_map`).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
        raise ValueError(f"data_mesh: replicas must be a positive integer, got {replicas!r}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < replicas:
        platform = devices[0].platform if devices else "none"
        raise ValueError(f"data_mesh: {replicas} replicas need {replicas} devices, but only "
                         f"{len(devices)} {platform} device(s) are visible; {FAKE_DEVICES_HINT}")
    return Mesh(np.array(devices[:replicas]), (AXIS,))


def replica_count(mesh: Mesh) -> int:
    """R, the size of the mesh's "data" axis."""
    if AXIS not in mesh.shape:
        raise ValueError(f"the mesh must have an axis named {AXIS!r}, got axes {tuple(mesh.shape)}")
    return int(mesh.shape[AXIS])


def global_batch(mesh: Mesh, local: Any) -> Any:
    """This process's rows of the global batch (a pytree of arrays) -> global arrays sharded over
    "data". On one process `local` is the whole batch. Wraps `jax.make_array_from_process_local_data`."""
    sharding = NamedSharding(mesh, P(AXIS))
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), local)


def replicate(mesh: Mesh, tree: Any) -> Any:
    """Every process's identical copy of a pytree (the parameters) -> global arrays replicated over
    the mesh."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), tree)


# ---- uneven replica batches: per-replica counts, padding and the validity mask ---------------------

def check_counts(op: str, counts, replicas: int, batch: Optional[int] = None) -> tuple[int, ...]:
    """(n_1, …, n_R): one non-negative count per replica, at least one example in all, summing to
    the batch when it is given."""
    try:
        counts = tuple(counts)
    except TypeError:
        raise ValueError(f"{op}: counts must be a sequence of {replicas} per-replica example counts, "
                         f"got {counts!r}") from None
    if len(counts) != replicas or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0
                                      for n in counts):
        raise ValueError(f"{op}: counts must be {replicas} non-negative integers (one per replica), got {counts}")
    if sum(counts) < 1:
        raise ValueError(f"{op}: counts {counts} hold no example")
    if batch is not None and sum(counts) != batch:
        raise ValueError(f"{op}: counts {counts} sum to {sum(counts)}, but the batch holds {batch} "
                         f"examples (x holds the replicas' valid rows one after another)")
    return tuple(int(n) for n in counts)


def uneven_split(batch: int, replicas: int) -> tuple[int, ...]:
    """An uneven split of a batch, as the last batch of an epoch can leave: the first replica holds
    batch − (R − 1) examples, every other one example (needs batch > R)."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch <= replicas or replicas < 2:
        raise ValueError(f"uneven_split: an uneven split needs R ≥ 2 replicas and more examples than "
                         f"replicas, got batch {batch!r} and R = {replicas!r}")
    return (int(batch) - replicas + 1,) + (1,) * (replicas - 1)


def padded(x, targets, counts: Sequence[int], *, fill: float = 0.0):
    """The concatenated valid batch (replica r's n_r rows one after another) -> (x_pad [R·N_pad,…],
    targets_pad [R·N_pad,K], valid [R·N_pad]) with N_pad = max n_r: replica r's rows first, then
    padding. Padded images hold `fill`, padded targets 1/K (rows still sum to 1); valid marks the
    real rows. The step gives padded rows no weight anywhere, so what they hold does not matter."""
    x, targets = np.asarray(x), np.asarray(targets)
    counts = check_counts("parallel.padded", counts, len(counts), x.shape[0])
    n_pad, k = max(counts), targets.shape[1]
    xs = np.full((len(counts) * n_pad,) + x.shape[1:], fill, x.dtype)
    ts = np.full((len(counts) * n_pad, k), 1.0 / k, targets.dtype)
    valid = np.zeros(len(counts) * n_pad, x.dtype)
    rows = valid_rows(counts)
    xs[rows], ts[rows], valid[rows] = x, targets, 1
    return xs, ts, valid


def valid_rows(counts: Sequence[int]) -> np.ndarray:
    """The padded batch's row of each valid example, in the order of the concatenated batch."""
    n_pad = max(counts)
    return np.concatenate([r * n_pad + np.arange(n) for r, n in enumerate(counts)]).astype(np.int64)


# ---- one replica's rendered step ----------------------------------------------------------------

class ReplicaStep(NamedTuple):
    """What the data-parallel forward-backward returns; every field is global (the same on every
    replica) except `dx`, which is sharded like the batch."""
    loss: jax.Array               # the global mean loss
    grads: dict[str, jax.Array]   # the gradient of the global mean loss, all-reduced
    dx: Optional[jax.Array]       # ∂loss/∂x of the global loss (rows of the concatenated batch)
    stats: dict[str, jax.Array]   # "<bn>.running_mean/var" of the batch: global under sync BN,
                                  # the (count-weighted) replica mean of per-replica statistics without it
    accuracy: jax.Array           # fraction of the global batch whose argmax logit is the target's


def replica_config(cfg, sync_bn: bool):
    """The config each replica runs: BatchNorm statistics over the "data" axis, or its own batch."""
    return dataclasses.replace(cfg, bn_axis_name=AXIS if sync_bn else None)


def reducing(params, reduce: Callable = lax.pmean) -> Callable:
    """The data-parallel step's `after_stage`: each stage's nodes all-reduced (in the parameters'
    dtype: float32 under bf16 convs) as soon as the chain has produced them, while the
    stages below still run — what a hand-written backward knows and `value_and_grad` does not. The
    next stage's backward is made to read the reduced nodes (a NaN in any of them poisons its
    cotangent, as it would poison the update): without that data dependence XLA's all-reduce
    combiner merges every node's all-reduce into one at the end, which holds all local gradients at
    once (ResNet-34 at R = 2: 81 MiB of temporaries instead of 26)."""
    def after_stage(nodes, dx):
        if not nodes:
            return nodes, dx
        nodes = reduce({k: g.astype(params[k].dtype) for k, g in nodes.items()}, AXIS)
        probe = sum(v.ravel()[0] for v in nodes.values())
        return nodes, dx + jnp.where(jnp.isnan(probe), jnp.nan, 0.0).astype(dx.dtype)
    return after_stage


def _varies(v: jax.Array) -> bool:
    """Whether a value inside the step still differs across replicas (a synchronised BN statistic
    is already the same on every replica)."""
    manual = getattr(jax.typeof(v), "manual_axis_type", None)
    return manual is None or AXIS in manual.varying


def _global(v: jax.Array) -> jax.Array:
    return lax.pmean(v, AXIS) if _varies(v) else v


def _hits(logits, targets):
    return (jnp.argmax(logits, axis=1) == jnp.argmax(targets, axis=1)).astype(logits.dtype)


def replica_step(net, kit: Kit, cfg, label_smoothing: float, sync_bn: bool, replicas: int, with_dx: bool,
                 masked: bool = False) -> Callable:
    """The body each replica runs inside `shard_map`: (params, x, targets[, valid]) ->
    (loss, grads, dx, stats, accuracy) as `ReplicaStep` describes; the rendered step itself is
    `rendered.step`, the one every consumer runs.

    Equal counts (masked=False): the head divides by this replica's N and the gradients are
    mean-all-reduced, which divides by R·N. Uneven counts (masked=True): BatchNorm counts only the
    valid examples, the head divides by the global count and masks the padded rows, and the
    gradients are sum-all-reduced."""
    rcfg = replica_config(cfg, sync_bn)

    def even(params, x, targets):
        # the head divides by this replica's N: the mean over replicas then divides by R·N
        out = rendered.step(net, kit, params, x, targets, rcfg, alpha=label_smoothing,
                            after_stage=reducing(params, lax.pmean))
        # synchronised: already global; per-replica (or per-example BN): the replica mean
        stats = jax.tree.map(_global, out.stats)
        # equal N on every replica: the mean of the replica means is the global mean
        return (lax.pmean(out.loss, AXIS), out.grads, out.dx / replicas if with_dx else None, stats,
                lax.pmean(jnp.mean(_hits(out.logits, targets.astype(out.logits.dtype))), AXIS))

    def uneven(params, x, targets, valid):
        local = jnp.sum(valid)
        count = lax.psum(local, AXIS)                      # n = Σ_r n_r
        # BatchNorm over the valid cells only; the loss and its cotangent divided by the global count
        # every replica's nodes already carry 1/n: the all-reduce sums them
        out = rendered.step(net, kit, params, x, targets, rcfg, alpha=label_smoothing, valid=valid, divisor=count,
                            after_stage=reducing(params, lax.psum))
        stats = jax.tree.map(lambda v: lax.psum(local * v, AXIS) / count if _varies(v) else v, out.stats)
        hits = lax.psum(jnp.sum(valid * _hits(out.logits, targets.astype(out.logits.dtype))), AXIS) / count
        return lax.psum(out.loss, AXIS), out.grads, out.dx if with_dx else None, stats, hits

    return uneven if masked else even


@functools.lru_cache(maxsize=64)
def _compiled(net, kit: Kit, cfg, mesh: Mesh, label_smoothing: float, sync_bn: bool, with_dx: bool,
              masked: bool, quick: bool) -> Callable:
    step = replica_step(net, kit, cfg, label_smoothing, sync_bn, replica_count(mesh), with_dx, masked)
    in_specs = (P(), P(AXIS), P(AXIS)) + ((P(AXIS),) if masked else ())
    sharded = jax.shard_map(step, mesh=mesh, in_specs=in_specs,
                            out_specs=(P(), P(), P(AXIS) if with_dx else None, P(), P()))
    return jax.jit(sharded, compiler_options=rendered.QUICK if quick else None)


def _targets(op: str, targets, batch: int, num_classes: int, dtype):
    """Int labels [B] -> one-hot rows; rows [B,K] pass through. Values are checked when this process
    can see all of them (not for a multi-process global array)."""
    shape = tuple(jnp.shape(targets))
    visible = getattr(targets, "is_fully_addressable", True) and not isinstance(targets, jax.core.Tracer)
    if len(shape) == 1 and jnp.issubdtype(jnp.result_type(targets), jnp.integer):
        if shape[0] != batch:
            raise ValueError(f"{op}: labels must have shape ({batch},) for a batch of {batch}, got {shape}")
        if not visible:
            return jax.nn.one_hot(targets, num_classes, dtype=dtype)
        return head.one_hot(jnp.asarray(targets), num_classes, dtype)
    if shape != (batch, num_classes) or not jnp.issubdtype(jnp.result_type(targets), jnp.floating):
        raise ValueError(f"{op}: targets must be int labels ({batch},) or float rows summing to 1 of "
                         f"shape ({batch}, {num_classes}), got {jnp.result_type(targets)} {shape}")
    if visible:
        tol = head.ROW_SUM_TOL.get(jnp.dtype(jnp.result_type(targets)), 1e-2)
        worst = float(np.max(np.abs(np.sum(np.asarray(targets, np.float64), axis=1) - 1)))
        if worst > tol:
            raise ValueError(f"{op}: every target row must sum to 1 (the smoothed-loss cotangent "
                             f"assumes it); the worst row is off by {worst:.3g}")
    return targets


def _check_batch(op: str, x, mesh: Mesh) -> int:
    if jnp.ndim(x) != 4:
        raise ValueError(f"{op}: x must be images [R·N,C,H,W], got shape {tuple(jnp.shape(x))}")
    replicas, batch = replica_count(mesh), int(jnp.shape(x)[0])
    if batch % replicas:
        raise ValueError(f"{op}: the global batch {batch} must be divisible by the {replicas} "
                         f"replicas (each replica holds N = batch / R examples; uneven replica "
                         f"batches take counts=(n_1, …, n_R))")
    return batch


def forward_backward(net, params, x, targets, cfg, *, mesh: Mesh, kit: Kit = KIT, label_smoothing: float = 0.0,
                     sync_bn: bool = True, with_dx: bool = True, counts: Optional[Sequence[int]] = None,
                     valid=None, quick: bool = False) -> ReplicaStep:
    """The data-parallel rendered step: loss, gradients of the global loss, input gradient, batch stats.

    x [R·N,C,H,W] and targets (int labels [R·N] or rows [R·N,K]) hold the global batch; replica r
    takes rows r·N … (r+1)·N − 1. `with_dx=False` skips the input gradient (a train step does not
    need it).

    Uneven replica batches: `counts=(n_1, …, n_R)` with x the concatenated valid batch [Σ n_r,…]
    (replica r's rows one after another); dx comes back in the same rows. Or `valid` [R·N]: x is
    already padded (replica r's rows r·N … (r+1)·N − 1, valid[i] = 1 for a real example, 0 for
    padding; a multi-process global batch pads this way); dx then comes back padded, 0 on padding.
    kit: the rendered chain's ops (a planted bug runs in every replica). quick: LLVM's optimisation
    off (`rendered.QUICK`), for a step evaluated once (a check).
    """
    op = "parallel.forward_backward"
    require_net(net, "parallel.forward_backward")
    if counts is not None and valid is not None:
        raise ValueError(f"{op}: give counts (a concatenated valid batch) or valid (a padded batch), not both")
    if counts is not None:
        if jnp.ndim(x) != 4:
            raise ValueError(f"{op}: x must be images [Σ n_r,C,H,W], got shape {tuple(jnp.shape(x))}")
        counts = check_counts(op, counts, replica_count(mesh), int(jnp.shape(x)[0]))
        t = _targets(op, targets, int(jnp.shape(x)[0]), cfg.num_classes, jnp.result_type(x))
        xs, ts, valid_ = padded(x, t, counts)
        out = forward_backward(net, params, jnp.asarray(xs), jnp.asarray(ts), cfg, mesh=mesh, kit=kit,
                               label_smoothing=label_smoothing, sync_bn=sync_bn, with_dx=with_dx,
                               valid=jnp.asarray(valid_), quick=quick)
        return out._replace(dx=None if out.dx is None else out.dx[valid_rows(counts)])
    batch = _check_batch(op, x, mesh)
    t = _targets(op, targets, batch, cfg.num_classes, jnp.result_type(x))
    fn = _compiled(net, kit, cfg, mesh, float(label_smoothing), bool(sync_bn), bool(with_dx), valid is not None,
                   bool(quick))
    args = (dict(params), x, t) if valid is None else (dict(params), x, t, _mask(op, valid, batch, x))
    out = ReplicaStep(*fn(*args))
    # jit hands dicts back sorted by key; `list(grads)` is the signature order, as in `params`
    return out._replace(grads={k: out.grads[k] for k in params})


def _mask(op: str, valid, batch: int, x):
    if tuple(jnp.shape(valid)) != (batch,):
        raise ValueError(f"{op}: valid must have shape ({batch},) (one flag per row of x), "
                         f"got {tuple(jnp.shape(valid))}")
    visible = getattr(valid, "is_fully_addressable", True) and not isinstance(valid, jax.core.Tracer)
    if visible:
        v = np.asarray(valid, np.float64)
        if not np.all((v == 0) | (v == 1)) or v.sum() < 1:
            raise ValueError(f"{op}: valid must hold 1 (a real example) or 0 (padding), at least one 1")
        return jnp.asarray(v, jnp.result_type(x))
    return valid.astype(jnp.result_type(x))


def loss_and_grads(net, params, x, targets, cfg, *, mesh: Mesh, label_smoothing: float = 0.0,
                   sync_bn: bool = True, counts: Optional[Sequence[int]] = None):
    """(loss, grads) of the global batch R·N from R replicas, each running the rendered chain on N.

    Each replica divides its loss by its own N; the gradients are all-reduced by mean, the loss is
    the mean over replicas. With `sync_bn` (the default) every BatchNorm uses the global batch's
    statistics and the result is the single-device gradient at batch R·N; `sync_bn=False` gives
    per-replica BatchNorm. `counts`: uneven replica batches (see `forward_backward`). `cfg.bf16`
    selects the bf16 conv kinds; the all-reduces stay in the parameters' dtype.
    """
    out = forward_backward(net, params, x, targets, cfg, mesh=mesh, label_smoothing=label_smoothing,
                           sync_bn=sync_bn, with_dx=False, counts=counts)
    return out.loss, out.grads


# ---- the data-parallel train step -----------------------------------------------------------------

def _in_order_of(tree, template):
    """`tree` with every dict's keys in `template`'s order (jit hands dicts back sorted by key)."""
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_in_order_of(a, b) for a, b in zip(tree, template)))
    if isinstance(template, Mapping):
        return {k: _in_order_of(tree[k], template[k]) for k in template}
    return tree


@functools.lru_cache(maxsize=None)
def _update_fn(opt: train.Optimizer) -> Callable:
    """The optimizer's update and the running statistics, jitted once per optimizer."""
    def update(state: train.TrainState, grads, stats, lr):
        params, opt_state = opt.update(state.params, grads, state.opt_state, lr)
        running = train.update_running(state.running, stats, state.step)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values()))
        return train.TrainState(params, opt_state, running, state.step + 1), grad_norm

    return jax.jit(update)


def make_step(net, cfg, opt: train.Optimizer, *, mesh: Mesh, label_smoothing: float = 0.0,
              sync_bn: bool = True, kit: Kit = KIT) -> Callable:
    """The data-parallel train step `step(state, x, targets, lr, counts=None) -> (state, metrics)`.

    The same contract as `train.make_step` (state: `train.TrainState`; targets: int labels [R·N]
    or rows [R·N,K]); each replica runs the rendered chain on its N examples, the gradients are
    all-reduced, and every replica applies the optimizer's update to the replicated parameters.
    The running statistics are updated with the global batch's statistics under `sync_bn` (the
    replica mean of per-replica statistics without it). `counts`: an uneven last batch (x is the
    concatenated valid batch, replica r holding n_r of it). bf16 convs: `cfg.bf16`.
    """
    require_net(net, "parallel.make_step")
    if not isinstance(opt, train.Optimizer):
        raise ValueError(f"parallel.make_step: opt must be a train.Optimizer (train.make_optimizer"
                         f"(name)), got {type(opt).__name__}")
    update = _update_fn(opt)

    def step(state: train.TrainState, x, targets, lr, counts: Optional[Sequence[int]] = None):
        out = forward_backward(net, state.params, x, targets, cfg, mesh=mesh, kit=kit, label_smoothing=label_smoothing,
                               sync_bn=sync_bn, with_dx=False, counts=counts)
        # every replica applies the same update to the replicated parameters: one global update
        new, grad_norm = update(state, out.grads, out.stats, lr)
        metrics = {"loss": out.loss, "accuracy": out.accuracy, "grad_norm": grad_norm,
                   "lr": jnp.asarray(lr, jnp.float32)}
        return _in_order_of(new, state), metrics

    return step


# ---- the same rendered step on one device ------------------------------------------------------

def single_device(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, kit: Kit = KIT) -> ReplicaStep:
    """The rendered step on one device at the whole batch: what the mesh step must reproduce (a
    train step's running statistics and accuracy included). The tie itself is
    `checks.tie.tie` on R replicas, against the float64 oracle."""
    t = _targets("parallel.single_device", targets, int(jnp.shape(x)[0]), cfg.num_classes,
                 jnp.result_type(x))
    out = rendered.compiled(net, kit, dict(params), x, t, replica_config(cfg, False), alpha=float(label_smoothing))
    hits = jnp.mean(_hits(out.logits, t.astype(out.logits.dtype)))
    return ReplicaStep(out.loss, {k: out.grads[k] for k in params}, out.dx, out.stats, hits)


# ---- combining variances across replicas: Chan's formula vs a one-round E[x²] exchange ----------

def one_round_statistics(x: jax.Array, axis_name: str) -> tuple[jax.Array, jax.Array]:
    """The peer Chan's combine replaces: one all-reduce of (E_r[x], E_r[x²]), then σ² = E[x²] − μ².

    One round instead of two, but when |μ| ≫ σ both terms are ≈ μ² and their difference loses
    about log10(μ²/σ²) digits: in float32 (u = 2⁻²⁴) at μ/σ = 10⁴ the error is of order u·μ² ≈ 6σ².
    Kept only to show that drift; `gradtie.ops.batchnorm.statistics` uses Chan's combine.
    """
    axes = (0, 2, 3)
    moments = lax.pmean(jnp.stack([jnp.mean(x, axis=axes), jnp.mean(jnp.square(x), axis=axes)]),
                        axis_name)
    return moments[0], moments[1] - jnp.square(moments[0])


@functools.lru_cache(maxsize=16)
def _statistics_fn(mesh: Mesh, method: str):
    if method == "chan":
        def f(x):
            return batchnorm.statistics(x, axis_name=AXIS)
    elif method == "one_round":
        def f(x):
            return one_round_statistics(x, AXIS)
    else:
        raise ValueError(f"method {method!r}: expected 'chan' or 'one_round'")
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=(P(), P())))


def global_statistics(x, *, mesh: Mesh, method: str = "chan") -> tuple[jax.Array, jax.Array]:
    """Per-channel mean and population variance of x [R·N,C,H,W] split over the mesh's replicas,
    combined with Chan's formula (`"chan"`, what synchronised BatchNorm does) or one E[x²] round."""
    _check_batch("parallel.global_statistics", x, mesh)
    return _statistics_fn(mesh, method)(x)


class DriftRow(NamedTuple):
    offset: float         # μ/σ of the data: x = offset + N(0, 1)
    chan: float           # max over channels of |σ²_chan − σ²_exact| / σ²_exact
    one_round: float      # the same for E[x²] − μ²


class DriftReport(NamedTuple):
    dtype: str
    replicas: int
    shape: tuple[int, ...]
    rows: list[DriftRow]

    def table(self) -> str:
        lines = [f"{'mean/std':>9} {'Chan rel err':>13} {'E[x²]−μ² rel err':>17}"]
        lines += [f"{r.offset:9.0e} {r.chan:13.1e} {r.one_round:17.1e}" for r in self.rows]
        return "\n".join(lines)


UNIT_ROUNDOFF = {"float32": tolerances.UNIT_ROUNDOFF["float32"], "float64": tolerances.UNIT_ROUNDOFF["float64"]}


def chan_bound(offset: float, dtype: str = "float32") -> float:
    """The relative error Chan's combine stays under for data with mean/std = offset:
    CHAN_FACTOR·u·(1 + |μ|/σ) (`tolerances.CHAN_FACTOR`)."""
    return tolerances.CHAN_FACTOR * UNIT_ROUNDOFF[dtype] * (1.0 + abs(offset))


def one_round_scale(offset: float, dtype: str = "float32") -> float:
    """u·(μ/σ)²: the size of the E[x²] − μ² error relative to σ² for data with mean/std = offset
    (two numbers of size μ² + σ², each rounded at u·μ², subtracted)."""
    return UNIT_ROUNDOFF[dtype] * offset ** 2


def variance_drift(offsets: Sequence[float], *, mesh: Mesh, per_replica: int = 4,
                   channels: int = 8, size: int = 8, seed: int = 0,
                   dtype: str = "float32") -> DriftReport:
    """The global variance of x = offset + N(0,1) (dtype) from both combines, against float64.

    The exact value is the two-pass float64 variance of the SAME rounded dtype values, so the
    errors are the combines' own round-off, not the rounding of the data.
    """
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"variance_drift: dtype must be one of {', '.join(UNIT_ROUNDOFF)}, got {dtype!r}")
    replicas = replica_count(mesh)
    shape = (replicas * per_replica, channels, size, size)
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(shape)
    rows = []
    for offset in offsets:
        x = (offset + noise).astype(dtype)
        x64 = x.astype(np.float64)
        exact = np.mean(np.square(x64 - np.mean(x64, axis=(0, 2, 3), keepdims=True)), axis=(0, 2, 3))
        errs = []
        for method in ("chan", "one_round"):
            _, var = global_statistics(jnp.asarray(x), mesh=mesh, method=method)
            errs.append(float(np.max(np.abs(np.asarray(var, np.float64) - exact) / exact)))
        rows.append(DriftRow(float(offset), *errs))
    return DriftReport(dtype, replicas, shape, rows)
