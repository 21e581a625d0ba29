"""Data parallelism with synchronised BatchNorm on a JAX device mesh.

R replicas on a 1-D mesh (axis "data") each hold N examples of a global batch of R·N. Each replica
runs the rendered chain (`net.forward`, the head cotangent with its own divisor N, `net.backward`)
with `cfg.bn_axis_name = "data"`, so every BatchNorm layer normalises with the statistics of the
whole global batch: the mean is all-reduced, the variances are combined with Chan's formula, and
the backward all-reduces the per-channel means of γ·dy and x̂·γ·dy (see `gradtie.ops.batchnorm`).
The parameter gradients are then all-reduced by mean. Because the cotangent is linear and each
replica divides by its own N, the replica mean of the gradients is the gradient of the mean loss
over all R·N examples: the single-device gradient at batch R·N.

With per-replica BatchNorm (`sync_bn=False`) each replica normalises with its own N examples'
statistics; that is a different function of the parameters, and its gradient differs.

Multi-process (several hosts, or several processes on one host with `jax.distributed`): build the
global batch with `global_batch` and the parameters with `replicate`; everything else is the same.
Shown in: Data-parallel tie.
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

from . import train
from .checks import tolerances
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


# ---- one replica's rendered step ----------------------------------------------------------------

class ReplicaStep(NamedTuple):
    """What the data-parallel forward-backward returns; every field is global (the same on every
    replica) except `dx`, which is sharded like the batch."""
    loss: jax.Array               # mean over replicas of each replica's mean loss = the global mean
    grads: dict[str, jax.Array]   # replica mean of the rendered parameter gradients
    dx: Optional[jax.Array]       # ∂loss/∂x of the global loss: each replica's dx divided by R
    stats: dict[str, jax.Array]   # "<bn>.running_mean/var" of the batch: global under sync BN,
                                  # the replica mean of the per-replica statistics without it
    accuracy: jax.Array           # fraction of the global batch whose argmax logit is the target's


def replica_config(cfg, sync_bn: bool):
    """The config each replica runs: BatchNorm statistics over the "data" axis, or its own batch."""
    return dataclasses.replace(cfg, bn_axis_name=AXIS if sync_bn else None)


def _pmean_packed(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One all-reduce for the whole gradient: the nodes packed into one flat vector per dtype
    (a single collective instead of one per tensor; the arithmetic per element is the same)."""
    out = {}
    for dtype in sorted({jnp.dtype(g.dtype) for g in tree.values()}, key=str):
        names = [k for k, g in tree.items() if jnp.dtype(g.dtype) == dtype]
        flat = lax.pmean(jnp.concatenate([jnp.ravel(tree[k]) for k in names]), AXIS)
        offsets = np.cumsum([0] + [tree[k].size for k in names])
        for k, a, b in zip(names, offsets[:-1], offsets[1:]):
            out[k] = flat[a:b].reshape(tree[k].shape)
    return {k: out[k] for k in tree}


def _global(v: jax.Array) -> jax.Array:
    """The replica mean of a value that still varies across replicas; a value that is already the
    same on every replica (a synchronised BN statistic) is returned as it is."""
    manual = getattr(jax.typeof(v), "manual_axis_type", None)
    if manual is not None and AXIS not in manual.varying:
        return v
    return lax.pmean(v, AXIS)


def _replica_step(net, cfg, label_smoothing: float, sync_bn: bool, replicas: int, with_dx: bool):
    rcfg = replica_config(cfg, sync_bn)

    def step(params, x, targets):
        logits, saved = net.forward(params, x, rcfg)
        targets = targets.astype(logits.dtype)
        loss = head.forward(logits, targets, label_smoothing)
        # the head divides by this replica's N: the mean over replicas then divides by R·N
        dlogits = head.cotangent(logits, targets, label_smoothing)
        grads, dx = net.backward(params, saved, dlogits, rcfg)
        # all-reduce in the parameters' dtype (float32 under bf16 convs: SPEC §7)
        grads = _pmean_packed({k: g.astype(params[k].dtype) for k, g in grads.items()})
        # synchronised: already global; per-replica (or per-example BN): the replica mean
        stats = jax.tree.map(_global, net.batch_stats(saved))
        hits = jnp.mean((jnp.argmax(logits, axis=1) == jnp.argmax(targets, axis=1)).astype(logits.dtype))
        # equal N on every replica: the mean of the replica means is the global mean
        return (lax.pmean(loss, AXIS), grads, dx / replicas if with_dx else None, stats,
                lax.pmean(hits, AXIS))

    return step


