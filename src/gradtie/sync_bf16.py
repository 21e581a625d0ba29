"""SyncBf16's exact difference: the mesh's all-reduced node against a single device's own node.

`DataParallel.SyncBf16` (`den_allReduceMeanF_convWeightGradBBf16_sub_global` and its strided peer)
states, with no bound and for any rounding rnd, the difference between the all-reduced bf16 weight
gradient G of R replicas and 1/R of the one-device bf16 node at batch R·N, at the same global
operands X, DY (replica r holding shard r of each):

    G − node_{R·N}(X, DY)/R = (1/R)·(Σ_r rnd(S_r) − rnd(Σ_r S_r)),

S_r being replica r's contraction at its rounded operands. It is two statements in one: the
all-reduce is the mean of the replicas' rounded partial sums (`…_shard`), and the one-device node
rounds their sum once (`…_global_split`). So both sides are computed apart here:

- G, from the mesh's own step (`checks.bf16.replicas.mesh_replica_sum`);
- node_{R·N}, from a single device's own run of the weight-gradient kind over the whole batch R·N,
  at the replicas' operands concatenated (one float32 contraction of R·N examples in the device's
  own order, rounded once), the statement's left-hand node;
- the statement's term, from the replicas' partial sums S_r recomputed in float64 and rnd(S_r) as
  the mesh's nodes.

The two sides agree bit for bit except where the single device's float32 contraction and the
float64 sum of the replicas' float32 partial sums land on either side of a bf16 rounding boundary: a
summation order the statement (over ℝ) does not see. Each of the two float32 sums lies within
γ_n(2⁻²⁴)·M of the exact one (M = Σ|x|·|dy| of the batch-R·N node), and each rounding moves it by at
most half a bf16 ulp, so every entry is held to (one bf16 ulp + 2·γ_n·M)/R, with the all-reduce's
own float32 rounding, and the share predicted bit for bit is reported. The controls drop a piece of
the term and must miss: without it the prediction is G = node_{R·N}/R (the rounding outside the
replica sum); without the per-replica rounding the term is (1/R)·(Σ_r S_r − rnd(Σ_r S_r)). Shown in:
Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import rendered
from .checks.bf16.kinds import U_F32, apply
from .checks.bf16.replicas import ReplicaReport
from .checks.bf16.sites import contraction_length


@dataclass(frozen=True)
class ExactRow:
    name: str                # the conv weight node
    entries: int
    same_sums: bool          # every replica's node is the recomputed rnd(S_r) bit for bit
    exact: int               # entries where G − node/R equals the statement's term bit for bit
    within: int              # entries within (one bf16 ulp + 2·γ_n(2⁻²⁴)·M)/R and the all-reduce's rounding of it
    no_term: int             # the control without the difference term: G = node/R
    no_rounding: int         # the control without the per-replica rounding: term (1/R)·(Σ_r S_r − rnd(Σ_r S_r))
    nonzero: int             # entries where the term (1/R)(Σ_r rnd(S_r) − rnd(Σ_r S_r)) is not 0


@dataclass
class ExactReport:
    net: str
    replicas: int
    rows: list[ExactRow]

    def at(self, same_sums: bool) -> list[ExactRow]:
        return [r for r in self.rows if r.same_sums == same_sums]

    @property
    def exact(self) -> bool:
        """Every entry of every node within the summation-order bound of the statement's term, and
        at least 99 % of them bit for bit."""
        return all(r.within == r.entries for r in self.rows) and self.share("exact") >= 0.99

    @property
    def controls_red(self) -> bool:
        """Each control fails the verdict at every node: it predicts G − node/R bit for bit at fewer
        than 99 % of the node's entries."""
        return all(r.no_term < 0.99 * r.entries and r.no_rounding < 0.99 * r.entries for r in self.rows)

    def share(self, field: str, rows=None) -> float:
        rows = self.rows if rows is None else rows
        return sum(getattr(r, field) for r in rows) / max(sum(r.entries for r in rows), 1)

    def summary(self) -> str:
        return (f"{self.net}, R = {self.replicas}: G − node_(R·N)/R equals the statement's term bit for bit at "
                f"{self.share('exact'):.2%} of the entries, within the summation-order bound at "
                f"{sum(r.within == r.entries for r in self.rows)}/{len(self.rows)} nodes; controls: without the "
                f"difference term {self.share('no_term'):.1%} of entries, without the per-replica rounding "
                f"{self.share('no_rounding'):.1%}")

    def table(self) -> str:
        head = (f"{'node':<30} {'entries':>8} {'shared sums':>11} {'exact':>8} {'bounded':>8} {'no term':>8} "
                f"{'no rnd':>8} {'F ≠ 0':>7}")
        return "\n".join([head, "-" * len(head)] + [
            f"{r.name + '.weight':<30} {r.entries:>8} {'yes' if r.same_sums else 'no':>11} {r.exact / r.entries:8.2%} "
            f"{r.within / r.entries:8.2%} {r.no_term / r.entries:8.2%} {r.no_rounding / r.entries:8.2%} "
            f"{r.nonzero / r.entries:7.1%}" for r in self.rows])


