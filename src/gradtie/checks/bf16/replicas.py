"""Replica sums: the all-reduced bf16 weight gradient is (1/R)·Σ_r rnd(S_r), not rnd(Σ_r S_r)/R.

Each of R replicas runs the weight-gradient kind on its own N examples, with its own cotangent (R
times its share of the single-device one, since it divides by its own N): its node is rnd(S_r), S_r
the float32 contraction at its rounded operands, and the all-reduce averages those nodes. The
difference from rnd(Σ_r S_r)/R is exactly (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)], at most 2u·M (each of
the R + 1 roundings moves a value by at most u of its size), and 0 at the identity rounding. Lean:
`DataParallel.SyncBf16`. `replica_rows` splits one device's weight-gradient sites into shards by
hand; `mesh_replica_sum` reads every replica's operands and node from the data-parallel bf16 step
itself, on a device mesh, through a recording kit (Lean: `ResNet34SyncStepTieB` at the bf16 flag).
Shown in: bf16 erasure, Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ... import kit as kit_
from ... import parallel, rendered
from ...nets.layers import rounding
from ...nets.protocol import as_net
from ...ops import conv
from ..tie import Chain, need_x64, targets_matrix
from .kinds import U_BF16, U_F32
from .sites import Site, same_computation


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

    @property
    def ok(self) -> bool:
        return bool((self.nodes_rounded or not self.equal_required) and self.reduce_ratio <= 1
                    and self.formula_ratio <= 1 and self.max_diff_rel <= 2 * U_BF16 and self.identity_zero)


@dataclass
class ReplicaReport:
    net: str
    replicas: int
    per_replica: int
    rows: list[ReplicaRow]
    arrays: dict = field(default_factory=dict)   # name -> {"diff", "formula", "mag"} (float64)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def control_red(self) -> bool:
        """Had the all-reduce returned rnd(Σ_r S_r)/R, the formula check would fail."""
        return any(r.control_ratio > 1 for r in self.rows)

    def summary(self) -> str:
        req = [r for r in self.rows if r.equal_required]
        n = len(self.rows)
        return (f"{self.net}, R = {self.replicas} × N = {self.per_replica}, bf16 flag, sync BN: "
                f"{sum(r.ok for r in self.rows)}/{n} weight-gradient nodes are (1/R)·Σ_r rnd(S_r); "
                f"replica nodes rnd(S_r) bit for bit at {sum(r.nodes_rounded for r in req)}/{len(req)} sites "
                f"that run the reference's sums; the all-reduced node differs from rnd(Σ_r S_r)/R at "
                f"{sum(r.differing > 0 for r in self.rows)}/{n} nodes; identity rounding: difference 0 at "
                f"{sum(r.identity_zero for r in self.rows)}/{n}")

    def table(self) -> str:
        head = (f"{'node':<26} {'s':>1} {'k':>1} {'rnd(S_r) bitwise':>16} {'all-reduce/bound':>16} "
                f"{'formula/bound':>13} {'|F|/M ≤ 2u':>10} {'differing':>9} {'id 0':>5}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            bit = ("yes" if r.nodes_rounded else "NO") if r.equal_required else ("(yes)" if r.nodes_rounded else "n/a")
            lines.append(f"{r.name + '.weight':<26} {r.stride:>1} {r.kernel_size:>1} {bit:>16} {r.reduce_ratio:16.2f} "
                         f"{r.formula_ratio:13.2f} {r.max_diff_rel / (2 * U_BF16):10.3f} {r.differing:9.1%} "
                         f"{'yes' if r.identity_zero else 'NO':>5}")
        return "\n".join(lines)


MeshReplicaRow, MeshReplicaReport = ReplicaRow, ReplicaReport   # the Data-parallel chapter's names


@partial(jax.jit, static_argnames=("kernel_size", "stride", "rnd", "formulation"), compiler_options=rendered.QUICK)
def _shard_numbers(xs, dys, *, kernel_size, stride, rnd, formulation=None):
    """Per replica r (xs [R,n,…], dys [R,n,…]): its kind's node, S_r (the float32 contraction at
    rounded operands), the identity kind and its f32 peer, and M_r = Σ|x|·|dy| (float64)."""
    gw = partial(conv.grad_weight, kernel_size=kernel_size, stride=stride, formulation=formulation)
    out = [(gw(x, dy, rnd=rnd), gw(rnd(x).astype(x.dtype), rnd(dy).astype(x.dtype)), gw(x, dy, rnd=conv.identity),
            gw(x, dy), gw(jnp.abs(x.astype(jnp.float64)), jnp.abs(dy.astype(jnp.float64))))
           for x, dy in zip(xs, dys)]
    return [jnp.stack(a) for a in zip(*out)]


def _row(name, stride, k, xs, dys, nodes, g, rnd, formulation=None) -> tuple[ReplicaRow, dict]:
    """One weight-gradient site over R replicas: nodes [R,…] the replicas' bf16 nodes, g the
    all-reduced node. Everything is compared in float64, where R bf16 and R float32 values add exactly."""
    _, s, kind_id, peer, mag = (np.asarray(a, np.float64) for a in _shard_numbers(
        jnp.asarray(xs), jnp.asarray(dys), kernel_size=k, stride=stride, rnd=rnd, formulation=formulation))
    replicas = len(xs)
    nodes, g = np.asarray(nodes, np.float64), np.asarray(g, np.float64)
    rnd64 = conv.identity if rnd is conv.identity else conv.round_bf16            # rnd on float64 values
    rounded = np.asarray(rnd64(jnp.asarray(s)))                                   # rnd(S_r)
    rounded_sum = np.asarray(rnd64(jnp.asarray(s.sum(0))))                        # rnd(Σ_r S_r)
    formula = (rounded.sum(0) - rounded_sum) / replicas
    bound = (replicas - 1) * U_F32 * np.abs(nodes).sum(0) / replicas              # the all-reduce's rounding
    m = mag.sum(0) / replicas                                                     # M of the node G
    live = m > 0

    def ratio(err):
        over = np.where(bound > 0, err / np.where(bound > 0, bound, 1), np.where(err > 0, np.inf, 0.0))
        return float(over.max(initial=0.0))

    diff = g - rounded_sum / replicas
    row = ReplicaRow(name, replicas, stride, k, bool(np.array_equal(nodes, rounded)),
                     same_computation("grad_weight", xs.shape[1:], dys.shape[1:], nodes.shape[1:], k, rnd, formulation),
                     ratio(np.abs(g - nodes.mean(0))), ratio(np.abs(diff - formula)),
                     float((np.abs(formula[live]) / m[live]).max(initial=0.0)), float(np.mean(formula != 0)),
                     bool(np.array_equal(kind_id, peer)), ratio(np.abs(formula)))
    return row, {"diff": diff, "formula": formula, "mag": m}


def replica_rows(sites: list[Site], replicas: int, rnd, net: str = "net") -> ReplicaReport:
    """Every weight-gradient site of a one-device chain split by hand into R equal shards: replica r
    holds x's rows r·n … (r+1)·n − 1 and R times its share of dy; the all-reduce is their exact mean."""
    need_x64("the replica sum")
    rows, arrays = [], {}
    first = {s.name: i for i, s in reversed(list(enumerate(sites)))}      # forward order
    for s in sorted((s for s in sites if s.op == "grad_weight"), key=lambda s: first[s.name]):
        if replicas < 1 or s.a.shape[0] % replicas:
            raise ValueError(f"replica sum: batch {s.a.shape[0]} does not split into {replicas} equal shards")
        xs = np.asarray(s.a).reshape((replicas, -1) + s.a.shape[1:])
        dys = replicas * np.asarray(s.b).reshape((replicas, -1) + s.b.shape[1:])
        nodes = _shard_numbers(jnp.asarray(xs), jnp.asarray(dys), kernel_size=s.kernel_size, stride=s.stride,
                               rnd=rnd, formulation=s.formulation)[0]
        nodes = np.asarray(nodes, np.float64)
        row, arrays[s.name] = _row(s.name, s.stride, s.kernel_size, xs, dys, nodes, nodes.mean(0), rnd, s.formulation)
        rows.append(row)
    per = sites[0].a.shape[0] // replicas if sites else 0
    return ReplicaReport(net, replicas, per, rows, arrays)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), compiler_options=rendered.QUICK)