@functools.lru_cache(maxsize=64)
def _compiled(net, cfg, mesh: Mesh, label_smoothing: float, sync_bn: bool, with_dx: bool) -> Callable:
    step = _replica_step(net, cfg, label_smoothing, sync_bn, replica_count(mesh), with_dx)
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                            out_specs=(P(), P(), P(AXIS) if with_dx else None, P(), P()))
    return jax.jit(sharded)


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
                         f"replicas (each replica holds N = batch / R examples)")
    return batch


def forward_backward(net, params, x, targets, cfg, *, mesh: Mesh, label_smoothing: float = 0.0,
                     sync_bn: bool = True, with_dx: bool = True) -> ReplicaStep:
    """The data-parallel rendered step: loss, replica-mean gradients, input gradient, batch stats.

    x [R·N,C,H,W] and targets (int labels [R·N] or rows [R·N,K]) hold the global batch; replica r
    takes rows r·N … (r+1)·N − 1. `with_dx=False` skips the input gradient (a train step does not
    need it).
    """
    op = "parallel.forward_backward"
    batch = _check_batch(op, x, mesh)
    t = _targets(op, targets, batch, cfg.num_classes, jnp.result_type(x))
    fn = _compiled(net, cfg, mesh, float(label_smoothing), bool(sync_bn), bool(with_dx))
    out = ReplicaStep(*fn(dict(params), x, t))
    # jit hands dicts back sorted by key; `list(grads)` is the signature order, as in `params`
    return out._replace(grads={k: out.grads[k] for k in params})


def loss_and_grads(net, params, x, targets, cfg, *, mesh: Mesh, label_smoothing: float = 0.0,
                   sync_bn: bool = True):
    """(loss, grads) of the global batch R·N from R replicas, each running the rendered chain on N.

    Each replica divides its loss by its own N; the gradients are all-reduced by mean, the loss is
    the mean over replicas. With `sync_bn` (the default) every BatchNorm uses the global batch's
    statistics and the result is the single-device gradient at batch R·N; `sync_bn=False` gives
    per-replica BatchNorm. `cfg.bf16` selects the bf16 conv kinds; the all-reduces stay in the
    parameters' dtype.
    """
    out = forward_backward(net, params, x, targets, cfg, mesh=mesh, label_smoothing=label_smoothing,
                           sync_bn=sync_bn, with_dx=False)
    return out.loss, out.grads


# ---- the data-parallel train step -----------------------------------------------------------------

def _in_order_of(tree, template):
    """`tree` with every dict's keys in `template`'s order (jit hands dicts back sorted by key)."""
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_in_order_of(a, b) for a, b in zip(tree, template)))
    if isinstance(template, Mapping):
        return {k: _in_order_of(tree[k], template[k]) for k in template}
    return tree


_UPDATES: dict = {}


def _update_fn(opt: train.Optimizer) -> Callable:
    """The optimizer's update and the running statistics, jitted once per optimizer object (its
    hyper dict makes it unhashable, so it is keyed by identity)."""
    hit = _UPDATES.get(id(opt))
    if hit is not None and hit[0] is opt:
        return hit[1]

    def update(state: train.TrainState, grads, stats, lr):
        params, opt_state = opt.update(state.params, grads, state.opt_state, lr)
        running = train.update_running(state.running, stats, state.step)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values()))
        return train.TrainState(params, opt_state, running, state.step + 1), grad_norm

    _UPDATES[id(opt)] = (opt, jax.jit(update))
    return _UPDATES[id(opt)][1]


