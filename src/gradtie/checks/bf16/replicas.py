"""Replica sums: the all-reduced bf16 weight gradient is (1/R)·Σ_r rnd(S_r), not rnd(Σ_r S_r)/R.

Replica r runs the weight-gradient kind on its own shard (its cotangent R times its share of the
one-device one): its node is rnd(S_r), S_r the float32 contraction at its rounded operands, and the
all-reduce averages the nodes. The difference from rnd(Σ_r S_r)/R is exactly (1/R)[Σ_r rnd(S_r) −
rnd(Σ_r S_r)]: at most 2u·M, and 0 at the identity rounding. Lean: `DataParallel.SyncBf16` (on the
mesh step: `ResNet34SyncStepTieB` at the bf16 flag). Shown in: bf16 erasure, Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ... import kit as kit_
from ... import parallel, rendered
from ...nets.layers import rounding
from ...ops import conv
from ..tie import Chain, need_x64, targets_matrix
from .kinds import U_BF16, U_F32, Site
from .sites import contraction_length, node_bound, recorded, same_computation


@dataclass(frozen=True)
class ReplicaRow:
    name: str               # the conv's layer name: "conv1", "layer2.0.downsample.0"
    replicas: int
    stride: int
    kernel_size: int
    nodes_rounded: bool     # every replica's node == rnd(S_r), bit for bit
    equal_required: bool    # the kind and the reference run the same sums (`sites.same_computation`)
    reduce_ratio: float     # max |G − mean_r node_r| over the float32 all-reduce's bound (≤ 1)
    formula_ratio: float    # max |(G − rnd(Σ_r S_r)/R) − formula| over the same bound (≤ 1)
    max_diff_rel: float     # max |formula| / M: ≤ 2u
    differing: float        # fraction of entries where G ≠ rnd(Σ_r S_r)/R (the formula is nonzero)
    identity_zero: bool     # at rnd = identity every replica's kind is S_r bit for bit: formula 0
    control_ratio: float    # the control: the formula check with G replaced by rnd(Σ_r S_r)/R (> 1: red)
    node_ratio: float       # max_r |node_r − exact_r| / (node_bound(n)·M_r): the bound B(n) per node (≤ 1)

    @property
    def ok(self) -> bool:
        return bool((self.nodes_rounded or not self.equal_required) and self.node_ratio <= 1
                    and self.reduce_ratio <= 1 and self.formula_ratio <= 1 and self.max_diff_rel <= 2 * U_BF16
                    and self.identity_zero)


@dataclass
class ReplicaReport:
    net: str
    replicas: int
    per_replica: int
    rows: list[ReplicaRow]
    # name -> {"diff", "formula", "mag", "g": G, "sum": Σ_r S_r, "replica_rounded": Σ_r rnd(S_r),
    # "rounded_sum": rnd(Σ_r S_r)}, each float64; "x", "dy": the replicas' operands, concatenated
    # along the batch (float32: the global operands of `SyncBf16`'s batch-R·N node)
    arrays: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def control_red(self) -> bool:
        """Had the all-reduce returned rnd(Σ_r S_r)/R, the formula check would fail."""
        return any(r.control_ratio > 1 for r in self.rows)

    def summary(self) -> str:
        req, n = [r for r in self.rows if r.equal_required], len(self.rows)
        return (f"{self.net}, R = {self.replicas} × N = {self.per_replica}, bf16 flag, sync BN: "
                f"{sum(r.ok for r in self.rows)}/{n} weight-gradient nodes are (1/R)·Σ_r rnd(S_r); "
                f"replica nodes rnd(S_r) bit for bit at {sum(r.nodes_rounded for r in req)}/{len(req)} sites "
                f"that run the reference's sums; the all-reduced node differs from rnd(Σ_r S_r)/R at "
                f"{sum(r.differing > 0 for r in self.rows)}/{n} nodes; identity rounding: difference 0 at "
                f"{sum(r.identity_zero for r in self.rows)}/{n}")

    def table(self) -> str:
        head = (f"{'node':<28} {'s':>1} {'k':>1} {'rnd(S_r) bitwise':>16} {'node/B(n)':>9} {'all-reduce/bound':>16} "
                f"{'formula/bound':>13} {'|F|/M ≤ 2u':>10} {'differing':>9} {'id 0':>5}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            bit = ("yes" if r.nodes_rounded else "NO") if r.equal_required else ("(yes)" if r.nodes_rounded else "n/a")
            lines.append(f"{r.name + '.weight':<28} {r.stride:>1} {r.kernel_size:>1} {bit:>16} {r.node_ratio:9.3f} "
                         f"{r.reduce_ratio:16.2f} {r.formula_ratio:13.2f} {r.max_diff_rel / (2 * U_BF16):10.3f} "
                         f"{r.differing:9.1%} {'yes' if r.identity_zero else 'NO':>5}")
        return "\n".join(lines)


MeshReplicaReport = ReplicaReport   # the Data-parallel chapter's name


@partial(jax.jit, static_argnums=1, compiler_options=rendered.QUICK)
def _shard_numbers(s: Site, rnd):
    """A weight-gradient site split over replicas (a [R,n,…], b [R,n,…]): per replica, its kind's
    `Site.numbers` under rnd and at the identity rounding (whose S is the f32 peer), stacked."""
    out = [(r.numbers(rnd), r.numbers(conv.identity)) for r in (replace(s, a=x, b=dy) for x, dy in zip(s.a, s.b))]
    return jax.tree.map(lambda *a: jnp.stack(a), *out)


def _row(s: Site, rnd, g=None) -> tuple[ReplicaRow, dict]:
    """A weight-gradient site split over R replicas (a, b, node [R,…]; node None: the replicas' kinds)
    against g, the all-reduced node (None: the nodes' exact mean), in float64: R values add exactly.

    The formula's rnd(S_r) are the replica nodes, what the step did: where the kind sums in its own
    order (patches · weights with bf16-typed operands) rnd(S_r) recomputed in the reference's order
    may sit a bf16 ulp from the node, which no all-reduce rounding explains. The nodes themselves are
    held to rnd(S_r) bit for bit where the sums agree (`same_computation`), and each to the B(n)
    bound against its exact value everywhere."""
    num, ident = jax.tree.map(lambda a: np.asarray(a, np.float64), _shard_numbers(replace(s, node=None), rnd))
    replicas = len(s.a)
    nodes = num["kind"] if s.node is None else np.asarray(s.node, np.float64)
    g = nodes.mean(0) if g is None else np.asarray(g, np.float64)
    rnd64 = conv.identity if rnd is conv.identity else conv.round_bf16            # rnd on float64 values
    rounded = np.asarray(rnd64(jnp.asarray(num["s"])))                            # rnd(S_r)
    rounded_sum = np.asarray(rnd64(jnp.asarray(num["s"].sum(0))))                 # rnd(Σ_r S_r)
    formula = (nodes.sum(0) - rounded_sum) / replicas                             # rnd(S_r): the step's nodes
    bound = (replicas - 1) * U_F32 * np.abs(nodes).sum(0) / replicas              # the all-reduce's rounding
    m = num["mag"].sum(0) / replicas                                              # M of the node G
    live = m > 0

    def ratio(err):
        over = np.where(bound > 0, err / np.where(bound > 0, bound, 1), np.where(err > 0, np.inf, 0.0))
        return float(over.max(initial=0.0))

    n = contraction_length("grad_weight", s.a.shape[1:], s.b.shape[1:], s.kernel_size)   # per replica
    err, mag_r = np.abs(nodes - num["exact"]), num["mag"]
    node_over = np.where(mag_r > 0, err / np.where(mag_r > 0, mag_r * node_bound(n), 1), np.where(err > 0, np.inf, 0.0))
    diff = g - rounded_sum / replicas
    row = ReplicaRow(s.name, replicas, s.stride, s.kernel_size, bool(np.array_equal(nodes, rounded)),
                     same_computation(replace(s, a=s.a[0], b=s.b[0]), rnd),
                     ratio(np.abs(g - nodes.mean(0))), ratio(np.abs(diff - formula)),
                     float((np.abs(formula[live]) / m[live]).max(initial=0.0)), float(np.mean(formula != 0)),
                     bool(np.array_equal(ident["kind"], ident["s"])), ratio(np.abs(formula)),
                     float(node_over.max(initial=0.0)))
    return row, {"diff": diff, "formula": formula, "mag": m, "g": g, "sum": num["s"].sum(0),  # float64, exact
                 "replica_rounded": rounded.sum(0), "rounded_sum": rounded_sum,
                 "x": np.asarray(s.a).reshape((-1,) + tuple(s.a.shape[2:])),
                 "dy": np.asarray(s.b).reshape((-1,) + tuple(s.b.shape[2:]))}


def _report(net: str, replicas: int, split: list[Site], rnd, grads=None) -> ReplicaReport:
    """Rows of the split weight-gradient sites; grads: the all-reduced nodes (None: exact means)."""
    rows = [_row(s, rnd, None if grads is None else grads[f"{s.name}.weight"]) for s in split]
    return ReplicaReport(net, replicas, split[0].a.shape[1] if split else 0, [r for r, _ in rows],
                         {r.name: a for r, a in rows})


def replica_rows(sites: list[Site], replicas: int, rnd, net: str = "net") -> ReplicaReport:
    """Every weight-gradient site of a one-device chain split by hand into R equal shards: replica r
    holds x's rows r·n … (r+1)·n − 1 and R times its share of dy; the all-reduce is their exact mean."""
    need_x64("the replica sum")
    if sites and (replicas < 1 or sites[0].a.shape[0] % replicas):
        raise ValueError(f"replica sum: batch {sites[0].a.shape[0]} does not split into {replicas} equal shards")
    first = {s.name: i for i, s in reversed(list(enumerate(sites)))}      # forward order
    split = lambda a: np.asarray(a).reshape((replicas, -1) + a.shape[1:])   # noqa: E731
    return _report(net, replicas, [replace(s, a=split(s.a), b=replicas * split(s.b), node=None) for s in sorted(
        (s for s in sites if s.op == "grad_weight"), key=lambda s: first[s.name])], rnd)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), compiler_options=rendered.QUICK)