def _mesh_sites(net, kit, cfg, mesh, alpha, params, x, t):
    """The data-parallel rendered step on `mesh` (synchronised BN) with every weight-gradient kind's
    operands and node read per replica through a recording kit."""
    replicas = parallel.replica_count(mesh)

    def body(p, x_, t_):
        log: list = []
        step = parallel.replica_step(net, kit_.recording(kit, log, ("conv_grad_weight",)), cfg, alpha, True,
                                     replicas, False)
        _, grads, _, _, _ = step(p, x_, t_)
        return grads, {(i, c.args[0], c.kwargs.get("stride", 1), c.kwargs["kernel_size"], c.kwargs.get("formulation")):
                       (c.args[1], c.args[2], c.out[None]) for i, c in enumerate(log)}

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(parallel.AXIS), P(parallel.AXIS)),
                         out_specs=(P(), P(parallel.AXIS)))(params, x, t)


def mesh_replica_sum(net, params, x, targets, cfg, *, mesh, chain: Optional[Chain] = None,
                     label_smoothing: float = 0.0) -> ReplicaReport:
    """SyncBf16 on a mesh: every conv weight node of the data-parallel bf16 step (cfg.bf16; the
    chain's kit, default the real one) against (1/R)·Σ_r rnd(S_r), S_r the float32 contraction of
    replica r's own rounded operands, and its distance from rnd(Σ_r S_r)/R, which is exactly
    (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)]. The all-reduce sums R float32 values: the identities hold up
    to its rounding, at most (R − 1)·2⁻²⁴·(1/R)Σ_r|node_r| per entry (in practice 0)."""
    need_x64("the replica sum")
    net = as_net(net)
    if not cfg.bf16:
        raise ValueError("mesh_replica_sum: cfg.bf16 must be True (the SyncBf16 statement is about the bf16 kinds)")
    chain = chain or Chain(net)
    rnd = rounding(cfg)
    replicas = parallel.replica_count(mesh)
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    grads, recorded = _mesh_sites(chain.net, chain.kit, cfg, mesh, float(label_smoothing), dict(params), x, t)

    def shards(a):
        a = np.asarray(a)
        return a.reshape((replicas, a.shape[0] // replicas) + a.shape[1:])
    rows, arrays = [], {}
    for (_, name, stride, k, form), (xs, dys, nodes) in sorted(recorded.items(), key=lambda kv: kv[0][0]):
        row, arrays[name] = _row(name, stride, k, shards(xs), shards(dys), nodes, grads[f"{name}.weight"], rnd, form)
        rows.append(row)
    order = {k: i for i, k in enumerate(params)}
    rows.sort(key=lambda r: order[f"{r.name}.weight"])
    return ReplicaReport(chain.label, replicas, int(x.shape[0]) // replicas, rows, arrays)