def make_step(net, cfg, opt: train.Optimizer, *, mesh: Mesh, label_smoothing: float = 0.0,
              sync_bn: bool = True) -> Callable:
    """The data-parallel train step `step(state, x, targets, lr) -> (state, metrics)` on `mesh`.

    The same contract as `train.make_step` (state: `train.TrainState`; targets: int labels [R·N]
    or rows [R·N,K]); each replica runs the rendered chain on its N examples, the gradients are
    all-reduced by mean, and every replica applies the optimizer's update to the replicated
    parameters. The running statistics are updated with the global batch's statistics under
    `sync_bn` (the replica mean of per-replica statistics without it). bf16 convs: `cfg.bf16`.
    """
    if not isinstance(opt, train.Optimizer):
        raise ValueError(f"parallel.make_step: opt must be a train.Optimizer (train.make_optimizer"
                         f"(name)), got {type(opt).__name__}")
    update = _update_fn(opt)

    def step(state: train.TrainState, x, targets, lr):
        out = forward_backward(net, state.params, x, targets, cfg, mesh=mesh,
                               label_smoothing=label_smoothing, sync_bn=sync_bn, with_dx=False)
        # every replica applies the same update to the replicated parameters: one global update
        new, grad_norm = update(state, out.grads, out.stats, lr)
        metrics = {"loss": out.loss, "accuracy": out.accuracy, "grad_norm": grad_norm,
                   "lr": jnp.asarray(lr, jnp.float32)}
        return _in_order_of(new, state), metrics

    return step


# ---- the tie: data-parallel gradients against one device at batch R·N ---------------------------

# float64, rendered vs rendered: the two sides differ only in summation order (the all-reduces and
# the split of each BN sum into R partial sums), so they agree to round-off (SPEC §8: ~1e-12).
REL_F64 = tolerances.REL_F64
# A conv bias behind BatchNorm is 0 in ℝ: both sides hold only the round-off of a sum over the
# M = N·H·W cells of a BN input cotangent, which grows with M (measured 5e-15·max|g| for conv1 of
# cifar8 at R·N = 32, M = 32768). Such a node is held to REL_F64 of this floor times max|g|
# (an absolute 1e-13·max|g|, about 500 ulps of the largest gradient).
ZERO_NODE_FLOOR = 1e-3


@dataclasses.dataclass(frozen=True)
class NodeRow:
    name: str
    err: float            # max |data-parallel − single device|
    scale: float          # max |single device|, or the floor for zero-in-ℝ nodes
    zero_in_reals: bool
    limit: float

    @property
    def rel(self) -> float:
        return self.err / self.scale

    @property
    def ok(self) -> bool:
        return bool(self.rel <= self.limit)


@dataclasses.dataclass
class TieReport:
    """One row per parameter node plus the input gradient, data parallel vs one device."""
    net: str
    replicas: int
    per_replica: int
    sync_bn: bool
    rows: list[NodeRow]
    loss: float
    loss_single: float

    @property
    def failed(self) -> list[NodeRow]:
        return [r for r in self.rows if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def worst(self) -> NodeRow:
        return max(self.rows, key=lambda r: r.rel / r.limit)

    @property
    def max_rel(self) -> float:
        return max(r.rel for r in self.rows)

    def verdict(self) -> str:
        """Counts and pass/fail only: stable across machines (what a compared cell prints)."""
        bn = "sync BN" if self.sync_bn else "per-replica BN"
        nodes = [r for r in self.rows if r.name != "input"]
        tied = sum(r.ok for r in nodes)
        inp = [r for r in self.rows if r.name == "input"]
        return (f"R={self.replicas} × N={self.per_replica} ({bn}): tied {tied}/{len(nodes)} nodes"
                + (f", input gradient {'tied' if inp[0].ok else 'FAILED'}" if inp else ""))

    def summary(self) -> str:
        w = self.worst
        return f"{self.verdict()}; worst rel err {w.rel:.0e} ({w.name}, limit {w.limit:.0e})"

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "replicas": self.replicas, "per_replica": self.per_replica,
                "sync_bn": self.sync_bn, "ok": self.ok, "summary": self.summary(),
                "max_rel": self.max_rel, "loss": self.loss, "loss_single": self.loss_single,
                "nodes": [{"name": r.name, "err": r.err, "scale": r.scale, "rel": r.rel,
                           "limit": r.limit, "zero_in_reals": r.zero_in_reals, "ok": r.ok}
                          for r in self.rows]}