@partial(jax.jit, static_argnums=(2, 3, 4), compiler_options={**rendered.QUICK, **rendered.EXACT_ROUNDING})
def _single_device_node(x, dy, stride: int, kernel_size: int, rnd):
    """The bf16 weight-gradient kind over the whole batch on one device: one float32 contraction of
    every example at the rounded operands, rounded once (the formulation by the kit's shape rule)."""
    return apply("grad_weight", x, dy, stride=stride, out_shape=(dy.shape[1], x.shape[1], kernel_size, kernel_size),
                 rnd=rnd)


def _ulp_bf16(v: np.ndarray) -> np.ndarray:
    """The spacing of bf16 values at |v| (2⁻⁷ of its binade; the smallest normal spacing at 0)."""
    a = np.abs(v)
    e = np.floor(np.log2(np.where(a > 0, a, 2.0 ** -126)))
    return 2.0 ** (e - 7)


def exact_difference(replica_report: ReplicaReport, rnd) -> ExactReport:
    """SyncBf16's difference, node by node: G (the mesh's) − node_{R·N}/R (a single device's own run
    of the kind at the replicas' operands concatenated, under `rnd`, the nets' rounding) against the
    statement's term from the replicas' partial sums (`checks.bf16.replicas.mesh_replica_sum`'s
    report: its arrays G, Σ_r S_r, the term, rnd(Σ_r S_r), the operands)."""
    rep, rows = replica_report, []
    if rep.replicas != 2:
        raise ValueError(f"exact_difference: the float32 all-reduce rounds once only at R = 2, got R = {rep.replicas}")
    r_ = rep.replicas
    for row in rep.rows:
        a = rep.arrays[row.name]
        node = np.asarray(_single_device_node(jnp.asarray(a["x"]), jnp.asarray(a["dy"]), row.stride,
                                              row.kernel_size, rnd), np.float64)
        lhs = a["g"] - node / r_
        term = a["formula"]
        n = contraction_length("grad_weight", a["x"].shape, a["dy"].shape, row.kernel_size)   # batch R·N
        order = 2 * n * U_F32 / (1 - n * U_F32) * a["mag"]          # 2·γ_n·M_(R·N)/R: a["mag"] is M over R
        reduce_bound = (r_ - 1) * U_F32 * np.abs(a["replica_rounded"]) / r_
        ulp = np.maximum(_ulp_bf16(node), _ulp_bf16(a["rounded_sum"]))
        within = np.abs(lhs - term) <= ulp / r_ + order + reduce_bound
        no_rounding = (a["sum"] - a["rounded_sum"]) / r_
        rows.append(ExactRow(row.name, int(lhs.size), row.nodes_rounded, int(np.sum(lhs == term)), int(np.sum(within)),
                             int(np.sum(lhs == 0)), int(np.sum(lhs == no_rounding)), int(np.sum(term != 0))))
    return ExactReport(rep.net, rep.replicas, rows)
