"""Replica sums: the all-reduced bf16 weight gradient is (1/R)·Σ_r rnd(S_r), not rnd(Σ_r S_r)/R.

The difference is exactly (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)], at most 2u·M, and 0 at the identity
rounding. Lean: `DataParallel.SyncBf16` (what the bf16 weight-gradient kinds do under sharding).
`replica_sum` splits one device's operands into shards by hand; `mesh_replica_sum` reads them from
the data-parallel bf16 step itself, running on a device mesh. Shown in: bf16 erasure, Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ...ops import conv
from .kinds import QUICK, U_BF16, U_F32, _need_x64, _widen
from .sites import Site


@dataclass(frozen=True)
class ReplicaRow:
    name: str
    replicas: int
    nodes_rounded: bool      # each replica's bf16 node is rnd(S_r), bit for bit (the kind's identity)
    max_diff_rel: float      # max |mean_r rnd(S_r) − rnd(Σ_r S_r)/R| / M (M: the node's magnitude sum)
    differing: float         # fraction of entries where the two differ
    identity_zero: bool      # at rnd = identity the difference is exactly 0

    @property
    def ok(self) -> bool:
        """The difference (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)] is at most (1/R)(u·Σ_r|S_r| + u·|Σ_r S_r|)
        ≤ 2u·M: each of the R + 1 roundings moves a value by at most u of its size."""
        return bool(self.nodes_rounded and self.identity_zero and self.max_diff_rel <= 2 * U_BF16)


@partial(jax.jit, static_argnames=("kernel_size", "stride", "replicas", "rnd"), compiler_options=QUICK)
def _replica_nodes(x, dy, *, kernel_size, stride, replicas, rnd):
    """Per replica r: its bf16 weight-gradient node and S_r, its float32 contraction at rounded
    operands. The batch splits into R equal shards; a replica divides its loss by its own N, so its
    cotangent is R times its shard of the single-device one."""
    m = x.shape[0] // replicas
    nodes, partials = [], []
    for r in range(replicas):
        xr, dyr = x[r * m:(r + 1) * m], replicas * dy[r * m:(r + 1) * m]
        nodes.append(conv.grad_weight(xr, dyr, kernel_size=kernel_size, stride=stride, rnd=rnd))
        partials.append(conv.grad_weight(_widen(rnd(xr), x.dtype), _widen(rnd(dyr), x.dtype),
                                         kernel_size=kernel_size, stride=stride))
    mag = conv.grad_weight(jnp.abs(x.astype(jnp.float64)), jnp.abs(dy.astype(jnp.float64)),
                           kernel_size=kernel_size, stride=stride)
    return jnp.stack(nodes), jnp.stack(partials), mag


def replica_difference(x, dy, *, kernel_size: int, stride: int, replicas: int, rnd) -> dict[str, np.ndarray]:
    """The all-reduced bf16 weight gradient mean_r rnd(S_r) against rnd(Σ_r S_r)/R, in float64,
    where R bf16 values and R float32 values sum exactly."""
    _need_x64("the replica sum")
    if replicas < 1 or x.shape[0] % replicas:
        raise ValueError(f"replica sum: batch {x.shape[0]} does not split into {replicas} equal shards")
    nodes, partials, mag = _replica_nodes(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=rnd)
    rnd64 = conv.identity if rnd is conv.identity else conv.round_bf16   # rnd on float64 values
    nodes, s = np.asarray(nodes, np.float64), np.asarray(partials, np.float64)
    rounded = np.asarray(rnd64(jnp.asarray(s)))                       # rnd(S_r)
    mean_of_rounded = nodes.sum(0) / replicas                          # what the all-reduce returns
    rounded_of_sum = np.asarray(rnd64(jnp.asarray(s.sum(0)))) / replicas
    return {"nodes": nodes, "rounded": rounded, "mean_of_rounded": mean_of_rounded,
            "rounded_of_sum": rounded_of_sum, "diff": mean_of_rounded - rounded_of_sum,
            "formula": (rounded.sum(0) - np.asarray(rnd64(jnp.asarray(s.sum(0))))) / replicas,
            "mag": np.asarray(mag)}


def replica_sum(name: str, x, dy, *, kernel_size: int, stride: int, replicas: int, rnd=conv.round_bf16):
    """One weight-gradient site split over R replicas -> (ReplicaRow, the arrays under `rnd`)."""
    d = replica_difference(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=rnd)
    d_id = replica_difference(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=conv.identity)
    live = d["mag"] > 0
    rel = np.abs(d["diff"][live]) / d["mag"][live]
    row = ReplicaRow(name, replicas, bool(np.array_equal(d["nodes"], d["rounded"])), float(rel.max(initial=0.0)),
                     float(np.mean(d["diff"] != 0)), bool(np.all(d_id["diff"] == 0)))
    return row, d


def replica_rows(sites: list[Site], replicas: int, rnd) -> tuple[list[ReplicaRow], dict[str, dict]]:
    """Every weight-gradient site of a net, split over R replicas."""
    rows, arrays = [], {}
    for s in sites:
        if s.op == "grad_weight":
            row, arrays[s.name] = replica_sum(s.name, s.a, s.b, kernel_size=s.kernel_size, stride=s.stride,
                                              replicas=replicas, rnd=rnd)
            rows.append(row)
    return rows, arrays



# ---- on a mesh: the data-parallel bf16 step itself ------------------------------------------------
#
# The rows above split one device's operands into shards by hand. Below, the replicas are real: the
# data-parallel rendered step (synchronised BatchNorm, the bf16 flag on) runs on a device mesh, each
# replica's weight-gradient kinds see the operands its own chain hands them (its N examples and a
# cotangent R times its share, since each replica divides by its own N), and the all-reduce averages
# the rounded nodes in float32. Lean: `ResNet34SyncStepTieB` at the bf16 flag, `DataParallel.SyncBf16`.

@dataclass(frozen=True)
class MeshReplicaRow:
    name: str               # the conv's parameter prefix: "conv1", "layer2.0.downsample.0"
    replicas: int
    stride: int
    kernel_size: int
    nodes_rounded: bool     # every replica's node == rnd(S_r), bit for bit
    equal_required: bool    # the kind and the reference run the same sums (`sites.same_computation`)
    reduce_ratio: float     # max |G − mean_r node_r| over the float32 all-reduce's bound (≤ 1)
    formula_ratio: float    # max |(G − rnd(Σ_r S_r)/R) − formula| over the same bound (≤ 1)
    max_diff_rel: float     # max |formula| / M: ≤ 2u (each of the R + 1 roundings moves ≤ u of its size)
    differing: float        # fraction of entries where G ≠ rnd(Σ_r S_r)/R (the formula is nonzero)
    identity_zero: bool     # at rnd = identity every replica's kind is S_r bit for bit: formula 0
    control_ratio: float    # the control: the formula check with G replaced by rnd(Σ_r S_r)/R (> 1: red)

    @property
    def ok(self) -> bool:
        return bool((self.nodes_rounded or not self.equal_required) and self.reduce_ratio <= 1
                    and self.formula_ratio <= 1 and self.max_diff_rel <= 2 * U_BF16 and self.identity_zero)


@dataclass
class MeshReplicaReport:
    net: str
    replicas: int
    per_replica: int
    rows: list[MeshReplicaRow]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def differing(self) -> float:
        """Fraction of all weight-gradient entries where the all-reduced node is not rnd(Σ_r S_r)/R."""
        return float(np.mean([r.differing for r in self.rows]))

    def summary(self) -> str:
        req = [r for r in self.rows if r.equal_required]
        return (f"{self.net}, R = {self.replicas} × N = {self.per_replica}, bf16 flag, sync BN: "
                f"{sum(r.ok for r in self.rows)}/{len(self.rows)} weight-gradient nodes are (1/R)·Σ_r rnd(S_r); "
                f"replica nodes rnd(S_r) bit for bit at {sum(r.nodes_rounded for r in req)}/{len(req)} sites "
                f"that run the reference's sums; the all-reduced node differs from rnd(Σ_r S_r)/R at "
                f"{sum(r.differing > 0 for r in self.rows)}/{len(self.rows)} nodes; identity rounding: "
                f"difference 0 at {sum(r.identity_zero for r in self.rows)}/{len(self.rows)}")

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

    @property
    def control_red(self) -> bool:
        """Had the all-reduce returned rnd(Σ_r S_r)/R, the formula check would fail."""
        return any(r.control_ratio > 1 for r in self.rows)


_MESH_RUNS: dict = {}   # (net, cfg, mesh, α) -> (the jitted logged mesh step, the statics its trace read)


def mesh_weight_sites(net, params, x, targets, cfg, *, mesh, label_smoothing: float = 0.0):
    """The data-parallel rendered step on `mesh` (synchronised BN) with every weight-gradient kind's
    operands and node read per replica -> (all-reduced grads, [(name, stride, k, x [R,n,…], dy [R,n,…],
    node [R,O,C,k,k])])."""
    from ... import parallel
    from .sites import _logged_convs, _site_names
    replicas = parallel.replica_count(mesh)
    key = (net, cfg, mesh, float(label_smoothing))
    if key not in _MESH_RUNS:
        step = parallel.replica_step(net, cfg, float(label_smoothing), True, replicas, with_dx=False)
        statics: list = []

        def body(p, x_, t_):
            log: list = []
            with _logged_convs(log):
                _, grads, _, _, _ = step(p, x_, t_)
            picked = [(name, entry) for name, entry in zip(_site_names(log, p), log) if entry[0] == "grad_weight"]
            statics[:] = [(name, e[5], e[6]) for name, e in picked]
            return grads, [e[1] for _, e in picked], [e[2] for _, e in picked], [e[4][None] for _, e in picked]

        sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(parallel.AXIS), P(parallel.AXIS)),
                                out_specs=(P(), P(parallel.AXIS), P(parallel.AXIS), P(parallel.AXIS)))
        _MESH_RUNS[key] = (jax.jit(sharded, compiler_options=QUICK), statics)
    run, statics = _MESH_RUNS[key]
    t = parallel._targets("mesh_weight_sites", targets, int(x.shape[0]), cfg.num_classes, x.dtype)
    grads, xs, dys, nodes = run(dict(params), x, t)

    def shards(a):
        a = np.asarray(a)
        return a.reshape((replicas, a.shape[0] // replicas) + a.shape[1:])

    return grads, [(name, stride, k, shards(a), shards(b), np.asarray(node))
                   for (name, stride, k), a, b, node in zip(statics, xs, dys, nodes)]


@partial(jax.jit, static_argnames=("kernel_size", "stride", "rnd"), compiler_options=QUICK)
def _shard_numbers(xs, dys, *, kernel_size, stride, rnd):
    """Per replica r (xs [R,n,…], dys [R,n,…]): S_r, the float32 contraction at rounded operands;
    the identity kind and its f32 peer; and M_r = Σ|x|·|dy| (float64)."""
    statics = dict(kernel_size=kernel_size, stride=stride)
    s, kind_id, peer, mag = [], [], [], []
    for r in range(xs.shape[0]):
        x, dy = xs[r], dys[r]
        s.append(conv.grad_weight(_widen(rnd(x), x.dtype), _widen(rnd(dy), x.dtype), **statics))
        kind_id.append(conv.grad_weight(x, dy, rnd=conv.identity, **statics))
        peer.append(conv.grad_weight(x, dy, **statics))
        mag.append(conv.grad_weight(jnp.abs(x.astype(jnp.float64)), jnp.abs(dy.astype(jnp.float64)), **statics))
    return jnp.stack(s), jnp.stack(kind_id), jnp.stack(peer), jnp.stack(mag)


def mesh_replica_sum(net, params, x, targets, cfg, *, mesh, label_smoothing: float = 0.0) -> MeshReplicaReport:
    """SyncBf16 on a mesh: every conv weight node of the data-parallel bf16 step (cfg.bf16) against
    (1/R)·Σ_r rnd(S_r), S_r the float32 contraction of replica r's own rounded operands, and its
    distance from rnd(Σ_r S_r)/R, which is exactly (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)] (what one
    device would compute at R·N for R a power of two: its cotangent is 1/R of each replica's).

    The all-reduce sums R float32 values: the identities hold up to its rounding, at most
    (R − 1)·2⁻²⁴·(1/R)Σ_r|node_r| per entry (in practice 0: R bf16 values sum exactly)."""
    from ...nets.stages import rounding
    from .sites import same_computation
    _need_x64("the replica sum")
    if not cfg.bf16:
        raise ValueError("mesh_replica_sum: cfg.bf16 must be True (the SyncBf16 statement is about the bf16 kinds)")
    rnd = rounding(cfg)
    rnd64 = conv.identity if rnd is conv.identity else conv.round_bf16      # rnd on float64 values
    grads, site_list = mesh_weight_sites(net, params, x, targets, cfg, mesh=mesh, label_smoothing=label_smoothing)
    replicas = len(site_list[0][3]) if site_list else 1
    rows = []
    for name, stride, k, xs, dys, nodes in site_list:
        s, kind_id, peer, mag = (np.asarray(a, np.float64) for a in
                                 _shard_numbers(jnp.asarray(xs), jnp.asarray(dys), kernel_size=k, stride=stride, rnd=rnd))
        g = np.asarray(grads[f"{name}.weight"], np.float64)
        nodes = nodes.astype(np.float64)
        rounded = np.asarray(rnd64(jnp.asarray(s)))                               # rnd(S_r)
        rounded_sum = np.asarray(rnd64(jnp.asarray(s.sum(0))))                    # rnd(Σ_r S_r)
        formula = (nodes.sum(0) - rounded_sum) / replicas
        bound = (replicas - 1) * U_F32 * np.abs(nodes).sum(0) / replicas          # the all-reduce's rounding
        m = mag.sum(0) / replicas                                                 # M of the node G
        live = m > 0

        def ratio(err):
            over = np.where(bound > 0, err / np.where(bound > 0, bound, 1), np.where(err > 0, np.inf, 0.0))
            return float(over.max(initial=0.0))

        rows.append(MeshReplicaRow(
            name, replicas, stride, k, bool(np.array_equal(nodes, rounded)),
            same_computation("grad_weight", xs.shape[1:], dys.shape[1:], nodes.shape[1:], k, rnd),
            ratio(np.abs(g - nodes.mean(0))), ratio(np.abs((g - rounded_sum / replicas) - formula)),
            float((np.abs(formula[live]) / m[live]).max(initial=0.0)), float(np.mean(formula != 0)),
            bool(np.array_equal(kind_id, peer)), ratio(np.abs(formula))))
    order = {k: i for i, k in enumerate(params)}
    rows.sort(key=lambda r: order[f"{r.name}.weight"])
    return MeshReplicaReport(getattr(net, "NAME", "net"), replicas, int(x.shape[0]) // max(replicas, 1), rows)