def zero_in_reals(params: Mapping[str, Any]) -> set[str]:
    """Conv biases (a `.bias` beside a rank-4 `.weight`): every conv of both nets feeds BatchNorm."""
    return {k for k in params if k.endswith(".bias")
            and jnp.ndim(params.get(k[: -len("bias")] + "weight", 0)) == 4}


@functools.lru_cache(maxsize=64)
def _single_fn(net, cfg, label_smoothing: float):
    def run(params, x, targets):
        logits, saved = net.forward(params, x, cfg)
        t = targets.astype(logits.dtype)
        grads, dx = net.backward(params, saved, head.cotangent(logits, t, label_smoothing), cfg)
        hits = jnp.mean((jnp.argmax(logits, axis=1) == jnp.argmax(t, axis=1)).astype(logits.dtype))
        return head.forward(logits, t, label_smoothing), grads, dx, net.batch_stats(saved), hits
    return jax.jit(run)


def single_device(net, params, x, targets, cfg, *, label_smoothing: float = 0.0) -> ReplicaStep:
    """The rendered step on one device at the whole batch (the reference the mesh is tied to)."""
    t = _targets("parallel.single_device", targets, int(jnp.shape(x)[0]), cfg.num_classes,
                 jnp.result_type(x))
    fn = _single_fn(net, replica_config(cfg, False), float(label_smoothing))
    out = ReplicaStep(*fn(dict(params), x, t))
    return out._replace(grads={k: out.grads[k] for k in params})


def tie(net, params, x, targets, cfg, *, mesh: Mesh, sync_bn: bool = True,
        label_smoothing: float = 0.0, limit: float = REL_F64, reference=None) -> TieReport:
    """Every node of the data-parallel rendered step against the single-device rendered step at
    batch R·N: max |difference| relative to max |single device| (zero-in-ℝ nodes: to the floor).

    `reference`: a precomputed `single_device(...)` result for the same batch (it does not depend
    on the mesh, so one serves every R).
    """
    out = forward_backward(net, params, x, targets, cfg, mesh=mesh, label_smoothing=label_smoothing,
                           sync_bn=sync_bn)
    ref = reference if reference is not None else single_device(
        net, params, x, targets, cfg, label_smoothing=label_smoothing)
    g1 = {k: np.asarray(v, np.float64) for k, v in ref.grads.items()}
    gmax = max(float(np.max(np.abs(v))) for v in g1.values())
    zero = zero_in_reals(params)
    rows = []
    pairs = [(k, out.grads[k], g1[k]) for k in params] + [("input", out.dx, ref.dx)]
    for name, a, b in pairs:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(b)))
        if name in zero:
            scale = max(scale, ZERO_NODE_FLOOR * gmax)
        rows.append(NodeRow(name, float(np.max(np.abs(a - b))), scale if scale > 0 else 1.0,
                            name in zero, limit))
    replicas = replica_count(mesh)
    return TieReport(net=getattr(net, "NAME", net.__name__.rsplit(".", 1)[-1]), replicas=replicas,
                     per_replica=int(jnp.shape(x)[0]) // replicas, sync_bn=bool(sync_bn), rows=rows,
                     loss=float(out.loss), loss_single=float(ref.loss))


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


# the unit roundoff of each dtype the drift study runs in
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float64": 2.0 ** -53}
# Chan's combine: each replica's mean μ_r carries a few ulps of |μ| (u·|μ| per rounding through its
# sum); it enters σ² only through (μ_r − μ)², i.e. as 2(μ_r − μ)·δ_r ≲ 2σ·few·u|μ|, and the
# centred sums add a few u·σ². Relative to σ²: below CHAN_FACTOR·u·(1 + |μ|/σ).
CHAN_FACTOR = 4.0
# The one-round exchange subtracts two numbers of size μ² + σ², each rounded at u·μ²: relative to
# σ² its error is of order u·(μ/σ)² (6 at μ/σ = 10⁴ in float32: no correct digit left).


def chan_bound(offset: float, dtype: str = "float32") -> float:
    """The relative error Chan's combine stays under for data with mean/std = offset."""
    return CHAN_FACTOR * UNIT_ROUNDOFF[dtype] * (1.0 + abs(offset))


def one_round_scale(offset: float, dtype: str = "float32") -> float:
    """u·(μ/σ)²: the size of the E[x²] − μ² error for data with mean/std = offset."""
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