def _mesh_sites(net, kit, cfg, mesh, alpha, params, x, t):
    """The data-parallel rendered step on `mesh` (synchronised BN) with every weight-gradient kind's
    operands and node read per replica through a recording kit (concatenated on axis 0)."""
    def body(p, x_, t_):
        log: list = []
        step = parallel.replica_step(net, kit_.recording(kit, log, ("conv_grad_weight",)), cfg, alpha, True,
                                     parallel.replica_count(mesh), False)
        return step(p, x_, t_)[1], recorded(log)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(parallel.AXIS), P(parallel.AXIS)),
                         out_specs=(P(), P(parallel.AXIS)))(params, x, t)


def mesh_replica_sum(net, params, x, targets, cfg, *, mesh, chain: Optional[Chain] = None,
                     label_smoothing: float = 0.0) -> ReplicaReport:
    """SyncBf16 on a mesh: every conv weight node of the data-parallel bf16 step (cfg.bf16; the
    chain's kit, default the real one), each replica's operands and node read through a recording
    kit. The all-reduce sums R float32 values: the identities hold up to its rounding, at most
    (R − 1)·2⁻²⁴·(1/R)Σ_r|node_r| per entry (in practice 0)."""
    need_x64("the replica sum")
    if not cfg.bf16:
        raise ValueError("mesh_replica_sum: cfg.bf16 must be True (the SyncBf16 statement is about the bf16 kinds)")
    chain, replicas = chain or Chain(net), parallel.replica_count(mesh)
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    grads, sites = _mesh_sites(chain.net, chain.kit, cfg, mesh, float(label_smoothing), dict(params), x, t)
    split = lambda a: np.asarray(a).reshape((replicas, -1) + a.shape[1:])   # noqa: E731
    order = list(params)
    return _report(chain.label, replicas,
                   sorted((replace(s, a=split(s.a), b=split(s.b), node=split(s.node)) for s in sites),
                          key=lambda s: order.index(f"{s.name}.weight")), rounding(cfg), grads)
